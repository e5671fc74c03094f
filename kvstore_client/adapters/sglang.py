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
flat copy of each page (any layout whose pages SGLang can copy out), stored as one
object. ``batch_exists`` answers with the store's longest stored prefix in one round
trip.

Keys are ``sgl/<tag>/<page hash>/<part>``: the tag is a digest of everything that
makes a page's bytes what they are (model, tensor-parallel rank unless the KV is
rank-replicated MLA, pipeline stage, context-parallel ranks, interface, and the host
pool's per-page geometry: layout, dtype, page size, layers, heads and head dims or
MLA's latent widths), read from the pool's own attributes. The pool's capacity is not
in it, so servers with different ``--hicache-size`` / ``--hicache-ratio`` share pages,
while pages of other models, ranks, geometries or layouts never answer. Only the host
pool classes in :data:`POOL_KINDS` are taken, each checked at registration against the
page SGLang itself copies. A store that cannot be reached makes pages misses and
writes failures, never an exception into SGLang; :meth:`KVStoreHiCache.get_stats`
counts both.

The multi-pool v2 interface (hybrid models' SWA, Mamba, indexer and draft pools) is
refused at registration (:meth:`KVStoreHiCache.register_mem_host_pool_v2`); only the KV
pool itself, which SGLang's hybrid controller registers again through v2, is taken.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.observability.metrics_collector import StorageMetrics

from kvstore.config import ClientConfig
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.results import PutStatus
from kvstore_client.store import Store

log = logging.getLogger(__name__)

TAG_VERSION = "kvstore-sglang-v2"
"""Bumped whenever the keys of the same page change (v2: the pool's capacity left the tag)."""
ZERO_COPY_LAYOUTS = ("page_first", "page_first_direct")
MAX_TRACKED_KEYS = 1 << 20
"""Keys this backend remembers writing, for :meth:`KVStoreHiCache.clear`."""
GIB = float(1 << 30)
"""SGLang's bandwidth histograms are in GB/s of 2**30 bytes (as its Mooncake backend reports them)."""


# -- host pools ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PoolKind:
    """How this backend reads one SGLang host pool class.

    ``geometry`` returns the per-page dimensions that are particular to the class, from the pool's
    own attributes; the capacity (tokens or pages the pool holds) is never among them.
    ``row_elements`` is the elements one token of one layer takes in the page SGLang copies out
    (``get_dummy_flat_data_page``), all parts together: registration checks it against that page.
    """

    name: str
    layouts: tuple[str, ...]
    """Layouts whose pages SGLang copies out and back (``get_data_page`` / ``set_from_flat_data_page``)."""
    parts: tuple[str, ...]
    """One object per part with the zero-copy interface, in this order."""
    part_buffers: Callable[[Any], tuple[torch.Tensor, ...]]
    geometry: Callable[[Any], dict[str, Any]]
    row_elements: Callable[[Any], int]
    rank_replicated: Callable[[Any], bool]
    """Whether every tensor-parallel rank holds the same bytes for a page (so they share its keys)."""


POOL_KINDS: dict[type, PoolKind] = {
    # kv_buffer, the capacity in capitals: layer_first [2, layers, TOKENS, heads, dim];
    # page_first [2, TOKENS, layers, heads, dim]; page_first_direct [2, PAGES, layers, page, heads, dim];
    # page_head [2, PAGES, heads, page, layers, dim].
    MHATokenToKVPoolHost: PoolKind(
        name="mha",
        layouts=("layer_first", "page_first", "page_first_direct", "page_head"),
        parts=("k", "v"),
        part_buffers=lambda pool: (pool.k_buffer, pool.v_buffer),
        geometry=lambda pool: {"heads": pool.head_num, "head_dim": pool.head_dim, "v_head_dim": pool.v_head_dim},
        row_elements=lambda pool: 2 * pool.head_num * pool.head_dim,
        rank_replicated=lambda pool: False,
    ),
    # kv_buffer, the capacity in capitals: layer_first [layers, TOKENS, 1, row]; page_first [TOKENS, layers, 1, row];
    # page_first_direct [PAGES, layers, page, 1, row] (row: kv_lora_rank + qk_rope_head_dim, or wider when packed).
    MLATokenToKVPoolHost: PoolKind(
        name="mla",
        layouts=("layer_first", "page_first", "page_first_direct"),
        parts=("m",),
        part_buffers=lambda pool: (pool.kv_buffer,),
        geometry=lambda pool: {
            "kv_lora_rank": pool.kv_lora_rank,
            "qk_rope_head_dim": pool.qk_rope_head_dim,
            "row": pool.kv_cache_dim,
            "packed_fp8": bool(pool.dsa_kv_cache_store_fp8),
        },
        row_elements=lambda pool: pool.kv_cache_dim,
        # With layer sharding each rank holds other layers of the page.
        rank_replicated=lambda pool: not getattr(pool, "_layer_shard_enabled", False),
    ),
}
"""Exactly these classes, not their subclasses: SGLang's MXFP8, asymmetric and HiSparse pools
subclass these with pages of another format."""


# -- metrics -------------------------------------------------------------------------------------
@dataclass
class KVStoreStorageMetrics(StorageMetrics):
    """What the backend did between two :meth:`KVStoreHiCache.get_stats` calls.

    SGLang's own lists (``prefetch_pgs``, ``backup_pgs``, ``prefetch_bandwidth``,
    ``backup_bandwidth``; one sample per call that moved pages) are filled only when SGLang runs
    with ``--enable-metrics`` (``enable_storage_metrics``), the only case it drains them, so they
    cannot grow unread; the counters always. Counts are pages of the host pool, bytes those moved.
    """

    COUNTERS: ClassVar[tuple[str, ...]] = (
        "num_pages_read", "num_bytes_read", "num_pages_missed", "num_pages_read_failed",
        "num_pages_written", "num_bytes_written", "num_pages_already_stored", "num_pages_write_failed",
        "num_pages_looked_up", "num_pages_found", "num_pages_lookup_failed",
    )  # fmt: skip
    num_pages_read: int = 0
    """Pages loaded into the host pool (hits)."""
    num_bytes_read: int = 0
    num_pages_missed: int = 0
    """Pages asked for that the store did not hold (or held at another size)."""
    num_pages_read_failed: int = 0
    """Pages not loaded because the store failed (unreachable, timed out), not because they were missing."""
    num_pages_written: int = 0
    """Pages newly stored."""
    num_bytes_written: int = 0
    num_pages_already_stored: int = 0
    """Pages the store already held: nothing moved."""
    num_pages_write_failed: int = 0
    num_pages_looked_up: int = 0
    """Pages asked about by ``batch_exists`` / ``exists``."""
    num_pages_found: int = 0
    """Of those, the pages of the stored prefixes."""
    num_pages_lookup_failed: int = 0


class _Recorder:
    """Owns the counts since the last drain. Every method takes the lock: SGLang's prefetch and backup
    threads and its scheduler call the backend at once."""

    def __init__(self, *, histograms: bool) -> None:
        self._lock = threading.Lock()
        self._histograms = histograms
        self._now = KVStoreStorageMetrics()

    def read(self, *, pages: int, nbytes: int, missed: int, seconds: float) -> None:
        with self._lock:
            m = self._now
            m.num_pages_read += pages
            m.num_bytes_read += nbytes
            m.num_pages_missed += missed
            if self._histograms and pages:
                m.prefetch_pgs.append(pages)
                m.prefetch_bandwidth.append(nbytes / GIB / max(seconds, 1e-9))

    def wrote(self, *, pages: int, nbytes: int, existing: int, seconds: float) -> None:
        with self._lock:
            m = self._now
            m.num_pages_written += pages
            m.num_bytes_written += nbytes
            m.num_pages_already_stored += existing
            if self._histograms and pages:
                m.backup_pgs.append(pages)
                m.backup_bandwidth.append(nbytes / GIB / max(seconds, 1e-9))

    def looked_up(self, *, pages: int, found: int) -> None:
        with self._lock:
            self._now.num_pages_looked_up += pages
            self._now.num_pages_found += found

    def failed(self, *, read: int = 0, written: int = 0, looked_up: int = 0) -> None:
        with self._lock:
            self._now.num_pages_read_failed += read
            self._now.num_pages_write_failed += written
            self._now.num_pages_lookup_failed += looked_up

    def drain(self) -> KVStoreStorageMetrics:
        with self._lock:
            drained, self._now = self._now, KVStoreStorageMetrics()
        return drained


# -- the backend ---------------------------------------------------------------------------------
class KVStoreHiCache(HiCacheStorage):
    """SGLang's storage backend for one scheduler rank.

    ``mem_pool_host``, its :class:`PoolKind` and the key tag are set together by
    :meth:`register_mem_pool_host` (SGLang calls it once, before any I/O) and not changed after.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        master = extra.get("master") or os.environ.get("KVSTORE_MASTER")
        if not master:
            raise InvalidArgument("KVStoreHiCache needs extra_config.master (or $KVSTORE_MASTER)")
        self.config = storage_config
        self.zero_copy = bool(extra.get("interface_v1", 0))
        # Saves acknowledged by their daemon (other instances find a page a few ms later); "visible": by the master.
        config = ClientConfig(timeout_s=float(extra.get("timeout_s", 10.0)), put_mode=extra.get("put_mode", "cached"))
        self.store = Store.connect(str(master), config)
        self.mem_pool_host: Any = None
        self._kind: PoolKind | None = None
        self._tag: str | None = None
        self._written: set[str] = set()
        self._lock = threading.Lock()
        self._stats = _Recorder(histograms=bool(storage_config.enable_storage_metrics))

    # -- registration and identity -----------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        pool = mem_pool_host
        kind = POOL_KINDS.get(type(pool))
        if kind is None:
            names = " or ".join(cls.__name__ for cls in POOL_KINDS)
            raise InvalidArgument(
                f"KVStoreHiCache stores pages of {names} host pools, not of {type(pool).__name__}"
                " (a page format it has not been checked against)"
            )
        if self.zero_copy and pool.layout not in ZERO_COPY_LAYOUTS:
            raise InvalidArgument(
                f"interface_v1 needs a host pool layout of {' or '.join(ZERO_COPY_LAYOUTS)}"
                f" (--hicache-mem-layout), not {pool.layout!r}"
            )
        if pool.layout not in kind.layouts:
            raise InvalidArgument(
                f"KVStoreHiCache stores {type(pool).__name__} pages of the {', '.join(kind.layouts)} layouts"
                f" (--hicache-mem-layout), not {pool.layout!r}"
            )
        if pool.kv_buffer is None:
            raise InvalidArgument(f"the {type(pool).__name__} has no buffer (an allocator-only pool)")
        self._check_page(pool, kind)
        super().register_mem_pool_host(pool)
        self._kind = kind
        self._tag = self._make_tag(pool, kind)

    def _check_page(self, pool: Any, kind: PoolKind) -> None:
        """The geometry read from the pool's attributes must cover, element for element, the page SGLang
        copies out; with the zero-copy interface, the views of a page must too, each contiguous."""
        elements = pool.layer_num * pool.page_size * kind.row_elements(pool)
        real = pool.get_dummy_flat_data_page().numel()
        if real != elements:
            raise InvalidArgument(
                f"a {type(pool).__name__} page holds {real} elements, not the {elements} its attributes describe"
            )
        if self.zero_copy:
            views = self._views_at(pool, kind, 0)
            if not all(v.is_contiguous() for v in views) or sum(v.numel() for v in views) != elements:
                raise InvalidArgument(f"a {type(pool).__name__} page is not {len(kind.parts)} contiguous part(s)")

    def _make_tag(self, pool: Any, kind: PoolKind) -> str:
        c = self.config
        fields: dict[str, Any] = {
            "version": TAG_VERSION, "model": c.model_name,
            "tp": None if kind.rank_replicated(pool) else [c.tp_rank, c.tp_size],
            "pp": [c.pp_rank, c.pp_size], "cp": [c.attn_cp_rank, c.attn_cp_size],
            "dcp": [getattr(c, "dcp_rank", 0), getattr(c, "dcp_size", 1)], "interface_v1": self.zero_copy,
            "pool": kind.name, "layout": pool.layout, "dtype": str(pool.dtype), "page_size": pool.page_size,
            "layers": [pool.layer_num, pool.target_layer_num, pool.start_layer, pool.end_layer],
            "format": getattr(pool, "storage_format_tag", None), **kind.geometry(pool),
        }  # fmt: skip
        return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]

    def _key(self, page: str, part: str = "p") -> str:
        if self._tag is None:
            raise InvalidArgument("no host memory pool is registered")
        return f"sgl/{self._tag}/{page}/{part}"

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Take the KV pool (SGLang's hybrid controller registers every entry of its pool group again here,
        the KV anchor included); refuse any other pool, before the first request.

        The other pools (SWA windows, Mamba states, sparse-attention indexers, draft models) need keys
        of their own geometry and SGLang's per-pool hit policies (trailing pages, block groups), which
        this backend does not implement.
        """
        if host_pool_name != PoolName.KV:
            raise InvalidArgument(
                f"KVStoreHiCache stores the KV pool only, not SGLang's {str(host_pool_name)!r} pool"
                f" ({type(host_pool).__name__}): the multi-pool v2 interface (hybrid, sliding-window, Mamba,"
                " sparse-attention and draft pools) is not supported; run this model with another"
                " --hicache-storage-backend"
            )
        if host_pool is not self.mem_pool_host:
            raise InvalidArgument(
                f"the v2 'kv' pool ({type(host_pool).__name__}) is not the host pool registered by"
                " register_mem_pool_host"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    # -- zero copy (interface_v1) ----------------------------------------------------------------
    @staticmethod
    def _views_at(pool: Any, kind: PoolKind, start: int) -> list[torch.Tensor]:
        """Each part of the page at token index ``start``, as views into the host pool."""
        size = pool.page_size
        if pool.layout == "page_first":
            return [buf[start : start + size] for buf in kind.part_buffers(pool)]
        return [buf[start // size] for buf in kind.part_buffers(pool)]

    def _registered(self) -> tuple[Any, PoolKind]:
        if self.mem_pool_host is None or self._kind is None:
            raise InvalidArgument("no host memory pool is registered")
        return self.mem_pool_host, self._kind

    def _page_views(self, host_indices: torch.Tensor, pages: int) -> list[torch.Tensor]:
        """Contiguous views of each page's parts in the host pool, in key order (page 0's parts, page 1's ...)."""
        pool, kind = self._registered()
        size = pool.page_size
        if host_indices.numel() != pages * size:
            raise InvalidArgument(f"{host_indices.numel()} host indices for {pages} pages of {size} tokens")
        return [view for start in host_indices[::size].tolist() for view in self._views_at(pool, kind, start)]

    def _part_keys(self, keys: Sequence[str]) -> list[str]:
        parts = self._registered()[1].parts
        return [self._key(k, p) for k in keys for p in parts]

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        if not keys:
            return []
        objects = self._part_keys(keys)
        views = self._page_views(host_indices, len(keys))
        started = time.perf_counter()
        try:
            statuses = self.store.put_many(zip(objects, views, strict=True))
        except KVStoreError as exc:
            log.warning("storing %d pages failed: %s", len(keys), exc)
            self._stats.failed(written=len(keys))
            return [False] * len(keys)
        seconds = time.perf_counter() - started
        self._remember(objects)
        n = len(objects) // len(keys)
        stored = [any(s is PutStatus.STORED for s in statuses[i * n : (i + 1) * n]) for i in range(len(keys))]
        nbytes = sum(v.nbytes for v, s in zip(views, statuses, strict=True) if s is PutStatus.STORED)
        self._stats.wrote(pages=sum(stored), nbytes=nbytes, existing=len(keys) - sum(stored), seconds=seconds)
        return [True] * len(keys)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        if not keys:
            return []
        objects = self._part_keys(keys)
        views = self._page_views(host_indices, len(keys))
        started = time.perf_counter()
        try:
            got = self.store.get_many_into(objects, views, exact_size=True)
        except KVStoreError as exc:
            log.warning("loading %d pages failed: %s", len(keys), exc)
            self._stats.failed(read=len(keys))
            return [False] * len(keys)
        seconds = time.perf_counter() - started
        n = len(objects) // len(keys)
        pages = [got[i * n : (i + 1) * n] for i in range(len(keys))]
        loaded = [all(size is not None for size in page) for page in pages]
        nbytes = sum(sum(size or 0 for size in page) for page, ok in zip(pages, loaded, strict=True) if ok)
        self._stats.read(pages=sum(loaded), nbytes=nbytes, missed=len(keys) - sum(loaded), seconds=seconds)
        return loaded

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Pages stored from the first on: one prefix lookup for the whole batch."""
        if not keys:
            return 0
        objects = self._part_keys(keys) if self.zero_copy else [self._key(k) for k in keys]
        try:
            found = self.store.match_prefix(objects) // (len(objects) // len(keys))
        except KVStoreError as exc:
            log.warning("looking up %d pages failed: %s", len(keys), exc)
            self._stats.failed(looked_up=len(keys))
            return 0
        self._stats.looked_up(pages=len(keys), found=found)
        return found

    # -- one object per page (the generic interface) ----------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None else None)[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        objects = [self._key(k) for k in keys]
        started = time.perf_counter()
        try:
            if target_locations is None:
                data = self.store.get_many(objects)
                sizes = [len(d) if d else None for d in data]
                pages = [torch.frombuffer(bytearray(d), dtype=torch.uint8) if d else None for d in data]
            else:
                sizes = self.store.get_many_into(objects, list(target_locations), exact_size=True)
                pages = [t if size is not None else None for t, size in zip(target_locations, sizes, strict=True)]
        except KVStoreError as exc:
            log.warning("loading %d pages failed: %s", len(keys), exc)
            self._stats.failed(read=len(keys))
            return [None] * len(keys)
        loaded = [size for size in sizes if size is not None]
        self._stats.read(
            pages=len(loaded), nbytes=sum(loaded), missed=len(keys) - len(loaded), seconds=time.perf_counter() - started
        )
        return pages

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value if value is not None else target_location])

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        data = values if values is not None else target_locations
        if data is None or len(data) != len(keys):
            raise InvalidArgument(f"batch_set got {len(keys)} keys and {0 if data is None else len(data)} values")
        objects = [self._key(k) for k in keys]
        pages = [v.contiguous() for v in data]
        started = time.perf_counter()
        try:
            statuses = self.store.put_many(zip(objects, pages, strict=True))
        except KVStoreError as exc:
            log.warning("storing %d pages failed: %s", len(keys), exc)
            self._stats.failed(written=len(keys))
            return False
        seconds = time.perf_counter() - started
        self._remember(objects)
        stored = [p.nbytes for p, s in zip(pages, statuses, strict=True) if s is PutStatus.STORED]
        self._stats.wrote(pages=len(stored), nbytes=sum(stored), existing=len(keys) - len(stored), seconds=seconds)
        return True

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- housekeeping ----------------------------------------------------------------------------
    def get_stats(self) -> KVStoreStorageMetrics:
        """What the backend did since the previous call (SGLang logs it when storage metrics are on)."""
        return self._stats.drain()

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
