"""The vLLM connector's settings, read once from vLLM's config: the options of
``kv_connector_extra_config`` (listed in :mod:`kvstore_client.adapters.vllm`), the role flags of
``kv_role``, and the key scheme of vLLM's KV cache spec for every tensor-parallel rank and pipeline
stage. The scheduler's and the workers' connectors read them the same way; each keeps what it uses.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal

from kvstore.errors import InvalidArgument
from kvstore_client.adapters.layout import KVLayout, dtype_name
from kvstore_client.adapters.vllm_inspect import (
    check_spec,
    single_attention_group,
    stage_layers,
    tp_rank,
    worker_layers,
)

DEFAULT_BLOCK_TOKENS = 256


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What a connector of either role is told at start. Frozen: nothing changes it after
    :func:`read_settings`."""

    master: str
    """The store's master, host:port."""
    timeout_s: float
    """The workers' store calls: loads and saves."""
    lookup_timeout_s: float
    """The scheduler's store calls: the prefix lookup."""
    put_mode: Literal["visible", "cached"]
    """Saves are acknowledged by the daemon ("cached", the default: the saver thread is not held by
    the master's commit; other engines find a block a few ms later) or by the master ("visible")."""
    load_async: bool
    """Load between scheduler steps instead of inside the forward pass."""
    layerwise: bool
    """Each attention layer waits only for its own layer's bytes (never with ``load_async``)."""
    max_pending_save_blocks: int
    """Saves queued past it are dropped."""
    save_decode: bool
    """Also save the blocks a request's answer completes, for the next turn of a conversation."""
    label_blocks: bool
    """Label each block saved with vLLM's block hash, parent hash and tokens (an extra master call a
    save, off the forward path), so that the store's KV events name blocks as vLLM's own do."""
    is_producer: bool
    is_consumer: bool
    layer_names: list[str]
    """The attention layers of the engine's one KV cache group, in vLLM's order."""
    page_tokens: int
    """vLLM's block size: tokens per page."""
    block_tokens: int
    """Tokens per stored block, a multiple of ``page_tokens``."""
    pages_per_block: int
    layouts: list[KVLayout]
    """The key scheme of every pipeline stage's every TP rank, stage-major: the scheduler's lookup asks
    them all, and its stats report ``layouts[0]``'s."""
    pp_size: int
    stages: list[tuple[int, int, int]]
    """Per pipeline stage: its first layer, its number of layers, the model's layers."""

    def worker_layout(self) -> KVLayout:
        """A worker's own key scheme: its TP rank's, over its pipeline stage's layers (call it in a
        worker: it asks vLLM's distributed state for the rank)."""
        first, total = worker_layers(self.layer_names, self.pp_size, self.stages)
        return dataclasses.replace(self.layouts[0], tp_rank=tp_rank(), first_layer=first,
                                   num_layers=len(self.layer_names), model_layers=total)  # fmt: skip


def read_settings(vllm_config: Any, kv_transfer_config: Any, kv_cache_config: Any) -> ConnectorSettings:
    """The settings, checked (in this order): InvalidArgument for a missing master, an unknown
    ``put_mode``, a KV cache this connector cannot store faithfully, or ``block_tokens`` not a
    multiple of vLLM's block size."""
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    master = extra.get("master") or os.environ.get("KVSTORE_MASTER")
    if not master:
        raise InvalidArgument("KVStoreConnector needs kv_connector_extra_config.master (or $KVSTORE_MASTER)")
    timeout_s = float(extra.get("timeout_s", 5.0))
    lookup_timeout_s = float(extra.get("lookup_timeout_s", 1.0))
    put_mode = extra.get("put_mode", "cached")
    if put_mode not in ("visible", "cached"):
        raise InvalidArgument(f'kv_connector_extra_config.put_mode is "visible" or "cached", not {put_mode!r}')
    load_async = bool(extra.get("load_async", False))
    layerwise = bool(extra.get("layerwise", True)) and not load_async
    max_pending_save_blocks = int(extra.get("max_pending_save_blocks", 512))
    save_decode = bool(extra.get("save_decode", False))
    label_blocks = bool(extra.get("label_blocks", False))
    is_producer = bool(kv_transfer_config.is_kv_producer)
    is_consumer = bool(kv_transfer_config.is_kv_consumer)
    group, layer_names = single_attention_group(kv_cache_config)
    spec = group.kv_cache_spec
    check_spec(spec, vllm_config)
    page_tokens = int(spec.block_size)
    block_tokens = int(extra.get("block_tokens", 0)) or (
        DEFAULT_BLOCK_TOKENS if DEFAULT_BLOCK_TOKENS % page_tokens == 0 else page_tokens
    )
    if block_tokens % page_tokens:
        raise InvalidArgument(f"block_tokens {block_tokens} is not a multiple of vLLM's block size {page_tokens}")
    model = str(extra.get("model") or vllm_config.model_config.model)
    parallel = vllm_config.parallel_config
    tp_size = int(parallel.tensor_parallel_size)
    pp_size = int(getattr(parallel, "pipeline_parallel_size", 1))
    stages = stage_layers(layer_names, vllm_config, pp_size)

    def layout(rank: int, first: int, count: int, total: int) -> KVLayout:
        return KVLayout(
            model=model, num_layers=count, num_kv_heads=int(spec.num_kv_heads), head_dim=int(spec.head_size),
            dtype=dtype_name(spec.dtype), block_tokens=block_tokens, tp_rank=rank, tp_size=tp_size,
            first_layer=first, model_layers=total,
        )  # fmt: skip

    return ConnectorSettings(
        master=str(master), timeout_s=timeout_s, lookup_timeout_s=lookup_timeout_s, put_mode=put_mode,
        load_async=load_async, layerwise=layerwise, max_pending_save_blocks=max_pending_save_blocks,
        save_decode=save_decode, label_blocks=label_blocks, is_producer=is_producer, is_consumer=is_consumer,
        layer_names=layer_names, page_tokens=page_tokens, block_tokens=block_tokens,
        pages_per_block=block_tokens // page_tokens,
        layouts=[layout(r, *stage) for stage in stages for r in range(tp_size)], pp_size=pp_size, stages=stages,
    )  # fmt: skip
