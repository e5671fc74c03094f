"""Payloads <-> messages: :func:`encode` a whole frame, :func:`decode_payload` one, strictly, typed by msgspec.

msgspec checks every field's type in C while it decodes (strictly: a bool or a
float is not an int). Anything malformed — a payload that is not msgpack, an
unknown version or kind, a field of the wrong type, too many or too few fields —
raises :class:`kvstore.errors.ProtocolError` naming what was wrong
(``Exists.keys[1]: expected `str`, got `int```), never another exception. The
one leniency is msgspec's: a trailing field that has a default
(``GetReplicas.lease``, ``InventoryItem.pinned``) may be left out.

The decoder reads the union of every subclass of :class:`Message`: this module
imports every module that defines messages before it builds it.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal, Union

import msgspec

from kvstore.errors import ProtocolError

# Every module of messages, imported for its classes: the decoder below is built from Message's subclasses.
from kvstore.protocol import commands, dataplane, grants, handshake, membership, put_get, queries, scheduling  # noqa: F401
from kvstore.protocol.base import Message, Struct
from kvstore.protocol.framing import FRAME_HEADER, MAX_FRAME_BYTES, PROTOCOL_VERSION


def _register() -> dict[int, type[Message]]:
    kinds: dict[int, type[Message]] = {}
    for cls in Message.__subclasses__():
        kind = cls.__struct_config__.tag
        assert type(kind) is int, f"{cls.__name__} declares no int tag (its kind)"
        other = kinds.setdefault(kind, cls)
        assert other is cls, f"message kind {kind} used by {other.__name__} and {cls.__name__}"
        cls.KIND = kind
    return dict(sorted(kinds.items()))  # by kind: the order seeded fuzzing draws from, whatever the file layout


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
