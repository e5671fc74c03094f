"""The DRAM arena file's layout, as its daemon makes it and a same-host client maps it.

File layout (``<shm_dir>/kvstore-<name>.arena``, little-endian)::

    [0, 4096)             header: magic, version, geometry, xxh3 of the header
    [4096, data_offset)   base index: 16-byte cells, BASE_CELLS_PER_SLOT per DramConfig.num_slots
    [data_offset, +cap)   data region, carved by :class:`kvstore.allocator.Allocator`
    [page past it, EOF)   overflow index: grown on demand, the file's size says how many cells

Here are the header (:func:`encode_header`, and :func:`read_header`, which checks it and the
file's size against it) and :class:`ArenaMapping`, the data region mapped by another process.
The index's records are :mod:`kvstore.tiers.slots`'s and the arena itself is
:class:`kvstore.tiers.dram.DramArena`: a client needs neither, so it loads neither.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import NamedTuple

import xxhash

from kvstore.errors import CorruptStore, InvalidArgument, ResourceShortage

MAGIC = b"KVSARENA"
VERSION = 2
HEADER_SIZE = 4096
CELL = 16
"""Bytes of an index cell, in both parts of the index (the header records it)."""
_HEADER = struct.Struct("<8sIIQQIIQ")  # magic, version, cell size, capacity, base cells, alignment, pad, data_offset
_HEADER_SUM = struct.Struct("<Q")


def page_round(n: int) -> int:
    return (n + 4095) & ~4095


def overflow_cells(path: Path | str, data_end: int, size: int) -> int:
    """How many overflow cells a file of ``size`` bytes whose data region ends at ``data_end`` holds;
    raises :class:`CorruptStore` when the size fits no table."""
    if size < data_end:
        raise CorruptStore(f"DRAM arena {path} is {size} bytes; its header says {data_end} (truncated?)")
    if size == data_end:
        return 0
    extra = size - page_round(data_end)
    if extra <= 0 or extra % CELL:
        raise CorruptStore(
            f"DRAM arena {path} is {size} bytes: {size - data_end} past its data region, not a whole index table"
        )
    return extra // CELL


def backed(fd: int, total: int) -> bool:
    """Whether the first ``total`` bytes of the file at ``fd`` are all allocated (no hole a write
    could fault on): tmpfs counts a file's allocated pages in its blocks."""
    return os.fstat(fd).st_blocks * 512 >= page_round(total)


class Geometry(NamedTuple):
    capacity: int
    base_cells: int
    alignment: int
    data_offset: int
    data_end: int
    overflow_cells: int


def encode_header(capacity: int, base_cells: int, alignment: int, data_offset: int) -> bytes:
    """A new arena's header, its checksum included (what :func:`read_header` reads back)."""
    header = _HEADER.pack(MAGIC, VERSION, CELL, capacity, base_cells, alignment, 0, data_offset)
    return header + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(header))


def read_header(path: Path | str, fd: int) -> Geometry:
    """The geometry of the arena open at ``fd``, all checked."""
    size = os.fstat(fd).st_size
    if size < HEADER_SIZE:
        raise CorruptStore(f"DRAM arena {path} is truncated: {size} bytes, smaller than its header")
    header = os.pread(fd, _HEADER.size + _HEADER_SUM.size, 0)
    magic, version, cell_size, capacity, num_cells, alignment, _, data_offset = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise CorruptStore(f"{path} is not a kvstore DRAM arena (magic {magic!r})")
    (stored_sum,) = _HEADER_SUM.unpack_from(header, _HEADER.size)
    if stored_sum != xxhash.xxh3_64_intdigest(header[: _HEADER.size]):
        raise CorruptStore(f"DRAM arena {path} has a corrupt header (checksum mismatch)")
    if version != VERSION or cell_size != CELL:
        name = Path(path).name.removeprefix("kvstore-").removesuffix(".arena")
        raise CorruptStore(
            f"DRAM arena {path} has format version {version}; this kvstore reads {VERSION}. Its blocks cannot"
            f" be served: remove it with `kvstore daemon --remove-arena {name}` (or start under another --name)"
        )
    expected_data_offset = page_round(HEADER_SIZE + num_cells * CELL)
    if data_offset != expected_data_offset:
        raise CorruptStore(f"DRAM arena {path} has an inconsistent header (data offset {data_offset})")
    data_end = data_offset + capacity
    return Geometry(capacity, num_cells, alignment, data_offset, data_end, overflow_cells(path, data_end, size))


class ArenaMapping:
    """Another process's arena, mapped for same-host transfers: the data region only, no index, no lock.

    Whoever maps it must be told where blocks are (the master's extents) and
    when they are safe to touch (leases for reads, reservations for writes).
    """

    def __init__(self, path: Path | str, writable: bool = True) -> None:
        """``writable``: map it for writes too (the cluster's own clients); a tenant's client maps
        it read-only and writes through the daemon's socket."""
        self.path = str(path)
        self.writable = writable
        try:
            fd = os.open(self.path, os.O_RDWR if writable else os.O_RDONLY)
        except OSError as exc:
            raise CorruptStore(f"cannot open DRAM arena {self.path}: {exc.strerror}") from None
        try:
            geometry = read_header(self.path, fd)
            self.capacity, self.alignment, self.data_offset = (
                geometry.capacity,
                geometry.alignment,
                geometry.data_offset,
            )
            total = geometry.data_end  # the data region only: the slots are the daemon's
            if not backed(fd, total):  # a write to a page tmpfs cannot back would kill this process (SIGBUS)
                raise ResourceShortage(f"DRAM arena {self.path} is not wholly backed by memory: not mapped")
            self.inode = os.fstat(fd).st_ino
            # MAP_POPULATE: map every page now, or each first touch of a page costs a fault (measured:
            # same-host puts of fresh extents ran at 2 GB/s with faults, against memcpy's 15-25 GB/s).
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, total, flags, mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
        finally:
            os.close(fd)
        self._buf = memoryview(self._mm)

    def extent(self, offset: int, size: int) -> memoryview:
        """A view of ``size`` bytes at ``offset`` in the data region; raises when that is out of bounds."""
        if offset < 0 or size < 0 or offset + size > self.capacity:
            raise InvalidArgument(f"extent ({offset}, {size}) is outside DRAM arena {self.path}")
        start = self.data_offset + offset
        return self._buf[start : start + size]

    def close(self) -> None:
        """Unmap; raises BufferError while a view from :meth:`extent` is still alive."""
        self._buf.release()
        self._mm.close()
