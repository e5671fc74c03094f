"""What vLLM's engine is, read from vLLM itself: its KV cache spec, pipeline stages and ranks, the page
layout of its attention backend, and what besides tokens changes a request's KV.

The connector (:mod:`kvstore_client.adapters.vllm`) builds its :class:`KVLayout` (in ``vllm_config.py``)
and :class:`PagedFormat` (in ``vllm_worker.py``) from these, and refuses at start what it cannot store
faithfully.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvstore.errors import InvalidArgument
from kvstore_client.adapters.layout import HeadInterior, KVLayout, PagedFormat

FUSED_BACKENDS = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"})
"""GPU backends whose ``[B, H, N, C]`` view holds each token's K then V in C (read from their sources:
they split C at head_size). Any other backend but CPU_ATTN is refused."""

log = logging.getLogger("kvstore_client.adapters.vllm")  # the connector's: its lines go where its do


def block_extras(request: Any, num_blocks: int, block_tokens: int) -> list[bytes] | None:
    """Per stored block, what besides its tokens changes its KV, as vLLM's own prefix cache hashes it:
    the LoRA adapter (name and path), the cache salt (block 0), multimodal inputs placed in the block
    and prompt embeddings. None when nothing does (the common case: keys are then the tokens' alone)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    out: list[bytes] = []
    mm_index = 0
    for i in range(num_blocks + 1):  # + 1: the trailing partial block's, for a prompt shorter than one block
        keys, mm_index = generate_block_hash_extra_keys(request, i * block_tokens, (i + 1) * block_tokens, mm_index)
        out.append(repr(keys).encode() if keys else b"")
    return out if any(out) else None


def single_attention_group(kv_cache_config: Any) -> tuple[Any, list[str]]:
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1 or not hasattr(groups[0].kv_cache_spec, "num_kv_heads"):
        raise InvalidArgument(
            "KVStoreConnector serves models with one full-attention KV cache group"
            " (start vLLM with --disable-hybrid-kv-cache-manager for others)"
        )
    return groups[0], list(groups[0].layer_names)


def check_spec(spec: Any, vllm_config: Any) -> None:
    """Refuse, at start, the KV caches whose blocks this connector cannot store faithfully."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    kind = type(spec).__name__
    if not isinstance(spec, FullAttentionSpec) or isinstance(spec, MLAAttentionSpec):
        raise InvalidArgument(f"KVStoreConnector serves full-attention KV caches only, not {kind}")
    if getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
        raise InvalidArgument(
            "KVStoreConnector cannot serve sliding-window or chunked-local attention layers: their pages do"
            " not hold every token of a prefix"
        )
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    if cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise InvalidArgument(
            f"KVStoreConnector does not store quantized KV caches yet (kv_cache_dtype={cache_dtype!r});"
            " run with kv_cache_dtype 'auto'"
        )


def stage_layers(layer_names: list[str], vllm_config: Any, pp_size: int) -> list[tuple[int, int, int]]:
    """(first layer, layers, model layers) of every pipeline stage."""
    if pp_size <= 1:
        return [(0, len(layer_names), len(layer_names))]
    from vllm.distributed.utils import get_pp_indices

    total = int(vllm_config.model_config.hf_text_config.num_hidden_layers)
    stages = []
    for rank in range(pp_size):
        start, end = get_pp_indices(total, rank, pp_size)
        stages.append((start, end - start, total))
    return stages


def worker_layers(layer_names: list[str], pp_size: int, stages: list[tuple[int, int, int]]) -> tuple[int, int]:
    """(first layer, model layers) of this worker's pipeline stage, from its attention layers' names."""
    if pp_size <= 1:
        return 0, len(layer_names)
    from vllm.model_executor.models.utils import extract_layer_index

    indices = sorted(extract_layer_index(name) for name in layer_names)
    if indices != list(range(indices[0], indices[0] + len(indices))):
        raise InvalidArgument(f"a pipeline stage's attention layers are not contiguous: {indices}")
    for first, count, total in stages:
        if first == indices[0] and count == len(indices):
            return first, total
    raise InvalidArgument(f"layers {indices[0]}..{indices[-1]} are no pipeline stage of {stages}")


def tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

        return int(get_tensor_model_parallel_rank()) if model_parallel_is_initialized() else 0
    except (ImportError, AssertionError):
        return 0


def backend_name(vllm_config: Any, layer_names: list[str]) -> str:
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    names = {b.get_name() for b in get_current_attn_backends(vllm_config, layer_names)}
    if len(names) != 1:
        raise InvalidArgument(f"KVStoreConnector needs one attention backend for all layers, got {sorted(names)}")
    return names.pop()


def paged_format(
    vllm_config: Any, layer_names: list[str], kv: torch.Tensor, layout: KVLayout, page_tokens: int
) -> PagedFormat:
    """How this engine's backend really lays out a page: read, not assumed from the tensor's shape."""
    backend = backend_name(vllm_config, layer_names)
    want = (layout.num_kv_heads, page_tokens, 2 * layout.head_dim)
    if kv.dim() != 4 or tuple(kv.shape[1:]) != want:
        raise InvalidArgument(f"{backend} KV tensor of shape {tuple(kv.shape)} is not vLLM's [B, H, N, C] {want}")
    if backend in FUSED_BACKENDS:
        return PagedFormat("BHNC", page_tokens)
    if backend == "CPU_ATTN":
        return PagedFormat("BHNC", page_tokens, cpu_attn_interior(kv.dtype, page_tokens, layout.num_kv_heads,
                                                                  layout.head_dim, vllm_config))  # fmt: skip
    raise InvalidArgument(
        f"KVStoreConnector cannot decode pages of the {backend} attention backend;"
        f" it serves {', '.join(sorted(FUSED_BACKENDS | {'CPU_ATTN'}))}"
    )


def cpu_attn_interior(
    dtype: torch.dtype, page_tokens: int, heads: int, head_dim: int, vllm_config: Any
) -> HeadInterior:
    """Where vLLM's CPU attention kernel puts K and V inside a head's page, read from where its own
    ``cpu_attn_reshape_and_cache`` writes known values (the layout depends on the CPU's ISA)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    isa = _get_attn_isa(vllm_config.model_config.dtype, page_tokens, head_dim, cache_dtype)
    n, d = page_tokens, head_dim
    code = torch.arange(n * d, dtype=torch.long).view(n, 1, d).expand(n, heads, d)
    slots = torch.arange(n, dtype=torch.long)

    def write(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        cache = torch.full((1, heads, n, 2 * d), -1.0, dtype=dtype)
        k_cache, v_cache = cache.view(1, heads, 2 * n, d).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key.to(dtype).contiguous(), value.to(dtype).contiguous(), k_cache, v_cache,
                                       slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype=cache_dtype)  # fmt: skip
        return cache[0].reshape(heads, -1).to(torch.long)

    # Values up to 255 are exact in every float type: write the element's index a byte at a time.
    value = torch.zeros(heads, 2 * n * d, dtype=torch.long)
    for byte in range(((n * d - 1).bit_length() + 7) // 8):
        digit = (code >> (8 * byte)) & 255
        value |= write(digit, digit) << (8 * byte)
    part = write(torch.ones(n, heads, d), torch.full((n, heads, d), 2.0))
    offsets = torch.full((2, n * d), -1, dtype=torch.long)
    where = torch.arange(2 * n * d)
    for p in (0, 1):
        placed = part[0] == p + 1
        offsets[p, value[0][placed]] = where[placed]
    if bool((part[1:] != part[0]).any()) or bool((value[1:] != value[0]).any()):
        raise InvalidArgument(f"CPU attention ({isa}) lays out heads' pages differently: cannot decode it")
    interior = HeadInterior.from_offsets(f"cpu_attn/{isa}", offsets.view(2, n, d))
    log.info("KV pages of %s (%s, %d-token pages): %s", interior.name, dtype, page_tokens,
             "strided" if interior.strided else "read through their probed index")  # fmt: skip
    return interior
