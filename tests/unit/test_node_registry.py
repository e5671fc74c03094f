"""The master's node registry: one entry per node of the table, links that follow the node's
address and epoch, a new term that starts empty, and views the admin API cannot change."""

from __future__ import annotations

import dataclasses
import time

import msgspec
import pytest

from kvstore.errors import InvalidArgument
from kvstore.placement.table import PlacementTable
from kvstore.policy import EvictionPolicy
from kvstore.protocol import InventoryItem, MasterHello, Nic, RegisterNode
from server.master.nodes import NodeRegistry

KB = 1024


def _register(node_id: str, address: str, inventory: list[InventoryItem] | None = None) -> RegisterNode:
    return RegisterNode(
        node_id, address, 64 * KB, 0, 64, inventory or [], [], "host", "/dev/shm/a", 7,
        [Nic("lo", "127.0.0.1", -1, -1)], False, "", 0, [],
    )  # fmt: skip


def _registry() -> NodeRegistry:
    return NodeRegistry(PlacementTable(EvictionPolicy(0.9, 0.8, 2), node_ttl_ms=10), command_timeout_s=1.0)


def test_registering_fills_the_table_and_the_registry_alike() -> None:
    nodes = _registry()
    item = InventoryItem("k", "dram", 0, 1000, 5)
    nodes.register(_register("n1", "127.0.0.1:1", [item]), now_ms=0)
    nodes.register(_register("n0", "127.0.0.1:2"), now_ms=0)
    assert set(nodes.table.nodes) == {"n0", "n1"}
    assert [i.node_id for i in nodes.infos()] == ["n0", "n1"]
    info = nodes.infos()[1]
    assert info.rails == ["127.0.0.1:1"] and info.arena_inode == 7 and info.up  # no rails: its address
    view = nodes.view("n1")
    assert view is not None and view.tiers["dram"]["blocks"] == 1 and not view.draining
    assert nodes.view("nope") is None


def test_a_bad_registration_leaves_both_untouched() -> None:
    nodes = _registry()
    nodes.register(_register("n0", "127.0.0.1:1"), now_ms=0)
    bad = [
        _register("", "127.0.0.1:1"),
        msgspec.structs.replace(_register("n0", "127.0.0.1:1"), dram_capacity=2**64 - 1),
        msgspec.structs.replace(_register("n0", "127.0.0.1:1"), alignment=3),
        msgspec.structs.replace(_register("n0", "127.0.0.1:1"), max_blocks=-1),
        _register("n0", "no-port"),
    ]
    for m in bad:
        with pytest.raises(InvalidArgument):
            nodes.register(m, now_ms=0)
    assert list(nodes.table.nodes) == ["n0"] and [i.node_id for i in nodes.infos()] == ["n0"]
    assert len(nodes.views()) == 1


def test_heartbeats_keep_transfer_figures_and_tell_unknown_nodes_to_register() -> None:
    nodes = _registry()
    assert not nodes.heartbeat("n0", {"tcp|a|out": 5}, now_ms=1)
    nodes.register(_register("n0", "127.0.0.1:1"), now_ms=0)
    assert nodes.heartbeat("n0", {"tcp|a|out": 5}, now_ms=1)
    view = nodes.view("n0")
    assert view is not None and dict(view.transfer_bytes) == {"tcp|a|out": 5}
    nodes.table.expire(100)  # silent past its TTL: fenced, still listed, down until it registers again
    assert [i.up for i in nodes.infos()] == [False]
    assert not nodes.heartbeat("n0", {}, now_ms=101) and [i.up for i in nodes.infos()] == [False]
    nodes.register(_register("n0", "127.0.0.1:1"), now_ms=102)
    assert nodes.heartbeat("n0", {}, now_ms=103) and [i.up for i in nodes.infos()] == [True]


def test_a_link_follows_the_nodes_address_and_carries_the_epoch() -> None:
    nodes = _registry()
    nodes.register(_register("n0", "127.0.0.1:1"), now_ms=0)
    first = nodes.link("n0", "blocks")
    assert first.address == "127.0.0.1:1" and first.hello is None  # no epoch: no fence
    nodes.register(_register("n0", "127.0.0.1:1"), now_ms=1)
    assert nodes.link("n0", "blocks") is first  # same daemon, same link
    grants = nodes.link("n0", "grants")
    assert grants is not first  # a lane of its own: never queued behind a slow drop
    nodes.epoch = 9
    nodes.register(_register("n0", "127.0.0.1:3"), now_ms=2)
    assert nodes.take_stale() == [first, grants]  # for the service to close
    moved = nodes.link("n0", "blocks")
    assert moved is not first and moved.address == "127.0.0.1:3" and moved.hello == MasterHello(9)
    assert nodes.take_stale() == []
    with pytest.raises(KeyError):
        nodes.link("nope", "blocks")


def test_a_new_term_starts_empty_and_hands_back_the_old_links() -> None:
    nodes = _registry()
    for i in range(2):
        nodes.register(_register(f"n{i}", f"127.0.0.1:{i + 1}"), now_ms=0)
    links = [nodes.link("n0", "blocks")]
    fresh = PlacementTable(EvictionPolicy(0.9, 0.8, 2), node_ttl_ms=10)
    assert nodes.reset(fresh) == links
    assert nodes.table is fresh and nodes.infos() == [] and nodes.views() == [] and nodes.links() == []


def test_views_cannot_change_the_registry() -> None:
    nodes = _registry()
    nodes.register(_register("n0", "127.0.0.1:1"), now_ms=0)
    nodes.heartbeat("n0", {"tcp|a|in": 1}, now_ms=1)
    view = nodes.views()[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.draining = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        view.transfer_bytes["tcp|a|in"] = 99  # type: ignore[index]
    again = nodes.view("n0")
    assert again is not None and again.transfer_bytes["tcp|a|in"] == 1


def test_inventory_items_that_cannot_be_blocks_are_left_out() -> None:
    nodes = _registry()
    items = [
        InventoryItem("good", "dram", 0, 100, 1),
        InventoryItem("", "dram", 128, 100, 1),
        InventoryItem("huge", "ssd", 0, 2**63, 1),
        InventoryItem("empty", "ssd", 0, 0, 1),
    ]
    nodes.register(_register("n0", "127.0.0.1:1", items), now_ms=0)
    assert set(nodes.table.objects) == {"good"}


def test_a_lease_to_serve_by_key_is_renewed_unless_it_lapsed_while_the_node_owes_drops() -> None:
    """The master renews a daemon's lease to serve by key at each heartbeat, but once it lapsed with
    drops owed (the removes waiting for them were answered on the lapse) not until they are made;
    before it granted any, a whole lease from the start of its term counts (a former leader's)."""
    nodes = NodeRegistry(PlacementTable(EvictionPolicy(0.9, 0.8, 2)), command_timeout_s=1.0, key_lease_s=0.05)
    now = time.monotonic()
    assert not nodes.key_lease_lapsed("n0", now) and nodes.key_lease_lapsed("n0", now + 0.06)  # the term's
    nodes.register(_register("n0", "127.0.0.1:1"), now_ms=0)
    assert nodes.renew_key_lease("n0", owes_drops=True)  # owed, but not lapsed: renewed
    time.sleep(0.06)
    assert nodes.key_lease_lapsed("n0", time.monotonic())
    assert not nodes.renew_key_lease("n0", owes_drops=True)  # lapsed while owing: until they are made
    assert nodes.key_lease_lapsed("n0", time.monotonic())
    assert nodes.renew_key_lease("n0", owes_drops=False)
    assert not nodes.key_lease_lapsed("n0", time.monotonic())
    assert not NodeRegistry(PlacementTable(), command_timeout_s=1.0).key_lease_lapsed("n0", now + 1e6)  # none: never
