"""Byte views over the buffers callers hand in: bytes, bytearray, memoryview,
numpy arrays and torch CPU tensors, without copying them."""

from __future__ import annotations

from typing import Any

from kvstore.errors import InvalidArgument


def _torch_to_numpy(obj: Any) -> Any:
    import torch  # only reached for a torch tensor, so torch is importable

    if obj.device.type != "cpu":
        raise InvalidArgument(f"tensor is on {obj.device}; only CPU tensors are accepted here")
    if not obj.is_contiguous():
        raise InvalidArgument("tensor must be contiguous")
    # A byte view keeps dtypes numpy lacks (bfloat16) and shares the tensor's memory.
    return obj.detach().reshape(-1).view(torch.uint8).numpy()


def as_view(data: Any, *, writable: bool = False, what: str = "data") -> memoryview:
    """A flat, C-contiguous byte ``memoryview`` of ``data`` sharing its memory.

    Raises :class:`InvalidArgument` for unsupported types, non-contiguous
    buffers, or read-only buffers when ``writable`` is asked for.
    """
    if type(data).__module__.startswith("torch"):
        data = _torch_to_numpy(data)
    try:
        view = data if isinstance(data, memoryview) else memoryview(data)
    except TypeError:
        raise InvalidArgument(
            f"{what} must be bytes, bytearray, memoryview, a numpy array or a CPU tensor, not {type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument(f"{what} must be C-contiguous")
    if writable and view.readonly:
        raise InvalidArgument(f"{what} is read-only; a writable buffer is needed")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
