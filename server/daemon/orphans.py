"""Orphans: blocks a daemon holds that no put the master knows placed there, found and dropped.

A two-trip put reserves its extent at the master, then writes the bytes to the daemon. If the
master gives the put up first (its reservation expired, its writer revoked it, the key was
removed, or a new leader never knew it), the drop it sends can reach the daemon before the bytes
do: the block lands after its drop, and nobody knows of it. It holds DRAM the master hands out
again, so puts there are refused (RetryLater: "overlaps the block"), and it is counted in no
quota. Tenants' seals are taken once and closed by the drop, which stops a tenant replaying one;
this stops the rest, whatever the cause:

- a block whose key the master dropped here while the daemon held none (the drop that came
  first) and that a two-trip write then began is asked about ``delay_s`` after (a put commits at
  the master within seconds, or is given up); other writes are the master's puts in flight, whose
  drop, if it comes, finds their bytes;
- the blocks in the way of a write refused for its key or extent are asked about at once;
- every block here is asked about again each ``sweep_s`` (a slow walk, ``batch`` a heartbeat).

The master answers, per block, whether a put it knows placed that key on this node with these
bytes (:class:`~kvstore.protocol.CheckBlocks`); an orphan's DRAM extent is kept out of its free
space until the daemon says the block is gone. The daemon drops an orphan only if it is still
held exactly as described and was not written anew while the question was out. A block still
being written is asked about only once it has been so for ``stale_s`` (a grant's write waits for
its commit at the master, which the master does not know of until then).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvstore.errors import KVStoreError
from kvstore.keys import BlockKey
from kvstore.protocol import CheckBlocks, CheckBlocksReply
from kvstore.ratelog import RateLimitedLog
from server.daemon.storage import BlockState, DaemonStorage

log = logging.getLogger("kvstore.daemon")

Ask = Callable[[CheckBlocks], CheckBlocksReply]
Drop = Callable[[list[tuple[BlockKey, BlockState]]], list[BlockKey]]

MAX_TRACKED = 1 << 20
"""Keys remembered for a check at most (the oldest beyond are left to the sweep)."""
SUSPECT_S = 600.0
"""How long a key the master dropped while absent stays suspect (a put's bytes come within its
reservation, seconds; a writer stalled longer is the sweep's)."""


class Orphans:
    """Which blocks to ask the master about, and dropping those it does not know (see the module)."""

    def __init__(
        self, storage: DaemonStorage, node_id: str, *, delay_s: float = 2.0, sweep_s: float = 600.0,
        batch: int = 4096, stale_s: float = 120.0, drop: Drop | None = None,
        pending: Callable[[BlockKey], bool] | None = None,
    ) -> None:  # fmt: skip
        """``drop``: how orphans are dropped (the server's, which first cuts their receivers);
        by default the storage's own. ``pending``: whether a block's commit to the master is still
        to come (a cached put's): never asked about then, since the master's "unknown" would be
        true when it answers and false once the commit lands, which may be before the drop."""
        self.storage = storage
        self._pending = pending
        self.node_id = node_id
        self.delay_s = delay_s
        self.sweep_s = sweep_s
        self.batch = batch
        self.stale_s = stale_s
        self._drop = drop or storage.drop_orphans
        self._lock = threading.Lock()
        self._written: dict[BlockKey, float] = {}
        """Keys written by two-trip puts, oldest first, with when their write began."""
        self._suspects: dict[BlockKey, float] = {}
        """Keys the master dropped while this daemon held none of them, with when (see :meth:`wrote`)."""
        self._refused: list[tuple[BlockKey, int, int]] = []
        """Writes refused for another block in the way, whose occupants are asked about at once."""
        self._urgent = False
        self._sweep: list[BlockKey] = []
        self._next_sweep = time.monotonic() + sweep_s
        self._release: list[BlockKey] = []
        """Orphans dropped (or found gone) whose extents the master has not yet been told are free."""
        self.dropped = 0
        """Orphans dropped since the start."""
        self._log = RateLimitedLog(log)
        storage.on_conflict = self.conflict

    def dropped_absent(self, keys: Sequence[BlockKey]) -> None:
        """The master dropped ``keys`` while this daemon held none of them: a write of one that comes
        later may be an orphan (see :meth:`wrote`)."""
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._suspects.pop(key, None)
                self._suspects[key] = now
            while self._suspects and (
                len(self._suspects) > MAX_TRACKED or next(iter(self._suspects.values())) < now - SUSPECT_S
            ):
                del self._suspects[next(iter(self._suspects))]

    def wrote(self, keys: Sequence[BlockKey]) -> None:
        """A two-trip write of ``keys`` began: those the master dropped while absent are asked about
        after ``delay_s`` (a put's bytes that came after its drop). The others are the master's own
        puts in flight (its drop, if it gives one up, comes after the bytes and finds them)."""
        now = time.monotonic()
        with self._lock:
            if not self._suspects:
                return
            for key in keys:
                if key in self._suspects:
                    self._written.pop(key, None)
                    self._written[key] = now
            while len(self._written) > MAX_TRACKED:
                del self._written[next(iter(self._written))]

    def conflict(self, refused: list[tuple[BlockKey, int, int]]) -> None:
        """Writes were refused for blocks in their key or extent: ask about those blocks, now."""
        with self._lock:
            self._refused.extend(refused[: MAX_TRACKED - len(self._refused)])

    def _due(self, now: float) -> list[tuple[BlockKey, float]]:
        with self._lock:
            refused, self._refused = self._refused, []
        # The blocks in the way of refused writes: asked about now, first, each with when it was
        # first seen being written (a refusal never restarts a half-written block's clock).
        occupants = self.storage.occupants(refused) if refused else []
        with self._lock:
            due: list[tuple[BlockKey, float]] = [(k, self._written.pop(k, now)) for k in occupants]
            cutoff = now if self._urgent else now - self.delay_s
            self._urgent = False
            taken: list[tuple[BlockKey, float]] = []
            for key, began in self._written.items():
                if began > cutoff or len(due) + len(taken) >= self.batch:
                    break
                taken.append((key, began))
            for key, _ in taken:
                del self._written[key]
            due += taken
        if len(due) < self.batch and self.sweep_s > 0:
            if not self._sweep and now >= self._next_sweep:
                self._sweep = self.storage.held_keys()
                self._next_sweep = now + self.sweep_s
            room = self.batch - len(due)
            take, self._sweep = self._sweep[-room:], self._sweep[:-room]
            asked = {key for key, _ in due}
            due += [(key, now) for key in take if key not in asked]
        return due

    def check(self, ask: Ask, now: float | None = None) -> int:
        """Ask the master about the blocks due and drop the orphans; how many were dropped. A master
        that does not answer: the blocks are asked about again at the next check."""
        now = time.monotonic() if now is None else now
        due = self._due(now)
        release, self._release = self._release, []
        if not due and not release:
            return 0
        states = self.storage.describe([k for k, _ in due])
        asked: list[tuple[BlockKey, BlockState]] = []
        later: list[tuple[BlockKey, float]] = []
        for (key, began), state in zip(due, states, strict=True):
            if state is None:
                release.append(key)  # gone: if an earlier answer kept its extent out, give it back
                continue
            if self._pending is not None and self._pending(key):
                continue  # the master learns of it from its commit (or the inventory), not from here
            if state.checksum < 0 and now - began < self.stale_s:
                later.append((key, began))  # still being written: asked once it is stale
            else:
                asked.append((key, state))
        dropped: list[BlockKey] = []
        try:
            with self.storage.watching():
                reply = ask(CheckBlocks(
                    self.node_id, [k for k, _ in asked], [s.offset for _, s in asked], [s.size for _, s in asked],
                    [max(s.checksum, 0) for _, s in asked], [str(k) for k in release],
                ))  # fmt: skip
                if len(reply.orphans) != len(asked):
                    raise KVStoreError(f"the master answered {len(reply.orphans)} of {len(asked)} orphan checks")
                orphans = [b for b, orphan in zip(asked, reply.orphans, strict=True) if orphan]
                dropped = self._drop(orphans) if orphans else []
                self.storage.confirm([b for b, orphan in zip(asked, reply.orphans, strict=True) if not orphan])
        except KVStoreError as exc:
            # Asked again after the delay (an answer lost after the master kept an extent out is
            # answered again, and given back then).
            self._log.warning("orphan-check", "could not check %d blocks with the master (%s); will retry",
                              len(asked), exc)  # fmt: skip
            later += [(k, now) for k, _ in asked]
            self._release = release + self._release
            orphans = []
        with self._lock:
            for key, began in later:
                self._written.setdefault(key, began)
        if orphans:
            self._release += [k for k, _ in orphans]  # dropped, or gone meanwhile: either way free
            self._urgent = True  # tell the master at once
            self.dropped += len(dropped)
            log.warning("dropped %d blocks that no put the master knows placed here (orphans)", len(dropped))
        return len(dropped)
