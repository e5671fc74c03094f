"""Copies between nodes in the placement table: replicate (extra replicas where readers are) and
drain (a node's blocks moved off it), their commands, answers and the races around them."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument, NotFound, RetryLater
from kvstore.placement.table import PlacementTable
from kvstore.policy import ActionKind, EvictionPolicy
from kvstore.results import HeldBlock, NodePrefix, PrefixMatch
from tests.unit.placement import DRAM, EXACT, KB, SSD, copy, located, placed, put, run, table


def test_replicate_copies_blocks_in_order_and_keeps_their_sources() -> None:
    t = table("a", "b", dram=8 * KB)
    put(t, "k0", "k1", "k2", node="a")
    t.writes.put_start(["w"], [KB], 1, "a", False, 0)  # being written: not copied
    moves = t.moves.plan_replicas(["k0", "missing", "w", "k1", "k2"], "b", 10 * KB)
    assert [(m.key, m.source, m.target, m.tier, m.size) for m in moves] == [
        ("k0", "a", "b", DRAM, KB), ("k1", "a", "b", DRAM, KB), ("k2", "a", "b", DRAM, KB)
    ]  # fmt: skip
    assert t.nodes["b"].alloc.used == 3 * KB
    # In flight: reserved on b, not readable there, not in its LRU; the source serves as before.
    [loc] = located(t.reads.get_replicas(["k0"], 0), ["k0"])
    assert loc is not None and [r.node_id for r in loc.replicas] == ["a"]
    assert len(t.nodes["b"].dram_lru) == 0 and t.reads.match_prefix_nodes(["k0"]).nodes.keys() == {"a"}
    described = t.inspection.describe("k0")
    assert described is not None
    assert [(r["node_id"], r["moving"]) for r in described["replicas"]] == [("a", False), ("b", True)]  # type: ignore[attr-defined]
    assert t.moves.plan_replicas(["k0"], "b", 10 * KB) == []  # a copy is coming already
    t.check()
    copied, drops = t.moves.finish_replicas(moves, [True, True, True])
    assert copied == moves and drops == []
    t.check()
    assert list(t.nodes["b"].dram_lru) == ["k0", "k1", "k2"]
    [loc] = located(t.reads.get_replicas(["k1"], 0), ["k1"])
    assert loc is not None and sorted(r.node_id for r in loc.replicas) == ["a", "b"]
    assert t.reads.match_prefix_nodes(["k0", "k1", "k2"]) == PrefixMatch(
        3, {"a": NodePrefix(3, 3), "b": NodePrefix(3, 3)}
    )
    assert t.moves.plan_replicas(["k0", "k1", "k2"], "b", 10 * KB) == []  # already there
    assert t.moves.plan_replicas(["k0"], "a", 10 * KB) == []


def test_replicate_copies_from_dram_first_and_ssd_blocks_too() -> None:
    t = placed({"a": [("k0", "ssd"), ("k1", "ssd")], "b": [("k1", "dram")], "c": []})
    moves = copy(t, ["k0", "k1"], "c")
    assert [(m.key, m.source, m.tier) for m in moves] == [("k0", "a", SSD), ("k1", "b", DRAM)]
    assert t.reads.match_prefix_nodes(["k0", "k1"]).nodes["c"] == NodePrefix(2, 2)


def test_replicate_stops_at_the_budget_and_at_the_first_block_without_room() -> None:
    t = PlacementTable(EXACT)
    t.membership.register_node("a", "a:1", 8 * KB, 0, 64, [], 0)
    t.membership.register_node("b", "b:1", 4 * KB, 0, 64, [], 0)
    put(t, "x0", "x1", node="b")
    put(t, "k0", "k1", "k2", node="a")
    put(t, "big", size=3 * KB, node="a")
    assert t.moves.plan_replicas(["k0", "k1"], "b", 0) == []
    assert [m.key for m in t.moves.plan_replicas(["k0", "k1"], "b", 3 * KB // 2)] == ["k0"]  # k1 would pass 1.5 KiB
    # 1 KiB left on b: "big" does not fit, and nothing after it is tried; b evicts nothing for it.
    assert [m.key for m in t.moves.plan_replicas(["big", "k1", "k2"], "b", 1 << 30)] == []
    assert [m.key for m in t.moves.plan_replicas(["k1", "k2"], "b", 1 << 30)] == ["k1"]
    assert t.reads.exists(["x0", "x1"]) == [True, True] and t.nodes["b"].inflight == 0
    t.check()


def test_replicate_respects_the_high_watermark_and_the_arenas_slots() -> None:
    t = PlacementTable(EvictionPolicy(0.5, 0.25))
    t.membership.register_node("a", "a:1", 8 * KB, 0, 64, [], 0)
    t.membership.register_node("b", "b:1", 8 * KB, 0, 64, [], 0, max_blocks=3)
    put(t, "k0", "k1", "k2", "k3", "k4", node="a")
    assert [m.key for m in t.moves.plan_replicas(["k0", "k1", "k2", "k3", "k4"], "b", 1 << 30)] == ["k0", "k1", "k2"]
    t = PlacementTable(EvictionPolicy(0.5, 0.25))
    t.membership.register_node("a", "a:1", 8 * KB, 0, 64, [], 0)
    t.membership.register_node("b", "b:1", 8 * KB, 0, 64, [], 0)
    put(t, "k0", "k1", "k2", "k3", "k4", "k5", node="a")
    assert len(t.moves.plan_replicas(["k0", "k1", "k2", "k3", "k4", "k5"], "b", 1 << 30)) == 4  # 4 KiB = 50%


def test_replicate_refuses_unknown_nodes_and_bad_budgets_and_skips_unusable_targets() -> None:
    t = table("a", "b", node_ttl_ms=1000)
    put(t, "k", node="a")
    with pytest.raises(NotFound, match="'ghost'"):
        t.moves.plan_replicas(["k"], "ghost", KB)
    with pytest.raises(InvalidArgument, match="max_bytes"):
        t.moves.plan_replicas(["k"], "b", -1)
    with pytest.raises(InvalidArgument):
        t.moves.plan_replicas([""], "b", KB)
    t.moves.start_drain("b")
    assert t.moves.plan_replicas(["k"], "b", KB) == []
    t.moves.stop_drain("b")
    t.membership.heartbeat("a", 1500)
    t.expire(1500)  # b is down
    assert t.moves.plan_replicas(["k"], "b", KB) == []


def test_each_replica_of_a_block_is_evicted_alone_and_remove_drops_them_all() -> None:
    t = PlacementTable(EXACT)
    t.membership.register_node("a", "a:1", 4 * KB, 4 * KB, 64, [], 0)
    t.membership.register_node("b", "b:1", 4 * KB, 0, 64, [], 0)
    put(t, "k0", "k1", node="a")
    copy(t, ["k0", "k1"], "b")
    _, commands = t.moves.evict_tier("a", DRAM)  # a demotes its replicas; b's stay readable meanwhile
    assert [(c.node_id, c.kind, c.keys) for c in commands] == [("a", ActionKind.DEMOTE, ("k0", "k1"))]
    [loc] = located(t.reads.get_replicas(["k0"], 0), ["k0"])
    assert loc is not None and [(r.node_id, r.tier) for r in loc.replicas] == [("b", "dram")]
    run(t, commands)
    t.expire(10_000)  # leases over
    assert t.reads.match_prefix_nodes(["k0", "k1"]) == PrefixMatch(2, {"a": NodePrefix(0, 2), "b": NodePrefix(2, 2)})
    # b is full: a put there drops its LRU block (no SSD; k0 was read since); a's SSD copy still serves it.
    plan = t.writes.put_start(["x0", "x1", "x2"], [KB] * 3, 1, "b", False, 10_000)
    assert [(c.node_id, c.kind, c.keys) for c in plan.commands] == [("b", ActionKind.DROP, ("k1",))]
    run(t, plan.commands)
    [loc] = located(t.reads.get_replicas(["k1"], 10_000), ["k1"])
    assert loc is not None and [(r.node_id, r.tier) for r in loc.replicas] == [("a", "ssd")]
    described = t.inspection.describe("k0")
    assert described is not None
    assert sorted((r["node_id"], r["tier"]) for r in described["replicas"]) == [("a", "ssd"), ("b", "dram")]  # type: ignore[attr-defined]
    removed, commands = t.remove(["k0"])
    assert removed == 1 and sorted(c.node_id for c in commands) == ["a", "b"] and all(c.release for c in commands)
    assert t.reads.exists(["k0", "k1"]) == [False, True]
    run(t, commands)
    assert t.inspection.describe("k0") is None and t.nodes["a"].ssd_used == KB


def test_a_replicated_pinned_block_is_pinned_on_its_new_node() -> None:
    t = table("a", "b")
    t.writes.put_start(["p"], [KB], 1, "a", True, 0)
    t.writes.put_end(["p"], [1])
    copy(t, ["p"], "b")
    assert t.nodes["b"].dram_lru.is_pinned("p")


def test_a_failed_copy_frees_its_extent_and_an_unanswered_one_is_dropped_first() -> None:
    t = table("a", "b")
    put(t, "k0", "k1", node="a")
    copy(t, ["k0"], "b", ok=False)
    assert t.nodes["b"].alloc.used == 0 and located(t.reads.get_replicas(["k0"], 0), ["k0"])[0] is not None
    moves = t.moves.plan_replicas(["k0", "k1"], "b", 1 << 30)
    copied, [drop] = t.moves.finish_replicas(moves, [False, False], answered=False)  # b may hold them: drop first
    assert copied == [] and (drop.node_id, drop.keys, drop.release) == ("b", ("k0", "k1"), True)
    assert t.nodes["b"].alloc.used == 2 * KB and t.moves.plan_replicas(["k0"], "b", KB) == []
    # b's replicas, never confirmed and being dropped, serve nothing meanwhile: not a prefix, not a
    # block a's eviction can count on.
    assert t.reads.match_prefix_nodes(["k0", "k1"]).nodes.keys() == {"a"}
    _, evictions = t.moves.evict_tier("a", DRAM)
    assert (
        t.reads.exists(["k0", "k1"]) == [True, False] and t.reads.match_prefix(["k1"]) == 0
    )  # k0: leased by the get above
    t.check()
    run(t, evictions)
    run(t, [drop])
    assert t.nodes["b"].alloc.used == 0 and t.reads.match_prefix_nodes(["k0", "k1"]).nodes == {"a": NodePrefix(1, 1)}
    with pytest.raises(InvalidArgument, match="1 results for 2 copies"):
        t.moves.finish_replicas(moves, [True])


@pytest.mark.parametrize("ok", [True, False])
def test_a_block_removed_during_its_copy_gains_no_replica(ok: bool) -> None:
    t = table("a", "b")
    put(t, "k0", node="a")
    moves = t.moves.plan_replicas(["k0"], "b", KB)
    _, [drop] = t.remove(["k0"])
    assert drop.node_id == "a"  # b is told nothing while it may still be copying
    run(t, [drop])
    assert t.inspection.describe("k0") is not None  # the copy holds the key until answered: not re-put meanwhile
    busy = t.writes.put_start(["k0"], [KB], 1, None, False, 0).tickets[0]
    assert busy is not None and busy.error_code == RetryLater.code
    copied, commands = t.moves.finish_replicas(moves, [ok])
    assert copied == []
    if ok:  # b holds the bytes: its extent is freed once b drops them
        assert [(c.node_id, c.keys) for c in commands] == [("b", ("k0",))]
        assert t.nodes["b"].alloc.used == KB
        run(t, commands)
    else:
        assert commands == []
    assert t.inspection.describe("k0") is None and t.nodes["b"].alloc.used == 0 and t.reads.exists(["k0"]) == [False]
    t.check()


def test_a_copy_to_a_node_that_re_registered_is_left_to_its_inventory() -> None:
    t = table("a", "b")
    put(t, "k0", "k1", node="a")
    moves = t.moves.plan_replicas(["k0", "k1"], "b", 1 << 30)
    t.membership.register_node("b", "b:1", 4 * KB, 0, 64, [HeldBlock("k0", DRAM, 2048, KB, 7)], 0)  # k0 arrived
    assert t.moves.finish_replicas(moves, [True, True]) == ([], [])
    t.check()
    assert t.reads.match_prefix_nodes(["k0", "k1"]).nodes == {"a": NodePrefix(2, 2), "b": NodePrefix(1, 1)}


def test_a_drain_does_not_copy_where_a_replica_is_coming() -> None:
    t = table("a", "b", "c", dram=8 * KB)
    put(t, "k0", node="a")
    put(t, "x", size=2 * KB, node="c")
    moves = t.moves.plan_replicas(["k0"], "b", KB)  # b stays the roomiest node
    t.moves.start_drain("a")
    drain, drops = t.moves.plan_moves("a", 10)
    assert drops == [] and [(m.key, m.source, m.target) for m in drain] == [("k0", "a", "c")]
    assert t.moves.finish_replicas(moves, [True])[0] == moves
    drops = t.moves.finish_moves("a", drain, [True])
    # Copied: a's replica is on its way out, and no longer counts for a's prefix.
    assert t.reads.match_prefix_nodes(["k0"]).nodes.keys() == {"b", "c"}
    run(t, drops)
    [loc] = located(t.reads.get_replicas(["k0"], 0), ["k0"])
    assert loc is not None and sorted(r.node_id for r in loc.replicas) == ["b", "c"]


def test_a_drain_copies_a_block_whose_other_replica_is_on_a_down_node() -> None:
    t = table("a", "b", "c", dram=8 * KB, node_ttl_ms=1000)
    put(t, "k0", node="a", replicas=2)
    [down] = [r.node_id for r in t.objects["k0"].replicas if r.node_id != "a"]
    [up] = {"b", "c"} - {down}
    t.membership.heartbeat("a", 1500)
    t.membership.heartbeat(up, 1500)
    t.expire(1500)
    assert not t.nodes[down].up
    t.moves.start_drain("a")
    drain, drops = t.moves.plan_moves("a", 10)
    # Not dropped on the strength of a copy nobody can read: copied to the node that is up.
    assert drops == [] and [(m.key, m.target) for m in drain] == [("k0", up)]
    assert t.reads.exists(["k0"]) == [True] and t.reads.match_prefix(["k0"]) == 1


def test_drain_and_replicate_copies_carry_the_blocks_pin() -> None:
    for drain in (True, False):
        t = table("a", "b")
        put(t, "p", node="a")
        t.writes.put_start(["q"], [KB], 1, "a", True, 0)
        assert t.writes.put_end(["q"], [7]) == [True]
        if drain:
            t.moves.start_drain("a")
            moves, _ = t.moves.plan_moves("a", 10)
        else:
            moves = t.moves.plan_replicas(["p", "q"], "b", 10 * KB)
        assert {m.key: m.pinned for m in moves} == {"p": False, "q": True}


def test_a_drain_copy_of_a_key_removed_meanwhile_keeps_its_extent_until_the_target_drops_it() -> None:
    t = table("a", "b")
    put(t, "k", node="a")
    t.moves.start_drain("a")
    [move], _ = t.moves.plan_moves("a", 10)
    _, removal = t.remove(["k"])  # while the target copies it
    drops = t.moves.finish_moves("a", [move], [True])  # the target committed the copy
    [to_b] = [c for c in drops if c.node_id == "b"]
    assert (to_b.kind, to_b.keys, to_b.offsets) == (ActionKind.DROP, ("k",), (move.extent.offset,))
    assert t.nodes["b"].alloc.used == KB  # the target holds the block there until it drops it
    t.moves.stop_drain("a")
    [ticket] = put(t, "x", node="b")
    assert ticket is not None and ticket.replicas[0].offset != move.extent.offset
    run(t, removal + drops)
    assert t.inspection.describe("k") is None and t.nodes["b"].alloc.used == KB  # only x's


def test_an_unanswered_drain_copy_is_dropped_before_its_extent_is_reused() -> None:
    t = table("a", "b")
    put(t, "k", node="a")
    t.moves.start_drain("a")
    [move], _ = t.moves.plan_moves("a", 10)
    [drop] = t.moves.finish_moves("a", [move], [False], answered=False)  # the target never answered
    assert (drop.node_id, drop.keys, drop.offsets) == ("b", ("k",), (move.extent.offset,))
    t.check()
    assert t.nodes["b"].alloc.used == KB
    [loc] = located(t.reads.get_replicas(["k"], 0), ["k"])
    assert loc is not None and [r.node_id for r in loc.replicas] == ["a"]  # still served from the source
    run(t, [drop], ok=False)  # the target had nothing there (and will refuse the copy if it comes)
    assert t.nodes["b"].alloc.used == 0 and t.inspection.describe("k")["replicas"][0]["node_id"] == "a"  # type: ignore[index]


def test_an_answered_failed_drain_copy_frees_its_extent_and_the_block_stays() -> None:
    t = table("a", "b")
    put(t, "k", node="a")
    t.moves.start_drain("a")
    [move], _ = t.moves.plan_moves("a", 10)
    assert t.moves.finish_moves("a", [move], [False]) == []
    t.check()
    assert t.nodes["b"].alloc.used == 0 and located(t.reads.get_replicas(["k"], 0), ["k"])[0] is not None
