"""The client core without I/O: replica failover, the grant pool, the master retry rule, and an
operation driven by a script of answers (what both Store and AsyncStore carry out)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from msgspec import structs

from kvstore.config import ClientConfig
from kvstore.errors import ConnectionFailed, InvalidArgument, NotLeader, NotReady, ProtocolError, Timeout
from kvstore.keys import checksum
from kvstore.protocol import (
    GetReplicas,
    GetReplicasReply,
    GrantReply,
    GrantSpace,
    LocatedRef,
    OkReply,
    PutEnd,
    PutEndReply,
    PutRevoke,
    PutStart,
    PutStartReply,
    ReplicaRef,
    ReturnGrants,
)
from kvstore.results import PutStatus
from kvstore_client.core import ClientCore, OverTcp
from kvstore_client.effects import Call, Daemons, Effect, Notify, Pause, ReadLocated, WriteReserved, drive
from kvstore_client.grants import GrantPool, NeedGrant
from kvstore_client.hedging import MULTIPLE, WINDOW
from kvstore_client.puts import PutOptions
from kvstore_client.reads import Failover
from transfer.rpc import Retry, after_failure

A = ReplicaRef("node0", "10.0.0.1:1", "dram", 0)
B = ReplicaRef("node1", "10.0.0.2:1", "dram", 64)
C = ReplicaRef("node2", "10.0.0.3:1", "ssd", 0)


DATA = b"0123456789"
"""The block "k" that the scripted reads serve (see :func:`_two_node_reads`)."""


def located(key: str, *replicas: ReplicaRef, size: int = 10) -> LocatedRef:
    return LocatedRef(key, size, 0, list(replicas))


# -- Failover ------------------------------------------------------------------------------------


def test_failover_reads_each_block_from_its_replicas_in_order_until_one_serves_it() -> None:
    plan = Failover({0: located("a", A, B, C), 1: located("b", B, A)})
    assert plan.round() == {("node0", A.address): [(0, A)], ("node1", B.address): [(1, B)]}
    plan.take([(0, A)], ConnectionFailed("gone"), lambda i, got: True)  # node0 is dead: block 0 to its next
    plan.take([(1, B)], [None], lambda i, got: got is not None)  # node1 misses block 1: its next
    assert plan.round() == {("node1", B.address): [(0, B)], ("node0", A.address): [(1, A)]}
    plan.take([(0, B)], Timeout("stalled"), lambda i, got: True)
    plan.take([(1, A)], [10], lambda i, got: got is not None)
    assert plan.round() == {("node2", C.address): [(0, C)]}
    assert plan.read == {1}
    plan.take([(0, C)], [None], lambda i, got: got is not None)
    assert not plan and plan.read == {1}  # block 0 missed on every replica: a miss, not an error


def test_failover_puts_local_replicas_first_and_keeps_the_masters_order_otherwise() -> None:
    plan = Failover({0: located("a", A, B, C)}, local=lambda r: r.node_id == "node2")
    assert plan.round() == {("node2", C.address): [(0, C)]}
    plan.missed(0)
    assert plan.round() == {("node0", A.address): [(0, A)]}


def test_failover_raises_a_failure_that_is_not_an_unreachable_node() -> None:
    plan = Failover({0: located("a", A, B)})
    with pytest.raises(ProtocolError):
        plan.take([(0, A)], ProtocolError("malformed"), lambda i, got: True)


def test_failover_passes_a_refusing_node_by_but_never_calls_its_last_refusal_a_miss() -> None:
    plan = Failover({0: located("a", A, B), 1: located("b", B)})
    plan.take([(0, A)], NotReady("node0's lease lapsed"), lambda i, got: True)  # block 0: to B
    plan.take([(1, B)], NotReady("node1's lease lapsed"), lambda i, got: True)  # block 1: nowhere else
    assert plan.round() == {("node1", B.address): [(0, B)]}
    plan.take([(0, B)], [10], lambda i, got: got is not None)
    assert not plan and plan.read == {0}
    with pytest.raises(NotReady, match="node1"):
        plan.finish()  # block 1 may well be stored: the read cannot tell, and says so
    earlier = Failover({0: located("a", A, B)})
    earlier.take([(0, A)], NotReady("node0's lease lapsed"), lambda i, got: True)
    earlier.take([(0, B)], [None], lambda i, got: got is not None)  # B has no copy; A may well have
    with pytest.raises(NotReady, match="node0"):
        earlier.finish()
    unreachable = Failover({0: located("a", A)})
    unreachable.take([(0, A)], ConnectionFailed("gone"), lambda i, got: True)
    unreachable.finish()  # a node gone: its blocks are misses, as before


def test_failover_of_blocks_without_replicas_is_done_at_once() -> None:
    assert not Failover({0: located("a")})


# -- GrantPool -------------------------------------------------------------------------------------


def grant_reply(grant_id: int, length: int = 4096) -> GrantReply:
    return GrantReply(grant_id, "node0", "10.0.0.1:1", 0, length, 60_000, 64)


def test_grant_pool_asks_installs_carves_and_gives_back() -> None:
    pool = GrantPool(4096)
    assert pool.carve([100], None) == NeedGrant([])
    carved, back = pool.install(grant_reply(1), None, [100])
    assert carved is not None and carved[1] == [0] and back == []
    assert pool.carve([100, 100], None) == (carved[0], [128, 256])  # aligned, from the front
    assert pool.carve([4000], None) is None  # a batch that would use up a grant: the two-trip way
    assert [pool.carve([960], None) for _ in range(3)] == [(carved[0], [384 + 960 * i]) for i in range(3)]
    assert pool.carve([960], None) == NeedGrant([1])  # not room enough: retired, another asked for
    assert pool.install(grant_reply(2, length=512), None, [960]) == (None, [2])  # too small to use
    assert pool.size == 512  # the master's cap, from now on
    assert pool.close() == []


def test_grant_pool_asks_for_one_grant_at_a_time() -> None:
    pool = GrantPool(4096)
    assert pool.carve([100], None) == NeedGrant([])
    assert pool.carve([100], None) is None  # asked for already: this put goes the two-trip way
    assert pool.carve([100], "node1") == NeedGrant([])  # another preferred node: its own grant
    pool.abandon(None)  # the master did not answer
    assert pool.carve([100], None) == NeedGrant([])
    carved, _ = pool.install(grant_reply(3), None, [100])
    assert carved is not None and pool.carve([100], None) == (carved[0], [128])


def test_grant_pool_drop_returns_a_grant_once() -> None:
    pool = GrantPool(4096)
    carved, _ = pool.install(grant_reply(7), "node0", [10])
    assert carved is not None
    assert pool.drop(carved[0]) == [7]
    assert pool.drop(carved[0]) == []


# -- the master retry rule ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "dynamic", "decision"),
    [
        (NotReady("starting"), False, Retry.AGAIN),
        (NotLeader("standby"), False, Retry.ELSEWHERE),
        (ConnectionFailed("refused"), False, Retry.ELSEWHERE),
        (Timeout("silent"), False, Retry.GIVE_UP),  # one fixed master: nobody else to ask
        (Timeout("silent"), True, Retry.ELSEWHERE),  # through etcd: a successor may answer
        (InvalidArgument("bad key"), True, Retry.GIVE_UP),
    ],
)
def test_after_failure(error: Exception, dynamic: bool, decision: Retry) -> None:
    assert after_failure(error, dynamic=dynamic) is decision  # type: ignore[arg-type]


# -- an operation, driven by a script ---------------------------------------------------------------


@pytest.mark.parametrize(
    "failure", [ConnectionFailed("node0 is gone"), Timeout("node0 did not answer"), NotReady("node0's lease lapsed")]
)
def test_a_get_reads_the_next_replica_when_the_first_node_fails(failure: Exception) -> None:
    core = ClientCore(ClientConfig(), OverTcp())
    data = b"0123456789"
    reads: list[str] = []

    def answer(effect: Effect) -> Any:
        if isinstance(effect, Call):
            assert isinstance(effect.message, GetReplicas) and effect.message.keys == ["k"]
            return GetReplicasReply(
                [10], [checksum(data)], [2], ["node0", "node1"], [A.address, B.address], ["dram", "dram"], [0, 64], 0, 0
            )
        assert isinstance(effect, Daemons)
        [job] = effect.jobs
        assert isinstance(job, ReadLocated)
        reads.append(job.node_id)
        if job.node_id == "node0":
            return [failure]
        [(_, _, view)] = job.blocks
        view[:10] = data
        return [[10]]

    assert drive(core.get_many(["k"], verify=True), answer) == [data]
    assert reads == ["node0", "node1"]
    assert core.hints.get("k") == ("node1", B.address)  # remembered where it was read


def test_a_get_whose_only_copy_is_on_a_refusing_node_raises_instead_of_missing() -> None:
    """A node whose lease with the master lapsed answers NotReady: the hinted read goes the master's
    way, and a located block with no other replica fails the get (a miss would be a lie)."""
    core = ClientCore(ClientConfig(), OverTcp())
    core.hints.note([("k", ("node0", A.address))])
    refusal = NotReady("node0's lease with the master lapsed")
    asked: list[str] = []

    def answer(effect: Effect) -> Any:
        if isinstance(effect, Call):
            asked.append("master")
            return GetReplicasReply([10], [0], [1], ["node0"], [A.address], ["dram"], [0], 0, 0)
        assert isinstance(effect, Daemons)
        [job] = effect.jobs
        asked.append(type(job).__name__)
        return [refusal]

    with pytest.raises(NotReady, match="lapsed"):
        drive(core.get_many(["k"], verify=True), answer)
    assert asked == ["ReadDirect", "master", "ReadLocated"]
    assert core.hints.get("k") is None and not core.marks.suspected("node0")  # alive: no suspect


def test_a_two_trip_write_waits_its_patience_then_the_whole_timeout_only_where_that_is_shorter() -> None:
    core = ClientCore(ClientConfig(timeout_s=10.0), OverTcp())
    assert core.write_patience_s(4096) == pytest.approx(0.2 + 4096 / 100e6)  # two read failovers, the bytes
    assert core.write_patience_s(4096, attempt=2) == pytest.approx(0.8 + 4096 / 100e6)  # doubled at each attempt
    assert core.write_patience_s(4096, attempt=6) == 0.0  # 12.8 s: the timeout bounds it
    assert core.write_patience_s(1 << 30) == 0.0  # 10.7 s of bytes at the floor rate: the timeout bounds it
    assert ClientCore(ClientConfig(failover_ms=0), OverTcp()).write_patience_s(4096) == 0.0


def _hedging_core() -> ClientCore:
    """A client whose last reads took 3 ms each: it hedges at three of them."""
    core = ClientCore(ClientConfig(), OverTcp())
    for _ in range(WINDOW):
        core.read_times.add(0.003)
    return core


def _on_two_nodes(data: bytes) -> GetReplicasReply:
    """The master's answer for one block "k" of ``data`` held on node0 and node1."""
    return GetReplicasReply(
        [10], [checksum(data)], [2], ["node0", "node1"], [A.address, B.address], ["dram", "dram"], [0, 64], 0, 0
    )


def _on_node0(data: bytes) -> GetReplicasReply:
    """The master's answer for one block "k" of ``data`` whose one copy is on node0."""
    return GetReplicasReply([10], [checksum(data)], [1], ["node0"], [A.address], ["dram"], [0], 0, 0)


def _asking_master(
    answer: Callable[[Effect], Any], again: GetReplicasReply | Exception
) -> tuple[Callable[[Effect], Any], list[GetReplicas]]:
    """``answer`` with the master asked again: every GetReplicas after the first answered ``again``
    (raised, when an exception); and the GetReplicas it was asked, in order."""
    asked: list[GetReplicas] = []

    def with_master(effect: Effect) -> Any:
        if isinstance(effect, Call):
            assert isinstance(effect.message, GetReplicas)
            asked.append(effect.message)
            if len(asked) > 1:
                if isinstance(again, Exception):
                    raise again
                return again
        return answer(effect)

    return with_master, asked


def _located_job(effect: Effect, data: bytes) -> ReadLocated | None:
    """The one ReadLocated job of ``effect``; None for the master's call (answer :func:`_on_two_nodes`)."""
    if isinstance(effect, Call):
        return None
    assert isinstance(effect, Daemons)
    [job] = effect.jobs
    assert isinstance(job, ReadLocated)
    return job


def _two_node_reads(
    node: Callable[[str, float], Any], data: bytes = DATA
) -> tuple[Callable[[Effect], Any], list[tuple[str, float]]]:
    """A script of answers for gets of "k" (``data`` on node0 and node1), and the (node, patience)
    of each read it was asked: ``node(node_id, patience)`` gives a read's outcome, or None to serve
    ``data``."""
    jobs: list[tuple[str, float]] = []

    def answer(effect: Effect) -> Any:
        job = _located_job(effect, data)
        if job is None:
            return _on_two_nodes(data)
        jobs.append((job.node_id, job.patience_s))
        outcome = node(job.node_id, job.patience_s)
        if outcome is not None:
            return outcome
        [(_, _, view)] = job.blocks
        view[: len(data)] = data
        return [[len(data)]]

    return answer, jobs


def test_a_hedged_read_reads_a_slow_node_last_and_in_order_when_every_node_is_slow() -> None:
    """A read given up at the hedge patience makes its node slow for a while: its blocks are read at
    their other replicas first. When every replica's node is slow, the marks say nothing of which
    node to read: the replicas are read in order, each with the hedge patience while another is to come."""
    core = _hedging_core()
    hedge = core.read_patience_s
    assert hedge == MULTIPLE * 0.003
    answer, jobs = _two_node_reads(
        lambda node, patience: [Timeout("node0 paused")] if node == "node0" and patience else None
    )
    assert drive(core.get_many(["k"], verify=True), answer) == [DATA]
    assert jobs == [("node0", hedge), ("node1", hedge)]  # hedged after three p99s; node0 is still to come
    assert core.marks.slow("node0") and core.read_times.hedged == 1
    core.marks.note_unreachable("node1", Timeout("node1 paused too"), hedge)
    jobs.clear()
    core.hints.forget(["k"])
    assert drive(core.get_many(["k"], verify=True), answer) == [DATA]
    assert jobs == [("node0", hedge), ("node1", hedge)]  # both slow: in order
    assert not core.marks.suspected("node0") and not core.marks.suspected("node1")  # slow, not suspected


def test_a_read_whose_every_node_is_slow_never_rests_on_the_cut_one_untried() -> None:
    """bench.chaos's client cut, under load: both nodes marked slow (hedges given up at ~20 ms),
    node1 cut off from this client. The read used to pass node0 by for being slow, pass node1 by
    for the same, and come to rest on node1's last copy with no patience: the whole timeout (5 s)
    on the cut node, node0 (alive) never asked. Now node0 is read, and serves."""
    core = _hedging_core()
    hedge = core.read_patience_s
    core.marks.note_unreachable("node0", Timeout("a hedge given up under load"), hedge)
    core.marks.note_unreachable("node1", Timeout("a hedge given up: the cut began"), hedge)
    core.marks.answered("node0")  # another read's answer: node0 is alive, only slow lately
    answer, jobs = _two_node_reads(lambda node, patience: [Timeout("node1 is cut off")] if node == "node1" else None)
    assert drive(core.get_many(["k"], verify=True), answer) == [DATA]
    assert jobs == [("node0", hedge)]


def test_a_replica_given_up_at_the_hedge_is_read_again_last_when_the_others_fail() -> None:
    """A slow node given up at the hedge patience may be the one alive: its next replica's node is
    gone (refused), so the slow one is read again with the failover patience, and the get is a hit,
    not a miss."""
    core = _hedging_core()
    hedge = core.read_patience_s

    def node(node_id: str, patience: float) -> Any:
        if node_id == "node1":
            return [ConnectionFailed("node1 is gone")]
        if patience < 0.02:  # node0 answers in 20 ms: slower than the hedge, within the failover
            return [Timeout("node0 is slow")]
        return None

    answer, jobs = _two_node_reads(node)
    assert drive(core.get_many(["k"], verify=True), answer) == [DATA]
    assert jobs == [("node0", hedge), ("node1", hedge), ("node0", core.failover_s)]  # node0 last: a hit


def test_a_replica_given_up_and_read_again_last_is_a_miss_within_the_failover_not_the_timeout() -> None:
    """The node this read gave up does not answer the second time either (frozen, or cut off from
    this client) and the block's other replica missed (its key removed meanwhile): a miss within the
    failover patience, not a wait of the whole timeout (bench.chaos found reads of 3-5 s so)."""
    core = _hedging_core()
    hedge = core.read_patience_s

    def node(node_id: str, patience: float) -> Any:
        if node_id == "node1":
            return [[None]]  # removed here
        assert patience, "a read of a node this read gave up waited the whole timeout"
        return [Timeout("node0 is frozen")]

    answer, jobs = _two_node_reads(node)
    assert drive(core.get_many(["k"], verify=True), answer) == [None]
    assert jobs == [("node0", hedge), ("node1", hedge), ("node0", core.failover_s)]


def test_a_node_the_gets_fast_path_gave_up_is_a_miss_within_the_failover_not_the_timeout() -> None:
    """A get's fast path (a read by remembered location, Store._hit) gave node0 up at its patience
    for "k" (cut off from this client), and the get goes on the core's way at once: node0 is slow,
    so "k" is read at node1 first, which misses (removed meanwhile), and node0 last. That is a node
    this get gave up: the failover patience, a miss (it waited the whole timeout: a 5 s get in
    bench.chaos's client cut, 3.7 s in a daemon SIGSTOP). The same read without the fast path's
    give-up (node0 only slow for other reads) still waits for node0's last copy."""
    core = _hedging_core()
    hedge = core.read_patience_s

    def node(node_id: str, patience: float) -> Any:
        if node_id == "node1":
            return [[None]]  # removed here
        return [Timeout("node0 is cut off")]

    core.marks.note_unreachable("node0", Timeout("no reply began"), hedge)  # the fast path's give-up
    answer, jobs = _two_node_reads(node)
    assert drive(core.get_many(["k"], verify=True), answer) == [None]
    assert jobs == [("node1", hedge), ("node0", core.failover_s)]
    core.marks.note_unreachable("node0", Timeout("no reply began"), hedge)  # given up again (another key)
    core.marks.answered("node0")  # then its daemon answered another read of this client: alive
    answer, jobs = _two_node_reads(lambda node_id, patience: [[None]] if node_id == "node1" else None)
    assert drive(core.get_many(["k"], verify=True), answer) == [DATA]
    assert jobs == [("node1", hedge), ("node0", core.failover_s)]  # slow, but heard since: its last copy read


@pytest.mark.parametrize("again", ["removed", "put_again", "evicted_on_node0", "still_on_both", "moved", "no_master"])
def test_a_last_replica_after_another_answered_it_does_not_hold_the_block_is_read_where_the_master_places_it(
    again: str,
) -> None:
    """node0 answers that it does not hold "k" and node1, the last replica, is frozen (SIGSTOP: its
    connections stay open, nothing marks it slow or suspected). Before a wait on node1 the read asks
    the master again: "k" removed since it was located is a miss at once (bench.chaos's hour run
    waited 3.7 s on the frozen node so); "k" still on node1 (node0 alone lost its copy: evicted
    there) is waited for, as any last copy (a stored key is never a miss for a slow node); "k" moved
    to node2 is read there; a master that does not answer leaves the read as it was."""
    reply = {
        "removed": GetReplicasReply([-1], [0], [0], [], [], [], [], 0, 0),
        "put_again": GetReplicasReply(
            [10], [checksum(b"another!!!")], [1], ["node1"], [B.address], ["dram"], [64], 0, 0
        ),
        "evicted_on_node0": GetReplicasReply([10], [checksum(DATA)], [1], ["node1"], [B.address], ["dram"], [64], 0, 0),
        "still_on_both": _on_two_nodes(DATA),
        "moved": GetReplicasReply([10], [checksum(DATA)], [1], ["node2"], ["10.0.0.3:1"], ["ssd"], [0], 0, 0),
        "no_master": Timeout("the master did not answer"),
    }[again]
    read = None if again in ("removed", "put_again") else DATA
    core = _hedging_core()
    hedge = core.read_patience_s

    def node(node_id: str, patience: float) -> Any:
        if node_id == "node0":
            return [[None]]  # not held here
        assert read is not None, "waited on the frozen last replica of a removed key"
        assert node_id == ("node2" if again == "moved" else "node1")
        return None

    answer, jobs = _two_node_reads(node)
    with_master, asked = _asking_master(answer, reply)
    assert drive(core.get_many(["k"], verify=True), with_master) == [read]
    assert [m.keys for m in asked] == [["k"], ["k"]] and not asked[1].lease
    then = [] if read is None else [("node2", core.failover_s)] if again == "moved" else [("node1", core.failover_s)]
    assert jobs == [("node0", hedge), *then]


def test_a_keys_one_copy_on_a_node_given_up_lately_is_a_miss_within_the_failover_not_the_timeout() -> None:
    """The one copy of "k" is on node0, which this client gave up a moment ago (cut off from it: its
    reads there do not begin within their patience; nothing fails, the packets are dropped): a miss
    within the failover patience, not a wait of the whole timeout (4.7 s in bench.chaos's client
    cut). On a node not given up, the one copy is waited for (a first attempt, not a failed one)."""
    one_copy = _on_node0(DATA)
    core = _hedging_core()

    def node(node_id: str, patience: float) -> Any:
        assert patience, "waited the whole timeout on a node this client gave up"
        return [Timeout("node0 is cut off from this client")]

    answer, jobs = _two_node_reads(node)
    core.marks.note_unreachable("node0", Timeout("no reply began"), core.read_patience_s)  # another read's
    assert drive(core.get_many(["k"], verify=True), lambda e: one_copy if isinstance(e, Call) else answer(e)) == [None]
    assert jobs == [("node0", core.failover_s)]
    core = _hedging_core()
    answer, jobs = _two_node_reads(lambda node_id, patience: None)
    assert drive(core.get_many(["k"], verify=True), lambda e: one_copy if isinstance(e, Call) else answer(e)) == [DATA]
    assert jobs == [("node0", core.failover_s)]  # a first attempt (past it, the master is asked: below)


@pytest.mark.parametrize("master", ["suspects_it", "hears_it", "no_answer"])
def test_a_last_copy_on_a_node_that_does_not_begin_answering_is_confirmed_with_the_master(master: str) -> None:
    """The one copy of "k" is on node0, frozen a moment before the read (SIGSTOP): this client never
    gave node0 up and the master did not suspect it when the read located "k". Past the failover
    patience the read asks the master again: a node it suspects now (three missed heartbeats) makes
    the copy a miss at once (the read waited until the node was resumed: 2.9 s in bench.chaos's
    daemon SIGSTOP); a node it hears from is read again with twice the patience, four times, then
    waited for the whole timeout (a slow read of a live node completes); a master that
    does not answer (a leader's fault) leaves the read to the whole timeout."""
    one_copy = _on_node0(DATA)
    core = _hedging_core()
    fail = core.failover_s
    answer, jobs = _two_node_reads(
        lambda node_id, patience: [Timeout("node0 is frozen")] if patience else None  # live: answers the whole wait
    )
    again = {
        "suspects_it": structs.replace(one_copy, suspects=["node0"]),
        "hears_it": one_copy,
        "no_answer": Timeout("the master did not answer"),
    }[master]
    with_master, asked = _asking_master(lambda e: one_copy if isinstance(e, Call) else answer(e), again)
    got = drive(core.get_many(["k"], verify=True), with_master)
    if master == "suspects_it":
        assert got == [None] and jobs == [("node0", fail)] and len(asked) == 2 and core.marks.suspected("node0")
    elif master == "hears_it":
        assert got == [DATA] and len(asked) == 4
        assert jobs == [("node0", fail), ("node0", 2 * fail), ("node0", 4 * fail), ("node0", 0.0)]
    else:
        assert got == [DATA] and jobs == [("node0", fail), ("node0", 0.0)] and len(asked) == 2
    assert all(not m.lease for m in asked[1:])


def test_a_confirm_patience_past_the_timeout_is_the_whole_timeout() -> None:
    """With a failover of 3 s and a timeout of 5 s, the second asking's 6 s would pass the timeout:
    the read waits the whole timeout instead (a patience longer than it would outlive the link's)."""
    one_copy = _on_node0(DATA)
    core = ClientCore(ClientConfig(failover_ms=3000, timeout_s=5.0), OverTcp())
    answer, jobs = _two_node_reads(lambda node_id, patience: [Timeout("node0 is slow")] if patience else None)
    assert drive(core.get_many(["k"], verify=True), lambda e: one_copy if isinstance(e, Call) else answer(e)) == [DATA]
    assert jobs == [("node0", 3.0), ("node0", 0.0)]


@pytest.mark.parametrize("failure", [ConnectionFailed("node0 is gone"), NotReady("node0's lease lapsed")])
def test_a_last_replica_after_another_failed_is_waited_for_without_a_second_look(failure: Exception) -> None:
    """A node0 that failed instead of answering (gone, refusing) says nothing of the key: node1's
    last copy is waited for, and the master is not asked again."""
    core = _hedging_core()
    answer, jobs = _two_node_reads(lambda node_id, patience: [failure] if node_id == "node0" else None)
    calls: list[Effect] = []

    def counted(effect: Effect) -> Any:
        if isinstance(effect, Call):
            calls.append(effect)
        return answer(effect)

    assert drive(core.get_many(["k"], verify=True), counted) == [DATA]
    assert jobs == [("node0", core.read_patience_s), ("node1", core.failover_s)] and len(calls) == 1


def test_a_block_whose_every_replica_was_given_up_at_the_hedge_waits_the_failover_for_its_last() -> None:
    """Both nodes slower than the hedge in one read (a busy host): each is given up and read again;
    the last gets the failover patience (neither answered since), within which a live one answers."""
    core = _hedging_core()
    hedge = core.read_patience_s
    answer, jobs = _two_node_reads(lambda node, patience: [Timeout(f"{node} is slow")] if patience < 0.05 else None)
    assert drive(core.get_many(["k"], verify=True), answer) == [DATA]
    assert jobs == [("node0", hedge), ("node1", hedge), ("node0", hedge), ("node1", core.failover_s)]
    assert not core.marks.silent("node1") and core.marks.silent("node0")  # node1 answered; node0 did not since


def test_a_put_whose_write_a_node_did_not_answer_is_put_again_avoiding_that_node() -> None:
    """A two-copy put placed on node0 and node1: node0 does not answer the write within its patience
    (frozen, or cut off from this client alone: the master reaches it, so it would place there
    again). The put is revoked and put again, naming node0 as a node this client could not reach
    (PutStart.avoid); so does every put after it, until node0's daemon answers this client."""
    core = ClientCore(ClientConfig(grant_bytes=0), OverTcp())
    starts: list[PutStart] = []
    placed = {"node0": A, "node1": B, "node2": ReplicaRef("node2", "10.0.0.3:1", "dram", 128)}

    def answer(effect: Effect) -> Any:
        if isinstance(effect, Call):
            message = effect.message
            if isinstance(message, PutStart):
                starts.append(message)
                nodes = [n for n in placed if n not in message.avoid][:2]
                replicas = [placed[n] for n in nodes]
                return PutStartReply(
                    ["ok"], [0], [""], [2], nodes, [r.address for r in replicas], [r.offset for r in replicas]
                )
            if isinstance(message, PutEnd):
                return PutEndReply([True] * len(message.keys))
            assert isinstance(message, PutRevoke)
            return OkReply()
        if isinstance(effect, Pause):
            return None
        assert isinstance(effect, Daemons)
        assert all(isinstance(job, WriteReserved) for job in effect.jobs)
        return [Timeout("no reply began") if job.node_id == "node0" else [(0, "")] for job in effect.jobs]

    assert drive(core.put_many([("k", DATA)], PutOptions(replicas=2)), answer) == [PutStatus.STORED]
    assert [s.avoid for s in starts] == [[], ["node0"]]
    assert drive(core.put_many([("j", DATA)], PutOptions(replicas=2)), answer) == [PutStatus.STORED]
    assert starts[-1].avoid == ["node0"]
    core.marks.answered("node0")  # its daemon answered this client: reached again
    assert core.marks.unreached() == []


def test_a_grant_on_a_node_this_client_could_not_reach_is_given_back_and_the_next_avoids_it() -> None:
    """The client holds its grant on node0, then cannot reach node0 (a read there waited its whole
    timeout): its next put does not write into that grant (a one-trip write there has no patience:
    it would wait the whole timeout) but gives it back and asks for one, naming node0 to avoid."""
    core = ClientCore(ClientConfig(), OverTcp())
    nodes = {"node0": "10.0.0.1:1", "node1": "10.0.0.2:1"}
    asked: list[GrantSpace] = []
    returned: list[int] = []
    written: list[str] = []

    def answer(effect: Effect) -> Any:
        if isinstance(effect, Call):
            assert isinstance(effect.message, GrantSpace)
            asked.append(effect.message)
            node = next(n for n in nodes if n not in effect.message.avoid)
            return GrantReply(len(asked), node, nodes[node], 0, 1 << 20, 60_000, 64)
        if isinstance(effect, Notify):
            assert isinstance(effect.message, ReturnGrants)
            returned.extend(effect.message.grant_ids)
            return None
        assert isinstance(effect, Daemons)
        written.extend(job.node_id for job in effect.jobs)
        return [[(0, "")] for _ in effect.jobs]

    assert drive(core.put_many([("k", DATA)], None), answer) == [PutStatus.STORED]
    assert written == ["node0"] and core.granted_block("j", DATA, None) is not None
    core.marks.note_unreachable("node0", Timeout("no reply within the timeout"), 0.0)
    assert core.granted_block("j", DATA, None) is None  # not into node0's grant
    assert drive(core.put_many([("j", DATA)], None), answer) == [PutStatus.STORED]
    assert returned == [1] and [a.avoid for a in asked] == [[], ["node0"]] and written == ["node0", "node1"]


def test_a_node_holding_a_blocks_last_copy_and_another_with_a_replica_elsewhere_is_waited_for_neither() -> None:
    """bench.chaos, a daemon SIGSTOP: a get_many of a key with replicas on node0 and node1 and a key
    whose one copy is on node0, 10 ms after node0 froze (the master did not suspect it yet). One job
    to node0 for both waited the last copy's patience (the whole timeout) for both: 4.39 s, until
    node0 was resumed. Now node0 is asked for the first key with the hedge patience; given up, the
    first key is read at node1 and the last copy on node0 is a miss within the failover patience."""
    core = _hedging_core()
    hedge = core.read_patience_s
    data = DATA
    jobs: list[tuple[str, float, list[str]]] = []

    def answer(effect: Effect) -> Any:
        if isinstance(effect, Call):
            assert isinstance(effect.message, GetReplicas) and effect.message.keys == ["two", "one"]
            return GetReplicasReply(
                [10, 10], [checksum(data), checksum(data)], [2, 1], ["node0", "node1", "node0"],
                [A.address, B.address, A.address], ["dram"] * 3, [0, 64, 128], 0, 0,
            )  # fmt: skip
        assert isinstance(effect, Daemons)
        outcomes: list[Any] = []
        for job in effect.jobs:
            assert isinstance(job, ReadLocated)
            jobs.append((job.node_id, job.patience_s, [loc.key for loc, _, _ in job.blocks]))
            if job.node_id == "node0":
                assert job.patience_s, "a read of the frozen node0 waited the whole timeout"
                outcomes.append(Timeout("node0 is frozen"))
                continue
            for _, _, view in job.blocks:
                view[:10] = data
            outcomes.append([10] * len(job.blocks))
        return outcomes

    assert drive(core.get_many(["two", "one"], verify=True), answer) == [data, None]
    assert jobs == [("node0", hedge, ["two"]), ("node1", hedge, ["two"]), ("node0", core.failover_s, ["one"])]
