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
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
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
    say({"ready": round(time.perf_counter() - started, 2)})
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
