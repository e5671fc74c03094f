"""Absent nodes: of the cluster, not in the table (a new leader's missing node, an earlier leader's
fenced one); the keys removed meanwhile are dropped, not adopted, when they register."""

from __future__ import annotations

from kvstore.errors import RetryLater
from kvstore.placement.nodes import EVERYTHING, MAX_ABSENT_GONE, NodeRecord
from kvstore.placement.state import NodeCommand
from kvstore.policy import ActionKind
from kvstore.results import HeldBlock
from tests.unit.placement import DRAM, KB, SSD, put, run, table


def _blocks(*keys: str) -> list[HeldBlock]:
    return [HeldBlock(k, DRAM, i * KB, KB, 7) for i, k in enumerate(keys)]


def _dropped(commands: list[NodeCommand]) -> set[str]:
    return {k for c in commands if c.kind is ActionKind.DROP for k in c.keys}


def _absent(*entries: tuple[str, object, int]) -> NodeRecord:
    return NodeRecord(False, frozenset(entries))  # type: ignore[arg-type]


def test_a_key_removed_while_a_node_is_absent_is_dropped_at_its_registration() -> None:
    t = table("a", dram=8 * KB)
    put(t, "k", "kept")
    assert t.membership.take_records() == {"a": NodeRecord(True, frozenset())}
    t.membership.note_absent("b", set())
    assert t.membership.absent == ["b"] and t.stats()["nodes_absent"] == 1
    assert t.membership.take_records() == {"b": _absent()}  # kept (in etcd) even with nothing to drop yet
    removed, _ = t.remove(["k", "unknown"])  # "unknown": a key only the absent node may hold
    assert removed == 1
    assert t.membership.take_records() == {
        "b": _absent(*[(k, tier, -1) for k in ("k", "unknown") for tier in (DRAM, SSD)])
    }
    commands = t.membership.register_node("b", "b:1", 8 * KB, 0, 64, _blocks("k", "unknown", "kept", "other"), now_ms=0)
    assert _dropped(commands) == {"k", "unknown"}
    assert t.membership.absent == []
    record = t.membership.take_records()["b"]
    assert record is not None and record.member and record.gone  # owed until its first heartbeat
    assert t.membership.heartbeat("b", 1)
    assert t.membership.take_records() == {"b": NodeRecord(True, frozenset())}
    assert t.reads.exists(["k", "unknown", "kept", "other"]) == [False, False, True, True]
    t.check()


def test_an_absent_node_through_too_many_removes_drops_everything() -> None:
    t = table("a", dram=8 * KB)
    big = {(f"f{i}", DRAM, -1) for i in range(2 * MAX_ABSENT_GONE)}
    t.membership.note_absent(
        "big", big
    )  # an earlier leader's list of a fenced node is kept whole: the bound is on removes
    t.membership.note_absent("b", set())
    t.membership.take_records()
    t.remove(["r"])
    assert len(t.membership.take_records()["big"].gone) == len(big) + 2  # type: ignore[union-attr]
    t.remove([f"r{i}" for i in range(MAX_ABSENT_GONE // 2)])
    records = t.membership.take_records()
    assert records["b"] == _absent(EVERYTHING) and records["big"] == _absent(EVERYTHING)
    t.remove(["more"])  # nothing more to note
    assert t.membership.take_records() == {}
    commands = t.membership.register_node(
        "b", "b:1", 8 * KB, 8 * KB, 64, [*_blocks("x", "y"), HeldBlock("z", SSD, -1, KB, 7)], 0
    )
    assert _dropped(commands) == {"x", "y", "z"}
    assert t.membership.heartbeat("b", 1)
    assert t.reads.exists(["x", "y", "z"]) == [False] * 3
    t.check()


def test_a_fenced_node_is_kept_as_no_member_and_forgotten_once_it_leaves() -> None:
    t = table("a", "b")
    t.membership.take_records()
    t.membership.fence("b")
    assert t.membership.take_records() == {"b": _absent()}  # a new leader learns it is not to be waited for
    t.membership.register_node("b", "b:1", 4 * KB, 0, 64, [], now_ms=0)
    assert t.membership.take_records() == {"b": NodeRecord(True, frozenset())}
    t.membership.note_absent("c", set())
    t.membership.leave_node("c")
    assert t.membership.absent == [] and t.membership.take_records() == {"c": None}
    t.membership.note_absent("a", {("k", DRAM, -1)})  # registered in this table: its own registration's rules hold
    assert t.membership.absent == []


def test_blocks_a_remove_was_answered_without_are_in_the_nodes_record_until_it_drops_them() -> None:
    """A remove answered without a frozen node's drop (its lease to serve by key lapsed): the node's
    record names the block, so that a new leader drops it at the node's registration instead of
    adopting a removed key; the drop's answer takes it out again (a later put of the key there must
    not be dropped by a stale record)."""
    t = table("a", dram=8 * KB)
    put(t, "k", "v")
    t.membership.take_records()
    removed, commands = t.remove(["k"])
    assert removed == 1 and _dropped(commands) == {"k"}
    t.membership.owe("a", ["k", "never-stored"])
    record = t.membership.take_records()["a"]
    assert record is not None and record.member
    assert {e[0] for e in record.gone} == {"k"}
    t.membership.owe("a", ["k"])
    assert t.membership.take_records() == {}  # nothing new
    for c in commands:
        t.apply(c, [True] * len(c.keys))
    assert t.membership.take_records() == {"a": NodeRecord(True, frozenset())}
    assert t.reads.exists(["k"]) == [False]
    t.check()


def test_a_key_detached_from_its_owing_node_is_put_again_elsewhere_and_its_extent_freed_by_the_drop() -> None:
    """A remove answered on a frozen node's lapse: the key leaves the table at once (a put of it
    used to wait for the node's fence, 1.2 s in bench.chaos), its block's extent stays taken on the
    node that owes the drop, and no put of the key goes there until the drop is confirmed."""
    t = table("a", "b", "c", dram=8 * KB)
    put(t, "k", replicas=2, node="a")
    on = sorted(r["node_id"] for r in t.inspection.describe("k")["replicas"])  # type: ignore[index]
    free = {n: t.nodes[n].alloc.free_bytes for n in on}
    removed, commands = t.remove(["k"])
    assert removed == 1
    for n in on:
        t.membership.owe(n, ["k"])
    assert t.membership.detach("k") and t.inspection.describe("k") is None and t.reads.exists(["k"]) == [False]
    assert all(t.nodes[n].alloc.free_bytes == free[n] and "k" in t.nodes[n].owes for n in on)  # still taken
    t.check()
    [two] = t.writes.put_start(["k"], [KB], 2, None, False, 0).tickets  # one node left that may hold it: later
    assert two is not None and two.status == "error" and two.error_code == RetryLater.code
    put(t, "k", replicas=1, node=on[0])  # preferred on a node that owes it: placed elsewhere
    [replica] = t.inspection.describe("k")["replicas"]  # type: ignore[index]
    assert replica["node_id"] not in on
    run(t, commands)  # the drops are answered: the extents free, owed until the records say so
    assert all("k" in t.nodes[n].owes and t.nodes[n].alloc.free_bytes > free[n] for n in on)
    records, settling = t.membership.take_records(), t.membership.take_settling()
    assert all(r is not None and not r.gone for r in records.values()) and sorted(settling) == [(n, "k") for n in on]
    t.membership.records_not_kept(settling)  # etcd did not take them: still owed, taken again
    assert sorted(t.membership.take_settling()) == sorted(settling)
    t.membership.records_kept(settling)
    assert not any(t.nodes[n].owes for n in on)
    t.check()
    assert not t.membership.detach("missing")
