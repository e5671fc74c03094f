"""The master's KV events on ZMQ (``--kv-events``): what the placement table stores, as
:mod:`kvstore.events` spells it, for routers and the conductor.

Sockets and protocol are vLLM's ``ZmqEventPublisher``'s, so that its subscribers (Dynamo's ZMQ
relay, llm-d's indexer, vLLM's example) read the store as they read an engine:

- a PUB socket sends each batch as ``[topic, 8-byte big-endian sequence, msgpack batch]``;
- a ROUTER socket (``--kv-events-replay``) answers a request ``[b"", start sequence]`` with every
  batch it still keeps from that sequence on, ``[b"", topic, sequence, batch]`` each, then
  ``[b"", b"", END_SEQ, b""]``; it keeps the last ``kv_events_buffer`` batches, at most
  ``kv_events_buffer_bytes`` of them.

Sequences are consecutive within a leader's term and grow across leader changes: a term's first
batch takes ``max(previous + 1, the wall clock in microseconds)``, so it comes after the old
leader's last (which sends far fewer than a batch a microsecond) as long as the masters' clocks
agree to within the election (a second or more; NTP keeps them within milliseconds). A subscriber
sees a gap at a leader change, never a repeat or a reorder, and the new leader's first event is
``AllBlocksCleared``: its table starts empty and every replica the daemons
hold is told anew as they register. Only a leader whose etcd lease is confirmed publishes: changes
made while it is unconfirmed wait, and are dropped with its term if it loses it (a frozen old
leader never publishes after its successor).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

import zmq
import zmq.asyncio

from kvstore.events import END_SEQ, AllBlocksCleared, Event, encode_batch, seq_bytes
from kvstore.placement.table import PlacementTable

log = logging.getLogger("kvstore.master.events")

MAX_BATCH = 1024
"""Events per message at most (a large commit or a node's inventory is told in several)."""
FLUSH_S = 0.01
"""How often the table's changes are published."""
SEND_HWM = 100_000
"""Messages ZMQ queues for a slow subscriber before dropping (it sees a gap, and can replay)."""


class KVEventPublisher:
    """Publishes the changes of the table of the current term (see the module's text)."""

    def __init__(
        self, endpoint: str, replay_endpoint: str | None = None, *, buffer: int = 10_000,
        buffer_bytes: int = 32 << 20, topic: str = "",
    ) -> None:  # fmt: skip
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(buffer, 1))
        self._buffer_bytes = buffer_bytes
        self._buffered = 0
        """Bytes of the batches kept for replay (bounded by ``buffer_bytes`` as well as ``buffer``)."""
        self._seq = 0
        self._first = True
        """The next batch is its term's first."""
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._table: PlacementTable | None = None
        self._head: list[Event] = []
        """Events of this term told before the table's (its AllBlocksCleared)."""
        self.may_publish: Callable[[], bool] = lambda: True
        """Whether this master may publish now (a leader whose lease is confirmed)."""
        self.batches = 0
        self.events = 0
        self.replays = 0

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> tuple[str, str | None]:
        """Bind the sockets; the endpoints bound (a port given as ``*`` or 0 resolved)."""
        ctx = self._ctx = zmq.asyncio.Context()
        pub = self._pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.endpoint)
        bound = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        replay: str | None = None
        if self.replay_endpoint is not None:
            router = self._replay = ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.replay_endpoint)
            replay = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._tasks.append(asyncio.create_task(self._serve_replays(), name="kv-events-replay"))
        self._tasks.append(asyncio.create_task(self._flush_forever(), name="kv-events-flush"))
        return bound, replay

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._pub = self._replay = self._ctx = None

    # -- terms -------------------------------------------------------------------------------------
    def new_term(self, table: PlacementTable) -> None:
        """Lead with ``table`` (empty): subscribers are told to forget what they knew, then each
        replica as the daemons' inventories fill the table."""
        self._table = table
        table.kv_events.tell_changes()
        self._head = [AllBlocksCleared()]
        self._first = True

    def end_term(self) -> None:
        """Leadership lost: what this term has not published yet is not told (a successor tells
        the cluster as it finds it)."""
        if self._table is not None:
            self._table.kv_events.tell_changes(False)
        self._table = None
        self._head = []

    # -- publishing --------------------------------------------------------------------------------
    def flush(self) -> int:
        """Publish the table's changes since the last flush; how many events."""
        table = self._table
        if table is None or self._pub is None or not self.may_publish():
            return 0
        events: list[Event] = [*self._head, *table.kv_events.take_events()]
        self._head = []
        for at in range(0, len(events), MAX_BATCH):
            self._send(events[at : at + MAX_BATCH])
        return len(events)

    def _send(self, events: list[Event]) -> None:
        assert self._pub is not None
        now = time.time()
        # Consecutive within a term (a subscriber that sees a gap lost something, and replays); a
        # term's first from the clock, above whatever an earlier leader can have sent.
        self._seq = max(self._seq + 1, int(now * 1_000_000)) if self._first else self._seq + 1
        self._first = False
        payload = encode_batch(now, events)
        with contextlib.suppress(zmq.Again):  # a subscriber that does not keep up sees a gap, and can replay
            self._pub.send_multipart((self.topic, seq_bytes(self._seq), payload), flags=zmq.NOBLOCK, copy=False)
        buffer = self._buffer
        if len(buffer) == buffer.maxlen:
            self._buffered -= len(buffer[0][1])
        buffer.append((self._seq, payload))
        self._buffered += len(payload)
        while self._buffered > self._buffer_bytes and len(buffer) > 1:
            self._buffered -= len(buffer.popleft()[1])
        self.batches += 1
        self.events += len(events)

    async def _flush_forever(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                self.flush()
            except zmq.ZMQError as e:
                log.warning("KV events not published: %s", e)

    async def _serve_replays(self) -> None:
        router = self._replay
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("a KV events replay request of %d frames was ignored (expected [id, b'', seq])",
                            len(frames))  # fmt: skip
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            self.replays += 1
            with contextlib.suppress(zmq.ZMQError):  # the subscriber went away mid-replay
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        await router.send_multipart((client, b"", self.topic, seq_bytes(seq), payload))
                await router.send_multipart((client, b"", b"", END_SEQ, b""))
