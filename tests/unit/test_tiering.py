"""The placement table's tiers: evictions (DRAM to SSD, SSD out), promotions back, what a lease or
a pin keeps, and reads of a block while it moves."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore.errors import CapacityError, InvalidArgument
from kvstore.placement.records import TierLRU
from kvstore.placement.table import PlacementTable
from kvstore.policy import ActionKind, EvictionPolicy
from kvstore.results import HeldBlock
from tests.unit.placement import DRAM, EXACT, KB, SSD, got, located, put, run, table


def test_full_node_evicts_in_lru_order_before_placing() -> None:
    t = table("a", dram=4 * KB, ssd=2 * KB)
    put(t, "k0", "k1", "k2", "k3")
    t.reads.release_leases(got(t.reads.get_replicas(["k0"], 0)))
    plan = t.writes.put_start(["k4"], [KB], 1, None, False, 0)
    assert plan.tickets == [None] and plan.waiting == [0]
    [cmd] = plan.commands
    assert (cmd.kind, cmd.tier, cmd.keys) == (ActionKind.DEMOTE, DRAM, ("k1",))
    [moving] = located(t.reads.get_replicas(["k1"], 0), ["k1"])  # moving: read by key through its daemon
    assert moving is not None and [(r.tier, r.offset) for r in moving.replicas] == [("ssd", -1)]
    run(t, plan.commands)
    [loc] = located(t.reads.get_replicas(["k1"], 0), ["k1"])
    assert loc is not None and loc.replicas[0].tier == "ssd" and loc.replicas[0].offset == -1
    put(t, "k4")
    assert list(t.nodes["a"].dram_lru) == ["k2", "k3", "k0", "k4"]


def test_full_ssd_drops_its_lru_block_to_take_a_demotion() -> None:
    t = table("a", dram=2 * KB, ssd=KB)
    put(t, "k0", "k1")
    plan = t.writes.put_start(["k2"], [KB], 1, None, False, 0)
    run(t, plan.commands)
    put(t, "k2")
    plan = t.writes.put_start(["k3"], [KB], 1, None, False, 0)
    assert [(c.kind, c.tier, c.keys) for c in plan.commands] == [
        (ActionKind.DROP, SSD, ("k0",)),
        (ActionKind.DEMOTE, DRAM, ("k1",)),
    ]
    run(t, plan.commands)
    assert t.reads.exists(["k0", "k1"]) == [False, True]
    assert t.counters["evictions"] == 1 and t.counters["demotions"] == 2
    assert (
        t.tiering.take_evictions() == [("k0", "a", "lru")] and t.tiering.take_evictions() == []
    )  # taken once, for the log


def test_failed_demotion_means_the_daemon_dropped_it() -> None:
    t = table("a", dram=KB, ssd=4 * KB)
    put(t, "k0")
    plan = t.writes.put_start(["k1"], [KB], 1, None, False, 0)
    run(t, plan.commands, ok=False)
    assert t.reads.exists(["k0"]) == [False] and t.nodes["a"].ssd_used == 0
    assert t.tiering.take_evictions() == [("k0", "a", "demotion_failed")]


def test_a_block_mid_move_stays_readable_through_its_daemon() -> None:
    """While its demotion is under way the block is neither where it was nor where it goes: a get
    still finds it, as a replica to read by key (no extent, no lease), and so does exists; a
    demotion that failed leaves a miss, one that worked the SSD replica."""
    t = table("a", dram=KB, ssd=4 * KB)
    put(t, "k0")
    plan = t.writes.put_start(["k1"], [KB], 1, None, False, 0)
    assert [c.keys for c in plan.commands] == [("k0",)]  # k0 is being demoted
    leases = len(t.leases)
    reply = t.reads.get_replicas(["k0", "nope"], 0)
    assert reply.sizes == [KB, -1] and reply.tiers == ["ssd"] and reply.offsets == [-1]
    # One lease per hit, of no replica: the ids the reader releases are its own.
    assert len(t.leases) == leases + 1
    assert t.reads.release_leases([reply.first_lease]) == [] and len(t.leases) == leases
    assert t.reads.exists(["k0"]) == [True]
    t.check()
    run(t, plan.commands)
    reply = t.reads.get_replicas(["k0"], 0)
    assert reply.tiers == ["ssd"] and t.inspection.tier_usage(t.nodes["a"])["ssd"]["blocks"] == 1


def test_a_block_being_dropped_is_gone_at_once() -> None:
    """Unlike a demotion, an eviction that drops the block (no SSD) ends it for readers when it is
    planned: a get misses, exists says False and a prefix match stops there."""
    t = table("a", dram=2 * KB)
    put(t, "k0", "k1")
    count, [drop] = t.moves.evict_tier("a", DRAM)
    assert count == 2 and drop.kind is ActionKind.DROP
    assert t.reads.get_replicas(["k0"], 0).sizes == [-1] and t.reads.exists(["k0", "k1"]) == [False, False]
    assert t.reads.match_prefix(["k0"]) == 0 and t.reads.match_prefix_nodes(["k0"]).nodes == {}
    t.check()
    run(t, [drop])
    assert t.nodes["a"].alloc.used == 0


def test_leased_and_pinned_blocks_are_not_evicted() -> None:
    t = table("a", dram=2 * KB)
    put(t, "k0", "k1")
    located(t.reads.get_replicas(["k0"], 0), ["k0"])  # leased for 5 s
    plan = t.writes.put_start(["k2"], [KB], 1, None, False, now_ms=10)
    assert [c.keys for c in plan.commands] == [("k1",)]
    run(t, plan.commands)
    put(t, "k2", now=10)
    plan = t.writes.put_start(["k3"], [KB], 1, None, False, now_ms=10)
    assert [c.keys for c in plan.commands] == [("k2",)]
    run(t, plan.commands)
    t.writes.put_start(["p"], [KB], 1, None, True, 10)
    t.writes.put_end(["p"], [1])
    t.expire(10_000)  # lease over
    plan = t.writes.put_start(["k4"], [KB], 1, None, True, now_ms=10_000)
    assert [c.keys for c in plan.commands] == [("k0",)]
    run(t, plan.commands)
    t.writes.put_start(["k4"], [KB], 1, None, True, now_ms=10_000)
    t.writes.put_end(["k4"], [1])
    again = t.writes.put_start(["k5"], [KB], 1, None, False, 10_000)
    assert again.tickets[0] is not None and again.tickets[0].error_code == CapacityError.code  # only pinned left


def test_ssd_block_is_promoted_after_hits_once_unleased() -> None:
    t = table("a", dram=4 * KB, ssd=4 * KB, policy=EvictionPolicy(0.9, 0.5, promote_after_hits=2))
    put(t, "k0", "k1", "k2")
    plan = t.writes.put_start(["k3"], [KB], 1, None, False, 0)  # past 90%: evict down to 50%
    assert [(c.kind, c.keys) for c in plan.commands] == [(ActionKind.DEMOTE, ("k0", "k1"))]
    assert plan.tickets[0] is not None and plan.tickets[0].status == "ok"  # placed at once, eviction in background
    run(t, plan.commands)
    t.writes.put_end(["k3"], [7])
    assert t.reads.release_leases(got(t.reads.get_replicas(["k0"], 0))) == []  # one hit
    second = got(t.reads.get_replicas(["k0"], 0))
    assert t.expire(1) == []  # second hit, but still leased by this read
    [cmd] = t.reads.release_leases(second)
    assert (cmd.kind, cmd.tier, cmd.keys) == (ActionKind.PROMOTE, SSD, ("k0",)) and cmd.offsets[0] >= 0
    [moving] = located(t.reads.get_replicas(["k0"], 0), ["k0"])  # moving while promoted: by key, no extent
    assert moving is not None and [(r.tier, r.offset) for r in moving.replicas] == [("ssd", -1)]
    t.check()
    run(t, [cmd])
    [loc] = located(t.reads.get_replicas(["k0"], 0), ["k0"])
    assert loc is not None and loc.replicas[0].tier == "dram" and loc.replicas[0].offset == cmd.offsets[0]
    assert t.counters["promotions"] == 1 and t.nodes["a"].ssd_used == KB


def test_failed_promotion_leaves_the_block_on_ssd() -> None:
    t = table("a", dram=4 * KB, ssd=4 * KB, policy=EvictionPolicy(0.9, 0.5, promote_after_hits=1))
    put(t, "k0", "k1", "k2")
    run(t, t.writes.put_start(["k3"], [KB], 1, None, False, 0).commands)
    [cmd] = t.reads.release_leases(got(t.reads.get_replicas(["k0"], 0)))
    run(t, [cmd], ok=False)
    [loc] = located(t.reads.get_replicas(["k0"], 0), ["k0"])
    assert loc is not None and loc.replicas[0].tier == "ssd"


def test_a_node_out_of_index_slots_evicts_to_make_one() -> None:
    t = PlacementTable(EXACT)
    assert t.membership.register_node("a", "a:1", 64 * KB, 0, 64, [], 0, max_blocks=3) == []
    put(t, "k0", "k1", "k2", size=100)  # bytes to spare, but every slot taken
    plan = t.writes.put_start(["k3"], [100], 1, None, False, 0)
    assert plan.tickets == [None] and plan.waiting == [0]  # waits for an eviction
    [drop] = plan.commands
    assert drop.kind is ActionKind.DROP and drop.keys == ("k0",)  # the least recently used
    assert t.writes.put_start(["k4"], [100], 1, None, False, 0).tickets == [None]  # in flight: no second eviction
    run(t, [drop])
    [ticket] = put(t, "k3", size=100)
    assert ticket is not None and ticket.status == "ok"
    assert t.reads.exists(["k0", "k1", "k2", "k3"]) == [False, True, True, True]
    t.check()


def test_a_late_access_report_counts_the_tier_the_block_was_read_from() -> None:
    """A daemon reports the reads it served alone once a period, so a report can come after the
    block moved: a read from DRAM reported after the block's demotion is no SSD hit and promotes
    nothing (an operator's eviction to SSD would be undone); a read from SSD is one."""
    t = table("a", dram=4 * KB, ssd=4 * KB, policy=EvictionPolicy(0.9, 0.5, promote_after_hits=1))
    put(t, "k0", "k1")
    count, commands = t.moves.evict_tier("a", DRAM)
    assert count == 2
    run(t, commands)
    assert t.inspection.tier_usage(t.nodes["a"])["ssd"]["blocks"] == 2
    t.reads.record_access("a", ["k0", "k1"], ["dram", "dram"], now_ms=1)  # read before the demotion
    assert t.expire(2) == [] and t.counters["dram_hits"] == 2 and t.counters["ssd_hits"] == 0
    t.reads.record_access("a", ["k1"], ["ssd"], now_ms=3)
    [cmd] = t.expire(4)
    assert (cmd.kind, cmd.tier, cmd.keys) == (ActionKind.PROMOTE, SSD, ("k1",)) and t.counters["ssd_hits"] == 1
    with pytest.raises(InvalidArgument, match="an access report of 2 keys with 1 tiers"):
        t.reads.record_access("a", ["k0", "k1"], ["ssd"])
    assert t.counters["ssd_hits"] == 1
    t.check()


def test_an_answer_planned_before_its_node_re_registered_is_void() -> None:
    t = table("a", ssd=4 * KB)
    put(t, "k0")
    _, [demote] = t.moves.evict_tier("a", DRAM)
    assert (demote.kind, demote.keys) == (ActionKind.DEMOTE, ("k0",))
    # The daemon restarted before it demoted: its inventory has k0 in DRAM still.
    assert t.membership.register_node("a", "a:1", 4 * KB, 4 * KB, 64, [HeldBlock("k0", DRAM, 0, KB, 7)], 0) == []
    t.apply(demote, [True])  # the old daemon's answer, late
    t.check()
    [loc] = located(t.reads.get_replicas(["k0"], 0), ["k0"])
    assert loc is not None and [(r.tier, r.offset) for r in loc.replicas] == [("dram", 0)]
    assert t.nodes["a"].dram_freeing == 0 and t.nodes["a"].ssd_used == 0


def test_a_stale_drop_answer_does_not_drop_the_key_put_again() -> None:
    t = table("a")
    put(t, "k0")
    _, [evict] = t.moves.evict_tier("a", DRAM)  # no SSD: a drop
    _, removal = t.remove(["k0"])
    run(t, [evict])  # the eviction's drop is answered: k0 is gone
    assert t.inspection.describe("k0") is None
    plan = t.writes.put_start(["k0"], [KB], 1, None, False, 0)  # put again, at the same extent
    for c in removal:  # the removal's answer (if it sent a drop) comes after
        t.apply(c, [True] * len(c.keys))
    t.check()
    assert plan.tickets[0] is not None and t.writes.put_end(["k0"], [7]) == [True]
    assert located(t.reads.get_replicas(["k0"], 0), ["k0"])[0] is not None


def test_a_node_full_of_pins_is_never_walked_for_victims(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant pinned a node's whole index in tiny blocks, and every later key put there scanned
    every pin for a victim (a 40,000-key put held the master for minutes). Pins are kept apart
    from the LRU's order: finding victims walks only what could be evicted."""
    t = PlacementTable(EXACT)
    assert t.membership.register_node("a", "a:1", 256 * KB, 0, 64, [], 0, max_blocks=2000) == []
    pins = [f"pin{i}" for i in range(1990)]
    plan = t.writes.put_start(pins, [8] * len(pins), 1, None, True, 0)
    assert t.writes.put_end(pins, [7] * len(pins)) == [True] * len(pins)
    put(t, *(f"k{i}" for i in range(10)), size=8)
    lru = t.nodes["a"].dram_lru
    walked = 0
    live = TierLRU._live

    def counting(self: TierLRU, owner: int | None = None) -> Iterator[int]:
        nonlocal walked
        for row in live(self, owner):
            walked += 1
            yield row

    monkeypatch.setattr(TierLRU, "_live", counting)
    plan = t.writes.put_start([f"new{i}" for i in range(50)], [8] * 50, 1, None, False, 0)
    assert plan.commands and all(c.kind is ActionKind.DROP and all(k.startswith("k") for k in c.keys)
                                 for c in plan.commands)  # fmt: skip
    assert walked <= 50 * 10, f"{walked} rows walked for 50 keys with 10 evictable blocks"
    assert lru.num_pinned == 1990 and len(lru) == 2000 - sum(len(c.keys) for c in plan.commands)
    t.check()


def test_a_tenants_put_never_evicts_another_tenants_block() -> None:
    """A node full of bob's blocks: alice's put is refused by name (the old table evicted bob's least
    recently used block for it), bob keeps every block; once alice holds blocks there, her puts
    evict only hers, however many of bob's are older; an operator's put (of no tenant) still
    evicts by the whole node's LRU."""
    t = table("a", dram=8 * KB, policy=EvictionPolicy(0.99, 0.9))
    t.accounts.set_tenants(["alice", "bob"])
    bobs = [f"bob/{i}" for i in range(8)]
    assert t.writes.put_start(bobs, [KB] * 8, 1, None, False, 0, "bob").commands == [] and t.writes.put_end(
        bobs, [7] * 8
    )
    plan = t.writes.put_start(["alice/0"], [KB], 1, None, False, 0, "alice")
    [ticket] = plan.tickets
    assert plan.commands == [] and ticket is not None and ticket.status == "error"
    assert "evicts only its own" in ticket.error and "'alice'" in ticket.error
    assert t.counters["room_refused_tenants"] == 1 and t.reads.exists(bobs) == [True] * 8
    grant = t.grants.grant_space(KB, None, 1000, 0, owner="alice")
    assert grant.grant is None and isinstance(grant.error, CapacityError) and "evicts only its own" in str(grant.error)
    # bob removes two of his; alice fills them, then puts a third: her oldest block goes, no one else's.
    run(t, t.remove(["bob/6", "bob/7"])[1])
    assert t.writes.put_start(["alice/0", "alice/1"], [KB] * 2, 1, None, False, 0, "alice").commands == []
    assert t.writes.put_end(["alice/0", "alice/1"], [7, 7]) == [True, True]
    plan = t.writes.put_start(["alice/2"], [KB], 1, None, False, 0, "alice")
    assert plan.waiting == [0] and [c.keys for c in plan.commands] == [("alice/0",)]
    run(t, plan.commands)
    plan = t.writes.put_start(["alice/2"], [KB], 1, None, False, 0, "alice")
    assert t.writes.put_end(["alice/2"], [7]) == [True]
    run(t, plan.commands)  # full again past the watermark: her share of the headroom, of her own blocks
    assert [c.keys for c in plan.commands] == [("alice/1",)]
    assert t.reads.exists(bobs[:6]) == [True] * 6 and t.reads.exists(["alice/0", "alice/2"]) == [False, True]
    # An operator's put takes the node's least recently used block, whoever's it is.
    plan = t.writes.put_start(["op"], [KB], 1, None, False, 0)
    assert plan.commands and plan.commands[0].keys[0] == "bob/0"


def test_a_tenant_that_puts_before_the_master_next_reads_the_tenants_file_evicts_its_own() -> None:
    # A tenant added to the file logs in at once (the file is read again at login); the table hears of
    # it at the master's next tick. Its puts before that went to the shared LRU, where its own puts
    # (which evict only its blocks) never found them: a full node refused it (the test_auth flake).
    t = table("a", dram=8 * KB, policy=EvictionPolicy(0.99, 0.9))
    t.accounts.set_tenants(["alice"])  # the last tick's snapshot: "churn" is not in it yet
    for i in range(8):
        plan = t.writes.put_start([f"churn/{i}"], [KB], 1, None, False, 0, "churn")
        assert plan.tickets[0].status == "ok", plan.tickets
        assert t.writes.put_end([f"churn/{i}"], [7]) == [True]
    t.accounts.set_tenants(["alice", "churn"])  # the next tick
    plan = t.writes.put_start(["churn/8"], [KB], 1, None, False, 0, "churn")
    victims = [k for c in plan.commands for k in c.keys]
    assert plan.waiting == [0] and victims and all(k.startswith("churn/") for k in victims), victims  # its own
    run(t, plan.commands)
    assert t.writes.put_start(["churn/8"], [KB], 1, None, False, 0, "churn").tickets[0].status == "ok"
    t.check()


def test_an_operators_namespaces_share_one_lru() -> None:
    """On a master with a cluster secret and no tenant named so, keys' first path segments are an
    operator's namespaces (``model/<hash>``), not tenants: a put of one namespace evicts another's
    least recently used blocks, as a cache must (the first per-tenant LRU refused it for good)."""
    t = table("a", dram=16 * KB, policy=EvictionPolicy(0.99, 0.9))
    t.accounts.set_tenants(["alice"])
    put(t, *(f"modelA/{i:04d}" for i in range(15)))
    plan = t.writes.put_start(["modelB/0001"], [4 * KB], 1, None, False, 0)
    assert plan.waiting == [0] and [k for c in plan.commands for k in c.keys][:4] == [
        f"modelA/{i:04d}" for i in range(4)
    ]
    assert t.counters["room_refused_tenants"] == 0


def test_a_tenant_frees_headroom_in_proportion_to_what_it_holds() -> None:
    """Past the high watermark a put frees room down to the low one: a tenant alone on a node does as
    before; a tenant with a few blocks among many of another's frees only its share (it used to
    give up all of them to headroom that the other's puts would take)."""
    policy = EvictionPolicy(0.9, 0.5)
    alone = table("a", dram=10 * KB, policy=policy)
    put(alone, *(f"bob/{i}" for i in range(9)))
    plan = alone.writes.put_start(["bob/9"], [KB], 1, None, False, 0, "bob")
    assert sum(len(c.keys) for c in plan.commands) == 5  # down to the low watermark: 10 - 5 = 5 blocks
    mixed = table("a", dram=10 * KB, policy=policy)
    put(mixed, *(f"bob/{i}" for i in range(6)), "alice/0", "alice/1", "alice/2")
    plan = mixed.writes.put_start(["alice/3"], [KB], 1, None, False, 0, "alice")
    evicted = [k for c in plan.commands for k in c.keys]
    assert evicted == ["alice/0", "alice/1"]  # a third of the 5 blocks' headroom (she holds 3 of 9), her oldest


def test_the_owners_lrus_stay_whole_through_batches_and_reuse() -> None:
    t = table("a", "b", dram=64 * KB)
    keys = [f"{who}/{i}" for i in range(40) for who in ("alice", "bob", "carol")]
    plan = t.writes.put_start(keys, [KB] * len(keys), 1, None, False, 0)
    assert t.writes.put_end(keys, [7] * len(keys)) == [True] * len(keys) and not plan.commands
    t.reads.get_replicas(keys[::5], 0)
    run(t, t.remove(keys[::3])[1])
    for node in t.nodes.values():
        node.dram_lru.check()
        assert sorted(node.dram_lru) == sorted(k for k in keys[1::3] + keys[2::3] if node.dram_lru.row_of(k) >= 0)
