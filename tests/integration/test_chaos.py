"""bench.chaos end to end: a short run of every fault kind against the real cluster finds no
violation, and the same run with a bug planted in the daemons is caught (the checker can fail)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.chaos_faults import Partitions, SsdDisks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (Debian: apt install etcd-server)"),
    pytest.mark.timeout(400),
]
PLANTS = Path(__file__).resolve().parents[1] / "chaos_plants"


def _chaos(*args: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.chaos", "--json", *args], capture_output=True, text=True, timeout=360
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return lines[-1], lines[:-1]


def test_a_short_run_of_every_fault_kind_keeps_every_promise_and_alerts() -> None:
    kinds = ["leader_kill", "daemon_kill", "sigstop"]
    kinds += (["partition"] if Partitions.possible() else []) + (["disk_full"] if SsdDisks.possible() else [])
    summary, faults = _chaos(
        "--minutes", "1.3", "--seed", "7", "--calm", "20", "--interval", "4", "--faults", ",".join(kinds)
    )
    print(json.dumps(summary))
    assert summary["violations"] == 0, json.dumps(summary["first"], indent=1)
    assert summary["nemesis_error"] is None and summary["eviction_log_whole"], summary
    assert set(summary["faults"]) == set(kinds), faults
    assert summary["ok"] > 1000 and summary["max_op_s"] < 60
    assert min(summary["puts_by_mode"].get(m, 0) for m in ("visible", "cached")) > 100, summary  # both judged
    alerts = summary["alerts"]
    if "skipped" not in alerts:  # Prometheus is installed: each fault kind fired an alert, the calm none
        assert not alerts["faults_without_alert"] and not alerts["in_calm"], alerts
        assert "KvstoreMasterUnreachable" in alerts["by_fault"]["leader_kill"], alerts
        assert "KvstoreNodeDown" in alerts["by_fault"]["daemon_kill"], alerts
        if "partition_daemon" in alerts["by_fault"]:  # no master answers the daemon (the masters may not yet
            # count it down: it is down to them after 3 s of silence, and a partition may last little more)
            assert "KvstoreDaemonCutFromMaster" in alerts["by_fault"]["partition_daemon"], alerts
        if "disk_full" in kinds:
            assert "KvstoreTierDegraded" in alerts["by_fault"]["disk_full"], alerts


@pytest.mark.parametrize(
    ("plant", "caught", "minutes"),
    [  # long enough to catch each many times (hundreds in 9 s for the first two; a lost commit is rarer)
        ("corrupt_reads", "wrong_bytes", "0.1"),
        ("forgetful_drops", "read_after_remove", "0.1"),
        ("lost_cached_commits", "lost", "0.25"),
    ],
)
def test_the_checker_catches_a_bug_planted_in_the_daemons(plant: str, caught: str, minutes: str) -> None:
    summary, _ = _chaos(
        "--minutes", minutes, "--faults", "", "--prometheus", "no",
        "--cluster-env", f"PYTHONPATH={PLANTS}", "--cluster-env", f"KVSTORE_PLANT={plant}",
    )  # fmt: skip
    assert summary["ok"] > 500, summary  # the workers ran (a starved run would say nothing)
    assert summary["by_kind"].get(caught, 0) > 0, summary
