"""Where keys were last seen: the client's location hints.

A get of a key whose node is remembered asks that node's daemon directly, in one round trip;
a miss there (evicted, removed, moved) is forgotten and asked of the master. Bounded: the
least recently used hints go first.

A read's word about a key counts only if no hint of it came after the read began: a get that
began before this client's own put of the key was answered (and missed it at the master, which
did not know the put yet: a cached one) must not forget where that put went, or the writer's
next get would ask the master too and miss its own put.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class LocationHints:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._where: dict[str, tuple[str, str]] = {}  # key -> (node_id, address); order: last use
        self._set_at: dict[str, int] = {}
        """Key -> when its hint was set (:meth:`now`'s clock)."""
        self._clock = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[str, str] | None:
        return self._where.get(key)

    def now(self) -> int:
        """The stamp a read that begins now passes as ``since`` to :meth:`note` and :meth:`forget`."""
        return self._clock

    def note(self, places: Iterable[tuple[str, tuple[str, str] | None]], since: int | None = None) -> None:
        """Remember each key's (node_id, address); None forgets the key. ``since``: the word of a read
        that began at that stamp, which leaves a hint set after it alone."""
        if not self.capacity:
            return
        where, set_at = self._where, self._set_at
        with self._lock:
            for key, place in places:
                if since is not None and set_at.get(key, 0) > since:
                    continue  # a newer hint than this read knew of
                where.pop(key, None)  # re-inserted last: the dict's order is the order of last use
                set_at.pop(key, None)
                if place is not None:
                    self._clock += 1
                    where[key] = place
                    set_at[key] = self._clock
            while len(where) > self.capacity:
                oldest = next(iter(where))
                del where[oldest]
                set_at.pop(oldest, None)

    def forget(self, keys: Iterable[str], since: int | None = None) -> None:
        """Forget the keys' hints (``since``: as in :meth:`note`)."""
        self.note(((key, None) for key in keys), since)

    def __len__(self) -> int:
        return len(self._where)
