from kvstore.lru import LRU
from kvstore.policy import Action, ActionKind, EvictionPolicy, TierName, TierView

DEMOTE, DROP, PROMOTE = ActionKind.DEMOTE, ActionKind.DROP, ActionKind.PROMOTE
DRAM, SSD = TierName.DRAM, TierName.SSD


def tier(capacity: int, *keys: str, size: int = 10) -> TierView[str]:
    lru: LRU[str] = LRU()
    for k in keys:
        lru.insert(k, size)
    return TierView(capacity, len(keys) * size, lru)


def test_nothing_to_do_below_the_high_watermark() -> None:
    policy = EvictionPolicy(0.9, 0.5)
    assert policy.make_room(tier(100, "a", "b"), None, incoming=10) == []


def test_evicts_down_to_the_low_watermark_in_lru_order_without_ssd() -> None:
    policy = EvictionPolicy(0.9, 0.5)
    dram = tier(100, "a", "b", "c", "d", "e", "f", "g", "h", "i")
    actions = policy.make_room(dram, None, incoming=10)
    # 90 + 10 bytes must come down to 50: five victims, oldest first.
    assert actions == [Action(DROP, k, DRAM, 10) for k in "abcde"]


def test_demotes_to_ssd_when_it_has_room() -> None:
    policy = EvictionPolicy(1.0, 1.0)
    actions = policy.make_room(tier(30, "a", "b", "c"), tier(100, "x"), incoming=10)
    assert actions == [Action(DEMOTE, "a", DRAM, 10)]


def test_full_ssd_drops_its_own_lru_first() -> None:
    policy = EvictionPolicy(1.0, 1.0)
    ssd = tier(30, "x", "y", "z")
    ssd.lru.pin("x")
    actions = policy.make_room(tier(30, "a", "b", "c"), ssd, incoming=20)
    assert actions == [
        Action(DROP, "y", SSD, 10),
        Action(DROP, "z", SSD, 10),
        Action(DEMOTE, "a", DRAM, 10),
        Action(DEMOTE, "b", DRAM, 10),
    ]


def test_when_ssd_cannot_make_room_the_oldest_victims_are_dropped() -> None:
    policy = EvictionPolicy(1.0, 1.0)
    ssd = tier(30, "x", "y", "z")
    ssd.lru.pin("x")
    ssd.lru.lease("y")
    actions = policy.make_room(tier(30, "a", "b", "c"), ssd, incoming=20)
    assert actions == [Action(DROP, "z", SSD, 10), Action(DEMOTE, "b", DRAM, 10), Action(DROP, "a", DRAM, 10)]


def test_victims_skip_pinned_and_leased_dram_blocks() -> None:
    policy = EvictionPolicy(1.0, 1.0)
    dram = tier(30, "a", "b", "c")
    dram.lru.pin("a")
    dram.lru.lease("b")
    assert policy.make_room(dram, None, incoming=10) == [Action(DROP, "c", DRAM, 10)]
    dram.lru.pin("c")
    assert policy.make_room(dram, None, incoming=10) == []


def test_keys_the_views_say_are_leased_are_never_victims() -> None:
    # The master keeps leases outside the LRU (kvstore.placement.leases): the views carry them.
    policy = EvictionPolicy(1.0, 1.0)
    dram, ssd = tier(30, "a", "b", "c"), tier(30, "x", "y", "z")
    dram = TierView(dram.capacity, dram.used, dram.lru, {"a"})
    ssd = TierView(ssd.capacity, ssd.used, ssd.lru, {"x"})
    assert policy.make_room(dram, ssd, incoming=20) == [
        Action(DROP, "y", SSD, 10),
        Action(DROP, "z", SSD, 10),
        Action(DEMOTE, "b", DRAM, 10),
        Action(DEMOTE, "c", DRAM, 10),
    ]
    assert policy.make_slots(dram, None, used=3, capacity=3) == [Action(DROP, "b", DRAM, 10)]


def test_force_bytes_frees_even_below_the_watermark() -> None:
    policy = EvictionPolicy(0.9, 0.5)
    assert policy.make_room(tier(100, "a", "b"), None, incoming=10, force_bytes=15) == [
        Action(DROP, "a", DRAM, 10),
        Action(DROP, "b", DRAM, 10),
    ]


def test_blocks_larger_than_ssd_are_dropped_not_demoted() -> None:
    policy = EvictionPolicy(1.0, 1.0)
    dram = tier(100, "a", "b", size=50)
    assert policy.make_room(dram, tier(40), incoming=50) == [Action(DROP, "a", DRAM, 50)]


def test_promotion_after_n_hits() -> None:
    policy = EvictionPolicy(promote_after_hits=2)
    assert not policy.should_promote(1) and policy.should_promote(2)
    assert not EvictionPolicy(promote_after_hits=0).should_promote(100)
    assert policy.promote("k", 5) == Action(PROMOTE, "k", SSD, 5)


def test_out_of_slots_evicts_down_to_the_low_watermark_of_slots() -> None:
    policy = EvictionPolicy(high_watermark=0.9, low_watermark=0.5)
    dram = tier(10_000, *(f"k{i}" for i in range(10)))  # bytes to spare: only slots are short
    actions = policy.make_slots(dram, None, used=10, capacity=10)
    assert [(a.kind, a.key) for a in actions] == [(ActionKind.DROP, f"k{i}") for i in range(6)]  # 11 - 5
    ssd = tier(1_000)
    assert {a.kind for a in policy.make_slots(dram, ssd, used=10, capacity=10)} == {ActionKind.DEMOTE}
    assert len(policy.make_slots(dram, None, used=3, capacity=10)) == 1  # at least one
