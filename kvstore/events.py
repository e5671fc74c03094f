"""KV events: what the store holds, told the way routers read engines' caches.

The wire format is vLLM's (``vllm/distributed/kv_events.py``), which Dynamo's KV router, llm-d's
and vLLM's production-stack read: each message is three ZMQ frames, ``[topic, 8-byte big-endian
sequence, msgpack EventBatch]``; an :class:`EventBatch` is the array ``[ts, [events], dp_rank]``
and each event a map tagged by its ``"type"``: ``BlockStored``, ``BlockRemoved`` or
``AllBlocksCleared``. Beside vLLM's fields each event carries Mooncake's master's (its
``kv_event_publisher``): ``medium`` (``"cpu"`` for a DRAM replica, ``"disk"`` for an SSD one),
``backend_id`` (the node that holds the replica) and ``object_key`` (the store's key), and
``tenant_id`` where the key is a tenant's. Decoders that know only vLLM's fields skip the others
(msgspec and msgpack maps do).

One event is one key's replica on one node and tier: a key with two replicas is stored twice,
once per ``backend_id``; a demotion is a ``BlockRemoved`` on ``cpu`` and a ``BlockStored`` on
``disk`` of the same node. ``block_hashes`` holds one hash: the engine's block hash when the put
labelled the key with it (:class:`EngineBlock`), else the key's own (:func:`key_hash`).
``token_ids`` and ``block_size`` are the engine's when labelled, else ``[]`` and ``0`` (the store
holds bytes, not tokens). ``AllBlocksCleared`` with no ``backend_id`` says "forget every block
this store told of": a new leader's first event, before the daemons' inventories are told anew.

Pure: no sockets here; the master's publisher (``server/master/events.py``) sends what
:func:`encode_batch` makes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

from kvstore.errors import InvalidArgument

MEDIUM_DRAM = "cpu"
MEDIUM_SSD = "disk"
MEDIA = (MEDIUM_DRAM, MEDIUM_SSD)
"""Tier code (0 DRAM, 1 SSD, as the placement table stores it) -> Mooncake's ``medium``."""

BlockHash = bytes | int
"""vLLM's ``ExternalBlockHash``: bytes, or an int of at most 64 bits."""


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """One change; a map tagged ``"type"`` (vLLM's ``KVCacheEvent``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    """vLLM's: what besides the tokens went into each block's hash (a LoRA, a salt, images)."""
    backend_id: str | None = None
    object_key: str | None = None
    tenant_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    backend_id: str | None = None
    object_key: str | None = None
    tenant_id: str | None = None


class AllBlocksCleared(KVCacheEvent):
    backend_id: str | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``[ts, events, data_parallel_rank]`` (vLLM's ``KVEventBatch``)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class EngineBlock(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What an engine calls a block the store holds under some key: its hash (vLLM's block hash,
    as its own KV events give it), its parent's, its tokens and its block size. A put may label
    its keys with these, so that the store's events name blocks as the engine's events do."""

    block_hash: BlockHash
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EventBatch)
_HEX_TAIL = re.compile(r"(?:^|/)([0-9a-f]{32})$")
_UINT = re.compile(r"(?:0[xX][0-9a-fA-F]{1,16}|[0-9]{1,20})")
_U64 = (1 << 64) - 1
MAX_LABEL_TOKENS = 16_384
"""Most tokens a label may carry (an engine's block is 16 to a few hundred)."""
MAX_HASH_BYTES = 64


def check_label(label: EngineBlock, what: str) -> None:
    """Raise :class:`InvalidArgument` naming what is wrong with ``label``: hashes of bytes longer
    than 64, or ints outside 0 .. 2**64 - 1; more than :data:`MAX_LABEL_TOKENS` tokens; a
    negative block size."""
    for name, value in (("block_hash", label.block_hash), ("parent_block_hash", label.parent_block_hash)):
        if isinstance(value, bytes) and len(value) > MAX_HASH_BYTES:
            raise InvalidArgument(f"{what}.{name} is {len(value)} bytes; at most {MAX_HASH_BYTES}")
        if isinstance(value, int) and not 0 <= value <= _U64:
            raise InvalidArgument(f"{what}.{name} is {value}; an int hash is from 0 to 2**64 - 1")
    if len(label.token_ids) > MAX_LABEL_TOKENS:
        raise InvalidArgument(f"{what} has {len(label.token_ids)} tokens; at most {MAX_LABEL_TOKENS}")
    if label.block_size < 0:
        raise InvalidArgument(f"{what}.block_size is {label.block_size}; it cannot be negative")


def key_hash(key: str) -> BlockHash:
    """The block hash the store's events give a key no engine labelled: a key made by
    :func:`kvstore.keys.block_keys` (``namespace/`` and 32 hex digits) gives its 16 bytes; a
    number of at most 64 bits (``"12345"``, ``"0x2a"``, as Mooncake's master parses keys) the
    number; any other key the 16 bytes of xxh3-128 of its UTF-8."""
    m = _HEX_TAIL.search(key)
    if m is not None:
        return bytes.fromhex(m.group(1))
    if _UINT.fullmatch(key):
        value = int(key, 0) if key[:2] in ("0x", "0X") else int(key)
        if value <= _U64:
            return value
    return xxhash.xxh3_128_digest(key.encode())


def stored(key: str, node: str, medium: str, tenant: str | None, label: EngineBlock | None) -> BlockStored:
    if label is None:
        return BlockStored([key_hash(key)], None, [], 0, None, medium, None,
                           backend_id=node, object_key=key, tenant_id=tenant)  # fmt: skip
    return BlockStored(
        [label.block_hash], label.parent_block_hash, list(label.token_ids), label.block_size, None, medium, None,
        backend_id=node, object_key=key, tenant_id=tenant,
    )  # fmt: skip


def removed(key: str, node: str, medium: str, tenant: str | None, label: EngineBlock | None) -> BlockRemoved:
    block_hash = label.block_hash if label is not None else key_hash(key)
    return BlockRemoved([block_hash], medium, backend_id=node, object_key=key, tenant_id=tenant)


def encode_batch(ts: float, events: Sequence[Event]) -> bytes:
    """The msgpack of one batch (the third frame of a message)."""
    return _ENCODER.encode(EventBatch(ts, list(events)))


def decode_batch(payload: bytes) -> EventBatch:
    """A batch back from its msgpack; raises ``msgspec.DecodeError`` or ``ValidationError``."""
    return _DECODER.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)


END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of a replay's last reply (vLLM's ``END_SEQ``)."""
