"""Where keys were last seen: the client's location hints.

A get of a key whose node is remembered asks that node's daemon directly, in one round trip;
a miss there (evicted, removed, moved) is forgotten and asked of the master. Bounded: the
least recently used hints go first.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable


class LocationHints:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._where: dict[str, tuple[str, str]] = {}  # key -> (node_id, address); order: last use
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[str, str] | None:
        return self._where.get(key)

    def note(self, places: Iterable[tuple[str, tuple[str, str] | None]]) -> None:
        """Remember each key's (node_id, address); None forgets the key."""
        if not self.capacity:
            return
        where = self._where
        with self._lock:
            for key, place in places:
                where.pop(key, None)  # re-inserted last: the dict's order is the order of last use
                if place is not None:
                    where[key] = place
            while len(where) > self.capacity:
                del where[next(iter(where))]

    def forget(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._where.pop(key, None)

    def __len__(self) -> int:
        return len(self._where)
