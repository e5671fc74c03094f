"""Byte views over the buffers callers hand in: bytes, bytearray, memoryview,
numpy arrays and torch CPU tensors, without copying them.

Only plain bytes and numbers are stored: a buffer holding Python objects
(numpy ``object`` dtypes, structured dtypes with an object field) would store
the addresses of the objects, which mean nothing to any other process, so it is
refused, as is any buffer whose bytes cannot be viewed in place.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument

_PLAIN_FORMAT = re.compile(r"[@=<>!]?\d*(?:[cbB?hHiIlLqQnNefdgsuw]|Z[fdg])")
"""Buffer formats whose item is bytes, characters or a number (``Z*`` are numpy's complex types).
Pointers (``P``), objects (``O``), records (``T{...}``) and items of several fields are not."""
_NATIVE_NUMBERS = frozenset("cbB?hHiIlLqQnNefdg")
"""The usual formats, checked without the regular expression (``as_view`` is on every put's path)."""


def _torch_to_numpy(obj: Any) -> np.ndarray:
    import torch  # only reached for a torch tensor, so torch is importable

    if obj.layout != torch.strided:
        raise InvalidArgument(f"tensor has layout {obj.layout}; only dense (strided) tensors are accepted")
    if obj.device.type != "cpu":
        raise InvalidArgument(f"tensor is on {obj.device}; only CPU tensors are accepted here (copy it with .cpu())")
    if not obj.is_contiguous():
        raise InvalidArgument(f"tensor of shape {tuple(obj.shape)} is not contiguous; pass .contiguous() of it")
    if obj.is_conj() or obj.is_neg():
        # A lazy conjugate or negation: the memory does not hold the values the tensor shows.
        raise InvalidArgument("tensor has a pending conjugation or negation; pass .resolve_conj().resolve_neg() of it")
    if obj.is_quantized:
        raise InvalidArgument(f"tensor is quantized ({obj.dtype}); pass its int_repr() or dequantize() it")
    # A byte view keeps dtypes numpy lacks (bfloat16) and shares the tensor's memory.
    return obj.detach().reshape(-1).view(torch.uint8).numpy()


def _numpy_bytes(arr: np.ndarray, what: str) -> np.ndarray:
    dtype = arr.dtype
    if dtype.hasobject:
        raise InvalidArgument(
            f"{what} has dtype {dtype}, which holds Python objects; only arrays of bytes and numbers can be stored"
        )
    if dtype.kind not in "MmV":
        return arr  # numbers and characters: their memoryview is a plain one (and cheaper than a byte view)
    if not arr.flags.c_contiguous:
        raise InvalidArgument(f"{what} must be C-contiguous (numpy array of shape {arr.shape}); pass a copy of it")
    # Records and datetimes have no plain buffer format (or none at all); their bytes are what is stored.
    return arr.reshape(-1).view(np.uint8)


def as_view(data: Any, *, writable: bool = False, what: str = "data") -> memoryview:
    """A flat, C-contiguous byte ``memoryview`` of ``data`` sharing its memory.

    Raises :class:`InvalidArgument` for unsupported types, buffers of Python
    objects or of anything but bytes and numbers, non-contiguous buffers,
    tensors that are not dense CPU memory, or read-only buffers when
    ``writable`` is asked for.
    """
    torch = sys.modules.get("torch")  # a tensor means torch is imported; never import it here
    if torch is not None and isinstance(data, torch.Tensor):
        data = _torch_to_numpy(data)
    if isinstance(data, np.ndarray):
        data = _numpy_bytes(data, what)
    try:
        view = data if isinstance(data, memoryview) else memoryview(data)
    except TypeError:
        raise InvalidArgument(
            f"{what} must be bytes, bytearray, memoryview, a numpy array or a CPU tensor, not {type(data).__name__}"
        ) from None
    if view.format not in _NATIVE_NUMBERS and not _PLAIN_FORMAT.fullmatch(view.format):
        raise InvalidArgument(
            f"{what} is a buffer of format {view.format!r}; only buffers of bytes and numbers can be stored"
        )
    if not view.c_contiguous:
        raise InvalidArgument(f"{what} must be C-contiguous")
    if writable and view.readonly:
        raise InvalidArgument(f"{what} is read-only; a writable buffer is needed")
    if view.format != "B" or view.ndim != 1:
        if not view.nbytes:  # memoryview cannot cast a shape with a zero in it
            return memoryview(b"" if view.readonly else bytearray())
        view = view.cast("B")
    return view
