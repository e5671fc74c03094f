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
from bisect import bisect_right
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
    ended: bytearray
    """Per lease, 1 once it ended (released or expired)."""
    counted: bool = False
    """Its live leases are counted in :attr:`Leases._held` (done when someone first asks who is leased)."""


class Leases:
    """Every live lease, by id and by replica.

    Invariants: a lease is live iff its grant is in ``_grants`` (by first id) and its ``ended``
    flag is 0; ``_firsts`` holds the first id of every grant in ``_grants``, ascending (and of
    some that ended, dropped when they outnumber the live ones); every grant with a live lease
    has an entry in ``_deadlines`` (entries of grants ended already are skipped when they come
    up, or dropped all at once when they outnumber the live grants). ``_held[(node, tier)][k]``
    counts the live leases of *counted* grants covering that replica, and no count is zero; the
    grants not counted yet are in ``_uncounted``. Counting waits until someone asks who is leased
    (an eviction, a promotion, an operator): a get whose leases are released before then, the
    common case, never touches the counts.
    """

    def __init__(self) -> None:
        self._next_id = 1
        self._count = 0
        self._grants: dict[LeaseId, Grant] = {}
        """Grants with a live lease, by their first id (what the expiry heap is rebuilt from)."""
        self._firsts: list[int] = []
        self._held: dict[Holder, dict[str, int]] = {}
        self._uncounted: list[Grant] = []
        self._deadlines: list[tuple[int, int, Grant]] = []  # heap of (expiry, first id, grant)

    def __len__(self) -> int:
        """Live leases."""
        return self._count

    def grant(self, key: str, holders: Iterable[Holder], expiry_ms: int) -> LeaseId:
        """Lease the replicas ``holders`` of ``key`` until ``expiry_ms``."""
        return self.grant_many([key], [tuple(holders)], expiry_ms)

    def grant_many(self, keys: list[str], holders: list[tuple[Holder, ...]], expiry_ms: int) -> LeaseId:
        """Lease, for each of ``keys``, its replicas in ``holders`` until ``expiry_ms``: one lease per
        key, with consecutive ids from the one returned."""
        first = LeaseId(self._next_id)
        if not keys:
            return first
        if len(keys) != len(holders):
            raise ValueError(f"{len(keys)} keys but {len(holders)} holders")
        n = len(keys)
        self._next_id += n
        self._count += n
        grant = Grant(first, keys, holders, expiry_ms, n, bytearray(n))
        self._grants[first] = grant
        self._firsts.append(first)
        self._uncounted.append(grant)
        heapq.heappush(self._deadlines, (expiry_ms, first, grant))
        return first

    def _find(self, lease_id: int) -> Grant | None:
        """The live grant that holds ``lease_id``; None when there is none (its lease may have ended)."""
        firsts = self._firsts
        at = bisect_right(firsts, lease_id) - 1
        if at < 0:
            return None
        grant = self._grants.get(LeaseId(firsts[at]))
        return grant if grant is not None and lease_id < grant.first + len(grant.keys) else None

    def release(self, lease_id: LeaseId) -> bool:
        """End this lease (its reader is done); False when it had ended already (or never was)."""
        grant = self._find(lease_id)
        ended = grant is not None and self._end(grant, lease_id - grant.first)
        self._compact()
        return ended

    def release_many(self, lease_ids: Iterable[int]) -> int:
        """:meth:`release` of each of ``lease_ids``; how many ended. A get's ids come in a run of one
        grant: it is looked up once."""
        if isinstance(lease_ids, range | list) and lease_ids:
            grant = self._find(lease_ids[0])
            n = len(lease_ids)
            if (
                grant is not None and grant.first == lease_ids[0] and grant.live == len(grant.keys) == n
                and not grant.counted and lease_ids[-1] == grant.first + n - 1
                and (isinstance(lease_ids, range) or lease_ids == list(range(grant.first, grant.first + n)))
            ):  # fmt: skip
                # Every lease of a grant nobody has counted yet (a get's, released whole): ended at once.
                grant.ended[:] = b"\x01" * n
                grant.live = 0
                self._count -= n
                del self._grants[grant.first]
                self._compact()
                return n
        grant = None
        ended = 0
        for lease_id in lease_ids:
            if grant is None or not 0 <= lease_id - grant.first < len(grant.keys):
                grant = self._find(lease_id)
                if grant is None:
                    continue
            if self._end(grant, lease_id - grant.first):
                ended += 1
                if not grant.live:
                    grant = None
        self._compact()
        return ended

    def _compact(self) -> None:
        if len(self._deadlines) > 2 * len(self._grants) + 1024:  # mostly released: rebuild from the live ones
            self._deadlines = [(g.expiry_ms, g.first, g) for g in self._grants.values()]
            heapq.heapify(self._deadlines)
        if len(self._firsts) > 2 * len(self._grants) + 1024:
            self._firsts = sorted(self._grants)
        if len(self._uncounted) > 2 * len(self._grants) + 1024:
            self._uncounted = [g for g in self._uncounted if g.live]

    def key_of(self, lease_id: LeaseId) -> str | None:
        """The key a live lease covers; None when it has ended (or never was)."""
        grant = self._find(lease_id)
        if grant is None or grant.ended[lease_id - grant.first]:
            return None
        return grant.keys[lease_id - grant.first]

    @property
    def next_id(self) -> LeaseId:
        """The id the next grant will get."""
        return LeaseId(self._next_id)

    def expire(self, now_ms: int) -> int:
        """End every lease whose expiry is at or before ``now_ms``; how many ended."""
        ended = 0
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now_ms:
            _, _, grant = heapq.heappop(deadlines)
            for i in range(len(grant.keys)) if grant.live else ():
                ended += self._end(grant, i)  # else released earlier
        return ended

    def _end(self, grant: Grant, i: int) -> bool:
        if grant.ended[i]:
            return False
        grant.ended[i] = 1
        grant.live -= 1
        self._count -= 1
        if grant.counted:
            key, held = grant.keys[i], self._held
            for holder in grant.holders[i]:
                counts = held[holder]
                if counts[key] == 1:
                    del counts[key]
                    if not counts:
                        del held[holder]
                else:
                    counts[key] -= 1
        if not grant.live:
            del self._grants[grant.first]
        return True

    def _count_all(self) -> None:
        """Count the live leases of the grants not counted yet in ``_held``."""
        held = self._held
        for grant in self._uncounted:
            grant.counted = True
            if not grant.live:
                continue
            for key, replicas, ended in zip(grant.keys, grant.holders, grant.ended, strict=True):
                if ended:
                    continue
                for holder in replicas:
                    counts = held.get(holder)
                    if counts is None:
                        held[holder] = {key: 1}
                    else:
                        counts[key] = counts.get(key, 0) + 1
        self._uncounted.clear()

    # -- reading ----------------------------------------------------------------------------
    def is_leased(self, node_id: str, tier: TierName, key: str) -> bool:
        if self._uncounted:
            self._count_all()
        counts = self._held.get((node_id, tier))
        return counts is not None and key in counts

    def num_leased(self, node_id: str, tier: TierName) -> int:
        """Keys with a leased replica on this node and tier."""
        if self._uncounted:
            self._count_all()
        counts = self._held.get((node_id, tier))
        return len(counts) if counts is not None else 0

    def leased_keys(self, node_id: str, tier: TierName) -> Collection[str]:
        """The keys with a leased replica on this node and tier: a read-only view, good until leases change."""
        if self._uncounted:
            self._count_all()
        counts = self._held.get((node_id, tier))
        return counts.keys() if counts is not None else ()

    def check(self) -> None:
        """Assert the invariants of the class docstring (for tests)."""
        held: dict[Holder, dict[str, int]] = {}
        live = 0
        for first, grant in self._grants.items():
            assert grant.first == first and grant.live == grant.ended.count(0) > 0, (
                "a grant's count of live leases drifted"
            )
            live += grant.live
            if not grant.counted:
                continue
            for key, replicas, ended in zip(grant.keys, grant.holders, grant.ended, strict=True):
                for holder in replicas if not ended else ():
                    held.setdefault(holder, {})[key] = held.get(holder, {}).get(key, 0) + 1
        assert held == self._held, "leased replicas drifted"
        assert live == self._count, "live leases miscounted"
        assert set(self._grants) <= set(self._firsts) and self._firsts == sorted(self._firsts), "grants unfindable"
        assert {id(g) for g in self._grants.values()} <= {id(g) for _, _, g in self._deadlines}, (
            "a live lease with no expiry"
        )
        assert {id(g) for g in self._grants.values() if not g.counted} <= {id(g) for g in self._uncounted}
