"""Per-node prefix matches and replicating blocks between nodes, on a master and two daemons as processes."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.errors import InvalidArgument, NotFound
from kvstore.keys import block_keys
from kvstore.protocol import NodePrefix, PrefixMatch, Replicated
from kvstore_cli.cluster import LocalCluster
from kvstore_client.store import PutOptions, Store
from tests.conftest import FACES, connect_client

KB = 1024
BLOCK = 64 * KB
TOKEN = "prefix-nodes-token"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # No SSD: evicting a node's DRAM drops its blocks there.
    with LocalCluster(2, dram="8MiB", admin=True, env={"KVSTORE_ADMIN_TOKEN": TOKEN}) as c:
        yield c


@pytest.fixture(params=FACES)
def store(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[Store]:
    """A Store, or an AsyncStore called as one: both faces replicate and match alike."""
    with connect_client(request.param, cluster.master_address) as s:
        yield s


def chain(name: str, n: int) -> tuple[list[str], np.ndarray]:
    """``n`` prefix-hashed keys of one prompt and a random block for each."""
    keys: list[str] = list(block_keys(list(range(16 * n)), 16, namespace=f"prefix-nodes-{name}"))
    return keys, np.random.default_rng(len(name)).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def evict_dram(cluster: LocalCluster, node_id: str) -> int:
    body = json.dumps({"node_id": node_id, "tier": "dram"}).encode()
    request = urllib.request.Request(f"http://{cluster.admin_address}/api/v1/evict", data=body, method="POST")
    request.add_header("Authorization", f"Bearer {TOKEN}")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as resp:
        return int(json.loads(resp.read())["evicted"])


def test_replicated_blocks_are_matched_on_both_nodes_and_outlive_the_source(
    cluster: LocalCluster, store: Store
) -> None:
    keys, blocks = chain(f"hot-{type(store).__name__}", 8)  # each face its own keys
    store.put_many(zip(keys[:6], blocks[:6], strict=True), PutOptions(preferred_node="node0"))
    assert store.match_prefix_nodes(keys) == PrefixMatch(6, {"node0": NodePrefix(dram=6, total=6)})
    assert store.match_prefix_nodes(keys).longest == store.match_prefix(keys)

    assert store.replicate(keys[:4], "node1", max_bytes=1 << 30) == Replicated(4, 4 * BLOCK)
    assert store.match_prefix_nodes(keys) == PrefixMatch(6, {"node0": NodePrefix(6, 6), "node1": NodePrefix(4, 4)})
    assert store.replicate(keys[:4], "node1", max_bytes=1 << 30) == Replicated(0, 0)  # there already

    # The source's copies go (node0 has no SSD: its DRAM blocks are dropped); node1's serve the prefix.
    assert evict_dram(cluster, "node0") >= 6
    assert store.match_prefix_nodes(keys) == PrefixMatch(4, {"node1": NodePrefix(4, 4)})
    # The master drops first and tells node0 after: a reader that remembers node0 (AsyncStore reads
    # it by key, over TCP) may still be served the dropped copies' exact bytes meanwhile. Read as
    # the master now places them.
    store._core.hints.forget(keys)
    out = np.zeros_like(blocks[:6])
    assert store.get_many_into(keys[:6], list(out), verify=True) == [BLOCK] * 4 + [None, None]
    assert np.array_equal(out[:4], blocks[:4])
    with Store.connect(cluster.master_address) as fresh:  # no remembered locations
        assert fresh.get_many(keys[:4], verify=True) == [bytes(b) for b in blocks[:4]]

    # Removing a replicated block removes every copy.
    assert store.remove_many(keys[:4]) == 4
    assert store.match_prefix_nodes(keys) == PrefixMatch(0, {})
    assert store.get_many(keys[:4]) == [None] * 4


def test_replicate_takes_keys_in_order_within_the_budget(store: Store) -> None:
    keys, blocks = chain(f"budget-{type(store).__name__}", 5)
    store.put_many(zip(keys, blocks, strict=True), PutOptions(preferred_node="node1"))
    assert store.replicate(keys, "node0", max_bytes=BLOCK - 1) == Replicated(0, 0)
    # Keys not stored are skipped; the copy stops before the block that would pass the budget.
    got = store.replicate(["never-stored", *keys], "node0", max_bytes=2 * BLOCK + BLOCK // 2)
    assert got == Replicated(2, 2 * BLOCK)
    match = store.match_prefix_nodes(keys)
    assert match == PrefixMatch(5, {"node0": NodePrefix(2, 2), "node1": NodePrefix(5, 5)})
    assert store.get_many(keys, verify=True) == [bytes(b) for b in blocks]
    store.remove_many(keys)


def test_bad_replicate_and_match_requests_are_typed_errors(store: Store) -> None:
    with pytest.raises(NotFound, match="'node9'"):
        store.replicate(["k"], "node9", max_bytes=BLOCK)
    with pytest.raises(InvalidArgument, match="max_bytes"):
        store.replicate(["k"], "node0", max_bytes=-1)
    with pytest.raises(InvalidArgument):
        store.match_prefix_nodes([""])
    assert store.match_prefix_nodes([]) == PrefixMatch(0, {})
    assert store.replicate([], "node0", max_bytes=0) == Replicated(0, 0)
