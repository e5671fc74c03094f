"""What a leader removed lately, for the PutEnd of a put whose answer a fault delayed.

A put begun with a leader that has since gone ends with its successor, which never made its
reservation: the successor adopted the block from its daemon's inventory, and PutEnd finds it
committed with the put's checksum (MasterCore.put_end). Unless the key was removed between the
adoption and the PutEnd: the put then said EXISTS of bytes it had stored itself, which every
reader had seen (bench.chaos: one in a 60-minute run). The leader remembers each key it removed,
with its checksum, for :data:`KEPT_S`: a PutEnd of a key it holds no reservation of, whose checksum
is the removed block's, was committed (its bytes were the key's value, then removed, all within the
put: this term never reserved the key for it, so the put began before this term did, or before a
reservation of it here, which forgets the key). Equal checksums of one key are the same write
(the store's rule: see PutStatus)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

KEPT_S = 60.0
"""How long a removal is remembered: past any client's put (its timeout and retries)."""
MOST = 1 << 16
"""At most this many removals remembered (the oldest forgotten first)."""


class RecentRemovals:
    """Keys a leader removed lately and their blocks' checksums (one term's: a new table, a new one)."""

    def __init__(self, kept_s: float = KEPT_S, most: int = MOST) -> None:
        self.kept_s = kept_s
        self.most = most
        self._removed: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def removed(self, keys_and_checksums: Iterable[tuple[str, int]]) -> None:
        """These committed blocks were removed now."""
        now = time.monotonic()
        removed = self._removed
        for key, check in keys_and_checksums:
            removed.pop(key, None)
            removed[key] = (check, now)
        while len(removed) > self.most:
            removed.popitem(last=False)

    def reserved(self, keys: Iterable[str]) -> None:
        """These keys are being put anew here: a PutEnd of them is this term's to judge."""
        removed = self._removed
        if removed:
            for key in keys:
                removed.pop(key, None)

    def was_committed(self, key: str, check: int) -> bool:
        """Whether ``key``'s removed block (within :attr:`kept_s`) had checksum ``check``."""
        got = self._removed.get(key)
        return got is not None and got[0] == check and time.monotonic() - got[1] <= self.kept_s
