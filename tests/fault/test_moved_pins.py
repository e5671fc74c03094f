"""A pin survives a drain: the copy a drain makes is pinned on its daemon too, so a master that
rebuilds its table from the daemons' inventories still never evicts the block."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvstore_cli.cluster import LocalCluster
from kvstore_client.store import PutOptions, Store
from tests.conftest import admin_call

TOKEN = "pin-token"


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="4MiB", ssd="4MiB", admin=True, env={"KVSTORE_ADMIN_TOKEN": TOKEN}) as c:
        yield c


def call(cluster: LocalCluster, method: str, path: str) -> tuple[int, Any]:
    return admin_call(cluster.admin_address, method, path, None, TOKEN)


def test_a_drained_pinned_block_is_pinned_on_its_new_node_after_a_master_restart(cluster: LocalCluster) -> None:
    keys = [f"pinned-{i}" for i in range(4)]
    with Store.connect(cluster.master_address) as store:
        for k in keys:
            store.put(k, k.encode() * 100, PutOptions(pin=True, preferred_node="node1"))
    assert all(call(cluster, "GET", f"/api/v1/keys/{k}")[1]["replicas"][0]["node_id"] == "node1" for k in keys)
    status, result = call(cluster, "POST", "/api/v1/nodes/node1/drain")
    assert status == 200 and result["blocks_left"] == 0
    cluster.kill_master()
    cluster.restart_master()  # the new master knows only what the daemons report
    for k in keys:
        status, meta = call(cluster, "GET", f"/api/v1/keys/{k}")
        assert status == 200 and [r["node_id"] for r in meta["replicas"]] == ["node0"]
        assert meta["pinned"], f"{k} lost its pin in the drain"
