"""Every message round-trips; every malformed payload is a ProtocolError and nothing else."""

from __future__ import annotations

import contextlib
import types
import typing
from typing import Any, Literal, Union

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore import protocol as P
from kvstore.errors import NotFound, ProtocolError

INT = st.integers(-(2**63), 2**64 - 1)


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:
    origin = typing.get_origin(tp)
    if tp is int:
        return INT
    if tp is float:
        return st.floats(allow_nan=False)
    if tp is str:
        return st.text(max_size=20)
    if tp is bytes:
        return st.binary(max_size=20)
    if tp is bool:
        return st.booleans()
    if origin is Literal:
        return st.sampled_from(typing.get_args(tp))
    if origin is list:
        return st.lists(strategy_for(typing.get_args(tp)[0]), max_size=4)
    if origin is dict:
        k, v = typing.get_args(tp)
        return st.dictionaries(strategy_for(k), strategy_for(v), max_size=3)
    if origin in (Union, types.UnionType):
        return st.one_of(*(st.none() if o is type(None) else strategy_for(o) for o in typing.get_args(tp)))
    if isinstance(tp, type) and issubclass(tp, P.Struct):
        hints = typing.get_type_hints(tp)
        return st.builds(tp, *(strategy_for(hints[name]) for name, _ in tp._validators))
    raise TypeError(tp)


ALL_MESSAGES = sorted(P.KIND_TO_MESSAGE.values(), key=lambda c: c.KIND)


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
@given(data=st.data(), request_id=st.integers(0, 2**63 - 1))
def test_every_message_round_trips(cls: type[P.Message], data: st.DataObject, request_id: int) -> None:
    message = data.draw(strategy_for(cls))
    frame = P.encode(message, request_id)
    decoder = P.FrameDecoder()
    payloads = list(decoder.feed(frame))
    assert len(payloads) == 1 and decoder.pending == 0
    assert P.decode_payload(payloads[0]) == (request_id, message)


def test_every_operation_has_its_own_kind() -> None:
    assert len({c.KIND for c in ALL_MESSAGES}) == len(ALL_MESSAGES) >= 25


def test_error_reply_carries_the_typed_error() -> None:
    reply = P.ErrorReply.from_error(NotFound("key 'x' is not stored"))
    _, decoded = P.decode_payload(P.encode(reply, 3)[4:])
    assert isinstance(decoded, P.ErrorReply)
    err = decoded.to_error()
    assert type(err) is NotFound and str(err) == "key 'x' is not stored"


def test_decoder_reassembles_frames_split_anywhere() -> None:
    frames = b"".join(P.encode(P.Exists([f"k{i}"]), i) for i in range(5))
    decoder = P.FrameDecoder()
    got = []
    for i in range(0, len(frames), 3):
        got += [P.decode_payload(p) for p in decoder.feed(frames[i : i + 3])]
    assert [rid for rid, _ in got] == list(range(5))
    assert decoder.pending == 0


def test_oversize_frames_are_refused_before_buffering() -> None:
    decoder = P.FrameDecoder(max_frame=1024)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        list(decoder.feed(P.FRAME_HEADER.pack(1025) + b"x" * 10))


def test_truncated_frames_wait_for_more_bytes() -> None:
    frame = P.encode(P.Stats(), 1)
    decoder = P.FrameDecoder()
    assert list(decoder.feed(frame[:-1])) == []
    assert decoder.pending == len(frame) - 1
    assert len(list(decoder.feed(frame[-1:]))) == 1


def raw(*items: Any) -> bytes:
    return bytes(msgpack.packb(list(items), use_bin_type=True))


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\xc1", "not valid msgpack"),
        (b"", "not valid msgpack"),
        (raw(P.PROTOCOL_VERSION, 2), "version, kind"),
        (raw(99, P.Stats.KIND, 1, []), "version 99"),
        (raw(P.PROTOCOL_VERSION, 9999, 1, []), "unknown message kind"),
        (raw(P.PROTOCOL_VERSION, "20", 1, []), "unknown message kind"),
        (raw(P.PROTOCOL_VERSION, P.Stats.KIND, "x", []), "request id"),
        (raw(P.PROTOCOL_VERSION, P.Exists.KIND, 1, [["a", 2]]), r"Exists.keys\[1\]: expected str"),
        (raw(P.PROTOCOL_VERSION, P.Exists.KIND, 1, ["a"]), "expected a list"),
        (raw(P.PROTOCOL_VERSION, P.Exists.KIND, 1, [["a"], "extra"]), "expected 1 fields"),
        (raw(P.PROTOCOL_VERSION, P.PutStart.KIND, 1, [["a"], [True], 1, None, False]), "expected int"),
        (raw(P.PROTOCOL_VERSION, P.PutStart.KIND, 1, [["a"], [1], 1, 5, False]), "preferred_node: expected str"),
        (
            raw(
                P.PROTOCOL_VERSION,
                P.RegisterNode.KIND,
                1,
                ["n", "a", 1, 1, 64, [["k", "tape", 0, 1, 2, False]], ["a"], "h", "p", 1, [], False, "", 0],
            ),
            "expected one of",
        ),
        (raw(P.PROTOCOL_VERSION, P.StatsReply.KIND, 1, [{"a": "b"}]), "StatsReply.stats"),
        (raw(P.PROTOCOL_VERSION, P.Replicate.KIND, 1, [["a"], "n", "1"]), "Replicate.max_bytes: expected int"),
        (raw(P.PROTOCOL_VERSION, P.MatchPrefixNodesReply.KIND, 1, [1, "n", [1], [1]]), "node_ids: expected a list"),
    ],
)
def test_malformed_payloads_are_protocol_errors(payload: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        P.decode_payload(payload)


@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_protocol_error(payload: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        P.decode_payload(payload)


@given(st.recursive(st.none() | st.booleans() | INT | st.text(max_size=5), lambda c: st.lists(c, max_size=4)))
def test_random_msgpack_bodies_never_raise_anything_but_protocol_error(body: Any) -> None:
    for kind in P.KIND_TO_MESSAGE:
        with contextlib.suppress(ProtocolError):
            P.decode_payload(raw(P.PROTOCOL_VERSION, kind, 1, body))


def test_request_id_of_a_bad_payload() -> None:
    assert P.request_id_of(raw(P.PROTOCOL_VERSION, 9999, 42, [])) == 42
    assert P.request_id_of(b"\xc1") == 0


def test_prefix_match_travels_as_parallel_columns() -> None:
    match = P.PrefixMatch(5, {"a": P.NodePrefix(dram=2, total=4), "b": P.NodePrefix(dram=0, total=5)})
    reply = P.MatchPrefixNodesReply.from_match(match)
    assert (reply.node_ids, reply.dram, reply.total) == (["a", "b"], [2, 0], [4, 5])
    _, decoded = P.decode_payload(P.encode(reply, 1)[4:])
    assert isinstance(decoded, P.MatchPrefixNodesReply) and decoded.prefix_match(7) == match
    assert P.MatchPrefixNodesReply.from_match(P.PrefixMatch(0, {})).prefix_match(0) == P.PrefixMatch(0, {})


@pytest.mark.parametrize(
    ("reply", "num_keys", "match"),
    [
        (P.MatchPrefixNodesReply(3, ["a", "b"], [1], [1, 2]), 3, "2 node ids but 1 dram and 2 total"),
        (P.MatchPrefixNodesReply(3, ["a"], [1], [1, 2]), 3, "1 node ids but 1 dram and 2 total"),
        (P.MatchPrefixNodesReply(4, [], [], []), 3, "a prefix of 4 keys for 3 keys"),
        (P.MatchPrefixNodesReply(-1, [], [], []), 3, "a prefix of -1 keys"),
        (P.MatchPrefixNodesReply(3, ["a"], [2], [1]), 3, "node 'a' holds 2 in DRAM and 1"),
        (P.MatchPrefixNodesReply(2, ["a"], [0], [3]), 3, "node 'a' holds 0 in DRAM and 3 in all of a prefix of 2"),
        (P.MatchPrefixNodesReply(2, ["a"], [0], [0]), 3, "node 'a' holds 0 in DRAM and 0"),
        (P.MatchPrefixNodesReply(2, ["a"], [-1], [1]), 3, "node 'a' holds -1"),
        (P.MatchPrefixNodesReply(2, ["a", "a"], [1, 1], [1, 1]), 3, "node 'a' is listed twice"),
    ],
)
def test_inconsistent_prefix_match_replies_are_protocol_errors(
    reply: P.MatchPrefixNodesReply, num_keys: int, match: str
) -> None:
    with pytest.raises(ProtocolError, match=match):
        reply.prefix_match(num_keys)
