"""What an OpenAI server's own prefix cache holds, from its KV events (vLLM's
``--kv-events-config``): the conductor's ``engine_events``. A thread follows the server's ZMQ
stream (:class:`transfer.kv_events.KVEventSubscriber`, replaying gaps where the server gives a
replay endpoint) and hands each batch to the event loop, where :class:`kvstore.engine_blocks.
EngineBlocks` turns pages into store keys. The same face as the guess it replaces
(:class:`server.conductor.openai.EngineCache`): ``held``, ``touch``, ``clear``."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from kvstore.engine_blocks import EngineBlocks
from transfer.kv_events import KVEventSubscriber

log = logging.getLogger(__name__)

POLL_S = 0.2
"""How long the follower thread waits for a batch before looking whether it should stop."""


class EngineEvents:
    """One server's cache from its events (see the module's text)."""

    def __init__(self, endpoint: str, replay: str, namespace: str, block_tokens: int) -> None:
        self.endpoint = endpoint
        self.blocks = EngineBlocks(namespace, block_tokens)
        self._sub = KVEventSubscriber([endpoint], [replay] if replay else [], from_seq=0 if replay else None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.batches = 0
        self.seq = -1
        """The sequence number of the last batch applied (-1: none yet; the conductor's metric)."""

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._follow, name=f"kv-events {self.endpoint}", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        assert self._loop is not None
        try:
            caught = self._sub.catch_up()  # a server that ran before the conductor: its cache as kept for replay
        except Exception:
            log.exception("replaying the KV events of %s", self.endpoint)
            caught = []
        if caught:
            self._loop.call_soon_threadsafe(self._apply, [(d.seq, d.batch.events) for d in caught])
        while not self._stop.is_set():
            try:
                got = self._sub.receive(POLL_S)
            except Exception:
                log.exception("following the KV events of %s", self.endpoint)
                continue
            if got:
                self._loop.call_soon_threadsafe(self._apply, [(d.seq, d.batch.events) for d in got])

    def _apply(self, batches: list[tuple[int, list[Any]]]) -> None:
        for seq, events in batches:
            self.blocks.apply(events)
            self.seq = seq
        self.batches += len(batches)

    async def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5 * POLL_S)
        self._sub.close()

    # -- the face of EngineCache ----------------------------------------------------------------
    def held(self, keys: Sequence[str]) -> int:
        return self.blocks.held(keys)

    def touch(self, keys: Iterable[str]) -> None:
        """Nothing: the server's events say what it caches."""

    def clear(self) -> None:
        """The server failed: its cache is gone, and a restarted one numbers its events from 0 again."""
        self.blocks.clear()
        self._sub.last = self.seq = -1

    def __len__(self) -> int:
        return len(self.blocks)
