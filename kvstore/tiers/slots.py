"""The DRAM arena's slot table: where each slot lives in the arena file, and how the table grows.

A slot is ``state u8, flags u8, key_len u16, pad u32, offset u64, size u64,
checksum u64, seq u64, key[256]`` (320 bytes). The table has two parts:

- the **base** slots, right after the header, as many as the header says
  (fixed when the file is made);
- the **overflow** slots, from the first page boundary past the data region
  to the end of the file. The file's size says how many there are: the table
  grows by extending the file (``ftruncate``, which zero-fills: every new slot
  is FREE) and reserving its pages, so a crash at any point of a growth
  leaves either the old table or the old one plus FREE slots. Nothing else
  (no header field) records the growth, so there is nothing to tear.

The table grows (doubling) when a block needs a slot and none is free, up to
``max_slots``, so that an arena of small blocks indexes as many as it holds
without paying 320 bytes a slot up front for an index it may never use.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from kvstore.errors import CorruptStore, ResourceShortage
from kvstore.resources import reserve

HEADER_SIZE = 4096
SLOT_SIZE = 320
GROW_MIN_SLOTS = 64
"""The fewest slots a growth adds (64 slots are five whole pages)."""

SLOT = struct.Struct("<BBHIQQQQ")  # state, flags, key_len, pad, offset, size, checksum, seq
SEQ = struct.Struct("<Q")
SEQ_OFFSET = 32
KEY_OFFSET = SLOT.size

FREE, WRITING, COMMITTED = 0, 1, 2
FLAG_PINNED = 1

SLOT_DTYPE = np.dtype(
    {
        "names": ["state", "flags", "key_len", "offset", "size", "checksum", "seq"],
        "formats": ["u1", "u1", "<u2", "<u8", "<u8", "<u8", "<u8"],
        "offsets": [0, 1, 2, 8, 16, 24, 32],
        "itemsize": SLOT_SIZE,
    }
)


def page_round(n: int) -> int:
    return (n + 4095) & ~4095


def overflow_slots(path: Path | str, data_end: int, size: int) -> int:
    """How many overflow slots a file of ``size`` bytes whose data region ends at ``data_end`` holds;
    raises :class:`CorruptStore` when the size fits no table."""
    if size < data_end:
        raise CorruptStore(f"DRAM arena {path} is {size} bytes; its header says {data_end} (truncated?)")
    if size == data_end:
        return 0
    extra = size - page_round(data_end)
    if extra <= 0 or extra % SLOT_SIZE:
        raise CorruptStore(
            f"DRAM arena {path} is {size} bytes: {size - data_end} past its data region, not a whole slot table"
        )
    return extra // SLOT_SIZE


class SlotTable:
    """The slots of one open arena file: their addresses, a copy of the table, and growth.

    Owned by :class:`kvstore.tiers.dram.DramArena`, which alone writes slots (through :meth:`locate`)
    and calls :meth:`grow`. ``num_slots`` only increases, up to ``max_slots``.
    """

    def __init__(
        self, path: Path, fd: int, mm: mmap.mmap, base_slots: int, data_end: int, overflow: int, max_slots: int
    ) -> None:
        self._path, self._fd, self._mm = path, fd, mm
        self.base_slots = base_slots
        self._overflow_offset = page_round(data_end)
        self._data_end = data_end
        self.num_slots = base_slots + overflow
        self.max_slots = max(max_slots, self.num_slots)
        self._ovf: mmap.mmap | None = self._map_overflow(overflow)

    def _map_overflow(self, count: int) -> mmap.mmap | None:
        if count == 0:
            return None
        return mmap.mmap(
            self._fd, count * SLOT_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=self._overflow_offset
        )

    def locate(self, index: int) -> tuple[mmap.mmap, int]:
        """The mapping that holds slot ``index`` and the slot's offset in it."""
        if index < self.base_slots:
            return self._mm, HEADER_SIZE + index * SLOT_SIZE
        assert self._ovf is not None and index < self.num_slots
        return self._ovf, (index - self.base_slots) * SLOT_SIZE

    def set_state(self, index: int, state: int) -> None:
        mm, base = self.locate(index)
        mm[base] = state

    def key(self, index: int, key_len: int) -> bytes:
        mm, base = self.locate(index)
        return bytes(mm[base + KEY_OFFSET : base + KEY_OFFSET + key_len])

    def read(self) -> dict[str, np.ndarray]:
        """Copies of every slot's fields (those of :data:`SLOT_DTYPE`, not the keys), by slot number.

        Copies, so that no numpy view of a mapping outlives this call (a live view
        would keep the mapping from closing, or from being replaced by a growth).
        """
        segments = [(self._mm, HEADER_SIZE, self.base_slots)]
        if self._ovf is not None:
            segments.append((self._ovf, 0, self.num_slots - self.base_slots))
        parts: dict[str, list[np.ndarray]] = {name: [] for name in SLOT_DTYPE.names or ()}
        for mm, offset, count in segments:
            view = np.frombuffer(mm, dtype=SLOT_DTYPE, count=count, offset=offset)
            try:
                for name, arrays in parts.items():
                    arrays.append(view[name].copy())
            finally:
                del view
        return {name: np.concatenate(arrays) for name, arrays in parts.items()}

    def grow(self) -> range:
        """Add slots (as many as there are, at least :data:`GROW_MIN_SLOTS`, at most up to ``max_slots``;
        :data:`GROW_MIN_SLOTS` when memory is short for more); the numbers of the new slots, all FREE.
        Raises :class:`ResourceShortage` when no memory can be had (the table is then as it was)."""
        add = min(max(self.num_slots, GROW_MIN_SLOTS), self.max_slots - self.num_slots)
        if add <= 0:
            return range(0)
        try:
            self._extend(add)
        except ResourceShortage:
            if add <= GROW_MIN_SLOTS:
                raise
            add = GROW_MIN_SLOTS
            self._extend(add)
        first = self.num_slots
        self.num_slots += add
        return range(first, self.num_slots)

    def _extend(self, add: int) -> None:
        overflow = self.num_slots - self.base_slots
        old_size = self._overflow_offset + overflow * SLOT_SIZE if overflow else self._data_end
        new_size = self._overflow_offset + (overflow + add) * SLOT_SIZE
        # Size first (the new slots read FREE, also after a crash), then the pages, then use.
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
