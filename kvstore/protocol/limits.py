"""What one client request may ask of the master at most.

The master answers a batch in one turn of its event loop (the placement table is synchronous), and
every other client waits for that turn to end: a 200,000-key put once held all of them for 2.3 s.
So a client request names at most :data:`MAX_BATCH_KEYS` keys (or lease ids); a larger one is
refused with an :class:`~kvstore.errors.InvalidArgument` that names the limit, before any work.
The client splits larger batches itself. Messages between the master and its daemons (inventories,
commits of granted blocks, access reports) are the servers' own and not limited here.
"""

from __future__ import annotations

from kvstore.errors import InvalidArgument
from kvstore.protocol.base import Message
from kvstore.protocol.put_get import GetReplicas, PutEnd, PutRevoke, PutStart, ReleaseLeases, Remove
from kvstore.protocol.queries import Exists, MatchPrefix
from kvstore.protocol.scheduling import MatchPrefixNodes, Replicate

MAX_BATCH_KEYS = 4096
"""The most keys (or lease ids) one client request to the master may name: about 40 ms of the
master's work at ~10 us a key, the most one request may hold every other client for."""

_BATCH_FIELDS: dict[type[Message], tuple[str, ...]] = {
    PutStart: ("keys",),
    PutEnd: ("keys",),
    PutRevoke: ("keys",),
    GetReplicas: ("keys", "release"),
    ReleaseLeases: ("lease_ids",),
    Remove: ("keys",),
    Exists: ("keys",),
    MatchPrefix: ("keys",),
    MatchPrefixNodes: ("keys",),
    Replicate: ("keys",),
}


_FIRST_FIELD: dict[int, tuple[str, str]] = {
    cls.KIND: (cls.__name__, fields[0])
    for cls, fields in _BATCH_FIELDS.items()
    if cls.__struct_fields__[0] == fields[0]
}
"""Kinds whose first field is a batch: their length is read from the frame before it is decoded."""


def check_frame(payload: bytes) -> tuple[int, InvalidArgument] | None:
    """(request id, the refusal) for a payload whose message names more than :data:`MAX_BATCH_KEYS`
    keys in its first field, read from msgpack's array headers without decoding the rest (decoding
    500,000 keys alone held the master's loop for a tenth of a second); None otherwise, or when the
    payload is not a plain request (the decoder then says what is wrong with it)."""
    try:
        outer, i = _array(payload, 0)  # [version, request id, [kind, fields...]], in any encoding msgpack has
        if outer != 3:
            return None
        _, i = _int(payload, i)
        request_id, i = _int(payload, i)
        fields, i = _array(payload, i)
        kind, i = _int(payload, i)
        named = _FIRST_FIELD.get(kind)
        if named is None or fields < 2:
            return None
        n, _ = _array(payload, i)
    except (IndexError, ValueError):
        return None
    if n <= MAX_BATCH_KEYS:
        return None
    return request_id, too_many(named[0], named[1], n)


_INT_WIDTHS = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False),
               0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)}  # fmt: skip


def _int(b: bytes, i: int) -> tuple[int, int]:
    """The msgpack integer at ``b[i]`` in any of its encodings, and where the next item starts."""
    first = b[i]
    if first <= 0x7F:
        return first, i + 1
    if first >= 0xE0:  # negative fixint
        return first - 0x100, i + 1
    width, signed = _INT_WIDTHS.get(first, (0, False))
    if not width:
        raise ValueError("not an int")
    if i + 1 + width > len(b):
        raise IndexError("cut short")
    return int.from_bytes(b[i + 1 : i + 1 + width], "big", signed=signed), i + 1 + width


def _array(b: bytes, i: int) -> tuple[int, int]:
    first = b[i]
    if 0x90 <= first <= 0x9F:
        return first & 0x0F, i + 1
    width = {0xDC: 2, 0xDD: 4}.get(first)
    if width is None:
        raise ValueError("not an array")
    if i + 1 + width > len(b):
        raise IndexError("cut short")
    return int.from_bytes(b[i + 1 : i + 1 + width], "big"), i + 1 + width


def too_many(kind: str, field: str, n: int) -> InvalidArgument:
    """The refusal of a request whose ``kind.field`` names ``n`` items, over :data:`MAX_BATCH_KEYS`."""
    return InvalidArgument(
        f"{kind}.{field} names {n} items; a request takes at most {MAX_BATCH_KEYS} (split the batch)"
    )


def check_batch(message: Message) -> None:
    """Raise InvalidArgument when a client request names more than :data:`MAX_BATCH_KEYS` items."""
    for field in _BATCH_FIELDS.get(type(message), ()):
        n = len(getattr(message, field))
        if n > MAX_BATCH_KEYS:
            raise too_many(type(message).__name__, field, n)
