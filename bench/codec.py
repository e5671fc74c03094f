"""Wire-codec micro-benchmark: µs per encode and per decode of representative master/daemon messages.

One JSON line per (message, keys): ``encode_us``/``decode_us`` of today's
:mod:`kvstore.protocol` (a whole frame: ``encode`` with its 4-byte header,
``decode_payload`` with its validation), beside the same run's baseline
(``baseline_encode_us``/``baseline_decode_us``): plain ``msgpack.packb`` plus
the header, and ``msgpack.unpackb``, of the equivalent untyped lists, which
validate nothing. With ``--old PATH`` (a copy of an earlier, single-file protocol.py) the
lines also carry that codec's figures (``old_encode_us``, ``old_decode_us``,
``old_frame_bytes``), measured on the same messages in the same run.

Each figure is the best of ``--repeat`` runs of a loop sized to take about
``--target-ms``: the least disturbed run on a shared machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import timeit
import types
from collections.abc import Callable
from typing import Any

import msgpack

from kvstore import protocol

REQUEST_ID = 0x2345_6789_ABCD_EF01
"""As large as a client's ids (transfer.rpc draws them from 62 random bits)."""

CASES: list[tuple[str, int]] = [
    ("GetReplicas", 1),
    ("GetReplicas", 64),
    ("GetReplicasReply", 1),
    ("GetReplicasReply", 64),
    ("PutStart", 1),
    ("PutStart", 64),
    ("PutStartReply", 1),
    ("PutStartReply", 64),
    ("Exists", 1),
    ("ExistsReply", 1),
    ("WriteBlocks", 1),
    ("WriteBlocks", 64),
    ("ReadReply", 1),
    ("ReadReply", 64),
    ("PutReply", 1),
    ("RegisterNode", 10_000),
]

NESTED: dict[str, dict[int, str]] = {"RegisterNode": {5: "InventoryItem", 10: "Nic"}}
"""Per message, the fields that hold a list of structs, and the struct's name."""


def plain_fields(name: str, n: int) -> list[Any]:
    """The message's fields as untyped values (nested structs as lists), ``n`` keys of realistic length."""
    keys = [f"{i:016x}" * 4 for i in range(n)]  # a 64-hex-digit prefix hash per block
    sizes = [256 * 1024] * n
    checksums = [0x9E37_79B9_7F4A_7C15 ^ i for i in range(n)]
    offsets = [i * 256 * 1024 for i in range(n)]
    address = "10.0.0.17:7001"
    replicas = [[1] * n, ["node-3"] * n, [address] * n]  # one DRAM replica per key: counts, nodes, addresses

    def register_node() -> list[Any]:
        blocks = zip(keys, offsets, sizes, checksums, strict=True)
        inventory = [
            [k, "ssd" if i % 4 == 0 else "dram", o, s, c, i % 16 == 0] for i, (k, o, s, c) in enumerate(blocks)
        ]
        nics = [["eth0", "10.0.0.17", 100_000, 0], ["eth1", "10.0.1.17", 100_000, 1]]
        rails = [address, "10.0.1.17:7001"]
        return ["node-3", address, 64 << 30, 1 << 40, 4096, inventory, rails, "host-3", "/dev/shm/kvstore-node-3",
                123456, nics, True, "", 1 << 20]  # fmt: skip

    builders: dict[str, Callable[[], list[Any]]] = {
        "GetReplicas": lambda: [keys, [], True],
        "GetReplicasReply": lambda: [sizes, checksums, *replicas, ["dram"] * n, offsets, 30_000],
        "PutStart": lambda: [keys, sizes, 1, None, False],
        "PutStartReply": lambda: [["ok"] * n, [0] * n, [""] * n, *replicas, offsets],
        "Exists": lambda: [keys],
        "ExistsReply": lambda: [[True] * n],
        "WriteBlocks": lambda: [keys, offsets, sizes, checksums, False],
        "ReadReply": lambda: [sizes, checksums],
        "PutReply": lambda: [[0] * n, [""] * n],
        "RegisterNode": register_node,
    }
    return builders[name]()


def typed(module: types.ModuleType, name: str, fields: list[Any]) -> Any:
    """The message ``name`` of codec ``module`` holding ``fields`` (nested lists become its structs)."""
    values = list(fields)
    for index, struct_name in NESTED.get(name, {}).items():
        struct = getattr(module, struct_name)
        values[index] = [struct(*item) for item in values[index]]
    return getattr(module, name)(*values)


def per_call_us(fn: Callable[[], object], repeat: int, target_ms: float) -> float:
    """The best of ``repeat`` timed loops, each sized to take about ``target_ms``, in µs per call."""
    timer = timeit.Timer(fn)
    number = 1
    while (elapsed := timer.timeit(number)) < target_ms / 1000 / 4:
        number *= 4
    number = max(1, int(number * target_ms / 1000 / elapsed))
    return min(timer.repeat(repeat, number)) / number * 1e6


def codec_figures(module: types.ModuleType, message: Any, repeat: int, target_ms: float) -> tuple[float, float, int]:
    """(encode µs, decode µs, frame bytes) of one codec, after checking that the message survives it."""
    frame = module.encode(message, REQUEST_ID)
    payload = frame[module.FRAME_HEADER.size :]
    if module.decode_payload(payload) != (REQUEST_ID, message):
        raise AssertionError(f"{type(message).__name__} does not round-trip through {module.__name__}")
    encode_us = per_call_us(lambda: module.encode(message, REQUEST_ID), repeat, target_ms)
    decode_us = per_call_us(lambda: module.decode_payload(payload), repeat, target_ms)
    return encode_us, decode_us, len(frame)


def baseline_figures(untyped: list[Any], repeat: int, target_ms: float) -> tuple[float, float]:
    """(encode µs, decode µs) of plain msgpack on the untyped frame, header included on the encode side."""
    header = protocol.FRAME_HEADER

    def encode() -> bytes:
        payload = msgpack.packb(untyped, use_bin_type=True)
        return header.pack(len(payload)) + payload

    payload = encode()[header.size :]
    if msgpack.unpackb(payload, raw=False) != untyped:
        raise AssertionError("the untyped frame does not round-trip through msgpack")
    encode_us = per_call_us(encode, repeat, target_ms)
    decode_us = per_call_us(lambda: msgpack.unpackb(payload, raw=False), repeat, target_ms)
    return encode_us, decode_us


def load_module(path: str) -> types.ModuleType:
    """Import a protocol.py from ``path`` as a module of its own (it registers its messages in itself)."""
    spec = importlib.util.spec_from_file_location("kvstore_old_protocol", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # get_type_hints resolves annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def run(old: types.ModuleType | None, only: str | None, repeat: int, target_ms: float) -> list[dict[str, Any]]:
    lines = []
    for name, n in CASES:
        if only and name != only:
            continue
        fields = plain_fields(name, n)
        message = typed(protocol, name, fields)
        encode_us, decode_us, frame_bytes = codec_figures(protocol, message, repeat, target_ms)
        untyped = [protocol.PROTOCOL_VERSION, REQUEST_ID, [message.KIND, *fields]]
        baseline_encode_us, baseline_decode_us = baseline_figures(untyped, repeat, target_ms)
        line: dict[str, Any] = {
            "bench": "codec",
            "message": name,
            "keys": n,
            "protocol_version": protocol.PROTOCOL_VERSION,
            "encode_us": round(encode_us, 3),
            "decode_us": round(decode_us, 3),
            "baseline_encode_us": round(baseline_encode_us, 3),
            "baseline_decode_us": round(baseline_decode_us, 3),
            "frame_bytes": frame_bytes,
        }
        if old is not None:
            old_encode_us, old_decode_us, old_frame_bytes = codec_figures(
                old, typed(old, name, fields), repeat, target_ms
            )
            line |= {
                "old_encode_us": round(old_encode_us, 3),
                "old_decode_us": round(old_decode_us, 3),
                "old_frame_bytes": old_frame_bytes,
            }
        print(json.dumps(line), flush=True)
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Wire-codec micro-benchmark.")
    parser.add_argument("--old", metavar="PATH", help="an earlier, single-file protocol.py to measure beside today's")
    parser.add_argument("--only", metavar="MESSAGE", help="measure this message only")
    parser.add_argument("--repeat", type=int, default=7, help="timed loops per figure; the best counts")
    parser.add_argument("--target-ms", type=float, default=20.0, help="about how long each timed loop runs")
    args = parser.parse_args(argv)
    run(load_module(args.old) if args.old else None, args.only, args.repeat, args.target_ms)


if __name__ == "__main__":
    main()
