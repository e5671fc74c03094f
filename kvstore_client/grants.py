"""Write space the master granted this client: one-trip puts carve their extents out of it.

A grant is a contiguous range of one node's DRAM arena, held for this client until its ttl
passes (the client stops using it a margin before) or it is returned. Blocks are carved from
the front, aligned; a grant that cannot hold the next block is retired (returned) and another
asked for. No I/O here: the client core asks the master for grants and gives them back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvstore.allocator import align_up
from kvstore.protocol import GrantReply

# Stop using a grant this long before it ends (the daemon refuses writes after its own deadline).
_MARGIN_S = 1.0
ALIGNMENT = 64
"""The smallest extent alignment (the daemons' default): what a batch needs is counted with it
before a grant (which names its node's alignment) is in hand."""


@dataclass(slots=True)
class Grant:
    grant_id: int
    node_id: str
    address: str
    next: int
    end: int
    usable_until: float
    alignment: int = 64

    @classmethod
    def from_reply(cls, reply: GrantReply) -> Grant:
        return cls(
            reply.grant_id, reply.node_id, reply.address, reply.offset, reply.offset + reply.length,
            time.monotonic() + reply.ttl_ms / 1000 - _MARGIN_S, reply.alignment,
        )  # fmt: skip

    def room(self) -> int:
        return self.end - self.next

    def need(self, sizes: Sequence[int]) -> int:
        """Bytes blocks of ``sizes`` take in this grant (each at this node's alignment)."""
        return sum(align_up(s, self.alignment) for s in sizes)

    def usable(self, sizes: Sequence[int]) -> bool:
        """Whether it can take blocks of ``sizes`` now (room left, not about to end)."""
        return self.room() >= self.need(sizes) and time.monotonic() <= self.usable_until

    def take(self, sizes: Sequence[int]) -> list[int] | None:
        """Offsets for blocks of ``sizes``, carved from the front; None when they do not fit."""
        if self.room() < self.need(sizes) or self.next % self.alignment:
            return None
        offsets = []
        for size in sizes:
            offsets.append(self.next)
            self.next += align_up(size, self.alignment)
        return offsets


def too_big_for(sizes: Sequence[int], grant_size: int) -> bool:
    """A batch that would use up a grant in a few puts saves nothing over the two-trip put (one
    master round trip for the whole batch) and would cost a grant each time."""
    return sum(align_up(s, ALIGNMENT) for s in sizes) * 4 > grant_size


class NeedGrant(NamedTuple):
    """No grant in hand can take the blocks: ask the master for one (of :attr:`GrantPool.size`
    bytes), after returning ``retired``, and hand its answer to :meth:`GrantPool.install`."""

    retired: list[int]


Carved = tuple[Grant, list[int]]
"""A grant and the offsets of the blocks carved out of it."""


class GrantPool:
    """The grants this client holds, one per preferred node (None: wherever the master chose).

    Without I/O: :meth:`carve` answers offsets, or that a grant must be asked for, or None (put
    the two-trip way); the caller talks to the master and gives back the ids these methods
    return. One grant is asked for at a time per preferred node: meanwhile other puts (threads, or
    tasks on an event loop) go the two-trip way rather than each asking for a grant of its own.
    Thread-safe: every change is one short critical section, never held across I/O."""

    def __init__(self, size: int) -> None:
        self.size = size
        """Bytes to ask for; lowered to the master's cap once it answers with less."""
        self._grants: dict[str | None, Grant] = {}
        self._asking: set[str | None] = set()
        """Preferred nodes a grant is being asked for (until :meth:`install` or :meth:`abandon`)."""
        self._lock = threading.Lock()

    def carve(self, sizes: Sequence[int], preferred: str | None) -> Carved | NeedGrant | None:
        """Offsets for blocks of ``sizes`` in the grant in hand; NeedGrant when there is none that
        can hold them; None when no grant would be worth it (the caller puts them the two-trip way)."""
        if too_big_for(sizes, self.size):
            return None
        with self._lock:
            grant = self._grants.get(preferred)
            if grant is not None and grant.usable(sizes):
                offsets = grant.take(sizes)
                return (grant, offsets) if offsets is not None else None
            if preferred in self._asking:
                return None  # another put is asking for one now
            self._asking.add(preferred)
            if grant is None:
                return NeedGrant([])
            del self._grants[preferred]
            return NeedGrant([grant.grant_id])  # its rest returns to the pool (an early end)

    def carve_held(self, sizes: Sequence[int], preferred: str | None) -> Carved | None:
        """Offsets for blocks of ``sizes`` in the grant in hand, if it can hold them; None otherwise,
        changing nothing (:meth:`carve` then says what to do)."""
        if too_big_for(sizes, self.size):
            return None
        with self._lock:
            grant = self._grants.get(preferred)
            if grant is None or not grant.usable(sizes):
                return None
            offsets = grant.take(sizes)
            return (grant, offsets) if offsets is not None else None

    def abandon(self, preferred: str | None) -> None:
        """The grant asked for after a NeedGrant did not come (the master refused, or did not answer)."""
        with self._lock:
            self._asking.discard(preferred)

    def install(
        self, reply: GrantReply, preferred: str | None, sizes: Sequence[int]
    ) -> tuple[Carved | None, list[int]]:
        """Take the master's new grant and carve ``sizes`` from it; returns what was carved (None:
        the two-trip way) and the ids of grants to give back."""
        # The master caps grants (a fraction of a node's DRAM): batches larger than that put
        # the two-trip way from now on, rather than asking for grants that cannot hold them.
        self.size = min(self.size, reply.length)
        fresh = Grant.from_reply(reply)
        if not fresh.usable(sizes):
            self.abandon(preferred)
            return None, [reply.grant_id]
        with self._lock:
            self._asking.discard(preferred)
            old = self._grants.get(preferred)
            self._grants[preferred] = fresh
            offsets = fresh.take(sizes)
        back = [old.grant_id] if old is not None else []  # another caller's, installed meanwhile
        return ((fresh, offsets) if offsets is not None else None), back

    def drop(self, grant: Grant) -> list[int]:
        """Stop using ``grant`` (its node refused it, or is unreachable); the ids to give back."""
        with self._lock:
            mine = [where for where, known in self._grants.items() if known is grant]
            for where in mine:
                del self._grants[where]
        return [grant.grant_id] if mine else []

    def held(self) -> list[Grant]:
        with self._lock:
            return list(self._grants.values())

    def close(self) -> list[int]:
        """Forget every grant; the ids to give back."""
        with self._lock:
            ids = [g.grant_id for g in self._grants.values()]
            self._grants.clear()
        return ids
