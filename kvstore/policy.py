"""Eviction and promotion policy across a node's DRAM and SSD tiers.

The policy is pure: it reads tier state and returns :class:`Action` lists in
the order they must be carried out; the caller performs them and updates the
tiers. Rules:

- A put of ``incoming`` bytes that would fill DRAM past the high watermark
  frees DRAM down to the low watermark (or at least ``force_bytes``) by taking
  DRAM victims in exact LRU order, skipping pinned and leased blocks.
- Each DRAM victim is *demoted* to SSD when the SSD tier exists and can take it,
  else *dropped*. Demotions that would fill SSD past its high watermark first
  drop SSD victims, in LRU order, down to SSD's low watermark. When SSD cannot
  make enough room, the oldest DRAM victims are dropped instead of demoted.
- Actions come back in execution order: SSD drops, then demotions, then DRAM
  drops.
- An SSD block read ``promote_after_hits`` times is promoted to DRAM.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvstore.lru import K

T = TypeVar("T")


class Victims(Protocol[K]):
    """What a policy reads of an LRU: its evictable keys and their sizes, least recently used first,
    skipping pinned keys and those in ``skip`` (:class:`kvstore.lru.LRU`, the master's
    :class:`kvstore.placement.records.TierLRU`)."""

    def victims(self, skip: Collection[K] = ...) -> Iterator[tuple[K, int]]: ...


class ActionKind(enum.Enum):
    DEMOTE = "demote"
    """Move a block from DRAM to SSD."""
    DROP = "drop"
    """Delete a block from the tier it is in."""
    PROMOTE = "promote"
    """Move a block from SSD to DRAM."""


class TierName(enum.Enum):
    DRAM = "dram"
    SSD = "ssd"

    # Members are singletons: identity hashing is C, where Enum's own hashes the name in Python (the
    # master hashes a tier for every replica a get leases).
    __hash__ = object.__hash__


@dataclass(frozen=True, slots=True)
class Action(Generic[T]):
    kind: ActionKind
    key: T
    tier: TierName
    """The tier the block is in when the action starts."""
    size: int


@dataclass(frozen=True, slots=True)
class TierView(Generic[T]):
    """What the policy may read of a tier: its capacity, bytes in use and LRU, and the keys leased
    by an owner that keeps leases outside the LRU (the master's :class:`kvstore.placement.leases.Leases`)."""

    capacity: int
    used: int
    lru: Victims[T]
    leased: Collection[T] = ()


@dataclass(frozen=True, slots=True)
class EvictionPolicy:
    high_watermark: float = 0.99
    low_watermark: float = 0.97
    promote_after_hits: int = 1

    def over_high_watermark(self, used: int, capacity: int) -> bool:
        """Whether a tier holding ``used`` of ``capacity`` bytes must evict."""
        return used > self.high_watermark * capacity

    def make_room(
        self, dram: TierView[K], ssd: TierView[K] | None, incoming: int, force_bytes: int = 0, headroom: float = 1.0
    ) -> list[Action[K]]:
        """Actions that leave room in DRAM for ``incoming`` more bytes, freeing at least ``force_bytes``.
        ``headroom`` is the part of the way down to the low watermark to free (1: all of it; a tenant
        frees its share of the tier's blocks, so a small tenant does not empty itself for others).

        May return too little when pinned and leased blocks fill the tier; the
        caller then reports a capacity error.
        """
        need = force_bytes
        if self.over_high_watermark(dram.used + incoming, dram.capacity):
            excess = dram.used + incoming - math.floor(self.low_watermark * dram.capacity)
            need = max(need, math.ceil(excess * headroom))
        if need <= 0:
            return []
        victims: list[tuple[K, int]] = []
        freed = 0
        for key, size in dram.lru.victims(dram.leased):
            if freed >= need:
                break
            victims.append((key, size))
            freed += size
        return self._place_victims(victims, ssd)

    def make_slots(
        self, dram: TierView[K], ssd: TierView[K] | None, used: int, capacity: int, headroom: float = 1.0
    ) -> list[Action[K]]:
        """Actions that free index slots in DRAM when ``used`` of ``capacity`` slots are taken:
        down to the low watermark (``headroom`` of the way, as for :meth:`make_room`; at least one),
        least recently used first."""
        need = max(1, math.ceil((used + 1 - math.floor(self.low_watermark * capacity)) * headroom))
        victims = list(itertools.islice(dram.lru.victims(dram.leased), need))
        return self._place_victims(victims, ssd)

    def _place_victims(self, victims: list[tuple[K, int]], ssd: TierView[K] | None) -> list[Action[K]]:
        if ssd is None or ssd.capacity <= 0:
            return [Action(ActionKind.DROP, key, TierName.DRAM, size) for key, size in victims]
        demote_bytes = sum(size for _, size in victims if size <= ssd.capacity)
        ssd_drops: list[Action[K]] = []
        ssd_freed = 0
        if self.over_high_watermark(ssd.used + demote_bytes, ssd.capacity):
            ssd_need = ssd.used + demote_bytes - math.floor(self.low_watermark * ssd.capacity)
            for key, size in ssd.lru.victims(ssd.leased):
                if ssd_freed >= ssd_need:
                    break
                ssd_drops.append(Action(ActionKind.DROP, key, TierName.SSD, size))
                ssd_freed += size
        room = math.floor(self.high_watermark * ssd.capacity) - (ssd.used - ssd_freed)
        # Newest victims are the most valuable: they get the SSD room first.
        demotes: list[Action[K]] = []
        drops: list[Action[K]] = []
        for key, size in reversed(victims):
            if size <= room:
                demotes.append(Action(ActionKind.DEMOTE, key, TierName.DRAM, size))
                room -= size
            else:
                drops.append(Action(ActionKind.DROP, key, TierName.DRAM, size))
        demotes.reverse()
        drops.reverse()
        return ssd_drops + demotes + drops

    def should_promote(self, hits: int) -> bool:
        """Whether an SSD block read ``hits`` times (this read included) goes back to DRAM."""
        return self.promote_after_hits > 0 and hits >= self.promote_after_hits

    def promote(self, key: K, size: int) -> Action[K]:
        return Action(ActionKind.PROMOTE, key, TierName.SSD, size)
