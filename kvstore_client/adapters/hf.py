"""Hugging Face transformers models on the store: building a model from a config, its KV layout,
and its ``DynamicCache`` to and from blocks.

Models are built from a transformers config with seeded random weights (nothing is
downloaded): the same config and seed give the same weights in every process, so
a prefill worker and a decode worker share KV. The model's identity in the key
namespace is a fingerprint of config and seed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvstore.errors import InvalidArgument
from kvstore_client.adapters.layout import DTYPES, KVLayout, gather_hf, hf_layers_from

DEFAULT_MODEL_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 8192,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.05,
}
"""A small Llama-shaped model (31M parameters, GQA 8:2, 8 layers): a 2,048-token prefill takes seconds on CPU.

Random weights at the usual ``initializer_range`` of 0.02 make such a model repeat one token;
at 0.05 its greedy output varies, so comparing generated tokens means something."""

DEFAULT_BLOCK_TOKENS = 256


def load_model_config(path: str | Path | None = None) -> Any:
    """A transformers config from a ``config.json`` (or a directory holding one); the default when None."""
    from transformers import AutoConfig

    if path is None:
        data = dict(DEFAULT_MODEL_CONFIG)
    else:
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
        try:
            data = json.loads(file.read_text())
        except OSError as exc:
            raise InvalidArgument(f"cannot read model config {file}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"model config {file} is not valid JSON: {exc.msg}") from None
        if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
            raise InvalidArgument(f"model config {file} has no 'model_type'")
    data = dict(data)
    model_type = data.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidArgument(f"transformers cannot build a {model_type!r} config: {exc}") from None


def _init_device(device: str) -> str:
    """Where random weights are drawn: a GPU draws other numbers than the CPU from the same seed."""
    return torch.device(device).type


def fingerprint(config: Any, seed: int, device: str = "cpu") -> str:
    """``<model_type>-<16 hex>``: equal for equal configs, seeds and initialising devices, so equal weights."""
    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    for volatile in ("transformers_version", "_attn_implementation_autoset"):
        text = text.replace(volatile, "")
    init = _init_device(device)
    digest = hashlib.sha256(f"{text}|seed={seed}{'' if init == 'cpu' else f'|init={init}'}".encode()).hexdigest()
    return f"{config.model_type}-{digest[:16]}"


def build_model(config: Any, *, seed: int = 0, dtype: str = "float32", attn: str = "sdpa", device: str = "cpu") -> Any:
    """A causal LM with random weights drawn from ``seed`` on ``device`` (fast for large models), in eval mode.

    Every process that builds it on the same kind of device gets the same weights.
    """
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise InvalidArgument(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    model.to(dtype=DTYPES[dtype])
    model.eval()
    # Greedy generation that stops only at max_new_tokens or EOS, the same in every worker.
    model.generation_config.do_sample = False
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    return model


def layout_for(
    config: Any,
    *,
    seed: int = 0,
    dtype: str = "float32",
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    name: str | None = None,
    device: str = "cpu",
) -> KVLayout:
    """The KV layout of a model built by :func:`build_model` from ``config``, ``seed`` and ``device``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if any(t != "full_attention" for t in getattr(text, "layer_types", None) or []):
        raise InvalidArgument("only models whose every layer is full attention map to prefix blocks")
    return KVLayout(
        model=name or fingerprint(config, seed, device),
        num_layers=text.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        block_tokens=block_tokens,
    )


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) tensors ``[batch, kv_heads, tokens, head_dim]`` of a ``DynamicCache``."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_from_blocks(
    parts: Sequence[torch.Tensor], layout: KVLayout, config: Any, tokens: int, device: torch.device | str = "cpu"
) -> Any:
    """A ``DynamicCache`` on ``device`` holding the first ``tokens`` tokens of staging tensors laid end to end."""
    from transformers import DynamicCache

    if tokens == 0:
        return DynamicCache(config=config)
    if torch.device(device).type != "cpu":
        # The staged blocks travel as they are (pinned: at the link's speed); the device transposes them.
        parts = [p.to(device, non_blocking=True) for p in parts]
    return DynamicCache(ddp_cache_data=hf_layers_from(parts, layout, tokens), config=config)


def blocks_from_cache(cache: Any, layout: KVLayout, start: int, out: torch.Tensor) -> None:
    """Copy ``out.shape[0]`` blocks of the cache's tokens from ``start`` on into the staging tensor ``out``."""
    gather_hf(cache_layers(cache), layout, start, out)
