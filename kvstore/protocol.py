"""The master RPC wire protocol: versioned, length-prefixed msgpack frames.

A frame is a 4-byte big-endian payload length, then the payload: a msgpack
array ``[version, kind, request_id, [field, ...]]``. ``kind`` names the message
type; fields are positional, in the dataclass's order; nested structs travel
as arrays the same way. Every request gets exactly one reply carrying its
request id: the reply type of the operation, or :class:`ErrorReply` with a
code from :mod:`kvstore.errors`.

The codec is pure: :class:`FrameDecoder` is fed bytes and knows no socket.
Anything malformed — a bad length, a payload that is not msgpack, an unknown
version or kind, a field of the wrong type — raises
:class:`kvstore.errors.ProtocolError` naming what was wrong, never another
exception.
"""

from __future__ import annotations

import struct
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, NamedTuple, TypeVar, Union, cast, dataclass_transform

import msgpack

from kvstore.errors import KVStoreError, ProtocolError, error_from_code

PROTOCOL_VERSION = 2
MAX_FRAME_BYTES = 64 * 1024 * 1024
FRAME_HEADER = struct.Struct("!I")

Tier = Literal["dram", "ssd"]

Validator = Callable[[Any, str], Any]


class Struct:
    """Base of every wire struct: a frozen, slotted dataclass with a validator per field."""

    _validators: ClassVar[tuple[tuple[str, Validator], ...]] = ()
    _nested: ClassVar[tuple[tuple[str, bool], ...]] = ()
    """Per field, whether it can hold structs (only those are walked when encoding)."""

    def to_wire(self) -> list[Any]:
        return [_to_wire(getattr(self, name)) if nested else getattr(self, name) for name, nested in self._nested]

    @classmethod
    def from_wire(cls, raw: Any, where: str = "") -> Any:
        where = where or cls.__name__
        if not isinstance(raw, list | tuple) or len(raw) != len(cls._validators):
            raise ProtocolError(f"{where}: expected {len(cls._validators)} fields, got {_describe(raw)}")
        values = [check(value, f"{where}.{name}") for (name, check), value in zip(cls._validators, raw, strict=True)]
        return cls(*values)


class Message(Struct):
    """A top-level message; ``KIND`` is its stable number on the wire."""

    KIND: ClassVar[int] = 0


def _to_wire(value: Any) -> Any:
    if isinstance(value, Struct):
        return value.to_wire()
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _validator(tp: Any) -> Validator:
    """A function that checks (and converts nested structs of) a decoded value of type ``tp``."""
    origin = typing.get_origin(tp)
    if tp is int:

        def check_int(v: Any, where: str) -> int:
            if type(v) is not int:
                raise ProtocolError(f"{where}: expected int, got {_describe(v)}")
            return v

        return check_int
    if tp is float:

        def check_float(v: Any, where: str) -> float:
            if type(v) not in (float, int):
                raise ProtocolError(f"{where}: expected float, got {_describe(v)}")
            return float(v)

        return check_float
    if tp in (str, bytes, bool):

        def check_plain(v: Any, where: str) -> Any:
            if type(v) is not tp:
                raise ProtocolError(f"{where}: expected {tp.__name__}, got {_describe(v)}")
            return v

        return check_plain
    if isinstance(tp, type) and issubclass(tp, Struct):
        return tp.from_wire
    if origin is Literal:
        allowed = typing.get_args(tp)

        def check_literal(v: Any, where: str) -> Any:
            if v not in allowed or type(v) is not type(allowed[0]):
                raise ProtocolError(f"{where}: expected one of {allowed}, got {_describe(v)}")
            return v

        return check_literal
    if origin is list:
        item_type = typing.get_args(tp)[0]
        item = _validator(item_type)
        scalar = item_type in (int, str)

        def check_list(v: Any, where: str) -> list[Any]:
            if not isinstance(v, list):
                raise ProtocolError(f"{where}: expected a list, got {_describe(v)}")
            if scalar and all(type(x) is item_type for x in v):  # the hot case: batches of keys or sizes
                return v
            return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]

        return check_list
    if origin is dict:
        key_check, value_check = (_validator(a) for a in typing.get_args(tp))

        def check_dict(v: Any, where: str) -> dict[Any, Any]:
            if not isinstance(v, dict):
                raise ProtocolError(f"{where}: expected a map, got {_describe(v)}")
            return {key_check(k, f"{where} key"): value_check(x, f"{where}[{k!r}]") for k, x in v.items()}

        return check_dict
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if type(None) in options:
            inner = [o for o in options if o is not type(None)]
            inner_check = _validator(inner[0] if len(inner) == 1 else Union[tuple(inner)])  # noqa: UP007

            def check_optional(v: Any, where: str) -> Any:
                return None if v is None else inner_check(v, where)

            return check_optional
        checks = [_validator(o) for o in options]

        def check_union(v: Any, where: str) -> Any:
            for check in checks:
                try:
                    return check(v, where)
                except ProtocolError:
                    continue
            raise ProtocolError(f"{where}: expected {tp}, got {_describe(v)}")

        return check_union
    raise TypeError(f"no wire validator for {tp!r}")


def _holds_struct(tp: Any) -> bool:
    if isinstance(tp, type) and issubclass(tp, Struct):
        return True
    return any(_holds_struct(arg) for arg in typing.get_args(tp))


S = TypeVar("S", bound=type[Struct])

KIND_TO_MESSAGE: dict[int, type[Message]] = {}


@dataclass_transform(frozen_default=True)
def wire(cls: S) -> S:
    """Make ``cls`` a frozen dataclass, give it field validators and register it if it is a Message."""
    dc = dataclass(frozen=True, slots=True)(cls)
    hints = typing.get_type_hints(dc)
    dc._validators = tuple((f.name, _validator(hints[f.name])) for f in fields(cast(Any, dc)))
    dc._nested = tuple((f.name, _holds_struct(hints[f.name])) for f in fields(cast(Any, dc)))
    if issubclass(dc, Message):
        other = KIND_TO_MESSAGE.setdefault(dc.KIND, dc)
        assert other is dc, f"message kind {dc.KIND} used by {other.__name__} and {dc.__name__}"
    return cast(S, dc)


# -- structs ---------------------------------------------------------------------


@wire
class Replica(Struct):
    """Where one copy of a block lives: a node's data-plane address, its tier and DRAM extent."""

    node_id: str
    address: str
    tier: Tier
    offset: int
    """Offset in the node's DRAM arena; -1 for an SSD replica (LMDB has no extents)."""
    size: int


@wire
class PutTicket(Struct):
    """The answer to one key of a put_start: where to write, or why not."""

    status: Literal["ok", "exists", "error"]
    replicas: list[Replica]
    error_code: int
    error: str


@wire
class InventoryItem(Struct):
    """One block a daemon holds, as it reports it when (re)registering."""

    key: str
    tier: Tier
    offset: int
    size: int
    checksum: int
    pinned: bool = False
    """Written with pin=True: never evicted, including by a master that rebuilt its table."""


# -- replies shared by many requests ----------------------------------------------


@wire
class ErrorReply(Message):
    KIND = 1
    code: int
    message: str

    def to_error(self) -> KVStoreError:
        return error_from_code(self.code, self.message)

    @classmethod
    def from_error(cls, exc: KVStoreError) -> ErrorReply:
        return cls(exc.code, str(exc))


@wire
class OkReply(Message):
    KIND = 2


# -- daemon -> master -------------------------------------------------------------------


@wire
class Nic(Struct):
    """One network interface of a host, as :mod:`transfer.topology` reads it."""

    name: str
    address: str
    speed_mbps: int
    """-1: the link reports no speed (loopback, veth)."""
    numa_node: int
    """-1: unknown or not a NUMA machine."""


@wire
class NodeInfo(Struct):
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


@wire
class RegisterNode(Message):
    KIND = 10
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
    """Blocks the DRAM arena can index (its slot table); 0: no limit but capacity."""


@wire
class RegisterReply(Message):
    KIND = 11
    heartbeat_interval_ms: int
    node_ttl_ms: int


@wire
class Heartbeat(Message):
    KIND = 12
    node_id: str
    transfer_bytes: dict[str, int]
    """Bytes the daemon moved since it started, by "transport|rail|direction" (for /metrics)."""


@wire
class HeartbeatReply(Message):
    KIND = 13
    known: bool
    """False when the master does not know the node (it restarted): the daemon re-registers."""


# -- client -> master -------------------------------------------------------------------


@wire
class PutStart(Message):
    KIND = 20
    keys: list[str]
    sizes: list[int]
    replicas: int
    preferred_node: str | None
    pin: bool


@wire
class PutStartReply(Message):
    """One ticket per key, flattened into parallel lists so that a batch decodes in a few list checks.

    Ticket ``i`` is ``statuses[i]``, ``error_codes[i]``, ``errors[i]`` and its
    ``counts[i]`` DRAM replicas, the next entries of ``nodes``/``addresses``/``offsets``.
    """

    KIND = 21
    statuses: list[str]
    error_codes: list[int]
    errors: list[str]
    counts: list[int]
    nodes: list[str]
    addresses: list[str]
    offsets: list[int]

    @classmethod
    def from_tickets(cls, tickets: Sequence[PutTicket]) -> PutStartReply:
        replicas = [r for t in tickets for r in t.replicas]
        return cls(
            [t.status for t in tickets], [t.error_code for t in tickets], [t.error for t in tickets],
            [len(t.replicas) for t in tickets], [r.node_id for r in replicas], [r.address for r in replicas],
            [r.offset for r in replicas],
        )  # fmt: skip

    def tickets(self) -> list[PutTicket]:
        """The tickets, checked for consistency (a ProtocolError names what does not add up)."""
        n = len(self.statuses)
        if not len(self.error_codes) == len(self.errors) == len(self.counts) == n:
            raise ProtocolError(f"PutStartReply: {n} statuses but other per-key lists of other lengths")
        _check_flat("PutStartReply", self.counts, self.nodes, self.addresses, self.offsets)
        out, at = [], 0
        for status, code, error, count in zip(self.statuses, self.error_codes, self.errors, self.counts, strict=True):
            if status not in ("ok", "exists", "error"):
                raise ProtocolError(f"PutStartReply: unknown status {status!r}")
            replicas = [
                Replica(self.nodes[j], self.addresses[j], "dram", self.offsets[j], 0) for j in range(at, at + count)
            ]
            at += count
            out.append(PutTicket(status, replicas, code, error))  # type: ignore[arg-type]
        return out


@wire
class PutEnd(Message):
    KIND = 22
    keys: list[str]
    checksums: list[int]


@wire
class PutEndReply(Message):
    KIND = 23
    committed: list[bool]


@wire
class PutRevoke(Message):
    KIND = 24
    keys: list[str]


@wire
class GetReplicas(Message):
    KIND = 30
    keys: list[str]
    release: list[str]
    """Keys whose earlier leases this client is done with (piggybacked, to save a round trip)."""
    lease: bool = True
    """Lease the replicas: needed by readers that touch memory without the daemon (shared memory,
    RDMA). A reader that reads through the daemon, which copies under its own lock, asks for none."""


@wire
class GetReplicasReply(Message):
    """Per key its size (-1: a miss) and checksum, and its ``counts[i]`` replicas, the next
    entries of ``nodes``/``addresses``/``tiers``/``offsets``: flat lists decode fast."""

    KIND = 31
    sizes: list[int]
    checksums: list[int]
    counts: list[int]
    nodes: list[str]
    addresses: list[str]
    tiers: list[str]
    offsets: list[int]
    lease_ms: int

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


@wire
class MatchPrefix(Message):
    KIND = 32
    keys: list[str]


@wire
class MatchPrefixReply(Message):
    KIND = 33
    matched: int


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


@wire
class MatchPrefixNodes(Message):
    """The longest stored prefix of ``keys``, and how much of it each node holds (a scheduler's question)."""

    KIND = 45
    keys: list[str]


@wire
class MatchPrefixNodesReply(Message):
    """A :class:`PrefixMatch` in parallel columns: node ``i`` is ``node_ids[i]``, ``dram[i]``, ``total[i]``."""

    KIND = 46
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


@wire
class Exists(Message):
    KIND = 34
    keys: list[str]


@wire
class ExistsReply(Message):
    KIND = 35
    exists: list[bool]


@wire
class Remove(Message):
    KIND = 36
    keys: list[str]


@wire
class RemoveReply(Message):
    KIND = 37
    removed: int


@wire
class Stats(Message):
    KIND = 38


@wire
class StatsReply(Message):
    KIND = 39
    stats: dict[str, int | float]


@wire
class ReleaseLeases(Message):
    KIND = 40
    keys: list[str]


@wire
class ListNodes(Message):
    KIND = 41


@wire
class AdminInfo(Message):
    """Where the master's REST admin API is (for tools given only the RPC address)."""

    KIND = 43


@wire
class AdminInfoReply(Message):
    KIND = 44
    address: str
    """host:port of the admin API; empty when the master serves none."""


@wire
class NodesReply(Message):
    KIND = 42
    nodes: list[NodeInfo]


@wire
class GrantSpace(Message):
    """Ask for DRAM space to write into without a master round trip per put: ``length`` bytes of one
    node's arena (``preferred_node`` when it has room), held for this client until the grant's
    ``ttl_ms`` passes or it is returned. Answered by a GrantReply."""

    KIND = 70
    length: int
    preferred_node: str | None


@wire
class GrantReply(Message):
    KIND = 71
    grant_id: int
    node_id: str
    address: str
    offset: int
    length: int
    ttl_ms: int
    """The grant ends this long after it was answered (the client stops using it a little before)."""


@wire
class ReturnGrants(Message):
    """Give granted space back early (its unused part returns to the pool)."""

    KIND = 72
    grant_ids: list[int]


@wire
class AccessReport(Message):
    """Blocks a daemon served by key since its last report (reads that asked the master nothing):
    the master counts the hits and keeps its LRU order."""

    KIND = 73
    node_id: str
    keys: list[str]


@wire
class CommitGranted(Message):
    """A daemon asks the master to commit blocks written into a grant: each key becomes a block at
    its extent, or is refused (it exists, or its extent is not free in the grant). Answered by a
    PutReply."""

    KIND = 74
    node_id: str
    grant_id: int
    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: bool


@wire
class PutReply(Message):
    """Per block of a one-trip put: 0 stored, 1 it existed (the stored bytes are kept), else the
    code of the error in :mod:`kvstore.errors` that refused it."""

    KIND = 75
    codes: list[int]
    errors: list[str]


@wire
class Replicate(Message):
    """Copy stored blocks into the DRAM of ``node_id`` and keep their other replicas (hot blocks near
    their readers). Keys are taken in order while they fit the node's free DRAM (nothing is evicted
    for them) and ``max_bytes``; keys not stored or already on the node are skipped."""

    KIND = 47
    keys: list[str]
    node_id: str
    max_bytes: int


@wire
class ReplicateReply(Message):
    KIND = 48
    copied: int
    """Blocks that gained a replica on the node."""
    bytes: int
    """Their bytes."""


class Replicated(NamedTuple):
    """What a replicate did: blocks that gained a replica on the node, and their bytes."""

    copied: int
    bytes: int


# -- master -> daemon ---------------------------------------------------------------------


@wire
class DemoteBlocks(Message):
    """Move blocks from the DRAM arena to the SSD tier, freeing their extents."""

    KIND = 50
    keys: list[str]


@wire
class DropBlocks(Message):
    KIND = 51
    keys: list[str]


@wire
class PromoteBlocks(Message):
    """Move SSD blocks into the DRAM arena at the given offsets."""

    KIND = 52
    keys: list[str]
    offsets: list[int]


@wire
class FetchBlocks(Message):
    """Copy blocks from another daemon (a drain): read them by key from ``source`` into the given
    reserved DRAM extents here, check their checksums and commit them. Answered by a CommandReply."""

    KIND = 54
    source: str
    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]


@wire
class OpenGrant(Message):
    """Space of this daemon's arena the master granted a client: writes into it (WriteGranted) are
    taken until the grant ends, at the latest ``ttl_ms`` after this command arrived."""

    KIND = 55
    grant_id: int
    offset: int
    length: int
    ttl_ms: int


@wire
class EndGrants(Message):
    """Take no more writes into these grants and cut those in flight; answered once none can land."""

    KIND = 56
    grant_ids: list[int]


@wire
class CommandReply(Message):
    KIND = 53
    done: list[bool]


# -- client -> daemon (data plane: the frame is followed by the blocks' bytes) ----------------


@wire
class WriteBlocks(Message):
    """Write blocks into reserved DRAM extents; their bytes follow the frame, concatenated in order."""

    KIND = 60
    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: bool
    """The batch was put with pin=True; the daemon records it so that pins survive a master restart."""


@wire
class WriteGranted(Message):
    """A put in one trip: write blocks into extents of a grant; the daemon checks them, has the
    master commit them, commits them here and answers with a PutReply. Bytes follow as in WriteBlocks."""

    KIND = 67
    grant_id: int
    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: bool


@wire
class WriteSlices(Message):
    """Write byte ranges of blocks into their reserved extents (the slices of large blocks, sprayed over rails).

    Each block is reserved by its first slice to arrive, on whichever rail; its bytes follow the
    frame, slice after slice. Answered by a WriteReply per slice; the blocks stay invisible until a
    CommitBlocks names them."""

    KIND = 66
    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    starts: list[int]
    lengths: list[int]


@wire
class CommitBlocks(Message):
    """Commit blocks whose bytes are already in their reserved DRAM extents: copied there by a
    same-host client, or written by WriteSlices.

    Nothing follows the frame; the daemon checks each block's checksum in place."""

    KIND = 64
    keys: list[str]
    offsets: list[int]
    sizes: list[int]
    checksums: list[int]
    pinned: bool


@wire
class WriteReply(Message):
    KIND = 61
    codes: list[int]
    """0 for a block stored, else the code of the error in :mod:`kvstore.errors`."""
    errors: list[str]

    @classmethod
    def from_outcomes(cls, outcomes: Sequence[KVStoreError | None]) -> WriteReply:
        """Per block None (stored) or the error that refused it."""
        return cls([0 if e is None else e.code for e in outcomes], ["" if e is None else str(e) for e in outcomes])


@wire
class ReadBlocks(Message):
    KIND = 62
    keys: list[str]
    tiers: list[str]
    """Where the master last saw each block; a daemon reads by key, so these are hints."""
    offsets: list[int]
    sizes: list[int]


@wire
class ReadSlices(Message):
    """Read byte ranges of blocks (one slice of a large block per entry, for spraying over several rails).

    Answered by a ReadReply: per slice the bytes sent, -1 when the block is not held or the
    range does not lie inside it."""

    KIND = 65
    keys: list[str]
    starts: list[int]
    lengths: list[int]


@wire
class ReadReply(Message):
    """Sizes of the blocks read (-1: not held) and their checksums (0 for those not held); the bytes
    of those held follow the frame, in order."""

    KIND = 63
    sizes: list[int]
    checksums: list[int]


# -- framing ------------------------------------------------------------------------------


def encode(message: Message, request_id: int) -> bytes:
    """One whole frame for ``message``."""
    payload = msgpack.packb([PROTOCOL_VERSION, message.KIND, request_id, message.to_wire()], use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise ProtocolError(f"{type(message).__name__} frame of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    return FRAME_HEADER.pack(len(payload)) + payload


def decode_payload(payload: bytes) -> tuple[int, Message]:
    """(request_id, message) of one frame's payload."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"payload is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(raw, list) or len(raw) != 4:
        raise ProtocolError(f"payload must be [version, kind, request_id, fields], got {_describe(raw)}")
    version, kind, request_id, body = raw
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})")
    if type(request_id) is not int:
        raise ProtocolError(f"request id must be an int, got {_describe(request_id)}")
    cls = KIND_TO_MESSAGE.get(kind) if type(kind) is int else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    return request_id, cls.from_wire(body)


def request_id_of(payload: bytes) -> int:
    """Best-effort request id of a payload that failed to decode (0 when none can be read), for the error reply."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        return raw[2] if isinstance(raw, list) and len(raw) > 2 and type(raw[2]) is int else 0
    except Exception:
        return 0


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
