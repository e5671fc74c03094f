from __future__ import annotations

import pytest

from kvstore.errors import CapacityError, GrantExpired, InvalidArgument, NoNodes, NotFound, RetryLater
from kvstore.placement.results import PUT_EXISTS, PUT_STORED, HeldBlock, NodePrefix, PrefixMatch
from kvstore.placement.state import Move
from kvstore.placement.table import PlacementTable
from kvstore.policy import ActionKind, EvictionPolicy, TierName
from tests.unit.placement import DRAM, EXACT, KB, SSD, got, leased, located, put, run, table


def test_put_commit_and_get() -> None:
    t = table("a", "b")
    [ticket] = put(t, "k1", node="b")
    assert ticket is not None and ticket.status == "ok"
    assert [(r.node_id, r.tier, r.offset) for r in ticket.replicas] == [("b", DRAM, 0)]
    [loc] = located(t.get_replicas(["k1"], 1), ["k1"])
    assert loc is not None and loc.size == KB and loc.checksum == 7 and loc.replicas[0].address == "b:1"
    assert located(t.get_replicas(["nope"], 1), ["nope"]) == [None]
    assert t.exists(["k1", "nope"]) == [True, False]


def test_keys_are_invisible_until_committed_and_a_second_put_reports_exists() -> None:
    t = table("a")
    plan = t.put_start(["k"], [KB], 1, None, False, 0)
    assert plan.tickets[0] is not None and plan.tickets[0].status == "ok"
    assert t.exists(["k"]) == [False] and t.match_prefix(["k"]) == 0
    again = t.put_start(["k"], [KB], 1, None, False, 0)
    assert again.tickets[0] is not None and again.tickets[0].status == "exists"
    t.put_end(["k"], [1])
    assert t.exists(["k"]) == [True] and t.match_prefix(["k", "x"]) == 1
    assert t.put_end(["k"], [1]) == [False]  # already committed: nothing pending
    t.check()


def test_replicas_land_on_distinct_nodes() -> None:
    t = table("a", "b", "c")
    [ticket] = put(t, "k", replicas=2)
    assert ticket is not None
    assert len({r.node_id for r in ticket.replicas}) == 2
    [loc] = located(t.get_replicas(["k"], 0), ["k"])
    assert loc is not None and len(loc.replicas) == 2


def test_expired_reservation_is_dropped_then_writable_again() -> None:
    t = table("a", reservation_ms=100)
    t.put_start(["k"], [KB], 1, None, False, now_ms=0)
    assert t.expire(50) == []
    [cmd] = t.expire(150)
    assert (cmd.node_id, cmd.kind, cmd.keys, cmd.release) == ("a", ActionKind.DROP, ("k",), True)
    # Until the daemon confirms, the extent is not reused and the key is busy.
    busy = t.put_start(["k"], [KB], 1, None, False, 150).tickets[0]
    assert busy is not None and busy.error_code == RetryLater.code
    assert t.put_end(["k"], [1]) == [False]
    run(t, [cmd])
    assert t.nodes["a"].alloc.used == 0
    put(t, "k", now=200)
    assert t.exists(["k"]) == [True]


def test_revoke_releases_through_the_daemon() -> None:
    t = table("a")
    t.put_start(["k1", "k2"], [KB, KB], 1, None, False, 0)
    [cmd] = t.put_revoke(["k1", "unknown"])
    assert cmd.keys == ("k1",)
    run(t, [cmd], ok=False)  # nothing had been written: the extent is free all the same
    assert t.nodes["a"].alloc.used == KB


def test_an_early_release_does_not_end_a_later_readers_lease() -> None:
    # Reader A leases k at 0 and releases it at 100; reader B leases k at 500: B's lease holds to 1500,
    # not to A's expiry at 1000 (the release and the expiry of A's lease used to both count against B).
    t = table("a", dram=2 * KB, lease_ms=1000)
    put(t, "k", "other")
    t.release_leases(got(t.get_replicas(["k"], 0)))
    t.expire(100)
    t.get_replicas(["k"], 500)
    t.expire(1000)
    assert leased(t, "k") == [True]
    count, [cmd] = t.evict_tier("a", DRAM)
    assert count == 1 and cmd.keys == ("other",)
    t.expire(1499)
    assert t.evict_tier("a", DRAM) == (0, [])
    t.expire(1500)
    count, [cmd] = t.evict_tier("a", DRAM)
    assert count == 1 and cmd.keys == ("k",)


def test_a_release_ends_one_lease_of_every_replica_it_was_handed() -> None:
    t = table("a", "b", ssd=4 * KB, lease_ms=1000)
    put(t, "k", replicas=2)
    first = got(t.get_replicas(["k"], 0))
    second = got(t.get_replicas(["k"], 10))
    assert leased(t, "k") == [True, True]
    t.release_leases(first)
    assert leased(t, "k") == [True, True]  # the second reader's lease holds both replicas
    t.release_leases(first)  # again (a retry): ends nothing more
    assert leased(t, "k") == [True, True]
    t.release_leases(second)
    assert leased(t, "k") == [False, False]
    assert t.tier_usage(t.nodes["a"])["dram"]["leased"] == 0


def test_a_late_release_ends_no_other_readers_lease() -> None:
    # A's lease expires before its release arrives; the release must not end B's lease instead.
    t = table("a", dram=2 * KB, lease_ms=1000)
    put(t, "k")
    a = got(t.get_replicas(["k"], 0))
    t.expire(1000)
    b = got(t.get_replicas(["k"], 1100))
    t.release_leases(a)  # A's, late: its lease is gone, and B's is not A's to end
    assert t.evict_tier("a", DRAM) == (0, [])
    t.release_leases(b)  # B's
    count, _ = t.evict_tier("a", DRAM)
    assert count == 1


def test_down_nodes_serve_nothing_until_they_heartbeat() -> None:
    t = table("a", "b", node_ttl_ms=1000)
    put(t, "k", node="a")
    assert t.heartbeat("b", 900)
    t.expire(1500)
    assert [n.node_id for n in t.up_nodes()] == ["b"]
    assert located(t.get_replicas(["k"], 1500), ["k"]) == [None] and t.match_prefix(["k"]) == 0
    [ticket] = put(t, "k2", node="a", now=1500)
    assert ticket is not None and ticket.replicas[0].node_id == "b"
    assert t.heartbeat("a", 1600)
    assert t.match_prefix(["k", "k2"]) == 2
    assert not t.heartbeat("ghost", 1600)


def test_puts_refused_for_room_held_by_pins_or_leases_are_counted() -> None:
    # For the alerts an operator wants (docker/prometheus/alerts.yml): room refused for pins pages.
    t = table("a", dram=2 * KB)
    t.put_start(["p0", "p1"], [KB, KB], 1, None, True, 0)
    t.put_end(["p0", "p1"], [1, 1])
    [tk] = t.put_start(["k"], [KB], 1, None, False, 0).tickets
    assert tk is not None and tk.error_code == CapacityError.code and "pinned" in tk.error
    assert (t.counters["room_refused_pinned"], t.counters["room_refused_leased"]) == (1, 0)
    assert t.grant_space(KB, None, 1000, 0).error is not None
    assert t.counters["room_refused_pinned"] == 2
    t = table("a", dram=KB)
    put(t, "x")
    t.get_replicas(["x"], 0)  # leased: not evicted for the next put
    [tk] = t.put_start(["k"], [KB], 1, None, False, 0).tickets
    assert tk is not None and tk.error_code == RetryLater.code
    assert (t.counters["room_refused_pinned"], t.counters["room_refused_leased"]) == (0, 1)


def test_no_nodes_and_oversize_blocks_are_ticket_errors() -> None:
    t = PlacementTable(EXACT)
    [tk] = t.put_start(["k"], [KB], 1, None, False, 0).tickets
    assert tk is not None and tk.error_code == NoNodes.code
    t = table("a", dram=4 * KB)
    [tk] = t.put_start(["k"], [8 * KB], 1, None, False, 0).tickets
    assert tk is not None and tk.error_code == CapacityError.code and "larger" in tk.error


@pytest.mark.parametrize(
    ("keys", "sizes", "replicas", "match"),
    [(["k"], [0], 1, "positive"), (["k"], [1, 2], 1, "2 sizes"), ([""], [1], 1, "empty"), (["k"], [1], 0, "replicas")],
)
def test_bad_put_start_arguments(keys: list[str], sizes: list[int], replicas: int, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        table("a").put_start(keys, sizes, replicas, None, False, 0)


def test_a_new_table_rebuilds_from_inventories() -> None:
    t = table("a", "b", dram=8 * KB, ssd=8 * KB)
    put(t, "k0", "k1", node="a")
    put(t, "k2", node="b")
    inventory = {
        "a": [HeldBlock("k0", DRAM, 0, KB, 7), HeldBlock("k1", SSD, -1, KB, 7)],
        "b": [HeldBlock("k2", DRAM, 0, KB, 7)],
    }
    fresh = PlacementTable(EXACT)
    for n, items in inventory.items():
        assert fresh.register_node(n, f"{n}:1", 8 * KB, 8 * KB, 64, items, 0) == []
    assert fresh.match_prefix(["k0", "k1", "k2"]) == 3
    [loc] = located(fresh.get_replicas(["k1"], 0), ["k1"])
    assert loc is not None and loc.replicas[0].tier == "ssd"
    fresh.check()


def test_registration_drops_what_it_cannot_adopt() -> None:
    t = table("a", dram=8 * KB)
    put(t, "k", node="a")
    items = [
        HeldBlock("k", DRAM, 0, KB, 999),  # same key, other bytes than node a's copy
        HeldBlock("x", DRAM, 1024, 2 * KB, 1),
        HeldBlock("y", DRAM, 2048, KB, 1),  # overlaps x
        HeldBlock("z", DRAM, 3000, KB, 1),  # misaligned
    ]
    [cmd] = t.register_node("b", "b:1", 8 * KB, 0, 64, items, 0)
    assert set(cmd.keys) == {"k", "y", "z"} and cmd.release
    assert t.exists(["x", "y"]) == [True, False]
    t.check()


def test_reregistration_replaces_the_nodes_state() -> None:
    t = table("a", "b")
    put(t, "k0", "k1", node="a")
    pending = t.put_start(["p"], [KB], 2, None, False, 0)
    assert pending.tickets[0] is not None and len(pending.tickets[0].replicas) == 2
    commands = t.register_node("a", "a:2", 4 * KB, 0, 64, [HeldBlock("k1", DRAM, 2048, KB, 7)], 0)
    assert t.exists(["k0", "k1"]) == [False, True]
    # The pending put lost its replica on a: its other replica is revoked through b.
    assert [(c.node_id, c.keys) for c in commands] == [("b", ("p",))]
    run(t, commands)
    [loc] = located(t.get_replicas(["k1"], 0), ["k1"])
    assert loc is not None and loc.replicas[0].address == "a:2" and loc.replicas[0].offset == 2048


def test_a_removed_key_whose_drop_was_not_confirmed_stays_removed_when_its_node_registers_again() -> None:
    # Found by bench.chaos: a daemon killed while a remove's drop was on its way came back with the
    # block in its inventory, and the table adopted it: the removed value was read again.
    t = table("a", "b")
    put(t, "k0", "k1", node="a")
    removed, [drop] = t.remove(["k0"])  # the drop never reaches a: it is down
    assert removed == 1 and drop.node_id == "a" and drop.keys == ("k0",)
    inventory = [HeldBlock("k0", DRAM, 0, KB, 7), HeldBlock("k1", DRAM, KB, KB, 7)]
    commands = t.register_node("a", "a:2", 4 * KB, 0, 64, inventory, 0)
    assert t.exists(["k0", "k1"]) == [False, True]
    assert [(c.node_id, c.kind, c.keys) for c in commands] == [("a", ActionKind.DROP, ("k0",))]
    run(t, commands)
    put(t, "k0", node="a")  # its extent is free again once dropped, and the key may be put anew
    assert t.exists(["k0"]) == [True]
    t.check()


def test_a_removed_blocks_extent_is_not_handed_out_again_while_a_reader_holds_a_lease_on_it() -> None:
    # Found by bench.chaos: a same-host reader copies straight from the arena at the extent its get
    # named; a forced remove dropped the block under it, a put took the extent, and the reader got
    # another key's bytes.
    t = table("a", dram=4 * KB)
    [ticket] = put(t, "k")
    assert ticket is not None and ticket.replicas[0].offset == 0
    reading = t.get_replicas(["k"], 0)
    removed, commands = t.remove(["k"])
    run(t, commands)  # the daemon dropped it; the reader's lease is still live
    assert removed == 1 and t.exists(["k"]) == [False]
    [other] = put(t, "x")
    assert other is not None and other.replicas[0].offset != 0
    t.release_leases(got(reading))
    t.expire(1)
    [again] = put(t, "y")
    assert again is not None and again.replicas[0].offset == 0  # free once no lease covers it
    t.check()


def test_remove_hides_at_once_and_frees_after_the_daemon() -> None:
    t = table("a", dram=4 * KB, ssd=4 * KB)
    put(t, "k0", "k1")
    removed, [cmd] = t.remove(["k0", "k0", "missing"])
    assert removed == 1 and cmd.keys == ("k0",) and cmd.release  # a removal is not an eviction
    assert t.exists(["k0"]) == [False]
    busy = t.put_start(["k0"], [KB], 1, None, False, 0).tickets[0]
    assert busy is not None and busy.error_code == RetryLater.code
    run(t, [cmd])
    assert t.counters["evictions"] == 0
    put(t, "k0")


def test_placement_strategies() -> None:
    t = table("a", "b", "c", strategy="local_first")  # type: ignore[arg-type]
    for i in range(3):
        [tk] = put(t, f"k{i}", node="c")
        assert tk is not None and tk.replicas[0].node_id == "c"
    t = table("a", "b", strategy="free_ratio")  # type: ignore[arg-type]
    owners = [tk.replicas[0].node_id for i in range(4) for tk in put(t, f"k{i}") if tk is not None]
    assert sorted(owners) == ["a", "a", "b", "b"]
    t = table("a", "b", strategy="random")  # type: ignore[arg-type]
    put(t, "k")
    with pytest.raises(InvalidArgument, match="unknown placement strategy"):
        PlacementTable(strategy="nearest")


def test_stats() -> None:
    t = table("a", "b", dram=4 * KB, ssd=KB)
    put(t, "k")
    located(t.get_replicas(["k", "x"], 0), ["k", "x"])
    s = t.stats()
    assert (s["nodes"], s["objects"], s["hits"], s["misses"], s["dram_used"]) == (2, 1, 1, 1, KB)
    assert s["dram_capacity"] == 8 * KB and s["ssd_capacity"] == 2 * KB


def test_pins_come_back_with_the_inventory() -> None:
    fresh = PlacementTable(EXACT)
    items = [HeldBlock("p", DRAM, 0, KB, 1, pinned=True), HeldBlock("q", DRAM, KB, KB, 1)]
    fresh.register_node("a", "a:1", 2 * KB, 0, 64, items, 0)
    assert fresh.nodes["a"].dram_lru.is_pinned("p") and not fresh.nodes["a"].dram_lru.is_pinned("q")
    plan = fresh.put_start(["r"], [KB], 1, None, False, 0)
    assert [c.keys for c in plan.commands] == [("q",)]  # the pinned block is not a victim


# -- per-node prefix match ------------------------------------------------------------------------


def placed(layout: dict[str, list[tuple[str, str]]], dram: int = 8 * KB, ssd: int = 8 * KB) -> PlacementTable:
    """A table rebuilt from inventories: per node, (key, tier) in order, each block KB bytes."""
    t = PlacementTable(EXACT)
    for node, items in layout.items():
        inventory = [
            HeldBlock(k, TierName(tier), i * KB if tier == "dram" else -1, KB, 7) for i, (k, tier) in enumerate(items)
        ]
        assert t.register_node(node, f"{node}:1", dram, ssd, 64, inventory, 0) == []
    t.check()
    return t


def test_match_prefix_nodes_counts_each_nodes_leading_keys_by_tier() -> None:
    t = placed({
        "a": [("k0", "dram"), ("k1", "dram"), ("k2", "ssd"), ("k3", "dram")],
        "b": [("k0", "ssd"), ("k1", "dram")],
        "c": [("k1", "dram"), ("k2", "dram"), ("k3", "dram"), ("k4", "dram")],  # lacks k0: holds no prefix
    })  # fmt: skip
    keys = ["k0", "k1", "k2", "k3", "k4", "k5", "k0"]
    match = t.match_prefix_nodes(keys)
    assert match == PrefixMatch(5, {"a": NodePrefix(dram=2, total=4), "b": NodePrefix(dram=0, total=2)})
    assert match.longest == t.match_prefix(keys)  # the cluster's prefix spans nodes: longer than any node's
    assert t.match_prefix_nodes([]) == PrefixMatch(0, {})
    assert t.match_prefix_nodes(["k5", "k0"]) == PrefixMatch(0, {})
    assert t.match_prefix_nodes(["k1", "k2"]).nodes == {
        "a": NodePrefix(1, 2), "b": NodePrefix(1, 1), "c": NodePrefix(2, 2)
    }  # fmt: skip


def test_match_prefix_nodes_counts_only_readable_replicas() -> None:
    t = placed({"a": [("k0", "dram"), ("k1", "dram"), ("k2", "dram")], "b": [("k0", "dram"), ("k1", "ssd")]})
    t.node_ttl_ms = 1000
    keys = ["k0", "k1", "k2"]
    # Demotions in flight: a's replicas are read by key through its daemon, as a get reads them, so
    # they count; in a's DRAM count they do not (they are on their way out of it).
    _, commands = t.evict_tier("a", DRAM)
    assert t.match_prefix_nodes(keys) == PrefixMatch(3, {"a": NodePrefix(0, 3), "b": NodePrefix(1, 2)})
    assert t.match_prefix(keys) == 3 and t.exists(keys) == [True] * 3
    run(t, commands)
    assert t.match_prefix_nodes(keys) == PrefixMatch(3, {"a": NodePrefix(0, 3), "b": NodePrefix(1, 2)})
    moves = t.plan_replicas(["k2"], "b", 1 << 30)  # a copy on its way to b is not readable there yet
    assert len(moves) == 1 and t.match_prefix_nodes(keys).nodes["b"] == NodePrefix(1, 2)
    assert t.finish_replicas(moves, [False]) == ([], [])
    t.check()
    t.heartbeat("a", 1500)
    t.expire(1500)  # b is down
    assert t.match_prefix_nodes(keys) == PrefixMatch(3, {"a": NodePrefix(0, 3)})
    _, commands = t.remove(["k1"])
    assert t.match_prefix_nodes(keys) == PrefixMatch(1, {"a": NodePrefix(0, 1)})
    t.put_start(["k9"], [KB], 1, "a", False, 1500)  # written, not committed: not a prefix
    assert t.match_prefix_nodes(["k9"]) == PrefixMatch(0, {})


# -- replicating blocks to a node ---------------------------------------------------------------------


def copy(t: PlacementTable, keys: list[str], node: str, max_bytes: int = 1 << 30, ok: bool = True) -> list[Move]:
    """Plan copies and have the target make them (or fail them all)."""
    moves = t.plan_replicas(keys, node, max_bytes)
    t.check()
    copied, drops = t.finish_replicas(moves, [ok] * len(moves))
    assert drops == [] and copied == (moves if ok else [])
    t.check()
    return moves


def test_replicate_copies_blocks_in_order_and_keeps_their_sources() -> None:
    t = table("a", "b", dram=8 * KB)
    put(t, "k0", "k1", "k2", node="a")
    t.put_start(["w"], [KB], 1, "a", False, 0)  # being written: not copied
    moves = t.plan_replicas(["k0", "missing", "w", "k1", "k2"], "b", 10 * KB)
    assert [(m.key, m.source, m.target, m.tier, m.size) for m in moves] == [
        ("k0", "a", "b", DRAM, KB), ("k1", "a", "b", DRAM, KB), ("k2", "a", "b", DRAM, KB)
    ]  # fmt: skip
    assert t.nodes["b"].alloc.used == 3 * KB
    # In flight: reserved on b, not readable there, not in its LRU; the source serves as before.
    [loc] = located(t.get_replicas(["k0"], 0), ["k0"])
    assert loc is not None and [r.node_id for r in loc.replicas] == ["a"]
    assert len(t.nodes["b"].dram_lru) == 0 and t.match_prefix_nodes(["k0"]).nodes.keys() == {"a"}
    described = t.describe("k0")
    assert described is not None
    assert [(r["node_id"], r["moving"]) for r in described["replicas"]] == [("a", False), ("b", True)]  # type: ignore[attr-defined]
    assert t.plan_replicas(["k0"], "b", 10 * KB) == []  # a copy is coming already
    t.check()
    copied, drops = t.finish_replicas(moves, [True, True, True])
    assert copied == moves and drops == []
    t.check()
    assert list(t.nodes["b"].dram_lru) == ["k0", "k1", "k2"]
    [loc] = located(t.get_replicas(["k1"], 0), ["k1"])
    assert loc is not None and sorted(r.node_id for r in loc.replicas) == ["a", "b"]
    assert t.match_prefix_nodes(["k0", "k1", "k2"]) == PrefixMatch(3, {"a": NodePrefix(3, 3), "b": NodePrefix(3, 3)})
    assert t.plan_replicas(["k0", "k1", "k2"], "b", 10 * KB) == []  # already there
    assert t.plan_replicas(["k0"], "a", 10 * KB) == []


def test_replicate_copies_from_dram_first_and_ssd_blocks_too() -> None:
    t = placed({"a": [("k0", "ssd"), ("k1", "ssd")], "b": [("k1", "dram")], "c": []})
    moves = copy(t, ["k0", "k1"], "c")
    assert [(m.key, m.source, m.tier) for m in moves] == [("k0", "a", SSD), ("k1", "b", DRAM)]
    assert t.match_prefix_nodes(["k0", "k1"]).nodes["c"] == NodePrefix(2, 2)


def test_replicate_stops_at_the_budget_and_at_the_first_block_without_room() -> None:
    t = PlacementTable(EXACT)
    t.register_node("a", "a:1", 8 * KB, 0, 64, [], 0)
    t.register_node("b", "b:1", 4 * KB, 0, 64, [], 0)
    put(t, "x0", "x1", node="b")
    put(t, "k0", "k1", "k2", node="a")
    put(t, "big", size=3 * KB, node="a")
    assert t.plan_replicas(["k0", "k1"], "b", 0) == []
    assert [m.key for m in t.plan_replicas(["k0", "k1"], "b", 3 * KB // 2)] == ["k0"]  # k1 would pass 1.5 KiB
    # 1 KiB left on b: "big" does not fit, and nothing after it is tried; b evicts nothing for it.
    assert [m.key for m in t.plan_replicas(["big", "k1", "k2"], "b", 1 << 30)] == []
    assert [m.key for m in t.plan_replicas(["k1", "k2"], "b", 1 << 30)] == ["k1"]
    assert t.exists(["x0", "x1"]) == [True, True] and t.nodes["b"].inflight == 0
    t.check()


def test_replicate_respects_the_high_watermark_and_the_arenas_slots() -> None:
    t = PlacementTable(EvictionPolicy(0.5, 0.25))
    t.register_node("a", "a:1", 8 * KB, 0, 64, [], 0)
    t.register_node("b", "b:1", 8 * KB, 0, 64, [], 0, max_blocks=3)
    put(t, "k0", "k1", "k2", "k3", "k4", node="a")
    assert [m.key for m in t.plan_replicas(["k0", "k1", "k2", "k3", "k4"], "b", 1 << 30)] == ["k0", "k1", "k2"]
    t = PlacementTable(EvictionPolicy(0.5, 0.25))
    t.register_node("a", "a:1", 8 * KB, 0, 64, [], 0)
    t.register_node("b", "b:1", 8 * KB, 0, 64, [], 0)
    put(t, "k0", "k1", "k2", "k3", "k4", "k5", node="a")
    assert len(t.plan_replicas(["k0", "k1", "k2", "k3", "k4", "k5"], "b", 1 << 30)) == 4  # 4 KiB = 50%


def test_replicate_refuses_unknown_nodes_and_bad_budgets_and_skips_unusable_targets() -> None:
    t = table("a", "b", node_ttl_ms=1000)
    put(t, "k", node="a")
    with pytest.raises(NotFound, match="'ghost'"):
        t.plan_replicas(["k"], "ghost", KB)
    with pytest.raises(InvalidArgument, match="max_bytes"):
        t.plan_replicas(["k"], "b", -1)
    with pytest.raises(InvalidArgument):
        t.plan_replicas([""], "b", KB)
    t.start_drain("b")
    assert t.plan_replicas(["k"], "b", KB) == []
    t.stop_drain("b")
    t.heartbeat("a", 1500)
    t.expire(1500)  # b is down
    assert t.plan_replicas(["k"], "b", KB) == []


def test_each_replica_of_a_block_is_evicted_alone_and_remove_drops_them_all() -> None:
    t = PlacementTable(EXACT)
    t.register_node("a", "a:1", 4 * KB, 4 * KB, 64, [], 0)
    t.register_node("b", "b:1", 4 * KB, 0, 64, [], 0)
    put(t, "k0", "k1", node="a")
    copy(t, ["k0", "k1"], "b")
    _, commands = t.evict_tier("a", DRAM)  # a demotes its replicas; b's stay readable meanwhile
    assert [(c.node_id, c.kind, c.keys) for c in commands] == [("a", ActionKind.DEMOTE, ("k0", "k1"))]
    [loc] = located(t.get_replicas(["k0"], 0), ["k0"])
    assert loc is not None and [(r.node_id, r.tier) for r in loc.replicas] == [("b", "dram")]
    run(t, commands)
    t.expire(10_000)  # leases over
    assert t.match_prefix_nodes(["k0", "k1"]) == PrefixMatch(2, {"a": NodePrefix(0, 2), "b": NodePrefix(2, 2)})
    # b is full: a put there drops its LRU block (no SSD; k0 was read since); a's SSD copy still serves it.
    plan = t.put_start(["x0", "x1", "x2"], [KB] * 3, 1, "b", False, 10_000)
    assert [(c.node_id, c.kind, c.keys) for c in plan.commands] == [("b", ActionKind.DROP, ("k1",))]
    run(t, plan.commands)
    [loc] = located(t.get_replicas(["k1"], 10_000), ["k1"])
    assert loc is not None and [(r.node_id, r.tier) for r in loc.replicas] == [("a", "ssd")]
    described = t.describe("k0")
    assert described is not None
    assert sorted((r["node_id"], r["tier"]) for r in described["replicas"]) == [("a", "ssd"), ("b", "dram")]  # type: ignore[attr-defined]
    removed, commands = t.remove(["k0"])
    assert removed == 1 and sorted(c.node_id for c in commands) == ["a", "b"] and all(c.release for c in commands)
    assert t.exists(["k0", "k1"]) == [False, True]
    run(t, commands)
    assert t.describe("k0") is None and t.nodes["a"].ssd_used == KB


def test_a_replicated_pinned_block_is_pinned_on_its_new_node() -> None:
    t = table("a", "b")
    t.put_start(["p"], [KB], 1, "a", True, 0)
    t.put_end(["p"], [1])
    copy(t, ["p"], "b")
    assert t.nodes["b"].dram_lru.is_pinned("p")


def test_a_failed_copy_frees_its_extent_and_an_unanswered_one_is_dropped_first() -> None:
    t = table("a", "b")
    put(t, "k0", "k1", node="a")
    copy(t, ["k0"], "b", ok=False)
    assert t.nodes["b"].alloc.used == 0 and located(t.get_replicas(["k0"], 0), ["k0"])[0] is not None
    moves = t.plan_replicas(["k0", "k1"], "b", 1 << 30)
    copied, [drop] = t.finish_replicas(moves, [False, False], answered=False)  # b may hold them: drop first
    assert copied == [] and (drop.node_id, drop.keys, drop.release) == ("b", ("k0", "k1"), True)
    assert t.nodes["b"].alloc.used == 2 * KB and t.plan_replicas(["k0"], "b", KB) == []
    # b's replicas, never confirmed and being dropped, serve nothing meanwhile: not a prefix, not a
    # block a's eviction can count on.
    assert t.match_prefix_nodes(["k0", "k1"]).nodes.keys() == {"a"}
    _, evictions = t.evict_tier("a", DRAM)
    assert t.exists(["k0", "k1"]) == [True, False] and t.match_prefix(["k1"]) == 0  # k0: leased by the get above
    t.check()
    run(t, evictions)
    run(t, [drop])
    assert t.nodes["b"].alloc.used == 0 and t.match_prefix_nodes(["k0", "k1"]).nodes == {"a": NodePrefix(1, 1)}
    with pytest.raises(InvalidArgument, match="1 results for 2 copies"):
        t.finish_replicas(moves, [True])


@pytest.mark.parametrize("ok", [True, False])
def test_a_block_removed_during_its_copy_gains_no_replica(ok: bool) -> None:
    t = table("a", "b")
    put(t, "k0", node="a")
    moves = t.plan_replicas(["k0"], "b", KB)
    _, [drop] = t.remove(["k0"])
    assert drop.node_id == "a"  # b is told nothing while it may still be copying
    run(t, [drop])
    assert t.describe("k0") is not None  # the copy holds the key until answered: not re-put meanwhile
    busy = t.put_start(["k0"], [KB], 1, None, False, 0).tickets[0]
    assert busy is not None and busy.error_code == RetryLater.code
    copied, commands = t.finish_replicas(moves, [ok])
    assert copied == []
    if ok:  # b holds the bytes: its extent is freed once b drops them
        assert [(c.node_id, c.keys) for c in commands] == [("b", ("k0",))]
        assert t.nodes["b"].alloc.used == KB
        run(t, commands)
    else:
        assert commands == []
    assert t.describe("k0") is None and t.nodes["b"].alloc.used == 0 and t.exists(["k0"]) == [False]
    t.check()


def test_a_copy_to_a_node_that_re_registered_is_left_to_its_inventory() -> None:
    t = table("a", "b")
    put(t, "k0", "k1", node="a")
    moves = t.plan_replicas(["k0", "k1"], "b", 1 << 30)
    t.register_node("b", "b:1", 4 * KB, 0, 64, [HeldBlock("k0", DRAM, 2048, KB, 7)], 0)  # k0 arrived
    assert t.finish_replicas(moves, [True, True]) == ([], [])
    t.check()
    assert t.match_prefix_nodes(["k0", "k1"]).nodes == {"a": NodePrefix(2, 2), "b": NodePrefix(1, 1)}


def test_a_drain_does_not_copy_where_a_replica_is_coming() -> None:
    t = table("a", "b", "c", dram=8 * KB)
    put(t, "k0", node="a")
    put(t, "x", size=2 * KB, node="c")
    moves = t.plan_replicas(["k0"], "b", KB)  # b stays the roomiest node
    t.start_drain("a")
    drain, drops = t.plan_moves("a", 10)
    assert drops == [] and [(m.key, m.source, m.target) for m in drain] == [("k0", "a", "c")]
    assert t.finish_replicas(moves, [True])[0] == moves
    drops = t.finish_moves("a", drain, [True])
    # Copied: a's replica is on its way out, and no longer counts for a's prefix.
    assert t.match_prefix_nodes(["k0"]).nodes.keys() == {"b", "c"}
    run(t, drops)
    [loc] = located(t.get_replicas(["k0"], 0), ["k0"])
    assert loc is not None and sorted(r.node_id for r in loc.replicas) == ["b", "c"]


def test_a_drain_copies_a_block_whose_other_replica_is_on_a_down_node() -> None:
    t = table("a", "b", "c", dram=8 * KB, node_ttl_ms=1000)
    put(t, "k0", node="a", replicas=2)
    [down] = [r.node_id for r in t.objects["k0"].replicas if r.node_id != "a"]
    [up] = {"b", "c"} - {down}
    t.heartbeat("a", 1500)
    t.heartbeat(up, 1500)
    t.expire(1500)
    assert not t.nodes[down].up
    t.start_drain("a")
    drain, drops = t.plan_moves("a", 10)
    # Not dropped on the strength of a copy nobody can read: copied to the node that is up.
    assert drops == [] and [(m.key, m.target) for m in drain] == [("k0", up)]
    assert t.exists(["k0"]) == [True] and t.match_prefix(["k0"]) == 1


def test_grants_are_carved_committed_and_freed_without_handing_space_out_twice() -> None:
    table = PlacementTable(EvictionPolicy())
    table.register_node("n", "n:1", 1 << 20, 0, 64, [], 0)
    plan = table.grant_space(64 * 1024, None, 1000, 0)
    assert plan.grant is not None and plan.error is None
    grant = plan.grant
    base = grant.pieces[0].offset
    table.check()
    # A put elsewhere never lands inside the grant.
    other = table.put_start(["elsewhere"], [64 * 1024], 1, None, False, 0).tickets[0]
    assert other is not None and other.status == "ok"
    off = other.replicas[0].offset
    assert off + 64 * 1024 <= base or off >= base + 64 * 1024
    out = table.commit_granted("n", grant.grant_id, ["a", "b"], [base + 4096, base], [100, 4096], [1, 2], False)
    assert out == [(PUT_STORED, ""), (PUT_STORED, "")]
    table.check()
    # Idempotent for the same block; exists for a key stored elsewhere; refused for taken space.
    assert table.commit_granted("n", grant.grant_id, ["a"], [base + 4096], [100], [1], False) == [(PUT_STORED, "")]
    assert table.commit_granted("n", grant.grant_id, ["b"], [base + 8192], [10], [9], False)[0][0] == PUT_EXISTS
    code, _ = table.commit_granted("n", grant.grant_id, ["c"], [base + 4096], [64], [3], False)[0]
    assert code == InvalidArgument.code
    table.check()
    # The grant ends: its daemon answers, the rest goes back; the committed blocks stay.
    assert table.expired_grants(2000) == {"n": [grant.grant_id]}
    code, _ = table.commit_granted("n", grant.grant_id, ["d"], [base + 8192], [64], [3], False)[0]
    assert code == GrantExpired.code
    table.finish_end_grants("n", [grant.grant_id])
    table.check()
    assert table.nodes["n"].alloc.used == 64 * 1024 + 4096 + 128
    assert table.exists(["a", "b", "c", "d"]) == [True, True, False, False]


def test_a_read_holds_its_key_against_remove_and_eviction_for_hold_ms() -> None:
    # Mooncake's KV lease: a get, an exists or a daemon's access report holds the key for hold_ms;
    # the reader's own (short) lease release does not end it, a later read extends it.
    t = table("a", dram=2 * KB, lease_ms=100, hold_ms=1000)
    put(t, "k0", "k1")
    reply = t.get_replicas(["k0"], 0)
    t.release_leases(got(reply))  # the reader is done: its lease ends, the hold does not
    assert t.held(["k0", "k1", "nope"], 999) == [0] and t.held(["k0"], 1000) == []
    assert leased(t, "k0") == [True]
    plan = t.put_start(["k2"], [KB], 1, None, False, now_ms=10)
    assert [c.keys for c in plan.commands] == [("k1",)]  # k0 is held: k1 goes although it is newer
    run(t, plan.commands)
    put(t, "k2", now=10)
    assert t.exists(["k2"], now_ms=500) == [True] and t.held(["k2"], 1400) == [0]
    t.record_access("a", ["k0"], ["dram"], now_ms=900)  # a read the daemon served alone, reported at 900
    t.expire(1000)
    assert t.held(["k0"], 1899) == [0] and leased(t, "k0") == [True]
    t.expire(1900)
    assert t.held(["k0"], 1900) == [] and leased(t, "k0") == [False]
    t.check()


def test_a_forced_remove_ends_the_hold_and_no_hold_without_hold_ms() -> None:
    t = table("a", dram=2 * KB, hold_ms=1000)
    put(t, "k")
    t.exists(["k"], now_ms=1)
    removed, [drop] = t.remove(["k"])
    assert removed == 1 and len(t.leases) == 0
    run(t, [drop])
    plain = table("a", dram=2 * KB)
    put(plain, "k")
    plain.exists(["k"], now_ms=1)
    plain.release_leases(got(plain.get_replicas(["k"], 1)))
    assert plain.held(["k"], 2) == [] and len(plain.leases) == 0


def test_a_node_that_leaves_takes_its_blocks_and_revokes_its_puts() -> None:
    t = table("a", "b", dram=4 * KB)
    put(t, "only-a", node="a")
    put(t, "both", node="a", replicas=2)
    plan = t.put_start(["inflight"], [KB], 2, "a", False, 0)  # reserved on a and b, not committed
    assert plan.tickets[0] is not None and plan.tickets[0].status == "ok"
    [revoke] = t.leave_node("a")
    assert (revoke.node_id, revoke.kind, revoke.keys) == ("b", ActionKind.DROP, ("inflight",))
    assert "a" not in t.nodes and t.exists(["only-a", "both"]) == [False, True]
    run(t, [revoke])
    assert t.leave_node("a") == [] and t.put_end(["inflight"], [7]) == [False]


def test_drain_and_replicate_copies_carry_the_blocks_pin() -> None:
    for drain in (True, False):
        t = table("a", "b")
        put(t, "p", node="a")
        t.put_start(["q"], [KB], 1, "a", True, 0)
        assert t.put_end(["q"], [7]) == [True]
        if drain:
            t.start_drain("a")
            moves, _ = t.plan_moves("a", 10)
        else:
            moves = t.plan_replicas(["p", "q"], "b", 10 * KB)
        assert {m.key: m.pinned for m in moves} == {"p": False, "q": True}


@pytest.mark.parametrize("ssd_first", [False, True])
def test_a_key_reported_in_both_tiers_keeps_its_dram_copy_and_drops_the_other(ssd_first: bool) -> None:
    t = table("a", ssd=4 * KB)
    both = [HeldBlock("k", DRAM, 0, KB, 7), HeldBlock("k", SSD, -1, KB, 7)]
    [drop] = t.register_node("b", "b:1", 4 * KB, 4 * KB, 64, both[::-1] if ssd_first else both, 0)
    assert (drop.node_id, drop.kind, drop.tier, drop.keys, drop.tier_only) == ("b", ActionKind.DROP, SSD, ("k",), True)
    t.check()
    [loc] = located(t.get_replicas(["k"], 0), ["k"])
    assert loc is not None and [(r.node_id, r.tier, r.offset) for r in loc.replicas] == [("b", "dram", 0)]
    run(t, [drop])  # the SSD copy is gone: the DRAM one stays
    assert t.describe("k")["replicas"][0]["tier"] == "dram"  # type: ignore[index]


def test_of_a_key_in_both_tiers_the_copy_that_agrees_with_other_nodes_is_kept() -> None:
    t = table("a", ssd=4 * KB)
    put(t, "k")  # checksum 7 on node a
    both = [HeldBlock("k", DRAM, 0, KB, 9), HeldBlock("k", SSD, -1, KB, 7)]
    [drop] = t.register_node("b", "b:1", 4 * KB, 4 * KB, 64, both, 0)
    assert (drop.tier, drop.keys, drop.tier_only) == (DRAM, ("k",), True)
    t.check()
    run(t, [drop])
    assert sorted((r["node_id"], r["tier"]) for r in t.describe("k")["replicas"]) == [("a", "dram"), ("b", "ssd")]  # type: ignore[index]


def test_a_drain_copy_of_a_key_removed_meanwhile_keeps_its_extent_until_the_target_drops_it() -> None:
    t = table("a", "b")
    put(t, "k", node="a")
    t.start_drain("a")
    [move], _ = t.plan_moves("a", 10)
    _, removal = t.remove(["k"])  # while the target copies it
    drops = t.finish_moves("a", [move], [True])  # the target committed the copy
    [to_b] = [c for c in drops if c.node_id == "b"]
    assert (to_b.kind, to_b.keys, to_b.offsets) == (ActionKind.DROP, ("k",), (move.extent.offset,))
    assert t.nodes["b"].alloc.used == KB  # the target holds the block there until it drops it
    t.stop_drain("a")
    [ticket] = put(t, "x", node="b")
    assert ticket is not None and ticket.replicas[0].offset != move.extent.offset
    run(t, removal + drops)
    assert t.describe("k") is None and t.nodes["b"].alloc.used == KB  # only x's


def test_an_unanswered_drain_copy_is_dropped_before_its_extent_is_reused() -> None:
    t = table("a", "b")
    put(t, "k", node="a")
    t.start_drain("a")
    [move], _ = t.plan_moves("a", 10)
    [drop] = t.finish_moves("a", [move], [False], answered=False)  # the target never answered
    assert (drop.node_id, drop.keys, drop.offsets) == ("b", ("k",), (move.extent.offset,))
    t.check()
    assert t.nodes["b"].alloc.used == KB
    [loc] = located(t.get_replicas(["k"], 0), ["k"])
    assert loc is not None and [r.node_id for r in loc.replicas] == ["a"]  # still served from the source
    run(t, [drop], ok=False)  # the target had nothing there (and will refuse the copy if it comes)
    assert t.nodes["b"].alloc.used == 0 and t.describe("k")["replicas"][0]["node_id"] == "a"  # type: ignore[index]


def test_an_answered_failed_drain_copy_frees_its_extent_and_the_block_stays() -> None:
    t = table("a", "b")
    put(t, "k", node="a")
    t.start_drain("a")
    [move], _ = t.plan_moves("a", 10)
    assert t.finish_moves("a", [move], [False]) == []
    t.check()
    assert t.nodes["b"].alloc.used == 0 and located(t.get_replicas(["k"], 0), ["k"])[0] is not None
