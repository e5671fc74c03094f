"""Orphans in the placement table (issue 27): blocks a daemon holds that no put placed there are
told apart from the table's own, and their DRAM extents are kept out of placement until dropped."""

from __future__ import annotations

import pytest

from kvstore.allocator import Extent
from kvstore.errors import InvalidArgument
from tests.unit.placement import KB, put, table


def test_orphans_are_told_apart_and_their_extents_kept_out_of_placement_until_dropped() -> None:
    t = table("a", "b")
    put(t, "known", node="a")  # at offset 0 of a, checksum 7
    t.writes.put_start(["pending"], [KB], 1, "a", False, 0)  # reserved at 1024, not yet committed
    orphans = t.membership.check_blocks(
        "a", ["known", "pending", "gone", "other-bytes", "elsewhere"], [0, KB, 2 * KB, 0, 3 * KB], [KB] * 5,
        [7, 0, 5, 8, 7],
    )  # fmt: skip
    assert orphans == [False, False, True, True, True]
    # "gone" at 2048 was free: now out of placement; "other-bytes" lies over a known block: nothing taken.
    assert sorted(t.nodes["a"].quarantine) == ["elsewhere", "gone"] and t.nodes["a"].alloc.used == 4 * KB
    t.check()
    [ticket] = t.writes.put_start(["new"], [KB], 1, "a", False, 0).tickets
    assert ticket is not None and [r.node_id for r in ticket.replicas] == ["b"]  # a is full: not over an orphan
    assert t.membership.check_blocks("b", ["known"], [KB], [KB], [7]) == [True]  # not placed on b
    assert t.membership.check_blocks("nobody", ["x"], [0], [KB], [7]) == [False]  # registers again: adopted then
    t.membership.release_quarantine("a", ["gone", "elsewhere", "never-quarantined"])
    assert t.nodes["a"].quarantine == {} and t.nodes["a"].alloc.used == 2 * KB
    t.check()
    assert t.stats()["orphans"] == 4
    with pytest.raises(InvalidArgument, match="differ in length"):
        t.membership.check_blocks("a", ["x"], [], [KB], [7])


def test_an_orphan_of_a_key_reserved_elsewhere_on_the_node_is_one_and_its_extent_comes_back() -> None:
    t = table("a", dram=8 * KB)
    assert t.membership.check_blocks("a", ["k"], [4 * KB], [KB], [7]) == [True]  # an orphan at 4096, kept out
    assert t.nodes["a"].quarantine == {"k": Extent(4 * KB, KB)}
    [ticket] = t.writes.put_start(["k"], [KB], 1, "a", False, 0).tickets  # put again: reserved elsewhere
    assert ticket is not None and (at := ticket.replicas[0].offset) != 4 * KB
    assert t.membership.check_blocks("a", ["k"], [4 * KB], [KB], [7]) == [True]  # the old block: still an orphan
    assert t.membership.check_blocks("a", ["k"], [at], [KB], [0]) == [False]  # the new one: the orphan is gone
    assert t.nodes["a"].quarantine == {} and t.nodes["a"].alloc.used == KB
    t.check()
