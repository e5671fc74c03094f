"""The README's client examples run as written against a real cluster.

The rule: every fenced ``python`` block that sits right under a line starting
with ``<!-- readme-test: cluster`` in README.md runs as a script of its own, in
a fresh interpreter, with the master address of ``kvstore cluster up``
(``127.0.0.1:50051``) replaced by the test cluster's. Each block runs twice, so
that an example that stores what it misses also takes its load path, and must
leave a key in that cluster (which shows it used the address it was given). A
block that promises its output with a comment ``# run it twice: <output>`` must
print that output on its second run. Other
python blocks (the node store's, which writes under /var/lib, and the engines',
which need a model) are not run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore_cli.cluster import LocalCluster

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MARKER = "<!-- readme-test: cluster"
MASTER = "127.0.0.1:50051"
TOKEN = "readme-token"


def cluster_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, code) of every ``python`` block right under a marker line."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if not line.startswith(MARKER):
            continue
        assert lines[i + 1 : i + 2] == ["```python"], f"README.md:{i + 1}: the marker must sit right above ```python"
        end = lines.index("```", i + 2)
        blocks.append((i + 3, "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks


BLOCKS = cluster_blocks(README.read_text())


def test_the_readme_marks_its_client_examples() -> None:
    assert BLOCKS, f"no ```python block under a {MARKER!r} line in README.md"
    for line, code in BLOCKS:
        assert MASTER in code, f"README.md:{line}: a cluster example connects to {MASTER} (kvstore cluster up)"


def test_the_marker_rule_finds_exactly_the_marked_blocks() -> None:
    text = "```python\nskipped()\n```\n<!-- readme-test: cluster -->\n```python\nrun()\n```\n```python\nno()\n```\n"
    assert cluster_blocks(text) == [(6, "run()\n")]
    with pytest.raises(AssertionError, match="right above"):
        cluster_blocks("<!-- readme-test: cluster -->\n\n```python\nx\n```\n")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="32MiB", admin=True, env={"KVSTORE_ADMIN_TOKEN": TOKEN}) as c:
        yield c


def stored_keys(cluster: LocalCluster) -> list[str]:
    query = urllib.parse.urlencode({"limit": "10000"})
    req = urllib.request.Request(f"http://{cluster.admin_address}/api/v1/keys?{query}")
    req.add_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        keys: list[str] = json.loads(resp.read())["keys"]
    return keys


@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_a_readme_client_example_runs_as_written(cluster: LocalCluster, tmp_path: Path, line: int, code: str) -> None:
    script = tmp_path / "example.py"
    script.write_text(code.replace(MASTER, cluster.master_address))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    before = set(stored_keys(cluster))
    for run in (1, 2):
        done = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"README.md:{line}, run {run}:\n{done.stdout}\n{done.stderr}"
    assert set(stored_keys(cluster)) > before, f"README.md:{line} stored nothing in the cluster it was pointed at"
    for promised in re.findall(r"# run it twice: (.+)$", code, flags=re.MULTILINE):
        assert promised.strip() in done.stdout, f"README.md:{line} promises {promised!r}, printed {done.stdout!r}"
