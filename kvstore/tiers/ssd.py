"""The SSD tier: blocks in an LMDB environment on local disk.

Two named databases: ``meta`` (key -> size u64, checksum u64, seq u64, flags
u8) and ``data`` (key -> bytes), plus ``info`` holding the format marker that
tells our environment from a foreign one. A block's meta and data are written
in the same transaction, so a block is either wholly there or absent after any
crash. Reads copy straight out of LMDB's map (``buffers=True``) into the
caller's buffer.

``used`` counts block bytes, and ``capacity`` bounds it. LMDB stores a large
value in whole pages, so the map is sized at twice the capacity by default;
should it still fill (``MDB_MAP_FULL``), :meth:`store` reports no room.

A disk that fills before the tier does (other files on it, or a filesystem
smaller than ``capacity``), or that fails a write, does not stop the tier: the
blocks of the failed write report False (the caller drops them: it is a
cache), ``capacity`` is lowered to what the disk holds (:meth:`refresh_capacity`),
and ``fault`` says why until the disk has room for the configured size again.

One process owns an environment at a time (an exclusive ``flock`` on
``kvstore.lock`` beside it). The in-memory index mirrors ``meta``; ``seq``
updates by :meth:`touch` stay in memory (persisting every read would cost a
write transaction), so after a restart blocks are ordered by when they were
written to this tier.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lmdb

from kvstore.config import SsdConfig, format_size
from kvstore.errors import BufferTooSmall, CorruptStore, InvalidArgument, StoreBusy
from kvstore.keys import BlockKey
from kvstore.resources import allocated, fs_free
from kvstore.tiers.base import BlockRecord, IndexedTier

FORMAT = b"kvstore-ssd-v1"
_META = struct.Struct("<QQQB")  # size, checksum, seq, flags
FLAG_PINNED = 1

DISK_SHARE = 0.9
"""Of a disk that cannot hold the configured capacity, the share the tier's blocks may take."""
IO_FAULT_HOLD_S = 60.0
"""After a write failed for another reason than space, how long the tier takes nothing."""
ROOM_PRIOR_BYTES = 1 << 20
"""How a tier's pages compare with its blocks' bytes is taken as equal for this much of each, before
what it holds says otherwise (see ``SsdTier._room``)."""


class _WriteFailed(Exception):
    """A write transaction the disk refused (full, or an I/O error); the tier degrades on it."""


@dataclass(slots=True)
class _Meta(BlockRecord):
    stored_seq: int
    """The seq on disk: when the block was written to this tier (``seq``, the last use, stays in memory)."""


class SsdTier(IndexedTier[_Meta]):
    """A capacity-bounded block store in LMDB. Single-threaded: its owner serialises calls."""

    def __init__(self, config: SsdConfig) -> None:
        if config.path is None or config.capacity <= 0:
            raise InvalidArgument("the SSD tier needs ssd.path and a positive ssd.capacity")
        self.config = config
        self.path = Path(config.path)
        self.capacity = config.capacity
        self.description = f"SSD tier {self.path}"
        self._index: dict[str, _Meta] = {}
        self._used = 0
        self._closed = False
        self.fault = ""
        """Why the tier holds less than its configured capacity (its last failed write); "" while healthy."""
        self.failed_writes = 0
        """Blocks that a failed write could not store, since the tier opened."""
        self._fault_until = 0.0
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.path / "kvstore.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreBusy(f"SSD tier {self.path} is open in another process") from None
        try:
            self._open()
        except BaseException:
            os.close(self._lock_fd)
            raise

    def _open(self) -> None:
        data_file = self.path / "data.mdb"
        existed = data_file.exists()
        try:
            self._env = lmdb.open(
                str(self.path),
                map_size=self.config.effective_map_size,
                subdir=True,
                max_dbs=4,
                sync=self.config.sync,
                metasync=self.config.sync,
                readahead=False,
                max_readers=64,
            )
        except lmdb.Error as exc:
            raise CorruptStore(f"SSD tier {self.path} cannot be opened as LMDB: {exc}") from None
        try:
            self._check_size(data_file)
            with self._env.begin(write=not existed) as txn:
                try:
                    info = self._env.open_db(b"info", txn=txn, create=not existed)
                except lmdb.NotFoundError:
                    raise CorruptStore(f"{self.path} is an LMDB environment but not a kvstore SSD tier") from None
                marker = txn.get(b"format", db=info)
                if not existed:
                    txn.put(b"format", FORMAT, db=info)
                elif marker != FORMAT:
                    raise CorruptStore(f"{self.path} is an LMDB environment but not a kvstore SSD tier ({marker!r})")
            with self._env.begin(write=True) as txn:
                self._meta = self._env.open_db(b"meta", txn=txn)
                self._data = self._env.open_db(b"data", txn=txn)
            with self._env.begin() as txn:
                for raw_key, raw in txn.cursor(db=self._meta):
                    self._load_entry(raw_key, raw)
        except lmdb.Error as exc:
            self._env.close()
            raise CorruptStore(f"SSD tier {self.path} is damaged: {exc}") from None
        except BaseException:
            self._env.close()
            raise

    def _check_size(self, data_file: Path) -> None:
        """A data file shorter than LMDB's last page would fault on first touch: refuse it."""
        needed = (self._env.info()["last_pgno"] + 1) * self._env.stat()["psize"]
        have = data_file.stat().st_size
        if have < needed:
            raise CorruptStore(f"SSD tier {self.path} is truncated: data.mdb has {have} bytes, LMDB needs {needed}")

    def _load_entry(self, raw_key: bytes, raw: bytes) -> None:
        if len(raw) != _META.size:
            raise CorruptStore(
                f"SSD tier {self.path}: record of {raw_key[:40]!r} is {len(raw)} bytes, not {_META.size}"
            )
        size, check, seq, flags = _META.unpack(raw)
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptStore(f"SSD tier {self.path} holds a key that is not UTF-8: {raw_key[:40]!r}") from None
        self._index[key] = _Meta(size, check, seq, bool(flags & FLAG_PINNED), seq)
        self._used += size

    # -- Tier interface -----------------------------------------------------
    @property
    def used(self) -> int:
        return self._used

    def store(self, key: BlockKey, data: memoryview, checksum: int, seq: int, pinned: bool = False) -> bool:
        return self.store_many([(key, data, checksum, seq, pinned)])[0]

    def store_many(self, items: Sequence[tuple[BlockKey, memoryview, int, int, bool]]) -> list[bool]:
        """Write blocks in one transaction; a block that does not fit reports False, the others are kept."""
        self._check_open()
        fits: list[bool] = []
        budget = self.capacity - self._used
        for key, data, _, _, _ in items:
            if key in self._index:
                raise InvalidArgument(f"key {key!r} is already in SSD tier {self.path}")
            ok = 0 < data.nbytes <= budget
            budget -= data.nbytes if ok else 0
            fits.append(ok)
        chosen = [item for item, ok in zip(items, fits, strict=True) if ok]
        if not chosen:
            return fits
        try:
            self._write(chosen)
            return fits
        except _WriteFailed as exc:
            self._failed(exc, len(chosen))
            return [False] * len(items)
        except lmdb.MapFullError:
            if len(chosen) == 1:
                return [False] * len(items)
        # Fall back to one transaction a block so that whatever fits is kept.
        for i, item in enumerate(items):
            if fits[i]:
                try:
                    self._write([item])
                except lmdb.MapFullError:
                    fits[i] = False
                except _WriteFailed as exc:
                    rest = [j for j in range(i, len(items)) if fits[j]]
                    self._failed(exc, len(rest))
                    for j in rest:
                        fits[j] = False
                    break
        return fits

    def _failed(self, exc: _WriteFailed, blocks: int) -> None:
        self.failed_writes += blocks
        self._fault_until = 0.0
        self.refresh_capacity()
        if not self.degraded:  # not for want of space (an I/O error): take nothing more for a while
            self.capacity = self._used
            self._fault_until = time.monotonic() + IO_FAULT_HOLD_S
        self.fault = f"write failed: {exc}"

    def _write(self, items: Sequence[tuple[BlockKey, memoryview, int, int, bool]]) -> None:
        try:
            with self._env.begin(write=True) as txn:
                for key, data, check, seq, pinned in items:
                    raw_key = key.encode("utf-8")
                    txn.put(raw_key, _META.pack(data.nbytes, check, seq, FLAG_PINNED if pinned else 0), db=self._meta)
                    txn.put(raw_key, data, db=self._data)
        except lmdb.MapFullError:
            raise
        except lmdb.Error as exc:  # ENOSPC, EIO: the transaction is aborted, nothing of it is kept
            raise _WriteFailed(str(exc)) from None
        for key, data, check, seq, pinned in items:
            self._index[key] = _Meta(data.nbytes, check, seq, pinned, seq)
            self._used += data.nbytes

    def refresh_capacity(self) -> int:
        """Lower ``capacity`` to what the disk can hold now (the blocks held and the free space of
        its filesystem), or raise it back towards the configured size once there is room again;
        clears ``fault`` when the configured size fits. After a write failed with room on the disk
        (an I/O error) the tier takes nothing for ``IO_FAULT_HOLD_S``, then tries again. Safe from
        another thread than the owner's (it reads the tier's size and LMDB's statistics only).
        Returns the capacity."""
        if self._closed or time.monotonic() < self._fault_until:
            return self.capacity
        try:
            room = self._room()
        except (lmdb.Error, OSError) as exc:
            self.fault = f"its disk cannot be measured: {exc}"
            return self.capacity
        # Short of room, keep some of it free: LMDB needs pages of its own (the tree, its free list)
        # besides a block's, and reuses pages freed by earlier transactions only.
        self.capacity = self.config.capacity if room >= self.config.capacity else int(room * DISK_SHARE)
        if self.capacity == self.config.capacity:
            self.fault = ""
        elif not self.fault:
            configured = format_size(self.config.capacity)
            self.fault = f"its disk has room for {format_size(room)} of the {configured} configured"
        return self.capacity

    def _room(self) -> int:
        """Block bytes the disk can hold: its free space and the data file (what it holds and the
        pages it has freed, which LMDB reuses), in the proportion of the file's pages in use to the
        block bytes they hold now (a block takes whole pages, and the tree some more), counted from
        :data:`ROOM_PRIOR_BYTES` of pages and bytes alike: the few pages of a tier that holds little
        (each tree's first leaf) say nothing of what blocks will take (one 4 KiB block in four pages
        made a 56 MiB disk look able to hold 14 MiB, and the tier degraded before it was used)."""
        disk = allocated(self.path / "data.mdb") + fs_free(self.path)
        pages = 0
        with self._env.begin() as txn:
            for db in (self._meta, self._data):
                stat = txn.stat(db)
                pages += stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        in_use = pages * self._env.stat()["psize"]
        if in_use <= self._used:
            return disk
        return disk * (self._used + ROOM_PRIOR_BYTES) // (in_use + ROOM_PRIOR_BYTES)

    @property
    def degraded(self) -> bool:
        return self.capacity < self.config.capacity

    def read_into(self, key: BlockKey, dst: memoryview) -> int:
        meta = self._record(key)
        if dst.nbytes < meta.size:
            raise BufferTooSmall(f"buffer of {dst.nbytes} bytes cannot hold block {key!r} of {meta.size} bytes")
        with self._env.begin(buffers=True) as txn:
            src = txn.get(key.encode("utf-8"), db=self._data)
            if src is None or len(src) != meta.size:
                raise CorruptStore(f"SSD tier {self.path}: data of {key!r} is missing or has the wrong size")
            dst[: meta.size] = src
        return meta.size

    @contextmanager
    def views(self, keys: Sequence[BlockKey]) -> Iterator[list[memoryview]]:
        """Zero-copy views of blocks inside LMDB's map, in one read transaction, valid until the ``with`` ends.

        One transaction for the batch: LMDB allows a thread one read transaction at a time.
        """
        metas = [self._record(key) for key in keys]
        with self._env.begin(buffers=True) as txn:
            out = []
            for key, meta in zip(keys, metas, strict=True):
                src = txn.get(key.encode("utf-8"), db=self._data)
                if src is None or len(src) != meta.size:
                    raise CorruptStore(f"SSD tier {self.path}: data of {key!r} is missing or has the wrong size")
                out.append(memoryview(src))
            yield out

    def read(self, key: BlockKey) -> bytes:
        out = bytearray(self._record(key).size)
        self.read_into(key, memoryview(out))
        return bytes(out)

    def delete(self, key: BlockKey) -> int:
        size = self._record(key).size
        self.delete_many([key])
        return size

    def delete_many(self, keys: Sequence[BlockKey]) -> None:
        """Delete blocks in one transaction; raises :class:`NotFound` (deleting nothing) if any is absent."""
        metas = [self._record(key) for key in keys]
        try:
            with self._env.begin(write=True) as txn:
                for key in keys:
                    raw_key = key.encode("utf-8")
                    txn.delete(raw_key, db=self._meta)
                    txn.delete(raw_key, db=self._data)
        except lmdb.Error as exc:
            raise CorruptStore(f"SSD tier {self.path}: delete failed: {exc}") from None
        for key, meta in zip(keys, metas, strict=True):
            del self._index[key]
            self._used -= meta.size

    def touch(self, key: BlockKey, seq: int) -> None:
        self._record(key).seq = seq

    def set_pinned(self, key: BlockKey, pinned: bool) -> None:
        meta = self._record(key)
        with self._env.begin(write=True) as txn:
            txn.put(
                key.encode("utf-8"),
                _META.pack(meta.size, meta.checksum, meta.stored_seq, FLAG_PINNED if pinned else 0),
                db=self._meta,
            )
        meta.pinned = pinned

    # -- lifecycle ----------------------------------------------------------
    def close(self) -> None:
        """Flush and close the environment; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._index.clear()
        try:
            self._env.sync(True)
        finally:
            self._env.close()
            os.close(self._lock_fd)
