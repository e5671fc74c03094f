"""The conductor's view of one server's cache from its KV events (server.conductor.engine_events):
what it was sent counts as held until its events speak of it, and a clear is not undone by batches
the follower thread received before it. Events go over a real ZMQ PUB socket in the wire format."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from kvstore.events import END_SEQ, AllBlocksCleared, BlockRemoved, encode_batch, seq_bytes
from kvstore.keys import block_keys
from server.conductor import engine_events
from server.conductor.engine_events import EngineEvents
from tests.unit.test_engine_blocks import NS, page_hash, stored

TOKENS = [(i * 7) % 300 + 1 for i in range(100)]
KEYS = [str(k) for k in block_keys(TOKENS, 32, NS)]  # 3 store blocks of 2 pages of 16


def follower() -> EngineEvents:
    return EngineEvents("tcp://127.0.0.1:1", "", NS, 32)  # never started: batches applied by hand


def test_what_the_server_was_sent_is_held_until_its_events_speak_of_it() -> None:
    ev = follower()
    ev.touch(KEYS[:2])  # the conductor sent a prompt of two blocks
    assert ev.held(KEYS) == 2 and len(ev) == 0
    ev._apply(0, [(0, [stored(TOKENS, 0, 4)])])  # the server cached them: the events hold them now
    assert ev.held(KEYS) == 2 and len(ev) == 2 and not ev._expected
    ev._apply(0, [(1, [BlockRemoved([page_hash(TOKENS, 3)], "GPU")])])  # it evicted the second
    assert ev.held(KEYS) == 1


def test_a_removal_takes_back_a_block_sent_again_before_its_events_came() -> None:
    ev = follower()
    ev._apply(0, [(0, [stored(TOKENS, 0, 6)])])
    ev.touch(KEYS)  # sent again while the server was evicting
    assert list(ev._expected) == KEYS
    ev._apply(0, [(1, [BlockRemoved([page_hash(TOKENS, 1)], "GPU")])])
    assert ev.held(KEYS) == 0 and KEYS[0] not in ev._expected  # the first block is gone: a prefix of nothing


def test_a_cleared_cache_takes_back_what_it_was_sent() -> None:
    ev = follower()
    ev.touch(KEYS)
    assert ev.held(KEYS) == 3
    ev._apply(0, [(0, [AllBlocksCleared()])])
    assert ev.held(KEYS) == 0


def test_batches_received_before_a_clear_are_dropped() -> None:
    ev = follower()
    ev.clear()  # the server failed; a batch the thread had received before is applied late
    ev._apply(0, [(7, [stored(TOKENS, 0, 6)])])
    assert ev.held(KEYS) == 0 and ev.seq == -1
    ev._apply(1, [(0, [stored(TOKENS, 0, 6)])])  # the restarted server's
    assert ev.held(KEYS) == 3 and ev.seq == 0


def test_what_the_events_never_speak_of_stops_counting(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(engine_events, "time", SimpleNamespace(monotonic=lambda: clock.now))
    ev = follower()
    ev.touch(KEYS[1:2])
    ev.touch(KEYS[:1])
    assert ev.held(KEYS) == 2
    clock.now += engine_events.EXPECT_S - 1
    ev.touch(KEYS[1:2])  # sent again: counts afresh
    clock.now += 2  # the first has run out, the second not
    assert ev.held(KEYS) == 0 and ev.held(KEYS[1:]) == 1
    clock.now += engine_events.EXPECT_S
    assert ev.held(KEYS[1:]) == 0 and not ev._expected


def test_a_clear_is_not_undone_by_batches_received_before_it() -> None:
    """A batch the thread received before a clear (the server that failed) is dropped, and the
    restarted server's batches, numbered from 0 again, are applied."""
    other = [(i * 5) % 300 + 2 for i in range(64)]
    third = [(i * 3) % 300 + 4 for i in range(64)]
    other_keys = [str(k) for k in block_keys(other, 32, NS)]
    third_keys = [str(k) for k in block_keys(third, 32, NS)]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")

    def send(seq: int, event: object) -> None:
        pub.send_multipart([b"", seq_bytes(seq), encode_batch(time.time(), [event])])  # type: ignore[list-item]

    async def until_applied(ev: EngineEvents, seq: int, event: object) -> None:
        deadline = time.monotonic() + 10
        while ev.seq != seq:  # a PUB drops what it sends before the subscriber joined: send until it lands
            assert time.monotonic() < deadline, "the follower never applied the batch"
            send(seq, event)
            await asyncio.sleep(0.05)

    async def main() -> tuple[int, int, int]:
        ev = EngineEvents(f"tcp://127.0.0.1:{port}", "", NS, 32)
        ev.start()
        try:
            await until_applied(ev, 0, stored(TOKENS, 0, 2))
            send(1, stored(other, 0, 4))
            deadline = time.monotonic() + 10
            while ev._sub.last != 1 and time.monotonic() < deadline:
                time.sleep(0.01)  # the loop held: the thread receives the batch and queues it
            assert ev._sub.last == 1, "the follower thread never received the batch"
            time.sleep(0.1)
            ev.clear()  # the server failed before the loop applied it
            await asyncio.sleep(0.3)
            dropped = ev.held(other_keys)
            await until_applied(ev, 0, stored(third, 0, 4))  # the server restarted: its numbers from 0
            return dropped, ev.held(third_keys), ev.held(KEYS)
        finally:
            await ev.close()

    try:
        assert asyncio.run(main()) == (0, 2, 0)
    finally:
        pub.close(linger=0)
        ctx.term()


class Replay:
    """A server's replay endpoint (vLLM's protocol): a ROUTER answering ``[b"", start]`` with the
    batches it keeps from ``start`` on, then END_SEQ."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.kept: list[tuple[int, bytes]] = []
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self.port = self._router.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            client, _, start = self._router.recv_multipart()
            for seq, payload in list(self.kept):
                if seq >= int.from_bytes(start, "big"):
                    self._router.send_multipart([client, b"", b"", seq_bytes(seq), payload])
            self._router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._router.close(linger=0)


def test_after_a_clear_the_follower_replays_what_the_server_kept() -> None:
    """A batch of the restarted server that came while a receive straddled the clear is dropped with
    the old server's; the follower then asks the server's replay endpoint for everything it keeps."""
    third = [(i * 3) % 300 + 4 for i in range(64)]
    third_keys = [str(k) for k in block_keys(third, 32, NS)]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    replay = Replay(ctx)

    async def main() -> tuple[int, int]:
        ev = EngineEvents(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay.port}", NS, 32)
        ev.start()
        try:
            deadline = time.monotonic() + 10
            while ev.seq != 0:
                assert time.monotonic() < deadline, "the follower never applied the batch"
                pub.send_multipart([b"", seq_bytes(0), encode_batch(time.time(), [stored(TOKENS, 0, 2)])])
                await asyncio.sleep(0.05)
            replay.kept = [(0, encode_batch(time.time(), [stored(third, 0, 4)]))]  # the restarted server's
            ev.clear()
            deadline = time.monotonic() + 10
            while not ev.held(third_keys) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return ev.held(KEYS), ev.held(third_keys)
        finally:
            await ev.close()

    try:
        assert asyncio.run(main()) == (0, 2)
    finally:
        replay.close()
        pub.close(linger=0)
        ctx.term()
