"""Room in each node's tiers: reserving DRAM extents (evicting by LRU when a tier is full),
promoting SSD blocks read often, and recording what daemons did with the commands.

An extent is reused only after its daemon has confirmed that the block in it
is gone: an evicted or promoted replica is MOVING or DROPPING (not readable, in no
LRU) until the daemon's answer is applied. So a daemon never holds a block in
an extent that the master gave to another key. A leased replica is never
evicted, demoted or promoted: the policy sees the leases through its tier views.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.allocator import Extent
from kvstore.errors import InvalidArgument
from kvstore.placement.records import TierLRU
from kvstore.placement.state import (
    DRAM,
    DROPPING,
    MOVING,
    READY,
    SSD,
    Catalog,
    Eviction,
    EvictionReason,
    NodeCommand,
    NodeState,
    ObjectEntry,
    ReplicaState,
)
from kvstore.policy import Action, ActionKind, EvictionPolicy, TierName, TierView, Victims


class Tiering:
    """Carries out the eviction policy on the catalog's nodes (reservations, evictions, promotions of
    ``Catalog.want_promote``) and records the daemons' answers."""

    def __init__(self, catalog: Catalog, policy: EvictionPolicy) -> None:
        self.catalog = catalog
        self.policy = policy

    def take_evictions(self) -> list[Eviction]:
        """The evictions since the last call (see :class:`~kvstore.placement.state.Eviction`), oldest first."""
        return self.catalog.take_evictions()

    @property
    def evictions_lost(self) -> int:
        """Evictions dropped untaken (more than EVICTIONS_KEPT between two takes)."""
        return self.catalog.evictions_lost

    def dram_view(self, node: NodeState, used: int, owner: int | None = None) -> TierView[str]:
        """The node's DRAM tier as the policy sees it, with ``used`` bytes in use; its victims only
        ``owner``'s (:meth:`_owner_id`) when a tenant asks."""
        leased = self.catalog.leases.leased_keys(node.node_id, DRAM)
        return TierView(node.alloc.capacity, used, _victims(node.dram_lru, owner), leased)

    def ssd_view(self, node: NodeState, owner: int | None = None) -> TierView[str] | None:
        """The node's SSD tier as the policy sees it, counting evictions in flight; None without SSD."""
        if not node.ssd_capacity:
            return None
        leased = self.catalog.leases.leased_keys(node.node_id, SSD)
        return TierView(node.ssd_capacity, node.ssd_used + node.ssd_delta, _victims(node.ssd_lru, owner), leased)

    def _owner_id(self, tenant: str) -> int | None:
        """The LRU owner whose blocks a request of ``tenant`` may evict: None for any ("": no tenant);
        -1 for a tenant with no key yet (it has no log: nothing to evict)."""
        return self.catalog.rec.owner_ids.get(tenant, -1) if tenant else None

    def reserve_many(self, node: NodeState, sizes: list[int]) -> list[int] | None:
        """Extents (their offsets) for all of ``sizes`` on ``node`` at once when they fit with no eviction (below
        the high watermark and the node's block count, in one free extent); else None, and the
        caller reserves them one at a time (:meth:`reserve`), evicting as it must."""
        alloc = node.alloc
        total = alloc.total_length(sizes)
        if self.policy.over_high_watermark(alloc.used - node.dram_freeing + total, alloc.capacity):
            return None
        if node.max_blocks and alloc.num_extents + len(sizes) > node.max_blocks:
            return None
        return alloc.alloc_offsets(sizes)

    @staticmethod
    def take(node: NodeState, size: int) -> Extent | None:
        """An extent on ``node`` in the room it has now (or None), evicting nothing: for a node
        suspected or unreachable, whose evictions might not be answered until its fence."""
        if node.max_blocks and node.alloc.num_extents >= node.max_blocks:
            return None
        return node.alloc.alloc(size)

    def reserve(
        self, node: NodeState, size: int, commands: list[NodeCommand], owner: str = ""
    ) -> tuple[Extent | None, bool]:
        """An extent on ``node`` (or None), and whether evictions were added to ``commands`` for it.
        The evictions take only ``owner``'s blocks when it is not "": the tenant a request is of, so
        that no tenant's put ever evicts another's block ("": an operator's, or no tenants).

        Past the high watermark the node evicts down to the low one even when
        the extent was found, so that later puts find room without waiting; a tenant's request
        frees its share of that headroom (its part of the tier's evictable blocks), of its own
        blocks: a tenant alone on a node keeps the headroom, one with a few blocks among another's
        does not give them up for room that the other's puts would take.
        """
        # Bytes that evictions in flight will free count as free already, so nothing is evicted for them twice.
        dram_used = node.alloc.used - node.dram_freeing
        who = self._owner_id(owner)
        over = self.policy.over_high_watermark(dram_used + size, node.alloc.capacity)
        if node.max_blocks and node.alloc.num_extents >= node.max_blocks:
            # Every slot of the arena's index is taken: room comes only from evicting blocks.
            if node.inflight:
                return None, False  # evictions in flight will free slots; the put waits for them
            view = self.dram_view(node, dram_used, who)
            actions = self.policy.make_slots(view, self.ssd_view(node, who), node.alloc.num_extents,
                                             node.max_blocks, headroom=_share(node, who)[1])  # fmt: skip
            commands.extend(self.start_actions(node, actions))
            return None, bool(actions)
        extent = node.alloc.alloc(size)
        if extent is not None and not over:
            return extent, False
        view = self.dram_view(node, dram_used + (size if extent is not None else 0), who)
        ssd = self.ssd_view(node, who)
        incoming, force = (0, 0) if extent is not None else (size, size)  # a found extent is in ``used`` already
        actions = self.policy.make_room(view, ssd, incoming, force_bytes=force, headroom=_share(node, who)[0])
        commands.extend(self.start_actions(node, actions))
        return extent, bool(actions)

    def start_actions(self, node: NodeState, actions: Sequence[Action[str]]) -> list[NodeCommand]:
        """Mark the replicas of ``actions`` moving and group them into commands, in execution order."""
        cat = self.catalog
        rec = cat.rec
        groups: dict[tuple[ActionKind, TierName], list[tuple[str, int]]] = {}
        for action in actions:
            self._count_eviction(node, action.kind, action.tier, action.size, +1)
            row = rec.row_on(cat.objects[action.key].slot, node.idx)
            ReplicaState(rec, row).to(DROPPING if action.kind is ActionKind.DROP else MOVING)
            node.lru(action.tier).remove_row(row)
            groups.setdefault((action.kind, action.tier), []).append((action.key, action.size))
        return cat.issue(
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

    def plan_promotions(self) -> list[NodeCommand]:
        """Promote wanted SSD blocks that no reader holds, where DRAM has room without evicting."""
        cat = self.catalog
        per_node: dict[str, list[tuple[str, int]]] = {}
        for key in list(cat.want_promote):
            entry = cat.objects.get(key)
            ssd = [r for r in cat.readable(entry) if r.tier is SSD]
            if entry is None or not ssd or any(r.tier is DRAM for r in entry.replicas):
                cat.want_promote.discard(key)
                continue
            node = cat.nodes[ssd[0].node_id]
            if cat.leases.is_leased(node.node_id, SSD, key) or node.ssd_lru.is_pinned(key):
                continue
            cat.want_promote.discard(key)
            if self.policy.over_high_watermark(node.alloc.used + entry.size, node.alloc.capacity):
                continue
            extent = node.alloc.alloc(entry.size)
            if extent is None:
                continue
            ssd[0].to(MOVING)
            node.ssd_lru.remove_row(ssd[0].row)
            ssd[0].extent = extent  # where it will land; the tier changes when the daemon confirms
            per_node.setdefault(node.node_id, []).append((key, extent.offset))
        return cat.issue(
            [
                NodeCommand(n, ActionKind.PROMOTE, SSD, tuple(k for k, _ in items), tuple(o for _, o in items))
                for n, items in per_node.items()
            ]
        )

    def apply(self, command: NodeCommand, done: Sequence[bool]) -> None:
        """Record what a daemon did. ``done[i]``: DEMOTE -> moved (else dropped);
        DROP -> it was there; PROMOTE -> moved (else it stays on SSD)."""
        cat = self.catalog
        if len(done) != len(command.keys):
            raise InvalidArgument(f"{len(done)} results for a command of {len(command.keys)} keys")
        node = cat.nodes.get(command.node_id)
        if node is None or node.gen != command.node_gen:
            return  # the node left or re-registered: its inventory replaced what this was planned on
        node.inflight = max(0, node.inflight - len(command.keys))
        for size in command.sizes:
            self._count_eviction(node, command.kind, command.tier, size, -1)
        for key, gen, ok in zip(command.keys, command.gens, done, strict=True):
            if command.kind is ActionKind.DROP:
                if command.tier is DRAM and key in node.quarantine:
                    node.alloc.free(node.quarantine.pop(key))  # the daemon holds no such block in DRAM now
                if key in node.owes:  # a block detached from the table is gone now (Catalog.detach)
                    node.settling.add(key)
            found = cat.replica(key, node.node_id, gen)
            if found is None:
                continue  # not the replica it was planned for: that one is gone already
            entry, replica = found
            if command.kind is ActionKind.PROMOTE:
                self._finish_promote(node, entry, replica, ok)
            elif command.kind is ActionKind.DEMOTE and ok:
                assert replica.extent is not None
                node.alloc.free(replica.extent)
                replica.tier, replica.extent = SSD, None
                node.ssd_used += entry.size
                replica.to(READY)
                if not entry.removing:
                    node.ssd_lru.insert_row(replica.row)
                cat.counters["demotions"] += 1
            else:
                # A failed demotion: the daemon dropped the block instead (its SSD is full or failing).
                cat.counters["demotions_failed"] += command.kind is ActionKind.DEMOTE
                why: EvictionReason | None = None
                if not command.release:
                    why = "demotion_failed" if command.kind is ActionKind.DEMOTE else "lru"
                cat.drop_replica(key, node.node_id, evicted=why, gen=gen)

    def _finish_promote(self, node: NodeState, entry: ObjectEntry, replica: ReplicaState, ok: bool) -> None:
        replica.to(READY)
        assert replica.extent is not None
        if ok:
            replica.tier = DRAM
            node.ssd_used -= entry.size
            if not entry.removing:
                node.dram_lru.insert_row(replica.row)
            entry.ssd_hits = 0
            self.catalog.counters["promotions"] += 1
        else:
            node.alloc.free(replica.extent)
            replica.extent = None
            if not entry.removing:
                node.ssd_lru.insert_row(replica.row)


def _victims(lru: TierLRU, owner: int | None) -> Victims[str]:
    """What a policy may evict of ``lru``: all of it (None), or one owner's blocks."""
    return lru if owner is None else lru.of(owner)


def _share(node: NodeState, owner: int | None) -> tuple[float, float]:
    """``owner``'s part of the node's evictable DRAM (bytes, blocks): its share of the headroom; all
    of it for None."""
    return (1.0, 1.0) if owner is None else node.dram_lru.share(owner)
