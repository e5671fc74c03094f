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

Import every name from here (``from kvstore.protocol import PutStart``); the
modules are where each part lives:

- :mod:`~kvstore.protocol.framing`: the frame header, the version, :class:`FrameDecoder`
- :mod:`~kvstore.protocol.codec`: :func:`encode`, :func:`decode_payload`, :data:`KIND_TO_MESSAGE`, diagnoses
- :mod:`~kvstore.protocol.base`: :class:`Struct`, :class:`Message`, shared structs, ErrorReply and OkReply
- :mod:`~kvstore.protocol.membership`: daemon -> master: register, heartbeat, access reports, leave
- :mod:`~kvstore.protocol.put_get`: client -> master: two-trip puts, gets, leases, removal
- :mod:`~kvstore.protocol.queries`: client -> master: prefix, exists, key listings, stats, nodes, admin
- :mod:`~kvstore.protocol.scheduling`: a scheduler's prefix-by-node matches and replicates
- :mod:`~kvstore.protocol.grants`: one-trip puts into granted space (client, master and daemon)
- :mod:`~kvstore.protocol.commands`: master -> daemon: demote, drop, promote, fetch
- :mod:`~kvstore.protocol.dataplane`: client -> daemon: block writes and reads, bytes after the frame
- :mod:`~kvstore.protocol.handshake`: authentication frames and tenants' tickets
"""

from __future__ import annotations

from kvstore.protocol.base import ErrorReply, InventoryItem, Message, OkReply, PutTicket, Replica, Struct, Tier
from kvstore.protocol.codec import KIND_TO_MESSAGE, decode_payload, encode, request_id_of
from kvstore.protocol.commands import CommandReply, DemoteBlocks, DropBlocks, FetchBlocks, PromoteBlocks
from kvstore.protocol.dataplane import (
    CommitBlocks,
    ReadBlocks,
    ReadReply,
    ReadSlices,
    WriteBlocks,
    WriteReply,
    WriteSlices,
)
from kvstore.protocol.framing import FRAME_HEADER, MAX_FRAME_BYTES, PROTOCOL_VERSION, FrameDecoder
from kvstore.protocol.grants import (
    PUT_EXISTS,
    PUT_STORED,
    CommitGranted,
    EndGrants,
    FlushCommits,
    GrantReply,
    GrantSpace,
    OpenGrant,
    PutReply,
    ReturnGrants,
    WriteGranted,
)
from kvstore.protocol.handshake import (
    AuthChallenge,
    AuthHello,
    AuthOk,
    AuthProof,
    GetTicket,
    TenantsPolicy,
    TicketReply,
)
from kvstore.protocol.limits import MAX_BATCH_KEYS, check_batch, check_frame, too_many
from kvstore.protocol.membership import (
    AccessReport,
    CheckBlocks,
    CheckBlocksReply,
    Heartbeat,
    HeartbeatReply,
    LeaveNode,
    MasterHello,
    Nic,
    NodeInfo,
    RegisterNode,
    RegisterReply,
    ReportNode,
)
from kvstore.protocol.put_get import (
    ClearReplicas,
    ClearReplicasReply,
    GetReplicas,
    GetReplicasReply,
    LabelBlocks,
    LocatedRef,
    PutEnd,
    PutEndReply,
    PutRevoke,
    PutStart,
    PutStartReply,
    ReleaseLeases,
    Remove,
    RemoveReply,
    ReplicaRef,
)
from kvstore.protocol.queries import (
    AdminInfo,
    AdminInfoReply,
    Exists,
    ExistsReply,
    KeysReply,
    ListKeys,
    ListNodes,
    MatchPrefix,
    MatchPrefixReply,
    NodesReply,
    Stats,
    StatsReply,
)
from kvstore.protocol.scheduling import (
    MatchPrefixNodes,
    MatchPrefixNodesReply,
    NodePrefix,
    PrefixMatch,
    Replicate,
    Replicated,
    ReplicateReply,
)

__all__ = [
    "FRAME_HEADER",
    "KIND_TO_MESSAGE",
    "MAX_BATCH_KEYS",
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "PUT_EXISTS",
    "PUT_STORED",
    "AccessReport",
    "AdminInfo",
    "AdminInfoReply",
    "AuthChallenge",
    "AuthHello",
    "AuthOk",
    "AuthProof",
    "CheckBlocks",
    "CheckBlocksReply",
    "ClearReplicas",
    "ClearReplicasReply",
    "CommandReply",
    "CommitBlocks",
    "CommitGranted",
    "DemoteBlocks",
    "DropBlocks",
    "EndGrants",
    "ErrorReply",
    "Exists",
    "ExistsReply",
    "FetchBlocks",
    "FlushCommits",
    "FrameDecoder",
    "GetReplicas",
    "GetReplicasReply",
    "GetTicket",
    "GrantReply",
    "GrantSpace",
    "Heartbeat",
    "HeartbeatReply",
    "InventoryItem",
    "KeysReply",
    "LabelBlocks",
    "LeaveNode",
    "ListKeys",
    "ListNodes",
    "LocatedRef",
    "MasterHello",
    "MatchPrefix",
    "MatchPrefixNodes",
    "MatchPrefixNodesReply",
    "MatchPrefixReply",
    "Message",
    "Nic",
    "NodeInfo",
    "NodePrefix",
    "NodesReply",
    "OkReply",
    "OpenGrant",
    "PrefixMatch",
    "PromoteBlocks",
    "PutEnd",
    "PutEndReply",
    "PutReply",
    "PutRevoke",
    "PutStart",
    "PutStartReply",
    "PutTicket",
    "ReadBlocks",
    "ReadReply",
    "ReadSlices",
    "RegisterNode",
    "RegisterReply",
    "ReleaseLeases",
    "Remove",
    "RemoveReply",
    "Replica",
    "ReplicaRef",
    "Replicate",
    "ReplicateReply",
    "Replicated",
    "ReportNode",
    "ReturnGrants",
    "Stats",
    "StatsReply",
    "Struct",
    "TenantsPolicy",
    "TicketReply",
    "Tier",
    "WriteBlocks",
    "WriteGranted",
    "WriteReply",
    "WriteSlices",
    "check_batch",
    "check_frame",
    "decode_payload",
    "encode",
    "request_id_of",
    "too_many",
]
