"""The native data-plane loops: built, loaded, and observably the same as the pure-Python fallback.

tests/unit/test_wire.py runs every frame-I/O test through both; this file checks the switch
itself and fuzzes the two against each other (bench.fuzz_native)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest
import xxhash

from bench.fuzz_native import fuzz
from kvstore.errors import ConnectionFailed, ProtocolError
from transfer import native, wire


def test_the_install_built_the_native_part() -> None:
    if os.environ.get("KVSTORE_NO_NATIVE", "") not in ("", "0"):
        pytest.skip("KVSTORE_NO_NATIVE is set: this run is the fallback's")
    assert native.active(), f"transfer._native did not load ({native.reason}): pip install -e . builds it with gcc"


def _loads(env: dict[str, str]) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("KVSTORE_NO_NATIVE", "KVSTORE_NATIVE_PATH")}
    out = subprocess.run(
        [sys.executable, "-c", "import transfer.native as n; print(n.active(), n.reason)"],
        env={**base, **env}, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return out.stdout.strip() + out.stderr


def test_the_fallback_runs_when_asked_or_when_the_extension_cannot_load() -> None:
    assert _loads({"KVSTORE_NO_NATIVE": "1"}).startswith("False KVSTORE_NO_NATIVE is set")
    missing = _loads({"KVSTORE_NATIVE_PATH": "/nonexistent/_native.so"})
    assert missing.startswith("False not available")
    assert "running the pure-Python fallback" in missing  # the one log line


def test_native_and_fallback_agree_on_a_fuzzed_stream() -> None:
    if not native.active():
        pytest.skip(f"the native part is not loaded ({native.reason})")
    summary = fuzz(300, seed=3)
    assert summary["inputs"] == 300
    assert summary["mismatches"] == 0, summary["examples"]


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "python"])
def test_checksums_are_computed_as_a_large_block_streams_in(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 3 MiB block sent in uneven pieces with a stall between them: the sum is the block's xxh3,
    the bytes land whole; a block cut short is an error, never a sum."""
    if native_on and not native.active():
        pytest.skip(f"the native part is not loaded ({native.reason})")
    monkeypatch.setattr(native, "lib", native.lib if native_on else None)
    block = os.urandom(3 * 1024 * 1024 + 5)
    a, b = socket.socketpair()
    wire.set_timeouts(b, 5)

    def send() -> None:
        for at in range(0, len(block), 700_001):
            a.sendall(block[at : at + 700_001])
        a.close()

    sender = threading.Thread(target=send)
    sender.start()
    target = memoryview(bytearray(len(block)))
    head = memoryview(bytearray(10))
    sums = wire.recv_parts(b, [head, 100, target[: len(block) - 110]], sums=True)
    sender.join()
    assert sums[1] is None
    assert sums[0] == xxhash.xxh3_64_intdigest(block[:10])
    assert sums[2] == xxhash.xxh3_64_intdigest(block[110:])
    assert bytes(target[: len(block) - 110]) == block[110:]
    with pytest.raises(ConnectionFailed, match="mid-message"):
        wire.recv_parts(b, [memoryview(bytearray(1))], sums=True)
    b.close()


@pytest.mark.parametrize("native_on", [True, False], ids=["native", "python"])
def test_lengths_no_stream_carries_are_refused_before_a_byte_is_read(
    native_on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer's size of 2**63 or more (msgpack carries up to 2**64 - 1) to drop, an empty read-only
    target, a limit below zero: each answered the same way by both loops, the stream untouched."""
    if native_on and not native.active():
        pytest.skip(f"the native part is not loaded ({native.reason})")
    monkeypatch.setattr(native, "lib", native.lib if native_on else None)
    a, b = socket.socketpair()
    wire.set_timeouts(b, 1)
    a.sendall(b"\x00\x00\x00\x05hello")
    for huge in (2**63, 2**64 - 1, -1):
        with pytest.raises(ConnectionFailed, match=f"part 1 drops {huge} bytes"):
            wire.recv_parts(b, [memoryview(bytearray(2)), huge])
    assert wire.recv_parts(b, [memoryview(b"")], sums=True) == [xxhash.xxh3_64_intdigest(b"")]
    with pytest.raises(ProtocolError, match="frame of 5 bytes exceeds the limit of -1"):
        wire.recv_message(b, -1)
    a.close()
    b.close()
