"""Background loops that cannot die silently (server/supervisor.py), and the daemon sweep that did."""

from __future__ import annotations

import threading
import time

from kvstore.auth import TICKET_SKEW_MS, Authority
from kvstore.protocol import WriteBlocks
from server.daemon.gate import Gate
from server.supervisor import Supervisor


def test_a_loop_that_raises_is_restarted_and_counted_and_one_that_returns_ends() -> None:
    supervisor = Supervisor()
    stop = threading.Event()
    runs: list[int] = []

    def flaky() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise ValueError("boom")
        stop.wait()  # the third run lives until stopped

    t = supervisor.thread("flaky", flaky, stop)
    assert supervisor.counts() == {"flaky": 0}  # known from its start
    t.start()
    deadline = time.monotonic() + 5
    while len(runs) < 3:
        assert time.monotonic() < deadline, runs
        time.sleep(0.01)
    assert supervisor.counts() == {"flaky": 2} and t.is_alive()
    stop.set()
    t.join(2)
    assert not t.is_alive()
    done = supervisor.thread("once", lambda: None, threading.Event())
    done.start()
    done.join(2)
    assert not done.is_alive() and supervisor.counts()["once"] == 0


def test_a_loop_that_fails_after_its_stop_is_not_restarted() -> None:
    supervisor = Supervisor()
    stop = threading.Event()
    runs: list[int] = []

    def fails() -> None:
        runs.append(1)
        stop.set()
        raise RuntimeError("on the way out")

    t = supervisor.thread("fails", fails, stop)
    t.start()
    t.join(2)
    assert runs == [1] and supervisor.counts() == {"fails": 1}


def test_the_sweep_survives_a_key_put_removed_and_put_again_past_its_first_seal() -> None:
    """Put K, remove K, put K again, then the first seal expires: the sweep used to raise ValueError
    (list.remove) in Gate._prune and its thread died, so late logins were never cut again."""
    authority = Authority(b"s" * 32)
    gate = Gate(authority, "n0")
    now_ms = int(time.time() * 1000)

    def write(seal_ends: int) -> None:
        seal = authority.seal("alice", "n0", "alice/k", 0, 4, seal_ends)
        gate._claim(WriteBlocks(["alice/k"], [0], [4], [1], False, [seal]))

    write(now_ms + 1_000)
    gate.dropped(["alice/k"])  # removed
    write(now_ms + 90_000)  # put again: a new reservation, a new seal
    gate.sweep(wall_ms=now_ms + 1_000 + TICKET_SKEW_MS + 1)  # the first seal is past its end
    assert len(gate._seals) == 1 and len(gate._sealed["alice/k"]) == 1
    gate.dropped(["alice/k"])  # the second put's block is dropped too: its seal is closed
    gate.sweep(wall_ms=now_ms + 90_000 + TICKET_SKEW_MS + 1)
    assert not gate._seals and not gate._sealed
