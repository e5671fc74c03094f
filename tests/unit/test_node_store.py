from pathlib import Path

import numpy as np
import pytest

from kvstore.errors import (
    BufferTooSmall,
    CapacityError,
    CorruptBlock,
    CorruptStore,
    InvalidArgument,
    InvalidKey,
    NotFound,
    StoreBusy,
    StoreClosed,
)
from kvstore.keys import BlockKey, checksum
from kvstore.node_store import NodeStore
from kvstore.policy import TierName
from kvstore.results import PutStatus
from kvstore.tiers.dram import arena_path
from tests.conftest import node_config

KB = 1024
DRAM, SSD = TierName.DRAM, TierName.SSD
K = BlockKey
EXACT = {"high_watermark": 1.0, "low_watermark": 1.0, "promote_after_hits": 2}


def block(i: int, size: int = KB) -> bytes:
    return bytes([i % 251]) * size


def test_put_get_exists_delete(tmp_path: Path) -> None:
    store = NodeStore(node_config(tmp_path))
    assert store.put("a", b"hello") is PutStatus.STORED
    assert store.get("a") == b"hello"
    assert store.exists("a") and not store.exists("b")
    assert store.get("b") is None
    assert store.delete("a") and not store.delete("a")
    assert store.get("a") is None
    s = store.stats()
    assert (s.hits, s.misses, s.puts) == (1, 2, 1)
    store.destroy()


def test_put_of_an_existing_key_keeps_the_stored_bytes(tmp_path: Path) -> None:
    store = NodeStore(node_config(tmp_path))
    store.put("a", b"first")
    assert store.put("a", b"second!") is PutStatus.EXISTS
    assert store.get("a") == b"first"
    assert store.stats().put_exists == 1
    store.destroy()


def test_batch_forms(tmp_path: Path) -> None:
    store = NodeStore(node_config(tmp_path))
    assert store.put_many([("a", b"1"), ("b", b"22"), ("a", b"x")]) == [
        PutStatus.STORED,
        PutStatus.STORED,
        PutStatus.EXISTS,
    ]
    assert store.get_many(["a", "zz", "b"]) == [b"1", None, b"22"]
    assert store.exists_many(["a", "zz"]) == [True, False]
    bufs = [bytearray(4), bytearray(4)]
    assert store.get_many_into(["b", "zz"], bufs) == [2, None]
    assert bufs[0][:2] == b"22"
    assert store.match_prefix(["a", "b", "zz", "a"]) == 2
    assert store.match_prefix([]) == 0
    assert store.delete_many(["a", "zz", "b", "a"]) == 2
    with pytest.raises(InvalidArgument, match="2 keys but 1 buffers"):
        store.get_many_into(["a", "b"], [bytearray(1)])
    store.destroy()


def test_batches_are_validated_before_anything_is_written(tmp_path: Path) -> None:
    store = NodeStore(node_config(tmp_path))
    with pytest.raises(InvalidKey):
        store.put_many([("ok", b"1"), ("", b"2")])
    assert not store.exists("ok")
    store.destroy()


def test_zero_copy_numpy_and_get_into(tmp_path: Path) -> None:
    store = NodeStore(node_config(tmp_path))
    src = np.arange(1000, dtype=np.float32)
    store.put("arr", src)
    dst = np.zeros(1000, dtype=np.float32)
    assert store.get_into("arr", dst) == 4000
    assert np.array_equal(src, dst)
    with pytest.raises(BufferTooSmall, match="4000 bytes"):
        store.get_into("arr", np.zeros(999, dtype=np.float32))
    with pytest.raises(InvalidArgument, match="read-only"):
        store.get_into("arr", b"x" * 4000)
    with pytest.raises(InvalidArgument, match="contiguous"):
        store.put("strided", np.arange(100)[::2])
    store.destroy()


def test_torch_cpu_tensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    store = NodeStore(node_config(tmp_path))
    src = torch.randn(64, 32, dtype=torch.bfloat16)
    store.put("t", src)
    dst = torch.empty_like(src)
    assert store.get_into("t", dst) == src.numel() * 2
    assert torch.equal(src, dst)
    store.destroy()


@pytest.mark.parametrize(
    ("key", "data", "error", "match"),
    [
        ("", b"x", InvalidKey, "empty"),
        ("x" * 300, b"x", InvalidKey, "256"),
        (5, b"x", InvalidKey, "int"),
        ("k", b"", InvalidArgument, "empty"),
        ("k", 12345, InvalidArgument, "int"),
        ("k", "text", InvalidArgument, "str"),
        ("k", "8MiB of zeros", CapacityError, "larger than the DRAM tier"),
    ],
)
def test_bad_puts_are_typed_errors(tmp_path: Path, key: object, data: object, error: type, match: str) -> None:
    store = NodeStore(node_config(tmp_path))
    if data == "8MiB of zeros":
        data = bytes(8 * KB * KB)
    with pytest.raises(error, match=match):
        store.put(key, data)
    store.destroy()


def test_lru_blocks_are_demoted_then_dropped_in_order(tmp_path: Path) -> None:
    store = NodeStore(node_config(tmp_path, dram=4 * KB, ssd=3 * KB, eviction=EXACT))
    for i in range(4):
        store.put(f"k{i}", block(i))
    store.get("k0")  # k0 becomes DRAM's newest
    store.put("k4", block(4))
    assert store.lru_keys(DRAM) == ["k2", "k3", "k0", "k4"]
    assert store.lru_keys(SSD) == ["k1"]
    for i in range(5, 8):
        store.put(f"k{i}", block(i))
    assert store.lru_keys(DRAM) == ["k4", "k5", "k6", "k7"]
    assert store.lru_keys(SSD) == ["k2", "k3", "k0"]  # k1, SSD's oldest, was dropped for k0
    s = store.stats()
    assert (s.demotions, s.ssd_drops, s.dram_drops) == (4, 1, 0)
    assert store.get("k1") is None and store.get("k3") == block(3)
    store.destroy()


def test_ssd_block_is_promoted_after_n_hits(tmp_path: Path) -> None:
    store = NodeStore(node_config(tmp_path, dram=2 * KB, ssd=4 * KB, eviction=EXACT))
    for i in range(3):
        store.put(f"k{i}", block(i))
    assert store.tier_of("k0") is SSD
    assert store.get("k0") == block(0) and store.tier_of("k0") is SSD
    assert store.get("k0", verify=True) == block(0) and store.tier_of("k0") is DRAM
    assert store.lru_keys(DRAM) == ["k2", "k0"] and store.lru_keys(SSD) == ["k1"]
    assert store.stats().promotions == 1
    store.destroy()


def test_pinned_blocks_are_never_evicted(tmp_path: Path) -> None:
    store = NodeStore(node_config(tmp_path, dram=2 * KB, eviction=EXACT))
    store.put("p", block(1), pin=True)
    store.put("a", block(2))
    store.put("b", block(3))
    assert store.exists("p") and not store.exists("a")
    store.pin("b")
    with pytest.raises(CapacityError, match="pinned"):
        store.put("c", block(4))
    store.unpin("p")
    store.put("c", block(4))
    assert not store.exists("p") and store.exists("b")
    with pytest.raises(NotFound):
        store.pin("missing")
    store.destroy()


def test_fragmentation_evicts_more_until_a_contiguous_extent_frees(tmp_path: Path) -> None:
    store = NodeStore(node_config(tmp_path, dram=8 * KB, eviction=EXACT))
    for i in range(8):
        store.put(f"k{i}", block(i))
    store.delete_many(["k1", "k3", "k5"])  # 3 KiB free, no two adjacent
    store.put("big", block(9, 2 * KB))
    assert store.get("big") == block(9, 2 * KB)
    assert store.dram.used <= store.dram.capacity
    store.dram.allocator.check()
    store.destroy()


def test_checksum_mismatch_is_detected(tmp_path: Path) -> None:
    store = NodeStore(node_config(tmp_path))
    store.put("a", block(1))
    start = store.dram._data_offset + store.dram.extent("a").offset  # type: ignore[arg-type]
    store.dram._mm[start] ^= 0xFF
    assert store.get("a") is not None  # unverified read
    with pytest.raises(CorruptBlock, match="checksum"):
        store.get("a", verify=True)
    with pytest.raises(CorruptBlock):
        store.get_into("a", bytearray(KB), verify=True)
    store.destroy()


def test_verify_reads_config_checks_every_read(tmp_path: Path) -> None:
    store = NodeStore(node_config(tmp_path, verify_reads=True))
    store.put("a", block(1))
    start = store.dram._data_offset + store.dram.extent("a").offset  # type: ignore[arg-type]
    store.dram._mm[start] ^= 0xFF
    with pytest.raises(CorruptBlock):
        store.get("a")
    store.destroy()


def test_reopen_recovers_both_tiers_and_dram_order(tmp_path: Path) -> None:
    config = node_config(tmp_path, dram=4 * KB, ssd=8 * KB, eviction=EXACT)
    store = NodeStore(config)
    for i in range(8):
        store.put(f"k{i}", block(i))
    store.get("k4")
    dram_order, ssd_keys = store.lru_keys(DRAM), set(store.lru_keys(SSD))
    store.close()
    again = NodeStore(config)
    assert again.lru_keys(DRAM) == dram_order
    assert set(again.lru_keys(SSD)) == ssd_keys
    for i in range(8):
        assert again.get(f"k{i}", verify=True) == block(i)
    again.destroy()


def test_a_key_left_in_both_tiers_by_a_crash_keeps_its_dram_copy(tmp_path: Path) -> None:
    config = node_config(tmp_path, dram=4 * KB, ssd=8 * KB)
    store = NodeStore(config)
    store.put("a", block(1))
    assert store.ssd is not None
    store.ssd.store("a", memoryview(block(1)), 0, 0)  # as if a demotion died before deleting from DRAM
    store.close()
    again = NodeStore(config)
    assert again.tier_of("a") is DRAM and again.ssd is not None and "a" not in again.ssd
    again.destroy()


def test_a_demotion_that_finds_a_copy_left_on_ssd_reuses_it(tmp_path: Path) -> None:
    # A move that died half-way (here: as if after its SSD write) leaves the block in both tiers
    # while the store runs on; demoting it later must not fail every put that needs room.
    store = NodeStore(node_config(tmp_path, dram=4 * KB, ssd=8 * KB, eviction=EXACT))
    store.put("a", block(1))
    assert store.ssd is not None
    store.ssd.store(K("a"), memoryview(block(1)), checksum(block(1)), 0)
    for i in range(2, 6):
        store.put(f"k{i}", block(i))  # DRAM holds four: "a", its oldest, is demoted
    assert store.tier_of("a") is SSD and store.get("a", verify=True) == block(1)
    assert store.stats().demotions == 1
    store.destroy()


def test_a_promotion_whose_ssd_delete_fails_keeps_the_block_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = NodeStore(node_config(tmp_path, dram=2 * KB, ssd=4 * KB, eviction=EXACT))
    for i in range(3):
        store.put(f"k{i}", block(i))
    assert store.tier_of("k0") is SSD and store.ssd is not None

    def failing_delete(key: BlockKey) -> int:
        raise CorruptStore("SSD tier: delete failed: injected")

    monkeypatch.setattr(store.ssd, "delete", failing_delete)
    store.get("k0")
    assert store.get("k0", verify=True) == block(0) and store.tier_of("k0") is DRAM  # promoted, old copy left
    monkeypatch.undo()
    for i in range(3, 6):
        store.put(f"k{i}", block(i))  # k0 is demoted again, onto the copy it left
    assert store.tier_of("k0") is SSD and store.get("k0", verify=True) == block(0)
    store.close()
    again = NodeStore(store.config)
    assert again.tier_of("k0") is SSD
    for key in again.lru_keys(DRAM) + again.lru_keys(SSD):
        assert again.get(key, verify=True) == block(int(key[1:]))
    again.destroy()


def test_small_blocks_stay_readable_while_dram_has_room(tmp_path: Path) -> None:
    # 1 MiB of DRAM used to index 1024 blocks (one slot per 16 KiB): 3000 blocks of 256 bytes
    # fill three quarters of its bytes, and every one of them must stay readable, also after a reopen.
    config = node_config(tmp_path, dram="1MiB")
    store = NodeStore(config)
    for i in range(3000):
        store.put(f"s{i}", block(i, 256))
    assert store.stats().dram.blocks == 3000 and store.stats().dram_drops == 0
    store.close()
    again = NodeStore(config)
    assert all(again.get(f"s{i}", verify=True) == block(i, 256) for i in range(3000))
    again.destroy()


def test_closed_store_raises_and_second_opener_is_refused(tmp_path: Path) -> None:
    config = node_config(tmp_path)
    store = NodeStore(config)
    with pytest.raises(StoreBusy):
        NodeStore(config)
    store.close()
    store.close()
    with pytest.raises(StoreClosed):
        store.get("a")
    with pytest.raises(StoreClosed):
        store.put("a", b"x")
    NodeStore(config).destroy()
    assert not arena_path(config.dram).exists()


def test_ssd_failure_at_open_releases_the_arena(tmp_path: Path) -> None:
    config = node_config(tmp_path, ssd=KB * KB)
    assert config.ssd.path is not None
    config.ssd.path.mkdir(parents=True)
    (config.ssd.path / "data.mdb").write_bytes(b"garbage" * 1000)
    with pytest.raises(Exception, match="SSD tier"):
        NodeStore(config)
    (config.ssd.path / "data.mdb").unlink()
    NodeStore(config).destroy()  # the arena lock was released


def test_a_batch_get_never_evicts_its_own_blocks(tmp_path: Path) -> None:
    eviction = {"high_watermark": 1.0, "low_watermark": 1.0, "promote_after_hits": 1}
    store = NodeStore(node_config(tmp_path, dram=2 * KB, ssd=2 * KB, eviction=eviction))
    for i in range(4):
        store.put(f"k{i}", block(i))
    assert store.lru_keys(SSD) == ["k0", "k1"]
    # Promoting k0 needs SSD room for a demoted DRAM block; without the batch's lease, k1 would be dropped for it.
    assert store.get_many(["k0", "k1"]) == [block(0), block(1)]
    assert store.lru_keys(DRAM) == ["k0", "k1"]
    assert store.get_many_into(["k0", "k1"], [bytearray(KB), bytearray(KB)]) == [KB, KB]
    assert not store._dram_lru.is_leased("k0") and not store._ssd_lru.is_leased("k1")
    store.destroy()
