"""Client -> master: a block's life in the table: two-trip puts, gets and their leases, removal.

Replies that carry many replicas (:class:`PutStartReply`, :class:`GetReplicasReply`) travel as
flat parallel lists, which decode fast; their methods turn them back into per-key views
(:class:`PutTicket`, :class:`LocatedRef`), checked for consistency.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import msgspec

from kvstore.errors import ProtocolError
from kvstore.events import EngineBlock
from kvstore.protocol.base import Message, PutTicket, Replica
from kvstore.results import ReplicaLookup, Ticket


class PutStart(Message, tag=20, frozen=True):
    keys: list[str]
    sizes: list[int]
    replicas: int
    preferred_node: str | None
    pin: bool
    write_id: int = 0
    """The put's write id (:mod:`kvstore.write_ids`; 0: none): kept with each key it reserves, so that
    its PutEnd, its PutRevoke and a lookup know the put's own write from another's."""
    avoid: list[str] = []
    """Nodes this client could not reach lately (a write there given up at its patience, refused,
    or a node it suspects): placed on last, as suspected nodes are, when the others cannot take
    the put. A node the master reaches may be cut off from this one client, or frozen and not yet
    suspected by the master."""


class PutStartReply(Message, tag=21, frozen=True):
    """One ticket per key, flattened into parallel lists so that a batch decodes in a few list checks.

    Ticket ``i`` is ``statuses[i]``, ``error_codes[i]``, ``errors[i]`` and its
    ``counts[i]`` DRAM replicas, the next entries of ``nodes``/``addresses``/``offsets``.
    """

    statuses: list[str]
    error_codes: list[int]
    errors: list[str]
    counts: list[int]
    nodes: list[str]
    addresses: list[str]
    offsets: list[int]
    seals: list[bytes] = []
    """Per replica, the master's seal of the reservation (a tenant's writes must show it); empty unsealed."""

    @classmethod
    def from_tickets(cls, tickets: Sequence[Ticket], seals: list[bytes] | None = None) -> PutStartReply:
        """The wire form of the placement table's answers, one per key; ``seals``: one per replica, in order."""
        replicas = [r for t in tickets for r in t.replicas]
        return cls(
            [t.status for t in tickets], [t.error_code for t in tickets], [t.error for t in tickets],
            [len(t.replicas) for t in tickets], [r.node_id for r in replicas], [r.address for r in replicas],
            [r.offset for r in replicas], seals or [],
        )  # fmt: skip

    def tickets(self) -> list[PutTicket]:
        """The tickets, checked for consistency (a ProtocolError names what does not add up)."""
        n = len(self.statuses)
        if not len(self.error_codes) == len(self.errors) == len(self.counts) == n:
            raise ProtocolError(f"PutStartReply: {n} statuses but other per-key lists of other lengths")
        _check_flat("PutStartReply", self.counts, self.nodes, self.addresses, self.offsets)
        if self.seals and len(self.seals) != len(self.offsets):
            raise ProtocolError(f"PutStartReply: {len(self.seals)} seals for {len(self.offsets)} replicas")
        seals = self.seals or [b""] * len(self.offsets)
        out, at = [], 0
        for status, code, error, count in zip(self.statuses, self.error_codes, self.errors, self.counts, strict=True):
            if status not in ("ok", "exists", "error"):
                raise ProtocolError(f"PutStartReply: unknown status {status!r}")
            replicas = [
                Replica(self.nodes[j], self.addresses[j], "dram", self.offsets[j], 0, seals[j])
                for j in range(at, at + count)
            ]
            at += count
            out.append(PutTicket(status, replicas, code, error))  # type: ignore[arg-type]
        return out


class PutEnd(Message, tag=22, frozen=True):
    keys: list[str]
    checksums: list[int]
    write_id: int = 0
    """The put's write id, as its PutStart gave it: only a reservation of that write is committed."""


class PutEndReply(Message, tag=23, frozen=True):
    committed: list[bool]


class PutRevoke(Message, tag=24, frozen=True):
    keys: list[str]
    write_id: int = 0
    """The put's write id, as its PutStart gave it: only reservations of that write are given up."""


class LabelBlocks(Message, tag=25, frozen=True):
    """Name ``keys`` as an engine names their blocks (``labels[i]`` for ``keys[i]``: the engine's
    block hash, its parent's, its tokens): the master's KV events of their replicas carry those
    (:mod:`kvstore.events`), so that a router matches them with the engine's own events. Sent
    before the put of the keys; answered by an OkReply."""

    keys: list[str]
    labels: list[EngineBlock]


class ClearReplicas(Message, tag=26, frozen=True):
    """Mooncake's ``batch_replica_clear``: drop the replicas of ``keys`` on ``node`` (every replica
    when ""); a key left with none goes whole. Keys a recent read holds (the master's
    ``--default-kv-lease-ttl``) are left unless ``force``. Answered, once the daemons dropped them,
    by a ClearReplicasReply."""

    keys: list[str]
    node: str = ""
    force: bool = False


class ClearReplicasReply(Message, tag=27, frozen=True):
    cleared: list[int]
    """Indexes (into the request's keys) of the keys cleared: stored, with a replica on the node."""
    held: list[int] = msgspec.field(default_factory=list)
    """Indexes of keys left because a recent read holds them."""


class GetReplicas(Message, tag=30, frozen=True):
    keys: list[str]
    release: list[int]
    """Lease ids of earlier gets this client is done with (piggybacked, to save a round trip)."""
    lease: bool = True
    """Lease the replicas: needed by readers that touch memory without the daemon (shared memory,
    RDMA). A reader that reads through the daemon, which copies under its own lock, asks for none."""
    write_ids: bool = False
    """Answer each hit's write id too (:attr:`GetReplicasReply.write_ids`): a put that found its key
    stored asks whether the block is its own."""


class GetReplicasReply(Message, tag=31, frozen=True):
    """Per key its size (-1: a miss) and checksum, and its ``counts[i]`` replicas, the next
    entries of ``nodes``/``addresses``/``tiers``/``offsets``: flat lists decode fast."""

    sizes: list[int]
    checksums: list[int]
    counts: list[int]
    nodes: list[str]
    addresses: list[str]
    tiers: list[str]
    offsets: list[int]
    lease_ms: int
    first_lease: int
    """The lease id of the first hit when the get asked for leases (0 when it did not): the hits'
    leases are consecutive from there, and a reader releases those ids."""
    write_ids: list[int] = []
    """Per key, its block's write id (0 for a miss or an unknown one), when the get asked; else empty."""
    suspects: list[str] = []
    """Of the nodes named, those the master suspects now (silent for heartbeats: frozen or cut off):
    a reader waits on none of them (see ``NodeMarks.suspected`` in ``kvstore_client.marks``)."""

    @classmethod
    def from_lookup(cls, lookup: ReplicaLookup) -> GetReplicasReply:
        """The wire form of the placement table's lookup (its lists, as they are)."""
        return cls(
            lookup.sizes, lookup.checksums, lookup.counts, lookup.nodes, lookup.addresses, lookup.tiers,
            lookup.offsets, lookup.lease_ms, lookup.first_lease,
        )  # fmt: skip

    def located(self, keys: Sequence[str]) -> list[LocatedRef | None]:
        """Each key's location (None for a miss), checked for consistency with ``keys``."""
        if not len(self.sizes) == len(self.checksums) == len(self.counts) == len(keys):
            raise ProtocolError(f"GetReplicasReply: {len(self.sizes)} answers for {len(keys)} keys")
        _check_flat("GetReplicasReply", self.counts, self.nodes, self.addresses, self.tiers, self.offsets)
        if any(t != "dram" and t != "ssd" for t in self.tiers):
            raise ProtocolError("GetReplicasReply: a tier that is neither dram nor ssd")
        out: list[LocatedRef | None] = []
        at = 0
        nodes, addresses, tiers, offsets = self.nodes, self.addresses, self.tiers, self.offsets
        for key, size, check, count in zip(keys, self.sizes, self.checksums, self.counts, strict=True):
            if size < 0:
                out.append(None)
                continue
            replicas = [ReplicaRef(nodes[j], addresses[j], tiers[j], offsets[j]) for j in range(at, at + count)]
            at += count
            out.append(LocatedRef(key, size, check, replicas))
        return out


class ReplicaRef(NamedTuple):
    """A reader's view of one replica (light: a get builds many)."""

    node_id: str
    address: str
    tier: str
    offset: int


class LocatedRef(NamedTuple):
    """A reader's view of one committed block: its size, checksum and replicas, DRAM first."""

    key: str
    size: int
    checksum: int
    replicas: list[ReplicaRef]


def _check_flat(what: str, counts: Sequence[int], *columns: Sequence[object]) -> None:
    total = sum(counts)
    if any(c < 0 for c in counts) or any(len(col) != total for col in columns):
        raise ProtocolError(f"{what}: replica counts add up to {total} but the replica lists disagree")


class ReleaseLeases(Message, tag=40, frozen=True):
    lease_ids: list[int]
    """Leases this reader is done with (see GetReplicasReply.first_lease)."""


class Remove(Message, tag=36, frozen=True):
    keys: list[str]
    force: bool = True
    """Also remove keys held by a recent read (the master's ``--default-kv-lease-ttl``); without
    force those are left and named in the reply's ``held``."""


class RemoveReply(Message, tag=37, frozen=True):
    removed: int
    held: list[int] = msgspec.field(default_factory=list)
    """Indexes (into the request's keys) of keys left because a recent read holds them."""
