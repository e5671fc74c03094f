"""What the placement table takes in and hands out, in its own types.

The table knows no wire format: the master's RPC layer turns these into messages
(and messages into these) at its edge, so a change of the protocol never reaches
the table, and the table's tests need no codec. Where a wire message carries the
same facts, :mod:`kvstore.protocol` converts (``PutStartReply.from_tickets``,
``GetReplicasReply.from_lookup``) or re-exports the type as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from kvstore.policy import TierName

PUT_STORED, PUT_EXISTS = 0, 1
"""Per-block codes of a commit into a grant (else an error code of :mod:`kvstore.errors`)."""


class HeldBlock(NamedTuple):
    """One block a daemon holds, as its inventory reports it when it (re)registers."""

    key: str
    tier: TierName
    offset: int
    """Its DRAM extent's offset; -1 on SSD."""
    size: int
    checksum: int
    pinned: bool = False
    write_id: int = 0
    """The write id its daemon kept with it (0: not known)."""


class PlacedReplica(NamedTuple):
    """Where a put writes one replica: a node, its data-plane address, the tier and DRAM extent."""

    node_id: str
    address: str
    tier: TierName
    offset: int
    """Offset in the node's DRAM arena; -1 on SSD."""
    size: int


class Ticket(NamedTuple):
    """The table's answer to one key of a put: where to write, or why not."""

    status: Literal["ok", "exists", "error"]
    replicas: list[PlacedReplica]
    error_code: int
    error: str


@dataclass(slots=True)
class ReplicaLookup:
    """Per key its size (-1: a miss) and checksum, and its ``counts[i]`` replicas, the next entries of
    ``nodes``/``addresses``/``tiers``/``offsets``. Flat, like the reply it becomes: a get is the
    master's hottest call, and these lists go to the wire as they are."""

    sizes: list[int] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    lease_ms: int = 0
    first_lease: int = 0
    """The lease id of the first hit when leases were asked for (0 otherwise); the hits' leases
    are consecutive from there."""


class NodePrefix(NamedTuple):
    """How much of a key list one node holds, counted from its first key."""

    dram: int
    """Leading keys with a readable replica on this node in DRAM."""
    total: int
    """Leading keys with a readable replica on this node in any tier (at least ``dram``)."""


class PrefixMatch(NamedTuple):
    """Where the stored prefix of a key list lies: across the cluster, and node by node."""

    longest: int
    """The cluster-wide longest stored prefix, as ``match_prefix`` answers it: its blocks may be
    spread over several nodes, so it can exceed every node's ``total``."""
    nodes: dict[str, NodePrefix]
    """Each node that holds at least the first key readable; a node absent from it holds 0."""
