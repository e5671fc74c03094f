"""The placement table's KV events: a subscriber that applies them in order holds exactly the
replicas the table stores, through puts, replicas, demotions, promotions, evictions, removes,
nodes that leave and inventories that come back; and the events' wire form is vLLM's."""

from __future__ import annotations

import random

import msgspec

from kvstore.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlock,
    decode_batch,
    encode_batch,
    key_hash,
)
from kvstore.placement.state import NodeCommand
from kvstore.placement.table import PlacementTable
from kvstore.policy import EvictionPolicy, TierName
from kvstore.results import HeldBlock
from tests.unit.placement import EXACT, KB, got, put, table

Held = set[tuple[str, str, str]]
"""(key, node, medium) a subscriber believes stored."""


def follow(held: Held, events: list[BlockStored | BlockRemoved | AllBlocksCleared], cleared: set[str]) -> None:
    """Apply ``events``: strictly (nothing stored twice, nothing removed that was not stored),
    but for the nodes ``cleared`` (fenced: their removals may name what was forgotten)."""
    for e in events:
        if isinstance(e, AllBlocksCleared):
            assert e.backend_id is not None
            cleared.add(e.backend_id)
            held -= {h for h in held if h[1] == e.backend_id}
            continue
        assert e.object_key is not None and e.backend_id is not None and e.medium is not None
        item = (e.object_key, e.backend_id, e.medium)
        if isinstance(e, BlockStored):
            assert item not in held, f"stored twice: {item}"
            held.add(item)
        else:
            assert item in held or e.backend_id in cleared, f"removed but never stored: {item}"
            held.discard(item)


def run(t: PlacementTable, commands: list[NodeCommand]) -> None:
    """The daemons carry out ``commands``; those for a fenced node are settled without it."""
    for c in commands:
        node = t.nodes.get(c.node_id)
        if node is not None and node.fenced:
            t.settle_fenced(c)
        else:
            t.apply(c, [True] * len(c.keys))
    t.check()


def truth(t: PlacementTable) -> Held:
    """What the table stores: every committed key's replicas that readers are sent to, by tier."""
    out: Held = set()
    for key in t.inspection.stored_keys(""):
        described = t.inspection.describe(key)
        assert described is not None
        for r in described["replicas"]:  # type: ignore[attr-defined]
            if r["status"] == "ready" and r["node_up"]:
                out.add((key, r["node_id"], "cpu" if r["tier"] == "dram" else "disk"))
    return out


def test_events_rebuild_what_the_table_stores_through_every_kind_of_change() -> None:
    rng = random.Random(7)
    t = table("a", "b", "c", dram=8 * KB, ssd=6 * KB, policy=EvictionPolicy(1.0, 1.0, promote_after_hits=2))
    t.kv_events.tell_changes()
    held: Held = set()
    cleared: set[str] = set()
    gone_inventories: dict[str, tuple[list[HeldBlock], bool]] = {}
    for step in range(600):
        op = rng.random()
        if op < 0.45:
            keys = [f"k{rng.randrange(60)}" for _ in range(rng.randrange(1, 4))]
            plan = t.writes.put_start(
                list(dict.fromkeys(keys)), [KB] * len(set(keys)), rng.choice([1, 2]), None, False, step
            )
            run(t, plan.commands)
            ok = [k for k, tk in zip(dict.fromkeys(keys), plan.tickets, strict=True) if tk and tk.status == "ok"]
            t.writes.put_end(ok, [7] * len(ok))
        elif op < 0.65:
            keys = [f"k{rng.randrange(60)}" for _ in range(3)]
            t.reads.release_leases(got(t.reads.get_replicas(keys, step)))
            run(t, t.expire(step))  # promotions of SSD blocks read often
        elif op < 0.8:
            _, commands = t.remove([f"k{rng.randrange(60)}"])
            run(t, commands)
        elif op < 0.88:
            if rng.random() < 0.5:
                run(t, t.moves.evict_keys([f"k{rng.randrange(60)}"])[2])
            elif up := sorted(n for n in t.nodes if t.nodes[n].up):
                run(t, t.moves.evict_tier(rng.choice(up), TierName.DRAM)[1])
        elif op < 0.94 and len(t.nodes) > 1 and not gone_inventories:
            n = rng.choice(sorted(t.nodes))
            inventory = [
                HeldBlock(key, TierName(r["tier"]), r["offset"], KB, 7)
                for key in t.inspection.stored_keys("")
                for r in t.inspection.describe(key)["replicas"]  # type: ignore[index]
                if r["node_id"] == n and r["status"] == "ready"
            ]
            fenced = rng.random() < 0.5
            if not fenced:
                run(t, t.membership.leave_node(n))
            else:  # its daemon found gone: fenced, its blocks unread until it registers again
                node = t.nodes[n]
                assert t.membership.fence_gone(n, node.gen, node.last_seen_ms)
            gone_inventories[n] = (inventory, fenced)
        elif gone_inventories:
            n, (inventory, fenced) = gone_inventories.popitem()
            # A daemon that left comes back with what was not put elsewhere meanwhile; a fenced
            # one with all it held (the table drops what was removed meanwhile).
            keep = inventory if fenced else [b for b in inventory if b.key not in t.objects]
            run(t, t.membership.register_node(n, f"{n}:1", 8 * KB, 6 * KB, 64, keep, now_ms=step))
            assert t.membership.heartbeat(n, step)
        t.check()
        follow(held, t.kv_events.take_events(), cleared)
        assert held == truth(t), f"step {step}"
    assert len(held) > 10 and len(cleared) >= 2  # stored something to the end; fenced nodes on the way


def test_no_events_are_kept_unless_asked() -> None:
    t = table("a")
    put(t, "k0")
    assert t.kv_events.take_events() == []
    t.kv_events.tell_changes()
    put(t, "k1")
    [e] = t.kv_events.take_events()
    assert isinstance(e, BlockStored) and (e.object_key, e.backend_id, e.medium) == ("k1", "a", "cpu")
    t.kv_events.tell_changes(False)
    put(t, "k2")
    assert t.kv_events.take_events() == []


def test_an_inventory_is_told_as_stored_replicas() -> None:
    t = PlacementTable(EXACT)
    t.kv_events.tell_changes()
    inventory = [HeldBlock("x", TierName.DRAM, 0, KB, 7), HeldBlock("y", TierName.SSD, -1, KB, 7)]
    run(t, t.membership.register_node("a", "a:1", 8 * KB, 8 * KB, 64, inventory, 0))
    events = t.kv_events.take_events()
    assert {(e.object_key, e.medium) for e in events} == {("x", "cpu"), ("y", "disk")}
    assert all(isinstance(e, BlockStored) for e in events)


def test_labelled_keys_carry_the_engines_hashes_until_their_removal() -> None:
    t = table("a")
    t.kv_events.tell_changes()
    label = EngineBlock(b"\x01" * 32, b"\x02" * 32, [5, 6, 7, 8], 4)
    t.kv_events.label(["k0"], [label])
    put(t, "k0", "k1")
    stored = {e.object_key: e for e in t.kv_events.take_events()}
    k0, k1 = stored["k0"], stored["k1"]
    assert isinstance(k0, BlockStored) and isinstance(k1, BlockStored)
    assert (k0.block_hashes, k0.parent_block_hash, k0.token_ids, k0.block_size) == ([b"\x01" * 32], b"\x02" * 32,
                                                                                     [5, 6, 7, 8], 4)  # fmt: skip
    assert k1.block_hashes == [key_hash("k1")] and k1.token_ids == [] and k1.parent_block_hash is None
    run(t, t.remove(["k0"])[1])
    [gone] = t.kv_events.take_events()
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == [b"\x01" * 32]
    put(t, "k0")  # the key's label went with it
    [again] = t.kv_events.take_events()
    assert isinstance(again, BlockStored) and again.block_hashes == [key_hash("k0")]
    t.kv_events.label(["k1"], [EngineBlock(b"\x05" * 32)])  # stored already: it keeps the name its store was told by
    run(t, t.remove(["k1"])[1])
    t.kv_events.label(["k1"], [EngineBlock(b"\x06" * 32)])
    put(t, "k1")  # removed and put again under a label, between two takes
    gone, back = t.kv_events.take_events()
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == [key_hash("k1")]
    assert isinstance(back, BlockStored) and back.block_hashes == [b"\x06" * 32]


def test_key_hashes_follow_the_keys_kinds() -> None:
    assert key_hash("ns/" + "ab" * 16) == bytes.fromhex("ab" * 16)
    assert key_hash("ab" * 16) == bytes.fromhex("ab" * 16)
    assert key_hash("12345") == 12345 and key_hash("0x2a") == 42  # numbers, as Mooncake's master parses keys
    assert key_hash(str(1 << 64)) == key_hash(str(1 << 64)) and isinstance(key_hash(str(1 << 64)), bytes)
    assert isinstance(key_hash("some/object"), bytes) and len(key_hash("some/object")) == 16  # type: ignore[arg-type]
    assert key_hash("a") != key_hash("b")


class _VllmStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    """vLLM 0.32's ``BlockStored`` as its own decoder declares it (fields copied by name and type)."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[object, ...] | None] | None = None
    group_idx: int | None = None


class _VllmRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class _VllmCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True):
    pass


class _VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[_VllmStored | _VllmRemoved | _VllmCleared]
    data_parallel_rank: int | None = None


def test_a_batch_decodes_with_vllms_own_declarations_and_ours() -> None:
    events = [
        BlockStored(
            [b"\x03" * 16], None, [], 0, None, "disk", None, backend_id="node-1", object_key="k", tenant_id="t1"
        ),
        BlockRemoved([42], "cpu", backend_id="node-2", object_key="42"),
        AllBlocksCleared(),
    ]
    payload = encode_batch(12.5, events)
    theirs = msgspec.msgpack.decode(payload, type=_VllmBatch)
    assert theirs.ts == 12.5 and [type(e).__name__ for e in theirs.events] == ["_VllmStored", "_VllmRemoved",
                                                                                 "_VllmCleared"]  # fmt: skip
    first = theirs.events[0]
    assert isinstance(first, _VllmStored) and first.block_hashes == [b"\x03" * 16] and first.medium == "disk"
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["backend_id"] == "node-1"  # Mooncake's fields
    assert decode_batch(payload).events == events
