"""Several rails to one daemon on loopback (127.0.0.1 and 127.0.0.2): slicing, spreading and failover."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.config import ClientConfig
from kvstore.errors import ConnectionFailed
from kvstore.protocol import NodeInfo
from kvstore_cli.cluster import LocalCluster
from kvstore_client.dataplane import RailPath
from kvstore_client.store import Store
from transfer.rails import RailSet

MB = 1 << 20


def _railset(store: Store, node: NodeInfo) -> RailSet | None:
    """The rails this client sprays the node's transfers over (None when it reaches it otherwise)."""
    path = store._path(node.node_id, node.address)
    return path.railset if isinstance(path, RailPath) else None


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(1, dram="64MiB", daemon_args=("--rail", "127.0.0.2")) as c:
        yield c


@pytest.fixture
def store(cluster: LocalCluster) -> Iterator[Store]:
    config = ClientConfig(transport="tcp", slice_bytes=256 * 1024, max_slices_in_flight=4)
    with Store.connect(cluster.master_address, config) as s:
        yield s


def test_blocks_are_sliced_over_both_rails_and_come_back_exact(store: Store) -> None:
    [node] = store.nodes()
    assert len(node.rails) == 2 and node.rails[1].startswith("127.0.0.2:")
    blocks = np.random.default_rng(3).integers(0, 256, (6, 3 * MB + 77), dtype=np.uint8)
    small = [bytes([i]) * 1000 for i in range(20)]
    keys = [f"rail-{i}" for i in range(len(blocks))]
    store.put_many(zip(keys, blocks, strict=True))
    store.put_many((f"rail-small-{i}", b) for i, b in enumerate(small))
    out = np.zeros_like(blocks)
    assert store.get_many_into(keys, list(out)) == [blocks.shape[1]] * len(keys)
    assert np.array_equal(out, blocks)
    assert store.get_many([f"rail-small-{i}" for i in range(20)] + ["rail-absent"]) == [*small, None]
    railset = _railset(store, node)
    assert railset is not None and all(r.bytes_moved > 0 and r.bandwidth > 0 for r in railset.rails)


def test_a_large_put_is_sliced_over_both_rails_and_committed_whole(store: Store) -> None:
    [node] = store.nodes()
    railset = _railset(store, node)
    assert railset is not None
    before = [r.bytes_moved for r in railset.rails]
    block = np.random.default_rng(5).integers(0, 256, 5 * MB + 3, dtype=np.uint8)
    assert store.put("sliced-put", block).value == "stored"
    moved = [r.bytes_moved - b for r, b in zip(railset.rails, before, strict=True)]
    assert all(n > 0 for n in moved) and sum(moved) == block.nbytes  # 21 slices, both rails
    out = np.zeros_like(block)
    assert store.get_into("sliced-put", out, verify=True) == block.nbytes
    assert np.array_equal(out, block)


def test_a_dead_rail_is_skipped_paused_and_probed_again(store: Store) -> None:
    [node] = store.nodes()
    data = np.random.default_rng(4).integers(0, 256, (4, 2 * MB), dtype=np.uint8)
    keys = [f"dead-rail-{i}" for i in range(len(data))]
    store.put_many(zip(keys, data, strict=True))
    with store._located(keys) as located:
        sizes = [loc.size for loc in located if loc is not None]
        sums = [loc.checksum for loc in located if loc is not None]
    dead = "127.0.0.1:1"  # nothing listens there: every slice sent to it fails
    railset = RailSet([node.rails[0], dead], timeout=2.0, slice_bytes=256 * 1024, max_inflight=4, cooldown_s=60)
    try:
        for _ in range(2):
            out = np.zeros_like(data)
            assert railset.read(keys, sizes, sums, [memoryview(r) for r in out]) == sizes
            assert np.array_equal(out, data)
        rail = next(r for r in railset.rails if r.address == dead)
        assert rail.failures >= 2 and rail.bytes_moved == 0
        assert [r.address for r in railset.usable()] == [node.rails[0]]  # resting
        rail.paused_until = time.monotonic() - 0.001  # as if the cooldown were over
        assert dead in [r.address for r in railset.usable()]  # probed on the next transfer
        out = np.zeros_like(data)
        assert railset.read(keys, sizes, sums, [memoryview(r) for r in out]) == sizes
        assert rail.paused_until > time.monotonic()  # the probe failed: resting again
    finally:
        railset.close()
    only_dead = RailSet([dead], timeout=1.0, slice_bytes=MB, max_inflight=2, cooldown_s=1.0)
    try:
        with pytest.raises(ConnectionFailed, match="no rail left"):
            only_dead.read(keys[:1], sizes[:1], sums[:1], [memoryview(bytearray(sizes[0]))])
    finally:
        only_dead.close()
