"""Views of the placement table's records: a key (:class:`ObjectEntry`), a replica
(:class:`ReplicaState`) and the stored or written keys (:class:`Keys`), read as objects by the
table's colder paths, operators and tests, over the columns of
:class:`~kvstore.placement.records.Records` (the hot paths read the columns themselves). A view is
good while its key or replica is: its slot or row is reused once that is gone.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from typing import Any

from kvstore.allocator import Extent
from kvstore.placement.records import S_READY, Records
from kvstore.policy import TierName

_GENERATIONS = [1]
"""The next generation of a replica or of a node's registration: unique in the process, never 0."""


def new_generation() -> int:
    gen = _GENERATIONS[0]
    _GENERATIONS[0] = gen + 1
    return gen


def new_generations(n: int) -> range:
    """``n`` consecutive new generations."""
    first = _GENERATIONS[0]
    _GENERATIONS[0] = first + n
    return range(first, first + n)


class ReplicaStatus(enum.Enum):
    """Where a replica is in its life; :data:`TRANSITIONS` lists the steps it may take.

    Only READY replicas of committed keys are in their node's tier LRU and handed out with
    their extent; every other status is out of the LRU, so no policy picks it twice.
    """

    READY = "ready"
    """Where the table says: readable once its key is committed."""
    MOVING = "moving"
    """A demotion or promotion is in flight, or a drain is copying it to another node: readable
    only by key through its daemon, which holds it in one tier or the other (:meth:`Catalog.in_motion`)."""
    COPYING = "copying"
    """Being copied in from another node (a replicate or a drain): its daemon is told nothing about
    it until the copy is answered, and nothing reads it."""
    DROPPING = "dropping"
    """A drop is in flight: as far as reads and prefix matches go it is gone already; its room is
    freed, and it leaves its key, once the daemon confirms."""


TRANSITIONS: dict[ReplicaStatus, frozenset[ReplicaStatus]] = {
    ReplicaStatus.READY: frozenset({ReplicaStatus.MOVING, ReplicaStatus.DROPPING}),
    ReplicaStatus.MOVING: frozenset({ReplicaStatus.READY, ReplicaStatus.DROPPING}),
    ReplicaStatus.COPYING: frozenset({ReplicaStatus.READY, ReplicaStatus.DROPPING}),
    ReplicaStatus.DROPPING: frozenset(),
}
"""A replica starts READY (placed by a put, found in an inventory) or COPYING (a copy planned);
a DROPPING one only ever leaves its key, when its daemon confirms the drop."""


STATUSES = (ReplicaStatus.READY, ReplicaStatus.MOVING, ReplicaStatus.COPYING, ReplicaStatus.DROPPING)
"""Statuses by the code their column holds (:data:`~kvstore.placement.records.S_READY` ...)."""
STATUS_CODE = {status: code for code, status in enumerate(STATUSES)}
TIERS = (TierName.DRAM, TierName.SSD)
"""Tiers by the code their column holds (:data:`~kvstore.placement.records.T_DRAM`, ``T_SSD``)."""
TIER_CODE = {tier: code for code, tier in enumerate(TIERS)}


class ReplicaState:
    """One replica of a key on one node: a view of its row in the table's records, good while the
    replica is. ``status`` changes only through :meth:`to`.

    ``gen`` is this replica's own number: a command names the replicas it was planned for by it,
    so an answer that comes back after the key was removed and put again (or its node
    re-registered) is not taken for the new replica's.
    """

    __slots__ = ("_rec", "row")

    def __init__(self, records: Records, row: int) -> None:
        self._rec = records
        self.row = row

    @property
    def node_id(self) -> str:
        return self._rec.node_ids[self._rec.r_node[self.row]]

    @property
    def tier(self) -> TierName:
        return TIERS[self._rec.r_tier[self.row]]

    @tier.setter
    def tier(self, tier: TierName) -> None:
        assert not self._rec.r_lru[self.row], "a replica's tier changed while in an LRU"
        self._rec.r_tier[self.row] = TIER_CODE[tier]

    @property
    def offset(self) -> int:
        """The DRAM extent's offset; -1 without one."""
        return self._rec.r_offset[self.row]

    @property
    def extent(self) -> Extent | None:
        """The DRAM extent; None on SSD (during a promotion: the extent it will land in)."""
        rec, row = self._rec, self.row
        offset = rec.r_offset[row]
        return Extent(offset, rec.length(rec.r_slot[row], rec.r_node[row])) if offset >= 0 else None

    @extent.setter
    def extent(self, extent: Extent | None) -> None:
        rec, row = self._rec, self.row
        if extent is not None:
            assert extent.length == rec.length(rec.r_slot[row], rec.r_node[row]), "an extent not of the key's size"
        rec.r_offset[row] = extent.offset if extent is not None else -1

    @property
    def status(self) -> ReplicaStatus:
        return STATUSES[self._rec.r_status[self.row]]

    @property
    def gen(self) -> int:
        return self._rec.r_gen[self.row]

    def __repr__(self) -> str:
        return f"ReplicaState({self.node_id!r}, {self.tier}, {self.extent}, {self.status}, gen={self.gen})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReplicaState):
            return NotImplemented
        return self._rec is other._rec and self.row == other.row

    __hash__ = None  # type: ignore[assignment]

    def to(self, status: ReplicaStatus) -> None:
        assert status in TRANSITIONS[self.status], f"replica on {self.node_id}: {self.status} -> {status}"
        self._rec.r_status[self.row] = STATUS_CODE[status]

    @property
    def ready(self) -> bool:
        return self._rec.r_status[self.row] == S_READY


READY, MOVING, COPYING, DROPPING = STATUSES


class ObjectEntry:
    """One key: a view of its slot in the table's records, good while the key is. Its fields change
    only through the table."""

    __slots__ = ("_rec", "slot")

    def __init__(self, records: Records, slot: int) -> None:
        self._rec = records
        self.slot = slot

    @property
    def key(self) -> str:
        key = self._rec.keys[self.slot]
        assert key is not None, "a view of a key that is gone"
        return key

    @property
    def size(self) -> int:
        return self._rec.size[self.slot]

    @property
    def checksum(self) -> int:
        return self._rec.checksum[self.slot]

    @property
    def write_id(self) -> int:
        """The write id of the put that reserved or wrote it (0: not known)."""
        return self._rec.write_id[self.slot]

    @property
    def committed(self) -> bool:
        return self._rec.is_committed(self.slot)

    @property
    def pinned(self) -> bool:
        return self._rec.is_pinned(self.slot)

    @property
    def removing(self) -> bool:
        """Removed, revoked or expired: gone once its daemons confirm; not readable, not placeable."""
        return self._rec.is_removing(self.slot)

    @removing.setter
    def removing(self, value: bool) -> None:
        assert value, "a key being removed stays so"
        self._rec.mark_removing(self.slot)

    @property
    def ssd_hits(self) -> int:
        return self._rec.ssd_hits[self.slot]

    @ssd_hits.setter
    def ssd_hits(self, value: int) -> None:
        self._rec.ssd_hits[self.slot] = min(value, 0xFFFFFFFF)

    @property
    def last_use(self) -> int:
        """The catalog's clock when the key was last put or read: its tenant's LRU order, across nodes."""
        return self._rec.last_use[self.slot]

    @property
    def deadline_ms(self) -> int:
        """Reservation deadline while uncommitted (0 once committed)."""
        return self._rec.deadlines.get(self.slot, 0)

    @property
    def hold(self) -> int:
        """The lease that holds the key after a read (``hold_ms``, Mooncake's KV lease); 0: none."""
        return self._rec.holds.get(self.slot, (0, 0))[0]

    @property
    def held_until_ms(self) -> int:
        """When that hold ends: until then the key is neither evicted nor removed without force."""
        return self._rec.holds.get(self.slot, (0, 0))[1]

    @property
    def replicas(self) -> list[ReplicaState]:
        rec = self._rec
        return [ReplicaState(rec, row) for row in rec.rows(self.slot)]

    def __repr__(self) -> str:
        return f"ObjectEntry({self.key!r}, size={self.size}, replicas={self.replicas})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ObjectEntry):
            return NotImplemented
        return self._rec is other._rec and self.slot == other.slot

    __hash__ = None  # type: ignore[assignment]


class Keys(Mapping[str, ObjectEntry]):
    """The table's committed keys (``committed=True``) or those being written, read-only, as views."""

    def __init__(self, records: Records, committed: bool) -> None:
        self._rec = records
        self._committed = committed

    def __getitem__(self, key: str) -> ObjectEntry:
        slot = self._rec.index.get(key)
        if slot is None or self._rec.is_committed(slot) != self._committed:
            raise KeyError(key)
        return ObjectEntry(self._rec, slot)

    def get(self, key: str, default: object = None) -> Any:
        slot = self._rec.index.get(key)
        if slot is None or self._rec.is_committed(slot) != self._committed:
            return default
        return ObjectEntry(self._rec, slot)

    def __contains__(self, key: object) -> bool:
        slot = self._rec.index.get(key)  # type: ignore[call-overload]
        return slot is not None and self._rec.is_committed(slot) == self._committed

    def __iter__(self) -> Iterator[str]:
        return iter(self._rec.keys_committed(self._committed))

    def __len__(self) -> int:
        committed = self._rec.committed
        return committed if self._committed else len(self._rec.index) - committed
