"""The vLLM connector's worker side: in each of vLLM's workers, it carries out the loads and saves the
scheduler side planned (:class:`KVStoreConnectorMetadata`), between the store and vLLM's KV pages.

Loads are read by a loader thread into staging memory and scattered into the pages (layer by layer
inside the forward pass, all layers before it, or between steps with ``load_async``); a block that does
not arrive is a load error, which vLLM recomputes. Saves are gathered from the pages inside the step (a
copy into staging memory, pinned on GPUs) and put by a saver thread, never on the forward path."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore_client.adapters.layout import (
    KVLayout,
    PagedFormat,
    gather_paged,
    leading_blocks,
    load_blocks,
    load_layer,
    save_blocks,
    scatter_paged,
)
from kvstore_client.adapters.vllm_config import ConnectorSettings
from kvstore_client.adapters.vllm_inspect import paged_format
from kvstore_client.adapters.vllm_metadata import KVStoreConnectorMetadata, LoadSpec, SaveSpec
from kvstore_client.adapters.vllm_metrics import KVStoreConnectorStats, StatsCounter
from kvstore_client.adapters.vllm_store import GuardedStore, repair

log = logging.getLogger("kvstore_client.adapters.vllm")  # the connector's: its lines go where its do


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


class KVStoreConnectorWorker:
    """The connector's worker side, for vLLM's worker-side hooks: one per worker, over that worker's
    layers and TP rank (:attr:`layout`).

    The forward pass (vLLM's thread) owns this step's loads and saves (``_step_loads``,
    ``_save_staging``); the loader threads fill a load's staging and events; the saver thread drains
    ``_saves``. ``_load_errors`` is guarded by ``_errors_lock``, ``_pending_save_blocks`` by ``_saved``."""

    def __init__(self, settings: ConnectorSettings, vllm_config: Any) -> None:
        self.settings = settings
        self.layout = settings.worker_layout()
        """This worker's key scheme: its TP rank's, over its pipeline stage's layers."""
        self._layer_layout = _one_layer(self.layout)  # moves one layer of this rank's blocks at a time
        self._vllm_config = vllm_config
        self.store = GuardedStore(settings.master, timeout_s=settings.timeout_s, put_mode=settings.put_mode)
        self.stats = StatsCounter()
        self._kv_caches: list[torch.Tensor] = []
        self.format: PagedFormat | None = None
        """How the attention backend lays out a page (None until :meth:`register_kv_caches`)."""
        self._layer_index = {name: i for i, name in enumerate(settings.layer_names)}
        self._save_staging: list[tuple[SaveSpec, torch.Tensor, set[int]]] = []
        self._step_loads: list[_Load] = []
        self._load_errors: set[int] = set()
        self._pending: dict[str, Future[None]] = {}
        self._errors_lock = threading.Lock()
        self._loader: ThreadPoolExecutor | None = None
        self._saves: queue.Queue[tuple[SaveSpec, list[str], torch.Tensor] | None] = queue.Queue()
        self._pending_save_blocks = 0
        self._saver: threading.Thread | None = None
        self._saved = threading.Condition()  # notified as queued saves finish
        self._pin = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = self.settings.layer_names
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise InvalidArgument(f"KV caches for layers {missing} were not registered")
        self._kv_caches = [kv_caches[name] for name in names]
        self.format = paged_format(self._vllm_config, names, self._kv_caches[0], self.layout,
                                   self.settings.page_tokens)  # fmt: skip
        self._pin = self._kv_caches[0].device.type == "cuda"

    def _staging(self, num_blocks: int) -> torch.Tensor:
        return self.layout.staging(num_blocks, pin=self._pin)

    def start_load_kv(self, meta: KVStoreConnectorMetadata) -> None:
        usable = self.store.available() if meta.loads or meta.saves else False
        if usable:
            self._save_staging = [(spec, self._staging(spec.num_blocks), set()) for spec in meta.saves]
        else:  # the store is sick: this step's saves are dropped, its loads recomputed
            self.stats.add("save_dropped_blocks", sum(spec.num_blocks for spec in meta.saves))
            self._save_staging = []
        self._step_loads = []
        for spec in meta.loads:
            if not usable:
                self.stats.add("skipped_ops")
                self._fail_pages(spec.pages)
                continue
            if self.settings.load_async:
                self._pending[spec.req_id] = self._pool().submit(self._load_whole, spec)
            elif self.settings.layerwise:
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
            sizes = self.store.client.sizes(keys)
            usable = leading_blocks(sizes, lay.block_bytes())
            self.stats.add("repaired_blocks", repair(self.store.client, keys, sizes, lay.block_bytes()))
            for layer in range(lay.num_layers):
                if usable:
                    load.layer_loaded[layer] = load_layer(self.store.client, keys[:usable], lay, layer, load.staging)
                load.layer_done[layer].set()
        except KVStoreError as exc:
            self.store.failed(exc, f"loading KV of request {load.spec.req_id}")
        finally:
            for event in load.layer_done:
                event.set()  # a failed read leaves its layers at 0 blocks: recomputed

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Wait for this layer's bytes of this step's loads, and put them into vLLM's pages."""
        layer = self._layer_index.get(layer_name)
        if layer is not None:
            self._scatter_layer(layer)

    def _scatter_layer(self, layer: int) -> None:
        assert self.format is not None or not self._step_loads
        for load in self._step_loads:
            if layer in load.scattered:
                continue
            if not load.layer_done[layer].wait(self.settings.timeout_s * 4):
                log.warning("layer %d of request %s did not arrive in time", layer, load.spec.req_id)
            load.scattered.add(layer)
            count = load.layer_loaded[layer] * self.settings.pages_per_block
            if count and self.format is not None:
                scatter_paged(load.staging[:, layer : layer + 1], [self._kv_caches[layer]], self._layer_layout,
                              self.format, load.spec.pages[:count])  # fmt: skip

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
        k = self.settings.pages_per_block
        self.stats.add("loaded_blocks", loaded)
        self.stats.add("loaded_bytes", loaded * self.layout.block_bytes())
        failed = [p for p in spec.pages[loaded * k :] if p >= 0]
        if failed:
            self.stats.add("load_failed_blocks", spec.num_blocks - loaded)
            self._fail_pages(failed)

    def _fail_pages(self, pages: Sequence[int]) -> None:
        with self._errors_lock:
            self._load_errors |= {p for p in pages if p >= 0}

    def _load_whole(self, spec: LoadSpec) -> None:
        """Load one request's blocks, every layer at once, into its pages (before the forward pass, or
        between steps with ``load_async``)."""
        assert self.format is not None
        keys = self._keys(spec.tokens, spec.extras, spec.first_block, spec.num_blocks)
        staging = self._staging(len(keys))
        try:
            loaded = load_blocks(self.store.client, keys, staging)
            if loaded < len(keys):
                rest = keys[loaded:]
                store = self.store.client
                self.stats.add("repaired_blocks", repair(store, rest, store.sizes(rest), self.layout.block_bytes()))
        except KVStoreError as exc:
            self.store.failed(exc, f"loading KV of request {spec.req_id}")
            loaded = 0
        if loaded:
            pages = spec.pages[: loaded * self.settings.pages_per_block]
            scatter_paged(staging, self._kv_caches, self.layout, self.format, pages)
        self._account_load(spec, loaded)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """Gather this layer's pages of every block being saved, as soon as the layer has written them."""
        layer = self._layer_index.get(layer_name)
        if layer is None or self.format is None:
            return
        for spec, staging, gathered in self._save_staging:
            _gather_layer(kv_layer, self._layer_layout, self.format, spec.pages, staging, layer)
            gathered.add(layer)

    def wait_for_save(self) -> None:
        """Finish this step's loads; gather the layers of this step's saves that save_kv_layer did not see,
        and hand the blocks to the saver thread (the put happens off the forward path)."""
        self._finish_loads()
        for spec, staging, gathered in self._save_staging:
            assert self.format is not None
            for layer in set(range(self.layout.num_layers)) - gathered:
                _gather_layer(self._kv_caches[layer], self._layer_layout, self.format, spec.pages, staging, layer)
            if self._pending_save_blocks + spec.num_blocks > self.settings.max_pending_save_blocks:
                self.stats.add("save_dropped_blocks", spec.num_blocks)
                continue
            keys = self._keys(spec.tokens, spec.extras, spec.first_block, spec.num_blocks)
            with self._saved:
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
                if self.store.breaker.is_closed and spec.labels is not None:
                    try:
                        self.store.client.label_blocks(keys, spec.labels)
                    except KVStoreError as exc:  # the blocks are worth saving unlabelled
                        self.stats.add("label_failures")
                        log.debug("labelling the blocks of request %s failed: %s", spec.req_id, exc)
                if self.store.breaker.is_closed:
                    save_blocks(self.store.client, keys, staging)
                    self.stats.add("saved_blocks", len(keys))
                    self.stats.add("saved_bytes", len(keys) * self.layout.block_bytes())
                else:
                    self.stats.add("save_dropped_blocks", len(keys))
            except KVStoreError as exc:
                self.store.failed(exc, f"saving KV of request {spec.req_id}")
                self.stats.add("save_failed_blocks", len(keys))
            finally:
                with self._saved:
                    self._pending_save_blocks -= len(keys)
                    self._saved.notify_all()

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Nothing is sent; received: the requests whose ``load_async`` loads are done."""
        done = {req for req, fut in self._pending.items() if fut.done()}
        for req in done:
            self._pending.pop(req).result()  # a load records its own errors; this surfaces bugs
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        return self.stats.take()

    def flush_saves(self, timeout_s: float | None = None) -> bool:
        """Wait (up to ``timeout_s``, default the store timeout) until every queued save has been put
        and is visible to every engine (``Store.flush``); returns whether they all were."""
        limit = self.settings.timeout_s if timeout_s is None else timeout_s
        with self._saved:
            if not self._saved.wait_for(lambda: self._pending_save_blocks == 0, limit):
                return False
        store = self.store.connected
        if store is None:
            return True
        try:
            store.flush()
        except KVStoreError as exc:
            log.warning("flushing saved KV blocks failed: %s", exc)
            return False
        return True

    def shutdown(self) -> None:
        if self._saver is not None:
            self.flush_saves()
            self._saves.put(None)
            self._saver.join(timeout=self.settings.timeout_s)
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        self.store.close()


def _gather_layer(
    kv: torch.Tensor, one: KVLayout, fmt: PagedFormat, pages: Sequence[int], staging: torch.Tensor, layer: int
) -> None:
    """Copy one layer's pages into ``staging[:, layer]`` (``one``: the layout of a single layer)."""
    gather_paged([kv], one, fmt, pages, staging[:, layer : layer + 1])


def _one_layer(layout: KVLayout) -> KVLayout:
    return KVLayout(layout.model, 1, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.block_tokens,
                    layout.tp_rank, layout.tp_size)  # fmt: skip
