"""The master's placement table: nodes, objects and their replicas, reservations,
grants, read leases and each node's per-tier LRU. Pure and synchronous: time
comes in as ``now_ms``, and every change a daemon must carry out comes back as
a :class:`~kvstore.placement.state.NodeCommand` that the caller sends and then
reports with :meth:`PlacementTable.apply`.

:class:`PlacementTable` is the one face of the table to the rest of the code;
each call is answered by the part that holds its rules, all over one shared
:class:`~kvstore.placement.state.Catalog`:

- :mod:`~kvstore.placement.nodes`: registration, heartbeats, silent nodes;
- :mod:`~kvstore.placement.writes`: placement strategies, puts, commits, removals;
- :mod:`~kvstore.placement.grants`: space granted for one-trip puts;
- :mod:`~kvstore.placement.reads`: lookups, leases handed out and released, access reports;
- :mod:`~kvstore.placement.leases`: the one owner of read leases;
- :mod:`~kvstore.placement.tiering`: reservations, evictions, promotions, the daemons' answers;
- :mod:`~kvstore.placement.moves`: operators' evictions, drains, replication;
- :mod:`~kvstore.placement.inspection`: usage, keys, counters, invariants.

An extent is reused only after its daemon has confirmed that the block in it
is gone, so a daemon never holds a block in an extent that the master gave to
another key. The invariants are those of :mod:`kvstore.placement.inspection`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from types import MappingProxyType

from kvstore.errors import InvalidArgument, NotFound
from kvstore.events import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, EngineBlock, removed, stored
from kvstore.placement.grants import GrantPlan, Grants
from kvstore.placement.inspection import Inspection
from kvstore.placement.moves import Moves
from kvstore.placement.nodes import Membership, NodeRecord
from kvstore.placement.reads import Reads
from kvstore.placement.state import (
    Catalog,
    Eviction,
    EvictionReason,
    Grant,
    Move,
    NodeCommand,
    NodeState,
    ObjectEntry,
    owner_of,
)  # fmt: skip
from kvstore.placement.tiering import Tiering
from kvstore.placement.writes import PLACEMENT_STRATEGIES, PutPlan, Writes
from kvstore.policy import EvictionPolicy, TierName
from kvstore.results import HeldBlock, PrefixMatch, ReplicaLookup

LABELS_UNPLACED = 65_536
"""Labels (:meth:`PlacementTable.label`) kept for keys not in the table (a put about to write them)."""


class PlacementTable:
    """The parts of the table, composed over one catalog. Readers get read-only views of its
    containers (``nodes``, ``objects``, ``grants``, ``counters``) and query methods; every change
    goes through a verb (an operator's drain: :meth:`start_drain`)."""

    def __init__(
        self,
        policy: EvictionPolicy | None = None,
        *,
        strategy: str = "local_first",
        reservation_ms: int = 30_000,
        lease_ms: int = 5_000,
        hold_ms: int = 0,
        node_ttl_ms: int = 10_000,
        seed: int = 0,
        keys_by_owner: bool = True,
    ) -> None:
        if strategy not in PLACEMENT_STRATEGIES:
            raise InvalidArgument(f"unknown placement strategy {strategy!r}; known: {sorted(PLACEMENT_STRATEGIES)}")
        policy = policy or EvictionPolicy()
        order = PLACEMENT_STRATEGIES[strategy]
        rng = random.Random(seed)  # one stream for puts and grants alike
        catalog = Catalog(lease_ms=lease_ms, keys_by_owner=keys_by_owner)
        self._catalog = catalog
        self.nodes: Mapping[str, NodeState] = MappingProxyType(catalog.nodes)
        self.objects: Mapping[str, ObjectEntry] = MappingProxyType(catalog.objects)
        self.pending: Mapping[str, ObjectEntry] = MappingProxyType(catalog.pending)
        self.grants: Mapping[int, Grant] = MappingProxyType(catalog.grants)
        self.counters: Mapping[str, int] = MappingProxyType(catalog.counters)
        self.leases = catalog.leases
        self._tiering = Tiering(catalog, policy)
        self._membership = Membership(catalog, ttl_ms=node_ttl_ms)
        self._writes = Writes(catalog, self._tiering, order, rng, reservation_ms=reservation_ms)
        self._grants = Grants(catalog, self._tiering, order, rng)
        self._reads = Reads(catalog, self._tiering, policy, lease_ms=lease_ms, hold_ms=hold_ms)
        self._moves = Moves(catalog, self._tiering, self._writes, policy)
        self._inspection = Inspection(catalog)
        self._admitted: Counter[str] = Counter()
        """Bytes of tenants' requests admitted under their quotas and not yet in the table (puts
        waiting for room, grants being opened): :meth:`tenant_held` counts them, so that requests
        served at once cannot each find the same room under a quota."""
        self._admitted_keys: Counter[tuple[str, bool]] = Counter()
        """The same for keys (tenant, pinned): :meth:`tenant_keys` counts them."""

    @property
    def policy(self) -> EvictionPolicy:
        return self._tiering.policy

    @property
    def lease_ms(self) -> int:
        return self._reads.lease_ms

    @property
    def hold_ms(self) -> int:
        return self._reads.hold_ms

    @property
    def reservation_ms(self) -> int:
        return self._writes.reservation_ms

    @property
    def node_ttl_ms(self) -> int:
        return self._membership.ttl_ms

    @node_ttl_ms.setter
    def node_ttl_ms(self, value: int) -> None:
        self._membership.ttl_ms = value

    # -- membership and time -------------------------------------------------------------------
    def register_node(
        self,
        node_id: str,
        address: str,
        dram_capacity: int,
        ssd_capacity: int,
        alignment: int,
        inventory: Sequence[HeldBlock],
        now_ms: int,
        max_blocks: int = 0,
        gone: set[tuple[str, TierName, int]] | None = None,
    ) -> list[NodeCommand]:
        return self._membership.register_node(
            node_id, address, dram_capacity, ssd_capacity, alignment, inventory, now_ms, max_blocks, gone
        )

    def check_blocks(
        self, node_id: str, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int],
        checksums: Sequence[int],
    ) -> list[bool]:  # fmt: skip
        return self._membership.check_blocks(node_id, keys, offsets, sizes, checksums)

    def release_quarantine(self, node_id: str, keys: Sequence[str]) -> None:
        self._membership.release_quarantine(node_id, keys)

    def leave_node(self, node_id: str) -> list[NodeCommand]:
        return self._membership.leave(node_id)

    def heartbeat(self, node_id: str, now_ms: int) -> bool:
        return self._membership.heartbeat(node_id, now_ms)

    def ssd_health(self, node_id: str, capacity: int, configured: int, fault: str) -> None:
        self._membership.ssd_health(node_id, capacity, configured, fault)

    def up_nodes(self) -> list[NodeState]:
        return self._catalog.up_nodes()

    def start_drain(self, node_id: str) -> None:
        """Take ``node_id`` out of placement: no new block or grant goes there, and
        :meth:`plan_moves` moves its blocks elsewhere. It stays out until :meth:`stop_drain`
        (or until it leaves)."""
        if node_id not in self._catalog.nodes:
            raise NotFound(f"node {node_id!r} is not registered")
        self._catalog.draining.add(node_id)

    def stop_drain(self, node_id: str) -> None:
        """Put a drained node back into placement."""
        self._catalog.draining.discard(node_id)

    def is_draining(self, node_id: str) -> bool:
        return node_id in self._catalog.draining

    def take_records(self) -> dict[str, NodeRecord | None]:
        return self._membership.take_records()

    def take_settling(self) -> list[tuple[str, str]]:
        """The (node, key) drops of detached blocks (Catalog.detach) confirmed since the last call,
        which the records :meth:`take_records` gives no longer name: hand them to
        :meth:`records_kept` once those are kept (a node owes the key until then: a new leader
        reading its old record would drop a block of the key put there since). Take both at once."""
        settling = []
        for node in self._catalog.nodes.values():
            if node.settling:
                settling += [(node.node_id, key) for key in node.settling]
                node.settling.clear()
        return settling

    def records_kept(self, settling: list[tuple[str, str]]) -> None:
        """The records that :meth:`take_records` gave with ``settling`` are kept: those nodes owe
        those keys no more."""
        nodes = self._catalog.nodes
        for node_id, key in settling:
            node = nodes.get(node_id)
            if node is not None:
                self._catalog.settled(node, key)

    def records_not_kept(self, settling: list[tuple[str, str]]) -> None:
        """They were not: taken again at the next :meth:`take_records`."""
        nodes = self._catalog.nodes
        for node_id, key in settling:
            node = nodes.get(node_id)
            if node is not None and key in node.owes:
                node.settling.add(key)

    def record_at_registration(self, node_id: str, gone: Iterable[tuple[str, TierName, int]] | None) -> NodeRecord:
        return self._membership.record_at_registration(node_id, set(gone) if gone is not None else None)

    def records_pending(self) -> bool:
        """Whether some node's record changed since :meth:`take_records`."""
        return bool(self._membership.records_changed)

    def record_changed(self, node_id: str) -> None:
        """``node_id``'s record is to be taken again (keeping it in etcd failed)."""
        self._membership.records_changed.add(node_id)

    def note_absent(self, node_id: str, gone: Iterable[tuple[str, TierName, int]], recorded: bool = False) -> None:
        self._membership.note_absent(node_id, set(gone), recorded)

    @property
    def absent(self) -> list[str]:
        """The absent nodes (see :mod:`kvstore.placement.nodes`)."""
        return sorted(self._membership.absent)

    def suspect(self, node_id: str, gen: int, seen_ms: int) -> bool:
        return self._membership.suspect(node_id, gen, seen_ms)

    def fence_gone(self, node_id: str, gen: int, seen_ms: int) -> bool:
        return self._membership.fence_gone(node_id, gen, seen_ms)

    def postpone_fences(self, now_ms: int, by_ms: int) -> None:
        self._membership.postpone_fences(now_ms, by_ms)

    def expire(self, now_ms: int) -> list[NodeCommand]:
        """Fence silent nodes, end expired leases and reservations; returns the drops and promotions due."""
        self._membership.fence_silent(now_ms)
        self.leases.expire(now_ms)
        self._catalog.free_parked()
        return self._writes.expire_reservations(now_ms) + self._tiering.plan_promotions()

    # -- writes --------------------------------------------------------------------------------
    def put_start(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        replicas: int,
        preferred_node: str | None,
        pin: bool,
        now_ms: int,
        tenant: str = "",
        write_id: int = 0,
        avoid: Collection[str] = (),
    ) -> PutPlan:
        self._catalog.know_tenant(tenant)
        return self._writes.put_start(keys, sizes, replicas, preferred_node, pin, now_ms, tenant, write_id, avoid)

    def put_end(self, keys: Sequence[str], checksums: Sequence[int], write_id: int = 0) -> list[bool]:
        return self._writes.put_end(keys, checksums, write_id)

    def put_revoke(self, keys: Iterable[str], write_id: int = 0) -> list[NodeCommand]:
        return self._writes.put_revoke(keys, write_id)

    def remove(self, keys: Iterable[str]) -> tuple[int, list[NodeCommand]]:
        keys = list(keys)
        removed = self._writes.remove(keys)
        self._membership.removed(keys)  # after: a key that is not valid raised first
        return removed

    # -- grants --------------------------------------------------------------------------------
    def grant_space(
        self, length: int, preferred_node: str | None, ttl_ms: int, now_ms: int, owner: str = "",
        avoid: Collection[str] = (),
    ) -> GrantPlan:  # fmt: skip
        self._catalog.know_tenant(owner)
        return self._grants.grant_space(length, preferred_node, ttl_ms, now_ms, owner, avoid)

    def confirm_grant(self, grant_id: int, deadline_ms: int) -> None:
        self._grants.confirm_grant(grant_id, deadline_ms)

    def expired_grants(self, now_ms: int) -> dict[str, list[int]]:
        return self._grants.expired_grants(now_ms)

    def end_grants(self, grant_ids: Iterable[int]) -> dict[str, list[int]]:
        return self._grants.end_grants(grant_ids)

    def finish_end_grants(self, node_id: str, grant_ids: Iterable[int]) -> None:
        self._grants.finish_end_grants(node_id, grant_ids)

    def commit_granted(
        self,
        node_id: str,
        grant_id: int,
        keys: Sequence[str],
        offsets: Sequence[int],
        sizes: Sequence[int],
        checksums: Sequence[int],
        pinned: bool,
        cached: bool = False,
        write_ids: Sequence[int] = (),
    ) -> list[tuple[int, str]]:
        return self._grants.commit_granted(
            node_id, grant_id, keys, offsets, sizes, checksums, pinned, cached, write_ids
        )

    # -- reads ---------------------------------------------------------------------------------
    def get_replicas(self, keys: Sequence[str], now_ms: int, lease: bool = True) -> ReplicaLookup:
        return self._reads.get_replicas(keys, now_ms, lease)

    def release_leases(self, lease_ids: Iterable[int]) -> list[NodeCommand]:
        return self._reads.release_leases(lease_ids)

    def record_access(self, node_id: str, keys: Sequence[str], tiers: Sequence[str], now_ms: int = 0) -> None:
        self._reads.record_access(node_id, keys, tiers, now_ms)

    def match_prefix(self, keys: Sequence[str]) -> int:
        return self._reads.match_prefix(keys)

    def match_prefix_nodes(self, keys: Sequence[str]) -> PrefixMatch:
        return self._reads.match_prefix_nodes(keys)

    def removing(self, keys: Iterable[str]) -> list[str]:
        """Of ``keys``, those a remove took out of service whose drops are not all confirmed yet (the
        master's commands know of drops planned for keys the table has forgotten already)."""
        rec = self._catalog.rec
        return [k for k in keys if (slot := rec.index.get(k)) is not None and rec.is_removing(slot)]

    def exists(self, keys: Sequence[str], now_ms: int = 0) -> list[bool]:
        return self._reads.exists(keys, now_ms)

    def held(self, keys: Sequence[str], now_ms: int) -> list[int]:
        return self._reads.held(keys, now_ms)

    # -- daemons' answers ----------------------------------------------------------------------
    def apply(self, command: NodeCommand, done: Sequence[bool]) -> None:
        self._tiering.apply(command, done)
        self._membership.settled(command)

    def detach(self, key: str) -> bool:
        """Forget a removed key whose drops were answered without (see Catalog.detach)."""
        return self._catalog.detach(key)

    def owe(self, node_id: str, keys: Iterable[str]) -> None:
        """A remove of ``keys`` is answered without ``node_id``'s drops (see Membership.owe)."""
        self._membership.owe(node_id, keys)

    def settle_fenced(self, command: NodeCommand) -> None:
        """Carry out ``command`` for a fenced node without its daemon (it serves nothing until it
        registers again, and its registration drops what is noted here): a drop or demotion as
        made, the block noted to drop then; a promotion as not made."""
        self._membership.gone_with(command)
        self._tiering.apply(command, [False] * len(command.keys))

    # -- operators: evictions, drains, replication ---------------------------------------------
    def evict_keys(
        self, keys: Iterable[str], why: EvictionReason = "operator"
    ) -> tuple[int, list[str], list[NodeCommand]]:
        return self._moves.evict_keys(keys, why)

    def clear_replicas(self, keys: Iterable[str], node_id: str = "") -> tuple[list[str], list[NodeCommand]]:
        return self._moves.clear_replicas(keys, node_id)

    def take_evictions(self) -> list[Eviction]:
        """The evictions since the last call (see :class:`~kvstore.placement.state.Eviction`), oldest first."""
        return self._catalog.take_evictions()

    @property
    def evictions_lost(self) -> int:
        """Evictions dropped untaken (more than EVICTIONS_KEPT between two takes)."""
        return self._catalog.evictions_lost

    def set_tenants(self, names: Iterable[str]) -> None:
        """The names that are tenants now (a master reads them from its tenants file each tick): only
        their keys get an LRU of their own, which their puts evict from (``put_start``'s ``tenant``)."""
        self._catalog.tenants = frozenset(names)

    def tenant_victims(self, tenant: str, need: int, keep: Collection[str] = ()) -> list[str]:
        return self._moves.tenant_victims(tenant, need, keep)

    def usage(self, tenant: str) -> int:
        """Bytes of the tenant's keys, pending and stored (each once, however many replicas)."""
        return self._catalog.usage.get(tenant, 0)

    def num_objects_of(self, owner: str) -> int:
        """Stored keys (not being removed) of ``owner``: its keys by owner when kept, else a scan."""
        cat = self._catalog
        keys = cat.owned.get(owner, ()) if cat.keys_by_owner else self._inspection.stored_keys(f"{owner}/")
        objects = cat.objects
        return sum(1 for k in keys if (e := objects.get(k)) is not None and not e.removing)

    def granted(self, owner: str) -> tuple[int, int]:
        """The open grants of ``owner`` and the bytes they still reserve (a grant returned or expired
        takes no more writes: its rest is on its way back to the pool, and counts no more)."""
        grants = [g for g in self._catalog.grants.values() if g.owner == owner and not g.ending]
        return len(grants), sum(p.length for g in grants for p in g.pieces)

    def tenant_held(self, tenant: str) -> int:
        """Everything the tenant holds or reserves: its keys (:meth:`usage`), its grants' pieces, and
        what requests of its admitted under its quota are still placing (:meth:`admit`)."""
        return self.usage(tenant) + self.granted(tenant)[1] + self._admitted[tenant]

    def tenant_keys(self, tenant: str) -> tuple[int, int]:
        """The tenant's keys and pinned keys, stored or being written or admitted (:meth:`admit`)."""
        cat, admitted = self._catalog, self._admitted_keys
        objects = len(cat.owned.get(tenant, ())) + admitted[tenant, False] + admitted[tenant, True]
        return objects, cat.pinned_keys[tenant] + admitted[tenant, True]

    def admit(self, tenant: str, nbytes: int, keys: int = 0, pinned: bool = False) -> None:
        """Count ``nbytes`` (and ``keys``, ``pinned`` or not) that a request of ``tenant`` was
        admitted for under its quota and will place (after waits for room) as held, until
        :meth:`settle` says they are placed or given up. The caller admits in the same step as it
        checked the quota, with no wait in between."""
        self._admitted[tenant] += nbytes
        self._admitted_keys[tenant, pinned] += keys

    def settle(self, tenant: str, nbytes: int, keys: int = 0, pinned: bool = False) -> None:
        """``nbytes`` and ``keys`` admitted for ``tenant`` are in the table now (or were given up)."""
        left = self._admitted[tenant] - nbytes
        assert left >= 0, f"tenant {tenant!r} settled {nbytes} bytes of {self._admitted[tenant]} admitted"
        if left:
            self._admitted[tenant] = left
        else:
            del self._admitted[tenant]
        self._admitted_keys[tenant, pinned] -= keys
        if self._admitted_keys[tenant, pinned] <= 0:
            del self._admitted_keys[tenant, pinned]

    def evict_tier(self, node_id: str, tier: TierName) -> tuple[int, list[NodeCommand]]:
        return self._moves.evict_tier(node_id, tier)

    def plan_moves(self, node_id: str, limit: int, skip: Collection[str] = ()) -> tuple[list[Move], list[NodeCommand]]:
        return self._moves.plan_moves(node_id, limit, skip)

    def finish_moves(
        self, source: str, moves: Sequence[Move], done: Sequence[bool], *, answered: bool = True
    ) -> list[NodeCommand]:
        return self._moves.finish_moves(source, moves, done, answered=answered)

    def plan_replicas(self, keys: Sequence[str], target_node_id: str, max_bytes: int) -> list[Move]:
        return self._moves.plan_replicas(keys, target_node_id, max_bytes)

    def finish_replicas(
        self, moves: Sequence[Move], done: Sequence[bool], *, answered: bool = True
    ) -> tuple[list[Move], list[NodeCommand]]:
        return self._moves.finish_replicas(moves, done, answered=answered)

    # -- KV events -----------------------------------------------------------------------------
    def tell_changes(self, on: bool = True) -> None:
        """Keep (or stop keeping) each replica stored or dropped, for :meth:`take_events`."""
        self._catalog.rec.events = [] if on else None
        self._catalog.labels_gone.clear()

    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The replicas stored on a node's tier (joined its LRU: committed, promoted, demoted there,
        found in an inventory) or no longer (evicted, demoted, removed, its node gone) since the
        last call, in order, as KV events (:mod:`kvstore.events`); [] when not kept. A node fenced
        is an ``AllBlocksCleared`` of its ``backend_id``: its replicas stay in the table, unread
        until its daemon registers again, and that registration tells them as stored anew (the
        removals it makes first are of blocks a follower already forgot)."""
        cat = self._catalog
        rec = cat.rec
        changes = rec.events
        if not changes:
            return []
        rec.events = []
        names, labels, gone, tenants = rec.node_ids, cat.labels, cat.labels_gone, cat.tenants
        out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        for joined, node, tier, key in changes:
            if tier < 0:  # a node fenced: what it holds is unread until its registration tells it anew
                out.append(AllBlocksCleared(names[node]))
                continue
            # A removal names the block as it was labelled (a key forgotten and put again since
            # has a new label); a store, as it is labelled now.
            label = labels.get(key) if joined or key not in gone else gone[key]
            owner = owner_of(key) if tenants else ""
            tenant = owner if owner and tenants and owner in tenants else None
            make = stored if joined else removed
            out.append(make(key, names[node], MEDIA[tier], tenant, label))
        gone.clear()
        return out

    def label(self, keys: Sequence[str], labels: Sequence[EngineBlock]) -> None:
        """Name ``keys`` as an engine names their blocks, for the KV events of their replicas (a put
        labels its keys before writing them; a key stored already keeps the name its events gave it,
        so that its removal names what its store did); kept only while events are told. Labels
        of keys not in the table are kept for a while: past :data:`LABELS_UNPLACED`, forgotten."""
        if len(keys) != len(labels):
            raise InvalidArgument(f"{len(keys)} keys but {len(labels)} labels")
        if self._catalog.rec.events is None:
            return  # no events told: nothing to name
        got = self._catalog.labels
        rec = self._catalog.rec
        for key, label in zip(keys, labels, strict=True):
            slot = rec.index.get(key)
            if slot is None or not rec.is_committed(slot):  # a stored key keeps the name it was told by
                got[key] = label
        if len(got) > len(self._catalog.rec.index) + LABELS_UNPLACED:
            index = self._catalog.rec.index
            for key in [k for k in got if k not in index]:
                del got[key]

    # -- inspection ----------------------------------------------------------------------------
    def tier_usage(self, node: NodeState) -> dict[str, dict[str, int]]:
        return self._inspection.tier_usage(node)

    def describe(self, key: str) -> dict[str, object] | None:
        return self._inspection.describe(key)

    def num_objects(self) -> int:
        """Stored keys (committed, and being removed until their daemons confirm)."""
        return len(self._catalog.objects)

    def stored_keys(self, prefix: str) -> list[str]:
        """Every stored key (not being removed) that starts with ``prefix``, in no order."""
        return self._inspection.stored_keys(prefix)

    def node_usage(self) -> list[dict[str, dict[str, int]]]:
        """:meth:`tier_usage` of every registered node."""
        return [self._inspection.tier_usage(n) for n in self._catalog.nodes.values()]

    def keys_page(self, prefix: str, after: str | None, limit: int) -> tuple[list[str], str | None]:
        return self._inspection.keys_page(prefix, after, limit)

    def blocks_on(self, node_id: str) -> int:
        return self._inspection.blocks_on(node_id)

    def stats(self) -> dict[str, int | float]:
        return {**self._inspection.stats(), "nodes_absent": len(self._membership.absent)}

    def check(self) -> None:
        self._inspection.check()
