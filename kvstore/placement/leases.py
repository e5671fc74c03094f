"""Read leases of the placement table: which replicas readers hold, and until when.

A get leases the replicas of a key it hands out as one lease with its own
identity and expiry (the leases of one get are kept as one :class:`Grant`, ids
consecutive, one expiry). A replica ``(node, tier, key)`` is *leased* while some
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


@dataclass(slots=True)
class Grant:
    """The leases of one grant: consecutive ids from ``first``, one per key (one get's hits, or
    one hold). A lease is one get of one key; the grant is how its record is kept, so that a get
    of many keys costs one record and one expiry instead of one of each per key."""

    first: LeaseId
    keys: list[str]
    holders: list[tuple[Holder, ...]]
    """Per key, the replicas the reader was handed (node, tier): leased whatever happens to the key later."""
    expiry_ms: int
    live: int
    """Leases of this grant not ended yet."""


class Leases:
    """Every live lease, indexed by id and by replica.

    Invariants: ``_live`` maps exactly the ids of live leases, each to its grant;
    ``_held[(node, tier)][k]`` counts the live leases covering that replica, and
    no count is zero; every grant with a live lease has an entry in
    ``_deadlines`` (entries of grants ended already are skipped when they come
    up, or dropped all at once when they outnumber the live grants: the heap
    stays within twice the live grants, plus a constant).
    """

    def __init__(self) -> None:
        self._next_id = 1
        self._live: dict[LeaseId, Grant] = {}
        self._grants: dict[LeaseId, Grant] = {}
        """Grants with a live lease, by their first id (what the expiry heap is rebuilt from)."""
        self._held: dict[Holder, dict[str, int]] = {}
        self._deadlines: list[tuple[int, int, Grant]] = []  # heap of (expiry, first id, grant)

    def __len__(self) -> int:
        """Live leases."""
        return len(self._live)

    def grant(self, key: str, holders: Iterable[Holder], expiry_ms: int) -> LeaseId:
        """Lease the replicas ``holders`` of ``key`` until ``expiry_ms``."""
        return self.grant_many([key], [tuple(holders)], expiry_ms)

    def grant_many(self, keys: list[str], holders: list[tuple[Holder, ...]], expiry_ms: int) -> LeaseId:
        """Lease, for each of ``keys``, its replicas in ``holders`` until ``expiry_ms``: one lease per
        key, with consecutive ids from the one returned."""
        first = LeaseId(self._next_id)
        if not keys:
            return first
        self._next_id += len(keys)
        grant = Grant(first, keys, holders, expiry_ms, len(keys))
        live, held = self._live, self._held
        for i, (key, replicas) in enumerate(zip(keys, holders, strict=True)):
            live[LeaseId(first + i)] = grant
            for holder in replicas:
                counts = held.get(holder)
                if counts is None:
                    held[holder] = {key: 1}
                else:
                    counts[key] = counts.get(key, 0) + 1
        self._grants[first] = grant
        heapq.heappush(self._deadlines, (expiry_ms, first, grant))
        return first

    def release(self, lease_id: LeaseId) -> bool:
        """End this lease (its reader is done); False when it had ended already (or never was)."""
        ended = self._end(lease_id)
        if len(self._deadlines) > 2 * len(self._grants) + 1024:  # mostly released: rebuild from the live ones
            self._deadlines = [(g.expiry_ms, g.first, g) for g in self._grants.values()]
            heapq.heapify(self._deadlines)
        return ended

    def key_of(self, lease_id: LeaseId) -> str | None:
        """The key a live lease covers; None when it has ended (or never was)."""
        grant = self._live.get(lease_id)
        return grant.keys[lease_id - grant.first] if grant is not None else None

    @property
    def next_id(self) -> LeaseId:
        """The id the next grant will get."""
        return LeaseId(self._next_id)

    def expire(self, now_ms: int) -> int:
        """End every lease whose expiry is at or before ``now_ms``; how many ended."""
        ended = 0
        deadlines, live = self._deadlines, self._live
        while deadlines and deadlines[0][0] <= now_ms:
            _, first, grant = heapq.heappop(deadlines)
            for i in range(len(grant.keys)) if grant.live else ():
                if live.get(LeaseId(first + i)) is grant:
                    self._end(LeaseId(first + i))
                    ended += 1  # else released earlier
        return ended

    def _end(self, lease_id: LeaseId) -> bool:
        grant = self._live.pop(lease_id, None)
        if grant is None:
            return False
        i = lease_id - grant.first
        key = grant.keys[i]
        for holder in grant.holders[i]:
            counts = self._held[holder]
            if counts[key] == 1:
                del counts[key]
                if not counts:
                    del self._held[holder]
            else:
                counts[key] -= 1
        grant.live -= 1
        if not grant.live:
            del self._grants[grant.first]
        return True

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
        held: dict[Holder, dict[str, int]] = {}
        grants: dict[int, Grant] = {}
        for lease_id, grant in self._live.items():
            assert 0 <= lease_id - grant.first < len(grant.keys), "a lease outside its grant"
            grants[id(grant)] = grant
            key = grant.keys[lease_id - grant.first]
            for holder in grant.holders[lease_id - grant.first]:
                held.setdefault(holder, {})[key] = held.get(holder, {}).get(key, 0) + 1
        assert held == self._held, "leased replicas drifted"
        assert all(g.live == sum(self._live.get(LeaseId(g.first + i)) is g for i in range(len(g.keys)))
                   for g in grants.values()), "a grant's count of live leases drifted"  # fmt: skip
        assert {g.first for g in grants.values()} == set(self._grants), "live grants miscounted"
        assert {id(g) for g in grants.values()} <= {id(g) for _, _, g in self._deadlines}, "a live lease with no expiry"
