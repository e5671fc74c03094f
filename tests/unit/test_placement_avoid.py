"""Nodes a client could not reach (``PutStart.avoid``, ``GrantSpace.avoid``) are placed on last: a
node the master reaches may be cut off from that one client, or frozen and not yet suspected."""

from __future__ import annotations

from kvstore.errors import RetryLater
from kvstore.placement.table import PlacementTable
from tests.unit.placement import KB, put, run, table


def _nodes(plan_tickets: list) -> set[str]:  # type: ignore[type-arg]
    return {r.node_id for t in plan_tickets if t is not None for r in t.replicas}


def test_a_put_avoids_the_nodes_its_client_could_not_reach_while_others_take_it() -> None:
    t = table("node0", "node1", "node2", dram=64 * KB)
    for n, preferred in enumerate(("node0", "node1", "node2", None)):
        plan = t.writes.put_start([f"k{n}", f"j{n}"], [KB, KB], 2, preferred, False, 0, avoid=frozenset({"node0"}))
        assert _nodes(plan.tickets) == {"node1", "node2"}, preferred
    one = t.writes.put_start(["k"], [KB], 1, "node1", False, 0, avoid=frozenset({"node1", "node2"}))
    assert _nodes(one.tickets) == {"node0"}


def test_avoided_nodes_still_take_a_put_the_others_cannot() -> None:
    t = table("node0", "node1", dram=64 * KB)
    plan = t.writes.put_start(["k"], [KB], 2, None, False, 0, avoid=frozenset({"node0"}))
    assert _nodes(plan.tickets) == {"node0", "node1"}  # two copies need both
    only = t.writes.put_start(["j"], [KB], 1, None, False, 0, avoid=frozenset({"node0", "node1"}))
    assert len(_nodes(only.tickets)) == 1  # every node avoided: placed all the same


def test_a_grant_avoids_the_nodes_its_client_could_not_reach() -> None:
    t = table("node0", "node1", dram=64 * KB)
    for preferred in ("node0", None):
        grant = t.grants.grant_space(4 * KB, preferred, 1000, 0, avoid=frozenset({"node0"})).grant
        assert grant is not None and grant.node_id == "node1"


def _full(t: PlacementTable, *nodes: str) -> None:
    """Fill each of ``nodes``' 4 KiB of DRAM with committed blocks: the next put there evicts."""
    for node in nodes:
        for i in range(4):
            put(t, f"fill-{node}-{i}", node=node)


def test_a_put_plans_no_eviction_on_an_avoided_or_suspected_node_and_waits_for_none_there() -> None:
    """A frozen or cut-off node may answer its evictions only at its fence (a second in bench.chaos):
    while enough other nodes can hold the copies, a put that needs room evicts on those alone, and
    waits for their evictions, never for one sent to the shunned node."""
    for shun in ("avoid", "suspect"):
        t = table("node0", "node1", "node2")
        _full(t, "node0", "node1", "node2")
        avoid = frozenset({"node0"}) if shun == "avoid" else frozenset()
        if shun == "suspect":
            assert t.membership.suspect("node0", t.nodes["node0"].gen, t.nodes["node0"].last_seen_ms)
        plan = t.writes.put_start(["k"], [KB], 2, "node0", False, 0, avoid=avoid)
        assert plan.waiting == [0] and plan.commands, shun
        assert {c.node_id for c in plan.commands} == {"node1", "node2"}, shun  # the old code evicted on node0 too
        run(t, plan.commands)
        again = t.writes.put_start(["k"], [KB], 2, "node0", False, 0, avoid=avoid)
        assert _nodes(again.tickets) == {"node1", "node2"}, shun


def _pinned_full(t: PlacementTable, node: str) -> None:
    for i in range(4):
        t.writes.put_start([f"pin-{node}-{i}"], [KB], 1, node, True, 0)
        assert t.writes.put_end([f"pin-{node}-{i}"], [7]) == [True]


def test_a_suspected_node_with_evictions_in_flight_holds_no_put_back() -> None:
    """Its evictions were sent before it was suspected and are still unanswered; the others cannot
    take the second copy now (pinned full): the put is told to retry (the node is fenced within a
    second, or answers again), neither held until its fence (the old code counted those evictions as
    room to come) nor given one copy of the two it asked for."""
    t = table("node0", "node1", "node2")
    _full(t, "node0")
    _pinned_full(t, "node2")
    early = t.writes.put_start(["e"], [KB], 1, "node0", False, 0)
    assert {c.node_id for c in early.commands} == {"node0"} and t.nodes["node0"].inflight  # sent, never answered
    assert t.membership.suspect("node0", t.nodes["node0"].gen, t.nodes["node0"].last_seen_ms)
    used = t.nodes["node1"].alloc.used
    plan = t.writes.put_start(["k"], [KB], 2, None, False, 0)
    [ticket] = plan.tickets
    assert plan.waiting == [] and ticket is not None and ticket.error_code == RetryLater.code, plan
    assert "node0" in ticket.error and t.nodes["node1"].alloc.used == used  # node1's extent given back


def test_a_put_needing_the_shunned_node_waits_for_it_as_for_any_node() -> None:
    """Two copies on two nodes, one of them avoided: it cannot be done without, so its eviction is
    planned and waited for as before."""
    t = table("node0", "node1")
    _full(t, "node0", "node1")
    plan = t.writes.put_start(["k"], [KB], 2, None, False, 0, avoid=frozenset({"node0"}))
    assert plan.waiting == [0] and {c.node_id for c in plan.commands} == {"node0", "node1"}


def test_a_put_the_answering_nodes_cannot_take_now_is_told_to_retry_naming_the_shunned_node() -> None:
    """The nodes that answer are full of pinned blocks; the avoided one has no room without evicting:
    RetryLater naming it (the put is not held until its fence, nor told the store is full)."""
    t = table("node0", "node1", "node2")
    _full(t, "node0")
    _pinned_full(t, "node1")
    _pinned_full(t, "node2")
    plan = t.writes.put_start(["k"], [KB], 2, None, False, 0, avoid=frozenset({"node0"}))
    [ticket] = plan.tickets
    assert ticket is not None and ticket.error_code == RetryLater.code and "node0" in ticket.error, ticket
    assert plan.commands == [] and t.counters["room_refused_suspects"] == 1


def test_a_grant_plans_no_eviction_on_an_avoided_node() -> None:
    """The node that answers is full of pinned blocks, the avoided one of evictable ones: RetryLater
    naming it (the client puts the two-trip way meanwhile), not a wait on its evictions."""
    t = table("node0", "node1")
    _full(t, "node0")
    _pinned_full(t, "node1")
    plan = t.grants.grant_space(KB, "node0", 1000, 0, avoid=frozenset({"node0"}))
    assert plan.grant is None and not plan.waiting and plan.commands == []
    assert isinstance(plan.error, RetryLater) and "node0" in str(plan.error)
    assert t.grants.grant_space(KB, "node0", 1000, 0).waiting  # not avoided: its evictions are waited for
