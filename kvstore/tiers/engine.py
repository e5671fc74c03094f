"""The moves of blocks between a node's DRAM arena and its SSD tier, in one place.

:class:`kvstore.node_store.NodeStore` (an embedded store that decides its own
evictions) and the storage daemon (which carries out the master's commands)
both drive their tiers through a :class:`TierEngine`, so that a write's commit
and abort, a demotion, a promotion, a drop and crash recovery behave the same
in both.

Crash safety: a move between tiers writes the new copy before it deletes the
old one, so a crash (or a failed delete) in between leaves the block in both
tiers, never in neither. Such a **twin** is never an error: the DRAM copy is
the block; opening the tiers deletes the SSD copy, a demotion reuses an SSD
copy with the same checksum instead of writing it again, and a drop deletes
both.

Pending writes: a block begun in the arena (:meth:`DramArena.begin` or
``begin_at``) and not yet committed is given up (its extent freed) by a
demotion or a drop of its key: whoever evicts it has decided it will not land.

Not thread-safe: the owner serialises calls (NodeStore's lock, the daemon's
exclusive lock). Sequence numbers order blocks by last use across both tiers;
only :meth:`next_seq` hands them out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvstore.config import DramConfig, SsdConfig, format_size
from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey
from kvstore.ratelog import RateLimitedLog
from kvstore.tiers.dram import DramArena
from kvstore.tiers.ssd import SsdTier

log = logging.getLogger("kvstore.tiers")

Reserve = Callable[[int], memoryview | None]
"""Reserves ``size`` bytes in the arena for a promoted block: a writable view, None (or a raised
:class:`KVStoreError`) when there is no room."""


class TierEngine:
    """A node's two tiers and the moves between them (see the module docstring for the rules).

    ``arena`` and ``ssd`` are public for reads and for writes' reservations; every commit, abort,
    demotion, promotion and drop goes through this class.
    """

    def __init__(self, dram: DramConfig, ssd: SsdConfig, *, managed: bool) -> None:
        """Open (or re-attach) both tiers and recover them: twins keep their DRAM copy.

        ``managed``: the arena places blocks itself (NodeStore); unmanaged, a master does (the daemon).
        """
        self.arena = DramArena(dram, managed=managed)
        try:
            self.ssd: SsdTier | None = SsdTier(ssd) if ssd.capacity > 0 else None
        except BaseException:
            self.arena.close()
            raise
        self._failures = RateLimitedLog(log)
        self._drop_twins()
        entries = [*self.arena.entries(), *(self.ssd.entries() if self.ssd else [])]
        self._seq = max((e.seq for e in entries), default=0)

    def _drop_twins(self) -> None:
        if self.ssd is None:
            return
        twins = [e.key for e in self.ssd.entries() if e.key in self.arena]
        if twins:
            self.ssd.delete_many(twins)

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # -- writes ------------------------------------------------------------------
    def commit(self, key: BlockKey, checksum: int, *, pinned: bool = False, write_id: int = 0) -> None:
        """Make the block being written under ``key`` by the put ``write_id`` visible, as the newest block."""
        self.arena.commit(key, checksum, self.next_seq(), pinned, write_id)

    def abort(self, key: BlockKey) -> bool:
        """Give up the write of ``key`` if one is pending (its extent is free again); whether one was."""
        if self.arena.is_pending(key):
            self.arena.abort(key)
            return True
        return False

    def touch(self, key: BlockKey) -> None:
        """Record a use of ``key`` in whichever tier holds it (DRAM persists it, SSD keeps it in memory)."""
        if key in self.arena:
            self.arena.touch(key, self.next_seq())
        elif self.ssd is not None and key in self.ssd:
            self.ssd.touch(key, self.next_seq())

    # -- moves ---------------------------------------------------------------------
    def demote(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Move DRAM blocks to SSD. Per key, True when it is on SSD afterwards (moved now, or by an
        earlier try of the same move); False when it is gone: SSD could not take it (the DRAM copy is
        dropped all the same) or it was not held. A pending write of a key is given up first."""
        for key in keys:
            self.abort(key)
        present = [k for k in dict.fromkeys(keys) if k in self.arena]
        moved: set[str] = set()
        if self.ssd is not None and present:
            moved = self._copy_to_ssd(present)
        for key in present:
            self.arena.delete(key)
        if self.ssd is not None:
            # Already moved: a retry of a command whose answer was lost.
            moved.update(k for k in keys if k not in self.arena and k in self.ssd)
        return [k in moved for k in keys]

    def _copy_to_ssd(self, keys: list[BlockKey]) -> set[str]:
        """Write the DRAM blocks ``keys`` to SSD (reusing a twin with the same checksum); those on SSD after."""
        ssd = self.ssd
        assert ssd is not None
        entries = {key: self.arena.entry(key) for key in keys}
        stale = [k for k in keys if k in ssd and ssd.entry(k).checksum != entries[k].checksum]
        if stale:  # not the same bytes: never serve them
            ssd.delete_many(stale)
        items = [
            (key, self.arena.view(key), entries[key].checksum, self.next_seq(), entries[key].pinned)
            for key in keys
            if key not in ssd
        ]
        failed = ssd.failed_writes
        try:
            results = ssd.store_many(items)
        finally:
            for item in items:
                item[1].release()
        if ssd.failed_writes > failed:
            self._failures.warning(
                "ssd-write", "%s: %d blocks dropped instead of demoted (%s); it holds %s now",
                ssd.description, ssd.failed_writes - failed, ssd.fault, format_size(ssd.capacity),
            )  # fmt: skip
        moved: set[str] = {item[0] for item, ok in zip(items, results, strict=True) if ok}
        moved.update(k for k in keys if k in ssd)  # twins reused
        return moved

    def promote(self, key: BlockKey, reserve: Reserve) -> bool:
        """Move an SSD block into the arena, into the room ``reserve`` gives it. False (the block stays
        on SSD) when there is no room, or when the key is not on SSD alone."""
        ssd = self.ssd
        if ssd is None or key not in ssd or key in self.arena or self.arena.is_pending(key):
            return False
        entry = ssd.entry(key)
        try:
            dst = reserve(entry.size)
        except KVStoreError:
            return False
        if dst is None:
            return False
        try:
            ssd.read_into(key, dst)
        except BaseException:
            dst.release()
            self.arena.abort(key)
            raise
        dst.release()
        self.arena.commit(key, entry.checksum, self.next_seq(), entry.pinned)
        try:
            ssd.delete(key)
        except KVStoreError as exc:  # a twin: the DRAM copy is the block from now on (module docstring)
            self._failures.warning("ssd-delete", "%s: a promoted block's old copy stays: %s", ssd.description, exc)
        return True

    def drop(self, keys: Sequence[BlockKey], tier: str = "") -> list[bool]:
        """Delete blocks from every tier that holds them, and give up pending writes of them, or
        from ``tier`` only ("dram": with pending writes, or "ssd"); per key, whether there was
        anything to delete."""
        dram, ssd = tier != "ssd", tier != "dram"
        out = []
        on_ssd: dict[BlockKey, None] = {}
        for key in keys:
            held = self.abort(key) if dram else False
            if dram and key in self.arena:
                self.arena.delete(key)
                held = True
            if ssd and self.ssd is not None and key in self.ssd:
                on_ssd[key] = None
                held = True
            out.append(held)
        if on_ssd and self.ssd is not None:
            self.ssd.delete_many(list(on_ssd))
        return out

    # -- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Close both tiers (SSD first), keeping their contents for the next open; the first failure
        is raised once both have been tried."""
        errors: list[BaseException] = []
        for tier in (self.ssd, self.arena):
            if tier is None:
                continue
            try:
                tier.close()
            except Exception as exc:  # close both tiers even if one fails
                errors.append(exc)
        if errors:
            raise errors[0]
