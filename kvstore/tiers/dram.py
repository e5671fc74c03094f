"""The DRAM tier: an arena of block bytes and its index in one shared-memory file.

The file (``<shm_dir>/kvstore-<name>.arena``) is a header, a base index, the data region and an
overflow index; its layout and header are defined in :mod:`kvstore.arena_format`, with which a
same-host client maps the data region without loading this module.

The index (:mod:`kvstore.tiers.slots`) is a record of 2 cells and the key's (48 bytes a block
for a key of up to 19 bytes) per block; it grows as blocks need records, so it is sized by
the blocks held, not by a fixed count per byte; a growth only extends the file, so it is
crash-safe as it stands (see that module). At most ``DramConfig.max_slots`` blocks are held.
Format version 1 (a slot of 320 bytes each, key inline) is refused, with the way out.

A block is written in this order: its record with state WRITING, then its bytes, then the
single state byte COMMITTED. The file is a MAP_SHARED mapping of a tmpfs file, so every store
has reached the file when the process dies, however it dies; re-opening keeps COMMITTED records
and frees the others. Hence a killed daemon restarts with its DRAM blocks, and a same-host
client can later map the same file.

One process owns an arena for writing at a time (an exclusive ``flock``).
Invariants: ``_index`` holds exactly the COMMITTED records; ``_pending`` the
WRITING ones; their extents are exactly the allocator's allocated extents, their
cells exactly the cell allocator's (with the one cell between the index's two parts).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.allocator import Allocator, Extent, ExtentSet, align_up
from kvstore.arena_format import CELL, HEADER_SIZE, Geometry, backed, encode_header, read_header
from kvstore.arena_format import page_round as _page_round
from kvstore.config import DramConfig
from kvstore.errors import (
    BufferTooSmall,
    CapacityError,
    ConfigError,
    CorruptStore,
    InvalidArgument,
    ResourceShortage,
    RetryLater,
    StoreBusy,
)
from kvstore.keys import MAX_KEY_BYTES, BlockKey
from kvstore.resources import RESERVE_CHUNK, reserve
from kvstore.tiers.arena_files import arena_path
from kvstore.tiers.base import BlockRecord, IndexedTier
from kvstore.tiers.slots import (
    COMMITTED,
    FREE,
    KEY,
    MAX_OFFSET,
    MAX_SEQ,
    MAX_SIZE,
    PINNED,
    STATE_MASK,
    TAIL,
    WRITING,
    SlotTable,
    encode_head,
    encode_key,
    record_cells,
)

BASE_CELLS_PER_SLOT = 4
"""Cells of a new arena's base index per ``DramConfig.num_slots``: a block with a key of up to 34 bytes."""


@dataclass(slots=True)
class _Slot(BlockRecord):
    index: int
    """Its record's first cell."""
    extent: Extent
    cells: int
    """Its record's cells."""


def _check_seq(seq: int) -> None:
    if not 0 <= seq < MAX_SEQ:
        raise InvalidArgument(f"a block's seq is in [0, 2**56), got {seq}")


def base_cells(config: DramConfig) -> int:
    return config.num_slots * BASE_CELLS_PER_SLOT


def arena_size(config: DramConfig) -> int:
    """Bytes of a new arena file of ``config``: header, base index and data region (the index may
    grow past it later, by 16 bytes a cell)."""
    return _page_round(HEADER_SIZE + base_cells(config) * CELL) + config.capacity


def capacity_within(config: DramConfig, total: int) -> int:
    """The largest data capacity, a multiple of 1 MiB, whose arena (with ``config``'s other settings)
    takes at most ``total`` bytes; 0 when none does."""
    mib = 1024**2
    capacity = total // mib * mib
    while capacity > 0 and arena_size(config.model_copy(update={"capacity": capacity})) > total:
        capacity -= mib
    return capacity


class DramArena(IndexedTier[_Slot]):
    """A capacity-bounded block store in a shared-memory file that survives its process."""

    def __init__(self, config: DramConfig, *, create: bool = True, managed: bool = True) -> None:
        """Open (or create) the arena of ``config``.

        ``managed``: the arena places blocks itself (:meth:`begin`). Unmanaged,
        a master places them (:meth:`begin_at`) and the arena checks that each
        is in bounds and overlaps no block stored or being written: the master
        holds the one allocator, but a wrong (or forged) extent must never land
        on another block's bytes.
        """
        if config.capacity > MAX_OFFSET:
            raise ConfigError(f"a DRAM arena holds at most {MAX_OFFSET} bytes; the config asks for {config.capacity}")
        self.config = config
        self.managed = managed
        self.path = arena_path(config)
        self.capacity = config.capacity
        self.description = f"DRAM arena {config.name}"
        self._index: dict[str, _Slot] = {}
        self._pending: dict[str, _Slot] = {}
        self._closed = False
        self._index_shortage = ""
        created = False
        if not self.path.exists():
            if not create:
                raise CorruptStore(f"DRAM arena {self.path} does not exist")
            self._create()
            created = True
        self._fd = self._open_locked()
        try:
            self._mm = self._map_and_check()
            self._buf = memoryview(self._mm)
            if created and config.prefault:
                self._prefault()
            alloc, self._cells = self._recover()
            self._used = alloc.used
            self._alloc: Allocator | None = alloc if managed else None
            self._placed: ExtentSet | None = None
            if not managed:
                self._placed = ExtentSet()
                for slot in self._index.values():
                    self._placed.add(slot.extent)
        except BaseException:
            if hasattr(self, "_slots"):
                self._slots.close()
            with contextlib.suppress(BufferError):
                if hasattr(self, "_buf"):
                    self._buf.release()
                if hasattr(self, "_mm"):
                    self._mm.close()
            os.close(self._fd)
            raise

    # -- open / create ------------------------------------------------------
    def _geometry(self) -> tuple[int, int]:
        total = arena_size(self.config)
        return total - self.capacity, total

    def _create(self) -> None:
        data_offset, total = self._geometry()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, total)
            # Every page now, or a write to a page tmpfs cannot back kills the writer with SIGBUS.
            reserve(fd, total, f"DRAM arena {self.path}")
            header = encode_header(self.capacity, base_cells(self.config), self.config.alignment, data_offset)
            os.pwrite(fd, header, 0)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        # Rename last: a crash mid-create leaves a stray temp file, never a half-made arena.
        os.rename(tmp, self.path)

    def _open_locked(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError as exc:
            raise CorruptStore(f"cannot open DRAM arena {self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreBusy(f"DRAM arena {self.path} is open for writing in another process") from None
        return fd

    def _map_and_check(self) -> mmap.mmap:
        g = read_header(self.path, self._fd)
        if (g.capacity, g.alignment) != (self.capacity, self.config.alignment):
            raise ConfigError(
                f"DRAM arena {self.path} was created with capacity={g.capacity}, alignment={g.alignment}; the"
                f" config asks for capacity={self.capacity}, alignment={self.config.alignment}"
            )
        self._data_offset = g.data_offset
        total = os.fstat(self._fd).st_size
        if not backed(self._fd, total) and g.overflow_cells:
            # An index growth a crash cut short (the file extended, its pages not reserved yet) left free
            # cells at the end: they go, so that reopening needs no more memory than the blocks held.
            g = g._replace(overflow_cells=self._trim_free_tail(g))
            total = os.fstat(self._fd).st_size
        if not backed(self._fd, total):  # an arena of an older kvstore, or one whose creation was cut short
            try:
                reserve(self._fd, total, f"DRAM arena {self.path}")
            except ResourceShortage as exc:
                raise ResourceShortage(
                    f"{exc}. It is a leftover of an earlier daemon named {self.config.name!r} that this machine "
                    f"can no longer back; its blocks cannot be served. Remove it with "
                    f"`kvstore daemon --remove-arena {self.config.name}` (or start under another --name)"
                ) from None
        mm = mmap.mmap(self._fd, g.data_end, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            self._slots = SlotTable(self.path, self._fd, mm, g.base_cells, g.data_end, g.overflow_cells)
        except BaseException:
            mm.close()
            raise
        return mm

    def _trim_free_tail(self, g: Geometry) -> int:
        """Cut the free cells at the end of the overflow index off the file; the cells it keeps.
        Read backwards with pread, which answers zeros for pages never reserved (a fault on a
        mapping of them would have to allocate them, and SIGBUS where memory is short)."""
        start = _page_round(g.data_end)
        keep, chunk = g.overflow_cells, RESERVE_CHUNK // CELL
        while keep:
            first = max(0, keep - chunk)
            raw = os.pread(self._fd, (keep - first) * CELL, start + first * CELL)
            used = np.flatnonzero(np.frombuffer(raw, dtype=np.uint8)[::CELL])
            if len(used):  # every cell of a record has a nonzero first byte
                keep = first + int(used[-1]) + 1
                break
            keep = first
        os.ftruncate(self._fd, start + keep * CELL if keep else g.data_end)
        return keep

    def _prefault(self) -> None:
        """Write one byte in every page of the data region, so that no write pays a page fault later.
        In chunks: a signal's Python handler runs between two (SIGTERM stops a daemon promptly)."""
        pages = np.frombuffer(self._mm, dtype=np.uint8, count=self.capacity, offset=self._data_offset)
        try:
            for start in range(0, self.capacity, RESERVE_CHUNK):
                pages[start : start + RESERVE_CHUNK : 4096] = 0
        finally:
            del pages

    def _recover(self) -> tuple[Allocator, Allocator]:
        """Rebuild the index from COMMITTED records; free the others (puts cut short by a crash) and
        every marker no record owns. The allocators of the data region and of the cells."""
        cells = self._slots.read()
        total = len(cells)
        first = cells[:, 0]
        kinds = (first & 0xFF).astype(np.uint8)
        bad = ~np.isin(kinds, (FREE, WRITING, COMMITTED, WRITING | PINNED, COMMITTED | PINNED, TAIL, KEY))
        if bad.any():
            at = int(np.argmax(bad))
            raise CorruptStore(f"DRAM arena {self.path}: cell {at} has invalid state {int(kinds[at])}")
        heads = np.flatnonzero(np.isin(kinds & STATE_MASK, (WRITING, COMMITTED)) & (kinds < TAIL))
        for cell in heads[(kinds[heads] & STATE_MASK) == WRITING].tolist():
            self._slots.clear(cell, 1)  # its markers go with the others no record owns, below
        heads = heads[(kinds[heads] & STATE_MASK) == COMMITTED]
        if len(heads) and int(heads[-1]) + 1 >= total:
            raise CorruptStore(f"DRAM arena {self.path}: the record at cell {int(heads[-1])} is cut short")
        word0, word1 = first[heads], cells[heads, 1]
        word2, word3 = first[heads + 1], cells[heads + 1, 1]
        key_lens = ((word0 >> np.uint64(8)) & np.uint64(0xFF)) + np.uint64(1)
        offsets = ((word0 >> np.uint64(16)) & np.uint64((1 << 40) - 1)) << np.uint64(3)
        owned = np.zeros(total, dtype=bool)
        records: list[tuple[int, int]] = []
        extents: list[tuple[int, int]] = []
        end = 0
        sizes = word1 & np.uint64((1 << 40) - 1)
        for cell, key_len, offset, size, tail, seq_word, check, kind in zip(
            heads.tolist(), key_lens.tolist(), offsets.tolist(), sizes.tolist(), (word2 & np.uint64(0xFF)).tolist(),
            (word2 >> np.uint64(8)).tolist(), word3.tolist(), kinds[heads].tolist(), strict=True,
        ):  # fmt: skip
            n = record_cells(key_len)
            if cell < end or cell + n > total or tail != TAIL or not (kinds[cell + 2 : cell + n] == KEY).all():
                raise CorruptStore(f"DRAM arena {self.path}: the record at cell {cell} is torn or overlaps another")
            if not 0 < size < MAX_SIZE:
                raise CorruptStore(f"DRAM arena {self.path}: the record at cell {cell} has size {size}")
            try:
                key = self._slots.key(cell, key_len).decode("utf-8")
            except UnicodeDecodeError:
                raise CorruptStore(f"DRAM arena {self.path}: cell {cell} holds a key that is not UTF-8") from None
            if key in self._index:
                raise CorruptStore(f"DRAM arena {self.path}: key {key!r} is in two records")
            extent = Extent(offset, align_up(size, self.config.alignment))
            self._index[key] = _Slot(size, check, seq_word, bool(kind & PINNED), cell, extent, n)
            extents.append((offset, size))
            records.append((cell, n))
            owned[cell : cell + n] = True
            end = cell + n
        for cell in np.flatnonzero(((kinds == TAIL) | (kinds == KEY)) & ~owned).tolist():
            self._slots.clear(cell, 1)  # a record's markers whose state byte never came (or went)
        try:
            alloc = Allocator.rebuild(self.capacity, self.config.alignment, extents)
        except InvalidArgument as exc:
            raise CorruptStore(f"DRAM arena {self.path}: {exc}") from None
        records.append((self._slots.base, 1))  # no cell: where the data region lies between the two parts
        return alloc, Allocator.rebuild(total, 1, records, track=False)  # its records are in _index and _pending

    # -- Tier interface -----------------------------------------------------
    @property
    def used(self) -> int:
        return self._used

    @property
    def allocator(self) -> Allocator:
        if self._alloc is None:
            raise InvalidArgument(f"{self.description} is unmanaged: its master allocates its extents")
        return self._alloc

    @property
    def alignment(self) -> int:
        return self.config.alignment

    @property
    def index_bytes(self) -> int:
        """Bytes of the index in the arena file now (it grows as blocks need records)."""
        return self._slots.nbytes

    @property
    def max_slots(self) -> int:
        """The most blocks this arena indexes at once: what a master may place on it."""
        return self.config.max_slots

    def extent(self, key: BlockKey) -> Extent:
        """Where the block lives in the data region (for zero-copy transports)."""
        return self._record(key).extent

    def begin(self, key: BlockKey, size: int) -> memoryview | None:
        """Reserve room for ``key`` and return a writable view of it; None when there is no room.

        The block stays invisible until :meth:`commit`; :meth:`abort` (or a
        crash) releases it.
        """
        self._check_new(key, size)
        raw = key.encode("utf-8")
        allocator = self.allocator  # before the cells: an unmanaged arena refuses here
        cells = self._take_cells(len(raw))
        if cells is None:
            return None
        try:
            extent = allocator.alloc(size)
        except BaseException:
            self._cells.free(cells)
            raise
        if extent is None:
            self._cells.free(cells)
            return None
        return self._begin_slot(key, raw, cells, extent, size)

    def begin_at(self, key: BlockKey, offset: int, size: int) -> memoryview:
        """Like :meth:`begin`, at an extent the master chose; raises when it is out of bounds or no slot
        is free, and RetryLater when a block here holds the key or overlaps the extent (one no put
        the master knows placed: its daemon finds and drops such orphans)."""
        if key in self._index or key in self._pending:
            raise RetryLater(f"key {key!r} is held in {self.description} by another block (being dropped)")
        self._check_new(key, size)
        if self.managed:
            raise InvalidArgument(f"{self.description} is managed: it chooses its own extents")
        length = align_up(size, self.alignment)
        if offset < 0 or offset % self.alignment or offset + length > self.capacity:
            raise InvalidArgument(f"extent ({offset}, {size}) is misaligned or outside {self.description}")
        extent = Extent(offset, length)
        assert self._placed is not None
        other = self._placed.overlapping(extent)
        if other is not None:
            raise RetryLater(
                f"extent ({offset}, {size}) overlaps the block at ({other.offset}, {other.length}) in"
                f" {self.description}, which no put placed there (being dropped)"
            )
        raw = key.encode("utf-8")
        cells = self._take_cells(len(raw))
        if cells is None:
            why = f"; {self._index_shortage}" if len(self._index) + len(self._pending) < self.max_slots else ""
            raise CapacityError(f"{self.description} has no free index slot (max_blocks={self.max_slots}{why})")
        self._placed.add(extent)
        return self._begin_slot(key, raw, cells, extent, size)

    def _check_new(self, key: BlockKey, size: int) -> None:
        self._check_open()
        if key in self._index or key in self._pending:
            raise InvalidArgument(f"key {key!r} is already in {self.description}")
        if type(size) is not int or not 0 < size < MAX_SIZE:
            raise InvalidArgument(f"block size must be an int, positive and below {MAX_SIZE}, got {size!r}")

    def _take_cells(self, key_len: int) -> Extent | None:
        """The cells of a new record for a key of ``key_len`` bytes (the index grown when it has no
        room); None when ``max_slots`` blocks are held, or the index cannot grow."""
        if not 0 < key_len <= MAX_KEY_BYTES:  # what a record can hold (keys are checked long before)
            raise InvalidArgument(f"a key of {key_len} bytes: keys are 1 to {MAX_KEY_BYTES} bytes")
        if len(self._index) + len(self._pending) >= self.max_slots:
            return None
        n = record_cells(key_len)
        cells = self._cells.alloc(n)
        if cells is None:
            try:
                self._slots.grow(n)
            except ResourceShortage as exc:
                self._index_shortage = str(exc)
                return None
            self._cells.grow(self._slots.total)
            cells = self._cells.alloc(n)
        return cells

    def _begin_slot(self, key: BlockKey, raw: bytes, cells: Extent, extent: Extent, size: int) -> memoryview:
        self._used += extent.length
        self._slots.write(cells.offset, encode_head(WRITING, False, raw, extent.offset, size, 0, 0), encode_key(raw))
        self._pending[key] = _Slot(size, 0, 0, False, cells.offset, extent, cells.length)
        start = self._data_offset + extent.offset
        return self._buf[start : start + size]

    def is_pending(self, key: BlockKey) -> bool:
        """Whether ``key`` is being written (begun, not yet committed or aborted)."""
        return key in self._pending

    def extents(self) -> Iterator[tuple[BlockKey, Extent]]:
        """Every block's extent, stored or being written (a scan: for the rare questions that need it)."""
        for key, slot in [*self._index.items(), *self._pending.items()]:
            yield BlockKey(key), slot.extent

    def pending(self, key: BlockKey) -> tuple[int, int] | None:
        """(offset, size) of ``key`` while it is being written; None otherwise."""
        slot = self._pending.get(key)
        return None if slot is None else (slot.extent.offset, slot.size)

    def offset_of(self, key: BlockKey) -> int | None:
        """The data-region offset of ``key``'s block, committed or being written; None for neither."""
        slot = self._index.get(key) or self._pending.get(key)
        return None if slot is None else slot.extent.offset

    def pending_view(self, key: BlockKey, offset: int, size: int) -> memoryview | None:
        """A writable view of ``key`` while it is being written at exactly (offset, size); None otherwise."""
        slot = self._pending.get(key)
        if slot is None or slot.extent.offset != offset or slot.size != size:
            return None
        start = self._data_offset + offset
        return self._buf[start : start + size]

    def commit(self, key: BlockKey, checksum: int, seq: int, pinned: bool = False, write_id: int = 0) -> None:
        """Make the block being written under ``key`` readable; ``write_id`` is kept in memory only."""
        _check_seq(seq)
        slot = self._pending.pop(key)
        slot.checksum, slot.seq, slot.pinned, slot.write_id = checksum, seq, pinned, write_id
        self._slots.commit(slot.index, pinned, checksum, seq)
        self._index[key] = slot

    def abort(self, key: BlockKey) -> None:
        slot = self._pending.pop(key)
        self._release(slot)

    def _release(self, slot: _Slot) -> None:
        self._slots.clear(slot.index, slot.cells)
        self._cells.free(Extent(slot.index, slot.cells))
        if self._alloc is not None:
            self._alloc.free(slot.extent)
        if self._placed is not None:
            self._placed.remove(slot.extent)
        self._used -= slot.extent.length

    def store(self, key: BlockKey, data: memoryview, checksum: int, seq: int, pinned: bool = False) -> bool:
        _check_seq(seq)
        dst = self.begin(key, data.nbytes)
        if dst is None:
            return False
        try:
            dst[:] = data
        except BaseException:
            dst.release()
            self.abort(key)
            raise
        dst.release()
        self.commit(key, checksum, seq, pinned)
        return True

    def store_many(self, items: Sequence[tuple[BlockKey, memoryview, int, int, bool]]) -> list[bool]:
        return [self.store(*item) for item in items]

    def view(self, key: BlockKey) -> memoryview:
        """A read-only view of the block's bytes in the arena; release it before the block is deleted."""
        s = self._record(key)
        start = self._data_offset + s.extent.offset
        return self._buf[start : start + s.size].toreadonly()

    def read_into(self, key: BlockKey, dst: memoryview) -> int:
        s = self._record(key)
        if dst.nbytes < s.size:
            raise BufferTooSmall(f"buffer of {dst.nbytes} bytes cannot hold block {key!r} of {s.size} bytes")
        start = self._data_offset + s.extent.offset
        dst[: s.size] = self._buf[start : start + s.size]
        return s.size

    def read(self, key: BlockKey) -> bytes:
        s = self._record(key)
        start = self._data_offset + s.extent.offset
        return self._mm[start : start + s.size]

    def delete(self, key: BlockKey) -> int:
        slot = self._record(key)
        del self._index[key]
        self._release(slot)
        return slot.size

    def delete_many(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            self.delete(key)

    def touch(self, key: BlockKey, seq: int) -> None:
        _check_seq(seq)
        slot = self._record(key)
        slot.seq = seq
        self._slots.set_seq(slot.index, seq)

    def set_pinned(self, key: BlockKey, pinned: bool) -> None:
        slot = self._record(key)
        slot.pinned = pinned
        self._slots.set_pinned(slot.index, pinned)

    # -- lifecycle ----------------------------------------------------------
    def close(self) -> None:
        """Unmap and unlock; the file and its blocks stay for the next open. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for key in list(self._pending):
            self.abort(BlockKey(key))
        self._index.clear()
        # A caller may still hold a view(); the mapping then goes when that view does.
        with contextlib.suppress(BufferError):
            self._buf.release()
            self._mm.close()
        self._slots.close()
        os.close(self._fd)

    def destroy(self) -> None:
        """Close and delete the shared-memory file and every block in it."""
        self.close()
        self.path.unlink(missing_ok=True)

    @staticmethod
    def remove(config: DramConfig) -> None:
        """Delete the arena file of ``config`` if there is one (it must not be open)."""
        arena_path(config).unlink(missing_ok=True)
