"""Mooncake's ``BufferPool`` (``mooncake.buffer_pool``) for the drop-in store: leases of memory a
store's ``put_from``/``get_into`` take, carved from the store's local buffer (``setup``'s
``local_buffer_size``) and, past it, from overflow regions registered with the store for the
lease's life.

As Mooncake's: the pool holds up to ``max_bytes`` at once (0: twice the local buffer), each lease
``max(size, 1)`` bytes of it; ``max_regions`` bounds the leases out at once; ``acquire`` blocks
(``block_on_exhaustion``), waits at most ``timeout`` seconds, or raises at once; a lease's
``buffer`` is a writable memoryview of ``size`` bytes at ``ptr``, and while a view of it is alive
the lease cannot be released; a lease released by its destructor is fine, a pool closed with
leases out is not. Errors are ``RuntimeError`` with Mooncake's words. Local leases are 64-byte
aligned; overflow regions ``alignment``-aligned (a power of two, at least 8).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
import threading
import time
from typing import TYPE_CHECKING

from kvstore.allocator import Allocator, Extent

if TYPE_CHECKING:
    from kvstore_client.compat.mooncake import MooncakeDistributedStore

LOCAL_ALIGNMENT = 64


class _Region:
    """Memory a lease uses: an extent of the local buffer, or an overflow mapping of its own."""

    __slots__ = ("extent", "mapping", "ptr", "size")

    def __init__(self, ptr: int, size: int, extent: Extent | None = None, mapping: mmap.mmap | None = None) -> None:
        self.ptr, self.size, self.extent, self.mapping = ptr, size, extent, mapping


class BufferLease:
    """One acquired buffer: ``ptr``, ``size`` and ``buffer``; :meth:`release` (or ``with``) gives it back."""

    def __init__(self, pool: BufferPool, region: _Region, size: int) -> None:
        self._pool: BufferPool | None = pool
        self._region = region
        self._size = size
        self._raw: ctypes.Array[ctypes.c_ubyte] | None = (ctypes.c_ubyte * size).from_address(region.ptr)
        self._refs = sys.getrefcount(self._raw)
        """References to ``_raw`` with no view out: each view handed out holds one more (CPython's
        memoryviews keep their exporter), so that release can tell a live view."""

    @property
    def ptr(self) -> int:
        self._open()
        return self._region.ptr

    @property
    def size(self) -> int:
        return self._size

    @property
    def buffer(self) -> memoryview:
        return memoryview(self._open()).cast("B")

    def _open(self) -> ctypes.Array[ctypes.c_ubyte]:
        if self._raw is None:
            raise RuntimeError("buffer lease is closed")
        return self._raw

    def release(self) -> None:
        raw = self._open()
        if sys.getrefcount(raw) > self._refs + 1:  # + this frame's
            raise RuntimeError("cannot release buffer while exported views exist")
        del raw
        self._raw = None
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._give_back(self._region)

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._raw is not None:
                self.release()


class BufferPool:
    """See the module's text. Thread-safe."""

    def __init__(
        self,
        store: MooncakeDistributedStore,
        max_bytes: int = 0,
        min_size_class: int = 64 * 1024,
        max_size_class: int | None = None,
        alignment: int = 8 * 1024 * 1024,
        block_on_exhaustion: bool = True,
        default_timeout: float | None = None,
        max_regions: int | None = None,
        prewarm_size: int | None = None,
        prewarm_count: int = 0,
    ) -> None:
        if store is None or not hasattr(store, "local_region") or store.local_region() is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if min_size_class <= 0 or alignment <= 0:
            raise RuntimeError("min_size_class and alignment must be positive")
        if alignment < ctypes.sizeof(ctypes.c_void_p) or alignment & (alignment - 1):
            raise RuntimeError("alignment must be a power of two and at least sizeof(void*)")
        local = store.local_region()
        assert local is not None
        ptr, capacity = local
        if capacity == 0:
            raise RuntimeError("BufferPool requires a store configured with a local buffer")
        self._store = store
        self._local_ptr = ptr
        self._local = Allocator(capacity, LOCAL_ALIGNMENT, track=False)
        self.max_bytes = max(max_bytes, capacity) if max_bytes else 2 * capacity
        self.max_size_class = self.max_bytes if max_size_class is None else max_size_class
        self.min_size_class = min_size_class
        self.alignment = alignment
        self.block_on_exhaustion = block_on_exhaustion
        self.default_timeout = default_timeout
        self.max_regions = max_regions
        self._lock = threading.Condition()
        self._total = 0
        self._out = 0
        self._closed = False

    def acquire(self, size: int, block: bool | None = None, timeout: float | None = None) -> BufferLease:
        """A lease of ``size`` bytes (see the module's text)."""
        if size < 0:
            raise RuntimeError("requested buffer size must be non-negative")
        wait = self.block_on_exhaustion if block is None else block
        timeout = self.default_timeout if timeout is None else timeout
        if timeout is not None and timeout < 0:
            raise RuntimeError("timeout must be non-negative")
        need = max(size, 1)
        if need > self.max_bytes:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                self._raise_if_closed()
                if self._has_room(need):
                    region = self._carve(need)
                    self._total += need
                    self._out += 1
                    return BufferLease(self, region, size)
                if not wait:
                    raise RuntimeError("buffer pool is exhausted")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RuntimeError("timed out waiting for buffer")
                self._lock.wait(left)

    buffer = acquire

    def prewarm(self, size: int, count: int) -> None:
        """Nothing to warm: regions are carved as asked (as Mooncake's, a no-op)."""

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._out:
                raise RuntimeError("cannot close buffer pool with active leases")
            self._closed = True
            self._lock.notify_all()

    # -- inside --------------------------------------------------------------------------------
    def _raise_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("buffer pool is closed")

    def _has_room(self, need: int) -> bool:
        if self._total + need > self.max_bytes:
            return False
        return self.max_regions is None or self._out < self.max_regions

    def _carve(self, need: int) -> _Region:
        extent = self._local.alloc(need)
        if extent is not None:
            return _Region(self._local_ptr + extent.offset, need, extent=extent)
        # Past the local buffer: a mapping of its own (page-aligned; an alignment above a page is
        # had by mapping that much more), registered with the store while the lease lives.
        span = need + (self.alignment if self.alignment > mmap.PAGESIZE else 0)
        mapping = mmap.mmap(-1, span)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        ptr = -(-base // self.alignment) * self.alignment
        if self._store.register_buffer(ptr, need) != 0:
            mapping.close()
            raise RuntimeError("overflow buffer registration failed")
        return _Region(ptr, need, mapping=mapping)

    def _give_back(self, region: _Region) -> None:
        with self._lock:
            if region.extent is not None:
                self._local.free(region.extent)
            self._total -= region.size
            self._out -= 1
            self._lock.notify_all()
        if region.mapping is not None:
            self._store.unregister_buffer(region.ptr)
            _close_mapping(region.mapping)


def _close_mapping(mapping: mmap.mmap) -> None:
    """Unmap an overflow region (its ``from_buffer`` export is dropped with the view that made it)."""
    with contextlib.suppress(BufferError):
        mapping.close()


RegisteredBufferPool = BufferPool

__all__ = ["BufferLease", "BufferPool", "RegisteredBufferPool"]
