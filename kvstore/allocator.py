"""Offset allocator for a DRAM arena: best-fit over free extents, coalescing on free.

All offsets and lengths are multiples of ``alignment``; requests are rounded
up. Free extents are indexed three ways, kept consistent by ``_add_free`` and
``_remove_free`` only:

- ``_free_start``: start -> length, and ``_free_end``: end -> start, so a freed
  extent merges with both neighbours in O(1);
- ``_by_size``: length -> insertion-ordered set of starts, plus ``_sizes``, the
  sorted distinct lengths, so best fit is one dict probe in the common case of
  equal-sized KV blocks and a bisect otherwise.

Invariants: free extents never touch or overlap (they are always merged);
allocated and free extents tile ``[0, capacity)`` exactly.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

from sortedcontainers import SortedList

from kvstore.errors import InvalidArgument


def align_up(size: int, alignment: int) -> int:
    """``size`` rounded up to a multiple of ``alignment`` (a power of two)."""
    return (size + alignment - 1) & ~(alignment - 1)


class Extent(NamedTuple):
    """A reserved range ``[offset, offset + length)`` of an arena."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    capacity: int
    used: int
    free: int
    largest_free: int
    num_allocated: int
    num_free_extents: int

    @property
    def utilization(self) -> float:
        return self.used / self.capacity if self.capacity else 0.0


class Allocator:
    """Best-fit allocator over ``[0, capacity)``. Not thread-safe; its owner serialises calls."""

    def __init__(self, capacity: int, alignment: int = 64, *, track: bool = True) -> None:
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise InvalidArgument(f"alignment must be a positive power of two, got {alignment!r}")
        if type(capacity) is not int or capacity < alignment:
            raise InvalidArgument(
                f"capacity must be an int of at least one alignment unit ({alignment}), got {capacity!r}"
            )
        self.capacity = capacity - capacity % alignment
        self.alignment = alignment
        self._mask = alignment - 1
        self._free_start: dict[int, int] = {}
        self._free_end: dict[int, int] = {}
        self._by_size: dict[int, dict[int, None]] = {}
        self._sizes: list[int] = []
        self._allocated: dict[int, int] | None = {} if track else None
        """Allocated extents, start -> length; None when the owner keeps them (the master's table,
        which holds millions): then :meth:`free` and :meth:`carve` trust their caller, and
        :meth:`check` is given the extents."""
        self._count = 0
        self.used = 0
        self._add_free(0, self.capacity)

    # -- free-extent index -------------------------------------------------
    def _add_free(self, start: int, length: int) -> None:
        self._free_start[start] = length
        self._free_end[start + length] = start
        bucket = self._by_size.get(length)
        if bucket is None:
            self._by_size[length] = {start: None}
            insort(self._sizes, length)
        else:
            bucket[start] = None

    def _remove_free(self, start: int, length: int) -> None:
        del self._free_start[start]
        del self._free_end[start + length]
        bucket = self._by_size[length]
        del bucket[start]
        if not bucket:
            del self._by_size[length]
            del self._sizes[bisect_left(self._sizes, length)]

    # -- public API ---------------------------------------------------------
    def round_up(self, size: int) -> int:
        return align_up(size, self.alignment)

    def alloc(self, size: int) -> Extent | None:
        """Reserve ``size`` bytes (rounded up to the alignment); None when no free extent is large enough."""
        if type(size) is not int or size <= 0:
            raise InvalidArgument(f"allocation size must be a positive int, got {size!r}")
        length = (size + self._mask) & ~self._mask
        # The index updates of _remove_free/_add_free, inlined: this is the hot path.
        by_size, sizes = self._by_size, self._sizes
        bucket = by_size.get(length)
        if bucket:
            start = bucket.popitem()[0]
            if not bucket:
                del by_size[length]
                del sizes[bisect_left(sizes, length)]
            del self._free_start[start]
            del self._free_end[start + length]
        else:
            i = bisect_left(sizes, length)
            if i == len(sizes):
                return None
            found = sizes[i]
            bucket = by_size[found]
            start = bucket.popitem()[0]
            if not bucket:
                del by_size[found]
                del sizes[i]
            # Keep the tail of the extent free: same end, new start and length.
            rest, rest_len = start + length, found - length
            del self._free_start[start]
            self._free_start[rest] = rest_len
            self._free_end[start + found] = rest
            rest_bucket = by_size.get(rest_len)
            if rest_bucket is None:
                by_size[rest_len] = {rest: None}
                insort(sizes, rest_len)
            else:
                rest_bucket[rest] = None
        if self._allocated is not None:
            self._allocated[start] = length
        self._count += 1
        self.used += length
        return Extent(start, length)

    def alloc_many(self, sizes: Sequence[int]) -> list[Extent] | None:
        """Reserve one extent per size (each rounded up to the alignment), back to back in the best
        fit for their total; None when no free extent holds them all. Each is freed on its own."""
        offsets = self.alloc_offsets(sizes)
        if offsets is None:
            return None
        mask = self._mask
        return [Extent(at, (size + mask) & ~mask) for at, size in zip(offsets, sizes, strict=True)]

    def total_length(self, sizes: Sequence[int]) -> int:
        """The bytes that extents of ``sizes`` take, each rounded up to the alignment."""
        mask = self._mask
        if sizes and sizes.count(sizes[0]) == len(sizes):  # a batch of equal blocks, the common case
            return len(sizes) * ((sizes[0] + mask) & ~mask)
        return sum((size + mask) & ~mask for size in sizes)

    def alloc_offsets(self, sizes: Sequence[int]) -> list[int] | None:
        """:meth:`alloc_many`, answered with the extents' offsets only (their lengths are the sizes
        rounded up): what a caller that keeps millions of them records."""
        if not sizes or not (set(map(type, sizes)) == {int} and min(sizes) > 0):
            raise InvalidArgument(f"allocation sizes must be positive ints, got {list(sizes)[:8]!r}")
        mask = self._mask
        n = len(sizes)
        whole = self.alloc(self.total_length(sizes))
        if whole is None:
            return None
        if sizes.count(sizes[0]) == n:
            step = (sizes[0] + mask) & ~mask
            offsets = list(range(whole.offset, whole.offset + n * step, step))
            lengths: Sequence[int] = [step] * n
        else:
            lengths = [(size + mask) & ~mask for size in sizes]
            offsets = list(accumulate(lengths[:-1], initial=whole.offset))
        allocated = self._allocated
        if allocated is not None:
            del allocated[whole.offset]
            allocated.update(zip(offsets, lengths, strict=True))
        self._count += n - 1
        return offsets

    @classmethod
    def rebuild(
        cls, capacity: int, alignment: int, allocated: list[tuple[int, int]], *, track: bool = True
    ) -> Allocator:
        """An allocator whose allocated extents are exactly ``allocated`` (offset, size) pairs.

        Used when re-attaching an arena. Raises :class:`InvalidArgument` naming
        the first extent that is misaligned, out of bounds or overlapping.
        """
        alloc = cls(capacity, alignment, track=track)
        alloc._remove_free(0, alloc.capacity)
        pos = 0
        for offset, size in sorted(allocated):
            length = alloc.round_up(size)
            if offset & alloc._mask or size <= 0 or offset + length > alloc.capacity:
                raise InvalidArgument(f"extent ({offset}, {size}) is misaligned or outside [0, {alloc.capacity})")
            if offset < pos:
                raise InvalidArgument(f"extent ({offset}, {size}) overlaps the extent that ends at {pos}")
            if offset > pos:
                alloc._add_free(pos, offset - pos)
            if alloc._allocated is not None:
                alloc._allocated[offset] = length
            alloc._count += 1
            alloc.used += length
            pos = offset + length
        if pos < alloc.capacity:
            alloc._add_free(pos, alloc.capacity - pos)
        return alloc

    def grow(self, capacity: int) -> None:
        """Extend the range to ``[0, capacity)`` (rounded down to the alignment): what is added is free."""
        capacity -= capacity % self.alignment
        if capacity <= self.capacity:
            raise InvalidArgument(f"capacity {capacity} does not extend [0, {self.capacity})")
        start, length = self.capacity, capacity - self.capacity
        before = self._free_end.get(start)
        if before is not None:
            self._remove_free(before, start - before)
            length += start - before
            start = before
        self._add_free(start, length)
        self.capacity = capacity

    def take(self, extent: Extent) -> bool:
        """Reserve exactly ``extent`` (aligned) if it lies wholly in free space; False otherwise.
        Rare (an extent held by a block nobody placed): a scan of the free extents."""
        start, length = extent
        if length <= 0 or (start | length) & self._mask or start < 0 or start + length > self.capacity:
            return False
        end = start + length
        for f_start, f_len in self._free_start.items():
            if f_start <= start and end <= f_start + f_len:
                break
        else:
            return False
        self._remove_free(f_start, f_len)
        if f_start < start:
            self._add_free(f_start, start - f_start)
        if end < f_start + f_len:
            self._add_free(end, f_start + f_len - end)
        if self._allocated is not None:
            self._allocated[start] = length
        self._count += 1
        self.used += length
        return True

    def free(self, extent: Extent) -> None:
        """Return an extent from :meth:`alloc` or :meth:`rebuild`; freeing anything else raises."""
        start, length = extent
        if self._allocated is not None:
            if self._allocated.get(start) != length:
                raise InvalidArgument(f"extent ({start}, {length}) is not allocated (double free or foreign extent)")
            del self._allocated[start]
        elif (
            start in self._free_start or length <= 0 or (start | length) & self._mask or start + length > self.capacity
        ):
            raise InvalidArgument(f"extent ({start}, {length}) is not allocated (double free or foreign extent)")
        self._count -= 1
        self.used -= length
        before = self._free_end.get(start)
        if before is not None:
            self._remove_free(before, start - before)
            length += start - before
            start = before
        after = self._free_start.get(start + length)
        if after is not None:
            self._remove_free(start + length, after)
            length += after
        self._add_free(start, length)

    def carve(self, extent: Extent, part: Extent) -> list[Extent]:
        """Cut the allocated ``extent`` so that ``part`` (aligned, inside it) is an allocated extent of
        its own; returns the allocated rest (zero, one or two extents), left then right. Nothing is freed."""
        start, length = extent
        allocated = self._allocated
        if allocated is not None and allocated.get(start) != length:
            raise InvalidArgument(f"extent ({start}, {length}) is not allocated")
        p_start, p_len = part
        if (
            p_len <= 0
            or p_start & self._mask
            or p_len & self._mask
            or p_start < start
            or p_start + p_len > start + length
        ):
            raise InvalidArgument(f"({p_start}, {p_len}) is not an aligned part of extent ({start}, {length})")
        rest = []
        if p_start > start:
            rest.append(Extent(start, p_start - start))
        end, p_end = start + length, p_start + p_len
        if p_end < end:
            rest.append(Extent(p_end, end - p_end))
        if allocated is not None:
            del allocated[start]
            allocated[p_start] = p_len
            allocated.update(rest)
        self._count += len(rest)
        return rest

    @property
    def num_extents(self) -> int:
        """Extents handed out and not yet freed."""
        return self._count

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        return self._sizes[-1] if self._sizes else 0

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            capacity=self.capacity,
            used=self.used,
            free=self.capacity - self.used,
            largest_free=self.largest_free,
            num_allocated=self._count,
            num_free_extents=len(self._free_start),
        )

    def check(self, allocated: list[tuple[int, int]] | None = None) -> None:
        """Assert every invariant in the class docstring (for tests); ``allocated``: the extents
        handed out, as their owner keeps them (required when this allocator does not)."""
        if allocated is None:
            assert self._allocated is not None, "an untracked allocator is checked against its owner's extents"
            allocated = list(self._allocated.items())
        assert len(allocated) == self._count, f"{len(allocated)} extents held, {self._count} counted"
        spans = sorted([(s, n, "a") for s, n in allocated] + [(s, n, "f") for s, n in self._free_start.items()])
        pos = 0
        prev_kind = ""
        for start, length, kind in spans:
            assert start == pos, f"gap or overlap at {pos}: next span starts at {start}"
            assert length > 0 and start % self.alignment == 0 and length % self.alignment == 0
            assert not (kind == "f" and prev_kind == "f"), f"adjacent free extents at {start}"
            pos += length
            prev_kind = kind
        assert pos == self.capacity, f"spans cover {pos} of {self.capacity}"
        assert self.used == sum(n for _, n in allocated)
        assert self._sizes == sorted(self._by_size)
        assert all(self._free_end[s + n] == s for s, n in self._free_start.items())
        assert sum(len(b) for b in self._by_size.values()) == len(self._free_start)


class ExtentSet:
    """Extents someone else placed (a master, for an unmanaged arena), kept sorted so that a new
    one is checked against its neighbours: no two ever overlap. Not thread-safe.

    The starts are a SortedList (O(log n) to add and remove): a plain sorted list moved every
    later start on each add and remove, 18 us a put and its delete in a daemon of 100,000 blocks."""

    def __init__(self) -> None:
        self._starts: SortedList[int] = SortedList()
        self._ends: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._starts)

    def overlapping(self, extent: Extent) -> Extent | None:
        """An extent of the set that shares a byte with ``extent``, if one does."""
        start, end = extent.offset, extent.offset + extent.length
        i = self._starts.bisect_left(end)  # extents starting before ``end``: only the last can reach past start
        if i:
            before = self._starts[i - 1]
            if self._ends[before] > start:
                return Extent(before, self._ends[before] - before)
        return None

    def add(self, extent: Extent) -> None:
        """Add ``extent``; raises InvalidArgument naming the extent it would overlap."""
        if extent.length <= 0:
            raise InvalidArgument(f"extent ({extent.offset}, {extent.length}) is empty")
        other = self.overlapping(extent)
        if other is not None:
            raise InvalidArgument(
                f"extent ({extent.offset}, {extent.length}) overlaps the block at ({other.offset}, {other.length})"
            )
        self._starts.add(extent.offset)
        self._ends[extent.offset] = extent.offset + extent.length

    def remove(self, extent: Extent) -> None:
        if self._ends.get(extent.offset) != extent.offset + extent.length:
            raise InvalidArgument(f"extent ({extent.offset}, {extent.length}) is not in the set")
        del self._ends[extent.offset]
        self._starts.remove(extent.offset)
