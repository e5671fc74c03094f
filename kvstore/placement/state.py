"""The placement table's records and the one :class:`Catalog` of them that its parts share.

The records are what the master knows of each node, key and replica; the
commands it hands to daemons; the copies it plans. The catalog holds them all,
with the few primitives that every part needs (which replicas are readable,
issuing commands, revoking puts, dropping a replica once a daemon confirmed).
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvstore.allocator import Allocator, Extent
from kvstore.lru import LRU
from kvstore.placement.leases import Leases
from kvstore.policy import ActionKind, TierName

DRAM, SSD = TierName.DRAM, TierName.SSD


_GENERATIONS = itertools.count(1)
"""Generations of replicas and of nodes' registrations: unique in the process, never 0."""


def new_generation() -> int:
    return next(_GENERATIONS)


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


class ReplicaState:
    """One replica of a key on one node. ``status`` changes only through :meth:`to`.

    Its DRAM extent is kept as two ints, not an :class:`Extent` (one object less per key: the
    master holds millions of replicas); :attr:`extent` puts it together when asked (``offset``: -1
    without one; set both through :attr:`extent`). ``gen`` is
    this replica's own number: a command names the replicas it was planned for by it, so an
    answer that comes back after the key was removed and put again (or its node re-registered)
    is not taken for the new replica's.
    """

    __slots__ = ("_length", "gen", "node_id", "offset", "status", "tier")

    def __init__(
        self, node_id: str, tier: TierName, extent: Extent | None, status: ReplicaStatus = ReplicaStatus.READY,
        gen: int = 0,
    ) -> None:  # fmt: skip
        self.node_id = node_id
        self.tier = tier
        self.offset, self._length = extent if extent is not None else (-1, 0)
        self.status = status
        self.gen = gen or new_generation()

    @property
    def extent(self) -> Extent | None:
        """The DRAM extent; None on SSD (during a promotion: the extent it will land in)."""
        return Extent(self.offset, self._length) if self.offset >= 0 else None

    @extent.setter
    def extent(self, extent: Extent | None) -> None:
        self.offset, self._length = extent if extent is not None else (-1, 0)

    def __repr__(self) -> str:
        return f"ReplicaState({self.node_id!r}, {self.tier}, {self.extent}, {self.status}, gen={self.gen})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReplicaState):
            return NotImplemented
        return (self.node_id, self.tier, self.extent, self.status, self.gen) == (
            other.node_id, other.tier, other.extent, other.status, other.gen)  # fmt: skip

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it was

    def to(self, status: ReplicaStatus) -> None:
        assert status in TRANSITIONS[self.status], f"replica on {self.node_id}: {self.status} -> {status}"
        self.status = status

    @property
    def ready(self) -> bool:
        return self.status is ReplicaStatus.READY


READY, MOVING, COPYING, DROPPING = (
    ReplicaStatus.READY,
    ReplicaStatus.MOVING,
    ReplicaStatus.COPYING,
    ReplicaStatus.DROPPING,
)


@dataclass(slots=True)
class ObjectEntry:
    """One key. Fields change only through the table."""

    key: str
    size: int
    checksum: int
    replicas: list[ReplicaState]
    committed: bool
    deadline_ms: int
    """Reservation deadline while uncommitted."""
    pinned: bool
    removing: bool = False
    """Removed, revoked or expired: gone once its daemons confirm; not readable, not placeable."""
    ssd_hits: int = 0
    last_use: int = 0
    """The catalog's clock when the key was last put or read: its tenant's LRU order, across nodes."""
    hold: int = 0
    """The lease that holds the key after a read (``hold_ms``, Mooncake's KV lease); 0: none yet."""
    held_until_ms: int = 0
    """When that hold ends: until then the key is neither evicted nor removed without force."""


@dataclass(slots=True)
class NodeState:
    node_id: str
    address: str
    alloc: Allocator
    ssd_capacity: int
    ssd_used: int = 0
    dram_lru: LRU[str] = field(default_factory=LRU)
    ssd_lru: LRU[str] = field(default_factory=LRU)
    up: bool = True
    last_seen_ms: int = 0
    inflight: int = 0
    """Keys in commands sent to this node and not yet applied: room they may free is coming."""
    dram_freeing: int = 0
    """DRAM bytes that evictions in flight will free."""
    ssd_delta: int = 0
    """SSD bytes that evictions in flight will add (demotions) less those they will free (drops)."""
    max_blocks: int = 0
    """Blocks the node's arena can index (its slots); 0: bytes are the only limit."""
    ssd_configured: int = -1
    """The SSD tier's configured capacity; ``ssd_capacity`` is lower while its disk is short (-1: the same)."""
    ssd_fault: str = ""
    """Why the SSD tier holds less than configured, as its daemon reports it ("" while healthy)."""
    gen: int = field(default_factory=new_generation)
    """This registration's number: answers to commands planned before the node re-registered are
    void (its inventory replaced what they were planned on)."""

    def lru(self, tier: TierName) -> LRU[str]:
        return self.dram_lru if tier is DRAM else self.ssd_lru

    @property
    def dram_free_ratio(self) -> float:
        return self.alloc.free_bytes / self.alloc.capacity


@dataclass(slots=True)
class Grant:
    """DRAM of one node reserved for one client's puts: the pieces not yet committed as blocks."""

    grant_id: int
    node_id: str
    pieces: list[Extent]
    """Allocated extents, sorted by offset; a commit carves its block out of one."""
    deadline_ms: int
    ending: bool = False
    """The daemon is being told to take no more writes: commits are refused; pieces freed once it answers."""
    owner: str = ""
    """The tenant whose client asked for it ("" without tenants): only it may write into it or return it."""


@dataclass(frozen=True, slots=True)
class Move:
    """A block to be copied from ``source`` (a draining node, or a replica's node) into ``extent`` of
    the DRAM of ``target``: the target's daemon reads it by key from the source's."""

    key: str
    size: int
    checksum: int
    tier: TierName
    """Where the block is on the source."""
    target: str
    extent: Extent
    source: str
    pinned: bool = False
    """The block is pinned: its copy must be pinned on the target's daemon too (its inventory is
    what a new master rebuilds from)."""
    gen: int = 0
    """The generation of the COPYING replica reserved on ``target``."""
    source_gen: int = 0
    """The generation of the replica on ``source`` it is copied from."""


@dataclass(frozen=True, slots=True)
class NodeCommand:
    """Work for one daemon: maps one to one onto a DemoteBlocks, DropBlocks or PromoteBlocks message."""

    node_id: str
    kind: ActionKind
    tier: TierName
    """The tier the blocks are in now."""
    keys: tuple[str, ...]
    offsets: tuple[int, ...] = ()
    """DRAM offsets for PROMOTE; for a DROP of copies, the extents they were planned into (the
    daemon refuses a copy into one of them that comes after the drop found nothing there)."""
    release: bool = False
    """A DROP that evicts nothing: it frees reservations (revoked or expired puts), removed keys,
    conflicting inventory, or the replicas a drain copied elsewhere; not counted as evictions."""
    sizes: tuple[int, ...] = ()
    """Block sizes, for an eviction (its bytes are counted as leaving until it is applied)."""
    tier_only: bool = False
    """A DROP of the copy in ``tier`` only (the daemon may hold another, in the other tier, that
    stays); otherwise a drop takes the block from whichever tier holds it."""
    gens: tuple[int, ...] = ()
    """Per key, the generation of the replica the command was planned for (0: none in the table,
    as for inventory it could not adopt); set by :meth:`Catalog.issue` unless given."""
    node_gen: int = 0
    """The generation of the node's registration it was planned on; set by :meth:`Catalog.issue`."""


COUNTERS = (
    "puts",
    "put_exists",
    "gets",
    "hits",
    "dram_hits",
    "ssd_hits",
    "misses",
    "evictions",
    "demotions",
    "demotions_failed",
    "promotions",
    "expired",
    "bytes_read",
    "bytes_written",
    "grants",
    "grants_expired",
)


def owner_of(key: str) -> str:
    """The tenant a key belongs to: its first path segment (servers put ``NAME/`` in front of every
    key of tenant NAME); "" for a key with none."""
    head, sep, _ = key.partition("/")
    return head if sep else ""


class Catalog:
    """Everything the table knows, shared by its parts (:mod:`kvstore.placement.table` lists them).

    ``nodes`` gains and loses nodes only by registration (:class:`~kvstore.placement.nodes.Membership`);
    ``grants`` changes only in :class:`~kvstore.placement.grants.Grants` and when a node is forgotten;
    ``leases`` only through its own methods. Keys move between ``pending`` (being written) and
    ``objects`` (committed) in the writes; every part may mark replicas moving or drop them, through
    the primitives here. ``draining`` is the operator's: nodes out of placement.
    """

    def __init__(self, *, lease_ms: int, keys_by_owner: bool = True) -> None:
        self.nodes: dict[str, NodeState] = {}
        self.objects: dict[str, ObjectEntry] = {}
        self.pending: dict[str, ObjectEntry] = {}
        self.grants: dict[int, Grant] = {}
        # A release that comes up to one lease length after its lease expired is still known as late.
        self.leases = Leases()
        self.want_promote: set[str] = set()
        """SSD-only keys read often enough to be promoted once no reader holds them."""
        self.draining: set[str] = set()
        """Nodes out of placement, their blocks being moved elsewhere (an operator's drain)."""
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.usage: Counter[str] = Counter()
        """Bytes of the keys (pending or stored, counted once however many replicas) of each
        first path segment, ``NAME`` of ``NAME/...``: a tenant's bytes, for its quota."""
        self.keys_by_owner = keys_by_owner
        self.owned: dict[str, set[str]] = {}
        """The keys of each owner with a name (a tenant), pending or stored; kept only with
        ``keys_by_owner`` (a master with tenants: their quotas evict by it), else empty."""
        self.clock = 0

    def track(self, entry: ObjectEntry) -> None:
        """Count a key that came to exist (reserved by a put, committed into a grant, found in an inventory)."""
        owner = owner_of(entry.key)
        self.usage[owner] += entry.size
        if owner and self.keys_by_owner:
            self.owned.setdefault(owner, set()).add(entry.key)
        self.clock += 1
        entry.last_use = self.clock

    def untrack(self, entry: ObjectEntry) -> None:
        """Stop counting a key that is gone (its last replica dropped)."""
        owner = owner_of(entry.key)
        self.usage[owner] -= entry.size
        if not self.usage[owner]:
            del self.usage[owner]
        keys = self.owned.get(owner)
        if keys is not None:
            keys.discard(entry.key)
            if not keys:
                del self.owned[owner]

    def up_nodes(self) -> list[NodeState]:
        return [n for n in self.nodes.values() if n.up]

    def placeable(self) -> list[NodeState]:
        """Nodes new blocks and grants may go to: up and not draining."""
        return [n for n in self.up_nodes() if n.node_id not in self.draining]

    def readable(self, entry: ObjectEntry | None) -> list[ReplicaState]:
        if entry is None or entry.removing or not entry.committed:
            return []
        return [r for r in entry.replicas if r.status is READY and self.nodes[r.node_id].up]

    def in_motion(self, entry: ObjectEntry | None) -> list[ReplicaState]:
        """Replicas of a committed block between tiers (a demotion, a promotion, or a drain's copy
        out) on nodes that are up: not where the table says for long, but their daemon still has
        the block, in one tier or the other, and reads it by key under its lock. A block is readable
        through them until its move is done (or has failed, and the block is gone: then a read of it
        misses). A replica being dropped or copied in is not one."""
        if entry is None or entry.removing or not entry.committed:
            return []
        nodes = self.nodes
        return [r for r in entry.replicas if r.status is MOVING and nodes[r.node_id].up]

    def found(self, entry: ObjectEntry | None) -> bool:
        """Whether a read finds the committed block: through a replica :meth:`readable` or
        :meth:`in_motion` returns (one on an up node, neither being copied in nor dropped)."""
        if entry is None or entry.removing or not entry.committed:
            return False
        nodes = self.nodes
        for r in entry.replicas:  # noqa: SIM110 - a loop, not any(): this runs for every key of every exists
            if (r.status is READY or r.status is MOVING) and nodes[r.node_id].up:
                return True
        return False

    def touch(self, entry: ObjectEntry) -> None:
        self.clock += 1
        entry.last_use = self.clock
        nodes, key = self.nodes, entry.key
        for r in entry.replicas:
            node = nodes[r.node_id]
            (node.dram_lru if r.tier is DRAM else node.ssd_lru).touch_if_present(key)

    def busy(self, node: NodeState) -> bool:
        """Whether some of the node's DRAM is held only for now: leased, or reserved by puts in flight."""
        if self.leases.num_leased(node.node_id, DRAM) or any(g.node_id == node.node_id for g in self.grants.values()):
            return True
        return any(r.node_id == node.node_id for e in self.pending.values() for r in e.replicas)

    def issue(self, commands: list[NodeCommand]) -> list[NodeCommand]:
        """Name the replicas and the node registration each command is planned for (the replicas
        the keys have on its node now), and count the commands as in flight on their nodes until
        :meth:`PlacementTable.apply` sees their answers."""
        out = []
        for c in commands:
            node = self.nodes.get(c.node_id)
            if node is not None:
                node.inflight += len(c.keys)
            gens = c.gens or tuple(self._replica_gen(key, c.node_id) for key in c.keys)
            out.append(replace(c, gens=gens, node_gen=node.gen if node is not None else 0))
        return out

    def _replica_gen(self, key: str, node_id: str) -> int:
        entry = self.objects.get(key) or self.pending.get(key)
        replica = next((r for r in entry.replicas if r.node_id == node_id), None) if entry is not None else None
        return replica.gen if replica is not None else 0

    def replica(self, key: str, node_id: str, gen: int) -> tuple[ObjectEntry, ReplicaState] | None:
        """The key's replica of generation ``gen`` on ``node_id``, with its entry; None when it is gone."""
        entry = self.objects.get(key) or self.pending.get(key)
        if entry is None:
            return None
        replica = next((r for r in entry.replicas if r.node_id == node_id and r.gen == gen), None)
        return (entry, replica) if replica is not None else None

    def revoke(self, entries: Sequence[ObjectEntry]) -> list[NodeCommand]:
        """Give up puts: their daemons must drop whatever was written before the extents are reused."""
        per_node: dict[str, list[str]] = {}
        for entry in entries:
            entry.removing = True
            for r in entry.replicas:
                per_node.setdefault(r.node_id, []).append(entry.key)
        return self.issue(
            [NodeCommand(n, ActionKind.DROP, DRAM, tuple(keys), release=True) for n, keys in per_node.items()]
        )

    def drop_replica(self, key: str, node_id: str, evicted: bool = False, gen: int = 0) -> None:
        """The daemon confirmed the replica on ``node_id`` (of generation ``gen``; 0: whichever it
        is) gone: free its room; the key goes with its last."""
        entry = self.objects.get(key) or self.pending.get(key)
        node = self.nodes.get(node_id)
        if entry is None:
            return
        for r in [r for r in entry.replicas if r.node_id == node_id and gen in (0, r.gen)]:
            entry.replicas.remove(r)
            if node is not None:
                lru = node.lru(r.tier)
                if key in lru:
                    lru.remove(key)
                if r.extent is not None:
                    node.alloc.free(r.extent)
                if r.tier is SSD:
                    node.ssd_used -= entry.size
        if evicted:
            self.counters["evictions"] += 1
        if not entry.replicas and (self.objects.pop(key, None) is not None or self.pending.pop(key, None) is not None):
            self.untrack(entry)
            self.want_promote.discard(key)
