"""Puts and removals: placing new keys on nodes, committing them, giving them up.

- ``put_start`` places each new key on ``replicas`` distinct up nodes chosen by
  the placement strategy and reserves an extent in each node's DRAM arena
  (the master holds the one allocator of every arena). A node that has no
  extent for the block gets eviction commands; the key waits for them
  (``PutPlan.waiting``) and is placed when the caller asks again. A key that
  is already stored or being written reports ``exists``.
- ``put_end`` commits: only then is a block visible, and only a reservation of
  the put's own write id (``put_revoke`` gives up only those too). An uncommitted
  reservation expires after ``reservation_ms``.
- A revoked, expired or removed block is ``removing`` (not readable, not
  placeable) until its daemons confirm the drop; only then is its extent reused.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.allocator import Extent
from kvstore.errors import CapacityError, InvalidArgument, KVStoreError, NoNodes, RetryLater
from kvstore.keys import BlockKey, validate_key, validate_keys
from kvstore.placement.leases import LeaseId
from kvstore.placement.records import MAX_CHECKSUM, S_COPYING, TierLRU, gather
from kvstore.placement.state import (
    DRAM,
    TIERS,
    Catalog,
    NodeCommand,
    NodeState,
    ObjectEntry,
    no_room_text,
    shunned_refusal,
    suspects_last,
)
from kvstore.placement.tiering import Tiering
from kvstore.policy import ActionKind, TierName
from kvstore.results import PlacedReplica, Ticket

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
    """The table's answer to a put, one entry per key, kept flat as the reply it becomes (a put of
    a batch of new keys is the master's costliest call): each key's status (None: it waits for
    evictions), error, and its ``counts[i]`` replicas, the next entries of ``nodes``, ``addresses``
    and ``offsets``; :attr:`tickets` puts them together."""

    commands: list[NodeCommand] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    """Indexes of keys to ask again for once ``commands`` are applied."""
    statuses: list[str | None] = field(default_factory=list)
    error_codes: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    """Per key, the size it was placed for."""

    def add(self, ticket: Ticket | None, size: int) -> None:
        self.sizes.append(size)
        if ticket is None:
            self.statuses.append(None)
            self.error_codes.append(0)
            self.errors.append("")
            self.counts.append(0)
            return
        self.statuses.append(ticket.status)
        self.error_codes.append(ticket.error_code)
        self.errors.append(ticket.error)
        self.counts.append(len(ticket.replicas))
        for r in ticket.replicas:
            self.nodes.append(r.node_id)
            self.addresses.append(r.address)
            self.offsets.append(r.offset)

    @property
    def tickets(self) -> list[Ticket | None]:
        """One per key; None for a key waiting for evictions."""
        out: list[Ticket | None] = []
        at = 0
        for status, code, error, count, size in zip(
            self.statuses, self.error_codes, self.errors, self.counts, self.sizes, strict=True
        ):
            if status is None:
                out.append(None)
                continue
            replicas = [
                PlacedReplica(self.nodes[j], self.addresses[j], DRAM, self.offsets[j], size)
                for j in range(at, at + count)
            ]  # fmt: skip
            at += count
            out.append(Ticket(status, replicas, code, error))  # type: ignore[arg-type]
        return out


_RUN_MIN = 8
"""Batches of at least this many keys try the column-wise commit (below it, numpy's per-call cost wins)."""


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
        tenant: str = "",
        write_id: int = 0,
        avoid: Collection[str] = (),
    ) -> PutPlan:
        """Place ``keys`` (see the module's text) for the put ``write_id``; a put of ``tenant`` ("":
        of none, an operator's or a cluster's without tenants) evicts only that tenant's blocks for
        its room (and makes it a tenant: :meth:`Catalog.know_tenant`); nodes in ``avoid`` (its client
        could not reach them) are placed on last."""
        self.catalog.know_tenant(tenant)
        if len(keys) != len(sizes):
            raise InvalidArgument(f"put_start got {len(keys)} keys but {len(sizes)} sizes")
        checked = validate_keys(keys)
        if sizes and not (set(map(type, sizes)) == {int} and min(sizes) > 0):  # the common case at C speed
            for key, size in zip(checked, sizes, strict=True):
                if type(size) is not int or size <= 0:
                    raise InvalidArgument(f"size of {key!r} must be a positive int, got {size!r}")
        if not 1 <= replicas <= 16:
            raise InvalidArgument(f"replicas must be between 1 and 16, got {replicas}")
        plan = PutPlan()
        # One ordering for the whole batch: a batch is usually one request's chain of blocks, and
        # keeping it together on a node keeps a prefix from spanning nodes that evict independently.
        ordered, shunned = suspects_last(self.strategy(self.catalog.placeable(), preferred_node, self.rng), avoid)
        run = self._reserve_run(checked, sizes, ordered[0]) if replicas == 1 and ordered else None
        if run is not None:
            self._record_run(checked, sizes, ordered[0], run, pin, now_ms, plan, write_id)
            return plan
        smallest = min((n.alloc.capacity for n in ordered), default=0)
        for i, (key, size) in enumerate(zip(checked, sizes, strict=True)):
            fits = ordered if size <= smallest else [n for n in ordered if n.alloc.capacity >= size]
            plan.add(self._place(key, size, replicas, fits, pin, now_ms, plan, i, tenant, write_id, shunned), size)
        return plan

    def _reserve_run(self, keys: list[BlockKey], sizes: Sequence[int], node: NodeState) -> list[int] | None:
        """Extents on ``node``, the batch's first choice, for the whole batch at once, when every key
        is new (and named once) and all fit there without evicting; else None, and each key is
        placed alone. Either way a key goes where it would have gone alone: the first node, while it
        has room."""
        if len(keys) < 2 or not self.catalog.rec.index.keys().isdisjoint(keys) or len(set(keys)) != len(keys):
            return None
        if node.alloc.capacity < max(sizes) or (self.catalog.owed and not node.owes.isdisjoint(keys)):
            return None
        return self.tiering.reserve_many(node, list(sizes))

    def _record_run(
        self, keys: list[BlockKey], sizes: Sequence[int], node: NodeState, offsets: list[int], pin: bool, now_ms: int,
        plan: PutPlan, write_id: int,
    ) -> None:  # fmt: skip
        """Record new keys reserved at ``offsets`` of ``node`` (:meth:`_record` for a whole run), into ``plan``."""
        cat = self.catalog
        n = len(keys)
        cat.new_run(keys, sizes, node, offsets, pinned=pin, deadline=now_ms + self.reservation_ms, write_id=write_id)
        cat.counters["puts"] += n
        plan.statuses.extend(["ok"] * n)
        plan.error_codes.extend([0] * n)
        plan.errors.extend([""] * n)
        plan.counts.extend([1] * n)
        plan.nodes.extend([node.node_id] * n)
        plan.addresses.extend([node.address] * n)
        plan.offsets.extend(offsets)
        plan.sizes.extend(sizes)

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
        tenant: str = "",
        write_id: int = 0,
        shunned: frozenset[str] = frozenset(),
    ) -> Ticket | None:
        """A ticket for ``key`` on ``replicas`` of ``nodes`` (most preferred first, those in ``shunned``
        last: suspected, or a client could not reach them), or None when it waits for evictions."""
        cat = self.catalog
        rec = cat.rec
        slot = rec.index.get(key)
        if slot is not None:
            if rec.is_removing(slot):
                return _ticket_error(RetryLater(f"key {key!r} is being moved or removed; retry"))
            cat.counters["put_exists"] += 1
            if rec.is_committed(slot):
                cat.touch(slot)
            return Ticket("exists", [], 0, "")
        if key in cat.owed:  # an old block of it is still being dropped on some node
            nodes = [node for node in nodes if key not in node.owes]
            if len(nodes) < replicas:
                return _ticket_error(RetryLater(f"key {key!r} is still being dropped on a node; retry"))
        if not nodes:  # the nodes able to hold ``size`` bytes, most preferred first
            if not cat.up_nodes():
                return _ticket_error(NoNodes("no storage node is up"))
            return _ticket_error(CapacityError(f"block {key!r} of {size} bytes is larger than every node's DRAM"))
        if len(nodes) < replicas:
            # Fewer copies than asked would be a silent loss of redundancy: say so instead.
            return _ticket_error(
                NoNodes(f"{replicas} replicas of {key!r} asked for, but only {len(nodes)} nodes can hold it")
            )
        if shunned and len(nodes) - sum(n.node_id in shunned for n in nodes) < replicas:
            shunned = frozenset()  # too few others: they are waited for as any node
        chosen: list[tuple[NodeState, Extent]] = []
        waiting = False  # some node will have room once its evictions are done
        passed: NodeState | None = None  # a shunned node without room now
        for node in nodes:
            if len(chosen) == replicas:
                break
            if node.node_id in shunned:
                # Its evictions, and its commands in flight, may go unanswered until its fence (a
                # second): it takes a copy only in the room it has now, and only when the others
                # have none coming.
                if waiting:
                    break
                extent = self.tiering.take(node, size)
                if extent is None:
                    passed = node
                else:
                    chosen.append((node, extent))
                continue
            extent, evicting = self.tiering.reserve(node, size, plan.commands, tenant)
            if extent is not None:
                chosen.append((node, extent))
            waiting = waiting or (extent is None and (evicting or node.inflight > 0))
        # Fewer copies than asked where a shunned node could have made room: retry (it is fenced
        # within a second, or answers again), not a silent loss of redundancy.
        short = passed is not None and len(chosen) < replicas
        if (waiting and len(chosen) < min(replicas, len(nodes))) or not chosen or short:
            for node, extent in chosen:
                node.alloc.free(extent)
            if waiting:
                plan.waiting.append(i)
                return None
            if passed is not None:
                return _ticket_error(shunned_refusal(cat, f"block {key!r} of {size} bytes", passed))
            if any(cat.busy(node) for node in nodes):
                # Leases end and puts commit or expire: room will come without anyone's help.
                cat.counters["room_refused_leased"] += 1
                return _ticket_error(
                    RetryLater(f"no room for block {key!r} of {size} bytes yet: DRAM is leased or being written")
                )
            if tenant:
                cat.counters["room_refused_tenants"] += 1
                return _ticket_error(CapacityError(no_room_text(f"block {key!r} of {size} bytes", tenant)))
            cat.counters["room_refused_pinned"] += 1
            return _ticket_error(
                CapacityError(f"no room for block {key!r} of {size} bytes: every node's DRAM is pinned")
            )
        return self._record(key, size, chosen, pin, now_ms, write_id)

    def _record(
        self, key: BlockKey, size: int, chosen: list[tuple[NodeState, Extent]], pin: bool, now_ms: int,
        write_id: int = 0,
    ) -> Ticket:  # fmt: skip
        """Record a new key reserved in the DRAM extents of ``chosen`` for the put ``write_id``; its ticket."""
        cat = self.catalog
        slot = cat.new_key(key, size, 0, committed=False, pinned=pin, write_id=write_id)
        cat.rec.deadlines[slot] = now_ms + self.reservation_ms
        for node, extent in chosen:
            cat.add_replica(slot, node, DRAM, extent)
        cat.counters["puts"] += 1
        return Ticket("ok", [PlacedReplica(node.node_id, node.address, DRAM, extent.offset, size)
                             for node, extent in chosen], 0, "")  # fmt: skip

    def put_end(self, keys: Sequence[str], checksums: Sequence[int], write_id: int = 0) -> list[bool]:
        """Commit keys reserved for the put ``write_id``; False for a key whose reservation is gone
        (expired or revoked), or is another put's (another id: 0 is the id of a put that named none)."""
        cat = self.catalog
        if len(keys) != len(checksums):
            raise InvalidArgument(f"put_end got {len(keys)} keys but {len(checksums)} checksums")
        if checksums and not (
            set(map(type, checksums)) == {int} and min(checksums) >= 0 and max(checksums) < MAX_CHECKSUM
        ):
            bad = next(c for c in checksums if type(c) is not int or not 0 <= c < MAX_CHECKSUM)
            raise InvalidArgument(f"a checksum must be an int in [0, 2**64), got {bad!r}")
        if len(keys) >= _RUN_MIN and self._commit_run(keys, checksums, write_id):
            return [True] * len(keys)
        rec = cat.rec
        out, slots = rec.commit_keys(keys, checksums, write_id)
        head, nxt, sizes, r_node, node_at = rec.head, rec.r_next, rec.size, rec.r_node, cat.node_at
        written = 0
        # Rows to enter each DRAM LRU, in order (a put reserves DRAM only), one append of each run.
        lru: TierLRU | None = None
        lru_node = -1
        rows: list[int] = []
        for slot in slots:
            written += sizes[slot]
            row = head[slot]
            if r_node[row] == lru_node and nxt[row] < 0:
                rows.append(row)  # the common case: one replica, on the node of the key before
                continue
            while row >= 0:
                node = node_at[r_node[row]]
                assert node is not None
                if node.dram_lru is not lru:
                    if lru is not None:
                        lru.insert_rows(rows)
                    lru, rows, lru_node = node.dram_lru, [], node.idx
                rows.append(row)
                row = nxt[row]
        if lru is not None:
            lru.insert_rows(rows)
        cat.counters["bytes_written"] += written
        return out

    def _commit_run(self, keys: Sequence[str], checksums: Sequence[int], write_id: int) -> bool:
        """:meth:`put_end` of a batch of distinct keys each being written once, all on one node (a
        batch put, the common case), column-wise; False, having changed nothing, for any other."""
        cat = self.catalog
        rec = cat.rec
        slots = list(map(rec.index.get, keys))
        if None in slots or len(set(slots)) != len(slots):
            return False
        at = np.array(slots, np.intp)
        rows = gather(rec.head, at).astype(np.intp)
        nodes = gather(rec.r_node, rows)
        node = cat.node_at[int(nodes[0])]
        if node is None or (nodes != nodes[0]).any() or (gather(rec.r_next, rows) >= 0).any():
            return False
        if not rec.commit_run(at, checksums, write_id):
            return False
        node.dram_lru.insert_run(rows)
        cat.counters["bytes_written"] += int(gather(rec.size, at).sum())
        return True

    def put_revoke(self, keys: Iterable[str], write_id: int = 0) -> list[NodeCommand]:
        """Give up the reservations of the put ``write_id`` (0: of a put that named none); their
        daemons must drop whatever was written before the extents are reused."""
        pending = self.catalog.pending
        return self.catalog.revoke(
            [e for k in keys if (e := pending.get(k)) is not None and not e.removing and e.write_id == write_id]
        )

    def expire_reservations(self, now_ms: int) -> list[NodeCommand]:
        """Revoke the puts not committed by their deadline."""
        rec = self.catalog.rec
        expired = [ObjectEntry(rec, slot) for slot, deadline in rec.deadlines.items() if deadline <= now_ms]
        self.catalog.counters["expired"] += len(expired)
        return self.catalog.revoke(expired)

    def remove(self, keys: Iterable[str]) -> tuple[int, list[NodeCommand]]:
        """Stop serving ``keys`` at once; returns how many were stored and the drops their daemons must do."""
        cat = self.catalog
        rec = cat.rec
        per: dict[tuple[str, TierName], list[str]] = {}
        removed = 0
        for key in keys:
            slot = rec.index.get(validate_key(key))
            if slot is None or not rec.in_service(slot):
                continue
            removed += 1
            rec.mark_removing(slot)
            hold = rec.holds.pop(slot, None)
            if hold is not None:
                cat.leases.release(LeaseId(hold[0]))  # a forced remove ends the hold of an earlier read
            cat.want_promote.discard(key)
            for row in rec.rows(slot):
                # Copied in: the daemon may not hold it yet, finish_replicas drops it once answered.
                # Dropped: its drop is in flight already; a second could reach a block put again since.
                if rec.r_status[row] >= S_COPYING:
                    continue
                cat.delist(row)
                per.setdefault((rec.node_ids[rec.r_node[row]], TIERS[rec.r_tier[row]]), []).append(key)
        return removed, cat.issue(
            [NodeCommand(n, ActionKind.DROP, t, tuple(ks), release=True) for (n, t), ks in per.items()]
        )
