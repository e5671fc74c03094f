from __future__ import annotations

from kvstore.placement.leases import Leases
from kvstore.policy import TierName

DRAM, SSD = TierName.DRAM, TierName.SSD
A, B = ("a", DRAM), ("b", SSD)


def leases() -> Leases:
    return Leases()


def test_a_replica_is_leased_while_any_lease_covering_it_is_live() -> None:
    ls = leases()
    first = ls.grant("k", [A, B], 1000)
    second = ls.grant("k", [A], 1500)
    assert ls.is_leased("a", DRAM, "k") and ls.is_leased("b", SSD, "k")
    assert not ls.is_leased("a", SSD, "k") and not ls.is_leased("a", DRAM, "other")
    assert ls.release(first)
    assert ls.is_leased("a", DRAM, "k") and not ls.is_leased("b", SSD, "k")
    assert not ls.release(first)  # ended already: nothing else ends
    assert ls.is_leased("a", DRAM, "k")
    assert ls.expire(1499) == 0 and ls.is_leased("a", DRAM, "k")
    assert ls.expire(1500) == 1 and not ls.is_leased("a", DRAM, "k")
    assert not ls.release(second) and len(ls) == 0
    ls.check()


def test_the_expiry_of_a_released_lease_ends_nothing_else() -> None:
    # Reader A leases at 0 for 1000 ms and releases at 100; reader B leases at 500: B holds to 1500.
    ls = leases()
    a = ls.grant("k", [A], 1000)
    ls.release(a)
    ls.grant("k", [A], 1500)
    assert ls.expire(1000) == 0 and ls.is_leased("a", DRAM, "k")
    assert ls.expire(1500) == 1 and not ls.is_leased("a", DRAM, "k")
    ls.check()


def test_ids_are_consecutive_and_next_id_names_the_next() -> None:
    ls = leases()
    first = ls.next_id
    ids = [ls.grant(k, [A], 1000) for k in ("x", "y", "z")]
    assert ids == [first, first + 1, first + 2] and ls.next_id == first + 3
    assert not ls.release(ls.next_id)  # never granted: nothing ends
    ls.check()


def test_counts_and_views_per_node_and_tier() -> None:
    ls = leases()
    ls.grant("k", [A], 10)
    ls.grant("j", [A, B], 10)
    ls.grant("j", [A], 10)
    assert ls.num_leased("a", DRAM) == 2 and ls.num_leased("b", SSD) == 1 and ls.num_leased("c", DRAM) == 0
    assert sorted(ls.leased_keys("a", DRAM)) == ["j", "k"] and list(ls.leased_keys("c", DRAM)) == []
    assert ls.expire(10) == 3 and ls.num_leased("a", DRAM) == 0
    ls.check()


def test_released_leases_do_not_pile_up_in_the_expiry_heap() -> None:
    """Readers release their leases long before they expire: what the heap keeps for them stays
    bounded by the live leases, not by the reads of the last lease period."""
    leases = Leases()
    keep = [leases.grant(f"k{i}", [("n", TierName.DRAM)], 10**9) for i in range(10)]
    for i in range(20_000):
        leases.release(leases.grant(f"r{i}", [("n", TierName.DRAM)], 10**9))
    assert len(leases) == 10 and len(leases._deadlines) <= 2 * 10 + 1025
    assert all(leases.key_of(lease) == f"k{i}" for i, lease in enumerate(keep))
    assert leases.expire(10**9) == 10 and len(leases) == 0


def test_one_grant_of_many_keys_ends_lease_by_lease() -> None:
    # A get of three keys: ids consecutive from the first; releasing one leaves the others' replicas
    # leased, and the grant's expiry ends only the leases still live.
    ls = leases()
    first = ls.grant_many(["x", "y", "z"], [(A,), (A, B), ()], 1000)
    assert ls.next_id == first + 3
    assert [ls.key_of(first + i) for i in range(3)] == ["x", "y", "z"]  # type: ignore[arg-type]
    assert ls.release(first + 1)  # type: ignore[arg-type]
    assert not ls.is_leased("a", DRAM, "y") and not ls.is_leased("b", SSD, "y")
    assert ls.is_leased("a", DRAM, "x") and len(ls) == 2
    ls.check()
    assert ls.expire(1000) == 2 and len(ls) == 0
    assert not ls.release(first) and ls.key_of(first) is None
    ls.check()


def test_released_grants_do_not_pile_up_in_the_expiry_heap() -> None:
    ls = leases()
    for _ in range(5000):
        first = ls.grant_many(["k", "j"], [(A,), (A,)], 10**9)
        ls.release(first)
        ls.release(first + 1)  # type: ignore[arg-type]
    assert len(ls) == 0 and len(ls._deadlines) <= 1024 + 1
    ls.check()
