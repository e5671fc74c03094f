"""The placement table's columns: LRU logs against the reference LRU, batch rows against single
ones, slot and row reuse, and what a key costs in memory."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from kvstore.errors import InvalidArgument
from kvstore.lru import LRU
from kvstore.placement.records import COMMITTED, PINNED, S_READY, T_DRAM, Records, TierLRU
from kvstore.placement.table import PlacementTable


def _records(n: int, owners: int = 1) -> tuple[Records, list[int]]:
    """``n`` keys with a DRAM replica each; with ``owners`` > 1, key i belongs to owner ``t{i % owners}``."""
    rec = Records()
    node = rec.intern_node("a", 64)
    ids = [rec.intern_owner(f"t{o}") for o in range(owners)] if owners > 1 else [0]
    rows = []
    for i in range(n):
        state = COMMITTED | (PINNED if i % 7 == 0 else 0)
        slot = rec.add_key(f"k{i}", 100 + i, 0, state, 0, ids[i % len(ids)])
        rows.append(rec.add_replica(slot, node, T_DRAM, i * 256, S_READY, i + 1))
    return rec, rows


@pytest.mark.parametrize(("seed", "owners"), [(s, 1) for s in range(4)] + [(s, 3) for s in range(4)])
def test_a_tier_lru_keeps_the_reference_lrus_order_through_compactions(seed: int, owners: int) -> None:
    """Thousands of inserts, touches and removals (enough to compact the logs many times): the
    order, sizes, victims and pins are those of :class:`kvstore.lru.LRU` fed the same calls; with
    owners, each owner's victims are the model's victims of that owner, in the same order."""
    rng = random.Random(seed)
    rec, rows = _records(300, owners)
    lru = TierLRU(rec, 0, T_DRAM)
    model: LRU[str] = LRU()
    for _ in range(6000):
        row = rng.choice(rows)
        key = rec.keys[rec.r_slot[row]]
        assert key is not None
        op = rng.random()
        if key not in model and op < 0.6:
            lru.insert_row(row)
            model.insert(key, rec.size[rec.r_slot[row]])
            if rec.state[rec.r_slot[row]] & PINNED:
                model.pin(key)
        elif key in model and op < 0.8:
            lru.touch_row(row)
            model.touch(key)
        elif key in model:
            assert lru.remove(key) == model.remove(key)
        if rng.random() < 0.01:
            skip = set(rng.sample(sorted(model), min(5, len(model))))
            assert list(lru.victims(skip)) == list(model.victims(skip))
            for o in range(owners if owners > 1 else 0):
                mine = [(k, n) for k, n in model.victims(skip) if int(k[1:]) % owners == o]
                assert list(lru.of(rec.owner_ids[f"t{o}"]).victims(skip)) == mine
    lru.check()
    pinned = {k for k in model if model.is_pinned(k)}
    # Unpinned keys in the model's order; pins kept apart, after them (nothing evicts a pin).
    assert [k for k in lru if k not in pinned] == [k for k in model if k not in pinned]
    assert set(list(lru)[len(lru) - len(pinned) :]) == pinned and len(lru) == len(model)
    assert lru.total_bytes == model.total_bytes and lru.num_pinned == model.num_pinned
    for log in lru._logs.values():
        assert len(log.rows) <= 2 * log.members + 1024 + 1  # compacted as it went
        assert not any(rec.state[rec.r_slot[r]] & PINNED for r in log.rows)  # victims never walk pins


def test_batched_touches_and_inserts_order_as_one_at_a_time() -> None:
    rec, rows = _records(20)
    one, many = TierLRU(rec, 0, T_DRAM), TierLRU(rec, 0, T_DRAM)
    for row in rows[:10]:
        one.insert_row(row)
    order = [rows[i] for i in (3, 1, 4, 1, 5, 9)]
    for row in order:
        one.touch_row(row)
    expected = list(one)
    for row in rows[:10]:
        one.remove_row(row)
    many.insert_rows(rows[:10])
    many.touch_rows(order)
    assert list(many) == expected


def test_slots_and_rows_are_reused_and_a_run_matches_key_by_key() -> None:
    rec = Records()
    node = rec.intern_node("a", 64)
    rec.add_run(["x", "y", "z"], [1, 2, 3], 0, range(1, 4), node, [0, 64, 128], range(10, 13), 99)
    assert (
        rec.index == {"x": 0, "y": 1, "z": 2} and rec.rows(1) == [1] and rec.deadlines == dict.fromkeys((0, 1, 2), 99)
    )
    rec.check()
    row = rec.rows(1)[0]
    rec.remove_replica(row)
    rec.drop_key(1)
    rec.check()
    # A freed slot and row are reused; a run then goes key by key, with the same result.
    rec.add_run(["v", "w"], [5, 6], 0, range(4, 6), node, [192, 256], range(20, 22), 7)
    rec.check()
    assert sorted(rec.index.values()) == [0, 1, 2, 3] and rec.index["v"] == 1
    assert [rec.r_offset[r] for r in rec.rows(rec.index["w"])] == [256] and rec.deadlines[rec.index["w"]] == 7


def test_a_key_costs_less_than_half_of_what_it_did_as_objects() -> None:
    """20,000 committed one-replica keys: the table's own memory per key (its columns, index, LRU log
    and allocator; not the key strings, which any master keeps). As objects it was 512 B a key."""
    table = PlacementTable(keys_by_owner=False)
    table.register_node("a", "a:1", 1 << 30, 0, 64, [], 0)
    keys = [f"key-{i:07d}" for i in range(20_000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for s in range(0, len(keys), 500):
        batch = keys[s : s + 500]
        table.put_start(batch, [256] * len(batch), 1, None, False, 0)
        assert table.put_end(batch, list(range(s, s + len(batch)))) == [True] * len(batch)
    per_key = (tracemalloc.get_traced_memory()[0] - before) / len(keys)
    tracemalloc.stop()
    table.check()
    assert per_key < 256, f"{per_key:.0f} B a key"


def test_a_checksum_the_columns_cannot_hold_is_refused_by_name() -> None:
    table = PlacementTable()
    table.register_node("a", "a:1", 1 << 20, 0, 64, [], 0)
    table.put_start(["k"], [100], 1, None, False, 0)
    for bad in (-1, 1 << 64, 1.5):
        with pytest.raises(InvalidArgument, match="checksum"):
            table.put_end(["k"], [bad])  # type: ignore[list-item]
    assert table.put_end(["k"], [(1 << 64) - 1]) == [True]
    table.check()
