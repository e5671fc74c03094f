"""An O(1) least-recently-used order over keys, with pins and leases.

Order contract: iteration and :meth:`victims` go from the least recently used
key to the most recently used. :meth:`insert` and :meth:`touch` make a key the
most recent; nothing else reorders. A key may be *pinned* (by its owner, until
unpinned) or *leased* (counted: a reader holds it until it releases each
lease); :meth:`victims` skips both, leaving their place in the order intact.

The LRU holds each key's size so that a policy can count bytes freed without
another lookup. Only the owning tier index mutates it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterator
from typing import Generic, TypeVar

from kvstore.errors import NotFound

K = TypeVar("K", bound=Hashable)


class LRU(Generic[K]):
    def __init__(self) -> None:
        self._order: OrderedDict[K, int] = OrderedDict()
        self._pinned: set[K] = set()
        self._leases: dict[K, int] = {}
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __iter__(self) -> Iterator[K]:
        return iter(self._order)

    def size_of(self, key: K) -> int:
        return self._order[key]

    def insert(self, key: K, size: int) -> None:
        """Add ``key`` as the most recently used; re-inserting replaces its size and touches it."""
        old = self._order.pop(key, None)
        if old is not None:
            self.total_bytes -= old
        self._order[key] = size
        self.total_bytes += size

    def touch(self, key: K) -> None:
        """Make ``key`` the most recently used; raises :class:`NotFound` if absent."""
        try:
            self._order.move_to_end(key)
        except KeyError:
            raise NotFound(f"key {key!r} is not in this LRU") from None

    def touch_if_present(self, key: K) -> bool:
        """Make ``key`` the most recently used if it is here; whether it was (one call on hot paths)."""
        try:
            self._order.move_to_end(key)
        except KeyError:
            return False
        return True

    def remove(self, key: K) -> int:
        """Forget ``key`` (with its pin and leases); returns its size. Raises :class:`NotFound` if absent."""
        try:
            size = self._order.pop(key)
        except KeyError:
            raise NotFound(f"key {key!r} is not in this LRU") from None
        self.total_bytes -= size
        self._pinned.discard(key)
        self._leases.pop(key, None)
        return size

    def pin(self, key: K) -> None:
        if key not in self._order:
            raise NotFound(f"cannot pin {key!r}: not in this LRU")
        self._pinned.add(key)

    def unpin(self, key: K) -> None:
        self._pinned.discard(key)

    def is_pinned(self, key: K) -> bool:
        return key in self._pinned

    def lease(self, key: K) -> None:
        if key not in self._order:
            raise NotFound(f"cannot lease {key!r}: not in this LRU")
        self._leases[key] = self._leases.get(key, 0) + 1

    def release(self, key: K) -> None:
        count = self._leases.get(key, 0)
        if count <= 1:
            self._leases.pop(key, None)
        else:
            self._leases[key] = count - 1

    def is_leased(self, key: K) -> bool:
        return key in self._leases

    @property
    def num_pinned(self) -> int:
        return len(self._pinned)

    @property
    def num_leased(self) -> int:
        """Keys with at least one lease."""
        return len(self._leases)

    def victims(self, skip: Collection[K] = ()) -> Iterator[tuple[K, int]]:
        """(key, size) of evictable keys, least recently used first; skips pinned and leased keys,
        and those in ``skip`` (keys leased where the owner keeps leases itself, as the master does).

        Do not mutate the LRU while iterating.
        """
        pinned, leases = self._pinned, self._leases
        if not pinned and not leases and not skip:
            yield from self._order.items()
            return
        for key, size in self._order.items():
            if key not in pinned and key not in leases and key not in skip:
                yield key, size
