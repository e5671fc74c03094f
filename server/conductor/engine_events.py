"""What an OpenAI server's own prefix cache holds, from its KV events (vLLM's
``--kv-events-config``): the conductor's ``engine_events``. A thread follows the server's ZMQ
stream (:class:`transfer.kv_events.KVEventSubscriber`, replaying gaps where the server gives a
replay endpoint) and hands each batch to the event loop, where :class:`kvstore.engine_blocks.
EngineBlocks` turns pages into store keys. The same face as the guess it replaces
(:class:`server.conductor.openai.EngineCache`): ``held``, ``touch``, ``clear``.

Events come after the fact: a chat's next turn is sent the moment its answer ends, before the
server's events for that answer arrive. So what the conductor sends a server (``touch``: the prompt
at sending, prompt and answer at its end) counts as held until the server's events speak of that
block (stored: the events hold it from then on; removed: taken back, even where the removal came
before the request that re-creates it: the next events say so), its whole cache is cleared, or
``EXPECT_S`` pass with no word of it (a request that failed, a block the server never cached)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from kvstore.engine_blocks import EngineBlocks, leading
from transfer.kv_events import KVEventSubscriber

log = logging.getLogger(__name__)

POLL_S = 0.2
"""How long the follower thread waits for a batch before looking whether it should stop."""

EXPECT_S = 10.0
"""How long a block sent to the server counts as held with no event about it."""


class EngineEvents:
    """One server's cache from its events (see the module's text)."""

    def __init__(self, endpoint: str, replay: str, namespace: str, block_tokens: int) -> None:
        self.endpoint = endpoint
        self.blocks = EngineBlocks(namespace, block_tokens)
        self._sub = KVEventSubscriber([endpoint], [replay] if replay else [], from_seq=0 if replay else None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._expected: OrderedDict[str, float] = OrderedDict()
        """Keys sent to the server that its events have not spoken of yet -> until when they count."""
        self._epoch = 0
        """Cleared caches so far: batches received before a clear are dropped, and the thread starts
        the server's numbering afresh (read by the thread, written by the event loop)."""
        self.batches = 0
        self.seq = -1
        """The sequence number of the last batch applied (-1: none yet; the conductor's metric)."""

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._follow, name=f"kv-events {self.endpoint}", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        assert self._loop is not None
        epoch = self._epoch
        self._catch_up(epoch)  # a server that ran before the conductor: its cache as kept for replay
        while not self._stop.is_set():
            if epoch != self._epoch:  # cleared: a restarted server numbers its batches from 0 again
                epoch = self._epoch
                self._sub.last = -1
                self._catch_up(epoch)  # what it sent while a receive straddled the clear (dropped)
            try:
                got = self._sub.receive(POLL_S)
            except Exception:
                log.exception("following the KV events of %s", self.endpoint)
                continue
            if got:
                self._loop.call_soon_threadsafe(self._apply, epoch, [(d.seq, d.batch.events) for d in got])

    def _catch_up(self, epoch: int) -> None:
        """Apply every batch the server's replay endpoint keeps after the last one delivered (all of
        them after a start or a clear); nothing where it has none."""
        assert self._loop is not None
        if not self._sub.replay_endpoints:
            return
        try:
            caught = self._sub.catch_up()
        except Exception:
            log.exception("replaying the KV events of %s", self.endpoint)
            return
        if caught:
            self._loop.call_soon_threadsafe(self._apply, epoch, [(d.seq, d.batch.events) for d in caught])

    def _apply(self, epoch: int, batches: list[tuple[int, list[Any]]]) -> None:
        if epoch != self._epoch:
            return  # received before the cache was cleared: the old server's
        expected = self._expected
        for seq, events in batches:
            applied = self.blocks.apply(events)
            if applied.cleared:
                expected.clear()
            for key in applied.keys:
                expected.pop(key, None)
            self.seq = seq
        self.batches += len(batches)

    async def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5 * POLL_S)
        self._sub.close()

    # -- the face of EngineCache ----------------------------------------------------------------
    def held(self, keys: Sequence[str]) -> int:
        """Leading blocks of ``keys`` the server's events hold or it was sent (see the module's text)."""
        expected = self._expected
        if expected:
            now = time.monotonic()
            while expected and next(iter(expected.values())) < now:
                expected.popitem(last=False)
        return leading(keys, self)

    def __contains__(self, key: object) -> bool:
        """Whether the server's events hold ``key`` or it was sent and not yet spoken of (as of the
        last :meth:`held`, which drops what ran out)."""
        return isinstance(key, str) and (self.blocks.holds(key) or key in self._expected)

    def touch(self, keys: Iterable[str]) -> None:
        """The server was sent ``keys``: they count as held until its events speak of them."""
        until = time.monotonic() + EXPECT_S
        expected = self._expected
        for key in keys:
            expected[key] = until
            expected.move_to_end(key)

    def clear(self) -> None:
        """The server failed: its cache is gone, and a restarted one numbers its events from 0 again."""
        self._epoch += 1
        self.blocks.clear()
        self._expected.clear()
        self.seq = -1

    def __len__(self) -> int:
        """Blocks the server's events hold (what it was sent and has not spoken of is not counted)."""
        return len(self.blocks)
