"""SGLang HiCache storage backend on the store (the ``dynamic`` backend).

Start SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-mem-layout page_first
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore_client.adapters.sglang", "class_name": "KVStoreHiCache",
        "master": "127.0.0.1:50051", "interface_v1": 1}'

SGLang names each page of its host KV pool by a hash of the page's tokens and their
prefix. With ``interface_v1`` the cache controller calls the zero-copy
``batch_set_v1`` / ``batch_get_v1``: each page goes to the store straight from the
host pool and comes back straight into it, as one object for K and one for V (one for
an MLA page), which the ``page_first`` and ``page_first_direct`` layouts hold
contiguously. Without it the controller uses ``batch_set`` / ``batch_get`` with a
flat copy of each page (any layout), stored as one object. ``batch_exists`` answers
with the store's longest stored prefix in one round trip.

Keys are ``sgl/<tag>/<page hash>/<part>``: the tag is a digest of everything that
makes a page's bytes what they are (model, tensor-parallel rank unless MLA, pipeline
stage, context-parallel rank, host pool geometry, dtype, layout, interface), so pages
of other models, ranks or layouts never answer. A store that cannot be reached makes
pages misses and writes failures, never an exception into SGLang.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvstore.config import ClientConfig
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore_client.store import Store

log = logging.getLogger(__name__)

ZERO_COPY_LAYOUTS = ("page_first", "page_first_direct")
MAX_TRACKED_KEYS = 1 << 20
"""Keys this backend remembers writing, for :meth:`KVStoreHiCache.clear`."""


class KVStoreHiCache(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        master = extra.get("master") or os.environ.get("KVSTORE_MASTER")
        if not master:
            raise InvalidArgument("KVStoreHiCache needs extra_config.master (or $KVSTORE_MASTER)")
        self.config = storage_config
        self.zero_copy = bool(extra.get("interface_v1", 0))
        self.parts = ("m",) if storage_config.is_mla_model else ("k", "v")
        self.store = Store.connect(str(master), ClientConfig(timeout_s=float(extra.get("timeout_s", 10.0))))
        self.mem_pool_host: Any = None
        self._tag = self._make_tag(None)
        self._written: set[str] = set()
        self._lock = threading.Lock()

    # -- identity ----------------------------------------------------------------------------
    def _make_tag(self, pool: Any) -> str:
        c = self.config
        fields: list[Any] = [
            "kvstore-sglang-v1", c.model_name, None if c.is_mla_model else (c.tp_rank, c.tp_size),
            c.pp_rank, c.pp_size, c.attn_cp_rank, c.attn_cp_size, getattr(c, "dcp_rank", 0),
            getattr(c, "dcp_size", 1), self.zero_copy,
        ]  # fmt: skip
        if pool is not None:
            fields += [pool.layout, str(pool.dtype), tuple(pool.kv_buffer.shape[1:]), pool.page_size]
        return hashlib.sha256(json.dumps(fields, default=str).encode()).hexdigest()[:20]

    def _key(self, page: str, part: str = "p") -> str:
        return f"sgl/{self._tag}/{page}/{part}"

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        if self.zero_copy and mem_pool_host.layout not in ZERO_COPY_LAYOUTS:
            raise InvalidArgument(
                f"interface_v1 needs a host pool layout of {' or '.join(ZERO_COPY_LAYOUTS)}"
                f" (--hicache-mem-layout), not {mem_pool_host.layout!r}"
            )
        super().register_mem_pool_host(mem_pool_host)
        self._tag = self._make_tag(mem_pool_host)

    # -- zero copy (interface_v1) ----------------------------------------------------------------
    def _page_views(self, host_indices: torch.Tensor, pages: int) -> list[torch.Tensor]:
        """Contiguous views of each page's parts in the host pool, in key order (page 0's parts, page 1's ...)."""
        pool = self.mem_pool_host
        if pool is None:
            raise InvalidArgument("no host memory pool is registered")
        size = pool.page_size
        if host_indices.numel() != pages * size:
            raise InvalidArgument(f"{host_indices.numel()} host indices for {pages} pages of {size} tokens")
        starts = host_indices[::size].tolist()
        buf = pool.kv_buffer
        views = []
        for start in starts:
            for i in range(len(self.parts)):
                part = buf[i] if len(self.parts) == 2 else buf
                views.append(part[start : start + size] if pool.layout == "page_first" else part[start // size])
        return views

    def _part_keys(self, keys: Sequence[str]) -> list[str]:
        return [self._key(k, p) for k in keys for p in self.parts]

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        if not keys:
            return []
        try:
            objects = self._part_keys(keys)
            self.store.put_many(zip(objects, self._page_views(host_indices, len(keys)), strict=True))
        except KVStoreError as exc:
            log.warning("storing %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        self._remember(objects)
        return [True] * len(keys)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        if not keys:
            return []
        try:
            got = self.store.get_many_into(
                self._part_keys(keys), self._page_views(host_indices, len(keys)), exact_size=True
            )
        except KVStoreError as exc:
            log.warning("loading %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        n = len(self.parts)
        return [all(size is not None for size in got[i * n : (i + 1) * n]) for i in range(len(keys))]

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Pages stored from the first on: one prefix lookup for the whole batch."""
        if not keys:
            return 0
        objects = self._part_keys(keys) if self.zero_copy else [self._key(k) for k in keys]
        try:
            return self.store.match_prefix(objects) // (len(self.parts) if self.zero_copy else 1)
        except KVStoreError as exc:
            log.warning("looking up %d pages failed: %s", len(keys), exc)
            return 0

    # -- one object per page (the generic interface) ----------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        objects = [self._key(k) for k in keys]
        try:
            if target_locations is None:
                data = self.store.get_many(objects)
                return [torch.frombuffer(bytearray(d), dtype=torch.uint8) if d else None for d in data]
            got = self.store.get_many_into(objects, list(target_locations), exact_size=True)
        except KVStoreError as exc:
            log.warning("loading %d pages failed: %s", len(keys), exc)
            return [None] * len(keys)
        return [t if size is not None else None for t, size in zip(target_locations, got, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        data = values if values is not None else target_locations
        if data is None or len(data) != len(keys):
            raise InvalidArgument(f"batch_set got {len(keys)} keys and {0 if data is None else len(data)} values")
        objects = [self._key(k) for k in keys]
        try:
            self.store.put_many(zip(objects, [v.contiguous() for v in data], strict=True))
        except KVStoreError as exc:
            log.warning("storing %d pages failed: %s", len(keys), exc)
            return False
        self._remember(objects)
        return True

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- housekeeping ----------------------------------------------------------------------------
    def _remember(self, objects: list[str]) -> None:
        with self._lock:
            if len(self._written) + len(objects) <= MAX_TRACKED_KEYS:
                self._written.update(objects)

    def clear(self) -> None:
        """Remove the pages this backend stored (pages of other processes stay until the store evicts them)."""
        with self._lock:
            written, self._written = list(self._written), set()
        try:
            for i in range(0, len(written), 1024):
                self.store.remove_many(written[i : i + 1024])
        except KVStoreError as exc:
            log.warning("clearing stored pages failed: %s", exc)

    def close(self) -> None:
        self.store.close()
