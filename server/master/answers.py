"""Replies kept for retries: a request that must not run twice is answered once.

A client whose connection broke after it sent a put resends it, with the same request id, on a new
connection; it gets the first answer instead of running the request again. A client resends only
within its own timeout (``ClientConfig.timeout_s``, 10 s by default, plus one attempt), so replies
are kept ``ttl_s`` (30 s by default) and at most ``cap`` of them: what the cache holds is bounded
by min(request rate x ttl_s, cap) replies, under 1 KB each (16,384 by default: about 13 MB at
most; requests still being answered come on top, and are never dropped). Before this bound,
replies were kept 120 s with 65,536 of them (about 64 MB, which the allocator then kept for good).
The cap holds a retry's 10 s up to about 1,600 puts and removes a second; past that,
``dropped_early`` counts the replies dropped before their time.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

from kvstore.protocol import Message

RequestId = tuple[str, int, int]
"""Who asked, the request's id, and the hash of its bytes (a retry resends the same bytes)."""


class Answers:
    def __init__(self, ttl_s: float, cap: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.cap = cap
        self._clock = clock
        self._entries: OrderedDict[RequestId, tuple[float, Message | asyncio.Future[Message]]] = OrderedDict()
        self.dropped_early = 0
        """Replies dropped for the cap before their time was up: a retry of one would run again."""

    def __len__(self) -> int:
        return len(self._entries)

    def prune(self) -> None:
        """Drop the replies older than ``ttl_s``."""
        oldest = self._clock() - self.ttl_s
        while self._entries and next(iter(self._entries.values()))[0] < oldest:
            self._entries.popitem(last=False)

    def get(self, request_id: RequestId) -> Message | asyncio.Future[Message] | None:
        """The reply to ``request_id``, or the future of one still being worked out, or None."""
        entry = self._entries.get(request_id)
        return entry[1] if entry is not None else None

    def start(self, request_id: RequestId) -> asyncio.Future[Message]:
        """Note that ``request_id`` is being answered: retries meanwhile wait for the returned future."""
        self.prune()
        answer: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._entries[request_id] = (self._clock(), answer)
        if len(self._entries) > self.cap:  # the oldest answered one goes (never one still being answered)
            oldest = next((rid for rid, (_, a) in self._entries.items() if not isinstance(a, asyncio.Future)), None)
            if oldest is not None:
                del self._entries[oldest]
                self.dropped_early += 1
        return answer

    def finish(self, request_id: RequestId, answer: asyncio.Future[Message], reply: Message) -> None:
        """``reply`` answers ``request_id``: waiting retries get it, and later ones the reply alone
        (the future goes: a kept reply costs only itself)."""
        answer.set_result(reply)
        entry = self._entries.get(request_id)
        if entry is not None and entry[1] is answer:
            self._entries[request_id] = (entry[0], reply)

    def abandon(self, request_id: RequestId, answer: asyncio.Future[Message]) -> None:
        """Not answered: a retry runs the request afresh, and anyone waiting gives up."""
        entry = self._entries.get(request_id)
        if entry is not None and entry[1] is answer:
            del self._entries[request_id]
        answer.cancel()

    def clear(self) -> None:
        self._entries.clear()
