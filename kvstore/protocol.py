"""The master RPC wire protocol: versioned, length-prefixed msgpack frames, typed by msgspec.

A frame is a 4-byte big-endian payload length, then the payload: a msgpack
array ``[version, request_id, [kind, field, ...]]``. ``kind`` names the message
type (its msgspec union tag); fields are positional, in the struct's order;
nested structs travel as arrays the same way. Every request gets exactly one
reply carrying its request id: the reply type of the operation, or
:class:`ErrorReply` with a code from :mod:`kvstore.errors`.

The codec is pure: :class:`FrameDecoder` is fed bytes and knows no socket.
msgspec checks every field's type in C while it decodes (strictly: a bool or a
float is not an int). Anything malformed — a bad length, a payload that is not
msgpack, an unknown version or kind, a field of the wrong type, too many or too
few fields — raises :class:`kvstore.errors.ProtocolError` naming what was
wrong (``Exists.keys[1]: expected `str`, got `int```), never another exception.
The one leniency is msgspec's: a trailing field that has a default
(``GetReplicas.lease``, ``InventoryItem.pinned``) may be left out.
"""

from __future__ import annotations

import re
import struct
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, Literal, NamedTuple, Union

import msgspec

from kvstore.errors import KVStoreError, ProtocolError, error_from_code
from kvstore.placement.results import PUT_EXISTS as PUT_EXISTS  # the table's, re-exported
from kvstore.placement.results import PUT_STORED as PUT_STORED
from kvstore.placement.results import NodePrefix as NodePrefix
from kvstore.placement.results import PrefixMatch as PrefixMatch
from kvstore.placement.results import ReplicaLookup, Ticket

PROTOCOL_VERSION = 10
MAX_FRAME_BYTES = 64 * 1024 * 1024
FRAME_HEADER = struct.Struct("!I")

Tier = Literal["dram", "ssd"]


class Struct(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Base of every wire struct: frozen, and sent as the array of its fields in declaration order.

    ``forbid_unknown_fields`` makes an array with more items than fields an
    error (msgspec would otherwise drop the extras). Lists inside a struct are
    plain lists: its builder may fill them before sending it, nobody changes
    them after. Subclasses repeat ``frozen=True``: mypy's reading of
    ``dataclass_transform`` does not inherit it.
    """


class Message(Struct, frozen=True):
    """A top-level message; ``KIND`` is its stable number on the wire, declared as its ``tag``.

    Every subclass names its kind in its class line (``class Exists(Message, tag=34, frozen=True)``);
    its array on the wire starts with it, and :data:`KIND_TO_MESSAGE` refuses a kind used twice.
    """

    KIND: ClassVar[int] = 0


# -- structs ---------------------------------------------------------------------


class Replica(Struct, frozen=True):
    """Where one copy of a block lives: a node's data-plane address, its tier and DRAM extent."""

    node_id: str
    address: str
    tier: Tier
    offset: int
    """Offset in the node's DRAM arena; -1 for an SSD replica (LMDB has no extents)."""
    size: int
    seal: bytes = b""
    """A reservation's seal, for a tenant's write into it (see :meth:`kvstore.auth.Authority.seal`)."""


class PutTicket(Struct, frozen=True):
    """The answer to one key of a put_start: where to write, or why not."""

    status: Literal["ok", "exists", "error"]
    replicas: list[Replica]
    error_code: int
    error: str


class InventoryItem(Struct, frozen=True):
    """One block a daemon holds, as it reports it when (re)registering."""

    key: str
    tier: Tier
    offset: int
    size: int
    checksum: int
    pinned: bool = False
    """Written with pin=True: never evicted, including by a master that rebuilt its table."""


# -- replies shared by many requests ----------------------------------------------


class ErrorReply(Message, tag=1, frozen=True):
    code: int
    message: str

    def to_error(self) -> KVStoreError:
        return error_from_code(self.code, self.message)

    @classmethod
    def from_error(cls, exc: KVStoreError) -> ErrorReply:
        return cls(exc.code, str(exc))


class OkReply(Message, tag=2, frozen=True):
    """The success reply of a request that returns nothing else."""


# -- daemon -> master -------------------------------------------------------------------


class Nic(Struct, frozen=True):
    """One network interface of a host, as :mod:`transfer.topology` reads it."""

    name: str
    address: str
    speed_mbps: int
    """-1: the link reports no speed (loopback, veth)."""
    numa_node: int
    """-1: unknown or not a NUMA machine."""


class NodeInfo(Struct, frozen=True):
    """How clients reach a node's data: its rails, and whether they share its host (and its arena)."""

    node_id: str
    address: str
    rails: list[str]
    """Data-plane addresses, one per NIC the daemon serves on; ``address`` is the first."""
    host_id: str
    arena_path: str
    """The DRAM arena's shared-memory file: a client on the same host maps it."""
    arena_inode: int
    """Tells the same file from one of the same name elsewhere (another container's /dev/shm)."""
    nics: list[Nic]
    rdma: bool
    """The node has an RDMA device (UCX can use verbs rather than TCP)."""
    ucx_address: str
    """host:port of the node's UCX data plane; empty when it serves none."""
    up: bool


class RegisterNode(Message, tag=10, frozen=True):
    node_id: str
    address: str
    dram_capacity: int
    ssd_capacity: int
    alignment: int
    inventory: list[InventoryItem]
    rails: list[str]
    host_id: str
    arena_path: str
    arena_inode: int
    nics: list[Nic]
    rdma: bool
    ucx_address: str
    max_blocks: int
    """Blocks the DRAM arena can index at most (its slot table grows to this as blocks arrive); 0: no
    limit but capacity."""
    peers: list[str]
    """Node ids a master last told this daemon were in the cluster: a master that has just taken
    over waits for them (their inventories) before it answers reads and puts."""


class RegisterReply(Message, tag=11, frozen=True):
    heartbeat_interval_ms: int
    node_ttl_ms: int
    epoch: int
    """The master's leadership epoch (the revision of its etcd leader key; 0 without etcd). The
    daemon refuses commands from masters of an older epoch (see MasterHello)."""
    peers: list[str]


class Heartbeat(Message, tag=12, frozen=True):
    node_id: str
    transfer_bytes: dict[str, int]
    """Bytes the daemon moved since it started, by "transport|rail|direction" (for /metrics)."""
    ssd_capacity: int = -1
    """What the SSD tier can hold now: lowered from ``ssd_configured`` when its disk filled or
    failed a write (-1: as registered)."""
    ssd_configured: int = -1
    """The SSD tier's configured capacity (-1: as registered)."""
    ssd_fault: str = ""
    """Why ``ssd_capacity`` is below ``ssd_configured`` ("" while the tier is healthy)."""


class HeartbeatReply(Message, tag=13, frozen=True):
    known: bool
    """False when the master does not know the node (it restarted): the daemon re-registers."""
    peers: list[str]
    """The nodes the master knows now (see RegisterNode.peers)."""


class MasterHello(Message, tag=14, frozen=True):
    """First frame of a master's connection to a daemon: the commands that follow on it are the
    master's of ``epoch``. A daemon that has registered with a master of a later epoch refuses
    them (NotLeader): a deposed leader can no longer drop, move or grant anything."""

    epoch: int


# -- client -> master -------------------------------------------------------------------


class PutStart(Message, tag=20, frozen=True):
    keys: list[str]
    sizes: list[int]
    replicas: int
    preferred_node: str | None
    pin: bool


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


class PutEndReply(Message, tag=23, frozen=True):
    committed: list[bool]


class PutRevoke(Message, tag=24, frozen=True):
    keys: list[str]


class GetReplicas(Message, tag=30, frozen=True):
    keys: list[str]
    release: list[int]
    """Lease ids of earlier gets this client is done with (piggybacked, to save a round trip)."""
    lease: bool = True
    """Lease the replicas: needed by readers that touch memory without the daemon (shared memory,
    RDMA). A reader that reads through the daemon, which copies under its own lock, asks for none."""


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


class MatchPrefix(Message, tag=32, frozen=True):
    keys: list[str]


class MatchPrefixReply(Message, tag=33, frozen=True):
    matched: int


class MatchPrefixNodes(Message, tag=45, frozen=True):
    """The longest stored prefix of ``keys``, and how much of it each node holds (a scheduler's question)."""

    keys: list[str]


class MatchPrefixNodesReply(Message, tag=46, frozen=True):
    """A :class:`PrefixMatch` in parallel columns: node ``i`` is ``node_ids[i]``, ``dram[i]``, ``total[i]``."""

    longest: int
    node_ids: list[str]
    dram: list[int]
    total: list[int]

    @classmethod
    def from_match(cls, match: PrefixMatch) -> MatchPrefixNodesReply:
        nodes = match.nodes
        return cls(match.longest, list(nodes), [p.dram for p in nodes.values()], [p.total for p in nodes.values()])

    def prefix_match(self, num_keys: int) -> PrefixMatch:
        """The match, checked for consistency with a query of ``num_keys`` keys (a ProtocolError names
        what does not add up)."""
        n = len(self.node_ids)
        if not len(self.dram) == len(self.total) == n:
            raise ProtocolError(
                f"MatchPrefixNodesReply: {n} node ids but {len(self.dram)} dram and {len(self.total)} total counts"
            )
        if not 0 <= self.longest <= num_keys:
            raise ProtocolError(f"MatchPrefixNodesReply: a prefix of {self.longest} keys for {num_keys} keys asked")
        nodes: dict[str, NodePrefix] = {}
        for node_id, dram, total in zip(self.node_ids, self.dram, self.total, strict=True):
            if not 0 <= dram <= total <= self.longest or total == 0:
                raise ProtocolError(
                    f"MatchPrefixNodesReply: node {node_id!r} holds {dram} in DRAM and {total} in all of a "
                    f"prefix of {self.longest}"
                )
            if node_id in nodes:
                raise ProtocolError(f"MatchPrefixNodesReply: node {node_id!r} is listed twice")
            nodes[node_id] = NodePrefix(dram, total)
        return PrefixMatch(self.longest, nodes)


class Exists(Message, tag=34, frozen=True):
    keys: list[str]


class ExistsReply(Message, tag=35, frozen=True):
    exists: list[bool]


class Remove(Message, tag=36, frozen=True):
    keys: list[str]
    force: bool = True
    """Also remove keys held by a recent read (the master's ``--default-kv-lease-ttl``); without
    force those are left and named in the reply's ``held``."""


class RemoveReply(Message, tag=37, frozen=True):
    removed: int
    held: list[int] = msgspec.field(default_factory=list)
    """Indexes (into the request's keys) of keys left because a recent read holds them."""


class LeaveNode(Message, tag=88, frozen=True):
    """A daemon leaves for good (``kvstore daemon --leave-on-exit``, as a Mooncake client unmounts
    its segment at close): the master forgets the node and every replica on it. Answered by OkReply."""

    node_id: str


class ListKeys(Message, tag=86, frozen=True):
    """A page of stored keys that start with ``prefix``, in order, after ``after`` (exclusive; ""
    starts at the beginning); answered by a KeysReply. A tenant lists its own keys, named without
    its ``NAME/``."""

    prefix: str
    after: str
    limit: int


class KeysReply(Message, tag=87, frozen=True):
    keys: list[str]
    next: str
    """Pass as ``after`` for the next page; empty after the last."""


class Stats(Message, tag=38, frozen=True):
    """Ask the master for its counters; answered by a StatsReply."""


class StatsReply(Message, tag=39, frozen=True):
    stats: dict[str, int | float]


class ReleaseLeases(Message, tag=40, frozen=True):
    lease_ids: list[int]
    """Leases this reader is done with (see GetReplicasReply.first_lease)."""


class ListNodes(Message, tag=41, frozen=True):
    """Ask the master for every node it knows; answered by a NodesReply."""


class AdminInfo(Message, tag=43, frozen=True):
    """Where the master's REST admin API is (for tools given only the RPC address)."""


class AdminInfoReply(Message, tag=44, frozen=True):
    address: str
    """host:port of the admin API; empty when the master serves none."""


class NodesReply(Message, tag=42, frozen=True):
    nodes: list[NodeInfo]


class GrantSpace(Message, tag=70, frozen=True):
    """Ask for DRAM space to write into without a master round trip per put: ``length`` bytes of one
    node's arena (``preferred_node`` when it has room), held for this client until the grant's
    ``ttl_ms`` passes or it is returned. Answered by a GrantReply."""

    length: int
    preferred_node: str | None


class GrantReply(Message, tag=71, frozen=True):
    grant_id: int
    node_id: str
    address: str
    offset: int
    length: int
    ttl_ms: int
    """The grant ends this long after it was answered (the client stops using it a little before)."""
    alignment: int = 64
    """The node's extent alignment: blocks are carved from the grant at multiples of it."""


class ReturnGrants(Message, tag=72, frozen=True):
    """Give granted space back early (its unused part returns to the pool)."""

    grant_ids: list[int]


class AccessReport(Message, tag=73, frozen=True):
    """Blocks a daemon served by key since its last report (reads that asked the master nothing),
    each with the tier it was read from: the master counts the hits and keeps its LRU order. The
    tier is the one at the read: a report may come after the block moved (a read of a DRAM block
    demoted since is no SSD hit, and promotes nothing)."""

    node_id: str
    keys: list[str]
    tiers: list[Tier]


class CommitGranted(Message, tag=74, frozen=True):
    """A daemon asks the master to commit blocks written into a grant: each key becomes a block at
    its extent, or is refused (it exists, or its extent is not free in the grant). Answered by a
    PutReply."""

    node_id: str
    grant_id: int
    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: bool


# PUT_STORED, PUT_EXISTS (from the placement table): per-block codes of a one-trip put in :class:`PutReply`.


class PutReply(Message, tag=75, frozen=True):
    """Per block of a one-trip put: PUT_STORED, PUT_EXISTS (the stored bytes are kept), else the
    code of the error in :mod:`kvstore.errors` that refused it."""

    codes: list[int]
    errors: list[str]


class Replicate(Message, tag=47, frozen=True):
    """Copy stored blocks into the DRAM of ``node_id`` and keep their other replicas (hot blocks near
    their readers). Keys are taken in order while they fit the node's free DRAM (nothing is evicted
    for them) and ``max_bytes``; keys not stored or already on the node are skipped."""

    keys: list[str]
    node_id: str
    max_bytes: int


class ReplicateReply(Message, tag=48, frozen=True):
    copied: int
    """Blocks that gained a replica on the node."""
    bytes: int
    """Their bytes."""


class Replicated(NamedTuple):
    """What a replicate did: blocks that gained a replica on the node, and their bytes."""

    copied: int
    bytes: int


# -- authentication (the first frames of a connection to a server that requires it) ------------


class AuthHello(Message, tag=80, frozen=True):
    """A connection's first frame (see :mod:`kvstore.auth`): who the client claims to be and its nonce."""

    kind: Literal["cluster", "tenant", "ticket"]
    name: str
    nonce: bytes
    ticket: bytes
    """For ``kind="ticket"``: the ticket the master issued (empty otherwise)."""


class AuthChallenge(Message, tag=81, frozen=True):
    nonce: bytes


class AuthProof(Message, tag=82, frozen=True):
    proof: bytes


class AuthOk(Message, tag=83, frozen=True):
    """The server's proof that it knows the client's key too; the connection serves from here on."""

    proof: bytes


class GetTicket(Message, tag=84, frozen=True):
    """A tenant asks the master for a ticket to show the daemons (answered by a TicketReply)."""


class TicketReply(Message, tag=85, frozen=True):
    ticket: bytes
    sealed_key: bytes
    """The ticket's session key, masked with a key only this connection's two ends can derive."""
    expires_ms: int
    """Unix time (ms) the ticket ends at."""


# -- master -> daemon ---------------------------------------------------------------------


class DemoteBlocks(Message, tag=50, frozen=True):
    """Move blocks from the DRAM arena to the SSD tier, freeing their extents."""

    keys: list[str]


class DropBlocks(Message, tag=51, frozen=True):
    """Delete blocks: from whichever tier holds them, or with ``tier`` only from that one (a key
    held in both tiers keeps its other copy)."""

    keys: list[str]
    tier: Literal["", "dram", "ssd"] = ""
    fences: list[int] = []
    """For copies the master gave up on (a drain's or a replicate's), per key the DRAM offset the
    copy was planned into: one that has not arrived is refused when it comes (empty: none)."""


class PromoteBlocks(Message, tag=52, frozen=True):
    """Move SSD blocks into the DRAM arena at the given offsets."""

    keys: list[str]
    offsets: list[int]


class FetchBlocks(Message, tag=54, frozen=True):
    """Copy blocks from another daemon (a drain, a replicate): read them by key from ``source`` into
    the given reserved DRAM extents here, check their checksums and commit them, each pinned as
    ``pinned`` says (empty: none; a master before it sent none). Answered by a CommandReply."""

    source: str
    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: list[bool] = []


class OpenGrant(Message, tag=55, frozen=True):
    """Space of this daemon's arena the master granted a client: writes into it (WriteGranted) are
    taken until the grant ends, at the latest ``ttl_ms`` after this command arrived."""

    grant_id: int
    offset: int
    length: int
    ttl_ms: int
    owner: str = ""
    """The tenant the grant belongs to ("" without tenants): only its connections may write into it."""


class EndGrants(Message, tag=56, frozen=True):
    """Take no more writes into these grants and cut those in flight; answered once none can land."""

    grant_ids: list[int]


class CommandReply(Message, tag=53, frozen=True):
    done: list[bool]


# -- client -> daemon (data plane: the frame is followed by the blocks' bytes) ----------------


class WriteBlocks(Message, tag=60, frozen=True):
    """Write blocks into reserved DRAM extents; their bytes follow the frame, concatenated in order."""

    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: bool
    """The batch was put with pin=True; the daemon records it so that pins survive a master restart."""
    seals: list[bytes] = []
    """Per block, the master's seal of its reservation: a tenant's write lands only where the master
    reserved for it (empty for the cluster's own writes and on a cluster without authentication)."""


class WriteGranted(Message, tag=67, frozen=True):
    """A put in one trip: write blocks into extents of a grant; the daemon checks them, has the
    master commit them, commits them here and answers with a PutReply. Bytes follow as in WriteBlocks."""

    grant_id: int
    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: bool


class WriteSlices(Message, tag=66, frozen=True):
    """Write byte ranges of blocks into their reserved extents (the slices of large blocks, sprayed over rails).

    Each block is reserved by its first slice to arrive, on whichever rail; its bytes follow the
    frame, slice after slice. Answered by a WriteReply per slice; the blocks stay invisible until a
    CommitBlocks names them."""

    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    starts: list[int]
    lengths: list[int]
    seals: list[bytes] = []
    """Per slice, its block's reservation seal (as in WriteBlocks)."""


class CommitBlocks(Message, tag=64, frozen=True):
    """Commit blocks whose bytes are already in their reserved DRAM extents: copied there by a
    same-host client, or written by WriteSlices.

    Nothing follows the frame; the daemon checks each block's checksum in place."""

    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: bool
    seals: list[bytes] = []
    """Per block, its reservation seal (as in WriteBlocks)."""


class WriteReply(Message, tag=61, frozen=True):
    codes: list[int]
    """0 for a block stored, else the code of the error in :mod:`kvstore.errors`."""
    errors: list[str]

    @classmethod
    def from_outcomes(cls, outcomes: Sequence[KVStoreError | None]) -> WriteReply:
        """Per block None (stored) or the error that refused it."""
        return cls([0 if e is None else e.code for e in outcomes], ["" if e is None else str(e) for e in outcomes])


class ReadBlocks(Message, tag=62, frozen=True):
    keys: list[str]
    tiers: list[str]
    """Where the master last saw each block; a daemon reads by key, so these are hints."""
    offsets: list[int]
    sizes: list[int]


class ReadSlices(Message, tag=65, frozen=True):
    """Read byte ranges of blocks (one slice of a large block per entry, for spraying over several rails).

    Answered by a ReadReply: per slice the bytes sent, -1 when the block is not held or the
    range does not lie inside it."""

    keys: list[str]
    starts: list[int]
    lengths: list[int]


class ReadReply(Message, tag=63, frozen=True):
    """Sizes of the blocks read (-1: not held) and their checksums (0 for those not held); the bytes
    of those held follow the frame, in order."""

    sizes: list[int]
    checksums: list[int]


# -- framing ------------------------------------------------------------------------------


def _register() -> dict[int, type[Message]]:
    kinds: dict[int, type[Message]] = {}
    for cls in Message.__subclasses__():
        kind = cls.__struct_config__.tag
        assert type(kind) is int, f"{cls.__name__} declares no int tag (its kind)"
        other = kinds.setdefault(kind, cls)
        assert other is cls, f"message kind {kind} used by {other.__name__} and {cls.__name__}"
        cls.KIND = kind
    return kinds


KIND_TO_MESSAGE: dict[int, type[Message]] = _register()

_ENCODER = msgspec.msgpack.Encoder()
_DECODER: msgspec.msgpack.Decoder[tuple[int, int, Message]] = msgspec.msgpack.Decoder(
    tuple[int, int, Union[tuple(KIND_TO_MESSAGE.values())]]  # type: ignore[misc]  # noqa: UP007
)
_UNTYPED = msgspec.msgpack.Decoder()
"""Only for a payload the typed decoder refused: to say in the protocol's terms what is wrong."""
_UNREADABLE = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)
"""What msgspec raises for bad input: DecodeError (ValidationError is one), UnicodeDecodeError for a
string that is not UTF-8, RecursionError for arrays nested past its limit (untyped decoding only)."""


def encode(message: Message, request_id: int) -> bytes:
    """One whole frame for ``message``."""
    payload = _ENCODER.encode((PROTOCOL_VERSION, request_id, message))
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"{type(message).__name__} frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return FRAME_HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> tuple[int, Message]:
    """(request_id, message) of one frame's payload."""
    try:
        version, request_id, message = _DECODER.decode(payload)
    except _UNREADABLE as exc:
        raise ProtocolError(_diagnose(payload, exc)) from None
    if version != PROTOCOL_VERSION:
        raise ProtocolError(_unsupported(version))
    return request_id, message


def request_id_of(payload: bytes) -> int:
    """Best-effort request id of a payload that failed to decode, for the error reply: 0 when none can be
    read, or when the payload is of another version (whose framing may put something else there)."""
    try:
        raw = _UNTYPED.decode(payload)
    except _UNREADABLE:
        return 0
    if not isinstance(raw, list) or len(raw) < 2 or type(raw[0]) is not int or raw[0] != PROTOCOL_VERSION:
        return 0
    return raw[1] if type(raw[1]) is int else 0


def _unsupported(version: object) -> str:
    return f"protocol version {version!r:.60} is not supported (this side speaks {PROTOCOL_VERSION})"


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


_ERROR_AT = re.compile(r"(?s)(.*) - at (`key` in )?`\$((?:\[(?:\d+|\.\.\.)\])*)`")
_STEP = re.compile(r"\[(\d+|\.\.\.)\]")


def _diagnose(payload: bytes, error: Exception) -> str:
    """What is wrong with a payload the typed decoder refused, in the protocol's terms.

    The frame's envelope is checked here in the order a reader needs it (version
    first: a peer of another version may frame differently); a fault inside a
    message has msgspec's path of indices turned into field names.
    """
    if not isinstance(error, msgspec.ValidationError):
        return f"payload is not valid msgpack: {error}"
    try:
        raw = _UNTYPED.decode(payload)
    except RecursionError:
        return "payload is nested too deeply to read"
    except _UNREADABLE as exc:  # a map key that is itself a map, say
        return f"payload cannot be read: {exc}"
    if isinstance(raw, list) and raw and (type(raw[0]) is not int or raw[0] != PROTOCOL_VERSION):
        return _unsupported(raw[0])
    if not isinstance(raw, list) or len(raw) != 3:
        return f"payload must be [version, request_id, [kind, field, ...]], got {_describe(raw)}"
    if type(raw[1]) is not int:
        return f"request id must be an int, got {_describe(raw[1])}"
    body = raw[2]
    if not isinstance(body, list) or not body:
        return f"message must be [kind, field, ...], got {_describe(body)}"
    kind = body[0]
    cls = KIND_TO_MESSAGE.get(kind) if type(kind) is int else None
    if cls is None:
        return f"unknown message kind {_describe(kind)}"
    text = str(error)
    located = _ERROR_AT.fullmatch(text)
    if located is None or not located.group(3).startswith("[2]"):
        return f"{cls.__name__}: {text}"
    what, in_key, path = located.groups()
    steps = _STEP.findall(path)[1:]
    if not steps and what.startswith("Expected `array` of"):  # msgspec counts the kind in some of these
        fields = msgspec.structs.fields(cls)
        required = sum(f.required for f in fields)
        expected = f"{required} to {len(fields)}" if required < len(fields) else f"{len(fields)}"
        return f"{cls.__name__}: expected {expected} fields, got {len(body) - 1}"
    where, tp = _field_path(cls, steps)
    if in_key:
        where, tp = f"{where} key", (typing.get_args(tp) or (Any,))[0]
    if typing.get_origin(tp) is Literal:
        what += f" (expected one of {typing.get_args(tp)})"
    return f"{where}: {what[:1].lower()}{what[1:]}"


def _field_path(cls: type[Message], steps: list[str]) -> tuple[str, Any]:
    """msgspec's indices into a message's array as field names (``Exists.keys[1]``), and the type found there."""
    where: str = cls.__name__
    tp: Any = cls
    skip = 1  # a message's array starts with its kind
    for step in steps:
        fields = msgspec.structs.fields(tp) if isinstance(tp, type) and issubclass(tp, Struct) else ()
        if step.isdigit() and 0 <= int(step) - skip < len(fields):
            field = fields[int(step) - skip]
            where, tp = f"{where}.{field.name}", field.type
        else:  # an item of a list, or a value of a map ("...")
            where, tp = f"{where}[{step}]", (typing.get_args(tp) or (Any,))[-1]
        skip = 0
        if typing.get_origin(tp) in (Union, types.UnionType):  # X | None -> X
            options = [o for o in typing.get_args(tp) if o is not type(None)]
            tp = options[0] if len(options) == 1 else tp
    return where, tp


class FrameDecoder:
    """Splits a byte stream into frame payloads. Fed bytes; knows no socket.

    A length above ``max_frame`` raises :class:`ProtocolError`: the stream
    cannot be resynchronised, so the connection must close.
    """

    def __init__(self, max_frame: int = MAX_FRAME_BYTES) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> Iterator[bytes]:
        """Payloads completed by ``data``, in order."""
        self._buf += data
        while len(self._buf) >= FRAME_HEADER.size:
            (length,) = FRAME_HEADER.unpack_from(self._buf)
            if length > self.max_frame:
                raise ProtocolError(f"frame of {length} bytes exceeds the limit of {self.max_frame}")
            end = FRAME_HEADER.size + length
            if len(self._buf) < end:
                return
            payload = bytes(self._buf[FRAME_HEADER.size : end])
            del self._buf[:end]
            yield payload

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buf)
