"""The cluster as a user sees it: a master and daemons as real processes, used through Store."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.config import ClientConfig
from kvstore.errors import BufferTooSmall, CorruptBlock, InvalidArgument, InvalidKey, NoNodes, StoreClosed
from kvstore.keys import block_keys
from kvstore.results import PutStatus
from kvstore_cli.cluster import LocalCluster
from kvstore_client.aio import AsyncStore
from kvstore_client.core import ClientCore
from kvstore_client.dataplane import DataPath
from kvstore_client.effects import Job, ReadLocated
from kvstore_client.links import ReadBatcher
from kvstore_client.store import PutOptions, Store
from tests.conftest import FACES, connect_client

KB = 1024


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="8MiB", ssd="16MiB") as c:
        yield c


@pytest.fixture(params=FACES)
def store(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[Store]:
    """A Store, or an AsyncStore called as one: both faces of the client pass the same tests."""
    with connect_client(request.param, cluster.master_address) as s:
        yield s


@pytest.fixture
def sync_store(cluster: LocalCluster) -> Iterator[Store]:
    with Store.connect(cluster.master_address) as s:
        yield s


def test_put_get_exists_remove(store: Store) -> None:
    assert store.put("basic", b"hello") is PutStatus.STORED
    assert store.get("basic") == b"hello"
    assert store.exists("basic") and not store.exists("basic-missing")
    assert store.get("basic-missing") is None
    assert store.remove("basic") and not store.exists("basic")
    assert store.get("basic") is None


def test_an_existing_key_keeps_its_bytes(store: Store) -> None:
    store.put("same", b"first")
    assert store.put("same", b"other") is PutStatus.EXISTS
    assert store.get("same") == b"first"


def test_zero_copy_numpy_batches_and_prefix_match(store: Store) -> None:
    keys = block_keys(list(range(64 * 16)), 64, namespace="cluster-test")
    blocks = np.random.default_rng(0).integers(0, 256, (len(keys), 64 * KB), dtype=np.uint8)
    assert store.put_many(zip(keys[:10], blocks[:10], strict=True)) == [PutStatus.STORED] * 10
    assert store.match_prefix(keys) == 10
    out = np.zeros_like(blocks[:12])
    assert store.get_many_into(keys[:12], list(out), verify=True) == [64 * KB] * 10 + [None, None]
    assert np.array_equal(out[:10], blocks[:10])
    assert store.exists_many(keys[9:11]) == [True, False]
    assert store.remove_many(keys[:10]) == 10


def test_torch_tensors(store: Store) -> None:
    torch = pytest.importorskip("torch")
    t = torch.randn(128, 64, dtype=torch.bfloat16)
    key = f"tensor-{type(store).__name__}"  # random bytes: a key of each face's own
    store.put(key, t)
    out = torch.empty_like(t)
    assert store.get_into(key, out) == t.numel() * 2
    assert torch.equal(t, out)


def test_replicas_land_on_two_nodes_and_pinning(store: Store) -> None:
    store.put("twice", b"x" * 1000, PutOptions(replicas=2, pin=True))
    assert store.get("twice") == b"x" * 1000
    stats = store.stats()
    assert stats["nodes_up"] == 2


def test_eviction_demotes_to_ssd_and_reads_stay_exact(store: Store) -> None:
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (400, 64 * KB), dtype=np.uint8)  # 25 MiB: more than both DRAMs
    keys = [f"evict-{i}" for i in range(len(blocks))]
    for start in range(0, len(keys), 50):
        store.put_many(zip(keys[start : start + 50], blocks[start : start + 50], strict=True))
    out = np.zeros_like(blocks)
    got = store.get_many_into(keys, list(out), verify=True)
    held = [i for i, n in enumerate(got) if n is not None]
    assert len(held) >= 350  # 16 MiB DRAM + 32 MiB SSD hold them nearly all
    assert all(np.array_equal(out[i], blocks[i]) for i in held)
    assert store.stats()["demotions"] > 0
    store.remove_many(keys)


def test_bad_input_is_a_typed_error(store: Store) -> None:
    with pytest.raises(InvalidKey):
        store.put("", b"x")
    with pytest.raises(InvalidArgument, match="empty"):
        store.put("empty", b"")
    store.put("small", b"0123456789")
    with pytest.raises(BufferTooSmall):
        store.get_into("small", bytearray(4))
    with pytest.raises(InvalidArgument, match="2 keys but 1 buffers"):
        store.get_many_into(["a", "b"], [bytearray(1)])


def test_exact_size_reads_a_block_of_another_size_as_a_miss(store: Store) -> None:
    store.put_many([("exact-a", b"a" * 100), ("exact-b", b"b" * 50), ("exact-c", b"c" * 200)])
    bufs = [bytearray(100) for _ in range(4)]
    got = store.get_many_into(["exact-a", "exact-b", "exact-c", "exact-none"], bufs, exact_size=True)
    assert got == [100, None, None, None]
    assert bufs[0] == b"a" * 100 and bufs[1] == bytearray(100) and bufs[2] == bytearray(100)
    assert store.get_many_into(["exact-b"], [bytearray(100)]) == [50]  # without it, a smaller block is read


@pytest.mark.parametrize(("face", "transport"), [("Store", "tcp"), ("Store", "auto"), ("AsyncStore", "tcp")])
def test_a_byte_range_of_each_block_reads_alone(cluster: LocalCluster, face: str, transport: str) -> None:
    blocks = np.random.default_rng(3).integers(0, 256, (6, 4 * KB), dtype=np.uint8)
    name = f"range-{face}-{transport}"
    keys = [f"{name}-{i}" for i in range(6)]
    with connect_client(face, cluster.master_address, ClientConfig(transport=transport)) as s:  # auto: shm here
        s.put_many(zip(keys, blocks, strict=True))
        s.put(f"{name}-short", b"z" * 100)
        out = np.zeros((7, 1000), dtype=np.uint8)
        got = s.get_range_many_into([*keys, f"{name}-short"], 1500, 1000, list(out))
        assert got == [1000] * 6 + [None]
        assert np.array_equal(out[:6], blocks[:, 1500:2500]) and not out[6].any()
        assert s.get_range_many_into(["range-missing"], 0, 10, [bytearray(10)]) == [None]
        with pytest.raises(InvalidArgument, match="start >= 0"):
            s.get_range_many_into(keys[:1], -1, 10, [bytearray(10)])
        with pytest.raises(BufferTooSmall):
            s.get_range_many_into(keys[:1], 0, 10, [bytearray(5)])


def test_async_store(cluster: LocalCluster) -> None:
    async def main() -> None:
        async with await AsyncStore.connect(cluster.master_address) as s:
            assert await s.put("async", b"value") is PutStatus.STORED
            assert await s.put("async", b"other") is PutStatus.EXISTS
            assert await s.get("async") == b"value"
            assert await s.match_prefix(["async", "nope"]) == 1
            assert await s.exists_many(["async", "nope"]) == [True, False]
            # Many gets at once from one loop: batched per node, each answer its own.
            keys = [f"async-many-{i}" for i in range(64)]
            blocks = [bytes([i]) * (100 + i) for i in range(64)]
            assert await s.put_many(zip(keys, blocks, strict=True)) == [PutStatus.STORED] * 64
            assert [k async for k in s.iter_keys("async-many-", page=10)] == sorted(keys)  # in pages, in order
            async with await AsyncStore.connect(cluster.master_address) as fresh:  # no hints: via the master
                assert await asyncio.gather(*(fresh.get(k, verify=True) for k in keys)) == blocks
                assert await asyncio.gather(*(fresh.get(k, verify=True) for k in keys)) == blocks  # by hint
                out = np.zeros((2, 200), dtype=np.uint8)
                assert await fresh.get_many_into(keys[:2], list(out)) == [100, 101]
                assert bytes(out[1][:101]) == blocks[1]
                with pytest.raises(BufferTooSmall):
                    await fresh.get_into(keys[63], bytearray(10))
                assert await s.remove_many(keys[:32]) == 32
                got = await asyncio.gather(*(fresh.get(k) for k in keys))
                assert got == [None] * 32 + blocks[32:]  # removed means gone, even for a remembered node
            with pytest.raises(InvalidKey):
                await s.get("")
            with pytest.raises(InvalidArgument):
                await s.put_many([("only-a-key",)])  # type: ignore[list-item]
            with pytest.raises(InvalidArgument):
                await s.put("x", b"y", PutOptions(replicas=0))
        with pytest.raises(StoreClosed):
            await s.get("async")

    asyncio.run(main())


def test_sizes_listing_and_remove_reports(store: Store) -> None:
    name = f"listed-{type(store).__name__}"
    keys = [f"{name}-{i}" for i in range(5)]
    store.put_many((k, bytes([i]) * (100 + i)) for i, k in enumerate(keys))
    assert store.sizes([*keys[:2], f"{name}-none"]) == [100, 101, None]  # no bytes move
    assert store.list_keys(name, limit=3) == (keys[:3], keys[2])
    assert store.list_keys(name, after=keys[2]) == (keys[3:], "")
    with pytest.raises(InvalidArgument, match="limit"):
        store.list_keys(name, limit=0)
    assert store.remove_report([*keys, f"{name}-none"]) == (5, [])
    assert store.sizes(keys) == [None] * 5


def test_bad_put_input_is_a_typed_error(store: Store) -> None:
    with pytest.raises(InvalidArgument, match="pair"):
        store.put_many([("a1",)])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="replicas"):
        PutOptions(replicas=0)
    with pytest.raises(NoNodes, match="replicas"):
        store.put("five-copies", b"x", PutOptions(replicas=5))  # two nodes: said, not silently fewer
    with pytest.raises(InvalidArgument, match="object"):
        store.put("objects", np.array(["a", None], dtype=object))


def test_remembered_keys_are_read_in_one_trip_to_their_node(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = contextlib.ExitStack()
    with stack:
        _one_trip_reads(stack, cluster, monkeypatch)


def _one_trip_reads(stack: contextlib.ExitStack, cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    # Over TCP: a same-host client copies through the arena under leases, which the master grants.
    store = stack.enter_context(Store.connect(cluster.master_address, ClientConfig(transport="tcp")))
    blocks = [bytes([i]) * (3 * KB + i) for i in range(8)]
    keys = [f"hinted-{i}" for i in range(len(blocks))]
    assert store.put_many(zip(keys, blocks, strict=True)) == [PutStatus.STORED] * len(keys)
    before = store.stats()

    def no_master(self: ClientCore, keys: list[str]) -> Any:
        raise AssertionError(f"the master was asked where {keys} are")

    monkeypatch.setattr(ClientCore, "locate", no_master)
    assert store.get_many(keys, verify=True) == blocks
    out = bytearray(8 * KB)
    assert store.get_into(keys[3], out) == len(blocks[3]) and out[: len(blocks[3])] == blocks[3]
    monkeypatch.undo()
    # The daemon reports the hits: the master counts them, in the tier each was read from (DRAM
    # here: the report may come after a demotion, and must not promote the block back), and keeps
    # its LRU order.
    deadline = time.monotonic() + 5
    while store.stats()["hits"] < before["hits"] + 9 and time.monotonic() < deadline:
        time.sleep(0.02)
    after = store.stats()
    assert after["hits"] >= before["hits"] + 9 and after["dram_hits"] >= before["dram_hits"] + 9
    assert after["ssd_hits"] == before["ssd_hits"]


def test_a_readers_leases_are_released_after_its_reads_not_before(
    sync_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = sync_store  # the face that reads the arena without the daemon, under leases
    # A lease released while the arena copy is still running would let the block be evicted
    # (and its space rewritten) under the reader.
    keys = [f"leased-{i}" for i in range(4)]
    store.put_many((k, bytes([i]) * 5000) for i, k in enumerate(keys))
    assert store._paths.may_lease
    seen: list[list[int]] = []
    fan_out = Store._fan_out

    def watching(self: Store, jobs: Sequence[Job]) -> list[Any]:
        if any(isinstance(job, ReadLocated) for job in jobs):
            seen.append(list(self._leases._pending))  # queued for release while this read runs
        return fan_out(self, jobs)

    monkeypatch.setattr(Store, "_fan_out", watching)
    store._core.hints.forget(keys)  # through the master, under leases
    assert store.get_many(keys) == [bytes([i]) * 5000 for i in range(4)]
    assert seen == [[]]  # nothing of this get queued for release while it reads


def test_stale_or_dead_hints_never_change_an_answer(store: Store, cluster: LocalCluster) -> None:
    store.put("moved", b"m" * 5000)
    store.put("gone", b"g" * 5000)
    with Store.connect(cluster.master_address) as other:
        other.remove("gone")
        assert other.put("gone", b"G" * 6000) is PutStatus.STORED  # same key, other bytes and size
    hints = store._core.hints
    place = hints.get("moved")
    assert place is not None
    other_node = next(n for n in store.nodes() if n.node_id != place[0])
    hints.note([("moved", (other_node.node_id, other_node.address))])  # a node that does not hold it
    hints.note([("absent", place)])  # a key nobody stored
    hints.note([("gone-too", ("nowhere", "127.0.0.1:1"))])  # a node that is not there
    assert store.get_many(["moved", "gone", "absent", "gone-too"]) == [b"m" * 5000, b"G" * 6000, None, None]
    assert hints.get("moved") == place and hints.get("absent") is None
    store.remove("moved")
    assert hints.get("moved") is None
    with Store.connect(cluster.master_address) as other:
        other.put("dropped", b"d" * 100)
        hint = other._core.hints.get("dropped")
        other.remove("dropped")  # removed by someone else: once remove returns, no daemon serves it
    hints.note([("dropped", hint)])
    assert store.get("dropped") is None


@pytest.mark.parametrize("face", FACES)
def test_one_remembered_key_read_in_one_trip_answers_as_the_core_does(face: str, cluster: LocalCluster) -> None:
    """The single-key fast path of both faces (a remembered node, read by key through its daemon)
    gives the answer the core's way gives: stale and dead hints, a block of another size, a short
    buffer, a removed key, and a block whose bytes no longer match its checksum (CorruptBlock with
    verify=True)."""
    with connect_client(face, cluster.master_address, ClientConfig(transport="tcp")) as store:
        _one_remembered_key(store, cluster, face)


def _one_remembered_key(store: Store, cluster: LocalCluster, face: str) -> None:
    store.put(f"{face}-one-moved", b"m" * 5000)
    store.put(f"{face}-one-sized", b"s" * 5000)
    with Store.connect(cluster.master_address) as other:
        other.remove(f"{face}-one-sized")
        assert other.put(f"{face}-one-sized", b"S" * 7000) is PutStatus.STORED
    hints = store._core.hints
    place = hints.get(f"{face}-one-moved")
    assert place is not None
    other_node = next(n for n in store.nodes() if n.node_id != place[0])
    hints.note([(f"{face}-one-moved", (other_node.node_id, other_node.address)), (f"{face}-one-absent", place),
                (f"{face}-one-dead", ("nowhere", "127.0.0.1:1"))])  # fmt: skip
    assert store.get(f"{face}-one-moved") == b"m" * 5000 and store.get(f"{face}-one-absent") is None
    assert store.get(f"{face}-one-dead") is None and store.get(f"{face}-one-sized") == b"S" * 7000
    out = bytearray(7000)
    assert store.get_into(f"{face}-one-sized", out) == 7000 and out == b"S" * 7000
    with pytest.raises(BufferTooSmall):
        store.get_into(f"{face}-one-sized", bytearray(10))
    assert store.get_many_into([f"{face}-one-sized"], [bytearray(8000)], exact_size=True) == [None]
    pattern = bytes(range(256)) * 20
    store.put(f"{face}-one-corrupt", pattern)
    assert store.get(f"{face}-one-corrupt", verify=True) == pattern  # remembered now: read by key
    for arena in Path("/dev/shm").glob(f"kvstore-{cluster.arena_name(0)[:-2]}-*.arena"):  # each daemon's
        with open(arena, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            at = m.find(pattern)
            if at >= 0:
                m[at] ^= 0xFF
    with pytest.raises(CorruptBlock):
        store.get(f"{face}-one-corrupt", verify=True)
    store.remove(f"{face}-one-corrupt")
    assert store.get(f"{face}-one-corrupt") is None


@pytest.mark.parametrize("face", FACES)
def test_a_remembered_node_that_misses_is_asked_once(
    face: str, cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get of a key whose remembered node no longer holds it (or failed) asks that node once, then
    the master: the faces' one-key fast path used to leave the hint for the core, which read the
    same node again (a stalled node cost the get two timeouts)."""
    trips: list[str] = []
    read_direct, read = DataPath.read_direct, ReadBatcher.read

    def counted_direct(self: DataPath, keys: Sequence[str], *args: Any, **kw: Any) -> Any:
        trips.extend(keys)
        return read_direct(self, keys, *args, **kw)

    def counted_read(self: ReadBatcher, key: str) -> Any:
        trips.append(key)
        return read(self, key)

    monkeypatch.setattr(DataPath, "read_direct", counted_direct)
    monkeypatch.setattr(ReadBatcher, "read", counted_read)
    with connect_client(face, cluster.master_address, ClientConfig(transport="tcp")) as store:
        key = f"{face}-missed-once"
        store.put(key, b"x" * 5000)
        hints = store._core.hints
        place = hints.get(key)
        assert place is not None
        elsewhere = next(n for n in store.nodes() if n.node_id != place[0])
        hints.note([(key, (elsewhere.node_id, elsewhere.address))])  # a node that does not hold it
        trips.clear()
        assert store.get(key) == b"x" * 5000
        assert trips == [key], trips  # the wrong node once, then the master's answer (its own read)
        assert hints.get(key) == place  # remembered where it was read


def test_a_daemon_out_of_index_slots_evicts_instead_of_refusing() -> None:
    # 8 MiB of DRAM but only 64 slots in its index: small blocks run out of slots long before bytes.
    slots = {"KVSTORE_DAEMON_DRAM__MAX_BLOCKS": "64"}
    with LocalCluster(1, dram="8MiB", env=slots) as c, Store.connect(c.master_address) as store:
        for i in range(300):
            assert store.put(f"slot-{i}", bytes([i % 256]) * 1000) is PutStatus.STORED
        assert store.stats()["evictions"] >= 300 - 64
        assert store.get_many([f"slot-{i}" for i in range(290, 300)]) == [
            bytes([i % 256]) * 1000 for i in range(290, 300)
        ]


def test_small_blocks_stay_readable_while_dram_has_room() -> None:
    # 4 MiB of DRAM: its index once had 1024 slots (one per 16 KiB), and the master evicted by
    # that count. 4000 blocks of 256 bytes fill a quarter of the bytes: none is evicted.
    with LocalCluster(1, dram="4MiB") as c, Store.connect(c.master_address) as store:
        keys = [f"small-{i}" for i in range(4000)]
        for start in range(0, len(keys), 500):
            batch = keys[start : start + 500]
            assert store.put_many([(k, k.encode().ljust(256, b".")) for k in batch]) == [PutStatus.STORED] * 500
        assert store.stats()["evictions"] == 0
        assert store.get_many(keys, verify=True) == [k.encode().ljust(256, b".") for k in keys]
