"""The interface every storage tier offers to :class:`kvstore.node_store.NodeStore`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstore.keys import BlockKey


@dataclass(slots=True)
class TierEntry:
    """One block as a tier records it. ``seq`` orders blocks by last use (higher is newer)."""

    key: BlockKey
    size: int
    checksum: int
    seq: int
    pinned: bool


class Tier(Protocol):
    """A capacity-bounded map from keys to immutable blocks that survives its process.

    ``store`` returns False when the tier has no room (an expected outcome that
    the caller answers by evicting); every other failure raises a
    :class:`kvstore.errors.KVStoreError`.
    """

    capacity: int

    @property
    def used(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...

    def entry(self, key: BlockKey) -> TierEntry: ...

    def entries(self) -> Iterator[TierEntry]: ...

    def store(self, key: BlockKey, data: memoryview, checksum: int, seq: int, pinned: bool = False) -> bool: ...

    def store_many(self, items: Sequence[tuple[BlockKey, memoryview, int, int, bool]]) -> list[bool]: ...

    def read_into(self, key: BlockKey, dst: memoryview) -> int: ...

    def read(self, key: BlockKey) -> bytes: ...

    def delete(self, key: BlockKey) -> int: ...

    def delete_many(self, keys: Sequence[BlockKey]) -> None: ...

    def touch(self, key: BlockKey, seq: int) -> None: ...

    def set_pinned(self, key: BlockKey, pinned: bool) -> None: ...

    def close(self) -> None: ...
