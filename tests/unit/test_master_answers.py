"""The master's replies kept for retries: bounded in time and in number, holding replies, not futures."""

from __future__ import annotations

import asyncio

from kvstore.protocol import OkReply, PutEndReply, encode
from server.master.answers import Answers


def test_replies_are_kept_for_their_time_then_dropped() -> None:
    async def run() -> None:
        now = [0.0]
        answers = Answers(ttl_s=30, cap=100, clock=lambda: now[0])
        future = answers.start(("c", 1, 0))
        assert answers.get(("c", 1, 0)) is future  # being answered: a retry waits for it
        answers.finish(("c", 1, 0), future, OkReply())
        assert future.result() == OkReply() and answers.get(("c", 1, 0)) == OkReply()  # the reply alone now
        now[0] = 29.0
        answers.prune()
        assert answers.get(("c", 1, 0)) == OkReply()
        now[0] = 31.0
        answers.prune()
        assert answers.get(("c", 1, 0)) is None and len(answers) == 0

    asyncio.run(run())


def test_the_bound_drops_the_oldest_and_counts_it() -> None:
    async def run() -> None:
        answers = Answers(ttl_s=30, cap=3, clock=lambda: 0.0)
        for i in range(5):
            answers.finish(("c", i, 0), answers.start(("c", i, 0)), OkReply())
        assert len(answers) == 3 and answers.dropped_early == 2
        assert answers.get(("c", 0, 0)) is None and answers.get(("c", 4, 0)) == OkReply()
        assert answers.dropped_young == 2  # dropped at once: their clients could still retry

    asyncio.run(run())


def test_only_replies_dropped_while_their_clients_may_retry_count_as_young() -> None:
    async def run() -> None:
        now = [0.0]
        answers = Answers(ttl_s=30, cap=2, clock=lambda: now[0], young_s=10)
        for i in range(4):
            now[0] = i * 6.0  # replies 6 s apart: the first is 12 s old when dropped, the next 12 s too
            answers.finish(("c", i, 0), answers.start(("c", i, 0)), OkReply())
        now[0] = 25.0
        answers.finish(("c", 9, 0), answers.start(("c", 9, 0)), OkReply())  # drops the one of 12 s: 13 s old
        assert answers.dropped_early == 3 and answers.dropped_young == 0
        answers.finish(("c", 10, 0), answers.start(("c", 10, 0)), OkReply())  # drops the one of 18 s: 7 s old
        assert answers.dropped_early == 4 and answers.dropped_young == 1

    asyncio.run(run())


def test_the_bound_never_drops_a_request_still_being_answered() -> None:
    async def run() -> None:
        answers = Answers(ttl_s=30, cap=2, clock=lambda: 0.0)
        pending = answers.start(("c", 0, 0))
        for i in range(1, 4):
            answers.finish(("c", i, 0), answers.start(("c", i, 0)), OkReply())
        assert answers.get(("c", 0, 0)) is pending and answers.get(("c", 3, 0)) == OkReply()

    asyncio.run(run())


def test_an_abandoned_request_runs_again_on_retry() -> None:
    async def run() -> None:
        answers = Answers(ttl_s=30, cap=3)
        future = answers.start(("c", 1, 0))
        answers.abandon(("c", 1, 0), future)
        assert future.cancelled() and answers.get(("c", 1, 0)) is None

    asyncio.run(run())


def test_replies_are_kept_encoded_and_bounded_in_bytes() -> None:
    async def run() -> None:
        reply = PutEndReply([True] * 512)
        size = len(encode(reply, 0))
        answers = Answers(ttl_s=30, cap=100, max_bytes=3 * size, clock=lambda: 0.0)
        for i in range(5):
            answers.finish(("c", i, 0), answers.start(("c", i, 0)), reply)
        assert len(answers) == 3 and answers.bytes == 3 * size and answers.dropped_early == 2
        assert answers.get(("c", 4, 0)) == reply and answers.get(("c", 1, 0)) is None  # decoded again for a retry
        answers.clear()
        assert answers.bytes == 0 and len(answers) == 0

    asyncio.run(run())
