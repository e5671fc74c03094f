"""Absent nodes: of the cluster, not in the table (a new leader's missing node, an earlier leader's
fenced one); the keys removed meanwhile are dropped, not adopted, when they register."""

from __future__ import annotations

from kvstore.placement.nodes import EVERYTHING, MAX_ABSENT_GONE
from kvstore.placement.results import HeldBlock
from kvstore.placement.state import NodeCommand
from kvstore.policy import ActionKind
from tests.unit.placement import DRAM, KB, SSD, put, table


def _blocks(*keys: str) -> list[HeldBlock]:
    return [HeldBlock(k, DRAM, i * KB, KB, 7) for i, k in enumerate(keys)]


def _dropped(commands: list[NodeCommand]) -> set[str]:
    return {k for c in commands if c.kind is ActionKind.DROP for k in c.keys}


def test_a_key_removed_while_a_node_is_absent_is_dropped_at_its_registration() -> None:
    t = table("a", dram=8 * KB)
    put(t, "k", "kept")
    t.take_gone_changes()  # a's registration: nothing to keep
    t.note_absent("b", set())
    assert t.absent == ["b"] and t.stats()["nodes_absent"] == 1
    assert t.take_gone_changes() == {"b": set()}  # kept (in etcd) even with nothing to drop yet
    removed, _ = t.remove(["k", "unknown"])  # "unknown": a key only the absent node may hold
    assert removed == 1
    assert t.take_gone_changes() == {"b": {(k, tier, -1) for k in ("k", "unknown") for tier in (DRAM, SSD)}}
    commands = t.register_node("b", "b:1", 8 * KB, 0, 64, _blocks("k", "unknown", "kept", "other"), now_ms=0)
    assert _dropped(commands) == {"k", "unknown"}
    assert t.absent == []
    assert t.take_gone_changes()["b"]  # owed until its first heartbeat says it took the answer
    assert t.heartbeat("b", 1)
    assert t.take_gone_changes() == {"b": None}
    assert t.exists(["k", "unknown", "kept", "other"]) == [False, False, True, True]
    t.check()


def test_an_absent_node_through_too_many_removes_drops_everything() -> None:
    t = table("a", dram=8 * KB)
    t.take_gone_changes()
    t.note_absent("b", set())
    t.remove([f"r{i}" for i in range(MAX_ABSENT_GONE // 2 + 1)])
    assert t.take_gone_changes() == {"b": {EVERYTHING}}
    t.remove(["more"])  # nothing more to note
    assert t.take_gone_changes() == {}
    commands = t.register_node("b", "b:1", 8 * KB, 8 * KB, 64, [*_blocks("x", "y"), HeldBlock("z", SSD, -1, KB, 7)], 0)
    assert _dropped(commands) == {"x", "y", "z"}
    assert t.heartbeat("b", 1)
    assert t.exists(["x", "y", "z"]) == [False] * 3
    t.check()


def test_a_fenced_node_is_kept_with_nothing_to_drop_and_forgotten_once_back_or_gone() -> None:
    t = table("a", "b")
    assert t.take_gone_changes() == {"a": None, "b": None}
    t._membership.fence("b")
    assert t.take_gone_changes() == {"b": set()}  # a new leader learns it absent from this
    t.register_node("b", "b:1", 4 * KB, 0, 64, [], now_ms=0)
    assert t.heartbeat("b", 1)
    assert t.take_gone_changes() == {"b": None}
    t.note_absent("c", set())
    t.leave_node("c")
    assert t.absent == [] and t.take_gone_changes() == {"c": None}
    t.note_absent("a", {("k", DRAM, -1)})  # registered in this table: its own registration's rules hold
    assert t.absent == []
