"""The master's placement table: nodes, objects and their replicas, reservations,
grants, read leases and each node's per-tier LRU. Pure and synchronous: time
comes in as ``now_ms``, and every change a daemon must carry out comes back as
a :class:`~kvstore.placement.state.NodeCommand` that the caller sends and then
reports with :meth:`PlacementTable.apply`.

:class:`PlacementTable` composes the parts, each over one shared, private
:class:`~kvstore.placement.state.Catalog`, and hands them out: a caller asks the
part that holds the rules (``table.writes.put_start(...)``,
``table.reads.get_replicas(...)``). The table itself carries out only what spans
parts (:meth:`~PlacementTable.expire`, :meth:`~PlacementTable.remove`,
:meth:`~PlacementTable.apply`, :meth:`~PlacementTable.settle_fenced`,
:meth:`~PlacementTable.stats`, :meth:`~PlacementTable.check`). The parts:

- ``membership`` (:mod:`~kvstore.placement.nodes`): registration, heartbeats, silent and absent nodes, their records;
- ``writes`` (:mod:`~kvstore.placement.writes`): placement strategies, puts, commits;
- ``grants`` (:mod:`~kvstore.placement.grants`): space granted for one-trip puts;
- ``reads`` (:mod:`~kvstore.placement.reads`): lookups, leases handed out and released, access reports;
- ``leases`` (:mod:`~kvstore.placement.leases`): the one owner of read leases;
- ``tiering`` (:mod:`~kvstore.placement.tiering`): reservations, evictions, promotions, the daemons' answers;
- ``moves`` (:mod:`~kvstore.placement.moves`): operators' evictions, drains, replication;
- ``accounts`` (:mod:`~kvstore.placement.accounts`): what each tenant holds, for its quota;
- ``kv_events`` (:mod:`~kvstore.placement.kv_events`): replicas stored and dropped, as KV events;
- ``inspection`` (:mod:`~kvstore.placement.inspection`): usage, keys, counters, invariants.

An extent is reused only after its daemon has confirmed that the block in it
is gone, so a daemon never holds a block in an extent that the master gave to
another key. The invariants are those of :mod:`kvstore.placement.inspection`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from kvstore.errors import InvalidArgument
from kvstore.placement.accounts import Accounts
from kvstore.placement.grants import Grants
from kvstore.placement.inspection import Inspection
from kvstore.placement.kv_events import KvEvents
from kvstore.placement.moves import Moves
from kvstore.placement.nodes import Membership
from kvstore.placement.reads import Reads
from kvstore.placement.state import Catalog, NodeCommand, NodeState, ObjectEntry
from kvstore.placement.tiering import Tiering
from kvstore.placement.writes import PLACEMENT_STRATEGIES, Writes
from kvstore.policy import EvictionPolicy


class PlacementTable:
    """The parts of the table, composed over one catalog that only they see. Readers get
    read-only views of its containers (``nodes``, ``objects``, ``pending``, ``counters``); every
    change goes through a part's verb, or the table's where it spans parts."""

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
        self.counters: Mapping[str, int] = MappingProxyType(catalog.counters)
        self.leases = catalog.leases
        self.tiering = Tiering(catalog, policy)
        self.membership = Membership(catalog, ttl_ms=node_ttl_ms)
        self.writes = Writes(catalog, self.tiering, order, rng, reservation_ms=reservation_ms)
        self.grants = Grants(catalog, self.tiering, order, rng)
        self.reads = Reads(catalog, self.tiering, policy, lease_ms=lease_ms, hold_ms=hold_ms)
        self.moves = Moves(catalog, self.tiering, self.writes, policy)
        self.accounts = Accounts(catalog)
        self.kv_events = KvEvents(catalog)
        self.inspection = Inspection(catalog)

    def expire(self, now_ms: int) -> list[NodeCommand]:
        """Fence silent nodes, end expired leases and reservations; returns the drops and promotions due."""
        self.membership.fence_silent(now_ms)
        self.leases.expire(now_ms)
        self._catalog.free_parked()
        return self.writes.expire_reservations(now_ms) + self.tiering.plan_promotions()

    def remove(self, keys: Iterable[str]) -> tuple[int, list[NodeCommand]]:
        """Stop serving ``keys`` at once (:meth:`Writes.remove`), and note them for the absent nodes
        (:meth:`Membership.removed`); returns how many were stored and the drops their daemons must do."""
        keys = list(keys)
        removed = self.writes.remove(keys)
        self.membership.removed(keys)  # after: a key that is not valid raised first
        return removed

    def apply(self, command: NodeCommand, done: Sequence[bool]) -> None:
        """A daemon's answer to ``command``: which of its keys it carried out."""
        self.tiering.apply(command, done)
        self.membership.settled(command)

    def settle_fenced(self, command: NodeCommand) -> None:
        """Carry out ``command`` for a fenced node without its daemon (it serves nothing until it
        registers again, and its registration drops what is noted here): a drop or demotion as
        made, the block noted to drop then; a promotion as not made."""
        self.membership.gone_with(command)
        self.tiering.apply(command, [False] * len(command.keys))

    def stats(self) -> dict[str, int | float]:
        return {**self.inspection.stats(), "nodes_absent": len(self.membership.absent)}

    def check(self) -> None:
        """Assert the table's invariants (:meth:`Inspection.check`; for tests)."""
        self.inspection.check()
