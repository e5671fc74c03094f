"""The dashboard in headless Chromium against a live cluster, with a screenshot written for people to look at."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.config import ClientConfig
from kvstore_cli.cluster import LocalCluster, LocalEtcd
from kvstore_client.store import Store
from tests.conftest import admin_call

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
REPO = Path(__file__).resolve().parents[2]
SCREENSHOT = REPO / "build" / "test-artifacts" / "dashboard.png"
SCREENSHOT_HA = SCREENSHOT.with_name("dashboard-ha.png")
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


def test_the_dashboard_shows_the_leader_standbys_tenants_and_alerts_of_an_ha_cluster(etcd: LocalEtcd) -> None:
    """Two masters on etcd, tenants with quotas, a node killed: the page names the leader and its term,
    the standby and how far behind it is, each tenant's bytes against its quota, the node down and the
    alert that fires for it (the master's own view: no Prometheus here)."""
    with LocalCluster(2, dram="8MiB", admin=True, etcd=etcd.endpoint, masters=2, authenticate=True,
                      master_args=("--node-ttl-ms", "1500")) as c:  # fmt: skip
        ops = c.add_admin("ops", "read-only")
        acme = c.add_tenant("acme", quota=2 << 20)
        c.add_tenant("idle", quota=8 << 20)
        leader = c.leader_index()
        standby = 1 - leader
        with Store.connect(c.master_address, config=ClientConfig(token=acme)) as store:
            for i in range(10):
                store.put(f"t-{i}", b"a" * 100_000)
            assert store.get(f"t-{i}") is not None
        c.kill_daemon(1)
        deadline = time.monotonic() + 30
        while True:
            status, alerts = admin_call(c.master_admin[leader], "GET", "/api/v1/alerts", token=ops)
            assert status == 200, alerts
            if any(a["name"] == "KvstoreNodeDown" for a in alerts["alerts"]):
                break
            assert time.monotonic() < deadline, alerts
            time.sleep(0.5)
        assert alerts["source"] == "master" and "KvstoreSplitBrain" in alerts["not_judged"]
        status, masters = admin_call(c.master_admin[leader], "GET", "/api/v1/masters", token=ops)
        assert status == 200
        roles = {m["address"]: (m["role"], m["follows"], m["error"]) for m in masters["masters"]}
        assert roles == {c.master_rpc[leader]: ("leader", True, ""), c.master_rpc[standby]: ("standby", True, "")}
        # The standby answers the cluster's routes with the leader's answer (its own table is empty),
        # and writes with NotLeader.
        status, summary = admin_call(c.master_admin[standby], "GET", "/api/v1/cluster", token=ops)
        assert status == 200 and summary["nodes"] == 2 and summary["objects"] == 10, summary
        status, body = admin_call(c.master_admin[standby], "POST", "/api/v1/evict", {"key": "acme/t-0"}, token=ops)
        assert status in (403, 503), body  # read-only token: refused before leadership is asked
        status, own = admin_call(c.master_admin[standby], "GET", "/api/v1/leadership", token=ops)
        assert status == 200 and own["role"] == "standby" and own["leader_epoch"] == masters["epoch"]
        status, usage = admin_call(c.master_admin[leader], "GET", "/api/v1/tenants", token=ops)
        assert status == 200
        held = {t["tenant"]: (t["held_bytes"], t["quota_bytes"]) for t in usage["tenants"]}
        assert held == {"acme": (1_000_000, 2 << 20), "idle": (0, 8 << 20)}

        # The same through the command line: `kvstore status` and `kvstore tenants usage`.
        env = {**os.environ, "KVSTORE_ADMIN_TOKEN": ops, "PYTHONPATH": str(REPO),
               "KVSTORE_CLUSTER_SECRET": Path(str(c.secret_file)).read_text().strip()}  # fmt: skip

        def cli(*args: str) -> str:
            done = subprocess.run([sys.executable, "-m", "kvstore_cli", *args, "--master", c.master_address],
                                  cwd=REPO, capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
            assert done.returncode == 0, done.stderr
            return done.stdout

        status = json.loads(cli("status", "--json"))
        assert status["ha"]["leader"] == c.master_rpc[leader]
        assert {m["address"]: m["role"] for m in status["ha"]["masters"]} == {
            c.master_rpc[leader]: "leader", c.master_rpc[standby]: "standby"
        }  # fmt: skip
        fired = status["alerts"]["alerts"]
        assert any(a["name"] == "KvstoreNodeDown" and a["labels"] == {"node": "node1"} for a in fired)
        table = cli("status")
        assert "KvstoreNodeDown" in table and "alerts firing" in table and "standby" in table
        usage = json.loads(cli("tenants", "usage", "--json"))
        assert {t["tenant"]: t["held_bytes"] for t in usage["tenants"]} == {"acme": 1_000_000, "idle": 0}
        assert "acme" in cli("tenants", "usage") and "no quota" not in cli("tenants", "usage")

        page = f"http://{c.master_admin[leader]}/#token={ops}"
        done = chromium("--dump-dom", page)
        assert done.returncode == 0, done.stderr[-500:]
        dom = done.stdout
        assert 'data-loaded="true"' in dom, "the page never finished a refresh"
        assert f'id="leader" class="value small">{c.master_rpc[leader]}<' in dom
        assert f'id="epoch" class="value">{masters["epoch"]}<' in dom
        assert f'<tr data-master="{c.master_rpc[standby]}"><td>{c.master_rpc[standby]}</td><td class="">standby</td>' \
            "<td>follows the leader</td>" in dom  # fmt: skip
        assert '<tr data-tenant="acme"><td>acme</td>' in dom and "976.6 KiB / 2.0 MiB" in dom
        assert '<tr data-tenant="idle"><td>idle</td>' in dom and "0 B / 8.0 MiB" in dom
        assert 'data-alert="KvstoreNodeDown"' in dom and "node node1 stopped heartbeating" in dom
        assert 'data-node="node1"><td>node1</td><td class="down">down<' in dom
        assert 'class="pill bad">1 node down<' in dom
        shot = chromium(f"--screenshot={SCREENSHOT_HA}", "--window-size=1280,1400", page)
        assert shot.returncode == 0, shot.stderr[-500:]
        assert SCREENSHOT_HA.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
