"""Mooncake Store's Python API on kvstore: engines that call ``mooncake.store`` switch by import.

``MooncakeDistributedStore`` keeps Mooncake's method names, argument orders and return
conventions: ints are 0 or a negative :class:`ErrorCode`, ``get`` returns ``b""`` for a miss,
``get_into`` the bytes read. ``kvstore compat-path mooncake`` prints a directory that, put on
``PYTHONPATH``, makes ``from mooncake.store import MooncakeDistributedStore`` load this module.

How Mooncake's ideas map onto kvstore:

- ``setup(..., global_segment_size, ...)``: a segment is DRAM the client gives the pool. The client
  starts a daemon on its host serving that much (:mod:`.segment`), named by ``get_hostname()``,
  and puts prefer it. ``close()`` stops it and the master forgets the blocks held only there,
  as Mooncake unmounts a closing client's segment.
- ``local_buffer_size``: Mooncake stages ``put``/``get`` bytes in this client buffer; here it is
  the largest value those copy in or out (0: they fail with INVALID_PARAMS, as in Mooncake).
  ``put_from``/``get_into`` go straight from and to registered memory.
- Read leases: start the master with ``--default-kv-lease-ttl MS``. A hit of a get, exists or
  get_size holds the key that long; ``remove`` without force then answers OBJECT_HAS_LEASE and
  ``remove_all`` skips it. Reads go through the master here (no location hints), so that the
  hold starts at the read.
- Raw addresses: ``put_from``/``get_into`` and their batch forms take only addresses inside a
  buffer given to ``register_buffer``, so a bad address is INVALID_PARAMS, never a segfault.
- ``ReplicateConfig``: ``replica_num`` copies on distinct nodes; ``with_hard_pin`` pins;
  ``preferred_segment(s)`` is the node of the first replica. Soft pins are checked as Mooncake
  checks them (a TTL needs ENABLE) but not kept: kvstore's eviction knows only hard pins.
- ``metadata_server``, ``rdma_devices`` and ``engine`` are accepted and unused: kvstore needs no
  metadata service, and picks its transport (TCP, shared memory, UCX) per node by itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import re
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, TypeVar

from kvstore.buffers import as_view
from kvstore.config import ClientConfig
from kvstore.errors import BufferTooSmall, InvalidArgument, KVStoreError, StoreClosed
from kvstore_client.compat.mooncake_types import (
    INFINITE,
    MAX_SOFT_PIN_TTL_MS,
    BufferHandle,
    ErrorCode,
    ObjectDataType,
    Registered,
    ReplicateConfig,
    SoftPinAction,
    check,
    error_code,
    parse_size,
)
from kvstore_client.compat.segment import Segment, node_id, split_hostname
from kvstore_client.compat.tensors import HEADER_BYTES, TensorMethods, deserialize, serialize_parts
from kvstore_client.puts import PutOptions
from kvstore_client.store import Store

log = logging.getLogger("kvstore.compat.mooncake")

T = TypeVar("T")


_DICT_DEFAULTS: dict[str, Any] = {
    "global_segment_size": 16 << 20, "local_buffer_size": 16 << 20, "protocol": "tcp", "rdma_devices": "",
    "master_server_addr": "127.0.0.1:50051", "tenant_id": "default", "ssd_offload_path": "",
    "enable_ssd_offload": "false", "enable_client_http_server": "false", "client_http_port": "9300",
}  # fmt: skip
_DICT_KEYS = frozenset({*_DICT_DEFAULTS, "local_hostname", "metadata_server", "ipc_socket_path"})


class MooncakeDistributedStore(TensorMethods):
    """Mooncake Store's client (see the module docstring); thread-safe once set up."""

    def __init__(self) -> None:
        self._store: Store | None = None
        self._segment: Segment | None = None
        self._hostname = ""
        self._local_buffer = 0
        self._local_map: mmap.mmap | None = None
        """The local buffer's memory, mapped on first use (a BufferPool's leases are carved from it)."""
        self._old_maps: list[mmap.mmap] = []
        self._buffers = Registered()
        self._lock = threading.Lock()
        self.timeout_s = 30.0
        """Bound on each network wait, and on a segment's daemon starting."""

    # -- set up and close ----------------------------------------------------------------------
    def setup(self, *args: Any, **kwargs: Any) -> int:
        """``setup(local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
        rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False, ssd_offload_path="",
        tenant_id="default", enable_client_http_server=False, client_http_port=9300)``, or
        ``setup(config_dict)``. 0, or a negative ErrorCode."""
        if len(args) == 1 and not kwargs and isinstance(args[0], dict):
            return self._setup_dict(args[0])
        return self._setup(*args, **kwargs)

    def _setup(
        self, local_hostname: str, metadata_server: str, global_segment_size: int, local_buffer_size: int,
        protocol: str, rdma_devices: str, master_server_addr: str, engine: Any = None,
        enable_ssd_offload: bool = False, ssd_offload_path: str = "", tenant_id: str = "default",
        enable_client_http_server: bool = False, client_http_port: int = 9300,
    ) -> int:  # fmt: skip
        for name, value, kind in (
            ("local_hostname", local_hostname, str), ("metadata_server", metadata_server, str),
            ("protocol", protocol, str), ("rdma_devices", rdma_devices, str),
            ("master_server_addr", master_server_addr, str), ("enable_ssd_offload", enable_ssd_offload, bool),
            ("ssd_offload_path", ssd_offload_path, str), ("tenant_id", tenant_id, str),
            ("enable_client_http_server", enable_client_http_server, bool),
        ):  # fmt: skip
            check(name, value, kind)
        check("global_segment_size", global_segment_size, int, unsigned=True)
        check("local_buffer_size", local_buffer_size, int, unsigned=True)
        check("client_http_port", client_http_port, int)
        return self._start(local_hostname, global_segment_size, local_buffer_size, protocol, master_server_addr)

    def _setup_dict(self, config: dict[Any, Any]) -> int:
        # Mooncake reads every key and value through str(); unknown keys are ignored (named in a warning here).
        given = {str(k): v for k, v in config.items()}
        for unknown in sorted(set(given) - _DICT_KEYS):
            log.warning("setup: unknown key %r ignored", unknown)
        merged = {**_DICT_DEFAULTS, **given}
        hostname, metadata = str(merged.get("local_hostname", "")), str(merged.get("metadata_server", ""))
        try:
            if not hostname or not metadata:
                raise InvalidArgument("setup needs local_hostname and metadata_server")
            segment = parse_size(merged["global_segment_size"], "global_segment_size")
            buffer = parse_size(merged["local_buffer_size"], "local_buffer_size")
            if 0 < segment < 1024 or 0 < buffer < 1024 or buffer > 1 << 40:
                raise InvalidArgument("segment and buffer sizes must be 0 or at least 1 KB (a buffer at most 1 TB)")
            if not str(merged["client_http_port"]).strip().isdigit():
                raise InvalidArgument(f"client_http_port {merged['client_http_port']!r} is not a port")
        except InvalidArgument as exc:
            log.error("setup: %s", exc)
            return int(ErrorCode.INVALID_PARAMS)
        return self._start(hostname, segment, buffer, str(merged["protocol"]), str(merged["master_server_addr"]))

    def _start(self, hostname: str, segment_size: int, buffer_size: int, protocol: str, master: str) -> int:
        with self._lock:
            self._close()
            try:
                if protocol not in ("tcp", "rdma"):
                    raise InvalidArgument(f"protocol {protocol!r}: tcp or rdma")
                if segment_size == INFINITE:
                    raise InvalidArgument("an infinite global segment cannot be served")
                host, port = split_hostname(hostname)
                # No location hints: every read asks the master, which holds the key from then on.
                store = Store.connect(master, ClientConfig(timeout_s=self.timeout_s, location_hints=0))
            except KVStoreError as exc:
                log.error("setup: %s", exc)
                return error_code(exc)
            segment = None
            if segment_size:
                try:
                    segment = Segment.start(store, master, host, port, segment_size, self.timeout_s)
                except KVStoreError as exc:
                    log.error("setup: the segment could not be served: %s", exc)
                    store.close()
                    return error_code(exc)
            self._store, self._segment, self._local_buffer = store, segment, buffer_size
            self._hostname = segment.name if segment is not None else f"{host}:{port or 0}"
            return 0

    def close(self) -> int:
        """Stop using the cluster; the segment's blocks held nowhere else are gone. 0, also when closed."""
        with self._lock:
            self._close()
        return 0

    def _close(self) -> None:
        store, segment = self._store, self._segment
        self._store = self._segment = None
        self._buffers.clear()
        if store is not None:
            store.close()
        if segment is not None:
            segment.stop()

    def local_region(self) -> tuple[int, int] | None:
        """The local buffer (``local_buffer_size`` bytes at an address ``put_from``/``get_into`` take),
        as (address, size): mapped and registered on first use, kept while this object lives (a
        lease may outlive a close). (0, 0) with no local buffer; None before setup."""
        with self._lock:
            if self._store is None:
                return None
            size = self._local_buffer
            if not size:
                return 0, 0
            if self._local_map is None or len(self._local_map) != size:
                if self._local_map is not None:  # a new setup's size: the old stays mapped for its leases
                    self._old_maps.append(self._local_map)
                self._local_map = mmap.mmap(-1, size)
            ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._local_map))
            if self._buffers.room(ptr) < size:
                self._buffers.add(ptr, size)
            return ptr, size

    def health_check(self) -> int:
        """0: healthy; 1: not set up; 2: the master does not answer."""
        store = self._store
        if store is None:
            return 1
        try:
            store.stats()
        except KVStoreError:
            return 2
        return 0

    def get_hostname(self) -> str:
        """This client's segment name, ``host:port``."""
        return self._hostname

    # -- helpers -------------------------------------------------------------------------------
    def _client(self) -> Store:
        store = self._store
        if store is None:
            raise StoreClosed("MooncakeDistributedStore is not set up (call setup first)")
        return store

    def _options(self, config: ReplicateConfig | None) -> PutOptions:
        config = config if config is not None else ReplicateConfig()
        if not isinstance(config, ReplicateConfig):
            raise TypeError(f"config must be a ReplicateConfig, got {type(config).__name__}")
        if config.soft_pin_ttl_ms is not None and (
            config.soft_pin_action is not SoftPinAction.ENABLE or config.soft_pin_ttl_ms > MAX_SOFT_PIN_TTL_MS
        ):
            raise InvalidArgument("soft_pin_ttl_ms is taken only with SoftPinAction.ENABLE, up to 24 h")
        if config.prefer_alloc_in_same_node:
            raise InvalidArgument("prefer_alloc_in_same_node is not supported by put")
        if not 1 <= config.replica_num <= 16:
            raise InvalidArgument(f"replica_num must be from 1 to 16, got {config.replica_num}")
        preferred = config.preferred_segments[0] if config.preferred_segments else config.preferred_segment
        node = None
        if preferred:
            node = node_id(preferred)
        elif self._segment is not None:
            node = self._segment.node_id
        return PutOptions(replicas=config.replica_num, pin=config.with_hard_pin, preferred_node=node)

    def _staged(self, size: int) -> None:
        """Refuse what the local buffer (Mooncake's staging memory for put and get) cannot hold."""
        if size > self._local_buffer:
            raise InvalidArgument(
                f"a value of {size} bytes does not fit the local buffer of {self._local_buffer} bytes"
                " (local_buffer_size)"
            )

    @staticmethod
    def _run(call: Callable[[], T], failed: Callable[[int], T]) -> T:
        try:
            return call()
        except KVStoreError as exc:
            log.debug("%s", exc)
            return failed(error_code(exc))

    def _put_views(self, keys: Sequence[Any], views: Sequence[memoryview], config: ReplicateConfig | None) -> list[int]:
        """Put each (key, view); per key 0 or a negative code. Empty values store nothing (0)."""
        store = self._client()
        options = self._options(config)
        todo = [i for i, v in enumerate(views) if v.nbytes]
        out = [0] * len(keys)
        try:
            store.put_many([(keys[i], views[i]) for i in todo], options)
        except KVStoreError:
            for i in todo:  # which ones failed, and why (stored, or there already: 0)
                try:
                    store.put(keys[i], views[i], options)
                except KVStoreError as exc:
                    out[i] = error_code(exc)
        return out

    def _remove_first(self, keys: Sequence[Any]) -> None:
        self._client().remove_many(list(keys), force=True)

    # -- put -----------------------------------------------------------------------------------
    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (any bytes-like buffer) under ``key``; an existing key keeps its bytes (0)."""
        return self.put_batch([key], [value], config)

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the parts, joined, under ``key``."""
        return self._run(lambda: self.put(key, b"".join(as_view(p, what="part") for p in parts), config), int)

    def put_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None) -> int:
        """Store every (key, value): 0, or the first failure's code."""

        def put() -> int:
            if len(keys) != len(values):
                raise InvalidArgument(f"put_batch got {len(keys)} keys but {len(values)} values")
            views = [as_view(v, what="value") for v in values]
            for v in views:
                self._staged(v.nbytes)
            return next((c for c in self._put_views(keys, views, config) if c), 0)

        return self._run(put, int)

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` under ``key``, replacing what is there."""
        return self.upsert_batch([key], [value], config)

    def upsert_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        return self._run(lambda: self.upsert(key, b"".join(as_view(p, what="part") for p in parts), config), int)

    def _put_values(self, keys: list[str], values: list[bytes], upsert: bool) -> list[int]:
        """Per key 0 or a negative code (the tensor methods' puts)."""
        try:
            for v in values:
                self._staged(len(v))
            if upsert:
                self._remove_first(keys)
            return self._put_views(keys, [memoryview(v) for v in values], None)
        except KVStoreError as exc:
            return [error_code(exc)] * len(keys)

    def _registered(self, ptr: int, size: int) -> memoryview:
        return self._buffers.view(ptr, size)

    def upsert_batch(self, keys: list[str], values: list[Any], config: ReplicateConfig | None = None) -> int:
        def upsert() -> int:
            self._options(config)  # a bad config changes nothing
            self._remove_first(keys)
            return self.put_batch(keys, values, config)

        return self._run(upsert, int)

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """Store ``size`` bytes of registered memory at ``buffer_ptr`` under ``key``."""
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        """Per key 0 or a negative code; lists of different lengths fail every key (nothing is put)."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        views = [partial(self._buffers.view, ptr, size) for ptr, size in zip(buffer_ptrs, sizes, strict=True)]
        return self._on_views(keys, views, partial(self._put_codes, config=config))

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_upsert_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        try:
            self._options(config)  # a bad config changes nothing
            self._remove_first(keys)
        except KVStoreError as exc:
            return [error_code(exc)] * len(keys)
        return self.batch_put_from(keys, buffer_ptrs, sizes, config)

    def batch_put_from_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:  # fmt: skip
        """Each key's value is its buffers joined, in order."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        views = [partial(self._joined, ptrs, sizes) for ptrs, sizes in zip(all_buffer_ptrs, all_sizes, strict=True)]
        return self._on_views(keys, views, partial(self._put_codes, config=config))

    def _joined(self, ptrs: list[int], sizes: list[int]) -> memoryview:
        """One key's registered buffers, joined in order (a copy)."""
        if len(ptrs) != len(sizes):
            raise InvalidArgument(f"{len(ptrs)} buffers but {len(sizes)} sizes")
        return memoryview(b"".join(self._buffers.view(p, s) for p, s in zip(ptrs, sizes, strict=True)))

    def _on_views(
        self, keys: list[str], views: Sequence[Callable[[], memoryview]],
        op: Callable[[list[str], list[memoryview]], list[int]],
    ) -> list[int]:  # fmt: skip
        """Per key INVALID_PARAMS where its memory cannot be had (``views[i]()`` raises), else what
        ``op`` answers for the keys whose memory can, called once for all of them."""
        out = [0] * len(keys)
        good: list[int] = []
        got: list[memoryview] = []
        for i, view in enumerate(views):
            try:
                got.append(view())
                good.append(i)
            except InvalidArgument:
                out[i] = int(ErrorCode.INVALID_PARAMS)
        for i, code in zip(good, op([keys[i] for i in good], got), strict=True):
            out[i] = code
        return out

    def _put_codes(self, keys: list[str], views: list[memoryview], config: ReplicateConfig | None) -> list[int]:
        try:
            return self._put_views(keys, views, config)
        except KVStoreError as exc:
            return [error_code(exc)] * len(keys)

    # -- get -----------------------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        """The value of ``key``; ``b""`` for a miss or a failure."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        def get() -> list[bytes]:
            got = self._client().get_many(keys)
            return [b"" if g is None or len(g) > self._local_buffer else g for g in got]

        return self._run(get, lambda _: [b""] * len(keys))

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The value of ``key`` in a :class:`BufferHandle`; None for a miss or a failure."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: list[str]) -> list[BufferHandle | None]:
        def get() -> list[BufferHandle | None]:
            store = self._client()
            sizes = store.sizes(keys)
            handles = [BufferHandle(s) if s is not None and 0 < s <= self._local_buffer else None for s in sizes]
            wanted = [i for i, h in enumerate(handles) if h is not None]
            got = store.get_many_into([keys[i] for i in wanted], [handles[i] for i in wanted], exact_size=True)
            for i, n in zip(wanted, got, strict=True):
                if n is None:
                    handles[i] = None  # removed or replaced since its size was asked
            return handles

        return self._run(get, lambda _: [None] * len(keys))

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Read ``key`` into registered memory: the bytes read, or a negative code (OBJECT_NOT_FOUND,
        INVALID_PARAMS for memory not registered or too small)."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        views = [partial(self._buffers.view, ptr, size) for ptr, size in zip(buffer_ptrs, sizes, strict=True)]
        return self._on_views(keys, views, self._read_into)

    def _read_into(self, keys: list[Any], views: list[memoryview]) -> list[int]:
        """Per key the bytes read into its view, or a negative code."""
        store = self._client()
        try:
            got = store.get_many_into(keys, views)
        except BufferTooSmall:
            return [self._read_one(store, key, view) for key, view in zip(keys, views, strict=True)]
        except KVStoreError as exc:
            return [error_code(exc)] * len(keys)
        return [n if n is not None else int(ErrorCode.OBJECT_NOT_FOUND) for n in got]

    @staticmethod
    def _read_one(store: Store, key: Any, view: memoryview) -> int:
        try:
            n = store.get_into(key, view)
        except KVStoreError as exc:
            return error_code(exc)
        return n if n is not None else int(ErrorCode.OBJECT_NOT_FOUND)

    def _values(self, keys: list[str]) -> list[bytes | int]:
        """Each key's value, or a negative code (OBJECT_NOT_FOUND, or the failure of them all)."""
        try:
            got = self._client().get_many(keys)
        except KVStoreError as exc:
            return [error_code(exc)] * len(keys)
        return [g if g is not None else int(ErrorCode.OBJECT_NOT_FOUND) for g in got]

    def batch_get_into_multi_buffers(
        self, keys: list[str], all_buffer_ptrs: list[list[int]], all_sizes: list[list[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:  # fmt: skip
        """Each key's value spread over its buffers, in order: per key the bytes read, or a negative code."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes):
            return [int(ErrorCode.INVALID_PARAMS)] * len(keys)
        out = []
        for ptrs, sizes, value in zip(all_buffer_ptrs, all_sizes, self._values(keys), strict=True):
            try:
                out.append(value if isinstance(value, int) else self._scatter(ptrs, sizes, value))
            except KVStoreError as exc:
                out.append(error_code(exc))
        return out

    def _scatter(self, ptrs: list[int], sizes: list[int], value: bytes) -> int:
        if len(ptrs) != len(sizes) or sum(sizes) < len(value):
            raise InvalidArgument(f"buffers of {sum(sizes)} bytes cannot hold a value of {len(value)}")
        at = 0
        for ptr, size in zip(ptrs, sizes, strict=True):
            view = self._buffers.view(ptr, size)
            n = min(size, len(value) - at)
            view[:n] = value[at : at + n]
            at += n
        return len(value)

    def get_into_ranges(
        self, buffer_ptrs: list[int], all_keys: list[list[str]], all_dst_offsets: list[list[list[int]]],
        all_src_offsets: list[list[list[int]]], all_sizes: list[list[list[int]]],
    ) -> list[list[list[int]]]:  # fmt: skip
        """Copy byte ranges of values into registered buffers: per buffer, per key, per fragment the
        bytes copied or a negative code (shapes follow ``all_dst_offsets``)."""
        bad = int(ErrorCode.INVALID_PARAMS)
        out = [[[bad] * len(d) for d in dsts] for dsts in all_dst_offsets]
        if not len(buffer_ptrs) == len(all_keys) == len(all_dst_offsets) == len(all_src_offsets) == len(all_sizes):
            return out
        wanted = sorted({k for keys in all_keys for k in keys})
        values = dict(zip(wanted, self._values(wanted), strict=True))
        for b, (ptr, keys, dsts, srcs, sizes) in enumerate(
            zip(buffer_ptrs, all_keys, all_dst_offsets, all_src_offsets, all_sizes, strict=True)
        ):
            room = self._buffers.room(ptr) if isinstance(ptr, int) and ptr >= 0 else 0
            if not room or not len(keys) == len(dsts) == len(srcs) == len(sizes):
                continue
            for k, key in enumerate(keys):
                if not len(dsts[k]) == len(srcs[k]) == len(sizes[k]):
                    continue
                value = values[key]
                for f, (dst, src, size) in enumerate(zip(dsts[k], srcs[k], sizes[k], strict=True)):
                    if isinstance(value, int):
                        out[b][k][f] = value
                    elif min(dst, src, size) >= 0 and dst + size <= room and src + size <= len(value):
                        self._buffers.view(ptr + dst, size)[:] = value[src : src + size]
                        out[b][k][f] = size
        return out

    # -- register ------------------------------------------------------------------------------
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Let ``put_from``/``get_into`` use ``size`` bytes at ``buffer_ptr`` (the caller keeps them alive)."""
        check("buffer_ptr", buffer_ptr, int, unsigned=True)
        check("size", size, int, unsigned=True)
        if not buffer_ptr or not size:
            return int(ErrorCode.INVALID_PARAMS)
        self._buffers.add(buffer_ptr, size)
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        check("buffer_ptr", buffer_ptr, int, unsigned=True)
        return 0 if self._buffers.remove(buffer_ptr) else int(ErrorCode.INVALID_PARAMS)

    # -- queries -------------------------------------------------------------------------------
    def is_exist(self, key: str) -> int:
        """1 stored, 0 not, or a negative code."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return self._run(lambda: [int(e) for e in self._client().exists_many(keys)], lambda c: [c] * len(keys))

    def get_size(self, key: str) -> int:
        """The size of ``key``'s value, or a negative code (OBJECT_NOT_FOUND)."""
        return self._run(lambda: _size(self._client().sizes([key])[0]), int)

    # -- remove --------------------------------------------------------------------------------
    def remove(self, key: str, force: bool = False) -> int:
        """0, OBJECT_NOT_FOUND, or OBJECT_HAS_LEASE while a read holds it (unless ``force``)."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        def remove() -> list[int]:
            store = self._client()
            out = []
            for key in keys:  # one at a time: the master answers a count, and which were held
                removed, held = store.remove_report([key], force=force)
                out.append(0 if removed else ErrorCode.OBJECT_HAS_LEASE if held else ErrorCode.OBJECT_NOT_FOUND)
            return [int(c) for c in out]

        return self._run(remove, lambda c: [c] * len(keys))

    def batch_replica_clear(self, keys: list[str], segment_name: str = "") -> list[str]:
        """Drop the replicas of ``keys`` on the segment ``segment_name`` (``host:port``, as
        ``get_hostname()`` names one; all replicas when ""); a key left with none is gone. Keys a read
        holds (``--default-kv-lease-ttl``) are skipped. The keys cleared ([] on an error)."""
        check("segment_name", segment_name, str)
        node = node_id(segment_name) if segment_name else ""
        return self._run(lambda: self._client().clear_replicas(keys, node), lambda c: [])

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Remove every key ``regex_pattern`` matches (``re.search``): how many, or a negative code."""
        try:
            pattern = re.compile(check("regex_pattern", regex_pattern, str))
        except re.error as exc:
            log.error("remove_by_regex: %s", exc)
            return int(ErrorCode.INVALID_PARAMS)
        return self._remove_matching(pattern.search, force)

    def remove_all(self, force: bool = False) -> int:
        """Remove every key (those a read holds are skipped unless ``force``): how many, or a negative code."""
        return self._remove_matching(lambda key: True, force)

    def _remove_matching(self, match: Callable[[str], Any], force: bool) -> int:
        def remove() -> int:
            store = self._client()
            removed = 0
            batch: list[str] = []
            for key in store.iter_keys():
                if match(key):
                    batch.append(key)
                if len(batch) == 1000:
                    removed += store.remove_many(batch, force=force)
                    batch = []
            return removed + (store.remove_many(batch, force=force) if batch else 0)

        return self._run(remove, int)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._close()


def _size(size: int | None) -> int:
    return size if size is not None else int(ErrorCode.OBJECT_NOT_FOUND)


# mooncake.store's tensor codec, which Mooncake's own Python (structured_object_store) calls.
_serialize_tensor = serialize_parts
"""(header, data address, data bytes, owner) of a tensor in Mooncake's layout."""
_deserialize_tensor = deserialize
"""The tensor in a header-then-data payload; InvalidArgument (a ValueError) when it is not one."""


def _tensor_metadata_size() -> int:
    """The bytes of the header before a tensor's data."""
    return HEADER_BYTES


from kvstore_client.compat.buffer_pool import BufferLease, BufferPool, RegisteredBufferPool  # noqa: E402

__all__ = [
    "BufferHandle",
    "BufferLease",
    "BufferPool",
    "ErrorCode",
    "MooncakeDistributedStore",
    "ObjectDataType",
    "RegisteredBufferPool",
    "ReplicateConfig",
    "SoftPinAction",
]
