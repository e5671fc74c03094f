"""The daemon's Committer (cached puts' commits at the master): answers of every kind in one group,
drops that fail while a registration runs, registrations that carry what is queued, flush and
drain. The master's side is a function answering as the master's commit_granted does; the real
cluster's behaviour is tests/integration/test_cached_puts.py's."""

from __future__ import annotations

import threading

import pytest

from kvstore.errors import GrantExpired, InvalidArgument, NotReady, RetryLater, Timeout
from kvstore.keys import BlockKey
from kvstore.protocol import PUT_EXISTS, PUT_STORED
from server.daemon.commits import Committer, Refused


class Master:
    """Answers per key from ``codes`` (PUT_STORED where none is given); records every call."""

    def __init__(self) -> None:
        self.codes: dict[str, int] = {}
        self.calls: list[list[str]] = []
        self.write_ids: list[list[int]] = []
        self.down = False

    def commit(self, grant_id: int, keys: list[BlockKey], offsets: list[int], sizes: list[int],
               checksums: list[int], pinned: bool, write_ids: list[int]) -> list[tuple[int, str]]:  # fmt: skip
        if self.down:
            raise Timeout("no reply")
        self.calls.append(list(keys))
        self.write_ids.append(list(write_ids))
        return [(self.codes.get(k, PUT_STORED), "why") for k in keys]


def committer(master: Master, dropped: list[str], released: list[object], drop_fails: list[bool]) -> Committer:
    def drop(blocks: list[Refused]) -> None:
        if drop_fails and drop_fails.pop(0):
            raise NotReady("a registration is running")
        dropped.extend(k for k, _, _, _ in blocks)

    return Committer(lambda: master.commit, drop, released.append, threading.Event())


def test_one_group_of_every_answer_commits_refuses_and_retries_each_as_its_code_says() -> None:
    master, dropped, released, fails = Master(), [], [], []  # type: ignore[var-annotated]
    c = committer(master, dropped, released, fails)
    master.codes = {"exists": PUT_EXISTS, "bad": InvalidArgument.code, "busy": RetryLater.code}
    for n, (key, hold) in enumerate((("ok", "h1"), ("exists", "h2"), ("bad", "h3"), ("busy", "h4"))):
        c.add(7, [BlockKey(key)], [0], [10], [1], False, hold, [40 + n])
    assert c._round() is True  # "busy" goes back
    assert master.calls == [["ok", "exists", "bad", "busy"]]  # one request for the grant's four puts
    assert master.write_ids == [[40, 41, 42, 43]]  # each with its put's write id
    assert sorted(dropped) == ["bad", "exists"] and c.refused == 2 and c.committed == 1
    assert sorted(released) == ["h1", "h2", "h3"] and c.holds(BlockKey("busy")) and not c.holds(BlockKey("ok"))
    master.codes = {}
    assert c._round() is False and released[-1] == "h4" and c.committed == 2 and c.pending() == 0
    c.flush(0.1)


def test_a_drop_refused_while_registering_keeps_everything_for_later() -> None:
    master, dropped, released = Master(), [], []  # type: ignore[var-annotated]
    c = committer(master, dropped, released, [True])
    master.codes = {"exists": PUT_EXISTS}
    c.add(1, [BlockKey("exists"), BlockKey("fine")], [0, 64], [10, 10], [1, 2], False, "h")
    assert c._round() is True and dropped == [] and released == []  # NotReady: nothing done, all back
    assert c._round() is False and dropped == ["exists"] and released == ["h"]


def test_a_registration_carries_what_is_queued_and_a_master_that_does_not_know_the_grant_waits_for_one() -> None:
    master, dropped, released = Master(), [], []  # type: ignore[var-annotated]
    c = committer(master, dropped, released, [])
    master.down = True
    c.add(3, [BlockKey("a")], [0], [10], [1], False, "h")
    assert c._round() is True and released == []  # unreachable: kept
    with pytest.raises(Timeout):
        c.flush(0.05)
    master.down = False
    master.codes = {"a": GrantExpired.code}  # a new leader before this daemon registered with it
    assert c._round() is True and dropped == [] and released == []
    c.registering()  # its inventory carries "a"
    assert released == ["h"] and c.adopted == 1 and c.pending() == 0 and not c.holds(BlockKey("a"))
    c.flush(0.05)


def test_drain_commits_in_the_callers_thread() -> None:
    master, dropped, released = Master(), [], []  # type: ignore[var-annotated]
    c = committer(master, dropped, released, [])
    c.add(3, [BlockKey("x")], [0], [10], [1], False, "h")
    c.drain(1.0)
    assert released == ["h"] and master.calls == [["x"]]
    master.down = True
    c.add(3, [BlockKey("y")], [0], [10], [1], False, "h2")
    with pytest.raises(Timeout):
        c.drain(0.1)


def test_a_refusal_names_the_block_as_it_was_acknowledged() -> None:
    """The drop of a refused cached put gets its key with the extent and checksum it was written
    with (the daemon drops that very block only, never a newer one under the key)."""
    master = Master()
    master.codes = {"exists": PUT_EXISTS}
    got: list[Refused] = []
    c = Committer(lambda: master.commit, got.extend, lambda _: None, threading.Event())
    c.add(7, [BlockKey("ok"), BlockKey("exists")], [0, 8192], [10, 20], [1, 2], False)
    assert c._round() is False
    assert got == [(BlockKey("exists"), 8192, 20, 2)]


def test_a_daemon_knows_its_cached_blocks_from_before_their_local_commit_to_after_the_master_took_them() -> None:
    """What a drop of puts begun with an earlier master must keep: a key whose commit is queued, or
    being acknowledged (before the block is even in the arena), and the very block the master took
    lately, nothing else."""
    master = Master()
    c = Committer(lambda: master.commit, lambda _: None, lambda _: None, threading.Event())
    k = BlockKey("k")
    assert not c.ours(k, None)
    with c.acknowledging([k]):
        assert c.ours(k, None) and c.holds(k)
        c.add(7, [k], [4096], [10], [5], False)
    assert c.ours(k, (4096, 10, 5))  # queued
    assert c._round() is False  # the master took it
    assert c.ours(k, (4096, 10, 5)) and not c.holds(k)
    assert not c.ours(k, (8192, 10, 5)) and not c.ours(k, None)  # another block under the key: not ours
