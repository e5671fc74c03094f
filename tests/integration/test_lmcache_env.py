"""LMCache's tests (``test_lmcache.py``) import LMCache, which pins numpy, transformers and
setuptools of its own: they run in ``.venv-lmcache`` (``scripts/lmcache-env.sh``, which the
README's test command runs; ``$KVSTORE_LMCACHE_PYTHON`` names another interpreter). This runs
them there from the main suite, and skips, saying why, where that environment was not built."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("KVSTORE_LMCACHE_PYTHON") or str(REPO / ".venv-lmcache" / "bin" / "python")


@pytest.mark.lmcache
@pytest.mark.skipif(not Path(PYTHON).exists(), reason=f"no LMCache environment at {PYTHON} (scripts/lmcache-env.sh)")
def test_lmcache_against_its_own_classes_in_the_lmcache_environment() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [
        PYTHON,
        "-m",
        "pytest",
        "-q",
        "-m",
        "lmcache",
        "-p",
        "no:cacheprovider",
        "tests/integration/test_lmcache.py",
    ]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    last = done.stdout.splitlines()[-1]
    assert " passed" in last and "skipped" not in last, last
