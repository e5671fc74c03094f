"""The kvstore command line, run as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.workload import chat_workload, load_trace, lru_prefix_hit_rate

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO.parent / "shared" / "traces" / "synthetic_trace.jsonl"


def kvstore(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvstore_cli", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def last_json(out: str) -> dict[str, float]:
    return dict(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.slow
def test_demo_prints_a_json_summary() -> None:
    result = kvstore("demo", "--json", "--verify", "--sessions", "60", "--dram", "4MiB", "--ssd", "8MiB")
    assert result.returncode == 0, result.stderr
    summary = last_json(result.stdout)
    requests = chat_workload(num_sessions=60)
    assert summary["requests"] == len(requests)
    assert summary["blocks"] == sum(len(r.hash_ids) for r in requests)
    assert 0 < summary["hit_rate"] < 1
    assert summary["hit_blocks"] + summary["stored_blocks"] == summary["blocks"]


def test_demo_prints_a_table_by_default() -> None:
    result = kvstore("demo", "--sessions", "20", "--dram", "4MiB", "--ssd", "0", "--local")
    assert result.returncode == 0, result.stderr
    assert "prefix hit rate" in result.stdout and "requests" in result.stdout


@pytest.mark.slow
def test_replay_without_eviction_matches_an_infinite_cache(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    requests = chat_workload(num_sessions=40, seed=3)
    fields = ("timestamp", "input_length", "output_length", "hash_ids")
    rows = [dict(zip(fields, (r.timestamp_ms, r.input_length, r.output_length, list(r.hash_ids)), strict=True))
            for r in requests]  # fmt: skip
    trace.write_text("\n".join(json.dumps(row) for row in rows))
    expected = lru_prefix_hit_rate(requests, 10**9)
    for mode in (["--local"], ["--engines", "1"]):  # in process, and through a cluster of real processes
        result = kvstore(
            "replay", str(trace), "--json", "--block-bytes", "4KiB", "--dram", "64MiB", "--ssd", "0", *mode
        )
        assert result.returncode == 0, result.stderr
        assert last_json(result.stdout)["hit_rate"] == pytest.approx(expected, abs=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(not TRACE.exists(), reason="shared/traces/synthetic_trace.jsonl is not present")
def test_replay_of_the_public_trace_with_eviction() -> None:
    result = kvstore(
        "replay", str(TRACE), "--json", "--limit", "800", "--block-bytes", "16KiB", "--dram", "16MiB", "--ssd", "32MiB",
        "--daemons", "1", "--engines", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = last_json(result.stdout)
    reference = lru_prefix_hit_rate(list(load_trace(TRACE, 800)), 3072)
    assert summary["requests"] == 800
    # Watermarks keep each tier 90-95% full, so the store may trail an exact LRU of the same size a little.
    assert reference - 0.05 <= summary["hit_rate"] <= reference + 0.01


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["replay", "/nonexistent/trace.jsonl"], "cannot read trace"),
        (["demo", "--dram", "12XB"], "12XB"),
        (["demo", "--block-bytes", "8"], "block_bytes"),
    ],
)
def test_bad_input_is_a_clear_error(args: list[str], message: str) -> None:
    result = kvstore(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_malformed_trace_line_names_its_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": -1}\n')
    result = kvstore("replay", str(trace))
    assert result.returncode == 2 and "bad.jsonl:2" in result.stderr and "timestamp" in result.stderr


def cluster_up(daemons: int) -> tuple[subprocess.Popen[str], str]:
    """``kvstore cluster up`` as a process, read up to its "cluster up" line; the process and the master's address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore_cli", "cluster", "up", "--daemons", str(daemons), "--dram", "8MiB",
         "--port", "0", "--admin-port", "0"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "cluster up" in line:
            break
    assert sum(line.startswith("daemon") for line in lines) == daemons
    return proc, next(line.split()[1] for line in lines if line.startswith("master"))


def test_cluster_up_serves_until_interrupted() -> None:
    proc, master = cluster_up(2)
    try:
        from kvstore_client.store import Store

        with Store.connect(master) as store:
            store.put("from-cli-cluster", b"v")
            assert store.get("from-cli-cluster") == b"v"
            assert store.stats()["nodes_up"] == 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.slow
def test_cluster_up_restarts_a_daemon_that_dies() -> None:
    """A daemon killed under ``cluster up`` is started again as it was: it re-attaches its arena, so
    what it held reads again; the cluster goes on, and its arenas still go when it stops."""
    proc, master = cluster_up(1)
    try:
        from kvstore_client.store import Store

        with Store.connect(master) as store:
            store.put("survives", b"v" * 4096)
            tag = f"cluster-{proc.pid}-"
            (pid,) = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and tag.encode() in
                      _cmdline(p) and b"daemon" in _cmdline(p)]  # fmt: skip
            os.kill(pid, signal.SIGKILL)
            assert proc.stdout is not None
            restarted = next(line for line in proc.stdout if "(restarted)" in line)
            assert restarted.startswith("daemon  node0")
            deadline = time.monotonic() + 30
            while store.get("survives") is None:  # until the restarted daemon has registered again
                assert time.monotonic() < deadline, "the restarted daemon's block did not come back"
                time.sleep(0.1)
            assert store.get("survives") == b"v" * 4096
        assert proc.poll() is None, "the cluster stopped"
        arenas = sorted(Path("/dev/shm").glob(f"kvstore-cluster-{proc.pid}-*.arena"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert arenas and not any(a.exists() for a in arenas)
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_cluster_up_killed_outright_takes_its_processes_and_leaves_listed_arenas() -> None:
    proc, _ = cluster_up(1)
    tag = f"cluster-{proc.pid}-".encode()
    try:
        children = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and tag in _cmdline(p)]
        assert children, "no daemon of the cluster found"
        master = [int(p.name) for p in Path("/proc").iterdir()
                  if p.name.isdigit() and b"kvstore_cli\x00master" in _cmdline(p) and _ppid(p) == proc.pid]  # fmt: skip
        assert len(master) == 1, "no master of the cluster found"
        proc.kill()  # SIGKILL: no handler runs, nothing is stopped by the cluster itself
        proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in children + master):
            assert time.monotonic() < deadline, "the cluster's processes outlived it"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    # Its arenas stay (a daemon that is stopped keeps its blocks): listed as leftovers, then removed.
    from kvstore.config import DramConfig
    from kvstore.tiers.arena_files import find_arenas, remove_arena

    left = [a for a in find_arenas(Path("/dev/shm")) if a.name.startswith(f"cluster-{proc.pid}-")]
    assert left and not any(a.in_use for a in left)
    for a in left:
        assert remove_arena(DramConfig(name=a.name)) > 0


def _ppid(proc_dir: Path) -> int:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _cmdline(proc_dir: Path) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:
        return b""


def test_cluster_up_stops_its_processes_and_arenas_on_sigterm() -> None:
    proc, master = cluster_up(1)
    try:
        arenas = sorted(Path("/dev/shm").glob(f"kvstore-cluster-{proc.pid}-*.arena"))
        assert len(arenas) == 1
        proc.send_signal(signal.SIGTERM)  # what `kill` sends: the cluster must not outlive it
        assert proc.wait(timeout=30) == 0
        assert not any(a.exists() for a in arenas)
        from kvstore.errors import ConnectionFailed
        from kvstore_client.store import Store

        with pytest.raises(ConnectionFailed):
            Store.connect(master).close()
    finally:
        proc.kill()
        proc.wait(timeout=10)
