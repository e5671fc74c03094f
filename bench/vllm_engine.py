"""A real vLLM engine (its CPU build) driven over stdin/stdout, for the engine tests and benchmark.

Run by the vLLM environment's Python (``scripts/vllm-env.sh``), never imported by the
main environment (:class:`bench.vllm_serving.VllmEngine` starts it). It starts
``vllm.LLM`` on a model directory, with the store's connector when ``--master`` is
given, prints ``{"ready": seconds}``, then answers one JSON line per command line on stdin:

- ``{"prompts": [[token ids], ...], "max_tokens": 8, "salt": ""}`` -> ``{"tokens": [[...], ...],
  "cached": [num_cached_tokens, ...], "times": [s, ...], "seconds": s, "metrics": {...}}``:
  greedy outputs, the prompt tokens vLLM did not compute (its own prefix cache and the
  store's), each prompt's time, each prompt with the ``cache_salt`` given, if any, and
  how much vLLM's prefix-cache counters and the connector's (``vllm:kvstore_*``) grew;
- ``{"quit": true}`` -> exits.

``--cpu-isa vector`` (or ``$KVSTORE_VLLM_CPU_ISA``) keeps vLLM's CPU attention off AMX on a
machine that has it: it takes its AVX-512 vector kernels and their page layout, the path a CPU
without AMX (AMD EPYC) takes. (Capping oneDNN too, with ``ONEDNN_MAX_CPU_ISA``, kills vLLM 0.32's
engine core on its first step: the linear layers keep whatever oneDNN picks.) ``ready`` names
the attention kernels vLLM chose (``attention_isa``).

Prompts run one after another (each its own ``generate`` call) and vLLM's own prefix
cache is reset before each, so that ``cached`` counts what the store gave. Answer lines
start with ``@@`` (vLLM prints to stdout too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--master", default="")
    parser.add_argument("--extra", default="{}", help="JSON merged into kv_connector_extra_config")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--cpu-isa", choices=("auto", "vector"), default=os.environ.get("KVSTORE_VLLM_CPU_ISA") or "auto"
    )
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    if args.cpu_isa == "vector":
        without_amx()
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    if args.master:
        extra = {"master": args.master, **json.loads(args.extra)}
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore_client.adapters.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=args.dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=0,
        disable_log_stats=False,
        **kwargs,
    )
    say(
        {
            "ready": round(time.perf_counter() - started, 2),
            "attention_isa": attention_isa(llm, args.dtype, args.block_size),
        }
    )
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        sampling = SamplingParams(max_tokens=int(command.get("max_tokens", 8)), temperature=0.0)
        tokens, cached, times = [], [], []
        before = counters(llm)
        began = time.perf_counter()
        for prompt in command["prompts"]:
            llm.reset_prefix_cache()
            request: dict[str, Any] = {"prompt_token_ids": prompt}
            if command.get("salt"):
                request["cache_salt"] = command["salt"]
            t = time.perf_counter()
            out = llm.generate([request], sampling, use_tqdm=False)[0]
            times.append(round(time.perf_counter() - t, 4))
            tokens.append(list(out.outputs[0].token_ids))
            cached.append(int(out.num_cached_tokens or 0))
        seconds = round(time.perf_counter() - began, 4)
        after = counters(llm)
        grew = {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
        say({"tokens": tokens, "cached": cached, "times": times, "seconds": seconds, "metrics": grew})


def without_amx() -> None:
    """Keep vLLM's CPU attention (and its page layout) off AMX in this process and in the engine
    processes it spawns (``vllm_vector/sitecustomize.py``, on their ``PYTHONPATH``, patches torch's
    AMX check in each)."""
    os.environ["KVSTORE_VLLM_CPU_ISA"] = "vector"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # so that ``ready`` can ask the workers (attention_isa)
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_vector")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False


def attention_isa(llm: Any, dtype: str, block_size: int) -> str:
    """The kernels vLLM's CPU attention picks for this dtype and page size ("amx", "vec", ...), as
    its worker processes choose them (asked over vLLM's collective RPC where it lets a function
    travel, else the choice this process would make)."""
    if os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") == "1":
        return ",".join(sorted(set(llm.collective_rpc(_worker_isa, args=(dtype, block_size)))))
    return _worker_isa(None, dtype, block_size)


def _worker_isa(worker: Any, dtype: str, block_size: int) -> str:
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(getattr(torch, dtype), block_size))


def counters(llm: Any) -> dict[str, float]:
    """vLLM's prefix-cache counters and the connector's, summed over their labels."""
    from vllm.v1.metrics.reader import Counter

    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and ("prefix_cache" in metric.name or "kvstore" in metric.name):
            out[metric.name] = out.get(metric.name, 0) + metric.value
    return out


def say(obj: dict[str, Any]) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
