"""Read leases of the placement table: which replicas readers hold, and until when.

A get leases the replicas of a key it hands out as one :class:`Lease` with its
own identity and expiry. A replica ``(node, tier, key)`` is *leased* while some
live lease covers it: a lease is live from its grant until it is released or
expires, whichever comes first, and ending it affects that lease alone. Time
comes in as ``now_ms``; nothing here reads a clock.

Releases by key. The wire's ``ReleaseLeases`` names keys, not leases: a release
of key ``k`` ends the live lease of ``k`` that expires first (the oldest, as
every lease lasts as long). So a release never shortens any other reader's
protection: if the releaser's own lease is still live, every lease left
expires no earlier than the one that ended, and the key stays leased at least
as long as each remaining reader's own lease runs. A release that arrives after
the releaser's lease expired (a slow client) would otherwise end someone else's
lease; so each lease that expires leaves a *late-release token* for its key,
kept for ``late_ms``, and a release of a key that has one spends it and ends no
lease. The cost is on the safe side: a token may absorb a punctual release,
whose lease then runs until it expires. Only a release that arrives more than
``late_ms`` after its lease expired can end another reader's lease early;
closing that too takes lease identities on the wire.

Only this class changes lease state; the table and the eviction policy read it
through :meth:`is_leased`, :meth:`num_leased` and :meth:`leased_keys`.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import NewType

from kvstore.errors import InvalidArgument
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
    when they come up); ``_tokens[k]`` is sorted and every token in it has an
    entry in ``_token_deadlines``.
    """

    def __init__(self, *, late_ms: int) -> None:
        if type(late_ms) is not int or late_ms < 0:
            raise InvalidArgument(f"late_ms must be a non-negative int of milliseconds, got {late_ms!r}")
        self.late_ms = late_ms
        self._next_id = 1
        self._live: dict[LeaseId, Lease] = {}
        self._by_key: dict[str, dict[LeaseId, int]] = {}
        self._held: dict[Holder, dict[str, int]] = {}
        self._deadlines: list[tuple[int, LeaseId]] = []  # heap of (expiry, lease)
        self._tokens: dict[str, list[int]] = {}  # key -> when each of its late-release tokens lapses
        self._token_deadlines: list[tuple[int, str]] = []  # heap of (lapse, key)

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
        """End this lease (its reader is done); False when it had ended already."""
        return self._end(lease_id) is not None

    def release_key(self, key: str) -> bool:
        """A reader is done with one lease of ``key`` but does not say which (see the module
        docstring): spend a late-release token of ``key`` if it has one, else end its live lease
        that expires first. True when a lease ended."""
        tokens = self._tokens.get(key)
        if tokens:
            tokens.pop(0)  # the one that lapses first; the heap entry is skipped when it comes up
            if not tokens:
                del self._tokens[key]
            return False
        live = self._by_key.get(key)
        if not live:
            return False
        first = min(live, key=live.__getitem__)  # ties: the oldest, as a dict keeps grant order
        self._end(first)
        return True

    def expire(self, now_ms: int) -> int:
        """End every lease whose expiry is at or before ``now_ms``, leaving a late-release token for
        each, and forget tokens past ``late_ms``. Returns how many leases ended."""
        ended = 0
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now_ms:
            expiry, lease_id = heapq.heappop(deadlines)
            lease = self._end(lease_id)
            if lease is None:
                continue  # released earlier
            ended += 1
            lapse = expiry + self.late_ms
            bisect.insort(self._tokens.setdefault(lease.key, []), lapse)
            heapq.heappush(self._token_deadlines, (lapse, lease.key))
        lapses = self._token_deadlines
        while lapses and lapses[0][0] <= now_ms:
            lapse, key = heapq.heappop(lapses)
            tokens = self._tokens.get(key)
            # Releases spend a key's tokens first-lapsing first: one lapsing now may be spent already.
            if tokens and tokens[0] <= lapse:
                tokens.pop(0)
                if not tokens:
                    del self._tokens[key]
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
        for key, tokens in self._tokens.items():
            assert tokens and tokens == sorted(tokens), f"{key}: tokens out of order"
        assert sum(map(len, self._tokens.values())) <= len(self._token_deadlines), "a token that never lapses"
