"""Read leases of the placement table: which replicas readers hold, and until when.

A get leases the replicas of a key it hands out as one :class:`Lease` with its
own identity and expiry. A replica ``(node, tier, key)`` is *leased* while some
live lease covers it: a lease is live from its grant until it is released or
expires, whichever comes first, and ending it affects that lease alone. Time
comes in as ``now_ms``; nothing here reads a clock.

Releases name leases. A get's reply carries the id of its first lease; the
leases of its hits are consecutive from there (one get's grants never
interleave with another's: the table is synchronous), and the reader releases
exactly those. A release of a lease that ended already (expired: a slow reader)
ends nothing, so no release ever shortens another reader's protection.

Only this class changes lease state; the table and the eviction policy read it
through :meth:`is_leased`, :meth:`num_leased` and :meth:`leased_keys`.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import NewType

from kvstore.policy import TierName

LeaseId = NewType("LeaseId", int)
"""One granted lease (one get of one key); never reused."""

Holder = tuple[str, TierName]
"""A replica's node and tier."""


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: LeaseId
    key: str
    holders: tuple[Holder, ...]
    """The replicas the reader was handed (node, tier): leased whatever happens to the key later."""
    expiry_ms: int


class Leases:
    """Every live lease, indexed by id, by key and by replica.

    Invariants: ``_live`` holds exactly the live leases; ``_by_key[k]`` maps the
    id of each live lease of ``k`` to its expiry; ``_held[(node, tier)][k]`` counts
    the live leases covering that replica, and no count is zero; every live
    lease has an entry in ``_deadlines`` (entries of ended leases are skipped
    when they come up, or dropped all at once when they outnumber the live
    ones: the heap stays within twice the live leases, plus a constant).
    """

    def __init__(self) -> None:
        self._next_id = 1
        self._live: dict[LeaseId, Lease] = {}
        self._by_key: dict[str, dict[LeaseId, int]] = {}
        self._held: dict[Holder, dict[str, int]] = {}
        self._deadlines: list[tuple[int, LeaseId]] = []  # heap of (expiry, lease)

    def __len__(self) -> int:
        """Live leases."""
        return len(self._live)

    def grant(self, key: str, holders: Iterable[Holder], expiry_ms: int) -> LeaseId:
        """Lease the replicas ``holders`` of ``key`` until ``expiry_ms``."""
        lease_id = LeaseId(self._next_id)
        self._next_id += 1
        lease = Lease(lease_id, key, tuple(holders), expiry_ms)
        self._live[lease_id] = lease
        self._by_key.setdefault(key, {})[lease_id] = expiry_ms
        for holder in lease.holders:
            counts = self._held.setdefault(holder, {})
            counts[key] = counts.get(key, 0) + 1
        heapq.heappush(self._deadlines, (expiry_ms, lease_id))
        return lease_id

    def release(self, lease_id: LeaseId) -> bool:
        """End this lease (its reader is done); False when it had ended already (or never was)."""
        ended = self._end(lease_id) is not None
        if len(self._deadlines) > 2 * len(self._live) + 1024:  # mostly released: rebuild from the live ones
            self._deadlines = [(lease.expiry_ms, lease.lease_id) for lease in self._live.values()]
            heapq.heapify(self._deadlines)
        return ended

    def key_of(self, lease_id: LeaseId) -> str | None:
        """The key a live lease covers; None when it has ended (or never was)."""
        lease = self._live.get(lease_id)
        return lease.key if lease is not None else None

    @property
    def next_id(self) -> LeaseId:
        """The id the next grant will get."""
        return LeaseId(self._next_id)

    def expire(self, now_ms: int) -> int:
        """End every lease whose expiry is at or before ``now_ms``; how many ended."""
        ended = 0
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now_ms:
            _, lease_id = heapq.heappop(deadlines)
            if self._end(lease_id) is not None:
                ended += 1  # else released earlier
        return ended

    def _end(self, lease_id: LeaseId) -> Lease | None:
        lease = self._live.pop(lease_id, None)
        if lease is None:
            return None
        live = self._by_key[lease.key]
        del live[lease_id]
        if not live:
            del self._by_key[lease.key]
        for holder in lease.holders:
            counts = self._held[holder]
            if counts[lease.key] == 1:
                del counts[lease.key]
                if not counts:
                    del self._held[holder]
            else:
                counts[lease.key] -= 1
        return lease

    # -- reading ----------------------------------------------------------------------------
    def is_leased(self, node_id: str, tier: TierName, key: str) -> bool:
        counts = self._held.get((node_id, tier))
        return counts is not None and key in counts

    def num_leased(self, node_id: str, tier: TierName) -> int:
        """Keys with a leased replica on this node and tier."""
        counts = self._held.get((node_id, tier))
        return len(counts) if counts is not None else 0

    def leased_keys(self, node_id: str, tier: TierName) -> Collection[str]:
        """The keys with a leased replica on this node and tier: a read-only view, good until leases change."""
        counts = self._held.get((node_id, tier))
        return counts.keys() if counts is not None else ()

    def check(self) -> None:
        """Assert the invariants of the class docstring (for tests)."""
        by_key: dict[str, dict[LeaseId, int]] = {}
        held: dict[Holder, dict[str, int]] = {}
        for lease_id, lease in self._live.items():
            assert lease.lease_id == lease_id
            by_key.setdefault(lease.key, {})[lease_id] = lease.expiry_ms
            for holder in lease.holders:
                held.setdefault(holder, {})[lease.key] = held.get(holder, {}).get(lease.key, 0) + 1
        assert by_key == self._by_key, "leases by key drifted"
        assert held == self._held, "leased replicas drifted"
        assert set(self._live) <= {lease_id for _, lease_id in self._deadlines}, "a live lease with no expiry"
