"""The allocator against a model: the set of live extents."""

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvstore.allocator import Allocator, Extent

CAPACITY = 64 * 1024
ALIGN = 64


class AllocatorMachine(RuleBasedStateMachine):
    extents = Bundle("extents")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = Allocator(CAPACITY, ALIGN)
        self.live: set[Extent] = set()

    @rule(target=extents, size=st.one_of(st.integers(1, 4096), st.sampled_from([1024, 4096, 16384])))
    def allocate(self, size: int) -> Extent | None:
        free_before = self.alloc.largest_free
        extent = self.alloc.alloc(size)
        rounded = -(-size // ALIGN) * ALIGN
        if extent is None:
            # Best fit fails only when no free extent is large enough.
            assert free_before < rounded
            return None
        assert extent.length == rounded and extent.offset % ALIGN == 0
        assert extent.offset >= 0 and extent.end <= CAPACITY
        for other in self.live:
            assert extent.end <= other.offset or other.end <= extent.offset, f"{extent} overlaps {other}"
        self.live.add(extent)
        return extent

    @rule(extent=consumes(extents))
    def free(self, extent: Extent | None) -> None:
        if extent is None:
            return
        self.alloc.free(extent)
        self.live.remove(extent)

    @invariant()
    def accounting_matches_the_model(self) -> None:
        assert self.alloc.used == sum(e.length for e in self.live) <= CAPACITY
        self.alloc.check()


TestAllocator = AllocatorMachine.TestCase
