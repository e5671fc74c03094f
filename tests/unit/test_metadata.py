from __future__ import annotations

from functools import partial

import pytest

from kvstore.errors import CapacityError, GrantExpired, InvalidArgument, NoNodes, RetryLater
from kvstore.placement.table import PlacementTable
from kvstore.policy import ActionKind, EvictionPolicy
from kvstore.results import PUT_EXISTS, PUT_STORED, HeldBlock, NodePrefix, PrefixMatch
from tests.unit.placement import DRAM, EXACT, KB, SSD, got, leased, located, placed, put, run, table


def test_put_commit_and_get() -> None:
    t = table("a", "b")
    [ticket] = put(t, "k1", node="b")
    assert ticket is not None and ticket.status == "ok"
    assert [(r.node_id, r.tier, r.offset) for r in ticket.replicas] == [("b", DRAM, 0)]
    [loc] = located(t.reads.get_replicas(["k1"], 1), ["k1"])
    assert loc is not None and loc.size == KB and loc.checksum == 7 and loc.replicas[0].address == "b:1"
    assert located(t.reads.get_replicas(["nope"], 1), ["nope"]) == [None]
    assert t.reads.exists(["k1", "nope"]) == [True, False]


def test_keys_are_invisible_until_committed_and_a_second_put_reports_exists() -> None:
    t = table("a")
    plan = t.writes.put_start(["k"], [KB], 1, None, False, 0)
    assert plan.tickets[0] is not None and plan.tickets[0].status == "ok"
    assert t.reads.exists(["k"]) == [False] and t.reads.match_prefix(["k"]) == 0
    again = t.writes.put_start(["k"], [KB], 1, None, False, 0)
    assert again.tickets[0] is not None and again.tickets[0].status == "exists"
    t.writes.put_end(["k"], [1])
    assert t.reads.exists(["k"]) == [True] and t.reads.match_prefix(["k", "x"]) == 1
    assert t.writes.put_end(["k"], [1]) == [False]  # already committed: nothing pending
    t.check()


def test_replicas_land_on_distinct_nodes() -> None:
    t = table("a", "b", "c")
    [ticket] = put(t, "k", replicas=2)
    assert ticket is not None
    assert len({r.node_id for r in ticket.replicas}) == 2
    [loc] = located(t.reads.get_replicas(["k"], 0), ["k"])
    assert loc is not None and len(loc.replicas) == 2


def test_expired_reservation_is_dropped_then_writable_again() -> None:
    t = table("a", reservation_ms=100)
    t.writes.put_start(["k"], [KB], 1, None, False, now_ms=0)
    assert t.expire(50) == []
    [cmd] = t.expire(150)
    assert (cmd.node_id, cmd.kind, cmd.keys, cmd.release) == ("a", ActionKind.DROP, ("k",), True)
    # Until the daemon confirms, the extent is not reused and the key is busy.
    busy = t.writes.put_start(["k"], [KB], 1, None, False, 150).tickets[0]
    assert busy is not None and busy.error_code == RetryLater.code
    assert t.writes.put_end(["k"], [1]) == [False]
    run(t, [cmd])
    assert t.nodes["a"].alloc.used == 0
    put(t, "k", now=200)
    assert t.reads.exists(["k"]) == [True]


def test_revoke_releases_through_the_daemon() -> None:
    t = table("a")
    t.writes.put_start(["k1", "k2"], [KB, KB], 1, None, False, 0)
    [cmd] = t.writes.put_revoke(["k1", "unknown"])
    assert cmd.keys == ("k1",)
    run(t, [cmd], ok=False)  # nothing had been written: the extent is free all the same
    assert t.nodes["a"].alloc.used == KB


def test_an_early_release_does_not_end_a_later_readers_lease() -> None:
    # Reader A leases k at 0 and releases it at 100; reader B leases k at 500: B's lease holds to 1500,
    # not to A's expiry at 1000 (the release and the expiry of A's lease used to both count against B).
    t = table("a", dram=2 * KB, lease_ms=1000)
    put(t, "k", "other")
    t.reads.release_leases(got(t.reads.get_replicas(["k"], 0)))
    t.expire(100)
    t.reads.get_replicas(["k"], 500)
    t.expire(1000)
    assert leased(t, "k") == [True]
    count, [cmd] = t.moves.evict_tier("a", DRAM)
    assert count == 1 and cmd.keys == ("other",)
    t.expire(1499)
    assert t.moves.evict_tier("a", DRAM) == (0, [])
    t.expire(1500)
    count, [cmd] = t.moves.evict_tier("a", DRAM)
    assert count == 1 and cmd.keys == ("k",)


def test_a_release_ends_one_lease_of_every_replica_it_was_handed() -> None:
    t = table("a", "b", ssd=4 * KB, lease_ms=1000)
    put(t, "k", replicas=2)
    first = got(t.reads.get_replicas(["k"], 0))
    second = got(t.reads.get_replicas(["k"], 10))
    assert leased(t, "k") == [True, True]
    t.reads.release_leases(first)
    assert leased(t, "k") == [True, True]  # the second reader's lease holds both replicas
    t.reads.release_leases(first)  # again (a retry): ends nothing more
    assert leased(t, "k") == [True, True]
    t.reads.release_leases(second)
    assert leased(t, "k") == [False, False]
    assert t.inspection.tier_usage(t.nodes["a"])["dram"]["leased"] == 0


def test_a_late_release_ends_no_other_readers_lease() -> None:
    # A's lease expires before its release arrives; the release must not end B's lease instead.
    t = table("a", dram=2 * KB, lease_ms=1000)
    put(t, "k")
    a = got(t.reads.get_replicas(["k"], 0))
    t.expire(1000)
    b = got(t.reads.get_replicas(["k"], 1100))
    t.reads.release_leases(a)  # A's, late: its lease is gone, and B's is not A's to end
    assert t.moves.evict_tier("a", DRAM) == (0, [])
    t.reads.release_leases(b)  # B's
    count, _ = t.moves.evict_tier("a", DRAM)
    assert count == 1


def test_silent_nodes_are_fenced_until_they_register_again() -> None:
    t = table("a", "b", node_ttl_ms=1000)
    put(t, "k", node="a")
    assert t.membership.heartbeat("b", 900)
    t.expire(1500)
    assert [n.node_id for n in t.membership.up_nodes()] == ["b"] and t.nodes["a"].fenced
    assert located(t.reads.get_replicas(["k"], 1500), ["k"]) == [None] and t.reads.match_prefix(["k"]) == 0
    [ticket] = put(t, "k2", node="a", now=1500)
    assert ticket is not None and ticket.replicas[0].node_id == "b"
    # Its daemon stopped serving within its lease: a heartbeat does not bring it back, a registration does.
    assert not t.membership.heartbeat("a", 1600) and not t.nodes["a"].up
    assert t.membership.register_node("a", "a:1", 4 * KB, 0, 64, [HeldBlock("k", DRAM, 0, KB, 7)], 1600) == []
    assert t.reads.match_prefix(["k", "k2"]) == 2 and t.membership.heartbeat("a", 1700)
    assert not t.membership.heartbeat("ghost", 1600)
    t.check()


def test_a_master_that_stalled_postpones_its_fences() -> None:
    """Heartbeats a stalled master did not read are no node's silence: each node gets time to be heard."""
    t = table("a", node_ttl_ms=1000)
    t.membership.postpone_fences(900, 500)  # as if the master's loop stood still from 0 to 900
    t.expire(1300)
    assert t.nodes["a"].up
    t.expire(1401)
    assert t.nodes["a"].fenced


def test_a_remove_waiting_for_a_silent_node_ends_when_it_is_fenced() -> None:
    """A remove whose drop a node never confirmed (it died) is done once the node is fenced, and so is
    a remove after that: the key is placeable again at once, and the node's registration drops its
    copies instead of adopting them (a removed key never comes back)."""
    t = table("a", "b", node_ttl_ms=1000)
    put(t, "k", "j", node="a", replicas=2)
    offset = {k: t.inspection.describe(k)["replicas"][0]["offset"] for k in ("k", "j")}  # type: ignore[index]
    removed, commands = t.remove(["k"])
    assert removed == 1 and sorted(c.node_id for c in commands) == ["a", "b"]
    run(t, [c for c in commands if c.node_id == "b"])
    assert t.reads.removing(["k"]) == ["k"]  # a's copy may still be served
    t.membership.heartbeat("b", 1500)
    t.expire(1500)
    assert t.reads.removing(["k"]) == [] and ("k", DRAM, offset["k"]) in t.nodes["a"].gone
    removed, commands = t.remove(["j"])  # a is fenced: its drop is settled without it
    for c in commands:
        if c.node_id == "a":
            t.settle_fenced(c)
        else:
            run(t, [c])
    assert removed == 1 and t.reads.removing(["j"]) == [] and ("j", DRAM, offset["j"]) in t.nodes["a"].gone
    put(t, "k", node="b", now=1500)  # placeable again: other bytes, say
    inventory = [HeldBlock("k", DRAM, offset["k"], KB, 7), HeldBlock("j", DRAM, offset["j"], KB, 7)]
    [drop] = t.membership.register_node("a", "a:1", 4 * KB, 0, 64, inventory, 1600)
    assert (drop.node_id, drop.kind, sorted(drop.keys)) == ("a", ActionKind.DROP, ["j", "k"])
    assert dict(zip(drop.keys, drop.at, strict=True)) == offset  # only where the inventory had them
    assert [r["node_id"] for r in t.inspection.describe("k")["replicas"]] == ["b"]  # type: ignore[index]
    assert t.reads.exists(["j"]) == [False]
    # Kept, and the node not up, until its daemon heartbeats (it took the answer naming the drops):
    # one that lost the answer registers again and drops them then.
    assert t.nodes["a"].gone and not t.nodes["a"].up
    [again] = t.membership.register_node("a", "a:1", 4 * KB, 0, 64, inventory, 1650)
    assert sorted(again.keys) == ["j", "k"] and t.reads.exists(["j"]) == [False]
    assert t.membership.heartbeat("a", 1700) and t.nodes["a"].up and not t.nodes["a"].gone
    run(t, [drop, again])


def test_a_fenced_node_drops_a_removed_key_from_either_tier() -> None:
    """A demotion cut short leaves a node the block on SSD while the table has it in DRAM: a remove
    settled while the node was fenced drops it from both tiers at its registration."""
    t = table("a", "b", dram=4 * KB, ssd=4 * KB, node_ttl_ms=1000)
    put(t, "k", node="a")
    t.membership.heartbeat("b", 1500)
    t.expire(1500)
    _, commands = t.remove(["k"])
    for c in commands:
        t.settle_fenced(c)
    [drop] = t.membership.register_node("a", "a:1", 4 * KB, 4 * KB, 64, [HeldBlock("k", SSD, -1, KB, 7)], 1600)
    assert drop.keys == ("k",) and drop.tier is SSD and t.reads.exists(["k"]) == [False]


def test_a_settled_drop_of_a_reservation_spares_the_keys_block_elsewhere() -> None:
    """A put's reservation given up while its node is fenced is dropped only where it was reserved: a
    block of the key the daemon holds at another offset (a cached put of it, its commit pending) is
    adopted at the registration."""
    t = table("a", node_ttl_ms=1000)
    plan = t.writes.put_start(["k"], [KB], 1, "a", False, 0)
    [ticket] = plan.tickets
    assert ticket is not None
    reserved = ticket.replicas[0].offset
    t.expire(1500)  # a is fenced
    for c in t.writes.put_revoke(["k"]):
        t.settle_fenced(c)
    assert t.nodes["a"].gone == {("k", DRAM, reserved)}
    elsewhere = 2 * KB if reserved != 2 * KB else 0
    assert t.membership.register_node("a", "a:1", 4 * KB, 0, 64, [HeldBlock("k", DRAM, elsewhere, KB, 7)], 1600) == []
    assert t.membership.heartbeat("a", 1700) and t.reads.exists(["k"]) == [True]


def test_puts_refused_for_room_held_by_pins_or_leases_are_counted() -> None:
    # For the alerts an operator wants (docker/prometheus/alerts.yml): room refused for pins pages.
    t = table("a", dram=2 * KB)
    t.writes.put_start(["p0", "p1"], [KB, KB], 1, None, True, 0)
    t.writes.put_end(["p0", "p1"], [1, 1])
    [tk] = t.writes.put_start(["k"], [KB], 1, None, False, 0).tickets
    assert tk is not None and tk.error_code == CapacityError.code and "pinned" in tk.error
    assert (t.counters["room_refused_pinned"], t.counters["room_refused_leased"]) == (1, 0)
    assert t.grants.grant_space(KB, None, 1000, 0).error is not None
    assert t.counters["room_refused_pinned"] == 2
    t = table("a", dram=KB)
    put(t, "x")
    t.reads.get_replicas(["x"], 0)  # leased: not evicted for the next put
    [tk] = t.writes.put_start(["k"], [KB], 1, None, False, 0).tickets
    assert tk is not None and tk.error_code == RetryLater.code
    assert (t.counters["room_refused_pinned"], t.counters["room_refused_leased"]) == (0, 1)


def test_no_nodes_and_oversize_blocks_are_ticket_errors() -> None:
    t = PlacementTable(EXACT)
    [tk] = t.writes.put_start(["k"], [KB], 1, None, False, 0).tickets
    assert tk is not None and tk.error_code == NoNodes.code
    t = table("a", dram=4 * KB)
    [tk] = t.writes.put_start(["k"], [8 * KB], 1, None, False, 0).tickets
    assert tk is not None and tk.error_code == CapacityError.code and "larger" in tk.error


@pytest.mark.parametrize(
    ("keys", "sizes", "replicas", "match"),
    [(["k"], [0], 1, "positive"), (["k"], [1, 2], 1, "2 sizes"), ([""], [1], 1, "empty"), (["k"], [1], 0, "replicas")],
)
def test_bad_put_start_arguments(keys: list[str], sizes: list[int], replicas: int, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        table("a").writes.put_start(keys, sizes, replicas, None, False, 0)


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
        assert fresh.membership.register_node(n, f"{n}:1", 8 * KB, 8 * KB, 64, items, 0) == []
    assert fresh.reads.match_prefix(["k0", "k1", "k2"]) == 3
    [loc] = located(fresh.reads.get_replicas(["k1"], 0), ["k1"])
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
    [cmd] = t.membership.register_node("b", "b:1", 8 * KB, 0, 64, items, 0)
    assert set(cmd.keys) == {"k", "y", "z"} and cmd.release
    assert t.reads.exists(["x", "y"]) == [True, False]
    t.check()


def test_reregistration_replaces_the_nodes_state() -> None:
    t = table("a", "b")
    put(t, "k0", "k1", node="a")
    pending = t.writes.put_start(["p"], [KB], 2, None, False, 0)
    assert pending.tickets[0] is not None and len(pending.tickets[0].replicas) == 2
    commands = t.membership.register_node("a", "a:2", 4 * KB, 0, 64, [HeldBlock("k1", DRAM, 2048, KB, 7)], 0)
    assert t.reads.exists(["k0", "k1"]) == [False, True]
    # The pending put lost its replica on a: its other replica is revoked through b.
    assert [(c.node_id, c.keys) for c in commands] == [("b", ("p",))]
    run(t, commands)
    [loc] = located(t.reads.get_replicas(["k1"], 0), ["k1"])
    assert loc is not None and loc.replicas[0].address == "a:2" and loc.replicas[0].offset == 2048


def test_a_removed_key_whose_drop_was_not_confirmed_stays_removed_when_its_node_registers_again() -> None:
    # Found by bench.chaos: a daemon killed while a remove's drop was on its way came back with the
    # block in its inventory, and the table adopted it: the removed value was read again.
    t = table("a", "b")
    put(t, "k0", "k1", node="a")
    removed, [drop] = t.remove(["k0"])  # the drop never reaches a: it is down
    assert removed == 1 and drop.node_id == "a" and drop.keys == ("k0",)
    inventory = [HeldBlock("k0", DRAM, 0, KB, 7), HeldBlock("k1", DRAM, KB, KB, 7)]
    commands = t.membership.register_node("a", "a:2", 4 * KB, 0, 64, inventory, 0)
    assert t.membership.heartbeat("a", 0)  # its daemon took the answer (up from here: see register_node)
    assert t.reads.exists(["k0", "k1"]) == [False, True]
    assert [(c.node_id, c.kind, c.keys) for c in commands] == [("a", ActionKind.DROP, ("k0",))]
    # Found by bench.chaos too: until the daemon confirms that drop, its extent is not handed out (a
    # same-host writer would copy a new block over the one the daemon still serves).
    placed = [put(t, f"n{i}", node="a")[0] for i in range(2)]
    assert all(p is not None and p.replicas[0].offset not in (0, KB) for p in placed)
    assert "k0" in t.nodes["a"].quarantine  # a is full now: k0's extent is not free space
    t.check()
    run(t, commands)
    put(t, "k0", node="a")  # its extent is free again once dropped, and the key may be put anew
    assert t.reads.exists(["k0"]) == [True]
    t.check()


def test_a_removed_blocks_extent_is_not_handed_out_again_while_a_reader_holds_a_lease_on_it() -> None:
    # Found by bench.chaos: a same-host reader copies straight from the arena at the extent its get
    # named; a forced remove dropped the block under it, a put took the extent, and the reader got
    # another key's bytes.
    t = table("a", dram=4 * KB)
    [ticket] = put(t, "k")
    assert ticket is not None and ticket.replicas[0].offset == 0
    reading = t.reads.get_replicas(["k"], 0)
    removed, commands = t.remove(["k"])
    run(t, commands)  # the daemon dropped it; the reader's lease is still live
    assert removed == 1 and t.reads.exists(["k"]) == [False]
    [other] = put(t, "x")
    assert other is not None and other.replicas[0].offset != 0
    t.reads.release_leases(got(reading))
    t.expire(1)
    [again] = put(t, "y")
    assert again is not None and again.replicas[0].offset == 0  # free once no lease covers it
    t.check()


def test_remove_hides_at_once_and_frees_after_the_daemon() -> None:
    t = table("a", dram=4 * KB, ssd=4 * KB)
    put(t, "k0", "k1")
    removed, [cmd] = t.remove(["k0", "k0", "missing"])
    assert removed == 1 and cmd.keys == ("k0",) and cmd.release  # a removal is not an eviction
    assert t.reads.exists(["k0"]) == [False]
    busy = t.writes.put_start(["k0"], [KB], 1, None, False, 0).tickets[0]
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
    located(t.reads.get_replicas(["k", "x"], 0), ["k", "x"])
    s = t.stats()
    assert (s["nodes"], s["objects"], s["hits"], s["misses"], s["dram_used"]) == (2, 1, 1, 1, KB)
    assert s["dram_capacity"] == 8 * KB and s["ssd_capacity"] == 2 * KB


def test_pins_come_back_with_the_inventory() -> None:
    fresh = PlacementTable(EXACT)
    items = [HeldBlock("p", DRAM, 0, KB, 1, pinned=True), HeldBlock("q", DRAM, KB, KB, 1)]
    fresh.membership.register_node("a", "a:1", 2 * KB, 0, 64, items, 0)
    assert fresh.nodes["a"].dram_lru.is_pinned("p") and not fresh.nodes["a"].dram_lru.is_pinned("q")
    plan = fresh.writes.put_start(["r"], [KB], 1, None, False, 0)
    assert [c.keys for c in plan.commands] == [("q",)]  # the pinned block is not a victim


# -- per-node prefix match ------------------------------------------------------------------------


def test_match_prefix_nodes_counts_each_nodes_leading_keys_by_tier() -> None:
    t = placed({
        "a": [("k0", "dram"), ("k1", "dram"), ("k2", "ssd"), ("k3", "dram")],
        "b": [("k0", "ssd"), ("k1", "dram")],
        "c": [("k1", "dram"), ("k2", "dram"), ("k3", "dram"), ("k4", "dram")],  # lacks k0: holds no prefix
    })  # fmt: skip
    keys = ["k0", "k1", "k2", "k3", "k4", "k5", "k0"]
    match = t.reads.match_prefix_nodes(keys)
    assert match == PrefixMatch(5, {"a": NodePrefix(dram=2, total=4), "b": NodePrefix(dram=0, total=2)})
    assert match.longest == t.reads.match_prefix(keys)  # the cluster's prefix spans nodes: longer than any node's
    assert t.reads.match_prefix_nodes([]) == PrefixMatch(0, {})
    assert t.reads.match_prefix_nodes(["k5", "k0"]) == PrefixMatch(0, {})
    assert t.reads.match_prefix_nodes(["k1", "k2"]).nodes == {
        "a": NodePrefix(1, 2), "b": NodePrefix(1, 1), "c": NodePrefix(2, 2)
    }  # fmt: skip


def test_match_prefix_nodes_counts_only_readable_replicas() -> None:
    t = placed({"a": [("k0", "dram"), ("k1", "dram"), ("k2", "dram")], "b": [("k0", "dram"), ("k1", "ssd")]})
    t.membership.ttl_ms = 1000
    keys = ["k0", "k1", "k2"]
    # Demotions in flight: a's replicas are read by key through its daemon, as a get reads them, so
    # they count; in a's DRAM count they do not (they are on their way out of it).
    _, commands = t.moves.evict_tier("a", DRAM)
    assert t.reads.match_prefix_nodes(keys) == PrefixMatch(3, {"a": NodePrefix(0, 3), "b": NodePrefix(1, 2)})
    assert t.reads.match_prefix(keys) == 3 and t.reads.exists(keys) == [True] * 3
    run(t, commands)
    assert t.reads.match_prefix_nodes(keys) == PrefixMatch(3, {"a": NodePrefix(0, 3), "b": NodePrefix(1, 2)})
    moves = t.moves.plan_replicas(["k2"], "b", 1 << 30)  # a copy on its way to b is not readable there yet
    assert len(moves) == 1 and t.reads.match_prefix_nodes(keys).nodes["b"] == NodePrefix(1, 2)
    assert t.moves.finish_replicas(moves, [False]) == ([], [])
    t.check()
    t.membership.heartbeat("a", 1500)
    t.expire(1500)  # b is down
    assert t.reads.match_prefix_nodes(keys) == PrefixMatch(3, {"a": NodePrefix(0, 3)})
    _, commands = t.remove(["k1"])
    assert t.reads.match_prefix_nodes(keys) == PrefixMatch(1, {"a": NodePrefix(0, 1)})
    t.writes.put_start(["k9"], [KB], 1, "a", False, 1500)  # written, not committed: not a prefix
    assert t.reads.match_prefix_nodes(["k9"]) == PrefixMatch(0, {})


def test_grants_are_carved_committed_and_freed_without_handing_space_out_twice() -> None:
    table = PlacementTable(EvictionPolicy())
    table.membership.register_node("n", "n:1", 1 << 20, 0, 64, [], 0)
    plan = table.grants.grant_space(64 * 1024, None, 1000, 0)
    assert plan.grant is not None and plan.error is None
    grant = plan.grant
    base = grant.pieces[0].offset
    table.check()
    # A put elsewhere never lands inside the grant.
    other = table.writes.put_start(["elsewhere"], [64 * 1024], 1, None, False, 0).tickets[0]
    assert other is not None and other.status == "ok"
    off = other.replicas[0].offset
    assert off + 64 * 1024 <= base or off >= base + 64 * 1024
    out = table.grants.commit_granted("n", grant.grant_id, ["a", "b"], [base + 4096, base], [100, 4096], [1, 2], False)
    assert out == [(PUT_STORED, ""), (PUT_STORED, "")]
    table.check()
    # Idempotent for the same block; exists for a key stored elsewhere; refused for taken space.
    assert table.grants.commit_granted("n", grant.grant_id, ["a"], [base + 4096], [100], [1], False) == [
        (PUT_STORED, "")
    ]
    assert table.grants.commit_granted("n", grant.grant_id, ["b"], [base + 8192], [10], [9], False)[0][0] == PUT_EXISTS
    code, _ = table.grants.commit_granted("n", grant.grant_id, ["c"], [base + 4096], [64], [3], False)[0]
    assert code == InvalidArgument.code
    table.check()
    # The grant ends: until its daemon answers, it still takes the commits of blocks the daemon
    # acknowledged (cached puts); then the rest goes back, the committed blocks stay, and no more
    # commits are taken.
    assert table.grants.expired_grants(2000) == {"n": [grant.grant_id]}
    assert table.grants.commit_granted("n", grant.grant_id, ["d"], [base + 8192], [64], [3], False) == [
        (PUT_STORED, "")
    ]
    table.grants.finish_end_grants("n", [grant.grant_id])
    code, _ = table.grants.commit_granted("n", grant.grant_id, ["e"], [base + 12288], [64], [3], False)[0]
    assert code == GrantExpired.code
    table.check()
    assert table.nodes["n"].alloc.used == 64 * 1024 + 4096 + 128 + 64
    assert table.reads.exists(["a", "b", "c", "d", "e"]) == [True, True, False, True, False]


def test_a_grant_commit_is_answered_stored_again_for_its_own_write_only() -> None:
    """A daemon's commit into a grant names each block's write id: asked again (its answer lost) it
    is PUT_STORED for the same write, PUT_EXISTS for another put's of the same bytes at the same
    extent; where either names no id, the checksum decides, as before ids."""
    table = PlacementTable(EvictionPolicy())
    table.membership.register_node("n", "n:1", 1 << 20, 0, 64, [], 0)
    grant = table.grants.grant_space(64 * 1024, None, 1000, 0).grant
    assert grant is not None
    base = grant.pieces[0].offset
    commit = partial(table.grants.commit_granted, "n", grant.grant_id)
    assert (
        commit(["a", "b"], [base, base + 4096], [100, 100], [1, 2], False, write_ids=[5, 0]) == [(PUT_STORED, "")] * 2
    )
    assert table.objects["a"].write_id == 5 and table.objects["b"].write_id == 0
    assert commit(["a"], [base], [100], [1], False, write_ids=[5]) == [(PUT_STORED, "")]
    assert commit(["a"], [base], [100], [1], False, write_ids=[6])[0][0] == PUT_EXISTS
    assert commit(["a"], [base], [100], [9], False, write_ids=[5])[0][0] == PUT_EXISTS  # its id, other bytes
    assert commit(["a"], [base], [100], [1], False) == [(PUT_STORED, "")]  # no id: by checksum
    assert commit(["b"], [base + 4096], [100], [2], False, write_ids=[7]) == [(PUT_STORED, "")]
    with pytest.raises(InvalidArgument, match="write_ids has 1 entries for 2 blocks"):
        commit(["c", "d"], [base + 8192, base + 12288], [100, 100], [1, 1], False, write_ids=[1])
    table.check()


def test_a_cached_commit_waits_for_a_put_still_being_written_under_its_key() -> None:
    """A cached put was answered STORED by its daemon already: while another put of the key is
    reserved and uncommitted the master answers RetryLater (the daemon keeps its block and asks
    again); a visible put's commit is answered EXISTS at once, as before. Once the other put
    committed, the cached one is EXISTS (dropped there); one that gave up holds the key until
    its extent is dropped, and the cached commit waits on."""
    table = PlacementTable(EvictionPolicy())
    table.membership.register_node("n", "n:1", 1 << 20, 0, 64, [], 0)
    grant = table.grants.grant_space(64 * 1024, None, 1000, 0).grant
    assert grant is not None
    base = grant.pieces[0].offset
    assert table.writes.put_start(["k", "j"], [4096, 4096], 1, None, False, 0).tickets[0] is not None
    code, text = table.grants.commit_granted("n", grant.grant_id, ["k"], [base], [100], [1], False, cached=True)[0]
    assert code == RetryLater.code and "being written by another put" in text
    assert table.grants.commit_granted("n", grant.grant_id, ["k"], [base], [100], [1], False)[0][0] == PUT_EXISTS
    table.writes.put_end(["k"], [7])
    assert (
        table.grants.commit_granted("n", grant.grant_id, ["k"], [base], [100], [1], False, cached=True)[0][0]
        == PUT_EXISTS
    )
    table.writes.put_revoke(["j"])  # the other put gave up: its extent is dropped, then the key is free
    assert table.grants.commit_granted("n", grant.grant_id, ["j"], [base], [100], [1], False, cached=True)[0][0] == (
        RetryLater.code
    )
    table.check()


def test_a_read_holds_its_key_against_remove_and_eviction_for_hold_ms() -> None:
    # Mooncake's KV lease: a get, an exists or a daemon's access report holds the key for hold_ms;
    # the reader's own (short) lease release does not end it, a later read extends it.
    t = table("a", dram=2 * KB, lease_ms=100, hold_ms=1000)
    put(t, "k0", "k1")
    reply = t.reads.get_replicas(["k0"], 0)
    t.reads.release_leases(got(reply))  # the reader is done: its lease ends, the hold does not
    assert t.reads.held(["k0", "k1", "nope"], 999) == [0] and t.reads.held(["k0"], 1000) == []
    assert leased(t, "k0") == [True]
    plan = t.writes.put_start(["k2"], [KB], 1, None, False, now_ms=10)
    assert [c.keys for c in plan.commands] == [("k1",)]  # k0 is held: k1 goes although it is newer
    run(t, plan.commands)
    put(t, "k2", now=10)
    assert t.reads.exists(["k2"], now_ms=500) == [True] and t.reads.held(["k2"], 1400) == [0]
    t.reads.record_access("a", ["k0"], ["dram"], now_ms=900)  # a read the daemon served alone, reported at 900
    t.expire(1000)
    assert t.reads.held(["k0"], 1899) == [0] and leased(t, "k0") == [True]
    t.expire(1900)
    assert t.reads.held(["k0"], 1900) == [] and leased(t, "k0") == [False]
    t.check()


def test_a_forced_remove_ends_the_hold_and_no_hold_without_hold_ms() -> None:
    t = table("a", dram=2 * KB, hold_ms=1000)
    put(t, "k")
    t.reads.exists(["k"], now_ms=1)
    removed, [drop] = t.remove(["k"])
    assert removed == 1 and len(t.leases) == 0
    run(t, [drop])
    plain = table("a", dram=2 * KB)
    put(plain, "k")
    plain.reads.exists(["k"], now_ms=1)
    plain.reads.release_leases(got(plain.reads.get_replicas(["k"], 1)))
    assert plain.reads.held(["k"], 2) == [] and len(plain.leases) == 0


def test_a_node_that_leaves_takes_its_blocks_and_revokes_its_puts() -> None:
    t = table("a", "b", dram=4 * KB)
    put(t, "only-a", node="a")
    put(t, "both", node="a", replicas=2)
    plan = t.writes.put_start(["inflight"], [KB], 2, "a", False, 0)  # reserved on a and b, not committed
    assert plan.tickets[0] is not None and plan.tickets[0].status == "ok"
    [revoke] = t.membership.leave_node("a")
    assert (revoke.node_id, revoke.kind, revoke.keys) == ("b", ActionKind.DROP, ("inflight",))
    assert "a" not in t.nodes and t.reads.exists(["only-a", "both"]) == [False, True]
    run(t, [revoke])
    assert t.membership.leave_node("a") == [] and t.writes.put_end(["inflight"], [7]) == [False]


@pytest.mark.parametrize("ssd_first", [False, True])
def test_a_key_reported_in_both_tiers_keeps_its_dram_copy_and_drops_the_other(ssd_first: bool) -> None:
    t = table("a", ssd=4 * KB)
    both = [HeldBlock("k", DRAM, 0, KB, 7), HeldBlock("k", SSD, -1, KB, 7)]
    [drop] = t.membership.register_node("b", "b:1", 4 * KB, 4 * KB, 64, both[::-1] if ssd_first else both, 0)
    assert (drop.node_id, drop.kind, drop.tier, drop.keys, drop.tier_only) == ("b", ActionKind.DROP, SSD, ("k",), True)
    t.check()
    [loc] = located(t.reads.get_replicas(["k"], 0), ["k"])
    assert loc is not None and [(r.node_id, r.tier, r.offset) for r in loc.replicas] == [("b", "dram", 0)]
    run(t, [drop])  # the SSD copy is gone: the DRAM one stays
    assert t.inspection.describe("k")["replicas"][0]["tier"] == "dram"  # type: ignore[index]


def test_of_a_key_in_both_tiers_the_copy_that_agrees_with_other_nodes_is_kept() -> None:
    t = table("a", ssd=4 * KB)
    put(t, "k")  # checksum 7 on node a
    both = [HeldBlock("k", DRAM, 0, KB, 9), HeldBlock("k", SSD, -1, KB, 7)]
    [drop] = t.membership.register_node("b", "b:1", 4 * KB, 4 * KB, 64, both, 0)
    assert (drop.tier, drop.keys, drop.tier_only) == (DRAM, ("k",), True)
    t.check()
    run(t, [drop])
    assert sorted((r["node_id"], r["tier"]) for r in t.inspection.describe("k")["replicas"]) == [
        ("a", "dram"),
        ("b", "ssd"),
    ]  # type: ignore[index]


def test_a_revoked_reservation_is_dropped_at_its_extent_only() -> None:
    """The drop of a reservation given up names the extent reserved: a daemon holding a block of the
    key elsewhere (a cached put's, not yet committed) keeps it."""
    table = PlacementTable(EvictionPolicy())
    table.membership.register_node("n", "n:1", 1 << 20, 0, 64, [], 0)
    ticket = table.writes.put_start(["k"], [4096], 1, None, False, 0).tickets[0]
    assert ticket is not None
    [command] = table.writes.put_revoke(["k"])
    assert command.keys == ("k",) and command.at == (ticket.replicas[0].offset,)
