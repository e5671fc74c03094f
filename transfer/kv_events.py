"""Following KV events (:mod:`kvstore.events`) over ZMQ: the store's masters' (``--kv-events``) or an
engine's (vLLM's ``--kv-events-config``), which speak the same protocol.

:class:`KVEventSubscriber` connects one SUB socket to every publisher given (all the HA masters:
only the leader publishes), delivers batches in sequence order, drops repeats, and asks a replay
endpoint for what a gap skipped. What no replay returns is counted in :attr:`lost`: after a
leader change the new leader's first event is ``AllBlocksCleared``, so a follower that lost the
old leader's last batches is whole again once it applies the new leader's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import zmq

from kvstore.errors import InvalidArgument
from kvstore.events import END_SEQ, AllBlocksCleared, EventBatch, decode_batch, seq_bytes, seq_of


def starts_term(batch: EventBatch) -> bool:
    """Whether ``batch`` is a publisher's first of a term: it tells to forget every block."""
    return bool(batch.events) and isinstance(batch.events[0], AllBlocksCleared) and batch.events[0].backend_id is None


class Delivered(NamedTuple):
    seq: int
    batch: EventBatch


class KVEventSubscriber:
    """A follower of one stream of KV events (see the module's text). Not thread-safe."""

    def __init__(
        self,
        endpoints: Sequence[str],
        replay: Sequence[str] = (),
        *,
        topic: str = "",
        replay_timeout_s: float = 2.0,
        from_seq: int | None = None,
    ) -> None:
        """``from_seq``: deliver from that sequence on (0: all a replay endpoint still keeps),
        replayed before the first batch that comes; None: from the first that comes."""
        if not endpoints:
            raise InvalidArgument("a KV events subscriber needs at least one endpoint to connect to")
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        for endpoint in endpoints:
            self._sub.connect(endpoint)
        self.replay_endpoints = list(replay)
        self.replay_timeout_s = replay_timeout_s
        self.last = -1 if not from_seq else from_seq - 1
        self._from_start = from_seq == 0
        """The sequence of the last batch delivered (-1: none yet)."""
        self.gaps = 0
        """Gaps seen (a leader change is one)."""
        self.lost = 0
        """Batches skipped that no replay gave back (known by the holes in the sequences; a hole
        before a term's first batch is not counted: that batch clears everything before it)."""
        self.bad = 0
        """Messages that were not a KV events batch (wrong frames, undecodable), dropped."""

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def receive(self, timeout_s: float) -> list[Delivered]:
        """The batches that came within ``timeout_s`` (waiting only until the first), in order,
        with the batches a gap before them skipped and a replay gave back."""
        out: list[Delivered] = []
        if not self._sub.poll(int(timeout_s * 1000)):
            return out
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 3 or len(frames[1]) != 8:
                self.bad += 1
                continue
            seq = seq_of(frames[1])
            if seq <= self.last:
                continue  # a repeat (a replay delivered it already)
            try:
                batch = decode_batch(frames[2])
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.bad += 1
                continue
            if self.last >= 0 and seq > self.last + 1:
                self.gaps += 1
                got = [*self._replay(self.last + 1, seq), Delivered(seq, batch)]
                prev = self.last
                for d in got:  # a hole before a term's first batch lost nothing: it clears all
                    if d.seq > prev + 1 and not starts_term(d.batch):
                        self.lost += d.seq - prev - 1
                    prev = d.seq
                out.extend(got[:-1])
            elif self.last == -1 and self._from_start:
                out.extend(self._replay(0, seq))
            out.append(Delivered(seq, batch))
            self.last = seq

    def catch_up(self) -> list[Delivered]:
        """Every batch after the last delivered (all, before the first) that a replay endpoint still
        keeps: what a follower that starts late asks for before it listens."""
        got = self._replay(self.last + 1, 1 << 63)
        if got:
            self.last = got[-1].seq
        return got

    def _replay(self, start: int, stop: int) -> list[Delivered]:
        """Batches ``start`` to ``stop`` - 1 from the first replay endpoint that has any."""
        for endpoint in self.replay_endpoints:
            got = self._replay_from(endpoint, start, stop)
            if got:
                return got
        return []

    def _replay_from(self, endpoint: str, start: int, stop: int) -> list[Delivered]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[Delivered] = []
        try:
            sock.connect(endpoint)
            sock.send_multipart((b"", seq_bytes(start)))
            deadline = time.monotonic() + self.replay_timeout_s
            while (left := deadline - time.monotonic()) > 0 and sock.poll(int(left * 1000)):
                frames = sock.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    break
                seq = seq_of(frames[2])
                if start <= seq < stop and (not out or seq > out[-1].seq):
                    try:
                        out.append(Delivered(seq, decode_batch(frames[3])))
                    except (msgspec.DecodeError, msgspec.ValidationError):
                        self.bad += 1
        finally:
            sock.close(linger=0)
        return out
