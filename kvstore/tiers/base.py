"""The interface every storage tier offers to :class:`kvstore.node_store.NodeStore`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from kvstore.errors import NotFound, StoreClosed
from kvstore.keys import BlockKey


@dataclass(slots=True)
class TierEntry:
    """One block as a tier records it. ``seq`` orders blocks by last use (higher is newer)."""

    key: BlockKey
    size: int
    checksum: int
    seq: int
    pinned: bool
    write_id: int = 0
    """The write id of the put that wrote it (:mod:`kvstore.write_ids`), kept in memory only: 0 after a
    restart, and on SSD."""


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


@dataclass(slots=True)
class BlockRecord:
    """What every tier's in-memory index keeps of a block; tiers extend it with its location."""

    size: int
    checksum: int
    seq: int
    pinned: bool
    write_id: int = field(default=0, kw_only=True)
    """See :attr:`TierEntry.write_id`."""


R = TypeVar("R", bound=BlockRecord)


class IndexedTier(Generic[R]):
    """The in-memory index half of a tier: key -> record, rebuilt from the tier's file at open.

    Subclasses set ``description`` (for messages) and fill ``_index``; only they mutate it.
    """

    description: str
    _index: dict[str, R]
    _closed: bool

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def _record(self, key: str) -> R:
        record = self._index.get(key)
        if record is None:
            self._check_open()
            raise NotFound(f"key {key!r} is not in {self.description}")
        return record

    def entry(self, key: BlockKey) -> TierEntry:
        r = self._record(key)
        return TierEntry(key, r.size, r.checksum, r.seq, r.pinned, r.write_id)

    def entries(self) -> Iterator[TierEntry]:
        for key, r in list(self._index.items()):
            yield TierEntry(BlockKey(key), r.size, r.checksum, r.seq, r.pinned, r.write_id)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"{self.description} is closed")
