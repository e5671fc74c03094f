"""A daemon's own /metrics (``kvstore daemon --metrics-port``): its link to the master seen from its
side, through a master's death and return, and a port it cannot have refused by name."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest

from kvstore_cli.cluster import LocalCluster
from kvstore_client.store import Store
from tests.conftest import admin_call


def scrape(address: str) -> dict[str, float]:
    status, text = admin_call(address, "GET", "/metrics")
    assert status == 200
    return {name: float(v) for name, v in re.findall(r'^(kvstore_daemon_[a-z_]+)\{node="node0"\} (\S+)$', text, re.M)}


@pytest.mark.slow
def test_a_daemon_says_when_no_master_answers_it_and_when_one_does_again() -> None:
    with LocalCluster(1, dram="16MiB", ssd="16MiB", daemon_metrics=True) as cluster:
        address = cluster.daemon_metrics[0]
        first = scrape(address)
        assert first["kvstore_daemon_registered"] == 1 and first["kvstore_daemon_registrations_total"] == 1
        assert first["kvstore_daemon_master_silence_seconds"] < 3 and first["kvstore_daemon_master_failures_total"] == 0
        assert first["kvstore_daemon_ssd_configured_bytes"] == 16 << 20
        assert first["kvstore_daemon_ssd_capacity_bytes"] > 0 and first["kvstore_daemon_ssd_fault"] == 0
        assert first["kvstore_daemon_dram_capacity_bytes"] > 0
        assert first["kvstore_daemon_dram_blocks"] == 0 and first["kvstore_daemon_dram_index_bytes"] > 0
        with Store.connect(cluster.master_address) as store:
            store.put_many([(f"m{i}", b"x" * 300) for i in range(3)])
        held = scrape(address)
        assert held["kvstore_daemon_dram_blocks"] == 3
        assert held["kvstore_daemon_dram_index_bytes"] == first["kvstore_daemon_dram_index_bytes"]  # room already
        cluster.kill_master()
        time.sleep(2.5)
        cut = scrape(address)
        assert cut["kvstore_daemon_master_silence_seconds"] >= 2 and cut["kvstore_daemon_master_failures_total"] > 0
        cluster.restart_master()  # a fresh master: the daemon registers again
        deadline = time.monotonic() + 10
        while (back := scrape(address))["kvstore_daemon_registrations_total"] < 2:
            assert time.monotonic() < deadline, back
            time.sleep(0.1)
        assert back["kvstore_daemon_master_silence_seconds"] < 2


def test_a_metrics_port_in_use_is_refused_by_name() -> None:
    with socket.socket() as taken, LocalCluster(0) as cluster:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "kvstore_cli", "daemon", "--master", cluster.master_address, "--name", "n9",
             "--dram", "8MiB", "--leave-on-exit", "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode != 0
    assert f"cannot serve metrics on 127.0.0.1:{port}" in done.stderr, done.stderr[-2000:]
