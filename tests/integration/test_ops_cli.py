"""The operator commands (status, nodes, node, key, keys, evict, drain, top) against a live cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.keys import block_keys
from kvstore_cli.cluster import LocalCluster
from kvstore_client.store import PutOptions, Store

REPO = Path(__file__).resolve().parents[2]
TOKEN = "ops-token"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="8MiB", ssd="8MiB", admin=True, env={"KVSTORE_ADMIN_TOKEN": TOKEN}) as c:
        with Store.connect(c.master_address) as store:
            for i in range(12):
                store.put(f"ops-{i:02d}", bytes([i]) * 30_000)
            store.put("ops-pinned", b"p" * 100, PutOptions(pin=True))
            store.get_many(["ops-01", "ops-02", "ops-none"])
        yield c


def kvstore(*args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_ADMIN_TOKEN"}
    if token is not None:
        env["KVSTORE_ADMIN_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "kvstore_cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**env, "PYTHONPATH": str(REPO)})  # fmt: skip


def test_status_and_nodes_as_json_and_as_tables(cluster: LocalCluster) -> None:
    done = kvstore("status", "--master", cluster.master_address, "--json")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["nodes_up"] == 2 and status["objects"] == 13 and status["counters"]["misses"] == 1
    table = kvstore("status", "--admin", cluster.admin_address)
    assert table.returncode == 0 and "hit rate" in table.stdout and "nodes up / down" in table.stdout
    nodes = json.loads(kvstore("nodes", "--admin", cluster.admin_address, "--json").stdout)
    assert [n["node_id"] for n in nodes["nodes"]] == ["node0", "node1"]
    assert "node0" in kvstore("nodes", "--master", cluster.master_address).stdout


def test_node_key_and_keys(cluster: LocalCluster) -> None:
    node = json.loads(kvstore("node", "node1", "--master", cluster.master_address, "--json").stdout)
    assert node["node_id"] == "node1" and node["address"] == cluster.daemon_addresses[1]
    assert "NICs" in kvstore("node", "node1", "--master", cluster.master_address).stdout
    key = json.loads(kvstore("key", "ops-pinned", "--master", cluster.master_address, "--json").stdout)
    assert key["pinned"] and key["size"] == 100
    assert "pinned" in kvstore("key", "ops-pinned", "--master", cluster.master_address).stdout
    page = json.loads(kvstore("keys", "--prefix", "ops-0", "--limit", "5", "--master", cluster.master_address,
                              "--json").stdout)  # fmt: skip
    assert page["keys"] == [f"ops-{i:02d}" for i in range(5)] and page["next_cursor"] == "ops-04"
    rest = kvstore(
        "keys", "--prefix", "ops-0", "--limit", "5", "--cursor", "ops-04", "--master", cluster.master_address
    )
    assert rest.stdout.split() == [f"ops-{i:02d}" for i in range(5, 10)]


def test_evict_and_drain(cluster: LocalCluster) -> None:
    done = kvstore("evict", "--prefix", "ops-1", "--master", cluster.master_address, "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["evicted"] == 2
    assert "pinned kept" in kvstore("evict", "--key", "ops-pinned", "--master", cluster.master_address).stdout
    assert kvstore("evict", "--node", "node0", "--tier", "ssd", "--master", cluster.master_address).returncode == 0
    drained = kvstore("drain", "node0", "--master", cluster.master_address)
    assert drained.returncode == 0 and "node0: drained" in drained.stdout
    with Store.connect(cluster.master_address) as store:
        assert store.get("ops-05") == bytes([5]) * 30_000


def test_top_refreshes(cluster: LocalCluster) -> None:
    done = kvstore("top", "--iterations", "2", "--interval", "0.2", "--master", cluster.master_address, "--json")
    frames = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(frames) == 2 and all("cluster" in f and "nodes" in f for f in frames)
    live = kvstore("top", "--iterations", "2", "--interval", "0.2", "--master", cluster.master_address)
    assert live.returncode == 0 and "nodes" in live.stdout


def test_errors_are_clear(cluster: LocalCluster) -> None:
    missing = kvstore("node", "nope", "--master", cluster.master_address)
    assert missing.returncode == 2 and "node 'nope' is not registered" in missing.stderr
    unauthorized = kvstore("status", "--master", cluster.master_address, token=None)
    assert unauthorized.returncode == 2 and "KVSTORE_ADMIN_TOKEN" in unauthorized.stderr
    nobody = kvstore("status", "--admin", "127.0.0.1:1")
    assert nobody.returncode == 2 and "admin API at http://127.0.0.1:1" in nobody.stderr
    bad = kvstore("evict", "--node", "node0", "--master", cluster.master_address)
    assert bad.returncode == 2 and "--node and --tier go together" in bad.stderr


def test_keys_and_evict_by_prefix_select_exactly_one_namespace(cluster: LocalCluster) -> None:
    tokens = list(range(64))
    fp16, bf16 = block_keys(tokens, 16, "ops-llama/fp16"), block_keys(tokens, 16, "ops-llama/bf16")
    with Store.connect(cluster.master_address) as store:
        store.put_many([(k, b"x" * 100) for k in [*fp16, *bf16, *block_keys(tokens, 16)]])
    listed = kvstore("keys", "--prefix", "ops-llama/fp16/", "--limit", "100", "--master", cluster.master_address,
                     "--json")  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["keys"] == sorted(fp16)
    described = kvstore("key", fp16[0], "--master", cluster.master_address, "--json")  # a "/" inside the key
    assert described.returncode == 0 and json.loads(described.stdout)["size"] == 100, described.stderr
    evicted = kvstore("evict", "--prefix", "ops-llama/fp16/", "--master", cluster.master_address, "--json")
    assert evicted.returncode == 0 and json.loads(evicted.stdout)["evicted"] == len(fp16), evicted.stderr
    left = kvstore("keys", "--prefix", "ops-llama/", "--limit", "100", "--master", cluster.master_address, "--json")
    assert json.loads(left.stdout)["keys"] == sorted(bf16)
