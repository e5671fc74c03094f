"""Outcomes that cross the wire or the client boundary: what a put came to, and what the placement
table takes in and hands out.

They are defined here, below the server's storage and the wire protocol alike, so that a message
or a client names them without loading the placement table, the tiers or LMDB: the table builds
them, :mod:`kvstore.protocol` converts them to and from messages at the master's edge
(``PutStartReply.from_tickets``, ``GetReplicasReply.from_lookup``) or re-exports them as they are,
and the client returns :class:`PutStatus`. The table knows no wire format, so a change of the
protocol never reaches it, and its tests need no codec.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from kvstore.policy import TierName


class PutStatus(enum.Enum):
    STORED = "stored"
    """This put's bytes are committed: any client reads them until they are removed or evicted. A
    ``cached`` put (``PutOptions.mode``) is STORED once its bytes are checked and committed in its
    daemon's arena: the writer reads them at once; other clients may miss the key (never read other
    bytes) until the master learns of it, a few ms later (``Store.flush`` waits for that). A daemon
    that dies before telling the master brings the block back with its inventory when it returns;
    where the master refuses it (another writer's block is under the key), the daemon drops it and
    the store keeps the other block (kvstore_daemon_cached_refused)."""
    EXISTS = "exists"
    """This put wrote nothing: the key is stored, or another put of it is being written (whose
    outcome decides what, if anything, is stored). A put compares a stored block with its own bytes
    where its write went out, and answers STORED when they match; under a fault (a leader or a
    daemon stopped mid-commit) an earlier attempt of it may still have landed unseen."""


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
