"""The Mooncake drop-in's pieces without a cluster: sizes as Mooncake's setup dict takes them, the
registry of raw buffers, error codes, and the tensor format (Mooncake's 304-byte header)."""

from __future__ import annotations

import ctypes
import struct

import pytest

from kvstore.errors import BufferTooSmall, CapacityError, ConnectionFailed, InvalidArgument, QuotaExceeded, Timeout
from kvstore_client.compat import tensors
from kvstore_client.compat.mooncake_types import INFINITE, ErrorCode, Registered, error_code, parse_size
from kvstore_client.compat.segment import node_id, split_hostname


@pytest.mark.parametrize(
    ("text", "size"),
    [("16MB", 16 << 20), ("16 MB", 16 << 20), ("1.5k", 1536), (" 2 gb ", 2 << 30), ("4096", 4096), ("1t", 1 << 40),
     (16 << 20, 16 << 20), ("infinite", INFINITE), ("1e3", 1000)],
)  # fmt: skip
def test_sizes_as_mooncake_reads_them(text: object, size: int) -> None:
    assert parse_size(text, "x") == size


@pytest.mark.parametrize("text", ["50%", "16 MiB", "-1", "", "MB", "1 PB", None, "1 2"])
def test_sizes_mooncake_refuses(text: object) -> None:
    with pytest.raises(InvalidArgument):
        parse_size(text, "global_segment_size")


def test_raw_addresses_are_used_only_inside_registered_buffers() -> None:
    buffers = Registered()
    memory = (ctypes.c_ubyte * 100)()
    base = ctypes.addressof(memory)
    buffers.add(base, 100)
    assert buffers.room(base) == 100 and buffers.room(base + 60) == 40 and buffers.room(base + 100) == 0
    assert buffers.room(base - 1) == 0
    view = buffers.view(base + 10, 5)
    view[:] = b"abcde"
    assert bytes(memory[10:15]) == b"abcde"
    for ptr, size in ((base + 96, 5), (base - 1, 2), (0, 1)):
        with pytest.raises(InvalidArgument):
            buffers.view(ptr, size)
    with pytest.raises(TypeError):
        buffers.view(-5, 1)
    assert buffers.view(base, 0).nbytes == 0
    assert buffers.remove(base) and not buffers.remove(base) and buffers.room(base) == 0


def test_error_codes() -> None:
    assert error_code(QuotaExceeded("q")) == ErrorCode.TENANT_QUOTA_EXCEEDED
    assert error_code(CapacityError("c")) == ErrorCode.NO_AVAILABLE_HANDLE
    assert error_code(BufferTooSmall("b")) == ErrorCode.INVALID_PARAMS
    assert error_code(Timeout("t")) == ErrorCode.RPC_TIMEOUT and error_code(ConnectionFailed("c")) == ErrorCode.RPC_FAIL


def test_hostnames_and_node_ids() -> None:
    assert split_hostname("localhost") == ("localhost", None)
    assert split_hostname("10.0.0.1:12345") == ("10.0.0.1", 12345)
    assert split_hostname("[::1]:5") == ("::1", 5)
    for bad in ("", "host:0", "host:x", "host:70000"):
        with pytest.raises(InvalidArgument):
            split_hostname(bad)
    assert node_id("localhost:12345") == "localhost-12345"


def test_tensor_header_is_mooncakes() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    blob = tensors.to_bytes(tensor)
    assert len(blob) == tensors.HEADER_BYTES + 24
    magic, version, header, dtype, ndim = struct.unpack_from("<IHHii", blob)
    assert (magic, version, header, dtype, ndim) == (0x4D4F4F4E, 1, 304, 6, 2)  # 6: INT32
    assert torch.equal(tensors.deserialize(blob), tensor)
    for bad in (blob[:100], blob[:-1], b"\0" * 400):
        with pytest.raises(InvalidArgument):
            tensors.deserialize(bad)


def test_mooncake_stores_tensor_codec_as_its_structured_store_calls_it() -> None:
    """mooncake.store's ``_serialize_tensor`` / ``_deserialize_tensor`` / ``_tensor_metadata_size``: a
    header and the data's address (a non-contiguous tensor copied first), and a header whose byte
    count and shapes Mooncake's structured store patches (offsets 32, 40, 104) to read some rows."""
    torch = pytest.importorskip("torch")
    from kvstore_client.compat import mooncake

    tensor = torch.arange(24, dtype=torch.int64).reshape(6, 4).t()  # not contiguous
    header, ptr, nbytes, owner = mooncake._serialize_tensor(tensor)
    assert len(header) == mooncake._tensor_metadata_size() == 304 and nbytes == 24 * 8
    assert torch.equal(mooncake._deserialize_tensor(header + ctypes.string_at(ptr, nbytes)), tensor)
    rows = bytearray(header)
    struct.pack_into("<Q", rows, 32, 2 * 6 * 8)  # the first two rows of the (4, 6) tensor
    struct.pack_into("<q", rows, 40, 2)
    struct.pack_into("<q", rows, 104, 2)
    assert torch.equal(mooncake._deserialize_tensor(bytes(rows) + ctypes.string_at(ptr, 2 * 6 * 8)), tensor[:2])
    empty = mooncake._serialize_tensor(torch.empty(0, 3))
    assert empty[1:3] == (0, 0) and mooncake._deserialize_tensor(empty[0]).shape == (0, 3)
    del owner
