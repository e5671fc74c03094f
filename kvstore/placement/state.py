"""The placement table's records and the one :class:`Catalog` of them that its parts share.

The records are what the master knows of each node, key and replica; the
commands it hands to daemons; the copies it plans. The catalog holds them all,
with the few primitives that every part needs (which replicas are readable,
issuing commands, revoking puts, dropping a replica once a daemon confirmed).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from itertools import repeat
from typing import Literal, NamedTuple

from kvstore.allocator import Allocator, Extent
from kvstore.config import MIN_BLOCK_BYTES
from kvstore.errors import RetryLater
from kvstore.events import EngineBlock
from kvstore.placement.leases import Holder, Leases
from kvstore.placement.records import S_MOVING, S_READY, T_DRAM, T_SSD, Records, TierLRU
from kvstore.placement.views import (  # noqa: F401  (the table's parts read the views from here)
    COPYING,
    DROPPING,
    MOVING,
    READY,
    STATUS_CODE,
    STATUSES,
    TIER_CODE,
    TIERS,
    TRANSITIONS,
    Keys,
    ObjectEntry,
    ReplicaState,
    ReplicaStatus,
    new_generation,
    new_generations,
)
from kvstore.policy import ActionKind, TierName

DRAM, SSD = TierName.DRAM, TierName.SSD


@dataclass(slots=True)
class NodeState:
    node_id: str
    address: str
    alloc: Allocator
    ssd_capacity: int
    idx: int
    """The node's index in the records (interned: the same across registrations)."""
    dram_lru: TierLRU
    ssd_lru: TierLRU
    ssd_used: int = 0
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
    owes: set[str] = field(default_factory=set)
    """Keys this node holds a block of that the table no longer places here, not yet confirmed
    dropped (see :meth:`Catalog.detach`): no put of them is placed here until it is, and the
    node's record that no longer names the block is kept (``settling`` until then)."""
    settling: set[str] = field(default_factory=set)
    """Of :attr:`owes`, those whose drop is confirmed, until the node's record says so in etcd."""
    quarantine: dict[str, Extent] = field(default_factory=dict)
    """DRAM extents held by blocks the daemon has but no put placed (orphans it is dropping), by
    key: out of the free space until the daemon says they are gone."""
    parked: list[tuple[str, Extent]] = field(default_factory=list)
    """DRAM extents of dropped blocks (a remove) that readers still hold leases on: a same-host
    reader copies straight from the arena, so the extent is not handed out again until no lease
    covers the block there (see :meth:`Catalog.free_parked`)."""
    suspect: bool = False
    """Missed heartbeats and did not answer the master's probe (frozen, cut off or overloaded): new
    blocks and grants go to other nodes first (:func:`suspects_last`) until its next heartbeat."""
    fenced: bool = False
    """Silent past the node TTL: its daemon stopped serving (its serve lease is shorter), and the
    commands for it are carried out without it; it comes back only by registering again (its
    heartbeats are refused). See :mod:`kvstore.placement.nodes`."""
    gone: set[tuple[str, TierName, int]] = field(default_factory=set)
    """(key, tier, DRAM offset or -1 for wherever) of the blocks the table gave up on this node (a
    removed key, an evicted copy) without its daemon's word, while it was fenced: its registration
    drops them, never adopts them. A registration keeps them until the node's first heartbeat (its
    daemon took the answer that names them); the node is not up until then."""
    gen: int = field(default_factory=new_generation)
    """This registration's number: answers to commands planned before the node re-registered are
    void (its inventory replaced what they were planned on)."""

    def lru(self, tier: TierName) -> TierLRU:
        return self.dram_lru if tier is DRAM else self.ssd_lru

    @property
    def dram_free_ratio(self) -> float:
        return self.alloc.free_bytes / self.alloc.capacity


def suspects_last(nodes: list[NodeState], avoid: Collection[str] = ()) -> tuple[list[NodeState], frozenset[str]]:
    """``nodes`` in the same order, but suspected ones and those in ``avoid`` (nodes a client could
    not reach) after the others (placed on only when the others cannot take a put or a grant); and
    the ids of those shunned so."""
    if not avoid and not any(n.suspect for n in nodes):
        return nodes, frozenset()
    shunned = frozenset(n.node_id for n in nodes if n.suspect or n.node_id in avoid)
    return [n for n in nodes if n.node_id not in shunned] + [n for n in nodes if n.node_id in shunned], shunned


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
    write_id: int = 0
    """The write id of the put that wrote the block: the copy keeps it too."""


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
    at: tuple[int, ...] = ()
    """For a DROP of reservations given up, per key the DRAM offset reserved (see DropBlocks.at)."""
    void_until_ms: int = 0
    """For a DROP: tenants' seals of these keys that end at or before this (wall clock, ms) write
    nothing more on the daemon, so a reservation given up cannot be written after its drop. Set by
    the master when the command first goes out (the table keeps no wall clock); 0: none."""


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
    "orphans",
    "room_refused_leased",
    "room_refused_pinned",
    "room_refused_tenants",
    "room_refused_suspects",
    "fences",
    "fences_refused",
    "suspicions",
)


EVICTIONS_KEPT = 65_536
"""Evictions the table keeps until the master takes them (:meth:`Catalog.take_evictions`); past that
the oldest go, counted in ``evictions_lost``."""


EvictionReason = Literal["lru", "demotion_failed", "operator", "quota"]


class Eviction(NamedTuple):
    """A block the table evicted: its key, the node ("" for every replica) and why: ``lru`` (room
    for other blocks), ``demotion_failed`` (a DRAM block whose SSD refused it), ``operator`` (the admin
    API), ``quota`` (room under its tenant's quota)."""

    key: str
    node_id: str
    reason: EvictionReason


def charged(size: int) -> int:
    """What a block of ``size`` bytes counts against its owner's quota: its bytes, and at least an
    index slot's worth (:data:`~kvstore.config.MIN_BLOCK_BYTES`): a flood of tiny objects costs
    what it occupies, the daemons' index slots, not its few bytes."""
    return size if size >= MIN_BLOCK_BYTES else MIN_BLOCK_BYTES


def owner_of(key: str) -> str:
    """The tenant a key belongs to: its first path segment (servers put ``NAME/`` in front of every
    key of tenant NAME); "" for a key with none."""
    head, sep, _ = key.partition("/")
    return head if sep else ""


def shunned_refusal(catalog: Catalog, what: str, node: NodeState) -> RetryLater:
    """Why a put or a grant is told to retry: the nodes that answer have no room now, and ``node``,
    suspected or unreachable, could have made some only by evictions that might go unanswered."""
    catalog.counters["room_refused_suspects"] += 1
    return RetryLater(f"no room for {what} on the nodes that answer now (node {node.node_id} is suspected or "
                      "unreachable); retry")  # fmt: skip


def no_room_text(what: str, tenant: str) -> str:
    """Why a tenant's put or grant found no room: the nodes are full of blocks it may not evict."""
    return (
        f"no room for {what}: every node that could hold it is full of pinned blocks or other tenants'"
        f" blocks, and a put of tenant {tenant!r} evicts only its own (remove some of its keys, or ask"
        " the operator for room)"
    )


class Catalog:
    """Everything the table knows, shared by its parts (:mod:`kvstore.placement.table` lists them).

    ``nodes`` gains and loses nodes only by registration (:class:`~kvstore.placement.nodes.Membership`);
    ``grants`` changes only in :class:`~kvstore.placement.grants.Grants` and when a node is forgotten;
    ``leases`` only through its own methods. Keys and replicas are rows of ``rec``
    (:class:`~kvstore.placement.records.Records`): a key is being written until committed, then
    stored; every part may mark replicas moving or drop them, through the primitives here.
    ``objects`` and ``pending`` are read-only views of the stored and the written keys.
    ``draining`` is the operator's: nodes out of placement.
    """

    def __init__(self, *, lease_ms: int, keys_by_owner: bool = True) -> None:
        self.rec = Records()
        self.nodes: dict[str, NodeState] = {}
        self.node_at: list[NodeState | None] = []
        """Node index -> the node registered under it now (None once it left)."""
        self.objects = Keys(self.rec, committed=True)
        self.pending = Keys(self.rec, committed=False)
        self.grants: dict[int, Grant] = {}
        self.leases = Leases()
        self.want_promote: set[str] = set()
        """SSD-only keys read often enough to be promoted once no reader holds them."""
        self.owed: Counter[str] = Counter()
        """Per key detached from the table, how many nodes still owe its drop (see :meth:`detach`)."""
        self.draining: set[str] = set()
        """Nodes out of placement, their blocks being moved elsewhere (an operator's drain)."""
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.evictions: deque[Eviction] = deque(maxlen=EVICTIONS_KEPT)
        self.evictions_lost = 0
        self.usage: Counter[str] = Counter()
        """Bytes charged for the keys (pending or stored, counted once however many replicas) of
        each first path segment, ``NAME`` of ``NAME/...``: a tenant's bytes, for its quota. A key is
        charged :func:`charged` of its size: at least an index slot's worth."""
        self.pinned_keys: Counter[str] = Counter()
        """Pinned keys (pending or stored) of each owner: a tenant's pins, for its cap."""
        self.keys_by_owner = keys_by_owner
        self.tenants: frozenset[str] | None = None
        """The names that are tenants (a master with a tenants file sets them as it reads it): only
        their keys get an LRU log of their own (:meth:`owner_id`). None: every named owner is one."""
        self.owned: dict[str, set[str]] = {}
        """The keys of each owner with a name (a tenant), pending or stored; kept only with
        ``keys_by_owner`` (a master with tenants: their quotas evict by it), else empty."""
        self.clock = 0
        self.labels: dict[str, EngineBlock] = {}
        """Keys an engine named (:meth:`~kvstore.placement.kv_events.KvEvents.label`) -> its name for
        them, for the KV events: kept while the key is in the table (and for
        :data:`~kvstore.placement.kv_events.LABELS_UNPLACED` keys not yet in it)."""
        self.labels_gone: dict[str, EngineBlock | None] = {}
        """Keys forgotten since the KV events were last taken -> the label each had (None: none):
        their removals name them so, whatever label a put of the same key brought since."""
        self.holders: list[tuple[tuple[Holder], tuple[Holder, Holder]]] = []
        """Node index -> ``((its DRAM holder,), (its DRAM holder, its SSD holder))``: the lease holders
        of its replicas, made once (the first, a lone DRAM replica's holders as a get leases them)."""

    # -- keys ------------------------------------------------------------------------------------
    def entry(self, key: str) -> ObjectEntry | None:
        """The key, stored or being written; None when the table does not know it."""
        slot = self.rec.index.get(key)
        return ObjectEntry(self.rec, slot) if slot is not None else None

    def new_key(self, key: str, size: int, checksum: int, *, committed: bool, pinned: bool, write_id: int = 0) -> int:
        """Record a key that came to exist (reserved by a put, committed into a grant, found in an
        inventory) by the put of ``write_id``, and count it for its owner; its slot."""
        self.clock += 1
        owner = owner_of(key)
        slot = self.rec.add_key(
            key, size, checksum, self.clock, self.owner_id(owner), write_id, committed=committed, pinned=pinned
        )
        self.usage[owner] += charged(size)
        if pinned:
            self.pinned_keys[owner] += 1
        if owner and self.keys_by_owner:
            self.owned.setdefault(owner, set()).add(key)
        return slot

    def new_run(self, keys: Sequence[str], sizes: Sequence[int], node: NodeState, offsets: list[int], *, pinned: bool,
                deadline: int, write_id: int = 0) -> None:  # fmt: skip
        """Record new keys (distinct, none in the table) reserved at ``offsets`` of ``node``'s DRAM,
        each with one replica there: what :meth:`new_key` and :meth:`add_replica` do key by key."""
        n = len(keys)
        first_clock = self.clock + 1
        self.clock += n
        owner = owner_of(keys[0])
        # Usually one owner for the whole batch, checked at C speed.
        one = (
            all(map(str.startswith, keys, repeat(owner + "/")))
            if owner
            else not any(map(str.__contains__, keys, repeat("/")))
        )
        owners = self.owner_id(owner) if one else [self.owner_id(owner_of(k)) for k in keys]
        self.rec.add_run(keys, sizes, range(first_clock, first_clock + n), node.idx, offsets, new_generations(n),
                         deadline, owners, write_id, pinned=pinned)  # fmt: skip
        usage = self.usage
        if one:
            usage[owner] += sum(sizes) + sum(MIN_BLOCK_BYTES - s for s in sizes if s < MIN_BLOCK_BYTES)
            if pinned:
                self.pinned_keys[owner] += n
        else:
            for key, size in zip(keys, sizes, strict=True):
                usage[owner_of(key)] += charged(size)
                if pinned:
                    self.pinned_keys[owner_of(key)] += 1
        if self.keys_by_owner:
            owned = self.owned
            for key in keys:
                if owner := owner_of(key):
                    owned.setdefault(owner, set()).add(key)

    def know_tenant(self, tenant: str) -> None:
        """``tenant`` made a request (its identity checked against the tenants file as read at its
        login): a tenant now, though the last :meth:`Accounts.set_tenants` (the master's tick)
        may predate it. Its keys must get its own LRU from the first one on: put in the shared log,
        they would never be victims of its puts, which evict only its own."""
        if tenant and self.tenants is not None and tenant not in self.tenants:
            self.tenants = self.tenants | {tenant}

    def owner_id(self, owner: str) -> int:
        """The LRU owner of a key of ``owner`` (:meth:`Records.intern_owner`): its own with tenants
        (``keys_by_owner``), else 0 for all (a key's first path segment names no tenant then)."""
        if not owner or not self.keys_by_owner or (self.tenants is not None and owner not in self.tenants):
            return 0  # a namespace of an operator's keys ("model/..."), or no tenants: the shared log
        return self.rec.intern_owner(owner)

    def forget_key(self, slot: int) -> None:
        """The key's last replica is gone: stop counting it, and reuse its slot."""
        rec = self.rec
        key = rec.keys[slot]
        assert key is not None
        owner = owner_of(key)
        self.usage[owner] -= charged(rec.size[slot])
        if not self.usage[owner]:
            del self.usage[owner]
        if rec.is_pinned(slot):
            self.pinned_keys[owner] -= 1
            if not self.pinned_keys[owner]:
                del self.pinned_keys[owner]
        keys = self.owned.get(owner)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.owned[owner]
        self.want_promote.discard(key)
        if rec.events is not None:  # its removal, told at the next take, names it as its store did
            self.labels_gone[key] = self.labels.pop(key, None) if self.labels else None
        elif self.labels:
            self.labels.pop(key, None)
        rec.drop_key(slot)

    def add_replica(self, slot: int, node: NodeState, tier: TierName, extent: Extent | None,
                    status: ReplicaStatus = ReplicaStatus.READY) -> int:  # fmt: skip
        """A replica of the key in ``slot`` on ``node`` (in no LRU); its row."""
        offset = extent.offset if extent is not None else -1
        return self.rec.add_replica(slot, node.idx, TIER_CODE[tier], offset, STATUS_CODE[status], new_generation())

    def lru_of(self, row: int) -> TierLRU | None:
        """The LRU the replica in ``row`` belongs in (by its node and tier); None once its node left."""
        rec = self.rec
        node = self.node_at[rec.r_node[row]]
        if node is None:
            return None
        return node.ssd_lru if rec.r_tier[row] else node.dram_lru

    def enlist(self, row: int) -> None:
        """Put the replica in ``row`` into its node's tier LRU, as the most recently used."""
        lru = self.lru_of(row)
        assert lru is not None
        lru.insert_row(row)

    def delist(self, row: int) -> None:
        """Take the replica in ``row`` out of its LRU, if it is in one."""
        if self.rec.r_lru[row]:
            lru = self.lru_of(row)
            assert lru is not None
            lru.remove_row(row)

    # -- nodes -----------------------------------------------------------------------------------
    def add_node(self, node_id: str, address: str, alloc: Allocator, ssd_capacity: int, *, now_ms: int,
                 max_blocks: int) -> NodeState:  # fmt: skip
        """Register ``node_id`` (which must not be registered now) with empty LRUs."""
        rec = self.rec
        idx = rec.intern_node(node_id, alloc.alignment)
        while len(self.node_at) <= idx:
            self.node_at.append(None)
            n = len(self.holders)
            dram, ssd = (rec.node_ids[n], DRAM), (rec.node_ids[n], SSD)
            self.holders.append(((dram,), (dram, ssd)))
        node = NodeState(node_id, address, alloc, ssd_capacity, idx, TierLRU(rec, idx, T_DRAM),
                         TierLRU(rec, idx, T_SSD), last_seen_ms=now_ms, max_blocks=max_blocks)  # fmt: skip
        self.nodes[node_id] = node
        self.node_at[idx] = node
        return node

    def remove_node(self, node_id: str) -> NodeState | None:
        node = self.nodes.pop(node_id, None)
        if node is not None:
            self.node_at[node.idx] = None
            for key in list(node.owes):  # its registration's inventory tells what it holds now
                self.settled(node, key)
        return node

    def up_nodes(self) -> list[NodeState]:
        return [n for n in self.nodes.values() if n.up]

    def placeable(self) -> list[NodeState]:
        """Nodes new blocks and grants may go to: up and not draining."""
        return [n for n in self.up_nodes() if n.node_id not in self.draining]

    # -- reading replicas --------------------------------------------------------------------------
    def _statuses(self, entry: ObjectEntry | None, *codes: int) -> list[ReplicaState]:
        if entry is None:
            return []
        rec = self.rec
        slot = entry.slot
        if not rec.in_service(slot):
            return []
        node_at, status = self.node_at, rec.r_status
        out = []
        for row in rec.rows(slot):
            node = node_at[rec.r_node[row]]
            if status[row] in codes and node is not None and node.up:
                out.append(ReplicaState(rec, row))
        return out

    def readable(self, entry: ObjectEntry | None) -> list[ReplicaState]:
        return self._statuses(entry, S_READY)

    def in_motion(self, entry: ObjectEntry | None) -> list[ReplicaState]:
        """Replicas of a committed block between tiers (a demotion, a promotion, or a drain's copy
        out) on nodes that are up: not where the table says for long, but their daemon still has
        the block, in one tier or the other, and reads it by key under its lock. A block is readable
        through them until its move is done (or has failed, and the block is gone: then a read of it
        misses). A replica being dropped or copied in is not one."""
        return self._statuses(entry, S_MOVING)

    def touch(self, slot: int) -> None:
        """A read or a put of an existing key: it becomes the most recently used, in its owner's
        order and in the LRU of each of its replicas."""
        rec = self.rec
        self.clock += 1
        rec.last_use[slot] = self.clock
        row, nxt, in_lru = rec.head[slot], rec.r_next, rec.r_lru
        while row >= 0:
            if in_lru[row]:
                lru = self.lru_of(row)
                assert lru is not None
                lru.touch_row(row)
            row = nxt[row]

    def busy(self, node: NodeState) -> bool:
        """Whether some of the node's DRAM is held only for now: leased, or reserved by puts in flight."""
        if self.leases.num_leased(node.node_id, DRAM) or any(g.node_id == node.node_id for g in self.grants.values()):
            return True
        rec = self.rec
        return any(rec.row_on(slot, node.idx) >= 0 for slot in rec.deadlines)

    # -- commands ----------------------------------------------------------------------------------
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
        rec = self.rec
        slot, idx = rec.index.get(key), rec.node_index.get(node_id)
        if slot is None or idx is None:
            return 0
        row = rec.row_on(slot, idx)
        return rec.r_gen[row] if row >= 0 else 0

    def replica(self, key: str, node_id: str, gen: int) -> tuple[ObjectEntry, ReplicaState] | None:
        """The key's replica of generation ``gen`` on ``node_id``, with its entry; None when it is gone."""
        rec = self.rec
        slot, idx = rec.index.get(key), rec.node_index.get(node_id)
        if slot is None or idx is None:
            return None
        row = rec.row_on(slot, idx)
        if row < 0 or rec.r_gen[row] != gen:
            return None
        return ObjectEntry(rec, slot), ReplicaState(rec, row)

    def revoke(self, entries: Sequence[ObjectEntry]) -> list[NodeCommand]:
        """Give up puts: their daemons must drop whatever was written before the extents are reused."""
        per_node: dict[str, list[tuple[str, int]]] = {}
        for entry in entries:
            entry.removing = True
            for r in entry.replicas:
                per_node.setdefault(r.node_id, []).append((entry.key, r.extent.offset if r.extent is not None else -1))
        return self.issue([
            NodeCommand(n, ActionKind.DROP, DRAM, tuple(k for k, _ in ks), release=True, at=tuple(o for _, o in ks))
            for n, ks in per_node.items()
        ])  # fmt: skip

    def drop_row(self, row: int) -> None:
        """Forget the replica in ``row`` (its daemon confirmed it gone, or its node left): free its
        room; the key goes with its last."""
        rec = self.rec
        slot = rec.r_slot[row]
        node = self.node_at[rec.r_node[row]]
        self.delist(row)
        if node is not None:
            if rec.r_offset[row] >= 0:
                extent = Extent(rec.r_offset[row], rec.length(slot, node.idx))
                key = rec.keys[slot]
                if rec.r_tier[row] == T_DRAM and key is not None and self.leases.is_leased(node.node_id, DRAM, key):
                    node.parked.append((key, extent))  # a forced remove: a reader may be copying it still
                else:
                    node.alloc.free(extent)
            if rec.r_tier[row] == T_SSD:
                node.ssd_used -= rec.size[slot]
        rec.remove_replica(row)
        if rec.head[slot] < 0:
            self.forget_key(slot)

    def detach(self, key: str) -> bool:
        """Forget a removed (or revoked) key whose drops its daemons have not confirmed, the master
        having answered without them (their leases to serve by key lapsed: they serve none of it):
        the key may be put again at once, though not on those nodes until they confirm the drop
        (:attr:`NodeState.owes`); their DRAM extents stay out of the free space meanwhile (in
        :attr:`NodeState.quarantine`, freed by the drop's answer). Whether it was forgotten (not
        when a node has a quarantined extent of the key already: the key waits for its drops)."""
        rec = self.rec
        slot = rec.index.get(key)
        if slot is None or not rec.is_removing(slot):
            return False
        rows = list(rec.rows(slot))
        for row in rows:
            node = self.node_at[rec.r_node[row]]
            if node is not None and rec.r_offset[row] >= 0 and key in node.quarantine:
                return False
        for row in rows:
            node = self.node_at[rec.r_node[row]]
            self.delist(row)
            if node is not None:
                if rec.r_offset[row] >= 0:
                    node.quarantine[key] = Extent(rec.r_offset[row], rec.length(slot, node.idx))
                if rec.r_tier[row] == T_SSD:
                    node.ssd_used -= rec.size[slot]
                if key not in node.owes:
                    node.owes.add(key)
                    self.owed[key] += 1
            rec.remove_replica(row)
        self.forget_key(slot)
        return True

    def settled(self, node: NodeState, key: str) -> None:
        """``node``'s daemon confirmed a drop of ``key``: it owes none of it (see :meth:`detach`)."""
        if key in node.owes:
            node.owes.discard(key)
            self.owed[key] -= 1
            if self.owed[key] <= 0:
                del self.owed[key]

    def free_parked(self) -> None:
        """Hand out again the parked extents no lease covers any more."""
        for node in self.nodes.values():
            parked, node.parked = node.parked, []
            for key, extent in parked:
                if self.leases.is_leased(node.node_id, DRAM, key):
                    node.parked.append((key, extent))
                else:
                    node.alloc.free(extent)

    def note_eviction(self, key: str, node_id: str, reason: EvictionReason) -> None:
        """Count an eviction and keep it for the master's log."""
        self.counters["evictions"] += 1
        if len(self.evictions) == EVICTIONS_KEPT:
            self.evictions_lost += 1
        self.evictions.append(Eviction(key, node_id, reason))

    def take_evictions(self) -> list[Eviction]:
        """The evictions since the last call, oldest first."""
        taken = list(self.evictions)
        self.evictions.clear()
        return taken

    def drop_replica(self, key: str, node_id: str, evicted: EvictionReason | None = None, gen: int = 0) -> None:
        """The daemon confirmed the replica on ``node_id`` (of generation ``gen``; 0: whichever it
        is) gone: free its room; the key goes with its last. ``evicted``: why, when it was an
        eviction (see :class:`Eviction`)."""
        rec = self.rec
        slot, idx = rec.index.get(key), rec.node_index.get(node_id)
        if slot is None:
            return
        row = rec.row_on(slot, idx) if idx is not None else -1
        if row >= 0 and gen in (0, rec.r_gen[row]):
            self.drop_row(row)
        if evicted:
            self.note_eviction(key, node_id, evicted)
