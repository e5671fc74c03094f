"""The daemon's book of grants: arena space the master granted clients for one-trip puts.

A grant is opened by the master (``OpenGrant``), written into by clients (``WriteGranted``: each
block claims an extent inside it, never one another block claimed), and ended by the master
(``EndGrants``) once it expired: the end takes no more writes, waits for the writes in flight
and for the commits of the cached puts acknowledged in it (the master frees its space only
after), and cuts a writer that stalls. This module decides; it does no I/O of its own (the
connections to cut are handed to ``cut``) and takes the time from its caller. Thread-safe:
every connection thread and the cached commits' thread use it.
"""

from __future__ import annotations

import socket
import threading
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.allocator import align_up
from kvstore.errors import GrantExpired, InvalidArgument, KVStoreError, PermissionDenied, Timeout

STALE_S = 60.0
"""A grant whose EndGrants never came (its master went away) is forgotten this long after it expired."""


@dataclass(slots=True)
class Grant:
    """Arena space the master granted a client: writes land only inside it, never twice in one place."""

    offset: int
    end: int
    deadline: float
    """time.monotonic() after which no write is taken."""
    owner: str = ""
    """The tenant the master granted it to ("" without tenants)."""
    claimed: list[tuple[int, int]] = field(default_factory=list)
    """Extents written into, sorted (start, end)."""
    receivers: set[socket.socket] = field(default_factory=set)
    active: int = 0
    """Writes in flight into it."""
    cached: int = 0
    """Cached puts acknowledged in it whose commit the master has not answered: the master ends the
    grant (and frees its space) only after them."""
    closed: bool = False

    def claim(self, start: int, end: int) -> bool:
        """Take ``[start, end)`` if it lies inside the grant and touches no extent taken before."""
        if start < self.offset or end > self.end:
            return False
        i = bisect_left(self.claimed, (start, end))
        if i > 0 and self.claimed[i - 1][1] > start:
            return False
        if i < len(self.claimed) and self.claimed[i][0] < end:
            return False
        self.claimed.insert(i, (start, end))
        return True

    def idle(self, cached: bool) -> bool:
        """No write in flight (and, with ``cached``, no cached put's commit unanswered)."""
        return self.active == 0 and (not cached or self.cached == 0)


class Grants:
    def __init__(self, capacity: int, alignment: int) -> None:
        """Grants of an arena of ``capacity`` bytes whose extents start on ``alignment``."""
        self.capacity = capacity
        self.alignment = alignment
        self._grants: dict[int, Grant] = {}
        self._cond = threading.Condition()

    def open(self, grant_id: int, offset: int, length: int, ttl_ms: int, owner: str, now: float) -> None:
        """Open grant ``grant_id`` (again: the same extent is fine, another one InvalidArgument)."""
        if offset < 0 or offset % self.alignment or length <= 0 or offset + length > self.capacity:
            raise InvalidArgument(f"grant ({offset}, {length}) is outside the arena or misaligned")
        with self._cond:
            for stale in [i for i, g in self._grants.items() if g.active == 0 and g.deadline < now - STALE_S]:
                del self._grants[stale]
            known = self._grants.get(grant_id)
            if known is None:
                self._grants[grant_id] = Grant(offset, offset + length, now + ttl_ms / 1000, owner=owner)
            elif (known.offset, known.end) != (offset, offset + length):
                raise InvalidArgument(f"grant {grant_id} is open here for another extent")

    def begin_write(
        self, grant_id: int, tenant: str | None, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int],
        sock: socket.socket, now: float,
    ) -> tuple[Grant | None, list[KVStoreError | None]]:  # fmt: skip
        """A write of blocks into grant ``grant_id`` by a connection of ``tenant`` (None: not a tenant's)
        begins: the grant (None when it takes none of them) and, per block, the error that refuses
        it (its extent is claimed otherwise). Every grant returned goes back to :meth:`end_write`."""
        n = len(keys)
        refused: list[KVStoreError | None] = [None] * n
        with self._cond:
            grant = self._grants.get(grant_id)
            if grant is not None and tenant is not None and grant.owner != tenant:
                return None, [PermissionDenied(f"grant {grant_id} is not tenant {tenant!r}'s")] * n
            if grant is None or grant.closed or now > grant.deadline:
                return None, [GrantExpired(f"grant {grant_id} has ended")] * n
            for i, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
                if offset % self.alignment or not grant.claim(offset, offset + align_up(size, self.alignment)):
                    refused[i] = InvalidArgument(
                        f"block {keys[i]!r}: extent ({offset}, {size}) is not free space of grant {grant_id}"
                    )
            grant.active += 1
            grant.receivers.add(sock)
        return grant, refused

    def end_write(self, grant: Grant, sock: socket.socket) -> None:
        with self._cond:
            grant.active -= 1
            grant.receivers.discard(sock)
            self._cond.notify_all()

    def hold(self, grant_id: int) -> Grant | None:
        """A cached put acknowledged in ``grant_id``: its end waits until :meth:`release` (None: no
        such grant here any more, nothing to hold)."""
        with self._cond:
            grant = self._grants.get(grant_id)
            if grant is not None:
                grant.cached += 1
            return grant

    def release(self, grant: object) -> None:
        """A cached put's commit is answered: what :meth:`hold` returned for it."""
        if isinstance(grant, Grant):
            with self._cond:
                grant.cached -= 1
                self._cond.notify_all()

    def ids(self) -> list[int]:
        with self._cond:
            return list(self._grants)

    def end(
        self, grant_ids: Sequence[int], cut: Callable[[socket.socket], None], wait_s: float, cached: bool = True,
        patience_s: float = 2.0,
    ) -> list[bool]:  # fmt: skip
        """Take no more writes into ``grant_ids`` and wait until none is in flight (with ``cached``, until
        the master answered the commits of the cached puts in them); writers still receiving after
        ``patience_s`` are cut, then ``wait_s`` more is given. Timeout when they did not stop."""
        with self._cond:
            grants = [g for i in grant_ids if (g := self._grants.get(i)) is not None]
            for grant in grants:
                grant.closed = True
            # Writes in flight finish first (their connections carry other requests too); only a
            # writer that stalls is cut off.
            done = self._cond.wait_for(lambda: all(g.idle(cached) for g in grants), patience_s)
            if not done:
                for grant in grants:
                    for sock in grant.receivers:
                        cut(sock)
                done = self._cond.wait_for(lambda: all(g.idle(cached) for g in grants), wait_s)
            if not done:
                raise Timeout("writes into ending grants did not stop in time")
            for grant_id in grant_ids:
                self._grants.pop(grant_id, None)
        return [True] * len(grant_ids)
