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
the key namespace; default the served model's name), ``load_async`` (load between
scheduler steps instead of before the forward pass), ``timeout_s``.

Scheduler side: ``get_num_new_matched_tokens`` asks the store for the longest stored
prefix of the prompt under every tensor-parallel rank's namespace (no side effect
on vLLM's state); ``build_connector_meta`` tells the workers which stored blocks to
load into which pages and which newly computed blocks to save. Worker side: loads go
straight from the store into a staging tensor and from there into vLLM's paged KV
tensors, one copy per layer (:mod:`kvstore_client.adapters.layout`); a block that
does not arrive is reported through ``get_block_ids_with_load_errors`` so that vLLM
recomputes it (with ``kv_load_failure_policy: recompute``). Saves gather each layer's
pages as its attention layer finishes (``save_kv_layer``) and put the blocks in
``wait_for_save``. Only full-attention models with one KV cache group are served.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.config import ClientConfig
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore_client.adapters.layout import (
    KVLayout,
    PagedFormat,
    dtype_name,
    gather_paged,
    load_blocks,
    save_blocks,
    scatter_paged,
)
from kvstore_client.store import Store

log = logging.getLogger(__name__)

DEFAULT_BLOCK_TOKENS = 256


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


@dataclass(slots=True)
class SaveSpec:
    """Save blocks ``first_block ..`` of a prompt from a request's pages."""

    req_id: str
    tokens: list[int]
    first_block: int
    pages: list[int]
    num_blocks: int


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
    """Blocks of the prompt the store holds (loaded, or saved by this connector)."""


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        master = extra.get("master") or os.environ.get("KVSTORE_MASTER")
        if not master:
            raise InvalidArgument("KVStoreConnector needs kv_connector_extra_config.master (or $KVSTORE_MASTER)")
        self.master = str(master)
        self.timeout_s = float(extra.get("timeout_s", 10.0))
        self.load_async = bool(extra.get("load_async", False))
        self.is_producer = bool(self._kv_transfer_config.is_kv_producer)
        self.is_consumer = bool(self._kv_transfer_config.is_kv_consumer)
        group, self.layer_names = _single_attention_group(kv_cache_config)
        spec = group.kv_cache_spec
        self.page_tokens = int(spec.block_size)
        block_tokens = int(extra.get("block_tokens", 0)) or (
            DEFAULT_BLOCK_TOKENS if DEFAULT_BLOCK_TOKENS % self.page_tokens == 0 else self.page_tokens
        )
        if block_tokens % self.page_tokens:
            raise InvalidArgument(
                f"block_tokens {block_tokens} is not a multiple of vLLM's block size {self.page_tokens}"
            )
        model = str(extra.get("model") or vllm_config.model_config.model)
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self.layouts = [
            KVLayout(
                model=model, num_layers=len(self.layer_names), num_kv_heads=int(spec.num_kv_heads),
                head_dim=int(spec.head_size), dtype=dtype_name(spec.dtype), block_tokens=block_tokens,
                tp_rank=rank, tp_size=self.tp_size,
            )
            for rank in range(self.tp_size)
        ]  # fmt: skip
        self.layout = self.layouts[_tp_rank() if role == KVConnectorRole.WORKER else 0]
        self.pages_per_block = block_tokens // self.page_tokens
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kv_load_failure_policy is not 'recompute': a block the store loses fails its request")
        self._store: Store | None = None
        self._store_lock = threading.Lock()
        # Scheduler side.
        self._asked: dict[str, int] = {}  # request -> the local hit it was last asked about
        self._loads: dict[str, LoadSpec] = {}
        self._stored_upto: dict[str, int] = {}  # request -> prompt blocks the store holds (its load's end)
        self._requests: dict[str, _Request] = {}
        # Worker side.
        self._kv_caches: list[torch.Tensor] = []
        self._format: PagedFormat | None = None
        self._layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self._save_staging: list[tuple[SaveSpec, torch.Tensor, set[int]]] = []
        self._load_errors: set[int] = set()
        self._pending: dict[str, Future[None]] = {}
        self._errors_lock = threading.Lock()
        self._loader: ThreadPoolExecutor | None = None

    @property
    def store(self) -> Store:
        with self._store_lock:
            if self._store is None:
                self._store = Store.connect(self.master, ClientConfig(timeout_s=self.timeout_s))
            return self._store

    # ==============================================================================================
    # Scheduler side
    # ==============================================================================================
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the store can give: whole stored blocks of the prompt,
        held under every rank's namespace, never the last token (vLLM computes it to sample)."""
        if not self.is_consumer:
            return 0, False
        tokens = list(request.prompt_token_ids or [])
        try:
            hit = min(self.store.match_prefix(lay.keys(tokens)) for lay in self.layouts) if tokens else 0
        except KVStoreError as exc:
            log.warning("store lookup failed, computing request %s: %s", request.request_id, exc)
            return 0, False
        hit_tokens = min(hit * self.layouts[0].block_tokens, request.num_tokens - 1)
        self._asked[request.request_id] = num_computed_tokens  # the hit the count is relative to
        if hit_tokens <= num_computed_tokens:
            return 0, False
        return hit_tokens - num_computed_tokens, self.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
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
        self._loads[request.request_id] = LoadSpec(request.request_id, tokens, first, load_pages, end - first)
        self._stored_upto[request.request_id] = (local + num_external_tokens) // bt

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        for new in scheduler_output.scheduled_new_reqs:
            tokens = list(new.prompt_token_ids or [])
            # Blocks of a local prefix-cache hit are saved too (a no-op where the store has them).
            known = self._stored_upto.pop(new.req_id, 0)
            self._requests[new.req_id] = _Request(tokens, list(new.block_ids[0]), known)
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
        """Save the prompt's blocks this step completes that the store does not hold yet."""
        state = self._requests[req_id]
        if not self.is_producer:
            return
        bt, k = self.layouts[0].block_tokens, self.pages_per_block
        done = min(computed + out.num_scheduled_tokens.get(req_id, 0), len(state.tokens)) // bt
        if done <= state.saved_blocks or done * k > len(state.pages):
            return
        first = state.saved_blocks
        pages = state.pages[first * k : done * k]
        meta.saves.append(SaveSpec(req_id, state.tokens[: done * bt], first, pages, done - first))
        state.saved_blocks = done

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        self._stored_upto.pop(request.request_id, None)
        return False, None  # saves finish inside the step (wait_for_save): the pages are free to go

    # ==============================================================================================
    # Worker side
    # ==============================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise InvalidArgument(f"KV caches for layers {missing} were not registered")
        self._kv_caches = [kv_caches[name] for name in self.layer_names]
        self._format = _paged_format(self._kv_caches[0], self.layout, self.page_tokens)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        self._save_staging = [
            (spec, self.layout.staging(spec.num_blocks), set()) for spec in meta.saves
        ]  # fmt: skip
        for spec in meta.loads:
            if self.load_async:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-vllm-load")
                self._pending[spec.req_id] = self._loader.submit(self._load, spec)
            else:
                self._load(spec)

    def _load(self, spec: LoadSpec) -> None:
        """Load one request's blocks into its pages; pages of blocks that did not arrive are load errors."""
        assert self._format is not None
        lay = self.layout
        keys = lay.keys(spec.tokens)[spec.first_block : spec.first_block + spec.num_blocks]
        staging = lay.staging(len(keys))
        try:
            loaded = load_blocks(self.store, keys, staging)
        except KVStoreError as exc:
            log.warning("loading KV of request %s failed: %s", spec.req_id, exc)
            loaded = 0
        k = self.pages_per_block
        if loaded:
            scatter_paged(staging, self._kv_caches, lay, self._format, spec.pages[: loaded * k])
        failed = {p for p in spec.pages[loaded * k :] if p >= 0}
        if failed:
            with self._errors_lock:
                self._load_errors |= failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv (or between steps, with load_async)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Gather this layer's pages of every block being saved, as soon as the layer has written them."""
        layer = self._layer_index.get(layer_name)
        if layer is None or self._format is None:
            return
        for spec, staging, gathered in self._save_staging:
            _gather_layer(kv_layer, self.layout, self._format, spec.pages, staging, layer)
            gathered.add(layer)

    def wait_for_save(self) -> None:
        """Put the blocks of this step; layers whose save_kv_layer did not come are gathered now."""
        assert self._format is not None or not self._save_staging
        for spec, staging, gathered in self._save_staging:
            assert self._format is not None
            if len(gathered) < self.layout.num_layers:
                for layer in set(range(self.layout.num_layers)) - gathered:
                    _gather_layer(self._kv_caches[layer], self.layout, self._format, spec.pages, staging, layer)
            keys = self.layout.keys(spec.tokens)[spec.first_block : spec.first_block + spec.num_blocks]
            try:
                save_blocks(self.store, keys, staging)
            except KVStoreError as exc:
                log.warning("saving KV of request %s failed: %s", spec.req_id, exc)
        self._save_staging = []

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = {req for req, fut in self._pending.items() if fut.done()}
        for req in done:
            self._pending.pop(req).result()  # a load records its own errors; this surfaces bugs
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        with self._store_lock:
            if self._store is not None:
                self._store.close()
                self._store = None


# -- helpers -----------------------------------------------------------------------------------


def _single_attention_group(kv_cache_config: Any) -> tuple[Any, list[str]]:
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1 or not hasattr(groups[0].kv_cache_spec, "num_kv_heads"):
        raise InvalidArgument(
            "KVStoreConnector serves models with one full-attention KV cache group"
            " (start vLLM with --disable-hybrid-kv-cache-manager for others)"
        )
    return groups[0], list(groups[0].layer_names)


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

        return int(get_tensor_model_parallel_rank()) if model_parallel_is_initialized() else 0
    except (ImportError, AssertionError):
        return 0


def _paged_format(kv: torch.Tensor, layout: KVLayout, page_tokens: int) -> PagedFormat:
    """The format of vLLM's per-layer tensors: the standardized ``[B, H, N, C]`` view, or an older layout."""
    h, n, d = layout.num_kv_heads, page_tokens, layout.head_dim
    candidates = {
        "BHNC": (h, n, 2 * d), "BNHC": (n, h, 2 * d), "2BNHD": (None, n, h, d), "B2NHD": (2, n, h, d),
    }  # fmt: skip
    for order, tail in candidates.items():
        shape = tuple(kv.shape[1:]) if order[0] != "2" else (None, *kv.shape[2:])
        if len(order) == kv.dim() and shape == tail and (order[0] != "2" or kv.shape[0] == 2):
            return PagedFormat(order, page_tokens)
    raise InvalidArgument(f"vLLM KV tensor of shape {tuple(kv.shape)} matches no known paged layout")


def _gather_layer(
    kv: torch.Tensor, layout: KVLayout, fmt: PagedFormat, pages: Sequence[int], staging: torch.Tensor, layer: int
) -> None:
    """Copy one layer's pages into ``staging[:, layer]``."""
    gather_paged([kv], _one_layer(layout), fmt, pages, staging[:, layer : layer + 1])


def _one_layer(layout: KVLayout) -> KVLayout:
    return KVLayout(layout.model, 1, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.block_tokens,
                    layout.tp_rank, layout.tp_size)  # fmt: skip
