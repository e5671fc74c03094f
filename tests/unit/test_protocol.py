"""Every message round-trips; every malformed payload is a ProtocolError and nothing else."""

from __future__ import annotations

import contextlib
import types
import typing
from typing import Any, Literal, Union

import msgpack
import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvstore import protocol as P
from kvstore.errors import InvalidArgument, NotFound, ProtocolError

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
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return st.builds(tp, *(strategy_for(f.type) for f in msgspec.structs.fields(tp)))
    raise TypeError(tp)


def raw(*items: Any) -> bytes:
    return bytes(msgpack.packb(list(items), use_bin_type=True))


def body(kind: int, *fields: Any) -> bytes:
    """A payload of this version for ``kind`` with the given (possibly wrong) fields."""
    return raw(P.PROTOCOL_VERSION, 1, [kind, *fields])


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
    assert all(c.__struct_config__.tag == c.KIND and P.KIND_TO_MESSAGE[c.KIND] is c for c in ALL_MESSAGES)


def test_the_frame_layout_is_version_request_id_then_kind_and_fields() -> None:
    frame = P.encode(P.GetReplicas(["a", "b"], [3]), 7)
    assert P.FRAME_HEADER.unpack_from(frame) == (len(frame) - 4,)
    assert msgpack.unpackb(frame[4:]) == [P.PROTOCOL_VERSION, 7, [P.GetReplicas.KIND, ["a", "b"], [3], True, False]]


def test_defaults_positional_construction_and_frozen_fields() -> None:
    assert P.GetReplicas(["a"], []).lease is True
    assert P.InventoryItem("k", "dram", 0, 1, 2).pinned is False
    info = P.Nic("eth0", "10.0.0.1", -1, -1)
    with pytest.raises(AttributeError):
        info.speed_mbps = 10  # type: ignore[misc]
    assert msgspec.structs.replace(info, speed_mbps=10) == P.Nic("eth0", "10.0.0.1", 10, -1)
    assert hash(info) == hash(P.Nic("eth0", "10.0.0.1", -1, -1))


def test_a_trailing_field_with_a_default_may_be_left_out_and_no_other() -> None:
    """msgspec's one leniency: the defaulted trailing fields of GetReplicas and InventoryItem."""
    assert P.decode_payload(raw(P.PROTOCOL_VERSION, 1, [P.GetReplicas.KIND, ["a"], []]))[1] == P.GetReplicas(
        ["a"], [], True
    )
    with pytest.raises(ProtocolError, match="GetReplicas: expected 2 to 4 fields, got 1"):
        P.decode_payload(raw(P.PROTOCOL_VERSION, 1, [P.GetReplicas.KIND, ["a"]]))


def test_a_fetch_from_a_master_that_sends_no_pins_pins_nothing() -> None:
    old = [P.FetchBlocks.KIND, "a:1", ["k"], [0], [10], [7]]
    assert P.decode_payload(raw(P.PROTOCOL_VERSION, 1, old))[1] == P.FetchBlocks("a:1", ["k"], [0], [10], [7], [])


def test_a_drop_from_a_master_that_names_no_tier_drops_from_either() -> None:
    assert P.decode_payload(raw(P.PROTOCOL_VERSION, 1, [P.DropBlocks.KIND, ["k"]]))[1] == P.DropBlocks(["k"], "", [])


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


INVENTORY_ITEM = ["k", "dram", 0, 1, 2, False]


def register_node(inventory: list[Any], nics: list[Any]) -> bytes:
    return body(P.RegisterNode.KIND, "n", "a", 1, 1, 64, inventory, ["a"], "h", "p", 1, nics, False, "", 0, [])


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\xc1", "not valid msgpack"),
        (b"", "not valid msgpack"),
        (body(P.Stats.KIND) + b"\x00", "not valid msgpack: .*trailing"),
        (raw(P.PROTOCOL_VERSION, 2), r"must be \[version, request_id, \[kind"),
        (raw(99, 1, [P.Stats.KIND]), "version 99 is not supported"),
        (raw(2, P.Stats.KIND, 1, []), "version 2 is not supported"),  # a frame of the previous version
        (raw(3.0, 1, [P.Stats.KIND]), "version 3.0 is not supported"),
        (raw(P.PROTOCOL_VERSION, 1, [9999]), "unknown message kind"),
        (raw(P.PROTOCOL_VERSION, 1, ["20"]), "unknown message kind"),
        (raw(P.PROTOCOL_VERSION, 1, [True]), "unknown message kind"),
        (raw(P.PROTOCOL_VERSION, 1, []), r"message must be \[kind"),
        (raw(P.PROTOCOL_VERSION, 1, P.Stats.KIND), r"message must be \[kind"),
        (raw(P.PROTOCOL_VERSION, "x", [P.Stats.KIND]), "request id must be an int"),
        (raw(P.PROTOCOL_VERSION, True, [P.Stats.KIND]), "request id must be an int, got bool"),
        (raw(P.PROTOCOL_VERSION, 1.0, [P.Stats.KIND]), "request id must be an int, got float"),
        (body(P.Exists.KIND, ["a", 2]), r"^Exists.keys\[1\]: expected `str`, got `int`"),
        (body(P.Exists.KIND, "a"), r"^Exists.keys: expected `array`, got `str`"),
        (body(P.Exists.KIND, ["a"], "extra"), "^Exists: expected 1 fields, got 2"),
        (body(P.Exists.KIND), "^Exists: expected 1 fields, got 0"),
        (body(P.Stats.KIND, 1), "^Stats: expected 0 fields, got 1"),
        (body(P.PutStart.KIND, ["a"], [True], 1, None, False), r"^PutStart.sizes\[0\]: expected `int`, got `bool`"),
        (body(P.PutStart.KIND, ["a"], [1], 1.0, None, False), "^PutStart.replicas: expected `int`, got `float`"),
        (
            body(P.PutStart.KIND, ["a"], [1], 1, 5, False),
            r"^PutStart.preferred_node: expected `str \| null`, got `int`",
        ),
        (body(P.GetReplicas.KIND, ["a"], [], 1), "^GetReplicas.lease: expected `bool`, got `int`"),
        (
            register_node([["k", "tape", 0, 1, 2, False]], []),
            r"^RegisterNode.inventory\[0\].tier: invalid enum value 'tape' \(expected one of \('dram', 'ssd'\)\)",
        ),
        (
            register_node([[*INVENTORY_ITEM, 7, 8]], []),
            r"^RegisterNode.inventory\[0\]: expected `array` of at most length 7",
        ),
        (
            register_node([INVENTORY_ITEM], [["eth0", "a", 1.5, 0]]),
            r"^RegisterNode.nics\[0\].speed_mbps: expected `int`",
        ),
        (
            body(P.NodesReply.KIND, [["n", "a", ["r"], "h", "p", 1, [["e", "a", 1, "x"]], False, "", True]]),
            r"^NodesReply.nodes\[0\].nics\[0\].numa_node: expected `int`, got `str`",
        ),
        (body(P.StatsReply.KIND, {"a": "b"}), r"^StatsReply.stats\[...\]: expected `int \| float`, got `str`"),
        (body(P.StatsReply.KIND, {"a": True}), r"^StatsReply.stats\[...\]: expected `int \| float`, got `bool`"),
        (body(P.StatsReply.KIND, {1: 2}), "^StatsReply.stats key: expected `str`, got `int`"),
        (body(P.Replicate.KIND, ["a"], "n", "1"), "^Replicate.max_bytes: expected `int`, got `str`"),
        (body(P.MatchPrefixNodesReply.KIND, 1, "n", [1], [1]), "^MatchPrefixNodesReply.node_ids: expected `array`"),
        (body(P.Exists.KIND, ["\x7f"]).replace(b"\xa1\x7f", b"\xa1\x80"), r"not valid msgpack: .*(?i:utf-8)"),
        (b"\x91" * 100_000 + b"\x01", "nested too deeply"),
        # StatsReply's map swapped for {{1: 2}: 3}: valid msgpack, but no Python dict can hold it
        (body(P.StatsReply.KIND, {})[:-1] + b"\x81\x81\x01\x02\x03", "map keys must be hashable"),
    ],
)
def test_malformed_payloads_are_protocol_errors(payload: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        P.decode_payload(payload)


@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_protocol_error(payload: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        P.decode_payload(payload)


ANY_VALUE = st.recursive(
    st.none() | st.booleans() | INT | st.floats() | st.text(max_size=5) | st.binary(max_size=5),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=3),
)


@given(ANY_VALUE)
def test_random_msgpack_bodies_never_raise_anything_but_protocol_error(fields: Any) -> None:
    for kind in P.KIND_TO_MESSAGE:
        for message in ([kind, *fields] if isinstance(fields, list) else [kind, fields], fields):
            with contextlib.suppress(ProtocolError):
                P.decode_payload(raw(P.PROTOCOL_VERSION, 1, message))


@pytest.mark.parametrize("cls", ALL_MESSAGES, ids=lambda c: c.__name__)
@given(data=st.data())
def test_every_truncated_payload_is_a_protocol_error(cls: type[P.Message], data: st.DataObject) -> None:
    payload = P.encode(data.draw(strategy_for(cls)), 5)[4:]
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(ProtocolError):
        P.decode_payload(payload[:cut])


@pytest.mark.parametrize("cls", [c for c in ALL_MESSAGES if msgspec.structs.fields(c)], ids=lambda c: c.__name__)
@given(data=st.data(), wrong=ANY_VALUE)
def test_a_wrong_typed_field_is_a_protocol_error_naming_it(
    cls: type[P.Message], data: st.DataObject, wrong: Any
) -> None:
    fields = msgspec.structs.fields(cls)
    index = data.draw(st.integers(0, len(fields) - 1))
    with contextlib.suppress(msgspec.ValidationError):
        msgspec.msgpack.Decoder(fields[index].type).decode(msgpack.packb(wrong))
        assume(False)  # a value that fits the field is no test of a wrong one
    message = msgspec.to_builtins(data.draw(strategy_for(cls)), builtin_types=(bytes,))
    message[1 + index] = wrong
    with pytest.raises(ProtocolError, match=rf"^{cls.__name__}\.{fields[index].name}(\[|:| key)"):
        P.decode_payload(raw(P.PROTOCOL_VERSION, 1, message))


def test_request_id_of_a_bad_payload() -> None:
    assert P.request_id_of(raw(P.PROTOCOL_VERSION, 42, [9999])) == 42
    assert P.request_id_of(raw(P.PROTOCOL_VERSION, True, [9999])) == 0
    assert P.request_id_of(raw(2, 38, 42, [])) == 0  # another version's frame: its id may sit elsewhere
    assert P.request_id_of(b"\xc1") == 0
    assert P.request_id_of(b"\xa1\x80") == 0  # not UTF-8
    assert P.request_id_of(b"\x91" * 100_000 + b"\x01") == 0


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


_BATCHES: dict[str, Any] = {
    "PutStart": lambda keys: P.PutStart(keys, [1] * len(keys), 1, None, False),
    "PutEnd": lambda keys: P.PutEnd(keys, [0] * len(keys)),
    "PutRevoke": lambda keys: P.PutRevoke(keys),
    "GetReplicas": lambda keys: P.GetReplicas(keys, [], False),
    "ReleaseLeases": lambda keys: P.ReleaseLeases(list(range(len(keys)))),
    "Remove": lambda keys: P.Remove(keys),
    "Exists": lambda keys: P.Exists(keys),
    "MatchPrefix": lambda keys: P.MatchPrefix(keys),
    "MatchPrefixNodes": lambda keys: P.MatchPrefixNodes(keys),
    "Replicate": lambda keys: P.Replicate(keys, "n0", 0),
}


@pytest.mark.parametrize("kind", sorted(_BATCHES))
def test_an_oversized_batch_is_seen_in_the_frame_before_it_is_decoded(kind: str) -> None:
    """The master refuses a batch over MAX_BATCH_KEYS from the frame's array headers alone (decoding
    half a million keys held its loop for a tenth of a second), naming the request it refuses."""
    assert {name for name, _ in P.limits._FIRST_FIELD.values()} == set(_BATCHES)

    def frame(n: int, request_id: int) -> bytes:
        return P.encode(_BATCHES[kind]([f"k{i}" for i in range(n)]), request_id)[P.FRAME_HEADER.size :]

    refused = P.check_frame(frame(P.MAX_BATCH_KEYS + 1, 2**40))
    assert refused is not None and refused[0] == 2**40
    assert f"{kind}." in str(refused[1]) and f"names {P.MAX_BATCH_KEYS + 1} items" in str(refused[1])
    assert P.check_frame(frame(P.MAX_BATCH_KEYS, 7)) is None
    with pytest.raises(InvalidArgument, match=f"at most {P.MAX_BATCH_KEYS}"):
        P.check_batch(P.decode_payload(frame(P.MAX_BATCH_KEYS + 1, 1))[1])


@given(st.binary(max_size=64))
def test_check_frame_never_raises_on_any_bytes(data: bytes) -> None:
    refused = P.check_frame(data)
    assert refused is None or isinstance(refused[1], InvalidArgument)


def test_an_oversized_batch_in_another_msgpack_encoding_is_seen_too() -> None:
    """msgspec decodes any valid encoding (array16 where a fixarray would do, signed ints): so does
    the check before decoding, or a peer would pass its batch by writing the same thing longhand."""
    keys = msgpack.packb([f"k{i}" for i in range(P.MAX_BATCH_KEYS + 1)])
    version = b"\xd1" + P.PROTOCOL_VERSION.to_bytes(2, "big", signed=True)
    request_id = b"\xd3" + (99).to_bytes(8, "big", signed=True)
    payload = (
        b"\xdc\x00\x03"
        + version
        + request_id
        + b"\xdd\x00\x00\x00\x02"
        + b"\xd2"
        + P.Exists.KIND.to_bytes(4, "big")
        + keys
    )
    assert isinstance(P.decode_payload(payload)[1], P.Exists)  # the decoder takes it as it is
    refused = P.check_frame(payload)
    assert refused is not None and refused[0] == 99 and "Exists.keys names" in str(refused[1])
