"""Differential fuzz of the native data-plane loops against the pure-Python fallback.

Each input is a byte stream that a peer sends over a real socket pair (in random chunks, then
closing or stalling) and a receive to run on it: a frame (:func:`transfer.wire.recv_message`
with a random limit) or a scatter receive of random buffers and dropped runs with their
checksums (:func:`transfer.wire.recv_parts`); or a send of random buffers
(:func:`transfer.wire.send_all`). Every input runs twice, once through ``transfer._native`` and
once through the fallback, and the two must agree on everything observable: the value, the
bytes that landed in each buffer, the checksums, the error's type and text, and what is left
unread on the socket. Streams lie on purpose: lengths past the limit, frames cut short, a peer
that stalls mid-frame, runs longer than any buffer.

``python -m bench.fuzz_native --inputs N --seed S`` prints one JSON line (``inputs``,
``mismatches``, ``examples``); :mod:`bench.fuzz` runs it as its ``native`` target. Run under
AddressSanitizer by tests/integration/test_native_builds.py.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from kvstore.errors import KVStoreError
from kvstore.protocol import FRAME_HEADER, OkReply, PutReply, encode
from transfer import native, wire

_STALL_S = 0.03
"""The receiving socket's timeout: a peer that stalls is seen after this."""


def _stream_for_frame(rng: random.Random) -> tuple[bytes, dict[str, Any]]:
    shape = rng.choice(["ok", "ok", "big", "lie", "short", "junk", "empty"])
    if shape == "ok":
        body = encode(PutReply([0] * rng.randint(0, 50), [""] * 0), rng.randint(0, 2**31))
        body = body if rng.random() < 0.5 else encode(OkReply(), 1)
        data = body
    elif shape == "big":  # longer than the eager limit: the length comes back, the rest in Python
        payload = encode(PutReply([0] * 20_000, []), 3)[FRAME_HEADER.size :]
        data = FRAME_HEADER.pack(len(payload)) + payload
    elif shape == "lie":  # a length past any limit
        data = FRAME_HEADER.pack(rng.choice([2**32 - 1, 2**31, 64 * 1024 * 1024 + 1])) + rng.randbytes(10)
    elif shape == "short":  # a header, or a frame, cut short
        whole = encode(OkReply(), 9)
        data = whole[: rng.randint(1, len(whole) - 1)]
    elif shape == "empty":
        data = b""
    else:
        data = rng.randbytes(rng.randint(1, 300))
    op = {"op": "frame", "max_frame": rng.choice([64 * 1024 * 1024, 1024, 10, 0])}
    return data, op


def _stream_for_parts(rng: random.Random) -> tuple[bytes, dict[str, Any]]:
    parts: list[tuple[str, int]] = []
    for _ in range(rng.randint(1, 8)):
        size = rng.choice([0, 1, 7, 4096, 65_535, 65_536, 65_537, rng.randint(1, 300_000)])
        parts.append(("drop" if rng.random() < 0.25 else "buf", size))
    if rng.random() < 0.05:  # more buffers than one scatter receive takes
        parts = [("buf", rng.randint(0, 20)) for _ in range(1100)]
    need = sum(n for _, n in parts)
    total = need if rng.random() < 0.7 else rng.randint(0, need + 10)
    return rng.randbytes(total), {"op": "parts", "parts": parts, "sums": rng.random() < 0.8}


def _sender(sock: socket.socket, data: bytes, rng: random.Random, close: bool, done: threading.Event) -> None:
    at = 0
    try:
        while at < len(data):
            n = rng.choice([1, 3, 100, 4096, 65_536, len(data)])
            sock.sendall(data[at : at + n])
            at += n
        if not close:
            done.wait(10)
    except OSError:
        pass
    finally:
        sock.close()


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except (KVStoreError, wire.NoRequest, OSError) as exc:
        text = "" if isinstance(exc, OSError) and not isinstance(exc, KVStoreError) else str(exc)
        return type(exc).__name__, text


def run_one(data: bytes, op: dict[str, Any], close: bool, chunk_seed: int, loops: ModuleType | None) -> tuple[Any, ...]:
    """What a receive of ``op`` on ``data`` observes through ``loops`` (None: the fallback)."""
    a, b = socket.socketpair()
    wire.set_timeouts(b, _STALL_S)
    done = threading.Event()
    sender = threading.Thread(target=_sender, args=(a, data, random.Random(chunk_seed), close, done))
    sender.start()
    saved = native.lib
    native.lib = loops
    try:
        if op["op"] == "frame":
            result = _outcome(lambda: wire.recv_message(b, op["max_frame"]))
            filled: list[bytes] = []
        else:
            targets = [memoryview(bytearray(n)) if kind == "buf" else n for kind, n in op["parts"]]
            result = _outcome(lambda: wire.recv_parts(b, targets, sums=op["sums"]))
            filled = [bytes(t) for t in targets if isinstance(t, memoryview)]
        done.set()  # the peer closes once it sent everything: what is left unread ends at EOF
        b.settimeout(5)
        rest = bytearray()
        try:
            while chunk := b.recv(1 << 20):
                rest += chunk
        except OSError:
            pass
    finally:
        native.lib = saved
        done.set()
        sender.join()
        b.close()
    return result, filled, bytes(rest)


def run_send(rng: random.Random, loops: ModuleType | None) -> bytes:
    sizes = [rng.choice([0, 1, 100, 70_000, 300_000]) for _ in range(rng.randint(0, 1500 if rng.random() < 0.1 else 9))]
    buffers: list[bytes | memoryview] = [rng.randbytes(n) for n in sizes]
    buffers = [memoryview(x) if i % 2 else x for i, x in enumerate(buffers)]
    a, b = socket.socketpair()
    wire.set_timeouts(a, 5)
    got = bytearray()

    def drain() -> None:
        while chunk := b.recv(1 << 20):
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    saved = native.lib
    native.lib = loops
    try:
        wire.send_all(a, buffers)
    finally:
        native.lib = saved
        a.close()
        reader.join()
        b.close()
    if bytes(got) != b"".join(buffers):
        raise AssertionError("send_all sent other bytes")
    return bytes(got)


def fuzz(inputs: int, seed: int) -> dict[str, Any]:
    """Run ``inputs`` inputs through both implementations; what they disagreed on."""
    loops = native.lib
    if loops is None:
        return {"target": "native", "native": native.reason, "inputs": 0, "mismatches": 0}
    rng = random.Random(seed)
    mismatches = 0
    examples: list[str] = []
    for i in range(inputs):
        kind = rng.random()
        if kind < 0.1:
            state = rng.getstate()
            run_send(rng, loops)
            rng.setstate(state)
            run_send(rng, None)
            continue
        data, op = (_stream_for_frame if kind < 0.55 else _stream_for_parts)(rng)
        close = rng.random() < 0.6
        chunk_seed = rng.randrange(2**32)
        fast = run_one(data, op, close, chunk_seed, loops)
        python = run_one(data, op, close, chunk_seed, None)
        if fast != python:
            mismatches += 1
            if len(examples) < 5:
                examples.append(f"input {i} {op['op']} close={close}: native {fast[0]!r} python {python[0]!r}")
    return {"target": "native", "native": native.reason, "inputs": inputs, "mismatches": mismatches,
            "examples": examples}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(fuzz(args.inputs, args.seed)))


if __name__ == "__main__":
    main()
