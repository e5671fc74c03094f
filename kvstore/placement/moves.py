"""Operators' moves of stored blocks: evicting them, draining a node, replicating hot blocks.

- ``evict_keys`` and ``evict_tier`` are an operator's evictions: by key from
  every tier, or one tier of one node emptied of what may go.
- ``plan_moves`` and ``finish_moves`` drain a node: each block is copied to
  another node (or dropped where a copy exists already), then dropped here.
- ``plan_replicas`` reserves DRAM on a node for copies of stored blocks whose
  other replicas stay (hot blocks near their readers). A copy's replica is
  COPYING (not readable, in no LRU, sent no drop) until ``finish_replicas``
  applies the target's answer; a block removed meanwhile loses it by a drop.
  A node holds at most one replica of a block.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Sequence

from kvstore.allocator import Extent
from kvstore.errors import InvalidArgument, NotFound
from kvstore.keys import validate_key
from kvstore.placement.state import (
    COPYING,
    DRAM,
    DROPPING,
    MOVING,
    READY,
    SSD,
    Catalog,
    EvictionReason,
    Move,
    NodeCommand,
    NodeState,
    ObjectEntry,
    ReplicaState,
)
from kvstore.placement.tiering import Tiering
from kvstore.placement.writes import Writes
from kvstore.policy import Action, ActionKind, EvictionPolicy, TierName


class Moves:
    """Plans copies and evictions of stored blocks, and records the copies' outcome."""

    def __init__(self, catalog: Catalog, tiering: Tiering, writes: Writes, policy: EvictionPolicy) -> None:
        self.catalog = catalog
        self.tiering = tiering
        self.writes = writes
        self.policy = policy

    def start_drain(self, node_id: str) -> None:
        """Take ``node_id`` out of placement: no new block or grant goes there, and
        :meth:`plan_moves` moves its blocks elsewhere. It stays out until :meth:`stop_drain`
        (or until it leaves)."""
        if node_id not in self.catalog.nodes:
            raise NotFound(f"node {node_id!r} is not registered")
        self.catalog.draining.add(node_id)

    def stop_drain(self, node_id: str) -> None:
        """Put a drained node back into placement."""
        self.catalog.draining.discard(node_id)

    def is_draining(self, node_id: str) -> bool:
        return node_id in self.catalog.draining

    def evict_keys(
        self, keys: Iterable[str], why: EvictionReason = "operator"
    ) -> tuple[int, list[str], list[NodeCommand]]:
        """Drop stored blocks from every tier (an operator's eviction, or ``why``); pinned ones stay.
        Returns how many were evicted, the pinned ones skipped, and the daemons' drops."""
        victims: list[str] = []
        pinned: list[str] = []
        for key in keys:
            entry = self.catalog.objects.get(validate_key(key))
            if entry is None or entry.removing:
                continue
            (pinned if entry.pinned else victims).append(key)
        evicted, commands = self.writes.remove(victims)
        for key in victims:
            self.catalog.note_eviction(key, "", why)
        return evicted, pinned, commands

    def clear_replicas(self, keys: Iterable[str], node_id: str = "") -> tuple[list[str], list[NodeCommand]]:
        """Mooncake's ``batch_replica_clear``: drop the replicas of ``keys`` on ``node_id`` (every
        replica when ""); a key with no replica readable elsewhere goes whole, as a remove. Returns the
        keys cleared (stored, and on that node) and the daemons' drops. Pinned keys go too."""
        cat = self.catalog
        whole: list[str] = []
        cleared: list[str] = []
        actions: list[Action[str]] = []
        node = cat.nodes.get(node_id) if node_id else None
        for key in keys:
            entry = cat.objects.get(validate_key(key))
            if entry is None or entry.removing or not entry.committed:
                continue
            if not node_id:
                cleared.append(key)
                whole.append(key)
                continue
            if node is None:
                continue
            ready = [r for r in entry.replicas if r.status is READY]
            here = [r for r in ready if r.node_id == node_id]
            if not here:
                continue
            cleared.append(key)
            if len(here) == len(ready):
                whole.append(key)
            else:
                actions += [Action(ActionKind.DROP, key, r.tier, entry.size) for r in here]
        _, commands = self.writes.remove(whole)
        if node is not None and actions:
            commands += self.tiering.start_actions(node, actions)
        return cleared, commands

    def tenant_victims(self, tenant: str, need: int, keep: Collection[str] = ()) -> list[str]:
        """The tenant's own blocks to evict for ``need`` bytes under its quota: least recently put or
        read first, across every node and tier; never a pinned, leased, unfinished or ``keep`` one."""
        cat = self.catalog
        candidates = []
        prefix = f"{tenant}/"
        rec = cat.rec
        keys = cat.owned.get(tenant, ()) if cat.keys_by_owner else (k for k in rec.index if k.startswith(prefix))
        for key in keys:
            slot = rec.index.get(key)
            if slot is None or not rec.is_evictable(slot) or key in keep:
                continue
            if any(cat.leases.is_leased(r.node_id, r.tier, key) for r in ObjectEntry(rec, slot).replicas):
                continue
            candidates.append((rec.last_use[slot], key, rec.size[slot]))
        heapq.heapify(candidates)
        chosen: list[str] = []
        got = 0
        while candidates and got < need:
            _, key, size = heapq.heappop(candidates)
            chosen.append(key)
            got += size
        return chosen

    def evict_tier(self, node_id: str, tier: TierName) -> tuple[int, list[NodeCommand]]:
        """Empty one tier of a node of what may go (neither pinned nor leased): DRAM blocks are
        demoted to SSD where it has room (making room there by LRU), SSD blocks dropped."""
        tiering = self.tiering
        node = self.catalog.nodes.get(node_id)
        if node is None:
            raise NotFound(f"node {node_id!r} is not registered")
        if tier is DRAM:
            view = tiering.dram_view(node, node.alloc.used)
            actions = self.policy.make_room(view, tiering.ssd_view(node), 0, force_bytes=node.alloc.used)
        else:
            leased = self.catalog.leases.leased_keys(node_id, SSD)
            actions = [Action(ActionKind.DROP, key, SSD, size) for key, size in node.ssd_lru.victims(leased)]
        return len(actions), tiering.start_actions(node, actions)

    def plan_moves(self, node_id: str, limit: int, skip: Collection[str] = ()) -> tuple[list[Move], list[NodeCommand]]:
        """Up to ``limit`` blocks of a draining node: copies to make on other nodes, and drops of
        replicas that have copies elsewhere already. Each copy reserves an extent on its target for
        a COPYING replica there (see :meth:`plan_replicas`); the replica here is MOVING (still read
        by key through its daemon) until :meth:`finish_moves`."""
        cat = self.catalog
        node = cat.nodes.get(node_id)
        if node is None:
            raise NotFound(f"node {node_id!r} is not registered")
        targets = [n for n in cat.up_nodes() if n.node_id != node_id and n.node_id not in cat.draining]
        moves: list[Move] = []
        drops: dict[TierName, list[str]] = {}
        for tier in (DRAM, SSD):
            for key in list(node.lru(tier)):
                if len(moves) + sum(map(len, drops.values())) >= limit:
                    break
                if key in skip:
                    continue
                entry = cat.objects[key]
                here = next(r for r in entry.replicas if r.node_id == node_id)
                if any(r.node_id != node_id and r.status is READY and cat.nodes[r.node_id].up for r in entry.replicas):
                    here.to(DROPPING)
                    node.lru(tier).remove(key)
                    drops.setdefault(tier, []).append(key)
                    continue
                for target in sorted(targets, key=lambda n: -n.alloc.free_bytes):
                    if any(r.node_id == target.node_id for r in entry.replicas):
                        continue  # one replica per node: a copy is coming in there already
                    extent = target.alloc.alloc(entry.size)
                    if extent is not None:
                        here.to(MOVING)
                        node.lru(tier).remove(key)
                        moves.append(self._copy(entry, here, target, extent))
                        break
        commands = [NodeCommand(node_id, ActionKind.DROP, t, tuple(ks), release=True) for t, ks in drops.items()]
        return moves, cat.issue(commands)

    def _copy(self, entry: ObjectEntry, source: ReplicaState, target: NodeState, extent: Extent) -> Move:
        """Reserve ``extent`` of ``target`` for a copy of ``entry`` from ``source``: a COPYING replica."""
        cat = self.catalog
        copy = ReplicaState(cat.rec, cat.add_replica(entry.slot, target, DRAM, extent, COPYING))
        return Move(
            entry.key, entry.size, entry.checksum, source.tier, target.node_id, extent, source.node_id, entry.pinned,
            copy.gen, source.gen, entry.write_id,
        )  # fmt: skip

    def finish_moves(
        self, source: str, moves: Sequence[Move], done: Sequence[bool], *, answered: bool = True
    ) -> list[NodeCommand]:
        """Record the copies a drain's target made (``done[i]``: the block is committed there): a
        copied block gains its new replica and the source's is dropped; one that was not copied
        stays where it was. What becomes of the copy itself is :meth:`finish_replicas`'s rule: an
        extent that the target may hold a block in (the copy was made but its key removed meanwhile,
        or the target never answered) is freed only once the target confirms a drop of it."""
        cat = self.catalog
        copied, drops = self.finish_replicas(moves, done, answered=answered)
        made = {id(m) for m in copied}
        per_tier: dict[TierName, list[str]] = {}
        for move in moves:
            found = cat.replica(move.key, source, move.source_gen)
            if found is None:
                continue  # the source left or re-registered, or the block was removed and its drop is done
            entry, here = found
            if here.status is not MOVING or entry.removing:
                continue  # removed meanwhile: its drop is on its way
            if id(move) in made:
                here.to(DROPPING)  # copied: the new replica serves it from now on
                per_tier.setdefault(here.tier, []).append(move.key)
            else:
                here.to(READY)
                cat.nodes[source].lru(here.tier).insert_row(here.row)
        back = [NodeCommand(source, ActionKind.DROP, t, tuple(ks), release=True) for t, ks in per_tier.items()]
        return drops + cat.issue(back)

    def plan_replicas(self, keys: Sequence[str], target_node_id: str, max_bytes: int) -> list[Move]:
        """Copies of stored blocks to add in the DRAM of ``target_node_id``, other replicas kept.

        Keys are taken in order; one that is not readable, or has a replica (or a copy coming) on
        the target, is skipped. Each copy reserves an extent on the target without evicting
        anything and without filling it past the high watermark; planning stops at the first key
        that does not fit, or that would take the copied bytes past ``max_bytes``. A down or
        draining target gets nothing. The reserved replica is COPYING (not readable, in no LRU,
        sent no drop) until :meth:`finish_replicas`; each move's source is a readable replica,
        DRAM first.
        """
        cat = self.catalog
        target = cat.nodes.get(target_node_id)
        if target is None:
            raise NotFound(f"node {target_node_id!r} is not registered")
        if type(max_bytes) is not int or max_bytes < 0:
            raise InvalidArgument(f"max_bytes must be a non-negative int, got {max_bytes!r}")
        checked = [validate_key(k) for k in keys]
        if not target.up or target_node_id in cat.draining:
            return []
        moves: list[Move] = []
        budget = max_bytes
        alloc = target.alloc
        for key in checked:
            entry = cat.objects.get(key)
            sources = cat.readable(entry)
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
            moves.append(self._copy(entry, min(sources, key=lambda r: r.tier is not DRAM), target, extent))
        return moves

    def finish_replicas(
        self, moves: Sequence[Move], done: Sequence[bool], *, answered: bool = True
    ) -> tuple[list[Move], list[NodeCommand]]:
        """Record the copies a target made (``done[i]``: the block is committed there).

        A copied block gains its replica: readable, in the target's DRAM LRU (pinned if the block
        is). A copy that failed frees its extent at once; with ``answered=False`` (the target never
        answered, and may yet hold the block, or commit it later) the target is told to drop it
        instead, and the extent is freed when it confirms. A block removed meanwhile gains
        nothing: a copy that was made is dropped the same way. A drop of a copy names the extent
        it was planned into: a daemon that does not hold the block there yet refuses the copy if
        it comes later, so a copy whose drop was planned never becomes a committed block. Returns
        the copies that became replicas, and the drops to send.
        """
        cat = self.catalog
        if len(done) != len(moves):
            raise InvalidArgument(f"{len(done)} results for {len(moves)} copies")
        copied: list[Move] = []
        drops: dict[str, list[Move]] = {}
        for move, ok in zip(moves, done, strict=True):
            found = cat.replica(move.key, move.target, move.gen)
            target = cat.nodes.get(move.target)
            if found is None or target is None or found[1].status is not COPYING:
                continue  # the target left or re-registered: its inventory replaced this copy
            entry, replica = found
            if ok and not entry.removing:
                replica.to(READY)
                target.dram_lru.insert_row(replica.row)
                copied.append(move)
            elif ok or not answered:
                replica.to(DROPPING)  # neither readable nor counted until the drop is applied
                drops.setdefault(move.target, []).append(move)  # the extent is freed once the drop is applied
            else:
                cat.drop_replica(move.key, move.target, gen=move.gen)
        return copied, cat.issue(
            [
                NodeCommand(
                    n, ActionKind.DROP, DRAM, tuple(m.key for m in ms), tuple(m.extent.offset for m in ms),
                    release=True, gens=tuple(m.gen for m in ms),
                )
                for n, ms in drops.items()
            ]
        )  # fmt: skip
