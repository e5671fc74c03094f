"""What a leader removed lately, for the PutEnd of a put whose answer a fault delayed.

A put begun with a leader that has since gone ends with its successor, which never made its
reservation: the successor adopted the block from its daemon's inventory, and PutEnd finds it
committed as the put's write (MasterCore.put_end). Unless the key was removed between the
adoption and the PutEnd: the put then said EXISTS of bytes it had stored itself, which every
reader had seen (bench.chaos: one in a 60-minute run). The leader remembers the blocks of each key
it removed, with their write ids and checksums, for :data:`KEPT_S` (the last :data:`PER_KEY` of a
key): a PutEnd of a key it holds no reservation of, whose write is one of them, was committed (its
bytes were the key's value, then removed, all within the put). A write id says so for certain,
whatever was put under the key since. A block without one (a writer or a daemon that sent none) is
judged by its checksum (equal checksums of one key are one write: see PutStatus), and only until
a put of the key begins here: from then on the table judges it."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from kvstore.write_ids import same_write

KEPT_S = 60.0
"""How long a removal is remembered: past any client's put (its timeout and retries)."""
MOST = 1 << 16
"""At most this many keys' removals remembered (the oldest forgotten first)."""
PER_KEY = 4
"""At most this many removed blocks remembered of one key (a key removed and put again and again)."""


class RecentRemovals:
    """Keys a leader removed lately and their blocks' writes (one term's: a new table, a new one)."""

    def __init__(self, kept_s: float = KEPT_S, most: int = MOST) -> None:
        self.kept_s = kept_s
        self.most = most
        self._removed: OrderedDict[str, list[tuple[int, int, float, bool]]] = OrderedDict()
        """Key -> its removed blocks, oldest first: (write id, checksum, when, whether only a PutEnd
        with that write id may match it: the key was reserved here since)."""

    def removed(self, blocks: Iterable[tuple[str, int, int]]) -> None:
        """These committed blocks, (key, write id, checksum), were removed now."""
        now = time.monotonic()
        removed = self._removed
        for key, write_id, check in blocks:
            kept = removed.pop(key, None) or []
            kept = [b for b in kept if now - b[2] <= self.kept_s][-(PER_KEY - 1) :]
            kept.append((write_id, check, now, False))
            removed[key] = kept
        while len(removed) > self.most:
            removed.popitem(last=False)

    def reserved(self, keys: Iterable[str]) -> None:
        """These keys are being put anew here: a PutEnd of a block of theirs with no write id is this
        term's to judge (a write id stays certain)."""
        removed = self._removed
        if removed:
            for key in keys:
                kept = removed.get(key)
                if kept is not None:
                    kept[:] = [(w, c, t, True) for w, c, t, _ in kept if w]
                    if not kept:
                        del removed[key]

    def was_committed(self, key: str, check: int, write_id: int = 0) -> bool:
        """Whether a block of ``key`` removed within :attr:`kept_s` was the write (``write_id``, ``check``)."""
        kept = self._removed.get(key)
        if not kept:
            return False
        now = time.monotonic()
        return any(
            now - when <= self.kept_s and (write_id or not by_id) and same_write(wid, c, write_id, check)
            for wid, c, when, by_id in kept
        )
