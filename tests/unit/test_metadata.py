from __future__ import annotations

import pytest

from kvstore.errors import CapacityError, InvalidArgument, NoNodes, RetryLater
from kvstore.metadata import NodeCommand, PlacementTable
from kvstore.policy import ActionKind, EvictionPolicy, TierName
from kvstore.protocol import InventoryItem, PutTicket

KB = 1024
DRAM, SSD = TierName.DRAM, TierName.SSD
EXACT = EvictionPolicy(1.0, 1.0, promote_after_hits=2)


def table(*nodes: str, dram: int = 4 * KB, ssd: int = 0, policy: EvictionPolicy = EXACT, **kw: int) -> PlacementTable:
    t = PlacementTable(policy, **kw)  # type: ignore[arg-type]
    for n in nodes:
        assert t.register_node(n, f"{n}:1", dram, ssd, 64, [], now_ms=0) == []
    return t


def put(t: PlacementTable, *keys: str, size: int = KB, now: int = 0, **kw: object) -> list[PutTicket | None]:
    plan = t.put_start(list(keys), [size] * len(keys), int(kw.get("replicas", 1)), kw.get("node"), False, now)  # type: ignore[arg-type]
    assert plan.commands == [] and plan.waiting == [], plan
    ok = [k for k, tk in zip(keys, plan.tickets, strict=True) if tk is not None and tk.status == "ok"]
    assert t.put_end(ok, [7] * len(ok)) == [True] * len(ok)
    t.check()
    return plan.tickets


def run(t: PlacementTable, commands: list[NodeCommand], ok: bool = True) -> None:
    for c in commands:
        t.apply(c, [ok] * len(c.keys))
    t.check()


def test_put_commit_and_get() -> None:
    t = table("a", "b")
    [ticket] = put(t, "k1", node="b")
    assert ticket is not None and ticket.status == "ok"
    assert [(r.node_id, r.tier, r.offset) for r in ticket.replicas] == [("b", "dram", 0)]
    [loc] = t.get_replicas(["k1"], 1).located(["k1"])
    assert loc is not None and loc.size == KB and loc.checksum == 7 and loc.replicas[0].address == "b:1"
    assert t.get_replicas(["nope"], 1).located(["nope"]) == [None]
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
    [loc] = t.get_replicas(["k"], 0).located(["k"])
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


def test_full_node_evicts_in_lru_order_before_placing() -> None:
    t = table("a", dram=4 * KB, ssd=2 * KB)
    put(t, "k0", "k1", "k2", "k3")
    t.get_replicas(["k0"], 0).located(["k0"])
    t.release_leases(["k0"])
    plan = t.put_start(["k4"], [KB], 1, None, False, 0)
    assert plan.tickets == [None] and plan.waiting == [0]
    [cmd] = plan.commands
    assert (cmd.kind, cmd.tier, cmd.keys) == (ActionKind.DEMOTE, DRAM, ("k1",))
    assert t.get_replicas(["k1"], 0).located(["k1"]) == [None]  # moving: not handed out
    run(t, plan.commands)
    [loc] = t.get_replicas(["k1"], 0).located(["k1"])
    assert loc is not None and loc.replicas[0].tier == "ssd" and loc.replicas[0].offset == -1
    put(t, "k4")
    assert list(t.nodes["a"].dram_lru) == ["k2", "k3", "k0", "k4"]


def test_full_ssd_drops_its_lru_block_to_take_a_demotion() -> None:
    t = table("a", dram=2 * KB, ssd=KB)
    put(t, "k0", "k1")
    plan = t.put_start(["k2"], [KB], 1, None, False, 0)
    run(t, plan.commands)
    put(t, "k2")
    plan = t.put_start(["k3"], [KB], 1, None, False, 0)
    assert [(c.kind, c.tier, c.keys) for c in plan.commands] == [
        (ActionKind.DROP, SSD, ("k0",)),
        (ActionKind.DEMOTE, DRAM, ("k1",)),
    ]
    run(t, plan.commands)
    assert t.exists(["k0", "k1"]) == [False, True]
    assert t.counters["evictions"] == 1 and t.counters["demotions"] == 2


def test_failed_demotion_means_the_daemon_dropped_it() -> None:
    t = table("a", dram=KB, ssd=4 * KB)
    put(t, "k0")
    plan = t.put_start(["k1"], [KB], 1, None, False, 0)
    run(t, plan.commands, ok=False)
    assert t.exists(["k0"]) == [False] and t.nodes["a"].ssd_used == 0


def test_leased_and_pinned_blocks_are_not_evicted() -> None:
    t = table("a", dram=2 * KB)
    put(t, "k0", "k1")
    t.get_replicas(["k0"], 0).located(["k0"])  # leased for 5 s
    plan = t.put_start(["k2"], [KB], 1, None, False, now_ms=10)
    assert [c.keys for c in plan.commands] == [("k1",)]
    run(t, plan.commands)
    put(t, "k2", now=10)
    plan = t.put_start(["k3"], [KB], 1, None, False, now_ms=10)
    assert [c.keys for c in plan.commands] == [("k2",)]
    run(t, plan.commands)
    t.put_start(["p"], [KB], 1, None, True, 10)
    t.put_end(["p"], [1])
    t.expire(10_000)  # lease over
    plan = t.put_start(["k4"], [KB], 1, None, True, now_ms=10_000)
    assert [c.keys for c in plan.commands] == [("k0",)]
    run(t, plan.commands)
    t.put_start(["k4"], [KB], 1, None, True, now_ms=10_000)
    t.put_end(["k4"], [1])
    again = t.put_start(["k5"], [KB], 1, None, False, 10_000)
    assert again.tickets[0] is not None and again.tickets[0].error_code == CapacityError.code  # only pinned left


def test_down_nodes_serve_nothing_until_they_heartbeat() -> None:
    t = table("a", "b", node_ttl_ms=1000)
    put(t, "k", node="a")
    assert t.heartbeat("b", 900)
    t.expire(1500)
    assert [n.node_id for n in t.up_nodes()] == ["b"]
    assert t.get_replicas(["k"], 1500).located(["k"]) == [None] and t.match_prefix(["k"]) == 0
    [ticket] = put(t, "k2", node="a", now=1500)
    assert ticket is not None and ticket.replicas[0].node_id == "b"
    assert t.heartbeat("a", 1600)
    assert t.match_prefix(["k", "k2"]) == 2
    assert not t.heartbeat("ghost", 1600)


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
        "a": [InventoryItem("k0", "dram", 0, KB, 7), InventoryItem("k1", "ssd", -1, KB, 7)],
        "b": [InventoryItem("k2", "dram", 0, KB, 7)],
    }
    fresh = PlacementTable(EXACT)
    for n, items in inventory.items():
        assert fresh.register_node(n, f"{n}:1", 8 * KB, 8 * KB, 64, items, 0) == []
    assert fresh.match_prefix(["k0", "k1", "k2"]) == 3
    [loc] = fresh.get_replicas(["k1"], 0).located(["k1"])
    assert loc is not None and loc.replicas[0].tier == "ssd"
    fresh.check()


def test_registration_drops_what_it_cannot_adopt() -> None:
    t = table("a", dram=8 * KB)
    put(t, "k", node="a")
    items = [
        InventoryItem("k", "dram", 0, KB, 999),  # same key, other bytes than node a's copy
        InventoryItem("x", "dram", 1024, 2 * KB, 1),
        InventoryItem("y", "dram", 2048, KB, 1),  # overlaps x
        InventoryItem("z", "dram", 3000, KB, 1),  # misaligned
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
    commands = t.register_node("a", "a:2", 4 * KB, 0, 64, [InventoryItem("k1", "dram", 2048, KB, 7)], 0)
    assert t.exists(["k0", "k1"]) == [False, True]
    # The pending put lost its replica on a: its other replica is revoked through b.
    assert [(c.node_id, c.keys) for c in commands] == [("b", ("p",))]
    run(t, commands)
    [loc] = t.get_replicas(["k1"], 0).located(["k1"])
    assert loc is not None and loc.replicas[0].address == "a:2" and loc.replicas[0].offset == 2048


def test_ssd_block_is_promoted_after_hits_once_unleased() -> None:
    t = table("a", dram=4 * KB, ssd=4 * KB, policy=EvictionPolicy(0.9, 0.5, promote_after_hits=2))
    put(t, "k0", "k1", "k2")
    plan = t.put_start(["k3"], [KB], 1, None, False, 0)  # past 90%: evict down to 50%
    assert [(c.kind, c.keys) for c in plan.commands] == [(ActionKind.DEMOTE, ("k0", "k1"))]
    assert plan.tickets[0] is not None and plan.tickets[0].status == "ok"  # placed at once, eviction in background
    run(t, plan.commands)
    t.put_end(["k3"], [7])
    t.get_replicas(["k0"], 0).located(["k0"])
    assert t.release_leases(["k0"]) == []  # one hit
    t.get_replicas(["k0"], 0).located(["k0"])
    assert t.expire(1) == []  # second hit, but still leased by this read
    [cmd] = t.release_leases(["k0"])
    assert (cmd.kind, cmd.tier, cmd.keys) == (ActionKind.PROMOTE, SSD, ("k0",)) and cmd.offsets[0] >= 0
    assert t.get_replicas(["k0"], 0).located(["k0"]) == [None]  # moving while promoted
    t.check()
    run(t, [cmd])
    [loc] = t.get_replicas(["k0"], 0).located(["k0"])
    assert loc is not None and loc.replicas[0].tier == "dram" and loc.replicas[0].offset == cmd.offsets[0]
    assert t.counters["promotions"] == 1 and t.nodes["a"].ssd_used == KB


def test_failed_promotion_leaves_the_block_on_ssd() -> None:
    t = table("a", dram=4 * KB, ssd=4 * KB, policy=EvictionPolicy(0.9, 0.5, promote_after_hits=1))
    put(t, "k0", "k1", "k2")
    run(t, t.put_start(["k3"], [KB], 1, None, False, 0).commands)
    t.get_replicas(["k0"], 0).located(["k0"])
    [cmd] = t.release_leases(["k0"])
    run(t, [cmd], ok=False)
    [loc] = t.get_replicas(["k0"], 0).located(["k0"])
    assert loc is not None and loc.replicas[0].tier == "ssd"


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
    t.get_replicas(["k", "x"], 0).located(["k", "x"])
    s = t.stats()
    assert (s["nodes"], s["objects"], s["hits"], s["misses"], s["dram_used"]) == (2, 1, 1, 1, KB)
    assert s["dram_capacity"] == 8 * KB and s["ssd_capacity"] == 2 * KB


def test_pins_come_back_with_the_inventory() -> None:
    fresh = PlacementTable(EXACT)
    items = [InventoryItem("p", "dram", 0, KB, 1, pinned=True), InventoryItem("q", "dram", KB, KB, 1)]
    fresh.register_node("a", "a:1", 2 * KB, 0, 64, items, 0)
    assert fresh.nodes["a"].dram_lru.is_pinned("p") and not fresh.nodes["a"].dram_lru.is_pinned("q")
    plan = fresh.put_start(["r"], [KB], 1, None, False, 0)
    assert [c.keys for c in plan.commands] == [("q",)]  # the pinned block is not a victim


def test_a_node_out_of_index_slots_evicts_to_make_one() -> None:
    t = PlacementTable(EXACT)
    assert t.register_node("a", "a:1", 64 * KB, 0, 64, [], 0, max_blocks=3) == []
    put(t, "k0", "k1", "k2", size=100)  # bytes to spare, but every slot taken
    plan = t.put_start(["k3"], [100], 1, None, False, 0)
    assert plan.tickets == [None] and plan.waiting == [0]  # waits for an eviction
    [drop] = plan.commands
    assert drop.kind is ActionKind.DROP and drop.keys == ("k0",)  # the least recently used
    assert t.put_start(["k4"], [100], 1, None, False, 0).tickets == [None]  # in flight: no second eviction
    run(t, [drop])
    [ticket] = put(t, "k3", size=100)
    assert ticket is not None and ticket.status == "ok"
    assert t.exists(["k0", "k1", "k2", "k3"]) == [False, True, True, True]
    t.check()
