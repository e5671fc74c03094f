"""Puts and removals: placing new keys on nodes, committing them, giving them up.

- ``put_start`` places each new key on ``replicas`` distinct up nodes chosen by
  the placement strategy and reserves an extent in each node's DRAM arena
  (the master holds the one allocator of every arena). A node that has no
  extent for the block gets eviction commands; the key waits for them
  (``PutPlan.waiting``) and is placed when the caller asks again. A key that
  is already stored or being written reports ``exists``.
- ``put_end`` commits: only then is a block visible. An uncommitted
  reservation expires after ``reservation_ms``.
- A revoked, expired or removed block is ``removing`` (not readable, not
  placeable) until its daemons confirm the drop; only then is its extent reused.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvstore.allocator import Extent
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError, NoNodes, RetryLater
from kvstore.keys import BlockKey, validate_key, validate_keys
from kvstore.placement.leases import LeaseId
from kvstore.placement.results import PlacedReplica, Ticket
from kvstore.placement.state import COPYING, DRAM, DROPPING, Catalog, NodeCommand, NodeState, ObjectEntry, ReplicaState
from kvstore.placement.tiering import Tiering
from kvstore.policy import ActionKind, TierName

Strategy = Callable[[list[NodeState], str | None, random.Random], list[NodeState]]
"""Orders the nodes a put or a grant may go to, most preferred first."""


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


@dataclass(slots=True)
class PutPlan:
    tickets: list[Ticket | None]
    """One per key; None for a key waiting for evictions."""
    commands: list[NodeCommand]
    waiting: list[int]
    """Indexes of keys to ask again for once ``commands`` are applied."""


def _ticket_error(exc: KVStoreError) -> Ticket:
    return Ticket("error", [], exc.code, str(exc))


class Writes:
    """Moves keys into ``Catalog.pending`` (placed), on to ``Catalog.objects`` (committed), and out."""

    def __init__(
        self, catalog: Catalog, tiering: Tiering, strategy: Strategy, rng: random.Random, *, reservation_ms: int
    ) -> None:
        self.catalog = catalog
        self.tiering = tiering
        self.strategy = strategy
        self.rng = rng
        self.reservation_ms = reservation_ms

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
        checked = validate_keys(keys)
        for key, size in zip(checked, sizes, strict=True):
            if type(size) is not int or size <= 0:
                raise InvalidArgument(f"size of {key!r} must be a positive int, got {size!r}")
        if not 1 <= replicas <= 16:
            raise InvalidArgument(f"replicas must be between 1 and 16, got {replicas}")
        plan = PutPlan([], [], [])
        # One ordering for the whole batch: a batch is usually one request's chain of blocks, and
        # keeping it together on a node keeps a prefix from spanning nodes that evict independently.
        ordered = self.strategy(self.catalog.placeable(), preferred_node, self.rng)
        smallest = min((n.alloc.capacity for n in ordered), default=0)
        reserved = self._reserve_run(checked, sizes, ordered[0]) if replicas == 1 and ordered else {}
        for i, (key, size) in enumerate(zip(checked, sizes, strict=True)):
            extent = reserved.get(i)
            if extent is not None:
                first = [ReplicaState(ordered[0].node_id, DRAM, extent)]
                plan.tickets.append(self._record(key, size, first, pin, now_ms))
                continue
            fits = ordered if size <= smallest else [n for n in ordered if n.alloc.capacity >= size]
            plan.tickets.append(self._place(key, size, replicas, fits, pin, now_ms, plan, i))
        return plan

    def _reserve_run(self, keys: list[BlockKey], sizes: Sequence[int], node: NodeState) -> dict[int, Extent]:
        """Extents on ``node``, the batch's first choice, for every new key of the batch at once (by
        index), when they all fit there without evicting; else none, and each key is placed alone.
        Either way a key goes where it would have gone alone: the first node, while it has room."""
        cat = self.catalog
        objects, pending = cat.objects, cat.pending
        new: dict[BlockKey, int] = {}
        for i, key in enumerate(keys):
            if key not in objects and key not in pending and key not in new:
                new[key] = i
        if len(new) < 2 or node.alloc.capacity < max(sizes[i] for i in new.values()):
            return {}
        extents = self.tiering.reserve_many(node, [sizes[i] for i in new.values()])
        return dict(zip(new.values(), extents, strict=True)) if extents is not None else {}

    def _place(
        self,
        key: BlockKey,
        size: int,
        replicas: int,
        nodes: list[NodeState],
        pin: bool,
        now_ms: int,
        plan: PutPlan,
        i: int,
    ) -> Ticket | None:
        cat = self.catalog
        existing = cat.objects.get(key) or cat.pending.get(key)
        if existing is not None:
            if existing.removing:
                return _ticket_error(RetryLater(f"key {key!r} is being moved or removed; retry"))
            cat.counters["put_exists"] += 1
            if existing.committed:
                cat.touch(existing)
            return Ticket("exists", [], 0, "")
        if not nodes:  # the nodes able to hold ``size`` bytes, most preferred first
            if not cat.up_nodes():
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
            extent, evicting = self.tiering.reserve(node, size, plan.commands)
            if extent is not None:
                chosen.append(ReplicaState(node.node_id, DRAM, extent))
            waiting = waiting or (extent is None and (evicting or node.inflight > 0))
        if (waiting and len(chosen) < min(replicas, len(nodes))) or not chosen:
            for r in chosen:
                assert r.extent is not None
                cat.nodes[r.node_id].alloc.free(r.extent)
            if waiting:
                plan.waiting.append(i)
                return None
            if any(cat.busy(node) for node in nodes):
                # Leases end and puts commit or expire: room will come without anyone's help.
                return _ticket_error(
                    RetryLater(f"no room for block {key!r} of {size} bytes yet: DRAM is leased or being written")
                )
            return _ticket_error(
                CapacityError(f"no room for block {key!r} of {size} bytes: every node's DRAM is pinned")
            )
        return self._record(key, size, chosen[:], pin, now_ms)  # a copy holds no room for appends

    def _record(self, key: BlockKey, size: int, chosen: list[ReplicaState], pin: bool, now_ms: int) -> Ticket:
        """Record a new key reserved in the DRAM extents of ``chosen``; its ticket."""
        cat = self.catalog
        entry = ObjectEntry(key, size, 0, chosen, False, now_ms + self.reservation_ms, pin)
        cat.pending[key] = entry
        cat.track(entry)
        cat.counters["puts"] += 1
        nodes = cat.nodes
        return Ticket("ok", [PlacedReplica(r.node_id, nodes[r.node_id].address, DRAM, r.offset, size) for r in chosen],
                      0, "")  # fmt: skip

    def put_end(self, keys: Sequence[str], checksums: Sequence[int]) -> list[bool]:
        """Commit reserved keys; False for a key whose reservation is gone (expired or revoked)."""
        cat = self.catalog
        if len(keys) != len(checksums):
            raise InvalidArgument(f"put_end got {len(keys)} keys but {len(checksums)} checksums")
        out = []
        pending, objects, nodes = cat.pending, cat.objects, cat.nodes
        written = 0
        for key, check in zip(keys, checksums, strict=True):
            entry = pending.get(key)
            if entry is None or entry.removing:
                out.append(False)
                continue
            del pending[key]
            # Committed: no reservation deadline any more (0 costs no int object of its own).
            entry.committed, entry.checksum, entry.deadline_ms = True, check, 0
            objects[key] = entry
            for r in entry.replicas:
                lru = nodes[r.node_id].dram_lru
                lru.insert(key, entry.size)
                if entry.pinned:
                    lru.pin(key)
            written += entry.size
            out.append(True)
        cat.counters["bytes_written"] += written
        return out

    def put_revoke(self, keys: Iterable[str]) -> list[NodeCommand]:
        """Give up reservations; their daemons must drop whatever was written before the extents are reused."""
        pending = self.catalog.pending
        return self.catalog.revoke([e for k in keys if (e := pending.get(k)) is not None and not e.removing])

    def expire_reservations(self, now_ms: int) -> list[NodeCommand]:
        """Revoke the puts not committed by their deadline."""
        expired = [e for e in self.catalog.pending.values() if e.deadline_ms <= now_ms]
        self.catalog.counters["expired"] += len(expired)
        return self.catalog.revoke(expired)

    def remove(self, keys: Iterable[str]) -> tuple[int, list[NodeCommand]]:
        """Stop serving ``keys`` at once; returns how many were stored and the drops their daemons must do."""
        cat = self.catalog
        per: dict[tuple[str, TierName], list[str]] = {}
        removed = 0
        for key in keys:
            entry = cat.objects.get(validate_key(key))
            if entry is None or entry.removing:
                continue
            removed += 1
            entry.removing = True
            if entry.hold:
                cat.leases.release(LeaseId(entry.hold))  # a forced remove ends the hold of an earlier read
                entry.hold = 0
            cat.want_promote.discard(key)
            for r in entry.replicas:
                if r.status is COPYING:
                    continue  # the daemon may not hold it yet: finish_replicas drops it once answered
                if r.status is DROPPING:
                    continue  # its drop is in flight already; a second could reach a block put again since
                lru = cat.nodes[r.node_id].lru(r.tier)
                if key in lru:
                    lru.remove(key)
                per.setdefault((r.node_id, r.tier), []).append(key)
        return removed, cat.issue(
            [NodeCommand(n, ActionKind.DROP, t, tuple(ks), release=True) for (n, t), ks in per.items()]
        )
