"""The dashboard in headless Chromium against a live cluster, with a screenshot written for people to look at."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore_cli.cluster import LocalCluster
from kvstore_client.store import Store

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = Path(__file__).resolve().parents[2] / "build" / "test-artifacts" / "dashboard.png"
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (Debian: apt install chromium)")


def chromium(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        # As root, in a closed network: no sandbox, no background connections, a fresh profile.
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--window-size=1280,720", "--virtual-time-budget=4000"]  # fmt: skip
        return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=90)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="8MiB", admin=True) as c:
        with Store.connect(c.master_address) as store:
            for i in range(40):
                store.put(f"dash-{i}", b"d" * 100_000)
            for _ in range(3):  # a few seconds of traffic for the charts
                store.get_many([f"dash-{i}" for i in range(50)])
                time.sleep(1.1)
        yield c


def test_the_dashboard_shows_live_nodes_usage_and_rates(cluster: LocalCluster) -> None:
    done = chromium("--dump-dom", f"http://{cluster.admin_address}/")
    assert done.returncode == 0, done.stderr[-500:]
    dom = done.stdout
    assert 'data-loaded="true"' in dom, "the page never finished a refresh"
    assert 'data-node="node0"' in dom and 'data-node="node1"' in dom
    assert ">2 / 2<" in dom and ">40<" in dom  # nodes up, objects
    assert 'class="pill ok">healthy<' in dom
    assert dom.count('class="bar dram"') == 2 and "/ 8.0 MiB" in dom
    assert "80.0%" in dom  # 120 hits of 150 lookups
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    shot = chromium(f"--screenshot={SCREENSHOT}", f"http://{cluster.admin_address}/")
    assert shot.returncode == 0, shot.stderr[-500:]
    assert SCREENSHOT.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and SCREENSHOT.stat().st_size > 10_000


def test_the_dashboard_asks_for_the_token_when_the_api_wants_one() -> None:
    with LocalCluster(1, dram="8MiB", admin=True, env={"KVSTORE_ADMIN_TOKEN": "dash-token"}) as c:
        done = chromium("--dump-dom", f"http://{c.admin_address}/")
    assert done.returncode == 0
    assert '<section id="token-box">' in done.stdout  # no longer hidden
    assert "needs an admin token" in done.stdout
