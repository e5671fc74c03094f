"""The master's placement table: nodes, objects and their replicas, reservations,
read leases and each node's per-tier LRU. Pure and synchronous: time comes in
as ``now_ms``, and every change a daemon must carry out comes back as a
:class:`NodeCommand` that the caller sends and then reports with :meth:`apply`.

Rules:

- ``put_start`` places each new key on ``replicas`` distinct up nodes chosen by
  the placement strategy and reserves an extent in each node's DRAM arena
  (the master holds the one allocator of every arena). A node that has no
  extent for the block gets eviction commands; the key waits for them
  (``PutPlan.waiting``) and is placed when the caller asks again. A key that
  is already stored or being written reports ``exists``.
- ``put_end`` commits: only then is a block visible. An uncommitted
  reservation expires after ``reservation_ms``.
- An extent is reused only after its daemon has confirmed that the block in it
  is gone: a revoked, expired or removed block is ``removing`` (not readable,
  not placeable), and an evicted or promoted replica ``moving`` (not
  readable), until the daemon's answer is applied. So a daemon never
  holds a block in an extent that the master gave to another key.
- ``get_replicas`` hands out replicas on up nodes only, touches their LRU and
  leases them for ``lease_ms`` (one lease per key and get, owned by
  :class:`~kvstore.leases.Leases`): a leased replica is never evicted,
  demoted or promoted. A release ends one lease, never another reader's (see
  :mod:`kvstore.leases`). An SSD-only block read ``promote_after_hits`` times
  is promoted to DRAM once its leases end.
- ``plan_replicas`` reserves DRAM on a node for copies of stored blocks whose
  other replicas stay (hot blocks near their readers). A copy's replica is
  ``copying`` (not readable, in no LRU, sent no drop) until ``finish_replicas``
  applies the target's answer; a block removed meanwhile loses it by a drop.
  A node holds at most one replica of a block.
- A daemon's (re)registration replaces everything the table knew of that node
  by the daemon's inventory: the daemons are the source of truth, so a new
  master rebuilds the whole table from them.
- ``grant_space`` reserves DRAM on one node for a client to write into without
  asking per put (a **grant**: allocated pieces of the arena, bounded and
  expiring). ``commit_granted`` turns an extent of a grant into a committed
  block (or answers ``exists``); a grant's unused pieces return to the pool only
  after its daemon confirmed the grant ended (``end_grants`` then
  ``finish_end_grants``), so no write into it can land in reused space.
- ``record_access`` counts reads a daemon served by key without the master
  (the one-trip read path) and touches the LRU as ``get_replicas`` does.

Invariants: a committed, readable replica is in exactly its node's tier LRU;
each node's allocator holds exactly the extents of that node's DRAM replicas
(committed, pending, moving or copying) and the pieces of its grants; no node
holds two replicas of a block.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.allocator import Allocator, Extent
from kvstore.errors import (
    CapacityError,
    GrantExpired,
    InvalidArgument,
    KVStoreError,
    NoNodes,
    NotFound,
    RetryLater,
)
from kvstore.keys import BlockKey, validate_key
from kvstore.leases import Leases
from kvstore.lru import LRU
from kvstore.policy import Action, ActionKind, EvictionPolicy, TierName, TierView
from kvstore.protocol import GetReplicasReply, InventoryItem, NodePrefix, PrefixMatch, PutTicket, Replica

DRAM, SSD = TierName.DRAM, TierName.SSD


@dataclass(slots=True)
class ReplicaState:
    node_id: str
    tier: TierName
    extent: Extent | None
    """The DRAM extent; None on SSD (during a promotion: the extent it will land in)."""
    moving: bool = False
    """A demotion, drop or promotion of this replica is in flight: not readable, not in an LRU."""
    copying: bool = False
    """Being copied in from another node (a replicate; also ``moving``): its daemon is told nothing
    about it until the copy is answered, so that no drop overtakes the copy."""


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

    def lru(self, tier: TierName) -> LRU[str]:
        return self.dram_lru if tier is DRAM else self.ssd_lru

    @property
    def dram_free_ratio(self) -> float:
        return self.alloc.free_bytes / self.alloc.capacity


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


@dataclass(frozen=True, slots=True)
class NodeCommand:
    """Work for one daemon: maps one to one onto a DemoteBlocks, DropBlocks or PromoteBlocks message."""

    node_id: str
    kind: ActionKind
    tier: TierName
    """The tier the blocks are in now."""
    keys: tuple[str, ...]
    offsets: tuple[int, ...] = ()
    """DRAM offsets for PROMOTE."""
    release: bool = False
    """A DROP that evicts nothing: it frees reservations (revoked or expired puts), removed keys,
    conflicting inventory, or the replicas a drain copied elsewhere; not counted as evictions."""
    sizes: tuple[int, ...] = ()
    """Block sizes, for an eviction (its bytes are counted as leaving until it is applied)."""


@dataclass(slots=True)
class PutPlan:
    tickets: list[PutTicket | None]
    """One per key; None for a key waiting for evictions."""
    commands: list[NodeCommand]
    waiting: list[int]
    """Indexes of keys to ask again for once ``commands`` are applied."""


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


@dataclass(slots=True)
class GrantPlan:
    grant: Grant | None
    commands: list[NodeCommand]
    waiting: bool
    """No room yet, but evictions in ``commands`` (or in flight) will make some: ask again."""
    error: KVStoreError | None = None


PUT_STORED, PUT_EXISTS = 0, 1
"""Per-block codes of a one-trip put (else an error code of :mod:`kvstore.errors`)."""


Strategy = Callable[[list[NodeState], str | None, random.Random], list[NodeState]]


def _free_ratio(nodes: list[NodeState], preferred: str | None, rng: random.Random) -> list[NodeState]:
    return sorted(nodes, key=lambda n: -n.dram_free_ratio)


def _local_first(nodes: list[NodeState], preferred: str | None, rng: random.Random) -> list[NodeState]:
    return sorted(nodes, key=lambda n: (n.node_id != preferred, -n.dram_free_ratio))


def _random(nodes: list[NodeState], preferred: str | None, rng: random.Random) -> list[NodeState]:
    out = list(nodes)
    rng.shuffle(out)
    return out


PLACEMENT_STRATEGIES: dict[str, Strategy] = {
    "free_ratio": _free_ratio,
    "local_first": _local_first,
    "random": _random,
}


def _ticket_error(exc: KVStoreError) -> PutTicket:
    return PutTicket("error", [], exc.code, str(exc))


class PlacementTable:
    def __init__(
        self,
        policy: EvictionPolicy | None = None,
        *,
        strategy: str = "local_first",
        reservation_ms: int = 30_000,
        lease_ms: int = 5_000,
        node_ttl_ms: int = 10_000,
        seed: int = 0,
    ) -> None:
        if strategy not in PLACEMENT_STRATEGIES:
            raise InvalidArgument(f"unknown placement strategy {strategy!r}; known: {sorted(PLACEMENT_STRATEGIES)}")
        self.policy = policy or EvictionPolicy()
        self.strategy = PLACEMENT_STRATEGIES[strategy]
        self.reservation_ms = reservation_ms
        self.lease_ms = lease_ms
        self.node_ttl_ms = node_ttl_ms
        self.nodes: dict[str, NodeState] = {}
        self.objects: dict[str, ObjectEntry] = {}
        self._pending: dict[str, ObjectEntry] = {}
        # A release that comes up to one lease length after its lease expired is still known as late.
        self.leases = Leases(late_ms=lease_ms)
        self._want_promote: set[str] = set()
        self.grants: dict[int, Grant] = {}
        self._next_grant = 1
        self.draining: set[str] = set()
        """Nodes out of placement, their blocks being moved elsewhere (an operator's drain)."""
        self._rng = random.Random(seed)
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "puts",
                "put_exists",
                "gets",
                "hits",
                "dram_hits",
                "ssd_hits",
                "misses",
                "evictions",
                "demotions",
                "promotions",
                "expired",
                "bytes_read",
                "bytes_written",
                "grants",
                "grants_expired",
            ),
            0,
        )

    # -- membership -----------------------------------------------------------------
    def register_node(
        self,
        node_id: str,
        address: str,
        dram_capacity: int,
        ssd_capacity: int,
        alignment: int,
        inventory: Sequence[InventoryItem],
        now_ms: int,
        max_blocks: int = 0,
    ) -> list[NodeCommand]:
        """(Re)build what the table knows of ``node_id`` from its inventory (oldest use first).

        Returns drops for blocks the table cannot adopt: a key that another
        node holds with other bytes, or an extent that overlaps another.
        """
        validate_key(node_id)
        commands = self._forget_node(node_id)
        alloc = Allocator(dram_capacity, alignment)
        node = NodeState(node_id, address, alloc, ssd_capacity, last_seen_ms=now_ms, max_blocks=max_blocks)
        conflicts: dict[TierName, list[str]] = {DRAM: [], SSD: []}
        dram_items = sorted((i for i in inventory if i.tier == "dram"), key=lambda i: i.offset)
        extents: list[tuple[int, int]] = []
        end = 0
        adopted: set[str] = set()
        for item in dram_items:
            if item.offset < end or item.offset % alignment or item.offset + item.size > alloc.capacity:
                conflicts[DRAM].append(item.key)
            else:
                extents.append((item.offset, item.size))
                end = item.offset + alloc.round_up(item.size)
                adopted.add(item.key)
        node.alloc = Allocator.rebuild(dram_capacity, alignment, extents)
        self.nodes[node_id] = node
        for item in inventory:
            tier = DRAM if item.tier == "dram" else SSD
            if tier is DRAM and item.key not in adopted:
                continue
            entry = self.objects.get(item.key) or self._pending.get(item.key)
            if entry is not None and (
                not entry.committed or entry.removing or entry.size != item.size or entry.checksum != item.checksum
            ):
                conflicts[tier].append(item.key)
                if tier is DRAM:
                    node.alloc.free(Extent(item.offset, node.alloc.round_up(item.size)))
                continue
            if entry is None:
                entry = ObjectEntry(item.key, item.size, item.checksum, [], True, 0, item.pinned)
                self.objects[item.key] = entry
            extent = Extent(item.offset, node.alloc.round_up(item.size)) if tier is DRAM else None
            entry.replicas.append(ReplicaState(node_id, tier, extent))
            node.lru(tier).insert(item.key, item.size)
            if entry.pinned:
                node.lru(tier).pin(item.key)
            if tier is SSD:
                node.ssd_used += item.size
        return commands + self._issue(
            [
                NodeCommand(node_id, ActionKind.DROP, tier, tuple(keys), release=True)
                for tier, keys in conflicts.items()
                if keys
            ]
        )

    def _forget_node(self, node_id: str) -> list[NodeCommand]:
        """Drop every replica on ``node_id``; returns revocations of its puts' replicas on other nodes."""
        if self.nodes.pop(node_id, None) is None:
            return []
        # Its grants go with it: the daemon forgets them when it registers, and the allocator is rebuilt.
        for grant_id in [g.grant_id for g in self.grants.values() if g.node_id == node_id]:
            del self.grants[grant_id]
        broken: list[ObjectEntry] = []
        # Readable replicas and moving ones alike: the daemon's inventory now tells what it holds.
        for store in (self.objects, self._pending):
            for key, entry in list(store.items()):
                kept = [r for r in entry.replicas if r.node_id != node_id]
                if len(kept) == len(entry.replicas):
                    continue
                entry.replicas = kept
                if not kept:
                    del store[key]
                    self._want_promote.discard(key)
                elif not entry.committed and not entry.removing:
                    broken.append(entry)
        # A put that had a replica there cannot complete; its other replicas may hold bytes already.
        return self._revoke(broken)

    def heartbeat(self, node_id: str, now_ms: int) -> bool:
        """Record that ``node_id`` is alive; False when the table does not know it (it must re-register)."""
        node = self.nodes.get(node_id)
        if node is None:
            return False
        node.last_seen_ms = now_ms
        node.up = True
        return True

    def up_nodes(self) -> list[NodeState]:
        return [n for n in self.nodes.values() if n.up]

    # -- time -------------------------------------------------------------------------
    def expire(self, now_ms: int) -> list[NodeCommand]:
        """Mark silent nodes down, end expired leases and reservations; returns the drops and promotions due."""
        for node in self.nodes.values():
            if node.up and now_ms - node.last_seen_ms > self.node_ttl_ms:
                node.up = False
        self.leases.expire(now_ms)
        expired = [e for e in self._pending.values() if e.deadline_ms <= now_ms]
        self.counters["expired"] += len(expired)
        return self._revoke(expired) + self._plan_promotions()

    def expired_grants(self, now_ms: int) -> dict[str, list[int]]:
        """Grants past their deadline, now ending, by node: their daemons must be told (then
        :meth:`finish_end_grants`)."""
        due = [g.grant_id for g in self.grants.values() if not g.ending and g.deadline_ms <= now_ms]
        self.counters["grants_expired"] += len(due)
        return self.end_grants(due)

    # -- grants: space written into without a master round trip per put -------------------------
    def grant_space(self, length: int, preferred_node: str | None, ttl_ms: int, now_ms: int) -> GrantPlan:
        """Reserve ``length`` bytes of one node's DRAM (placement as for a put, evicting by LRU first
        when the node is above its high watermark) for ``ttl_ms``."""
        if type(length) is not int or length <= 0:
            raise InvalidArgument(f"grant length must be a positive int, got {length!r}")
        if type(ttl_ms) is not int or ttl_ms <= 0:
            raise InvalidArgument(f"grant ttl must be a positive int of milliseconds, got {ttl_ms!r}")
        placeable = [n for n in self.up_nodes() if n.node_id not in self.draining]
        if not placeable:
            return GrantPlan(None, [], False, NoNodes("no storage node is up"))
        plan = PutPlan([], [], [])
        waiting = False
        for node in self.strategy(placeable, preferred_node, self._rng):
            if node.alloc.capacity < length:
                continue
            extent, evicting = self._reserve(node, length, plan)
            if extent is not None:
                grant = Grant(self._next_grant, node.node_id, [extent], now_ms + ttl_ms)
                self._next_grant += 1
                self.grants[grant.grant_id] = grant
                self.counters["grants"] += 1
                return GrantPlan(grant, plan.commands, False)
            waiting = waiting or evicting or node.inflight > 0
            if plan.commands:
                break  # room is being made on this node: ask again once it is
        if waiting:
            return GrantPlan(None, plan.commands, True)
        if not any(n.alloc.capacity >= length for n in placeable):
            return GrantPlan(
                None, [], False, CapacityError(f"a grant of {length} bytes is larger than every node's DRAM")
            )
        if any(self._busy(n) for n in placeable):
            return GrantPlan(None, [], False, RetryLater(f"no room for a grant of {length} bytes yet"))
        return GrantPlan(None, [], False, CapacityError(f"no room for a grant of {length} bytes: DRAM is pinned"))

    def confirm_grant(self, grant_id: int, deadline_ms: int) -> None:
        """Set the grant's deadline once its daemon took it (the daemon's own deadline ends earlier)."""
        grant = self.grants.get(grant_id)
        if grant is not None:
            grant.deadline_ms = deadline_ms

    def end_grants(self, grant_ids: Iterable[int]) -> dict[str, list[int]]:
        """Stop committing into these grants; by node, the grants its daemon must close."""
        out: dict[str, list[int]] = {}
        for grant_id in grant_ids:
            grant = self.grants.get(grant_id)
            if grant is None or grant.ending:
                continue
            grant.ending = True
            out.setdefault(grant.node_id, []).append(grant_id)
        return out

    def finish_end_grants(self, node_id: str, grant_ids: Iterable[int]) -> None:
        """The daemon closed these grants: their unused pieces return to the pool."""
        node = self.nodes.get(node_id)
        for grant_id in grant_ids:
            grant = self.grants.get(grant_id)
            if grant is None or grant.node_id != node_id:
                continue
            del self.grants[grant_id]
            if node is not None:
                for piece in grant.pieces:
                    node.alloc.free(piece)

    def commit_granted(
        self,
        node_id: str,
        grant_id: int,
        keys: Sequence[str],
        offsets: Sequence[int],
        sizes: Sequence[int],
        checksums: Sequence[int],
        pinned: bool,
    ) -> list[tuple[int, str]]:
        """Commit blocks a daemon holds written into a grant, each at its extent; per block
        (PUT_STORED, "") or (PUT_EXISTS, "") or an error's (code, text). Idempotent: a block
        already committed at that extent with that checksum answers PUT_STORED again."""
        if not len(keys) == len(offsets) == len(sizes) == len(checksums):
            raise InvalidArgument("commit_granted got lists of different lengths")
        grant = self.grants.get(grant_id)
        node = self.nodes.get(node_id)
        out: list[tuple[int, str]] = []
        for key, offset, size, check in zip(keys, offsets, sizes, checksums, strict=True):
            key = validate_key(key)
            entry = self.objects.get(key) or self._pending.get(key)
            if entry is not None:
                same = entry.committed and any(
                    r.node_id == node_id and r.extent is not None and r.extent.offset == offset for r in entry.replicas
                )
                if same and entry.checksum == check and entry.size == size:
                    out.append((PUT_STORED, ""))
                elif entry.removing:
                    out.append((RetryLater.code, f"key {key!r} is being moved or removed; retry"))
                else:
                    self.counters["put_exists"] += 1
                    if entry.committed:
                        self._touch(entry)
                    out.append((PUT_EXISTS, ""))
                continue
            if grant is None or grant.ending or grant.node_id != node_id or node is None:
                out.append((GrantExpired.code, f"grant {grant_id} on {node_id} has ended"))
                continue
            if type(size) is not int or size <= 0 or type(offset) is not int:
                out.append((InvalidArgument.code, f"block {key!r}: bad extent ({offset!r}, {size!r})"))
                continue
            extent = Extent(offset, node.alloc.round_up(size))
            at = next((i for i, p in enumerate(grant.pieces) if p.offset <= offset and extent.end <= p.end), None)
            if at is None or offset % node.alloc.alignment:
                out.append(
                    (InvalidArgument.code, f"block {key!r}: extent {extent} is not free space of grant {grant_id}")
                )
                continue
            grant.pieces[at : at + 1] = node.alloc.carve(grant.pieces[at], extent)
            entry = ObjectEntry(key, size, check, [ReplicaState(node_id, DRAM, extent)], True, 0, pinned)
            self.objects[key] = entry
            node.dram_lru.insert(key, size)
            if pinned:
                node.dram_lru.pin(key)
            self.counters["puts"] += 1
            self.counters["bytes_written"] += size
            out.append((PUT_STORED, ""))
        return out

    def record_access(self, node_id: str, keys: Iterable[str]) -> None:
        """Count reads ``node_id``'s daemon served by key (no master round trip) and touch their LRU."""
        counters = self.counters
        for key in keys:
            entry = self.objects.get(key)
            if entry is None or entry.removing or not entry.committed:
                continue
            replica = next((r for r in entry.replicas if r.node_id == node_id and not r.moving), None)
            if replica is None:
                continue
            counters["gets"] += 1
            counters["hits"] += 1
            counters["bytes_read"] += entry.size
            self._touch(entry)
            if replica.tier is DRAM:
                counters["dram_hits"] += 1
            else:
                counters["ssd_hits"] += 1
                entry.ssd_hits += 1
                if self.policy.should_promote(entry.ssd_hits) and not any(r.tier is DRAM for r in entry.replicas):
                    self._want_promote.add(key)

    # -- writes -----------------------------------------------------------------------
    def put_start(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        replicas: int,
        preferred_node: str | None,
        pin: bool,
        now_ms: int,
    ) -> PutPlan:
        if len(keys) != len(sizes):
            raise InvalidArgument(f"put_start got {len(keys)} keys but {len(sizes)} sizes")
        checked = [validate_key(k) for k in keys]
        for key, size in zip(checked, sizes, strict=True):
            if type(size) is not int or size <= 0:
                raise InvalidArgument(f"size of {key!r} must be a positive int, got {size!r}")
        if not 1 <= replicas <= 16:
            raise InvalidArgument(f"replicas must be between 1 and 16, got {replicas}")
        plan = PutPlan([], [], [])
        # One ordering for the whole batch: a batch is usually one request's chain of blocks, and
        # keeping it together on a node keeps a prefix from spanning nodes that evict independently.
        placeable = [n for n in self.up_nodes() if n.node_id not in self.draining]
        ordered = self.strategy(placeable, preferred_node, self._rng)
        for i, (key, size) in enumerate(zip(checked, sizes, strict=True)):
            plan.tickets.append(self._place(key, size, replicas, ordered, pin, now_ms, plan, i))
        return plan

    def _place(
        self,
        key: BlockKey,
        size: int,
        replicas: int,
        ordered: list[NodeState],
        pin: bool,
        now_ms: int,
        plan: PutPlan,
        i: int,
    ) -> PutTicket | None:
        existing = self.objects.get(key) or self._pending.get(key)
        if existing is not None:
            if existing.removing:
                return _ticket_error(RetryLater(f"key {key!r} is being moved or removed; retry"))
            self.counters["put_exists"] += 1
            if existing.committed:
                self._touch(existing)
            return PutTicket("exists", [], 0, "")
        nodes = [n for n in ordered if n.alloc.capacity >= size]
        if not nodes:
            if not self.up_nodes():
                return _ticket_error(NoNodes("no storage node is up"))
            return _ticket_error(CapacityError(f"block {key!r} of {size} bytes is larger than every node's DRAM"))
        if len(nodes) < replicas:
            # Fewer copies than asked would be a silent loss of redundancy: say so instead.
            return _ticket_error(
                NoNodes(f"{replicas} replicas of {key!r} asked for, but only {len(nodes)} nodes can hold it")
            )
        chosen: list[ReplicaState] = []
        waiting = False  # some node will have room once its evictions are done
        for node in nodes:
            if len(chosen) == replicas:
                break
            extent, evicting = self._reserve(node, size, plan)
            if extent is not None:
                chosen.append(ReplicaState(node.node_id, DRAM, extent))
            waiting = waiting or (extent is None and (evicting or node.inflight > 0))
        if (waiting and len(chosen) < min(replicas, len(nodes))) or not chosen:
            for r in chosen:
                assert r.extent is not None
                self.nodes[r.node_id].alloc.free(r.extent)
            if waiting:
                plan.waiting.append(i)
                return None
            if any(self._busy(node) for node in nodes):
                # Leases end and puts commit or expire: room will come without anyone's help.
                return _ticket_error(
                    RetryLater(f"no room for block {key!r} of {size} bytes yet: DRAM is leased or being written")
                )
            return _ticket_error(
                CapacityError(f"no room for block {key!r} of {size} bytes: every node's DRAM is pinned")
            )
        entry = ObjectEntry(key, size, 0, chosen, False, now_ms + self.reservation_ms, pin)
        self._pending[key] = entry
        self.counters["puts"] += 1
        return PutTicket("ok", [self._wire_replica(entry, r) for r in chosen], 0, "")

    def _busy(self, node: NodeState) -> bool:
        """Whether some of the node's DRAM is held only for now: leased, or reserved by puts in flight."""
        if self.leases.num_leased(node.node_id, DRAM) or any(g.node_id == node.node_id for g in self.grants.values()):
            return True
        return any(r.node_id == node.node_id for e in self._pending.values() for r in e.replicas)

    def _reserve(self, node: NodeState, size: int, plan: PutPlan) -> tuple[Extent | None, bool]:
        """An extent on ``node`` (or None), and whether evictions were added to ``plan`` for it.

        Past the high watermark the node evicts down to the low one even when
        the extent was found, so that later puts find room without waiting.
        """
        # Bytes that evictions in flight will free count as free already, so nothing is evicted for them twice.
        dram_used = node.alloc.used - node.dram_freeing
        over = self.policy.over_high_watermark(dram_used + size, node.alloc.capacity)
        if node.max_blocks and node.alloc.num_extents >= node.max_blocks:
            # Every slot of the arena's index is taken: room comes only from evicting blocks.
            if node.inflight:
                return None, False  # evictions in flight will free slots; the put waits for them
            view = self._dram_view(node, dram_used)
            actions = self.policy.make_slots(view, self._ssd_view(node), node.alloc.num_extents, node.max_blocks)
            plan.commands.extend(self._start_actions(node, actions))
            return None, bool(actions)
        extent = node.alloc.alloc(size)
        if extent is not None and not over:
            return extent, False
        view = self._dram_view(node, dram_used + (size if extent is not None else 0))
        ssd = self._ssd_view(node)
        incoming, force = (0, 0) if extent is not None else (size, size)  # a found extent is in ``used`` already
        actions = self.policy.make_room(view, ssd, incoming, force_bytes=force)
        plan.commands.extend(self._start_actions(node, actions))
        return extent, bool(actions)

    def _dram_view(self, node: NodeState, used: int) -> TierView[str]:
        """The node's DRAM tier as the policy sees it, with ``used`` bytes in use."""
        return TierView(node.alloc.capacity, used, node.dram_lru, self.leases.leased_keys(node.node_id, DRAM))

    def _ssd_view(self, node: NodeState) -> TierView[str] | None:
        """The node's SSD tier as the policy sees it, counting evictions in flight; None without SSD."""
        if not node.ssd_capacity:
            return None
        leased = self.leases.leased_keys(node.node_id, SSD)
        return TierView(node.ssd_capacity, node.ssd_used + node.ssd_delta, node.ssd_lru, leased)

    def _start_actions(self, node: NodeState, actions: Sequence[Action[str]]) -> list[NodeCommand]:
        """Mark the replicas of ``actions`` moving and group them into commands, in execution order."""
        groups: dict[tuple[ActionKind, TierName], list[tuple[str, int]]] = {}
        for action in actions:
            self._count_eviction(node, action.kind, action.tier, action.size, +1)
            entry = self.objects[action.key]
            for r in entry.replicas:
                if r.node_id == node.node_id:
                    r.moving = True
            node.lru(action.tier).remove(action.key)
            groups.setdefault((action.kind, action.tier), []).append((action.key, action.size))
        return self._issue(
            [
                NodeCommand(node.node_id, kind, tier, tuple(k for k, _ in items), sizes=tuple(n for _, n in items))
                for (kind, tier), items in groups.items()
            ]
        )

    @staticmethod
    def _count_eviction(node: NodeState, kind: ActionKind, tier: TierName, size: int, sign: int) -> None:
        if tier is DRAM:
            node.dram_freeing += sign * size
        if kind is ActionKind.DEMOTE:
            node.ssd_delta += sign * size
        elif tier is SSD:
            node.ssd_delta -= sign * size

    def put_end(self, keys: Sequence[str], checksums: Sequence[int]) -> list[bool]:
        """Commit reserved keys; False for a key whose reservation is gone (expired or revoked)."""
        if len(keys) != len(checksums):
            raise InvalidArgument(f"put_end got {len(keys)} keys but {len(checksums)} checksums")
        out = []
        for key, check in zip(keys, checksums, strict=True):
            entry = self._pending.get(key)
            if entry is None or entry.removing:
                out.append(False)
                continue
            del self._pending[key]
            entry.committed, entry.checksum = True, check
            self.objects[key] = entry
            for r in entry.replicas:
                lru = self.nodes[r.node_id].dram_lru
                lru.insert(key, entry.size)
                if entry.pinned:
                    lru.pin(key)
            self.counters["bytes_written"] += entry.size
            out.append(True)
        return out

    def put_revoke(self, keys: Iterable[str]) -> list[NodeCommand]:
        """Give up reservations; their daemons must drop whatever was written before the extents are reused."""
        return self._revoke([e for k in keys if (e := self._pending.get(k)) is not None and not e.removing])

    def _revoke(self, entries: Sequence[ObjectEntry]) -> list[NodeCommand]:
        per_node: dict[str, list[str]] = {}
        for entry in entries:
            entry.removing = True
            for r in entry.replicas:
                per_node.setdefault(r.node_id, []).append(entry.key)
        return self._issue(
            [NodeCommand(n, ActionKind.DROP, DRAM, tuple(keys), release=True) for n, keys in per_node.items()]
        )

    # -- reads ------------------------------------------------------------------------
    def _readable(self, entry: ObjectEntry | None) -> list[ReplicaState]:
        if entry is None or entry.removing or not entry.committed:
            return []
        return [r for r in entry.replicas if not r.moving and self.nodes[r.node_id].up]

    def _touch(self, entry: ObjectEntry) -> None:
        for r in entry.replicas:
            lru = self.nodes[r.node_id].lru(r.tier)
            if entry.key in lru:
                lru.touch(entry.key)

    def get_replicas(self, keys: Sequence[str], now_ms: int, lease: bool = True) -> GetReplicasReply:
        """Readable replicas of each key (DRAM first), leased for ``lease_ms`` when ``lease``; a miss
        has size -1. (A reader through the daemon needs no lease: the daemon copies under its lock.)

        Built straight in the flat wire form: this is the hottest call of the master.
        """
        checked = [validate_key(k) for k in keys]
        reply = GetReplicasReply([], [], [], [], [], [], [], self.lease_ms)
        sizes, checksums, counts = reply.sizes, reply.checksums, reply.counts
        expiry = now_ms + self.lease_ms
        counters = self.counters
        grant = self.leases.grant
        for key in checked:
            entry = self.objects.get(key)
            readable = self._readable(entry)
            if entry is None or not readable:
                counters["misses"] += 1
                sizes.append(-1)
                checksums.append(0)
                counts.append(0)
                continue
            counters["hits"] += 1
            self._touch(entry)
            if len(readable) > 1:
                readable.sort(key=lambda r: r.tier is not DRAM)
            if lease:
                grant(key, [(r.node_id, r.tier) for r in readable], expiry)
            for r in readable:
                node = self.nodes[r.node_id]
                reply.nodes.append(r.node_id)
                reply.addresses.append(node.address)
                reply.tiers.append(r.tier.value)
                reply.offsets.append(r.extent.offset if r.extent is not None and r.tier is DRAM else -1)
            sizes.append(entry.size)
            checksums.append(entry.checksum)
            counts.append(len(readable))
            counters["bytes_read"] += entry.size
            if readable[0].tier is DRAM:
                counters["dram_hits"] += 1
            else:
                counters["ssd_hits"] += 1
                entry.ssd_hits += 1
                if self.policy.should_promote(entry.ssd_hits):
                    self._want_promote.add(key)
        counters["gets"] += len(checked)
        return reply

    def release_leases(self, keys: Iterable[str]) -> list[NodeCommand]:
        """A reader is done with one lease per key in ``keys`` (once per time a get handed the key
        out): each ends the key's first-expiring lease, or none for a release that came late (see
        :meth:`Leases.release_key`). Returns promotions now due."""
        for key in keys:
            self.leases.release_key(key)
        return self._plan_promotions()

    def _plan_promotions(self) -> list[NodeCommand]:
        """Promote wanted SSD blocks that no reader holds, where DRAM has room without evicting."""
        per_node: dict[str, list[tuple[str, int]]] = {}
        for key in list(self._want_promote):
            entry = self.objects.get(key)
            ssd = [r for r in self._readable(entry) if r.tier is SSD]
            if entry is None or not ssd or any(r.tier is DRAM for r in entry.replicas):
                self._want_promote.discard(key)
                continue
            node = self.nodes[ssd[0].node_id]
            if self.leases.is_leased(node.node_id, SSD, key) or node.ssd_lru.is_pinned(key):
                continue
            self._want_promote.discard(key)
            if self.policy.over_high_watermark(node.alloc.used + entry.size, node.alloc.capacity):
                continue
            extent = node.alloc.alloc(entry.size)
            if extent is None:
                continue
            ssd[0].moving = True
            node.ssd_lru.remove(key)
            ssd[0].extent = extent  # where it will land; the tier changes when the daemon confirms
            per_node.setdefault(node.node_id, []).append((key, extent.offset))
        return self._issue(
            [
                NodeCommand(n, ActionKind.PROMOTE, SSD, tuple(k for k, _ in items), tuple(o for _, o in items))
                for n, items in per_node.items()
            ]
        )

    def match_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys are committed and readable."""
        objects, nodes = self.objects, self.nodes
        for i, key in enumerate(keys):
            entry = objects.get(key)
            if entry is None or entry.removing or not entry.committed:
                return i
            if not any(not r.moving and nodes[r.node_id].up for r in entry.replicas):
                return i
        return len(keys)

    def match_prefix_nodes(self, keys: Sequence[str]) -> PrefixMatch:
        """The longest readable prefix of ``keys`` (as :meth:`match_prefix`) and, per node holding
        the first key, how many leading keys it holds readable: in any tier, and in DRAM.

        One pass, O(keys x replicas): a node's count grows only while it equals the index of the
        key at hand, so a node that missed a key stops; the pass ends at the first key no node
        can serve, where every count has stopped too.
        """
        objects, nodes = self.objects, self.nodes
        total: dict[str, int] = {}
        dram: dict[str, int] = {}
        longest = len(keys)
        for i, key in enumerate(keys):
            entry = objects.get(key)
            if entry is None or entry.removing or not entry.committed:
                longest = i
                break
            readable = False
            for r in entry.replicas:
                if r.moving or not nodes[r.node_id].up:
                    continue
                readable = True
                node_id = r.node_id
                if total.get(node_id, 0) == i:
                    total[node_id] = i + 1
                    if r.tier is DRAM and dram.get(node_id, 0) == i:
                        dram[node_id] = i + 1
            if not readable:
                longest = i
                break
        return PrefixMatch(longest, {n: NodePrefix(dram.get(n, 0), t) for n, t in total.items()})

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [bool(self._readable(self.objects.get(validate_key(k)))) for k in keys]

    def remove(self, keys: Iterable[str]) -> tuple[int, list[NodeCommand]]:
        """Stop serving ``keys`` at once; returns how many were stored and the drops their daemons must do."""
        per: dict[tuple[str, TierName], list[str]] = {}
        removed = 0
        for key in keys:
            entry = self.objects.get(validate_key(key))
            if entry is None or entry.removing:
                continue
            removed += 1
            entry.removing = True
            self._want_promote.discard(key)
            for r in entry.replicas:
                if r.copying:
                    continue  # the daemon may not hold it yet: finish_replicas drops it once answered
                lru = self.nodes[r.node_id].lru(r.tier)
                if key in lru:
                    lru.remove(key)
                per.setdefault((r.node_id, r.tier), []).append(key)
        return removed, self._issue(
            [NodeCommand(n, ActionKind.DROP, t, tuple(ks), release=True) for (n, t), ks in per.items()]
        )

    # -- command completion ---------------------------------------------------------------
    def _issue(self, commands: list[NodeCommand]) -> list[NodeCommand]:
        """Count commands as in flight on their nodes until :meth:`apply` sees their answers."""
        for c in commands:
            node = self.nodes.get(c.node_id)
            if node is not None:
                node.inflight += len(c.keys)
        return commands

    def apply(self, command: NodeCommand, done: Sequence[bool]) -> None:
        """Record what a daemon did. ``done[i]``: DEMOTE -> moved (else dropped);
        DROP -> it was there; PROMOTE -> moved (else it stays on SSD)."""
        if len(done) != len(command.keys):
            raise InvalidArgument(f"{len(done)} results for a command of {len(command.keys)} keys")
        node = self.nodes.get(command.node_id)
        if node is None:
            return  # the node left; its inventory will replace this state
        node.inflight = max(0, node.inflight - len(command.keys))
        for size in command.sizes:
            self._count_eviction(node, command.kind, command.tier, size, -1)
        for key, ok in zip(command.keys, done, strict=True):
            entry = self.objects.get(key) or self._pending.get(key)
            replica = next((r for r in entry.replicas if r.node_id == node.node_id), None) if entry else None
            if entry is None or replica is None:
                continue
            if command.kind is ActionKind.PROMOTE:
                self._finish_promote(node, entry, replica, ok)
            elif command.kind is ActionKind.DEMOTE and ok:
                assert replica.extent is not None
                node.alloc.free(replica.extent)
                replica.tier, replica.extent = SSD, None
                node.ssd_used += entry.size
                if not entry.removing:
                    node.ssd_lru.insert(key, entry.size)
                replica.moving = False
                self.counters["demotions"] += 1
            else:
                self._drop_replica(key, node.node_id, evicted=not command.release)

    def _finish_promote(self, node: NodeState, entry: ObjectEntry, replica: ReplicaState, ok: bool) -> None:
        replica.moving = False
        assert replica.extent is not None
        if ok:
            replica.tier = DRAM
            node.ssd_used -= entry.size
            if not entry.removing:
                node.dram_lru.insert(entry.key, entry.size)
            entry.ssd_hits = 0
            self.counters["promotions"] += 1
        else:
            node.alloc.free(replica.extent)
            replica.extent = None
            if not entry.removing:
                node.ssd_lru.insert(entry.key, entry.size)

    def _drop_replica(self, key: str, node_id: str, evicted: bool = False) -> None:
        entry = self.objects.get(key) or self._pending.get(key)
        node = self.nodes.get(node_id)
        if entry is None:
            return
        for r in [r for r in entry.replicas if r.node_id == node_id]:
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
        if not entry.replicas:
            self.objects.pop(key, None)
            self._pending.pop(key, None)
            self._want_promote.discard(key)

    # -- operators: inspection and eviction ---------------------------------------------------
    def tier_usage(self, node: NodeState) -> dict[str, dict[str, int]]:
        """Per tier: capacity and used bytes, readable blocks, pinned and leased ones among them."""
        out: dict[str, dict[str, int]] = {}
        for tier, capacity, used in ((DRAM, node.alloc.capacity, node.alloc.used), (SSD, node.ssd_capacity,
                                                                                    node.ssd_used)):  # fmt: skip
            lru = node.lru(tier)
            out[tier.value] = {
                "capacity": capacity,
                "used": used,
                "blocks": len(lru),
                "pinned": lru.num_pinned,
                "leased": sum(1 for key in self.leases.leased_keys(node.node_id, tier) if key in lru),
            }
        return out

    def describe(self, key: str) -> dict[str, object] | None:
        """What the table knows of one key (stored or being written); None when it knows nothing."""
        entry = self.objects.get(validate_key(key)) or self._pending.get(key)
        if entry is None:
            return None
        replicas = []
        for r in entry.replicas:
            node = self.nodes.get(r.node_id)
            lru = node.lru(r.tier) if node is not None else None
            replicas.append({
                "node_id": r.node_id,
                "tier": r.tier.value,
                "offset": r.extent.offset if r.extent is not None and r.tier is DRAM else -1,
                "moving": r.moving,
                "leased": bool(lru is not None and key in lru and self.leases.is_leased(r.node_id, r.tier, key)),
                "node_up": bool(node is not None and node.up),
            })  # fmt: skip
        state = "removing" if entry.removing else "committed" if entry.committed else "writing"
        return {"key": entry.key, "size": entry.size, "checksum": entry.checksum, "pinned": entry.pinned,
                "state": state, "replicas": replicas}  # fmt: skip

    def keys_page(self, prefix: str, after: str | None, limit: int) -> tuple[list[str], str | None]:
        """Stored keys starting with ``prefix``, in order, after ``after``: one page and the next page's cursor."""
        # One pass, keeping the smallest limit + 1 (no sort of every key: the event loop is shared).
        floor = after if after is not None else ""
        candidates = (k for k, e in self.objects.items() if k > floor and k.startswith(prefix) and not e.removing)
        page = heapq.nsmallest(limit + 1, candidates)
        return page[:limit], (page[limit - 1] if len(page) > limit else None)

    def evict_keys(self, keys: Iterable[str]) -> tuple[int, list[str], list[NodeCommand]]:
        """Drop stored blocks from every tier (an operator's eviction); pinned ones stay.
        Returns how many were evicted, the pinned ones skipped, and the daemons' drops."""
        victims: list[str] = []
        pinned: list[str] = []
        for key in keys:
            entry = self.objects.get(validate_key(key))
            if entry is None or entry.removing:
                continue
            (pinned if entry.pinned else victims).append(key)
        evicted, commands = self.remove(victims)
        self.counters["evictions"] += evicted
        return evicted, pinned, commands

    def evict_tier(self, node_id: str, tier: TierName) -> tuple[int, list[NodeCommand]]:
        """Empty one tier of a node of what may go (neither pinned nor leased): DRAM blocks are
        demoted to SSD where it has room (making room there by LRU), SSD blocks dropped."""
        node = self.nodes.get(node_id)
        if node is None:
            raise NotFound(f"node {node_id!r} is not registered")
        if tier is DRAM:
            view = self._dram_view(node, node.alloc.used)
            actions = self.policy.make_room(view, self._ssd_view(node), 0, force_bytes=node.alloc.used)
        else:
            leased = self.leases.leased_keys(node_id, SSD)
            actions = [Action(ActionKind.DROP, key, SSD, size) for key, size in node.ssd_lru.victims(leased)]
        return len(actions), self._start_actions(node, actions)

    def plan_moves(self, node_id: str, limit: int, skip: Collection[str] = ()) -> tuple[list[Move], list[NodeCommand]]:
        """Up to ``limit`` blocks of a draining node: copies to make on other nodes (extents reserved
        there), and drops of replicas that have copies elsewhere already."""
        node = self.nodes.get(node_id)
        if node is None:
            raise NotFound(f"node {node_id!r} is not registered")
        targets = [n for n in self.up_nodes() if n.node_id != node_id and n.node_id not in self.draining]
        moves: list[Move] = []
        drops: dict[TierName, list[str]] = {}
        for tier in (DRAM, SSD):
            for key in list(node.lru(tier)):
                if len(moves) + sum(map(len, drops.values())) >= limit:
                    break
                if key in skip:
                    continue
                entry = self.objects[key]
                here = next(r for r in entry.replicas if r.node_id == node_id)
                if any(r.node_id != node_id and not r.moving for r in entry.replicas):
                    here.moving = True
                    node.lru(tier).remove(key)
                    drops.setdefault(tier, []).append(key)
                    continue
                for target in sorted(targets, key=lambda n: -n.alloc.free_bytes):
                    if any(r.node_id == target.node_id for r in entry.replicas):
                        continue  # one replica per node: a copy is coming in there already
                    extent = target.alloc.alloc(entry.size)
                    if extent is not None:
                        here.moving = True
                        node.lru(tier).remove(key)
                        moves.append(Move(key, entry.size, entry.checksum, tier, target.node_id, extent, node_id))
                        break
        commands = [NodeCommand(node_id, ActionKind.DROP, t, tuple(ks), release=True) for t, ks in drops.items()]
        return moves, self._issue(commands)

    def finish_moves(self, source: str, moves: Sequence[Move], done: Sequence[bool]) -> list[NodeCommand]:
        """Record the copies a target made: a copied block gains its new replica and the source's is
        dropped; a failed one frees the reserved extent and stays where it was."""
        drops: dict[TierName, list[str]] = {}
        for move, ok in zip(moves, done, strict=True):
            entry = self.objects.get(move.key)
            target = self.nodes.get(move.target)
            here = next((r for r in entry.replicas if r.node_id == source), None) if entry else None
            if entry is None or here is None or entry.removing or target is None or not ok:
                if target is not None:
                    target.alloc.free(move.extent)
                if entry is not None and here is not None and not entry.removing and source in self.nodes:
                    here.moving = False
                    self.nodes[source].lru(here.tier).insert(move.key, entry.size)
                continue
            entry.replicas.append(ReplicaState(move.target, DRAM, move.extent))
            target.dram_lru.insert(move.key, entry.size)
            if entry.pinned:
                target.dram_lru.pin(move.key)
            drops.setdefault(here.tier, []).append(move.key)
        return self._issue(
            [NodeCommand(source, ActionKind.DROP, t, tuple(ks), release=True) for t, ks in drops.items()]
        )

    def plan_replicas(self, keys: Sequence[str], target_node_id: str, max_bytes: int) -> list[Move]:
        """Copies of stored blocks to add in the DRAM of ``target_node_id``, other replicas kept.

        Keys are taken in order; one that is not readable, or has a replica (or a copy coming) on
        the target, is skipped. Each copy reserves an extent on the target without evicting
        anything and without filling it past the high watermark; planning stops at the first key
        that does not fit, or that would take the copied bytes past ``max_bytes``. A down or
        draining target gets nothing. The reserved replica is ``copying`` (not readable, in no
        LRU) until :meth:`finish_replicas`; each move's source is a readable replica, DRAM first.
        """
        target = self.nodes.get(target_node_id)
        if target is None:
            raise NotFound(f"node {target_node_id!r} is not registered")
        if type(max_bytes) is not int or max_bytes < 0:
            raise InvalidArgument(f"max_bytes must be a non-negative int, got {max_bytes!r}")
        checked = [validate_key(k) for k in keys]
        if not target.up or target_node_id in self.draining:
            return []
        moves: list[Move] = []
        budget = max_bytes
        alloc = target.alloc
        for key in checked:
            entry = self.objects.get(key)
            sources = self._readable(entry)
            if entry is None or not sources or any(r.node_id == target_node_id for r in entry.replicas):
                continue
            if entry.size > budget or (target.max_blocks and alloc.num_extents >= target.max_blocks):
                break
            if self.policy.over_high_watermark(alloc.used + entry.size, alloc.capacity):
                break
            extent = alloc.alloc(entry.size)
            if extent is None:
                break
            budget -= entry.size
            source = min(sources, key=lambda r: r.tier is not DRAM)
            entry.replicas.append(ReplicaState(target_node_id, DRAM, extent, moving=True, copying=True))
            moves.append(Move(key, entry.size, entry.checksum, source.tier, target_node_id, extent, source.node_id))
        return moves

    def finish_replicas(
        self, moves: Sequence[Move], done: Sequence[bool], *, answered: bool = True
    ) -> tuple[list[Move], list[NodeCommand]]:
        """Record the copies a target made (``done[i]``: the block is committed there).

        A copied block gains its replica: readable, in the target's DRAM LRU (pinned if the block
        is). A copy that failed frees its extent at once; with ``answered=False`` (the target never
        answered, and may yet hold the block) the target is told to drop it instead, and the
        extent is freed when it confirms. A block removed meanwhile gains nothing: a copy that was
        made is dropped the same way. Returns the copies that became replicas, and the drops to send.
        """
        if len(done) != len(moves):
            raise InvalidArgument(f"{len(done)} results for {len(moves)} copies")
        copied: list[Move] = []
        drops: dict[str, list[str]] = {}
        for move, ok in zip(moves, done, strict=True):
            entry = self.objects.get(move.key)
            target = self.nodes.get(move.target)
            replica = None
            if entry is not None:
                replica = next(
                    (r for r in entry.replicas if r.node_id == move.target and r.copying and r.extent == move.extent),
                    None,
                )
            if entry is None or target is None or replica is None:
                continue  # the target left or re-registered: its inventory replaced this copy
            replica.copying = False
            if ok and not entry.removing:
                replica.moving = False
                target.dram_lru.insert(move.key, entry.size)
                if entry.pinned:
                    target.dram_lru.pin(move.key)
                copied.append(move)
            elif ok or not answered:
                drops.setdefault(move.target, []).append(move.key)  # the extent is freed once the drop is applied
            else:
                self._drop_replica(move.key, move.target)
        return copied, self._issue(
            [NodeCommand(n, ActionKind.DROP, DRAM, tuple(ks), release=True) for n, ks in drops.items()]
        )

    def blocks_on(self, node_id: str) -> int:
        """Blocks (stored or being written) with a replica on ``node_id``."""
        return sum(
            1 for store in (self.objects, self._pending) for e in store.values()
            if any(r.node_id == node_id for r in e.replicas)
        )  # fmt: skip

    # -- reporting --------------------------------------------------------------------------
    def _wire_replica(self, entry: ObjectEntry, r: ReplicaState) -> Replica:
        offset = r.extent.offset if r.extent is not None and r.tier is DRAM else -1
        return Replica(r.node_id, self.nodes[r.node_id].address, r.tier.value, offset, entry.size)

    def stats(self) -> dict[str, int | float]:
        up = self.up_nodes()
        out: dict[str, int | float] = dict(self.counters)
        out.update(
            nodes=len(self.nodes),
            nodes_up=len(up),
            objects=len(self.objects),
            pending=len(self._pending),
            dram_capacity=sum(n.alloc.capacity for n in self.nodes.values()),
            dram_used=sum(n.alloc.used for n in self.nodes.values()),
            ssd_capacity=sum(n.ssd_capacity for n in self.nodes.values()),
            ssd_used=sum(n.ssd_used for n in self.nodes.values()),
        )
        return out

    def check(self) -> None:
        """Assert the invariants of the module docstring (for tests)."""
        self.leases.check()
        for store in (self.objects, self._pending):
            for e in store.values():
                assert len({r.node_id for r in e.replicas}) == len(e.replicas), f"{e.key}: two replicas on a node"
                assert all(r.moving for r in e.replicas if r.copying), f"{e.key}: a copy in flight is readable"
        for node in self.nodes.values():
            node.alloc.check()
            extents = sorted(
                [
                    (r.extent.offset, r.extent.length)
                    for store in (self.objects, self._pending)
                    for e in store.values()
                    for r in e.replicas
                    if r.node_id == node.node_id and r.extent is not None
                ]
                + [(p.offset, p.length) for g in self.grants.values() if g.node_id == node.node_id for p in g.pieces]
            )
            assert extents == sorted(node.alloc._allocated.items()), f"{node.node_id}: extents drifted"
            for tier in (DRAM, SSD):
                for key in node.lru(tier):
                    entry = self.objects[key]
                    assert entry.committed and not entry.removing, f"{key} in an LRU while not readable"
                    assert any(r.node_id == node.node_id and r.tier is tier and not r.moving for r in entry.replicas)
            ssd_bytes = sum(
                e.size for e in self.objects.values() for r in e.replicas if r.node_id == node.node_id and r.tier is SSD
            )
            assert ssd_bytes == node.ssd_used, f"{node.node_id}: ssd_used {node.ssd_used} != {ssd_bytes}"
