"""Nodes a client could not reach (``PutStart.avoid``, ``GrantSpace.avoid``) are placed on last: a
node the master reaches may be cut off from that one client, or frozen and not yet suspected."""

from __future__ import annotations

from tests.unit.placement import KB, table


def _nodes(plan_tickets: list) -> set[str]:  # type: ignore[type-arg]
    return {r.node_id for t in plan_tickets if t is not None for r in t.replicas}


def test_a_put_avoids_the_nodes_its_client_could_not_reach_while_others_take_it() -> None:
    t = table("node0", "node1", "node2", dram=64 * KB)
    for n, preferred in enumerate(("node0", "node1", "node2", None)):
        plan = t.put_start([f"k{n}", f"j{n}"], [KB, KB], 2, preferred, False, 0, avoid=frozenset({"node0"}))
        assert _nodes(plan.tickets) == {"node1", "node2"}, preferred
    one = t.put_start(["k"], [KB], 1, "node1", False, 0, avoid=frozenset({"node1", "node2"}))
    assert _nodes(one.tickets) == {"node0"}


def test_avoided_nodes_still_take_a_put_the_others_cannot() -> None:
    t = table("node0", "node1", dram=64 * KB)
    plan = t.put_start(["k"], [KB], 2, None, False, 0, avoid=frozenset({"node0"}))
    assert _nodes(plan.tickets) == {"node0", "node1"}  # two copies need both
    only = t.put_start(["j"], [KB], 1, None, False, 0, avoid=frozenset({"node0", "node1"}))
    assert len(_nodes(only.tickets)) == 1  # every node avoided: placed all the same


def test_a_grant_avoids_the_nodes_its_client_could_not_reach() -> None:
    t = table("node0", "node1", dram=64 * KB)
    for preferred in ("node0", None):
        grant = t.grant_space(4 * KB, preferred, 1000, 0, avoid=frozenset({"node0"})).grant
        assert grant is not None and grant.node_id == "node1"
