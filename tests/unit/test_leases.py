from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument
from kvstore.placement.leases import Leases
from kvstore.policy import TierName

DRAM, SSD = TierName.DRAM, TierName.SSD
A, B = ("a", DRAM), ("b", SSD)


def leases(late_ms: int = 0) -> Leases:
    return Leases(late_ms=late_ms)


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


def test_a_release_by_key_ends_the_lease_that_expires_first() -> None:
    ls = leases()
    late = ls.grant("k", [A], 2000)
    early = ls.grant("k", [B], 1000)
    assert ls.release_key("k")
    assert not ls.release(early) and ls.release(late)
    assert not ls.release_key("k") and not ls.release_key("never-leased")
    ls.check()


def test_a_release_by_key_after_its_lease_expired_spends_a_token_and_ends_nothing() -> None:
    ls = leases(late_ms=1000)
    ls.grant("k", [A], 1000)
    ls.expire(1000)  # A's lease ends unreleased: a token until 2000
    ls.grant("k", [A], 2100)
    assert not ls.release_key("k")  # A's release, late: B keeps its lease
    assert ls.is_leased("a", DRAM, "k")
    assert ls.release_key("k") and not ls.is_leased("a", DRAM, "k")
    ls.check()


def test_tokens_lapse_after_late_ms() -> None:
    ls = leases(late_ms=1000)
    ls.grant("k", [A], 1000)
    ls.grant("k", [A], 1500)
    ls.expire(1500)  # two tokens, lapsing at 2000 and 2500
    ls.grant("k", [A], 3000)
    ls.expire(2000)
    assert not ls.release_key("k")  # spends the one lapsing at 2500
    ls.expire(2500)
    assert ls.release_key("k")  # no token left: the live lease ends
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


@pytest.mark.parametrize("late_ms", [-1, 1.5, "10"])
def test_a_bad_late_ms_is_refused(late_ms: object) -> None:
    with pytest.raises(InvalidArgument, match="late_ms"):
        Leases(late_ms=late_ms)  # type: ignore[arg-type]
