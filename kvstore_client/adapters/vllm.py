"""vLLM KV connector (v1) on the store: vLLM loads stored prefixes instead of computing them, and saves
the blocks it computes.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore_client.adapters.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"master": "127.0.0.1:50051"}}'

``kv_connector_extra_config``: ``master`` (host:port, else ``$KVSTORE_MASTER``),
``block_tokens`` (tokens per stored block, a multiple of vLLM's block size; default
256 where it divides, else vLLM's block size), ``model`` (the weights' identity in
the key namespace; default the model as vLLM was given it: a path or a hub name), ``load_async`` (load between
scheduler steps instead of inside the forward pass), ``layerwise`` (default true:
each attention layer waits only for its own layer's bytes), ``lookup_timeout_s``
(default 1: the scheduler's prefix lookup), ``timeout_s`` (default 5: loads and saves),
``max_pending_save_blocks`` (default 512: saves queued past it are dropped), ``save_decode``
(default false: also save the blocks a request's answer completes, for the next turn of a
conversation to load).

What goes into a stored block is engine-neutral (:class:`KVLayout`: per layer K then V,
``[tokens, kv_heads, head_dim]`` each), whatever backend and page size stored it: the
page interior of vLLM's CPU attention (K transposed then V with its vector kernels, tiles with
its AMX kernels) is read from where the backend's own kernel writes known values, the GPU
backends' fused ``[B, H, N, K|V]`` views from their tensors; any other backend is refused at start. Keys carry
everything that changes the KV: model, dtype, shape, TP rank and size, the pipeline
stage's layers (namespace), and per request the LoRA adapter, cache salt and
multimodal inputs, exactly as vLLM's own prefix cache hashes them.

A sick store never makes vLLM slower than recomputing: the lookup is bounded by
``lookup_timeout_s``; after a failure a circuit breaker skips the store (lookups miss,
saves are dropped) and probes it again in the background. Loads that fail are
reported through ``get_block_ids_with_load_errors`` so vLLM recomputes them, and a
stored block of the wrong size is removed so that the next request stores it again.
Saves are gathered from vLLM's pages inside the step (a copy into staging memory,
pinned on GPUs) and put by a background thread, never on the forward path.
Only full-attention models with one KV cache group are served.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvstore.config import ClientConfig
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.events import EngineBlock
from kvstore_client.adapters.health import CircuitBreaker
from kvstore_client.adapters.layout import (
    KVLayout,
    PagedFormat,
    dtype_name,
    gather_paged,
    leading_blocks,
    load_blocks,
    load_layer,
    save_blocks,
    scatter_paged,
)
from kvstore_client.adapters.vllm_inspect import (
    block_extras,
    check_spec,
    paged_format,
    single_attention_group,
    stage_layers,
    tp_rank,
    worker_layers,
)
from kvstore_client.adapters.vllm_metrics import KVStoreConnectorStats, KVStorePromMetrics
from kvstore_client.store import Store

log = logging.getLogger(__name__)

DEFAULT_BLOCK_TOKENS = 256
SCHEME_PERIOD_S = 10.0
"""How often the scheduler's stats repeat the key scheme (``vllm:kvstore_layout_info``)."""


@dataclass(slots=True)
class LoadSpec:
    """Load stored blocks ``first_block ..`` of a prompt into a request's pages."""

    req_id: str
    tokens: list[int]
    """The prompt up to the end of the last block to load."""
    first_block: int
    pages: list[int]
    """Page ids for those blocks, ``pages_per_block`` each; -1 for a page the engine holds already."""
    num_blocks: int
    extras: list[bytes] | None = None
    """Per block, what else changes its KV (see :func:`block_extras`); None for nothing."""


@dataclass(slots=True)
class SaveSpec:
    """Save blocks ``first_block ..`` of a prompt from a request's pages."""

    req_id: str
    tokens: list[int]
    first_block: int
    pages: list[int]
    num_blocks: int
    extras: list[bytes] | None = None
    labels: list[EngineBlock] | None = None
    """With ``label_blocks``: per block saved, vLLM's name for it (:func:`engine_labels`)."""


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(slots=True)
class _Request:
    """What the scheduler side remembers of a running request."""

    tokens: list[int]
    pages: list[int]
    saved_blocks: int
    """Leading blocks the store holds (found by the lookup, loaded, or saved by this connector)."""
    extras: list[bytes] | None
    live: Any = None
    """vLLM's own request, whose tokens grow as it decodes (``save_decode``); None: the prompt only."""
    hashed: Any = None
    """vLLM's own request, for its block hashes (``label_blocks``); None: saves are not labelled."""


@dataclass(slots=True)
class _Load:
    """One request's load on the worker: filled by the loader thread, layer by layer."""

    spec: LoadSpec
    keys: list[str]
    staging: torch.Tensor
    layer_done: list[threading.Event]
    layer_loaded: list[int]
    """Leading blocks that arrived, per layer (0 until the layer is read)."""
    scattered: set[int] = field(default_factory=set)


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        master = extra.get("master") or os.environ.get("KVSTORE_MASTER")
        if not master:
            raise InvalidArgument("KVStoreConnector needs kv_connector_extra_config.master (or $KVSTORE_MASTER)")
        self.master = str(master)
        self.timeout_s = float(extra.get("timeout_s", 5.0))
        self.lookup_timeout_s = float(extra.get("lookup_timeout_s", 1.0))
        put_mode = extra.get("put_mode", "cached")
        if put_mode not in ("visible", "cached"):
            raise InvalidArgument(f'kv_connector_extra_config.put_mode is "visible" or "cached", not {put_mode!r}')
        self.put_mode: Literal["visible", "cached"] = put_mode
        """Saves are acknowledged by the daemon ("cached", the default: the saver thread is not held by
        the master's commit; other engines find a block a few ms later) or by the master ("visible")."""
        self.load_async = bool(extra.get("load_async", False))
        self.layerwise = bool(extra.get("layerwise", True)) and not self.load_async
        self.max_pending_save_blocks = int(extra.get("max_pending_save_blocks", 512))
        self.save_decode = bool(extra.get("save_decode", False))
        self.label_blocks = bool(extra.get("label_blocks", False))
        """Label each block saved with vLLM's block hash, parent hash and tokens (an extra master call a
        save, off the forward path), so that the store's KV events name blocks as vLLM's own do."""
        self.is_producer = bool(self._kv_transfer_config.is_kv_producer)
        self.is_consumer = bool(self._kv_transfer_config.is_kv_consumer)
        group, self.layer_names = single_attention_group(kv_cache_config)
        spec = group.kv_cache_spec
        check_spec(spec, vllm_config)
        self.page_tokens = int(spec.block_size)
        block_tokens = int(extra.get("block_tokens", 0)) or (
            DEFAULT_BLOCK_TOKENS if DEFAULT_BLOCK_TOKENS % self.page_tokens == 0 else self.page_tokens
        )
        if block_tokens % self.page_tokens:
            raise InvalidArgument(
                f"block_tokens {block_tokens} is not a multiple of vLLM's block size {self.page_tokens}"
            )
        model = str(extra.get("model") or vllm_config.model_config.model)
        parallel = vllm_config.parallel_config
        self.tp_size = int(parallel.tensor_parallel_size)
        pp_size = int(getattr(parallel, "pipeline_parallel_size", 1))
        stages = stage_layers(self.layer_names, vllm_config, pp_size)

        def layout(rank: int, first: int, count: int, total: int) -> KVLayout:
            return KVLayout(
                model=model, num_layers=count, num_kv_heads=int(spec.num_kv_heads), head_dim=int(spec.head_size),
                dtype=dtype_name(spec.dtype), block_tokens=block_tokens, tp_rank=rank, tp_size=self.tp_size,
                first_layer=first, model_layers=total,
            )  # fmt: skip

        # The scheduler asks every rank's and stage's namespace; a worker uses its own.
        self.layouts = [layout(r, *stage) for stage in stages for r in range(self.tp_size)]
        if role == KVConnectorRole.WORKER:
            first, total = worker_layers(self.layer_names, pp_size, stages)
            self.layout = layout(tp_rank(), first, len(self.layer_names), total)
        else:
            self.layout = self.layouts[0]
        self.pages_per_block = block_tokens // self.page_tokens
        self._layer_layout = _one_layer(self.layout)  # moves one layer of this rank's blocks at a time
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kv_load_failure_policy is not 'recompute': a block the store loses fails its request")
        self._vllm_config = vllm_config
        self._store: Store | None = None
        self._store_lock = threading.Lock()
        self.breaker = CircuitBreaker()
        self._probe: threading.Thread | None = None
        # Scheduler side.
        self._asked: dict[str, int] = {}  # request -> the local hit it was last asked about
        self._store_hit: dict[str, int] = {}  # request -> leading prompt blocks the store holds
        self._extras: dict[str, list[bytes] | None] = {}
        self._loads: dict[str, LoadSpec] = {}
        self._requests: dict[str, _Request] = {}
        self._live: dict[str, Any] = {}  # request -> vLLM's request, from its allocation to its first step
        self._hashed: dict[str, Any] = {}  # the same, kept for its block hashes (label_blocks)
        # Worker side.
        self._kv_caches: list[torch.Tensor] = []
        self._format: PagedFormat | None = None
        self._layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self._save_staging: list[tuple[SaveSpec, torch.Tensor, set[int]]] = []
        self._step_loads: list[_Load] = []
        self._load_errors: set[int] = set()
        self._pending: dict[str, Future[None]] = {}
        self._errors_lock = threading.Lock()
        self._loader: ThreadPoolExecutor | None = None
        self._saves: queue.Queue[tuple[SaveSpec, list[str], torch.Tensor] | None] = queue.Queue()
        self._pending_save_blocks = 0
        self._saver: threading.Thread | None = None
        self._stats = KVStoreConnectorStats()
        self._stats_lock = threading.Lock()
        self._scheme_due = 0.0  # when the scheduler's next report carries the key scheme
        self._saved = threading.Condition(self._stats_lock)  # notified as queued saves finish
        self._pin = False

    # -- the store, behind the breaker ----------------------------------------------------------
    def _connect(self) -> Store:
        with self._store_lock:
            if self._store is None:
                timeout = self.lookup_timeout_s if self._role == KVConnectorRole.SCHEDULER else self.timeout_s
                self._store = Store.connect(self.master, ClientConfig(timeout_s=timeout, put_mode=self.put_mode))
            return self._store

    @property
    def store(self) -> Store:
        return self._connect()

    def _available(self) -> bool:
        """Whether to use the store now. While the breaker is open, a background thread probes it."""
        if self.breaker.is_closed:
            return True
        if self.breaker.allow():
            probe = threading.Thread(target=self._probe_store, name="kvstore-vllm-probe", daemon=True)
            self._probe = probe
            probe.start()
        return False

    def _probe_store(self) -> None:
        try:
            self._connect().stats()
        except KVStoreError as exc:
            log.info("store still unavailable: %s", exc)
            self._failed(None)
        else:
            log.info("store %s answers again: using it", self.master)
            self.breaker.success()

    def _failed(self, exc: BaseException | None, what: str = "") -> None:
        was_closed = self.breaker.is_closed
        self.breaker.failure()
        if exc is not None and was_closed:
            log.warning("%s failed, skipping the store for %.0f s: %s", what, self.breaker.cooldown_s, exc)

    # ==============================================================================================
    # Scheduler side
    # ==============================================================================================
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the store can give: whole stored blocks of the prompt,
        held under every rank's and stage's namespace, never the last token (vLLM computes it to sample)."""
        tokens = list(request.prompt_token_ids or [])
        bt = self.layouts[0].block_tokens
        extras = self._extras.get(request.request_id)
        if request.request_id not in self._extras:
            extras = self._extras[request.request_id] = block_extras(request, len(tokens) // bt, bt)
        if not self.is_consumer or not tokens:
            return 0, False
        if not self._available():
            self._count("skipped_ops")
            return 0, False
        self._count("lookups")
        try:
            # Sizes, not only presence: a block of another size under our key is no hit (and is removed).
            hit = len(tokens) // bt
            for lay in self.layouts:
                keys = lay.keys(tokens, extras)
                sizes = self.store.sizes(keys)
                hit = min(hit, leading_blocks(sizes, lay.block_bytes()))
                self._count("repaired_blocks", _repair(self.store, keys, sizes, lay.block_bytes()))
        except KVStoreError as exc:
            self._count("lookup_failures")
            self._failed(exc, f"looking up request {request.request_id}")
            return 0, False
        self.breaker.success()
        self._store_hit[request.request_id] = hit
        hit_tokens = min(hit * bt, request.num_tokens - 1)
        self._asked[request.request_id] = num_computed_tokens  # the hit the count is relative to
        if hit_tokens <= num_computed_tokens:
            return 0, False
        return hit_tokens - num_computed_tokens, self.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.save_decode:
            self._live[request.request_id] = request
        if self.label_blocks:
            self._hashed[request.request_id] = request
        if num_external_tokens <= 0:
            return
        local = self._asked.get(request.request_id, 0)
        pages = list(blocks.get_block_ids()[0])
        bt, k = self.layouts[0].block_tokens, self.pages_per_block
        first, end = local // bt, -(-(local + num_external_tokens) // bt)
        load_pages = []
        for page in range(first * k, end * k):
            owned = local // self.page_tokens <= page < -(-(local + num_external_tokens) // self.page_tokens)
            load_pages.append(pages[page] if owned and page < len(pages) else -1)
        tokens = list(request.prompt_token_ids)[: end * bt]
        extras = self._extras.get(request.request_id)
        self._loads[request.request_id] = LoadSpec(
            request.request_id, tokens, first, load_pages, end - first, extras[:end] if extras else None
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            # Blocks the store holds already (a local prefix hit on them included) are not put again.
            known = self._store_hit.pop(new.req_id, 0)
            extras = self._extras.pop(new.req_id, None)
            live = self._live.pop(new.req_id, None)
            self._requests[new.req_id] = _Request(
                tokens, list(new.block_ids[0]), known, extras, live, self._hashed.pop(new.req_id, None)
            )
            self._plan_save(meta, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_pages = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids and new_pages is not None:
                state.pages = list(new_pages[0])  # a resumed request's whole block list
            elif new_pages is not None:
                state.pages.extend(new_pages[0])
            self._plan_save(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def _plan_save(self, meta: KVStoreConnectorMetadata, req_id: str, computed: int, out: Any) -> None:
        """Save the blocks this step completes that the store does not hold yet: the prompt's, and with
        ``save_decode`` those its answer fills too (the next turn of a conversation starts with them)."""
        state = self._requests[req_id]
        if not self.is_producer or not self.breaker.is_closed:
            return
        bt, k = self.layouts[0].block_tokens, self.pages_per_block
        tokens = state.tokens if state.live is None else state.live.all_token_ids
        done = min(computed + out.num_scheduled_tokens.get(req_id, 0), len(tokens)) // bt
        if done <= state.saved_blocks or done * k > len(state.pages):
            return
        if state.extras is not None and len(state.extras) <= done:  # blocks of the answer: their extras too
            state.extras = block_extras(state.live, done, bt)
        first = state.saved_blocks
        pages = state.pages[first * k : done * k]
        extras = state.extras[:done] if state.extras else None
        labels = engine_labels(state.hashed, tokens, first, done, bt, k) if state.hashed is not None else None
        meta.saves.append(SaveSpec(req_id, list(tokens[: done * bt]), first, pages, done - first, extras, labels))
        state.saved_blocks = done

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        for known in (self._requests, self._asked, self._loads, self._store_hit, self._extras, self._live,
                      self._hashed):  # fmt: skip
            known.pop(request.request_id, None)
        return False, None  # saves copy the pages inside the step: they are free to go

    # ==============================================================================================
    # Worker side
    # ==============================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise InvalidArgument(f"KV caches for layers {missing} were not registered")
        self._kv_caches = [kv_caches[name] for name in self.layer_names]
        self._format = paged_format(self._vllm_config, self.layer_names, self._kv_caches[0], self.layout,
                                     self.page_tokens)  # fmt: skip
        self._pin = self._kv_caches[0].device.type == "cuda"

    def _staging(self, num_blocks: int) -> torch.Tensor:
        return self.layout.staging(num_blocks, pin=self._pin)

    def _count(self, name: str, value: int = 1) -> None:
        with self._stats_lock:
            self._stats.add(name, value)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        usable = self._available() if meta.loads or meta.saves else False
        if usable:
            self._save_staging = [(spec, self._staging(spec.num_blocks), set()) for spec in meta.saves]
        else:  # the store is sick: this step's saves are dropped, its loads recomputed
            self._count("save_dropped_blocks", sum(spec.num_blocks for spec in meta.saves))
            self._save_staging = []
        self._step_loads = []
        for spec in meta.loads:
            if not usable:
                self._count("skipped_ops")
                self._fail_pages(spec.pages)
                continue
            if self.load_async:
                self._pending[spec.req_id] = self._pool().submit(self._load_whole, spec)
            elif self.layerwise:
                load = self._new_load(spec)
                self._step_loads.append(load)
                self._pool().submit(self._read_layers, load)
            else:
                self._load_whole(spec)

    def _pool(self) -> ThreadPoolExecutor:
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-vllm-load")
        return self._loader

    def _keys(self, tokens: list[int], extras: list[bytes] | None, first: int, count: int) -> list[str]:
        return list(self.layout.keys(tokens, extras)[first : first + count])

    def _new_load(self, spec: LoadSpec) -> _Load:
        n = self.layout.num_layers
        keys = self._keys(spec.tokens, spec.extras, spec.first_block, spec.num_blocks)
        events = [threading.Event() for _ in range(n)]
        return _Load(spec, keys, self._staging(len(keys)), events, [0] * n)

    def _read_layers(self, load: _Load) -> None:
        """The loader thread: check the blocks' sizes once, then read layer after layer into staging."""
        lay, keys = self.layout, load.keys
        try:
            sizes = self.store.sizes(keys)
            usable = leading_blocks(sizes, lay.block_bytes())
            self._count("repaired_blocks", _repair(self.store, keys, sizes, lay.block_bytes()))
            for layer in range(lay.num_layers):
                if usable:
                    load.layer_loaded[layer] = load_layer(self.store, keys[:usable], lay, layer, load.staging)
                load.layer_done[layer].set()
        except KVStoreError as exc:
            self._failed(exc, f"loading KV of request {load.spec.req_id}")
        finally:
            for event in load.layer_done:
                event.set()  # a failed read leaves its layers at 0 blocks: recomputed

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for this layer's bytes of this step's loads, and put them into vLLM's pages."""
        layer = self._layer_index.get(layer_name)
        if layer is not None:
            self._scatter_layer(layer)

    def _scatter_layer(self, layer: int) -> None:
        assert self._format is not None or not self._step_loads
        for load in self._step_loads:
            if layer in load.scattered:
                continue
            if not load.layer_done[layer].wait(self.timeout_s * 4):
                log.warning("layer %d of request %s did not arrive in time", layer, load.spec.req_id)
            load.scattered.add(layer)
            count = load.layer_loaded[layer] * self.pages_per_block
            if count and self._format is not None:
                scatter_paged(load.staging[:, layer : layer + 1], [self._kv_caches[layer]], self._layer_layout,
                              self._format, load.spec.pages[:count])  # fmt: skip

    def _finish_loads(self) -> None:
        """After the forward pass: layers nobody waited for are scattered too, and the pages of blocks that
        did not arrive in every layer are load errors (vLLM recomputes them)."""
        for layer in range(self.layout.num_layers):
            self._scatter_layer(layer)
        for load in self._step_loads:
            loaded = min(load.layer_loaded)
            self._account_load(load.spec, loaded)
        self._step_loads = []

    def _account_load(self, spec: LoadSpec, loaded: int) -> None:
        k = self.pages_per_block
        self._count("loaded_blocks", loaded)
        self._count("loaded_bytes", loaded * self.layout.block_bytes())
        failed = [p for p in spec.pages[loaded * k :] if p >= 0]
        if failed:
            self._count("load_failed_blocks", spec.num_blocks - loaded)
            self._fail_pages(failed)

    def _fail_pages(self, pages: Sequence[int]) -> None:
        with self._errors_lock:
            self._load_errors |= {p for p in pages if p >= 0}

    def _load_whole(self, spec: LoadSpec) -> None:
        """Load one request's blocks, every layer at once, into its pages (before the forward pass, or
        between steps with ``load_async``)."""
        assert self._format is not None
        keys = self._keys(spec.tokens, spec.extras, spec.first_block, spec.num_blocks)
        staging = self._staging(len(keys))
        try:
            loaded = load_blocks(self.store, keys, staging)
            if loaded < len(keys):
                rest = keys[loaded:]
                self._count(
                    "repaired_blocks", _repair(self.store, rest, self.store.sizes(rest), self.layout.block_bytes())
                )
        except KVStoreError as exc:
            self._failed(exc, f"loading KV of request {spec.req_id}")
            loaded = 0
        if loaded:
            pages = spec.pages[: loaded * self.pages_per_block]
            scatter_paged(staging, self._kv_caches, self.layout, self._format, pages)
        self._account_load(spec, loaded)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Gather this layer's pages of every block being saved, as soon as the layer has written them."""
        layer = self._layer_index.get(layer_name)
        if layer is None or self._format is None:
            return
        for spec, staging, gathered in self._save_staging:
            _gather_layer(kv_layer, self._layer_layout, self._format, spec.pages, staging, layer)
            gathered.add(layer)

    def wait_for_save(self) -> None:
        """Finish this step's loads; gather the layers of this step's saves that save_kv_layer did not see,
        and hand the blocks to the saver thread (the put happens off the forward path)."""
        self._finish_loads()
        for spec, staging, gathered in self._save_staging:
            assert self._format is not None
            for layer in set(range(self.layout.num_layers)) - gathered:
                _gather_layer(self._kv_caches[layer], self._layer_layout, self._format, spec.pages, staging, layer)
            if self._pending_save_blocks + spec.num_blocks > self.max_pending_save_blocks:
                self._count("save_dropped_blocks", spec.num_blocks)
                continue
            keys = self._keys(spec.tokens, spec.extras, spec.first_block, spec.num_blocks)
            with self._stats_lock:
                self._pending_save_blocks += spec.num_blocks
            self._saves.put((spec, keys, staging))
            if self._saver is None:
                self._saver = threading.Thread(target=self._save_loop, name="kvstore-vllm-save", daemon=True)
                self._saver.start()
        self._save_staging = []

    def _save_loop(self) -> None:
        while (item := self._saves.get()) is not None:
            spec, keys, staging = item
            try:
                if self.breaker.is_closed and spec.labels is not None:
                    try:
                        self.store.label_blocks(keys, spec.labels)
                    except KVStoreError as exc:  # the blocks are worth saving unlabelled
                        self._count("label_failures")
                        log.debug("labelling the blocks of request %s failed: %s", spec.req_id, exc)
                if self.breaker.is_closed:
                    save_blocks(self.store, keys, staging)
                    self._count("saved_blocks", len(keys))
                    self._count("saved_bytes", len(keys) * self.layout.block_bytes())
                else:
                    self._count("save_dropped_blocks", len(keys))
            except KVStoreError as exc:
                self._failed(exc, f"saving KV of request {spec.req_id}")
                self._count("save_failed_blocks", len(keys))
            finally:
                with self._saved:
                    self._pending_save_blocks -= len(keys)
                    self._saved.notify_all()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = {req for req, fut in self._pending.items() if fut.done()}
        for req in done:
            self._pending.pop(req).result()  # a load records its own errors; this surfaces bugs
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._stats_lock:
            now = time.monotonic()
            if self._role == KVConnectorRole.SCHEDULER and now >= self._scheme_due:
                self._scheme_due = now + SCHEME_PERIOD_S
                lay = self.layouts[0]
                self._stats.data.update(namespace=lay.namespace, block_tokens=lay.block_tokens,
                                        block_bytes=lay.block_bytes())  # fmt: skip
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KVStoreConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
    ) -> KVConnectorPromMetrics | None:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def flush_saves(self, timeout_s: float | None = None) -> bool:
        """Wait (up to ``timeout_s``, default the store timeout) until every queued save has been put
        and is visible to every engine (``Store.flush``); returns whether they all were."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        with self._saved:
            if not self._saved.wait_for(lambda: self._pending_save_blocks == 0, limit):
                return False
        if self._store is None:
            return True
        try:
            self._store.flush()
        except KVStoreError as exc:
            log.warning("flushing saved KV blocks failed: %s", exc)
            return False
        return True

    def shutdown(self) -> None:
        if self._saver is not None:
            self.flush_saves()
            self._saves.put(None)
            self._saver.join(timeout=self.timeout_s)
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        with self._store_lock:
            if self._store is not None:
                self._store.close()
                self._store = None


# -- helpers -----------------------------------------------------------------------------------


def engine_labels(
    request: Any, tokens: Sequence[int], first: int, done: int, bt: int, k: int
) -> list[EngineBlock] | None:
    """vLLM's names of store blocks ``first .. done - 1`` of ``request``: each block's last page's
    block hash (as vLLM's KV events give it: ``maybe_convert_block_hash``), the page's before it as
    its parent, and its ``bt`` tokens. None when vLLM has not hashed them all (a block of the answer
    not full yet)."""
    hashes = request.block_hashes
    if len(hashes) < done * k:
        return None
    return [
        EngineBlock(
            maybe_convert_block_hash(hashes[(i + 1) * k - 1]),
            maybe_convert_block_hash(hashes[i * k - 1]) if i else None,
            list(tokens[i * bt : (i + 1) * bt]),
            bt,
        )
        for i in range(first, done)
    ]


def _repair(store: Store, keys: Sequence[str], sizes: Sequence[int | None], want: int) -> int:
    """Remove stored blocks of the wrong size under our keys, so that the next request saves them anew.
    Returns how many were removed."""
    bad = [key for key, size in zip(keys, sizes, strict=True) if size is not None and size != want]
    if bad:
        log.warning("removing %d stored blocks of the wrong size (a block is %d bytes)", len(bad), want)
        store.remove_many(bad)
    return len(bad)


def _gather_layer(
    kv: torch.Tensor, one: KVLayout, fmt: PagedFormat, pages: Sequence[int], staging: torch.Tensor, layer: int
) -> None:
    """Copy one layer's pages into ``staging[:, layer]`` (``one``: the layout of a single layer)."""
    gather_paged([kv], one, fmt, pages, staging[:, layer : layer + 1])


def _one_layer(layout: KVLayout) -> KVLayout:
    return KVLayout(layout.model, 1, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.block_tokens,
                    layout.tp_rank, layout.tp_size)  # fmt: skip
