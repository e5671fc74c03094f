"""The master's commits of ``cached`` puts: blocks this daemon acknowledged once they were checked
and committed in its arena, told to the master after, many puts' commits in one request.

A cached put is acknowledged before the master knows of it. What keeps it:

- Its grant's space stays the daemon's until the commit is answered: each pending commit holds
  its grant open (the server's ``hold`` / ``release``), and a grant's end waits for its holders, so
  the master frees the space only after the commit (the master takes commits into a grant it is
  ending, not into one it has ended).
- A commit that cannot reach the master (a failover, a partition) is retried until it does, or
  until this daemon registers again: the registration's inventory carries the block, and the
  master adopts it from there (so the pending commit is dropped, counted as ``adopted``).
- A commit the master refuses (another writer's block under the key, EXISTS; an extent it does
  not take) drops the block here: the writer's put was acknowledged, but the store keeps the
  other block. Counted in ``refused`` (``kvstore_daemon_cached_refused_total``). Another put
  still being written under the key is no refusal yet: the master answers RetryLater until it
  ends, so that the key never holds neither block readable.

:meth:`Committer.flush` waits until every commit queued before it is done: a client's
``Store.flush()`` (a prefill's hand-off to its decode) makes its cached puts visible that way.
Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvstore.errors import GrantExpired, KVStoreError, NotLeader, NotReady, RetryLater, Timeout
from kvstore.keys import BlockKey
from kvstore.protocol import PUT_EXISTS, PUT_STORED
from kvstore.ratelog import RateLimitedLog

log = logging.getLogger("kvstore.daemon")

_RETRY = frozenset({GrantExpired.code, NotLeader.code, NotReady.code, RetryLater.code})
"""Codes of a commit's answer worth another try: the master is busy or does not know the grant yet
(a new leader before this daemon registered with it: the registration then carries the block)."""

Refused = tuple[BlockKey, int, int, int]
"""A block whose commit the master refused: (key, offset, size, checksum), as it was acknowledged."""

REMEMBERED = 65_536
"""Committed cached blocks a daemon remembers (see Committer.ours)."""

Commit = Callable[[int, list[BlockKey], list[int], list[int], list[int], bool, list[int]], list[tuple[int, str]]]
"""The master's commit of blocks written into a grant (MasterLink.commit_granted): per block (code, text)."""


@dataclass(slots=True)
class _Pending:
    seq: int
    grant_id: int
    keys: list[BlockKey]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: bool
    write_ids: list[int]
    registration: int
    """The daemon's registrations when it was acknowledged: a later one carried it to the master."""
    hold: object
    """What holds its grant open (given back to ``release`` once done)."""


class Committer:
    def __init__(
        self,
        commit: Callable[[], Commit | None],
        drop: Callable[[list[Refused]], object],
        release: Callable[[object], None],
        stop: threading.Event,
        linger_s: float = 0.0,
        batch_max: int = 256,
    ) -> None:
        """``linger_s``: how long a round waits for more commits to join it (up to ``batch_max``
        acknowledgements queued), unless a flush waits."""
        self._commit = commit
        self.linger_s = linger_s
        self.batch_max = batch_max
        self._flushing = 0
        """Flushes waiting: rounds go at once."""
        self._registration = 0
        """Registrations begun: an inventory taken after a block was acknowledged carries it."""
        self._drop = drop
        self._release = release
        self._stop = stop
        self._cond = threading.Condition()
        self._queue: deque[_Pending] = deque()
        self._pending: set[int] = set()
        """Seqs queued or being committed."""
        self._keys: Counter[BlockKey] = Counter()
        """Keys of the commits queued or being made (and of those being acknowledged)."""
        self._committed: OrderedDict[BlockKey, tuple[int, int, int]] = OrderedDict()
        """The latest blocks whose commit the master took, (offset, size, checksum) by key (at most
        :data:`REMEMBERED`): a drop of puts begun with an earlier master is never about them."""
        self._seq = 0
        self.committed = 0
        self.refused = 0
        self.adopted = 0
        self._failures = RateLimitedLog(log)

    def add(
        self, grant_id: int, keys: list[BlockKey], offsets: list[int], sizes: list[int], checksums: list[int],
        pinned: bool, hold: object = None, write_ids: list[int] | None = None,
    ) -> None:  # fmt: skip
        """Queue the commit of blocks acknowledged in grant ``grant_id`` (``write_ids``: their puts'
        write ids, one per block); ``hold`` (what holds the grant open for it) goes back to
        ``release`` when the commit is done."""
        ids = write_ids if write_ids is not None else [0] * len(keys)
        with self._cond:
            self._seq += 1
            self._queue.append(_Pending(self._seq, grant_id, keys, offsets, sizes, checksums, pinned, ids,
                                        self._registration, hold))  # fmt: skip
            self._pending.add(self._seq)
            self._keys.update(keys)
            if len(self._queue) == 1 or len(self._queue) >= self.batch_max:
                # The loop waits for a first commit, then lingers for a full round: waking it for
                # each one between (to find the round not full yet) cost the daemon two thread
                # switches a put.
                self._cond.notify_all()

    def holds(self, key: BlockKey) -> bool:
        """Whether a commit of ``key`` is queued or being made (its block is not an orphan)."""
        with self._cond:
            return key in self._keys

    @contextmanager
    def acknowledging(self, keys: list[BlockKey]) -> Iterator[None]:
        """Around a cached put's local commit and :meth:`add`: its keys are held from before the block
        is in the arena until the commit is queued (no drop finds the block and not the commit)."""
        with self._cond:
            self._keys.update(keys)
        try:
            yield
        finally:
            with self._cond:
                self._leave(keys)

    def ours(self, key: BlockKey, state: tuple[int, int, int] | None) -> bool:
        """Whether the block held under ``key`` (its state) is a cached put's of this daemon: its commit
        queued or being made, or taken by the master lately (that very block)."""
        with self._cond:
            return key in self._keys or (state is not None and self._committed.get(key) == tuple(state))

    def registering(self) -> None:
        """A registration begins (before its inventory is taken, which carries every block
        acknowledged so far): the commits queued are the master's to adopt from it, done now (their
        grants released, so the registration's end of every grant does not wait for them)."""
        with self._cond:
            self._registration += 1
            adopted = list(self._queue)
            self._queue.clear()
        self._count(adopted=sum(len(p.keys) for p in adopted))
        self._done(adopted)

    def pending(self) -> int:
        with self._cond:
            return sum(len(p.keys) for p in self._queue)

    def flush(self, timeout_s: float) -> None:
        """Return once every commit queued before this call is done; Timeout after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            upto = self._seq
            self._flushing += 1
            self._cond.notify_all()  # a round lingering for company goes now
            try:
                while any(seq <= upto for seq in self._pending):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Timeout(f"cached puts' commits not answered by the master within {timeout_s:g} s")
                    self._cond.wait(left)
            finally:
                self._flushing -= 1

    def run(self) -> None:
        """The commit loop (under the daemon's supervisor): everything queued goes in one request per
        grant; what could not be committed goes back and waits a little."""
        backoff = 0.01
        while not self._stop.is_set():
            with self._cond:
                while not self._queue and not self._stop.is_set():
                    self._cond.wait(0.5)
                # Group commit: puts acknowledged meanwhile join this round (one request for all).
                until = time.monotonic() + self.linger_s
                while len(self._queue) < self.batch_max and not self._flushing and not self._stop.is_set():
                    left = until - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            if self._round():
                self._stop.wait(backoff)
                backoff = min(2 * backoff, 0.5)
            else:
                backoff = 0.01

    def drain(self, timeout_s: float) -> None:
        """Commit what is queued now, in this thread (a daemon leaving, its loop stopped); Timeout
        when the master did not take it all within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._queue:
            if time.monotonic() > deadline:
                raise Timeout(f"{self.pending()} cached puts' commits not taken by the master in {timeout_s:g} s")
            if self._round():
                time.sleep(0.05)

    def _round(self) -> bool:
        """Commit everything queued; whether some of it must be tried again (put back in the queue)."""
        with self._cond:
            batch = list(self._queue)
            self._queue.clear()
        if not batch:
            return False
        try:
            failed = self._commit_all(batch)
        except BaseException:
            with self._cond:  # whatever went wrong, what is not done goes back (the supervisor logs it)
                self._queue.extendleft(reversed([p for p in batch if p.seq in self._pending]))
            raise
        if failed:
            with self._cond:
                self._queue.extendleft(reversed(failed))
        return bool(failed)

    def _commit_all(self, batch: list[_Pending]) -> list[_Pending]:
        """Commit ``batch`` (grouped by grant); the entries to try again. An entry is done only
        once every block of it is committed, adopted or refused (and dropped here)."""
        groups: dict[tuple[int, bool], list[_Pending]] = {}
        for p in batch:
            groups.setdefault((p.grant_id, p.pinned), []).append(p)
        failed: list[_Pending] = []
        for (grant_id, pinned), entries in groups.items():
            with self._cond:
                registration = self._registration
            adopted = [p for p in entries if p.registration < registration]
            if adopted:  # a registration since carried them in its inventory
                self._count(adopted=sum(len(p.keys) for p in adopted))
                self._done(adopted)
            entries = [p for p in entries if p.registration >= registration]
            commit = self._commit()
            if not entries:
                continue
            try:
                if commit is None:
                    raise KVStoreError("this daemon has no link to a master yet")
                answers = commit(
                    grant_id, [k for p in entries for k in p.keys], [o for p in entries for o in p.offsets],
                    [s for p in entries for s in p.sizes], [c for p in entries for c in p.checksums], pinned,
                    [w for p in entries for w in p.write_ids],
                )  # fmt: skip
                acked = {k: (o, s, c) for p in entries
                         for k, o, s, c in zip(p.keys, p.offsets, p.sizes, p.checksums, strict=True)}  # fmt: skip
                keys = [k for p in entries for k in p.keys]
                codes = {k: (code, text) for k, (code, text) in zip(keys, answers, strict=True)}
                retry = {k for k, (code, _) in codes.items() if code in _RETRY}
                refused = [k for k, (code, _) in codes.items() if code != PUT_STORED and code not in _RETRY]
                if refused:
                    # Only the very block refused: another written under its key since (a remove,
                    # then a new put) is the master's now and stays. NotReady while a registration
                    # runs: all of it again later.
                    self._drop([(k, *acked[k]) for k in refused])
            except KVStoreError as exc:
                self._failures.warning("cached-commit", "cached puts' commits to the master failed, retrying: %s", exc)
                failed.extend(entries)
                continue
            if refused:
                other = next((codes[k] for k in refused if codes[k][0] != PUT_EXISTS), None)
                why = other[1] if other is not None else "another block is under their keys"
                self._failures.warning("cached-refused", "the master refused %d cached puts' commits (dropped here):"
                                       " %s", len(refused), why)  # fmt: skip
            again = [p for p in entries if not retry.isdisjoint(p.keys)]
            if again:  # the master busy, or not knowing the grant yet (a registration will carry it)
                self._failures.warning("cached-retry", "cached puts' commits to retry: %s",
                                       next(codes[k][1] for k in retry))  # fmt: skip
                failed.extend(again)
            finished = [p for p in entries if retry.isdisjoint(p.keys)]
            dropped = set(refused)
            self._count(committed=sum(1 for p in finished for k in p.keys if k not in dropped), refused=len(refused))
            self._remember({k: acked[k] for p in finished for k in p.keys if codes[k][0] == PUT_STORED})
            self._done(finished)
        return failed

    def _remember(self, blocks: dict[BlockKey, tuple[int, int, int]]) -> None:
        with self._cond:
            for key, state in blocks.items():
                self._committed.pop(key, None)
                self._committed[key] = state
            while len(self._committed) > REMEMBERED:
                self._committed.popitem(last=False)

    def _leave(self, keys: list[BlockKey]) -> None:
        """Count ``keys`` out of :attr:`_keys` (under the lock); a key counted out entirely leaves it
        (one step a key: rebuilding the counter was a step per key held, on every put)."""
        held = self._keys
        for key in keys:
            n = held[key] - 1
            if n > 0:
                held[key] = n
            else:
                held.pop(key, None)

    def _count(self, committed: int = 0, refused: int = 0, adopted: int = 0) -> None:
        with self._cond:
            self.committed += committed
            self.refused += refused
            self.adopted += adopted

    def _done(self, entries: list[_Pending]) -> None:
        with self._cond:
            for p in entries:
                self._pending.discard(p.seq)
                self._leave(p.keys)
            self._cond.notify_all()
        for p in entries:
            self._release(p.hold)
