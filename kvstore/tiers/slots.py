"""The DRAM arena's index: a table of 16-byte cells, each block a record of two cells and its key's.

A block's record is ``2 + ceil((key_len - 4) / 15)`` consecutive cells (48 bytes for a key of up
to 19 bytes, 64 for one of up to 34: 32 hex digits, ...), as four little-endian u64 words and then
the rest of its key::

    cell c      word0: state (byte 0: 1 WRITING, 2 COMMITTED, bit 7 pinned) | (key_len - 1) << 8
                       | (offset // 8) << 16 (40 bits: arenas up to 8 TiB) | key byte 3 << 56
                word1: size (40 bits: blocks up to 1 TiB) | key bytes 0-2 << 40
    cell c + 1  word2: TAIL (byte 0) | seq << 8 (56 bits)    word3: checksum
    cell c + 2  KEY (byte 0), then the next 15 bytes of the key (the last cell zero-padded), and so on

Byte 0 of every cell says what it is: 0 free, a state (a record's first cell), :data:`TAIL` or
:data:`KEY`. A record is written key cells first, then its second cell, then its first (state
WRITING last), then the block's bytes, then the single state byte COMMITTED; it is freed by zeroing
its first byte, then its markers. So a process that dies anywhere leaves records whose state byte
tells all: re-opening keeps COMMITTED ones and frees the rest, with every marker no record owns.

The table has two parts, as cells numbered in one space:

- the **base** cells ``[0, base)``, right after the header, as many as the header says (fixed when
  the file is made);
- cell ``base`` is no cell at all (a record never straddles the data region);
- the **overflow** cells ``base + 1 ...``, from the first page boundary past the data region to
  the end of the file. The file's size says how many there are: the table grows by extending
  the file (``ftruncate``, which zero-fills: every new cell is free) and reserving its pages, so
  a crash at any point of a growth leaves either the old table or the old one plus free cells.
  Nothing else (no header field) records the growth, so there is nothing to tear.

The table grows by an eighth (at least :data:`GROW_MIN_CELLS`) when a record finds no room, so
that an arena of small blocks indexes as many as it holds, paying for the index of the blocks it
holds (the cells of 100,000 blocks with keys of 11 bytes take 4.8 MB), not 320 bytes a slot up front.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from kvstore.arena_format import CELL, HEADER_SIZE, page_round
from kvstore.errors import ResourceShortage
from kvstore.resources import reserve

KEY_PER_CELL = 15
HEAD_CELLS = 2
KEY_IN_HEAD = 4
"""Key bytes a record's first cell holds (the rest go in its key cells)."""
GROW_MIN_CELLS = 256
"""The fewest cells a growth adds (one page)."""

FREE, WRITING, COMMITTED = 0, 1, 2
PINNED = 0x80
STATE_MASK = 0x7F
TAIL = 0xFE
KEY = 0xFF

MAX_OFFSET = (1 << 40) * 8
MAX_SIZE = 1 << 40
MAX_SEQ = 1 << 56

HEAD = struct.Struct("<QQQQ")
"""A record's first two cells: word0 .. word3 (see the module's docstring)."""
SEQ = struct.Struct("<Q")
TAIL_WORDS = struct.Struct("<QQ")
SEQ_AT = CELL
"""Where a record's word2 (TAIL | seq << 8) starts in it."""


def _tail_word(seq: int) -> int:
    """A record's word2: the TAIL marker and its seq (56 bits)."""
    return TAIL | (seq & (MAX_SEQ - 1)) << 8


def record_cells(key_len: int) -> int:
    """Cells of the record of a key of ``key_len`` bytes."""
    return HEAD_CELLS + -(-max(0, key_len - KEY_IN_HEAD) // KEY_PER_CELL)


def encode_head(state: int, pinned: bool, raw_key: bytes, offset: int, size: int, checksum: int, seq: int) -> bytes:
    """A record's first two cells."""
    first = raw_key[:KEY_IN_HEAD].ljust(KEY_IN_HEAD, b"\0")
    return HEAD.pack(
        state | (PINNED if pinned else 0) | (len(raw_key) - 1) << 8 | (offset >> 3) << 16 | first[3] << 56,
        size | int.from_bytes(first[:3], "little") << 40,
        _tail_word(seq),
        checksum,
    )


def encode_key(raw_key: bytes) -> bytes:
    """A record's key cells (the key past the bytes its first cell holds)."""
    if len(raw_key) <= KEY_IN_HEAD + KEY_PER_CELL:  # one cell or none: most keys
        return b"\xff" + raw_key[KEY_IN_HEAD:].ljust(KEY_PER_CELL, b"\0") if len(raw_key) > KEY_IN_HEAD else b""
    return b"".join(
        b"\xff" + raw_key[i : i + KEY_PER_CELL].ljust(KEY_PER_CELL, b"\0")
        for i in range(KEY_IN_HEAD, len(raw_key), KEY_PER_CELL)
    )


class SlotTable:
    """The cells of one open arena file: their addresses, a copy of the table, and growth.

    Owned by :class:`kvstore.tiers.dram.DramArena`, which alone writes records and calls :meth:`grow`.
    ``total`` (the cells, the one between the two parts included) only increases.
    """

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, base: int, data_end: int, overflow: int) -> None:
        self._path, self._fd, self._mm = path, fd, mm
        self.base = base
        self._overflow_offset = page_round(data_end)
        self._data_end = data_end
        self.overflow = overflow
        self._ovf: mmap.mmap | None = self._map_overflow(overflow)

    @property
    def total(self) -> int:
        """Cells in the numbering: base, the one between, overflow."""
        return self.base + 1 + self.overflow

    @property
    def nbytes(self) -> int:
        """Bytes of the index in the file (both parts)."""
        return (self.base + self.overflow) * CELL

    def _map_overflow(self, count: int) -> mmap.mmap | None:
        if count == 0:
            return None
        return mmap.mmap(
            self._fd, count * CELL, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=self._overflow_offset
        )

    def locate(self, cell: int) -> tuple[mmap.mmap, int]:
        """The mapping that holds ``cell`` and the cell's offset in it."""
        if cell < self.base:
            return self._mm, HEADER_SIZE + cell * CELL
        assert self._ovf is not None and self.base < cell < self.total
        return self._ovf, (cell - self.base - 1) * CELL

    def write(self, cell: int, head: bytes, keys: bytes = b"") -> None:
        """Write the record at ``cell``: its key cells (when given), then its first two cells, their
        state byte last (see the module)."""
        mm, at = self.locate(cell)
        if keys:
            mm[at + HEAD_CELLS * CELL : at + HEAD_CELLS * CELL + len(keys)] = keys
        mm[at + 1 : at + HEAD.size] = head[1:]
        mm[at] = head[0]

    def commit(self, cell: int, pinned: bool, checksum: int, seq: int) -> None:
        """Commit the record at ``cell`` (written WRITING): its seq and checksum, then its state byte."""
        mm, at = self.locate(cell)
        TAIL_WORDS.pack_into(mm, at + SEQ_AT, _tail_word(seq), checksum)
        mm[at] = COMMITTED | (PINNED if pinned else 0)

    def set_state(self, cell: int, state: int) -> None:
        """The state of the record at ``cell``, its pin kept."""
        mm, at = self.locate(cell)
        mm[at] = mm[at] & PINNED | state

    def set_pinned(self, cell: int, pinned: bool) -> None:
        mm, at = self.locate(cell)
        mm[at] = mm[at] & STATE_MASK | (PINNED if pinned else 0)

    def set_seq(self, cell: int, seq: int) -> None:
        mm, at = self.locate(cell)
        SEQ.pack_into(mm, at + SEQ_AT, _tail_word(seq))

    def clear(self, cell: int, cells: int) -> None:
        """Free the record of ``cells`` cells at ``cell``: its state byte first, then its markers."""
        mm, at = self.locate(cell)
        for i in range(cells):
            mm[at + i * CELL] = FREE

    def key(self, cell: int, key_len: int) -> bytes:
        """The key bytes of the record at ``cell``."""
        mm, at = self.locate(cell)
        raw = mm[at : at + record_cells(key_len) * CELL]
        rest = b"".join(raw[i + 1 : i + CELL] for i in range(HEAD_CELLS * CELL, len(raw), CELL))
        return (raw[13:16] + raw[7:8] + rest)[:key_len]  # word1's top three bytes, word0's top byte, the rest

    def read(self) -> np.ndarray:
        """A copy of every cell as two u64 words, by cell number (shape ``(total, 2)``; the cell
        between the parts reads as free). A copy, so that no numpy view of a mapping outlives this
        call (a live view would keep the mapping from closing, or from being replaced by a growth)."""
        out = np.zeros((self.total, 2), dtype="<u8")
        segments = [(self._mm, HEADER_SIZE, 0, self.base)]
        if self._ovf is not None:
            segments.append((self._ovf, 0, self.base + 1, self.overflow))
        for mm, offset, first, count in segments:
            view = np.frombuffer(mm, dtype="<u8", count=2 * count, offset=offset)
            try:
                out[first : first + count] = view.reshape(count, 2)
            finally:
                del view
        return out

    def grow(self, need: int) -> range:
        """Add cells (an eighth of the table, at least ``need`` and :data:`GROW_MIN_CELLS`; as few as
        ``need`` allows when memory is short for more); the numbers of the new cells, all free.
        Raises :class:`ResourceShortage` when no memory can be had (the table is then as it was)."""
        least = max(need, GROW_MIN_CELLS)
        add = max(least, (self.base + self.overflow) // 8)
        try:
            self._extend(add)
        except ResourceShortage:
            if add <= least:
                raise
            add = least
            self._extend(add)
        first = self.total
        self.overflow += add
        return range(first, self.total)

    def _extend(self, add: int) -> None:
        overflow = self.overflow
        old_size = self._overflow_offset + overflow * CELL if overflow else self._data_end
        new_size = self._overflow_offset + (overflow + add) * CELL
        # Size first (the new cells read free, also after a crash), then the pages, then use.
        os.ftruncate(self._fd, new_size)
        try:
            reserve(self._fd, new_size, f"DRAM arena {self._path} index", start=page_round(old_size))
            ovf = self._map_overflow(overflow + add)
        except (ResourceShortage, OSError) as exc:
            os.ftruncate(self._fd, old_size)
            if isinstance(exc, ResourceShortage):
                raise
            raise ResourceShortage(f"DRAM arena {self._path}: its index cannot grow: {exc}") from None
        old, self._ovf = self._ovf, ovf
        if old is not None:
            old.close()

    def close(self) -> None:
        if self._ovf is not None:
            with contextlib.suppress(BufferError):
                self._ovf.close()
            self._ovf = None
