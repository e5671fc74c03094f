"""The placement table's cheaper paths behave as the plain ones: a batch of puts reserved as one
run, and tenants' victims found with or without the index of keys by owner."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidKey
from kvstore.policy import ActionKind
from tests.unit.placement import KB, put, table


def test_a_batch_of_new_keys_is_reserved_as_one_run_unless_it_must_evict() -> None:
    # Three new keys (and one already stored, and a repeat) fit on the preferred node: one run there.
    t = table("a", "b", dram=8 * KB)
    put(t, "old", node="a")
    plan = t.writes.put_start(["k1", "old", "k2", "k1", "k3"], [KB] * 5, 1, "a", False, 0)
    statuses = [tk.status if tk is not None else None for tk in plan.tickets]
    assert statuses == ["ok", "exists", "ok", "exists", "ok"] and plan.commands == []
    offsets = [tk.replicas[0].offset for tk in plan.tickets if tk is not None and tk.status == "ok"]
    assert offsets == [KB, 2 * KB, 3 * KB] and {
        tk.replicas[0].node_id for tk in plan.tickets if tk and tk.replicas
    } == {"a"}
    t.writes.put_end(["k1", "k2", "k3"], [1, 2, 3])
    t.check()
    # A batch that fills the node past its high watermark is placed key by key: the keys that no
    # longer fit make room by evicting the least recently used, exactly as they would alone.
    more = t.writes.put_start([f"m{i}" for i in range(5)], [KB] * 5, 1, "a", False, 1)
    assert more.commands and more.commands[0].kind is ActionKind.DROP and more.commands[0].keys[0] == "old"
    t.check()


@pytest.mark.parametrize("by_owner", [True, False])
def test_a_tenants_victims_are_its_own_oldest_keys_with_or_without_the_owner_index(by_owner: bool) -> None:
    t = table("a", dram=16 * KB, keys_by_owner=by_owner)
    put(t, "alice/1", "bob/1", "alice/2", "alice/3")
    t.reads.get_replicas(["alice/1"], 1, lease=False)  # alice/1 is now her most recently used
    assert t.moves.tenant_victims("alice", 2 * KB) == ["alice/2", "alice/3"]
    assert t.moves.tenant_victims("alice", KB, keep={"alice/2"}) == ["alice/3"]
    assert t.accounts.usage("alice") == 3 * KB and bool(t._catalog.owned) is by_owner
    t.check()


def test_a_get_or_exists_with_a_bad_key_changes_nothing() -> None:
    t = table("a")
    put(t, "x")
    before = dict(t.counters)
    clock = t._catalog.clock
    for call in (lambda: t.reads.get_replicas(["x", "nope", "é" * 300], 1), lambda: t.reads.exists(["x", ""])):
        with pytest.raises(InvalidKey):
            call()
    assert dict(t.counters) == before and t._catalog.clock == clock and len(t.leases) == 0
    assert t.reads.exists([b"x"]) == [True]  # type: ignore[list-item]  # bytes keys are decoded, as before
