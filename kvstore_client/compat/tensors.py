"""Tensors as Mooncake Store keeps them: a 304-byte ``TensorMetadata`` header, then the raw data.

The layout is Mooncake's (``mooncake-integration/integration_utils.h``), so a tensor put by either
store reads back in the other's format: magic, version, header size, dtype code, ndim, layout
kind (0: the full tensor), flags, data offset and data bytes; then the global and local shapes
(8 dimensions each, unused ones -1) and four layout axes, unused here. torch is imported on first
use: the rest of the drop-in works without it.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from kvstore.errors import InvalidArgument

MAGIC = 0x4D4F4F4E
VERSION = 1
HEADER_BYTES = 304
MAX_DIMS = 8
_FIXED = struct.Struct("<IHHiiIIQQ")  # magic, version, header size, dtype, ndim, layout kind, flags, offset, bytes
_SHAPES = struct.Struct(f"<{MAX_DIMS}q{MAX_DIMS}qII")  # global shape, local shape, axis count, reserved
_AXES = HEADER_BYTES - _FIXED.size - _SHAPES.size  # four LayoutAxis records, zero: no parallel layout
assert _AXES == 4 * 32

_DTYPE_NAMES = (
    "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "bool",
    "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
)  # fmt: skip
"""Mooncake's dtype codes: the index of each torch dtype's name."""


def torch_module() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError("the tensor methods need torch: pip install torch") from None
    return torch


def _code(dtype: Any) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise InvalidArgument(f"dtype {name} has no Mooncake tensor code; supported: {', '.join(_DTYPE_NAMES)}")
    return _DTYPE_NAMES.index(name)


def _header_and_flat(tensor: Any) -> tuple[bytes, Any]:
    """(header, ``tensor`` as one contiguous dimension in CPU memory: copied there where it is not)."""
    torch = torch_module()
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgument(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() > MAX_DIMS:
        raise InvalidArgument(f"a tensor of {tensor.dim()} dimensions; at most {MAX_DIMS}")
    code = _code(tensor.dtype)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    shape = list(tensor.shape) + [-1] * (MAX_DIMS - tensor.dim())
    header = (
        _FIXED.pack(MAGIC, VERSION, HEADER_BYTES, code, tensor.dim(), 0, 0, HEADER_BYTES, flat.nbytes)
        + _SHAPES.pack(*shape, *([-1] * MAX_DIMS), 0, 0)
        + bytes(_AXES)
    )
    return header, flat


def serialize(tensor: Any) -> tuple[bytes, memoryview]:
    """(header, data) of ``tensor`` (copied to contiguous CPU memory first where it is not)."""
    header, flat = _header_and_flat(tensor)
    torch = torch_module()
    return header, memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def serialize_parts(tensor: Any) -> tuple[bytes, int, int, Any]:
    """Mooncake's ``mooncake.store._serialize_tensor``: (header, the address of the data, its bytes,
    the tensor that owns them: keep it while the address is used)."""
    header, flat = _header_and_flat(tensor)
    return header, flat.data_ptr() if flat.numel() else 0, flat.nbytes, flat


def to_bytes(tensor: Any) -> bytes:
    header, data = serialize(tensor)
    return header + data


def deserialize(blob: Any) -> Any:
    """The tensor in ``blob`` (header then data); InvalidArgument (a ValueError) when it is not one."""
    torch = torch_module()
    view = memoryview(blob).cast("B")
    if view.nbytes < HEADER_BYTES:
        raise InvalidArgument(f"{view.nbytes} bytes cannot hold a tensor: its header alone is {HEADER_BYTES}")
    magic, version, header, code, ndim, _, _, offset, nbytes = _FIXED.unpack_from(view)
    if magic != MAGIC or version != VERSION or header != HEADER_BYTES:
        raise InvalidArgument("not a Mooncake tensor (bad magic, version or header size)")
    if not 0 <= code < len(_DTYPE_NAMES) or not 0 <= ndim <= MAX_DIMS:
        raise InvalidArgument(f"tensor header with dtype code {code} and {ndim} dimensions")
    if offset < HEADER_BYTES or offset + nbytes > view.nbytes:
        raise InvalidArgument(f"tensor data of {nbytes} bytes at {offset} lies outside the {view.nbytes} given")
    shape = _SHAPES.unpack_from(view, _FIXED.size)[:ndim]
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"tensor shape {shape} has a negative dimension")
    dtype = getattr(torch, _DTYPE_NAMES[code])
    numel = 1
    for d in shape:
        numel *= d
    if numel * torch.empty((), dtype=dtype).element_size() != nbytes:
        raise InvalidArgument(f"tensor of shape {shape} and dtype {dtype} cannot be {nbytes} bytes")
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    data = bytearray(view[offset : offset + nbytes])
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


def shards(tensor: Any, tp_size: int, split_dim: int) -> list[Any]:
    """``tensor`` split in ``tp_size`` equal shards along ``split_dim`` (each rank's ``{key}_tp_{rank}``)."""
    if type(tp_size) is not int or tp_size < 1:
        raise InvalidArgument(f"tp_size must be a positive int, got {tp_size!r}")
    if type(split_dim) is not int or not -tensor.dim() <= split_dim < max(tensor.dim(), 1):
        raise InvalidArgument(f"split_dim {split_dim!r} is not a dimension of a {tensor.dim()}-d tensor")
    length = tensor.shape[split_dim]
    if length % tp_size:
        raise InvalidArgument(f"dimension {split_dim} of length {length} does not split in {tp_size} equal shards")
    step = length // tp_size
    return [tensor.narrow(split_dim, rank * step, step) for rank in range(tp_size)]


class TensorMethods:
    """Mooncake's tensor methods, for a store class that has the byte methods they build on."""

    if TYPE_CHECKING:  # the byte methods they build on, of the class that takes them in

        def _put_values(self, keys: list[str], values: list[bytes], upsert: bool) -> list[int]: ...
        def _registered(self, ptr: int, size: int) -> memoryview: ...
        def get_batch(self, keys: list[str]) -> list[bytes]: ...
        def get_into(self, key: str, buffer_ptr: int, size: int) -> int: ...
        def put_from(self, key: str, buffer_ptr: int, size: int, config: Any = None) -> int: ...

    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store a tensor (Mooncake's header, then its data): 0 or a negative code."""
        return self.batch_put_tensor([key], [tensor])[0]

    def batch_put_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        return self._put_tensors(keys, tensors_list, upsert=False)

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        return self.batch_upsert_tensor([key], [tensor])[0]

    def batch_upsert_tensor(self, keys: list[str], tensors_list: list[Any]) -> list[int]:
        return self._put_tensors(keys, tensors_list, upsert=True)

    def _put_tensors(self, keys: list[str], tensors_list: list[Any], *, upsert: bool) -> list[int]:
        if len(keys) != len(tensors_list):
            return [_INVALID_PARAMS] * len(keys)
        out = [0] * len(keys)
        good, blobs = [], []
        for i, tensor in enumerate(tensors_list):
            try:
                blobs.append(to_bytes(tensor))
                good.append(i)
            except InvalidArgument:
                out[i] = _INVALID_PARAMS
        for i, code in zip(good, self._put_values([keys[i] for i in good], blobs, upsert), strict=True):
            out[i] = code
        return out

    def get_tensor(self, key: str) -> Any:
        """The tensor stored under ``key``, or None."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: list[str]) -> list[Any]:
        torch_module()
        return [_tensor_or_none(blob) for blob in self.get_batch(keys)]

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store ``size`` bytes of registered memory, a tensor as ``get_tensor_into`` leaves it (header, data)."""
        return self.put_from(key, buffer_ptr, size)

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Read a tensor into registered memory (header, then data) and return it, or None."""
        n = self.get_into(key, buffer_ptr, size)
        return _tensor_or_none(self._registered(buffer_ptr, n)) if n > 0 else None

    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        """Store each of ``tp_size`` equal shards along ``split_dim`` as ``{key}_tp_{rank}``."""
        try:
            parts = shards(tensor, tp_size, split_dim)
        except InvalidArgument:
            return _INVALID_PARAMS
        codes = self.batch_put_tensor([f"{key}_tp_{rank}" for rank in range(tp_size)], parts)
        return next((c for c in codes if c), 0)

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> Any:
        """Rank ``tp_rank``'s shard of a tensor stored with ``put_tensor_with_tp``, or None."""
        return self.get_tensor(f"{key}_tp_{tp_rank}")

    def batch_put_tensor_with_tp(
        self, base_keys: list[str], tensors_list: list[Any], tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> list[int]:
        if len(base_keys) != len(tensors_list):
            return [_INVALID_PARAMS] * len(base_keys)
        return [
            self.put_tensor_with_tp(k, t, tp_rank, tp_size, split_dim)
            for k, t in zip(base_keys, tensors_list, strict=True)
        ]

    def batch_get_tensor_with_tp(self, base_keys: list[str], tp_rank: int = 0, tp_size: int = 1) -> list[Any]:
        return self.batch_get_tensor([f"{k}_tp_{tp_rank}" for k in base_keys])


_INVALID_PARAMS = -600
"""Mooncake's INVALID_PARAMS (ErrorCode in kvstore_client.compat.mooncake)."""


def _tensor_or_none(blob: Any) -> Any:
    if not len(blob):
        return None
    try:
        return deserialize(blob)
    except InvalidArgument:
        return None
