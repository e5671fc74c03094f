import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvstore.arena_format import CELL, HEADER_SIZE, ArenaMapping
from kvstore.config import DramConfig
from kvstore.errors import (
    BufferTooSmall,
    CapacityError,
    ConfigError,
    CorruptStore,
    InvalidArgument,
    NotFound,
    ResourceShortage,
    RetryLater,
    StoreBusy,
    StoreClosed,
)
from kvstore.keys import BlockKey
from kvstore.tiers.arena_files import find_arenas, remove_arena
from kvstore.tiers.dram import DramArena, arena_path

K = BlockKey


@pytest.fixture
def config(tmp_path: Path) -> DramConfig:
    # A private directory keeps these tests' arenas apart from /dev/shm; tmpfs semantics are not needed here.
    return DramConfig(capacity=64 * 1024, name="unit", shm_dir=tmp_path, max_blocks=16)


def test_store_read_and_delete(config: DramConfig) -> None:
    arena = DramArena(config)
    assert arena.store(K("a"), memoryview(b"hello"), checksum=7, seq=1)
    assert "a" in arena and len(arena) == 1
    assert arena.read(K("a")) == b"hello"
    buf = bytearray(8)
    assert arena.read_into(K("a"), memoryview(buf)) == 5 and buf[:5] == b"hello"
    assert arena.entry(K("a")).checksum == 7
    assert arena.delete(K("a")) == 5
    assert "a" not in arena and arena.used == 0
    with pytest.raises(NotFound):
        arena.read(K("a"))
    arena.destroy()


def test_reports_no_room_when_bytes_or_slots_run_out(config: DramConfig) -> None:
    arena = DramArena(config)
    assert arena.store(K("big"), memoryview(bytes(60 * 1024)), 0, 0)
    assert not arena.store(K("too-big"), memoryview(bytes(8 * 1024)), 0, 0)
    arena.delete(K("big"))
    for i in range(16):
        assert arena.store(K(f"k{i}"), memoryview(b"x"), 0, 0)
    assert not arena.store(K("k16"), memoryview(b"x"), 0, 0)  # 16 slots only
    arena.destroy()


def test_contents_index_order_and_pins_survive_reopen(config: DramConfig) -> None:
    arena = DramArena(config)
    for i in range(5):
        arena.store(K(f"k{i}"), memoryview(bytes([i]) * (100 + i)), checksum=i, seq=10 + i)
    arena.touch(K("k0"), 99)
    arena.set_pinned(K("k3"), True)
    arena.delete(K("k1"))
    arena.close()
    again = DramArena(config)
    entries = {e.key: e for e in again.entries()}
    assert sorted(entries) == ["k0", "k2", "k3", "k4"]
    assert entries["k0"].seq == 99 and entries["k3"].pinned and not entries["k4"].pinned
    assert again.read(K("k4")) == bytes([4]) * 104
    assert again.used == sum(again.allocator.round_up(100 + i) for i in (0, 2, 3, 4))
    again.allocator.check()
    again.destroy()


def test_uncommitted_writes_are_freed_on_reopen(config: DramConfig) -> None:
    arena = DramArena(config)
    arena.store(K("done"), memoryview(b"1234"), 0, 1)
    view = arena.begin(K("half"), 4096)
    assert view is not None
    view[:2] = b"zz"
    view.release()
    # Simulate a crash: drop the mapping without close(), which would abort the write.
    arena._buf.release()
    arena._mm.close()
    os.close(arena._fd)
    again = DramArena(config)
    assert [e.key for e in again.entries()] == ["done"]
    assert again.used == 64
    again.destroy()


def test_begin_commit_abort(config: DramConfig) -> None:
    arena = DramArena(config)
    view = arena.begin(K("a"), 3)
    assert view is not None and "a" not in arena
    view[:] = b"abc"
    view.release()
    arena.commit(K("a"), checksum=1, seq=1)
    assert arena.read(K("a")) == b"abc"
    with pytest.raises(InvalidArgument):
        arena.begin(K("a"), 3)
    view = arena.begin(K("b"), 3)
    assert view is not None
    view.release()
    arena.abort(K("b"))
    assert "b" not in arena and arena.used == 64
    arena.destroy()


def test_read_into_a_small_buffer_is_an_error(config: DramConfig) -> None:
    arena = DramArena(config)
    arena.store(K("a"), memoryview(b"0123456789"), 0, 0)
    with pytest.raises(BufferTooSmall, match="10 bytes"):
        arena.read_into(K("a"), memoryview(bytearray(9)))
    arena.destroy()


def test_second_writer_is_refused(config: DramConfig) -> None:
    arena = DramArena(config)
    with pytest.raises(StoreBusy, match="another process"):
        DramArena(config)
    arena.close()
    DramArena(config).destroy()


def test_operations_after_close_raise(config: DramConfig) -> None:
    arena = DramArena(config)
    arena.close()
    arena.close()  # idempotent
    with pytest.raises(StoreClosed):
        arena.read(K("a"))
    with pytest.raises(StoreClosed):
        arena.begin(K("a"), 3)
    DramArena.remove(config)


def test_geometry_mismatch_is_a_config_error(config: DramConfig) -> None:
    DramArena(config).close()
    with pytest.raises(ConfigError, match="capacity=65536"):
        DramArena(config.model_copy(update={"capacity": 128 * 1024}))
    DramArena.remove(config)


def _make_file(config: DramConfig) -> Path:
    DramArena(config).close()
    return arena_path(config)


def test_foreign_file_is_refused(config: DramConfig) -> None:
    path = arena_path(config)
    path.write_bytes(b"hello, I am not an arena" * 1000)
    with pytest.raises(CorruptStore, match="not a kvstore DRAM arena"):
        DramArena(config)


def test_truncated_file_is_refused(config: DramConfig) -> None:
    path = _make_file(config)
    os.truncate(path, path.stat().st_size - 4096)
    with pytest.raises(CorruptStore, match="truncated"):
        DramArena(config)
    os.truncate(path, 100)
    with pytest.raises(CorruptStore, match="truncated"):
        DramArena(config)


def test_corrupt_header_is_refused(config: DramConfig) -> None:
    path = _make_file(config)
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"\xff\xff")
    with pytest.raises(CorruptStore, match="header"):
        DramArena(config)


@pytest.mark.parametrize(
    ("field_offset", "value", "match"),
    [
        (0, b"\x09", "invalid state"),
        (CELL, b"\x00", "torn"),  # its second cell's marker
        (2 * CELL, b"\x00", "torn"),  # its key cell's marker
        (2, ((1 << 40) >> 3).to_bytes(5, "little"), "outside"),  # its offset
        (8, bytes(5), "size 0"),
        (2 * CELL + 1, b"\xff", "not UTF-8"),
    ],
)
def test_corrupt_records_are_refused(config: DramConfig, field_offset: int, value: bytes, match: str) -> None:
    arena = DramArena(config)
    arena.store(K("abcdefgh"), memoryview(b"abc"), 0, 0)  # a record of three cells: the last one holds "efgh"
    arena.close()
    with open(arena_path(config), "r+b") as f:
        f.seek(HEADER_SIZE + field_offset)  # cell 0 holds its record
        f.write(value)
    with pytest.raises(CorruptStore, match=match):
        DramArena(config)


def test_overlapping_records_are_refused(config: DramConfig) -> None:
    arena = DramArena(config)
    arena.store(K("a"), memoryview(b"abc"), 0, 0)
    arena.store(K("b"), memoryview(b"abc"), 0, 0)
    arena.close()
    with open(arena_path(config), "r+b") as f:
        first = f.read(HEADER_SIZE + 8)[HEADER_SIZE:]  # state, key length, offset and a key byte of "a"'s record
        f.seek(HEADER_SIZE + 2 * CELL)  # "b"'s record, after the two cells of "a"'s
        f.write(first)
    with pytest.raises(CorruptStore, match="overlaps"):
        DramArena(config)


def test_an_arena_of_the_320_byte_slot_format_is_refused_with_the_way_out(config: DramConfig) -> None:
    import struct

    import xxhash

    path = _make_file(config)
    with open(path, "r+b") as f:
        header = bytearray(f.read(56))  # 48 bytes of fields, then their xxh3
        struct.pack_into("<II", header, 8, 1, 320)  # version 1, 320-byte slots
        header[48:56] = xxhash.xxh3_64_intdigest(bytes(header[:48])).to_bytes(8, "little")
        f.seek(0)
        f.write(header)
    with pytest.raises(CorruptStore, match=r"format version 1; this kvstore reads 2.*--remove-arena unit"):
        DramArena(config)


@pytest.mark.parametrize("key_len", [1, 14, 15, 16, 30, 31, 255, 256])
def test_keys_of_every_record_length_survive_reopen(config: DramConfig, key_len: int) -> None:
    keys = [K("k" * key_len), K(("é" * key_len)[: key_len // 2] or "é"), K(("x" * (key_len - 1)) + "1")]
    arena = DramArena(config)
    for i, key in enumerate(keys):
        assert arena.store(key, memoryview(bytes([i]) * 100), checksum=(1 << 64) - 1 - i, seq=(1 << 56) - 1 - i,
                           pinned=i == 1)  # fmt: skip
    arena.touch(keys[0], 7)
    arena.close()
    again = DramArena(config)
    assert {e.key: (e.checksum, e.seq, e.pinned) for e in again.entries()} == {
        keys[0]: ((1 << 64) - 1, 7, False), keys[1]: ((1 << 64) - 2, (1 << 56) - 2, True),
        keys[2]: ((1 << 64) - 3, (1 << 56) - 3, False),
    }  # fmt: skip
    assert [again.read(k) for k in keys] == [bytes([i]) * 100 for i in range(3)]
    again.destroy()


def test_a_record_cut_short_by_a_crash_is_freed_and_its_cells_reused(config: DramConfig) -> None:
    from kvstore.tiers.slots import encode_head, encode_key

    arena = DramArena(config)
    arena.store(K("kept"), memoryview(b"abc"), 5, 1)
    # A second record written as far as its key cells and second cell: its state byte never came.
    cells = arena._cells.alloc(4)
    assert cells is not None
    head = encode_head(0, False, b"z" * 20, 1024, 10, 9, 9)
    mm, at = arena._slots.locate(cells.offset)
    mm[at + 2 * CELL : at + 4 * CELL] = encode_key(b"z" * 20)
    mm[at + 1 : at + 2 * CELL] = head[1:]
    _crash(arena)
    again = DramArena(config)
    assert [e.key for e in again.entries()] == ["kept"] and not again.is_pending(K("z" * 20))
    mm, at = again._slots.locate(cells.offset)
    assert [mm[at + i * CELL] for i in range(4)] == [0, 0, 0, 0]  # no marker left behind
    assert again.store(K("y" * 20), memoryview(b"new"), 1, 2)  # in those cells
    assert again._index["y" * 20].index == cells.offset
    again.close()
    assert {e.key for e in DramArena(config).entries()} == {"kept", "y" * 20}


def test_the_index_takes_48_bytes_a_block_of_short_keys(tmp_path: Path) -> None:
    # 100,000 blocks of 256 bytes with keys of 11 bytes: the index in the file, over the blocks.
    config = DramConfig(capacity=32 * 1024**2, name="dense", shm_dir=tmp_path, prefault=False)
    arena = DramArena(config, managed=False)
    for i in range(100_000):
        arena.begin_at(K(f"m-{i:09d}"), i * 256, 256).release()
        arena.commit(K(f"m-{i:09d}"), i, i)
    size = arena_path(config).stat().st_size
    per_block = (size - config.capacity) / 100_000
    assert arena.index_bytes / 100_000 <= per_block <= 64, per_block
    assert arena.index_bytes >= 100_000 * 3 * CELL  # a record of three cells each
    arena.close()
    assert len(DramArena(config, managed=False)) == 100_000


def test_view_is_zero_copy(config: DramConfig) -> None:
    arena = DramArena(config)
    data = np.arange(256, dtype=np.uint8)
    arena.store(K("a"), memoryview(data), 0, 0)
    view = arena.view(K("a"))
    assert view.readonly and bytes(view) == data.tobytes()
    view.release()
    arena.destroy()


def test_unmanaged_arena_writes_where_the_master_says(config: DramConfig) -> None:
    arena = DramArena(config, managed=False)
    view = arena.begin_at(K("a"), 4096, 100)
    view[:] = b"a" * 100
    view.release()
    arena.commit(K("a"), 1, 1)
    assert arena.extent(K("a")).offset == 4096 and arena.used == 128
    with pytest.raises(InvalidArgument, match="is unmanaged"):
        arena.begin(K("b"), 10)
    with pytest.raises(InvalidArgument, match="misaligned"):
        arena.begin_at(K("b"), 10, 10)
    with pytest.raises(InvalidArgument, match="outside"):
        arena.begin_at(K("b"), 64 * 1024 - 64, 128)
    with pytest.raises(RetryLater, match="held"):
        arena.begin_at(K("a"), 0, 10)
    arena.close()
    again = DramArena(config, managed=False)
    assert again.read(K("a")) == b"a" * 100 and again.used == 128
    with pytest.raises(InvalidArgument, match="unmanaged"):
        _ = again.allocator
    again.delete(K("a"))
    assert again.used == 0
    again.destroy()


def test_managed_arena_refuses_outside_extents(config: DramConfig) -> None:
    arena = DramArena(config)
    with pytest.raises(InvalidArgument, match="managed"):
        arena.begin_at(K("a"), 0, 10)
    arena.destroy()


def test_an_arena_larger_than_its_filesystem_is_refused_at_creation_and_leaves_nothing(small_fs: Any) -> None:
    fs = small_fs("16m")
    config = DramConfig(capacity=64 * 1024**2, name="big", shm_dir=fs)
    with pytest.raises(ResourceShortage, match=r"DRAM arena .*kvstore-big\.arena: only .* could be reserved"):
        DramArena(config)
    assert list(fs.iterdir()) == []  # neither the arena nor its temporary file
    assert shutil.disk_usage(fs).used == 0  # and no page held


def _sparse_copy(config: DramConfig, target: DramConfig) -> None:
    """Make at ``target`` an arena file as an older kvstore left it: the same header, no page allocated."""
    DramArena(config).close()
    src, dst = arena_path(config), arena_path(target)
    with open(src, "rb") as f:
        head = f.read(HEADER_SIZE)
    with open(dst, "wb") as f:
        f.truncate(src.stat().st_size)
        f.write(head)


def test_a_leftover_arena_is_backed_at_reattach_or_refused_with_the_way_out(tmp_path: Path, small_fs: Any) -> None:
    config = DramConfig(capacity=8 * 1024**2, name="old", shm_dir=tmp_path / "a")
    (tmp_path / "a").mkdir()
    roomy = config.model_copy(update={"shm_dir": tmp_path / "b"})
    (tmp_path / "b").mkdir()
    _sparse_copy(config, roomy)
    assert os.stat(arena_path(roomy)).st_blocks * 512 < arena_path(roomy).stat().st_size
    arena = DramArena(roomy)  # there is room: its pages are reserved now
    assert os.stat(arena_path(roomy)).st_blocks * 512 >= arena_path(roomy).stat().st_size
    arena.close()
    fs = small_fs("4m")
    tight = config.model_copy(update={"shm_dir": fs})
    _sparse_copy(config, tight)
    with pytest.raises(ResourceShortage, match=r"leftover .*kvstore daemon --remove-arena old"):
        DramArena(tight)
    # A client never maps an arena that is not wholly backed (its first write could SIGBUS it).
    with pytest.raises(ResourceShortage, match="not wholly backed"):
        ArenaMapping(arena_path(tight))
    assert remove_arena(tight) > 0 and not arena_path(tight).exists()


def test_leftovers_are_listed_and_removed_but_never_one_in_use(config: DramConfig) -> None:
    arena = DramArena(config)
    other = config.model_copy(update={"name": "gone"})
    DramArena(other).close()
    stray = config.shm_dir / "kvstore-gone.arena.999999999.tmp"  # a creation cut short, by a pid long gone
    stray.write_bytes(b"x")
    found = {(a.name, a.in_use) for a in find_arenas(config.shm_dir)}
    assert found == {("unit", True), ("gone", False), ("", False)}
    with pytest.raises(StoreBusy, match="stop it first"):
        remove_arena(config)
    assert remove_arena(other) > 0
    assert not arena_path(other).exists() and not stray.exists()
    assert remove_arena(other) == 0  # nothing left to remove
    arena.destroy()


def _crash(arena: DramArena) -> None:
    """Drop the mappings without close(), which would abort pending writes: as if the process died."""
    arena._buf.release()
    arena._mm.close()
    arena._slots.close()
    os.close(arena._fd)


def test_the_index_grows_with_small_blocks_and_survives_a_crash(tmp_path: Path) -> None:
    # 1 MiB of data: a new arena has 1024 slots; blocks of 200 bytes take 256, so 4096 fit.
    config = DramConfig(capacity=1024**2, name="grow", shm_dir=tmp_path, prefault=False)
    arena = DramArena(config)
    assert (arena.index_bytes, arena.max_slots) == (1024 * 4 * CELL, 4096)  # room for 2048 records of 2 cells
    size = arena_path(config).stat().st_size
    for i in range(3000):
        assert arena.store(K(f"k{i}"), memoryview(bytes([i % 251]) * 200), i, i + 1), f"k{i} refused"
    assert arena.index_bytes >= 3000 * 2 * CELL and arena_path(config).stat().st_size > size
    half = arena.begin(K("half"), 100)  # in an overflow slot, never committed
    assert half is not None
    half.release()
    _crash(arena)
    again = DramArena(config)
    assert len(again) == 3000 and not again.is_pending(K("half")) and again.used == 3000 * 256
    assert all(again.read(K(f"k{i}")) == bytes([i % 251]) * 200 for i in range(3000))
    assert [e.key for e in sorted(again.entries(), key=lambda e: e.seq)][-1] == "k2999"
    for i in range(3000, 4096):
        assert again.store(K(f"k{i}"), memoryview(b"x"), 0, 0)
    assert not again.store(K("one-too-many"), memoryview(b"x"), 0, 0)  # max_slots: bytes to spare, no slot
    mapping = ArenaMapping(arena_path(config))  # a same-host client maps the data region of a grown file
    assert bytes(mapping.extent(again.extent(K("k7")).offset, 200)) == bytes([7]) * 200
    mapping.close()
    again.close()
    with open(arena_path(config), "r+b") as f:
        f.truncate(arena_path(config).stat().st_size - 100)  # not a whole slot table
    with pytest.raises(CorruptStore, match="not a whole index table"):
        DramArena(config)
    DramArena.remove(config)


def test_an_index_that_cannot_grow_refuses_the_block_and_keeps_the_others(small_fs: Any) -> None:
    fs = small_fs("2m")
    config = DramConfig(capacity=1024**2, name="tight", shm_dir=fs, prefault=False, max_blocks=1024 * 1024)
    arena = DramArena(config, managed=False)
    offsets = iter(range(0, 1024**2, 64))
    stored = 0

    def key(i: int) -> BlockKey:
        return K(f"k{i}".ljust(200, "x"))  # a record of 16 cells: the index outgrows the 2 MiB first

    while True:
        try:
            view = arena.begin_at(key(stored), next(offsets), 10)
        except CapacityError as exc:
            assert "no free index slot" in str(exc) and "could be reserved" in str(exc)
            break
        view.release()
        arena.commit(key(stored), 0, stored)
        stored += 1
    assert stored > 2048 and len(arena) == stored  # the last eighths did not fit: smaller steps did
    arena.close()
    again = DramArena(config, managed=False)
    assert len(again) == stored
    again.destroy()


def test_a_growth_a_crash_cut_short_is_trimmed_at_reopen(small_fs: Any) -> None:
    # The daemon died inside an index growth: the file extended, its pages never reserved, on a
    # file system that cannot back them. The free cells at the end go; every block stays.
    fs = small_fs("2m")
    config = DramConfig(capacity=1024**2, name="cut", shm_dir=fs, prefault=False)
    arena = DramArena(config, managed=False)
    for i in range(3000):  # past the base index: the last records are in the overflow part
        arena.begin_at(K(f"k{i}"), i * 64, 10).release()
        arena.commit(K(f"k{i}"), i, i)
    grown = arena_path(config).stat().st_size
    os.ftruncate(arena._fd, grown + 8 * 1024**2)  # more than the file system holds
    _crash(arena)
    again = DramArena(config, managed=False)
    assert len(again) == 3000 and again.entry(K("k2999")).checksum == 2999
    assert arena_path(config).stat().st_size <= grown  # its own free cells at the end went too
    assert again.begin_at(K("next"), 3000 * 64, 10) is not None  # and it grows again from there
    again.destroy()


def test_a_refused_begin_leaves_no_cells_taken(config: DramConfig) -> None:
    arena = DramArena(config, managed=False)
    before = (arena._cells.used, arena.index_bytes)
    for i in range(40):
        with pytest.raises(InvalidArgument, match="unmanaged"):
            arena.begin(K(f"k{i}"), 10)
    assert (arena._cells.used, arena.index_bytes) == before
    managed = DramArena(config.model_copy(update={"name": "managed"}))
    taken = managed._cells.used  # the one cell between the index's two parts
    with pytest.raises(InvalidArgument, match="an int"):
        managed.begin(K("a"), np.int64(10))  # type: ignore[arg-type]
    assert managed._cells.used == taken
    managed.destroy()
    arena.destroy()


def test_a_seq_past_56_bits_is_refused_not_cut(config: DramConfig) -> None:
    arena = DramArena(config)
    with pytest.raises(InvalidArgument, match="seq"):
        arena.store(K("a"), memoryview(b"x"), 0, 1 << 56)
    assert "a" not in arena and not arena.is_pending(K("a"))
    arena.store(K("a"), memoryview(b"x"), 0, (1 << 56) - 1)
    with pytest.raises(InvalidArgument, match="seq"):
        arena.touch(K("a"), -1)
    arena.destroy()
