import pytest

from kvstore.errors import NotFound
from kvstore.lru import LRU


def make(*keys: str) -> LRU[str]:
    lru: LRU[str] = LRU()
    for i, k in enumerate(keys):
        lru.insert(k, i + 1)
    return lru


def test_order_is_oldest_first_and_touch_makes_newest() -> None:
    lru = make("a", "b", "c")
    assert list(lru) == ["a", "b", "c"]
    lru.touch("a")
    assert list(lru) == ["b", "c", "a"]
    assert [k for k, _ in lru.victims()] == ["b", "c", "a"]


def test_reinsert_replaces_size_and_touches() -> None:
    lru = make("a", "b")
    lru.insert("a", 10)
    assert list(lru) == ["b", "a"] and lru.size_of("a") == 10 and lru.total_bytes == 12


def test_remove_returns_size_and_forgets_pins_and_leases() -> None:
    lru = make("a", "b", "c")
    lru.pin("b")
    lru.lease("c")
    assert lru.remove("b") == 2 and lru.remove("c") == 3
    lru.insert("b", 1)
    assert not lru.is_pinned("b") and not lru.is_leased("c")
    assert lru.total_bytes == 2


def test_victims_skip_pinned_and_leased_keys_in_exact_order() -> None:
    lru = make("a", "b", "c", "d", "e")
    lru.pin("a")
    lru.lease("c")
    lru.lease("c")
    assert [k for k, _ in lru.victims()] == ["b", "d", "e"]
    lru.release("c")
    assert [k for k, _ in lru.victims()] == ["b", "d", "e"]  # still one lease
    lru.release("c")
    lru.unpin("a")
    assert [k for k, _ in lru.victims()] == ["a", "b", "c", "d", "e"]


def test_victims_also_skip_keys_leased_elsewhere_in_exact_order() -> None:
    lru = make("a", "b", "c", "d")
    lru.pin("d")
    assert [k for k, _ in lru.victims({"b"})] == ["a", "c"]
    assert [k for k, _ in lru.victims({"zz": 1}.keys())] == ["a", "b", "c"]


def test_missing_keys_raise_not_found() -> None:
    lru = make("a")
    for op in (lru.touch, lru.remove, lru.pin, lru.lease):
        with pytest.raises(NotFound):
            op("zz")
    lru.unpin("zz")  # idempotent no-ops
    lru.release("zz")
