"""The placement table's columns: LRU logs against the reference LRU, batch rows against single
ones, slot and row reuse, what a key costs in memory, and a key's state as the named questions
answer it (against the bit expressions they replaced, over every reachable state)."""

from __future__ import annotations

import itertools
import random
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.lru import LRU
from kvstore.placement import records
from kvstore.placement.records import S_COPYING, S_DROPPING, S_MOVING, S_READY, T_DRAM, Records, TierLRU
from kvstore.placement.table import PlacementTable


def _records(n: int, owners: int = 1) -> tuple[Records, list[int]]:
    """``n`` keys with a DRAM replica each; with ``owners`` > 1, key i belongs to owner ``t{i % owners}``."""
    rec = Records()
    node = rec.intern_node("a", 64)
    ids = [rec.intern_owner(f"t{o}") for o in range(owners)] if owners > 1 else [0]
    rows = []
    for i in range(n):
        slot = rec.add_key(f"k{i}", 100 + i, 0, 0, ids[i % len(ids)], committed=True, pinned=i % 7 == 0)
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
            if rec.is_pinned(rec.r_slot[row]):
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
        assert not any(rec.is_pinned(rec.r_slot[r]) for r in log.rows)  # victims never walk pins


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
    rec.add_run(["x", "y", "z"], [1, 2, 3], range(1, 4), node, [0, 64, 128], range(10, 13), 99)
    assert (
        rec.index == {"x": 0, "y": 1, "z": 2} and rec.rows(1) == [1] and rec.deadlines == dict.fromkeys((0, 1, 2), 99)
    )
    rec.check()
    row = rec.rows(1)[0]
    rec.remove_replica(row)
    rec.drop_key(1)
    rec.check()
    # A freed slot and row are reused; a run then goes key by key, with the same result.
    rec.add_run(["v", "w"], [5, 6], range(4, 6), node, [192, 256], range(20, 22), 7)
    rec.check()
    assert sorted(rec.index.values()) == [0, 1, 2, 3] and rec.index["v"] == 1
    assert [rec.r_offset[r] for r in rec.rows(rec.index["w"])] == [256] and rec.deadlines[rec.index["w"]] == 7


def test_a_key_costs_less_than_half_of_what_it_did_as_objects() -> None:
    """20,000 committed one-replica keys: the table's own memory per key (its columns, index, LRU log
    and allocator; not the key strings, which any master keeps). As objects it was 512 B a key."""
    table = PlacementTable(keys_by_owner=False)
    table.membership.register_node("a", "a:1", 1 << 30, 0, 64, [], 0)
    keys = [f"key-{i:07d}" for i in range(20_000)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for s in range(0, len(keys), 500):
        batch = keys[s : s + 500]
        table.writes.put_start(batch, [256] * len(batch), 1, None, False, 0)
        assert table.writes.put_end(batch, list(range(s, s + len(batch)))) == [True] * len(batch)
    per_key = (tracemalloc.get_traced_memory()[0] - before) / len(keys)
    tracemalloc.stop()
    table.check()
    assert per_key < 256, f"{per_key:.0f} B a key"


def test_a_checksum_the_columns_cannot_hold_is_refused_by_name() -> None:
    table = PlacementTable()
    table.membership.register_node("a", "a:1", 1 << 20, 0, 64, [], 0)
    table.writes.put_start(["k"], [100], 1, None, False, 0)
    for bad in (-1, 1 << 64, 1.5):
        with pytest.raises(InvalidArgument, match="checksum"):
            table.writes.put_end(["k"], [bad])  # type: ignore[list-item]
    assert table.writes.put_end(["k"], [(1 << 64) - 1]) == [True]
    table.check()


# -- a key's state: each named predicate against the bit expression the parts used to write ----------
_C, _P, _R = records._COMMITTED, records._PINNED, records._REMOVING
_OLD: dict[str, Callable[[int], object]] = {
    "is_committed": lambda s: bool(s & _C),
    "is_pinned": lambda s: bool(s & _P),
    "is_removing": lambda s: bool(s & _R),
    "in_service": lambda s: s & (_C | _R) == _C,
    "is_writing": lambda s: not s & (_C | _R),
    "is_evictable": lambda s: s & (_C | _R | _P) == _C,
    "phase": lambda s: "removing" if s & _R else "committed" if s & _C else "writing",
}
_STATES = list(itertools.product((False, True), repeat=3))
"""Every reachable (committed, pinned, removing): a put may be revoked before or after its commit,
pinned or not."""


def _keyed(rec: Records, key: str, committed: bool, pinned: bool, removing: bool, write_id: int = 0) -> int:
    slot = rec.add_key(key, 100, 0, 0, write_id=write_id, committed=committed, pinned=pinned)
    if removing:
        rec.mark_removing(slot)
    return slot


@dataclass
class _Node:
    up: bool


@pytest.mark.parametrize(("committed", "pinned", "removing"), _STATES)
def test_each_predicate_answers_what_its_bit_expression_did(committed: bool, pinned: bool, removing: bool) -> None:
    rec = Records()
    slot = _keyed(rec, "k", committed, pinned, removing)
    bits = rec._state[slot]
    assert bits == (_C if committed else 0) | (_P if pinned else 0) | (_R if removing else 0)
    for name, old in _OLD.items():
        assert getattr(rec, name)(slot) == old(bits), name
    assert rec.committed == committed


def test_the_batch_predicates_answer_as_the_single_ones() -> None:
    rec = Records()
    node = rec.intern_node("a", 64)
    slots = [_keyed(rec, f"k{i}", *state) for i, state in enumerate(_STATES)]
    keys = [f"k{i}" for i in range(len(_STATES))] + ["unknown"]
    served = [s if _OLD["in_service"](rec._state[s]) else None for s in slots] + [None]
    assert rec.served_slots(keys) == served
    assert list(rec.served_items()) == [(f"k{i}", s) for i, s in enumerate(slots) if served[i] is not None]
    for committed in (True, False):
        want = [f"k{i}" for i, s in enumerate(slots) if rec.is_committed(s) == committed]
        assert rec.keys_committed(committed) == want
    # A read finds a key in service through a replica READY or between tiers, on a node that is up.
    for status in (S_READY, S_MOVING, S_COPYING, S_DROPPING):
        for up in (True, False):
            for slot in slots:
                row = rec.add_replica(slot, node, T_DRAM, 0, status, 1)
                found = _OLD["in_service"](rec._state[slot]) and status <= S_MOVING and up
                assert rec.is_found(slot, [_Node(up)]) == found
                assert not rec.is_found(slot, [None])  # its node left
                rec.remove_replica(row)


@pytest.mark.parametrize("run", [False, True])
def test_a_commit_takes_only_keys_its_put_is_writing(run: bool) -> None:
    """Of every state and a write id of this put or another, only a key being written (neither
    committed nor removing) by this put is committed: its bit set, its checksum and its count kept,
    its deadline gone; a run commits all of them or, if any is not so, none."""
    rec = Records()
    slots, ok = [], []
    for i, (state, write_id) in enumerate(itertools.product(_STATES, (7, 8))):
        slots.append(_keyed(rec, f"k{i}", *state, write_id=write_id))
        rec.deadlines[slots[-1]] = 99
        ok.append(_OLD["is_writing"](rec._state[slots[-1]]) and write_id == 7)
    before = [rec._state[s] for s in slots]
    keys, checksums = [f"k{i}" for i in range(len(slots))], list(range(100, 100 + len(slots)))
    committed = rec.committed
    if run:
        assert not rec.commit_run(np.array(slots, np.intp), checksums, 7)  # some are not this put's
        assert [rec._state[s] for s in slots] == before and rec.committed == committed
        mine = [s for s, good in zip(slots, ok, strict=True) if good]
        assert rec.commit_run(np.array(mine, np.intp), [checksums[s] for s in mine], 7)
        got = [s if good else -1 for s, good in zip(slots, ok, strict=True)]
    else:
        done, committed_slots = rec.commit_keys([*keys, keys[0]], [*checksums, 0], 7)
        assert done == [*ok, False]  # a key twice: its second is not
        assert committed_slots == [s for s, good in zip(slots, ok, strict=True) if good]
        got = [s if good else -1 for s, good in zip(slots, done[:-1], strict=True)]
    assert got == [s if good else -1 for s, good in zip(slots, ok, strict=True)]
    for s, good, old in zip(slots, ok, before, strict=True):
        assert rec._state[s] == (old | _C if good else old)
        assert (rec.checksum[s] == 100 + s) == good and (s in rec.deadlines) != good
    assert rec.committed == committed + sum(ok)
