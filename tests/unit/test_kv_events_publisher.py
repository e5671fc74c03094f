"""The master's KV events publisher on real ZMQ sockets: consecutive sequences within a term, a
jump at a new term that starts with AllBlocksCleared, and a replay buffer bounded in bytes."""

from __future__ import annotations

import asyncio

import zmq

from kvstore.events import END_SEQ, AllBlocksCleared, decode_batch, seq_bytes
from server.master.events import KVEventPublisher
from tests.unit.placement import KB, put, table


def replay(endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    out = []
    try:
        sock.connect(endpoint)
        sock.send_multipart((b"", seq_bytes(start)))
        while sock.poll(5000):
            frames = sock.recv_multipart()
            if frames[2] == END_SEQ:
                break
            out.append((int.from_bytes(frames[2], "big"), frames[3]))
    finally:
        sock.close(linger=0)
        ctx.term()
    return out


async def test_terms_sequences_and_a_replay_buffer_bounded_in_bytes() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_bytes=1 << 16)
    _, replay_at = publisher.start()
    assert replay_at is not None
    try:
        t = table("a", dram=4096 * KB)
        publisher.new_term(t)
        for i in range(40):
            put(t, *(f"term1/{i}/{j}" for j in range(30)), size=KB)
            publisher.flush()
        first = await asyncio.to_thread(replay, replay_at)  # the publisher serves replays on this loop
        seqs = [s for s, _ in first]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive within the term
        assert sum(len(p) for _, p in first) <= 1 << 16 and len(first) < 40  # the oldest went
        t2 = table("a", dram=4096 * KB)
        publisher.new_term(t2)
        put(t2, "term2/0")
        publisher.flush()
        later = await asyncio.to_thread(replay, replay_at, seqs[-1] + 1)
        assert len(later) == 1 and later[0][0] > seqs[-1] + 1  # a new term: a jump, never a repeat
        events = decode_batch(later[0][1]).events
        assert isinstance(events[0], AllBlocksCleared) and events[0].backend_id is None
        assert events[1].object_key == "term2/0"  # type: ignore[union-attr]
    finally:
        await publisher.close()
