"""Write space the master granted this client: one-trip puts carve their extents out of it.

A grant is a contiguous range of one node's DRAM arena, held for this client until its ttl
passes (the client stops using it a margin before) or it is returned. Blocks are carved from
the front, aligned; a grant that cannot hold the next block is retired (returned) and another
asked for. Thread-safe: carving is one short critical section.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


class GrantPool:
    def __init__(
        self, ask: Callable[[int, str | None], GrantReply], give_back: Callable[[list[int]], None], size: int
    ) -> None:
        self._ask = ask
        self._give_back = give_back
        self.size = size
        self._grants: dict[str | None, Grant] = {}  # by preferred node (None: wherever the master chose)
        self._lock = threading.Lock()

    def carve(self, sizes: Sequence[int], preferred: str | None) -> tuple[Grant, list[int]] | None:
        """Offsets for blocks of ``sizes`` in one grant (asking the master for one when needed), or
        None when no grant can hold them together (the caller puts them the two-trip way)."""
        if too_big_for(sizes, self.size):
            return None
        retired: Grant | None = None
        with self._lock:
            grant = self._grants.get(preferred)
            if grant is not None and not grant.usable(sizes):
                retired = self._grants.pop(preferred)
                grant = None
        if retired is not None:
            self._give_back([retired.grant_id])  # its rest returns to the pool (an early end)
        if grant is None:
            reply = self._ask(self.size, preferred)
            # The master caps grants (a fraction of a node's DRAM): batches larger than that put
            # the two-trip way from now on, rather than asking for grants that cannot hold them.
            self.size = min(self.size, reply.length)
            fresh = Grant.from_reply(reply)
            if not fresh.usable(sizes):
                self._give_back([reply.grant_id])
                return None
            with self._lock:
                old = self._grants.get(preferred)
                self._grants[preferred] = grant = fresh
            if old is not None:
                self._give_back([old.grant_id])
        with self._lock:
            offsets = grant.take(sizes)  # None: another thread took it meanwhile (rare): the two-trip way
        return (grant, offsets) if offsets is not None else None

    def drop(self, grant: Grant) -> None:
        """Stop using ``grant`` (its node refused it, or is unreachable) and return it."""
        with self._lock:
            mine = [where for where, known in self._grants.items() if known is grant]
            for where in mine:
                del self._grants[where]
        if mine:
            self._give_back([grant.grant_id])

    def close(self) -> None:
        with self._lock:
            ids = [g.grant_id for g in self._grants.values()]
            self._grants.clear()
        if ids:
            self._give_back(ids)
