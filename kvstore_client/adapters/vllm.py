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

The connector is a face, as vLLM's own ``NixlConnector`` is: vLLM builds one in its scheduler's
process and one in each worker's, and each delegates to its role's side,
:class:`~kvstore_client.adapters.vllm_scheduler.KVStoreConnectorScheduler` (lookups, and each step's
plan of loads and saves) or :class:`~kvstore_client.adapters.vllm_worker.KVStoreConnectorWorker`
(the bytes between the store and vLLM's pages). The two share their settings (``vllm_config.py``),
the plan that crosses from one to the other (``vllm_metadata.py``), the store behind its circuit
breaker (``vllm_store.py``) and the stats (``vllm_metrics.py``); neither imports the other.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvstore_client.adapters.layout import KVLayout, PagedFormat
from kvstore_client.adapters.vllm_config import ConnectorSettings, read_settings
from kvstore_client.adapters.vllm_metadata import KVStoreConnectorMetadata
from kvstore_client.adapters.vllm_metrics import KVStoreConnectorStats, KVStorePromMetrics
from kvstore_client.adapters.vllm_scheduler import KVStoreConnectorScheduler
from kvstore_client.adapters.vllm_worker import KVStoreConnectorWorker

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata"]

log = logging.getLogger(__name__)


class KVStoreConnector(KVConnectorBase_V1):
    """vLLM's KV connector v1 on the store, in either role: exactly one of :attr:`connector_scheduler`
    and :attr:`connector_worker` is set, by the role vLLM built it for, and every hook goes to that one
    (a worker's hook on the scheduler's connector is a bug in the caller: an AssertionError)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings: ConnectorSettings = read_settings(vllm_config, self._kv_transfer_config, kv_cache_config)
        self.layouts: list[KVLayout] = self.settings.layouts
        """The key scheme of every TP rank and pipeline stage (the scheduler asks them all)."""
        self.connector_scheduler: KVStoreConnectorScheduler | None = None
        self.connector_worker: KVStoreConnectorWorker | None = None
        # This role's key scheme (``layout``): a worker's own rank's and stage's; the scheduler's first one.
        if role == KVConnectorRole.WORKER:
            self.connector_worker = KVStoreConnectorWorker(self.settings, vllm_config)
            self.layout = self.connector_worker.layout
        else:
            self.connector_scheduler = KVStoreConnectorScheduler(self.settings)
            self.layout = self.layouts[0]
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kv_load_failure_policy is not 'recompute': a block the store loses fails its request")

    def _scheduler(self) -> KVStoreConnectorScheduler:
        assert self.connector_scheduler is not None, "a scheduler hook called on a worker's connector"
        return self.connector_scheduler

    def _worker(self) -> KVStoreConnectorWorker:
        assert self.connector_worker is not None, "a worker hook called on the scheduler's connector"
        return self.connector_worker

    @property
    def _format(self) -> PagedFormat | None:
        """How the worker's attention backend lays out a page (tests read pages through it); None on the
        scheduler and before ``register_kv_caches``."""
        return self.connector_worker.format if self.connector_worker is not None else None

    # -- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVStoreConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    # -- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        self._worker().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker().save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def flush_saves(self, timeout_s: float | None = None) -> bool:
        """Wait (up to ``timeout_s``, default the store timeout) until every save this worker queued has
        been put and is visible to every engine; returns whether they all were. The scheduler saves
        nothing: True at once."""
        if self.connector_worker is None:
            return True
        return self.connector_worker.flush_saves(timeout_s)

    # -- both --------------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.connector_worker is not None:
            return self.connector_worker.get_kv_connector_stats()
        return self._scheduler().get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
    ) -> KVConnectorPromMetrics | None:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
