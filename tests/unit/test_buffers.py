"""as_view: flat byte views of callers' buffers, shared and never copied; anything else is a typed error."""

from __future__ import annotations

import array
import ctypes
from typing import Any

import numpy as np
import pytest

from kvstore.buffers import as_view
from kvstore.errors import InvalidArgument


def shares_memory(view: memoryview, arr: np.ndarray) -> bool:
    return np.shares_memory(np.frombuffer(view, dtype=np.uint8), arr)


@pytest.mark.parametrize(
    "data",
    [
        b"abcdef",
        bytearray(b"abcdef"),
        memoryview(b"abcdef"),
        array.array("d", [1.0, 2.0]),
        (ctypes.c_int32 * 3)(1, 2, 3),
        np.arange(12, dtype=np.int32).reshape(3, 4),
        np.arange(3, dtype=">i4"),  # another byte order: stored as it lies in memory
        np.zeros(2, dtype=np.complex128),
        np.zeros(2, dtype=np.float16),
        np.array([b"abc", b"de"]),
        np.array(["ab", "c"]),
        np.array(5.0),  # 0-d
        np.zeros((0, 4), dtype=np.uint8),
        np.zeros((2, 0, 3), dtype=np.float32).data,  # empty, as a memoryview of three dimensions
        np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")]),  # a record of numbers is plain bytes
        np.zeros(2, dtype="datetime64[s]"),  # no buffer format at all, but plain bytes
    ],
)
def test_plain_buffers_become_flat_byte_views(data: Any) -> None:
    view = as_view(data)
    assert view.format == "B" and view.ndim == 1 and view.c_contiguous
    assert bytes(view) == (data.tobytes() if isinstance(data, np.ndarray | array.array) else bytes(data))


def test_views_share_memory_with_numpy_arrays_and_records() -> None:
    arr = np.arange(6, dtype=np.int64).reshape(2, 3)
    view = as_view(arr, writable=True)
    view[0] = 255
    assert arr[0, 0] == 255 and shares_memory(view, arr)
    records = np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")])
    assert shares_memory(as_view(records), records)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (np.array(["a", None], dtype=object), "dtype object, which holds Python objects"),
        (np.zeros(2, dtype=[("a", "<i4"), ("b", "O")]), r"dtype \[\('a', '<i4'\), \('b', 'O'\)\], which holds Python"),
        (np.zeros((2, 2), dtype=object), "dtype object"),
        (np.array([1, "x"], dtype=object).data, "format 'O'"),
        (np.zeros(2, dtype=[("a", "<i4"), ("b", "<f4")]).data, r"format 'T\{"),
        ((ctypes.c_void_p * 2)(), "format '<P'"),  # pointers mean nothing in another process
    ],
)
def test_buffers_of_objects_or_pointers_are_refused_naming_the_dtype(data: Any, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        as_view(data)


@pytest.mark.parametrize("data", ["text", 12, None, [1, 2], {"a": 1}])
def test_objects_without_a_buffer_are_refused_naming_the_type(data: Any) -> None:
    with pytest.raises(InvalidArgument, match=f"not {type(data).__name__}"):
        as_view(data, what="buffer")


def test_strided_buffers_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        as_view(np.arange(10)[::2])
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        as_view(np.zeros((3, 3)).T)
    with pytest.raises(InvalidArgument, match=r"C-contiguous \(numpy array of shape \(2,\)\)"):
        as_view(np.zeros(4, dtype=[("a", "<i4")])[::2])
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        as_view(memoryview(bytes(8))[::2])


def test_empty_buffers_of_any_shape_are_empty_views() -> None:
    assert as_view(np.zeros((0, 4), dtype=np.float32), writable=True).nbytes == 0
    assert as_view(np.zeros((2, 0)).data).nbytes == 0
    assert as_view(b"").nbytes == 0 and as_view(bytearray(), writable=True).nbytes == 0


def test_read_only_buffers_are_refused_only_when_a_writable_one_is_needed() -> None:
    assert as_view(b"abc").readonly
    with pytest.raises(InvalidArgument, match="buffer is read-only"):
        as_view(b"abc", writable=True, what="buffer")
    frozen = np.zeros(4, dtype=np.uint8)
    frozen.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        as_view(frozen, writable=True)
    stamps = np.zeros(2, dtype="datetime64[s]")
    stamps.flags.writeable = False
    with pytest.raises(InvalidArgument, match="read-only"):
        as_view(stamps, writable=True)


# -- torch ---------------------------------------------------------------------------------------


def test_cpu_tensors_of_every_dtype_are_shared_byte_views() -> None:
    torch = pytest.importorskip("torch")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8):
        tensor = torch.zeros((3, 4), dtype=dtype)
        view = as_view(tensor, writable=True)
        assert view.nbytes == tensor.numel() * tensor.element_size()
        view[0] = 1
        assert tensor.view(-1).view(torch.uint8)[0].item() == 1
    assert as_view(torch.nn.Parameter(torch.ones(3))).nbytes == 12  # a subclass of Tensor
    assert as_view(torch.ones(3, requires_grad=True)).nbytes == 12


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda t: t.ones(4, 4).t(), r"tensor of shape \(4, 4\) is not contiguous; pass .contiguous\(\)"),
        (lambda t: t.ones(8)[::2], "not contiguous"),
        (lambda t: t.ones(4, device="meta"), "tensor is on meta; only CPU tensors"),
        (lambda t: t.ones(4).to_sparse(), "layout torch.sparse_coo; only dense"),
        (lambda t: t.ones(2, dtype=t.complex64).conj(), "pending conjugation"),
        (lambda t: t._neg_view(t.ones(2)), "pending conjugation or negation"),
    ],
)
def test_tensors_whose_memory_cannot_be_viewed_as_is_are_refused(make: Any, match: str) -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidArgument, match=match):
        as_view(make(torch))


def test_gpu_tensors_are_refused_naming_the_device() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    with pytest.raises(InvalidArgument, match=r"tensor is on cuda:0; only CPU tensors.*\.cpu\(\)"):
        as_view(torch.ones(4, device="cuda"))


def test_objects_from_torch_that_are_not_tensors_are_not_taken_for_tensors() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidArgument, match="not Size"):
        as_view(torch.Size([2, 3]))
