import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.allocator import Allocator, Extent, ExtentSet
from kvstore.errors import InvalidArgument


def test_alloc_rounds_up_to_alignment_and_tracks_use() -> None:
    a = Allocator(4096, 64)
    e = a.alloc(100)
    assert e == Extent(0, 128)
    assert a.used == 128 and a.free_bytes == 4096 - 128
    a.check()


def test_returns_none_when_full_and_after_free_succeeds_again() -> None:
    a = Allocator(1024, 64)
    extents = [a.alloc(256) for _ in range(4)]
    assert a.alloc(64) is None
    a.free(extents[1])
    assert a.alloc(256) == extents[1]
    a.check()


def test_free_coalesces_both_neighbours() -> None:
    a = Allocator(1024, 64)
    x, y, z, w = (a.alloc(256) for _ in range(4))
    assert w is not None and x is not None and y is not None and z is not None
    a.free(x)
    a.free(z)
    assert a.largest_free == 256
    a.free(y)  # merges x, y, z into one extent
    assert a.largest_free == 768
    assert a.stats().num_free_extents == 1
    assert a.alloc(768) == Extent(0, 768)
    a.check()


def test_grow_adds_free_space_merged_with_a_free_tail() -> None:
    a = Allocator(1024, 64)
    x, y = a.alloc(512), a.alloc(256)
    assert x is not None and y is not None
    a.grow(2048 + 10)  # rounded down to the alignment
    assert a.capacity == 2048 and a.largest_free == 2048 - 768  # the free tail and the new range: one extent
    assert a.alloc(1280) == Extent(768, 1280)
    a.check()
    a.free(y)
    a.grow(4096)  # no free tail now: a new extent of its own
    assert a.stats().num_free_extents == 2 and a.largest_free == 2048
    a.check()
    with pytest.raises(InvalidArgument, match="does not extend"):
        a.grow(4096)


def test_best_fit_takes_the_smallest_extent_that_fits() -> None:
    a = Allocator(4096, 64)
    big, _, small, _ = a.alloc(1024), a.alloc(64), a.alloc(256), a.alloc(64)  # 64-byte separators
    assert big is not None and small is not None
    a.free(big)
    a.free(small)
    assert a.alloc(200) == Extent(small.offset, 256)


def test_stats_and_utilization() -> None:
    a = Allocator(1 << 20, 4096)
    for _ in range(128):
        a.alloc(4096)
    s = a.stats()
    assert s.used == 128 * 4096 and s.num_allocated == 128
    assert s.utilization == pytest.approx(0.5)
    assert s.largest_free == (1 << 20) - 128 * 4096


@pytest.mark.parametrize("size", [0, -1, 1.5, "8"])
def test_bad_sizes_are_rejected(size: object) -> None:
    with pytest.raises(InvalidArgument):
        Allocator(4096, 64).alloc(size)  # type: ignore[arg-type]


@pytest.mark.parametrize(("capacity", "alignment"), [(4096, 96), (4096, 0), (32, 64), ("1", 64)])
def test_bad_geometry_is_rejected(capacity: object, alignment: object) -> None:
    with pytest.raises(InvalidArgument):
        Allocator(capacity, alignment)  # type: ignore[arg-type]


def test_double_free_and_foreign_extents_are_errors() -> None:
    a = Allocator(4096, 64)
    e = a.alloc(64)
    assert e is not None
    a.free(e)
    with pytest.raises(InvalidArgument, match="double free"):
        a.free(e)
    with pytest.raises(InvalidArgument):
        a.free(Extent(128, 64))


def test_rebuild_restores_exactly_the_given_extents() -> None:
    a = Allocator.rebuild(4096, 64, [(1024, 100), (0, 64), (2048, 2048)])
    a.check()
    assert a.used == 64 + 128 + 2048
    assert a.alloc(2048) is None
    assert a.alloc(896) == Extent(1152, 896)  # best fit: the exact 896-byte gap, not the 960-byte one
    assert a.alloc(960) == Extent(64, 960)


@pytest.mark.parametrize("extents", [[(0, 128), (64, 64)], [(10, 64)], [(4096, 64)], [(0, 0)]])
def test_rebuild_rejects_overlapping_or_misplaced_extents(extents: list[tuple[int, int]]) -> None:
    with pytest.raises(InvalidArgument):
        Allocator.rebuild(4096, 64, extents)


def test_an_extent_set_refuses_overlaps_and_forgets_removed_extents() -> None:
    s = ExtentSet()
    s.add(Extent(64, 64))
    s.add(Extent(256, 128))
    s.add(Extent(128, 128))  # touching both neighbours is fine
    for bad in (Extent(0, 128), Extent(96, 8), Extent(300, 500), Extent(0, 1024)):
        with pytest.raises(InvalidArgument, match="overlaps"):
            s.add(bad)
    assert s.overlapping(Extent(0, 64)) is None and s.overlapping(Extent(384, 64)) is None
    assert s.overlapping(Extent(200, 1)) == Extent(128, 128)
    s.remove(Extent(128, 128))
    s.add(Extent(192, 64))
    with pytest.raises(InvalidArgument, match="not in the set"):
        s.remove(Extent(128, 128))
    assert len(s) == 3


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 60), st.integers(1, 8)), max_size=60))
def test_an_extent_set_agrees_with_a_byte_map(ops: list[tuple[bool, int, int]]) -> None:
    s, held, owner = ExtentSet(), [], [None] * 80
    for add, start, length in ops:
        extent = Extent(start, length)
        if add:
            free = all(owner[i] is None for i in range(start, start + length))
            assert (s.overlapping(extent) is None) == free
            if free:
                s.add(extent)
                held.append(extent)
                owner[start : start + length] = [extent] * length
        elif held:
            gone = held.pop(start % len(held))
            s.remove(gone)
            owner[gone.offset : gone.offset + gone.length] = [None] * gone.length
    assert len(s) == len(held)


def test_alloc_many_reserves_back_to_back_and_each_is_freed_alone() -> None:
    a = Allocator(4096, alignment=64)
    hole = a.alloc(128)  # a hole too small for the run below stays unused by it
    assert hole is not None
    wall = a.alloc(64)
    assert wall is not None
    a.free(hole)
    run = a.alloc_many([100, 64, 1])
    assert run == [Extent(192, 128), Extent(320, 64), Extent(384, 64)]
    assert a.used == 64 + 256
    a.free(run[1])
    a.free(run[0])
    a.free(run[2])
    a.free(wall)
    assert a.used == 0 and a.largest_free == 4096
    a.check()
    assert a.alloc_many([4096, 64]) is None and a.used == 0
    with pytest.raises(InvalidArgument):
        a.alloc_many([64, 0])


def test_an_untracked_allocator_is_checked_against_its_owners_extents() -> None:
    alloc = Allocator(4096, 64, track=False)
    a = alloc.alloc(100)
    offsets = alloc.alloc_offsets([64, 64, 200])
    assert a is not None and offsets == [128, 192, 256]
    held = [(a.offset, a.length), (128, 64), (192, 64), (256, 256)]
    alloc.check(held)
    with pytest.raises(AssertionError):
        alloc.check(held[:-1])  # an extent the owner forgot: the spans no longer tile the arena
    alloc.free(Extent(128, 64))
    alloc.check([h for h in held if h[0] != 128])
    with pytest.raises(InvalidArgument):
        alloc.free(Extent(128, 64))  # its start is free space now


def test_take_reserves_exactly_a_free_extent_or_nothing() -> None:
    a = Allocator(4096, alignment=64)
    first = a.alloc(1024)
    assert first == Extent(0, 1024)
    assert not a.take(Extent(512, 1024))  # overlaps an allocated extent
    assert not a.take(Extent(1000, 64))  # misaligned
    assert not a.take(Extent(4032, 128))  # past the end
    assert a.take(Extent(2048, 512))
    a.check([(0, 1024), (2048, 512)])
    assert a.alloc(1024) == Extent(1024, 1024) and a.alloc(1536) == Extent(2560, 1536)
    a.free(Extent(2048, 512))
    a.check([(0, 1024), (1024, 1024), (2560, 1536)])
