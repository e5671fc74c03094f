"""Replies kept for retries: a request that must not run twice is answered once.

A client whose connection broke after it sent a put resends it, with the same request id, on a new
connection; it gets the first answer instead of running the request again. A client resends only
within its own timeout (``ClientConfig.timeout_s``, 10 s by default, plus one attempt), so replies
are kept ``ttl_s`` (30 s by default), at most ``cap`` of them and ``max_bytes`` of their encoding.

Replies are kept encoded (msgpack), and decoded again only for the rare retry: a put of 512 keys is
answered with 512 tickets, about 250 bytes each as Python objects but 29 encoded, and the
replies of 30 s of puts are what the master would otherwise hold beside its keys (about a third of
its memory per key under a load of batched small puts, measured by ``bench.master``). Requests
still being answered come on top, and are never dropped; ``dropped_early`` counts the replies
dropped for a bound before their time.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

from kvstore.protocol import FRAME_HEADER, Message, decode_payload, encode

RequestId = tuple[str, int, int]
"""Who asked, the request's id, and the hash of its bytes (a retry resends the same bytes)."""


class Answers:
    def __init__(
        self, ttl_s: float, cap: int, max_bytes: int = 64 << 20, clock: Callable[[], float] = time.monotonic,
        young_s: float = 10.0,
    ) -> None:  # fmt: skip
        """``young_s``: how long a client may still retry (ClientConfig.timeout_s's default): a reply
        dropped younger than that may have its request run twice."""
        self.ttl_s = ttl_s
        self.young_s = young_s
        self.cap = cap
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[RequestId, tuple[float, bytes | asyncio.Future[Message]]] = OrderedDict()
        self.bytes = 0
        """Encoded bytes of the replies kept."""
        self.dropped_early = 0
        """Replies dropped for the cap before their time was up: a retry of one would run again."""
        self.dropped_young = 0
        """Of those, the ones younger than ``young_s``, whose clients may still be retrying."""

    def __len__(self) -> int:
        return len(self._entries)

    def prune(self) -> None:
        """Drop the replies older than ``ttl_s``."""
        oldest = self._clock() - self.ttl_s
        while self._entries and next(iter(self._entries.values()))[0] < oldest:
            self._forget(self._entries.popitem(last=False)[1][1])

    def _forget(self, kept: bytes | asyncio.Future[Message]) -> None:
        if isinstance(kept, bytes):
            self.bytes -= len(kept)

    def get(self, request_id: RequestId) -> Message | asyncio.Future[Message] | None:
        """The reply to ``request_id``, or the future of one still being worked out, or None."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        kept = entry[1]
        return decode_payload(kept[FRAME_HEADER.size :])[1] if isinstance(kept, bytes) else kept

    def start(self, request_id: RequestId) -> asyncio.Future[Message]:
        """Note that ``request_id`` is being answered: retries meanwhile wait for the returned future.
        (Replies past their time are pruned by the master's tick, not here: this is on every put.)"""
        answer: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._entries[request_id] = (self._clock(), answer)
        self._bound()
        return answer

    def _bound(self) -> None:
        """Drop the oldest answered replies (never one still being answered) while over a bound."""
        while len(self._entries) > self.cap or self.bytes > self.max_bytes:
            oldest = next((rid for rid, (_, a) in self._entries.items() if isinstance(a, bytes)), None)
            if oldest is None:
                return
            since, kept = self._entries.pop(oldest)
            self._forget(kept)
            self.dropped_early += 1
            if self._clock() - since < self.young_s:
                self.dropped_young += 1

    def finish(self, request_id: RequestId, answer: asyncio.Future[Message], reply: Message) -> None:
        """``reply`` answers ``request_id``: waiting retries get it, and later ones the reply alone
        (the future goes: a kept reply costs only itself)."""
        answer.set_result(reply)
        entry = self._entries.get(request_id)
        if entry is not None and entry[1] is answer:
            self._keep(request_id, entry[0], reply)

    def keep(self, request_id: RequestId, reply: Message) -> None:
        """``reply`` answers ``request_id``, answered without waiting (nothing can have waited for it)."""
        self._keep(request_id, self._clock(), reply)

    def _keep(self, request_id: RequestId, since: float, reply: Message) -> None:
        kept = encode(reply, 0)
        self._entries[request_id] = (since, kept)
        self.bytes += len(kept)
        self._bound()

    def abandon(self, request_id: RequestId, answer: asyncio.Future[Message]) -> None:
        """Not answered: a retry runs the request afresh, and anyone waiting gives up."""
        entry = self._entries.get(request_id)
        if entry is not None and entry[1] is answer:
            del self._entries[request_id]
        answer.cancel()

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
