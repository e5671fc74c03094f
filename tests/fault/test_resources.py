"""When the machine runs short: a disk that fills under the SSD tier, tiers asked larger than the
machine has. Real processes; the small filesystems are tmpfs mounts of their own (root only)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.results import PutStatus
from kvstore_cli.cluster import LocalCluster
from kvstore_client.store import Store
from tests.conftest import admin_call

MiB = 1024**2
FAST = ("--heartbeat-ms", "100")


def value(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, MiB, dtype=np.uint8).tobytes()


def wait_for(what: str, check: Any, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)
    return got


@pytest.mark.slow
def test_a_disk_that_fills_under_the_ssd_tier_degrades_it_and_puts_go_on(small_fs: Any) -> None:
    """The SSD tier's filesystem fills (another file takes it) while 200 puts of 1 MiB go through a
    32 MiB DRAM tier: every put succeeds, every read is its bytes or a miss, the tier's capacity
    drops to what the disk holds (seen by the daemon's check of its disk at each heartbeat, or by a
    demotion that failed and dropped its blocks instead) and the master shows why; a failure is
    logged once, not once per block."""
    fs = small_fs("64m")
    with LocalCluster(1, dram="32MiB", ssd="48MiB", workdir=fs, admin=True, master_args=FAST) as cluster:
        filler = fs / "filler"
        filler.write_bytes(bytes(shutil.disk_usage(fs).free - 16 * MiB))
        with Store.connect(cluster.master_address) as store:
            statuses = [store.put(f"full/{i}", value(i)) for i in range(200)]
            assert [s for s in statuses if s is not PutStatus.STORED] == []
            got = store.get_many([f"full/{i}" for i in range(200)])
            corrupt = [i for i, g in enumerate(got) if g is not None and g != value(i)]
            assert corrupt == []
            hits = [i for i, g in enumerate(got) if g is not None]
            assert len(hits) >= 16, "what DRAM holds, at least, reads back"
            # No block is left half-moved: whatever exists reads.
            assert store.exists_many([f"full/{i}" for i in hits]) == [True] * len(hits)

        def degraded() -> Any:
            code, node = admin_call(cluster.admin_address, "GET", "/api/v1/nodes/node0")
            assert code == 200, node
            return node if node["faults"].get("ssd") else None

        node = wait_for("the master shows the SSD tier degraded", degraded)
        ssd = node["tiers"]["ssd"]
        assert ssd["configured"] == 48 * MiB and ssd["capacity"] < 16 * MiB
        assert re.match(r"write failed|its disk has room for", node["faults"]["ssd"]), node["faults"]
        _, metrics = admin_call(cluster.admin_address, "GET", "/metrics")
        assert 'kvstore_tier_degraded{node="node0",tier="ssd"} 1.0' in metrics
        assert re.search(r"^kvstore_demotions_failed_total \S+$", metrics, re.M)
        out = subprocess.run([sys.executable, "-m", "kvstore_cli", "nodes", "--master", cluster.master_address],
                             capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
        assert "degraded" in out, out
        logs = "".join(p.read_text() for p in fs.glob("*.log"))
        assert logs.count("dropped instead of demoted") <= 1, logs[-3000:]  # a line a minute, not one a block
        assert "will retry" not in logs
        # Room on the disk again: the tier comes back to its configured size by itself.
        filler.unlink()
        wait_for("the SSD tier back to its size", lambda: not degraded())


def run_daemon(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore_cli", "daemon", "--master", "127.0.0.1:9", "--name", "short", *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}, check=False,
    )  # fmt: skip


def test_tiers_larger_than_the_machine_are_refused_before_anything_is_made(small_fs: Any, tmp_path: Path) -> None:
    shm = small_fs("64m")
    started = time.monotonic()
    done = run_daemon(["--dram", "256MiB"], {"KVSTORE_DAEMON_DRAM__SHM_DIR": str(shm)})
    assert done.returncode == 2, done.stderr
    assert "DRAM arena" in done.stderr and "64.0 MiB" in done.stderr and "--dram" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert list(shm.iterdir()) == []
    print(f"[resources] --dram 256MiB on a 64 MiB shm refused in {time.monotonic() - started:.2f} s")
    disk = small_fs("16m")
    done = run_daemon(["--dram", "4MiB", "--ssd", "512MiB", "--ssd-dir", str(disk / "ssd")],
                      {"KVSTORE_DAEMON_DRAM__SHM_DIR": str(shm)})  # fmt: skip
    assert done.returncode == 2 and "SSD tier" in done.stderr and "--ssd" in done.stderr, done.stderr
    assert list(shm.iterdir()) == [] and list(disk.iterdir()) == []
    mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    done = run_daemon(["--dram", str(2 * mem)])
    assert done.returncode == 2 and "--dram" in done.stderr, done.stderr
    assert not list(Path("/dev/shm").glob("kvstore-short.arena*"))
