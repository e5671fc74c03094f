"""Engine benchmark: time to first token with a stored prefix, against recomputing it and against the ideal.

For a prompt of ``--prompt-tokens`` tokens with a share ``stored_fraction`` of it
already in the store (put there by an earlier prefill of that prefix), one JSON
line per (fraction, transport) with, measured in the same run on the same model:

- ``ttft_recompute_s``: a prefill that loads nothing (the baseline);
- ``ttft_suffix_only_s``: the same suffix computed with the prefix's KV already
  in memory (the ideal a store can approach);
- ``ttft_loaded_s``: the prefill worker looking the prefix up, loading it from the
  store (``transport``: ``tcp`` over loopback, or ``auto``, which is shared memory
  on this host) and computing the suffix;
- ``decision``: what the worker's load-or-recompute choice was; ``ttft_always_load_s``:
  the same worker made to load the stored prefix (what loading costs where the
  worker declines it), with its store load (``always_load_s``) and the building of
  the engine's cache from the loaded blocks (``always_build_s``);
- ``efficiency`` = suffix_only / loaded, ``speedup`` = recompute / loaded;
- ``tokens_match``: the greedy tokens of prefill -> store -> decode (a decode
  worker in another process loading the KV from the store) equal single-process
  ``generate``; ``max_abs_logit_diff`` over the first token's and every decode
  step's logits. In a 16-bit dtype, tokens are compared up to the first step whose
  top-two logit gap is within ``logit_tolerance`` (past it either token is right).

And one ``decode_tail`` line: for a prompt that ends ``--tail-tokens`` into a block, the
decode worker's time until its cache is ready when the partial last block is loaded from
the store (the prefill stored it) against recomputing it.

Times are medians of ``--repeat`` runs, interleaved so that noise falls on all alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from typing import Any

import torch

from kvstore.config import ClientConfig
from kvstore_cli.cluster import LocalCluster
from kvstore_cli.engines import engine_arguments
from kvstore_client.adapters.pd import EngineSpec, WorkerPool
from kvstore_client.adapters.workers import PrefillWorker
from kvstore_client.store import Store


def logit_tolerance(dtype: torch.dtype, reference: torch.Tensor) -> float:
    """How far logits computed along another path may differ in ``dtype``: 0 in float32 (same arithmetic)."""
    if dtype == torch.float32:
        return 0.0
    return 8 * torch.finfo(dtype).eps * max(1.0, float(reference.abs().max()))


def compare(
    tokens: list[int], logits: list[torch.Tensor], ref_tokens: list[int], ref_logits: list[torch.Tensor], tol: float
) -> tuple[bool, float]:
    """(tokens match, max |logit difference|) of a run against the single-process reference."""
    diff = 0.0
    for i, (tok, ref) in enumerate(zip(tokens, ref_tokens, strict=False)):
        if i < len(logits) and i < len(ref_logits):
            diff = max(diff, float((logits[i] - ref_logits[i]).abs().max()))
        top2 = torch.topk(ref_logits[i], 2).values
        if tol and float(top2[0] - top2[1]) <= tol:
            return True, diff  # a near tie: past it, either continuation is the model's answer
        if tok != ref:
            return False, diff
    return len(tokens) == len(ref_tokens), diff


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _reference(model: Any, prompt: torch.Tensor, new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and their logits from single-process ``generate``."""
    with torch.inference_mode():
        ref = model.generate(
            prompt.unsqueeze(0).to(model.device), max_new_tokens=new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return ref.sequences[0, prompt.numel() :].tolist(), [x[0].float().cpu() for x in ref.logits]


def _decode_matches(
    decoded: dict[str, Any],
    first_logits: torch.Tensor | None,
    reference: tuple[list[int], list[torch.Tensor]],
    dtype: torch.dtype,
) -> tuple[bool, float, float]:
    """(tokens match, max |logit difference|, tolerance) of a prefill -> decode run against the reference."""
    assert first_logits is not None
    tol = logit_tolerance(dtype, reference[1][0])
    match, diff = compare(decoded["tokens"], [first_logits, *decoded["logits"]], *reference, tol)
    return match, diff, tol


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    spec = EngineSpec(
        model_config=str(args.model_config) if args.model_config else None, seed=args.seed, dtype=args.dtype,
        block_tokens=args.block_tokens, threads=os.cpu_count() or 1, device=args.device,
    )  # fmt: skip
    model, layout = spec.build()
    vocab = model.config.get_text_config().vocab_size
    fractions = [float(f) for f in args.fractions.split(",")]
    transports = args.transports.split(",")
    rows: list[dict[str, Any]] = []
    with (
        LocalCluster(args.daemons, dram=args.dram) as cluster,
        WorkerPool(cluster.master_address, spec, prefill=0, decode=1) as pool,
    ):
        stores = {t: Store.connect(cluster.master_address, ClientConfig(transport=t)) for t in transports}
        try:
            reference = PrefillWorker(model, layout, None, load_policy="never")
            reference.calibrate(args.calibrate_tokens)
            writer = PrefillWorker(model, layout, stores[transports[0]], load_policy="never")
            loaders = {t: PrefillWorker(model, layout, s, store_new=False) for t, s in stores.items()}
            for worker in (writer, *loaders.values()):
                worker.prefill_cost = reference.prefill_cost  # one fitted model, learning from every run
                worker._probe(4)
            for index, fraction in enumerate(fractions):
                g = torch.Generator().manual_seed(1000 + index)
                prompt = torch.randint(0, vocab, (args.prompt_tokens,), generator=g)
                rows.extend(_measure(args, model, layout, pool, reference, writer, loaders, prompt, fraction))
            a, b, c = reference.prefill_cost.coefficients
            rows.append({
                "bench": "engines", "op": "cost_models", "prefill_fixed_s": a, "prefill_per_token_s": b,
                "prefill_per_token_pair_s": c,
                **{f"{t}_load_latency_s": w.load_cost.latency_s for t, w in loaders.items()},
                **{f"{t}_load_GBps": round(w.load_cost.bytes_per_s / 1e9, 3) for t, w in loaders.items()},
            })  # fmt: skip
            if args.tail_tokens:
                g = torch.Generator().manual_seed(999)
                prompt = torch.randint(0, vocab, (args.prompt_tokens + args.tail_tokens,), generator=g)
                rows.append(_measure_tail(args, model, layout, pool, writer, prompt))
        finally:
            for s in stores.values():
                s.close()
    return rows


def _measure(
    args: argparse.Namespace,
    model: Any,
    layout: Any,
    pool: WorkerPool,
    reference: PrefillWorker,
    writer: PrefillWorker,
    loaders: dict[str, PrefillWorker],
    prompt: torch.Tensor,
    fraction: float,
) -> list[dict[str, Any]]:
    n = prompt.numel()
    bt = layout.block_tokens
    stored = min(round(fraction * n / bt) * bt, (n - 1) // bt * bt)
    if stored:
        writer.prefill(prompt[:stored])  # stores the prefix's blocks, as an earlier request would have
    prefix_cache = reference.forward(prompt[:stored], None)[1] if stored else None
    recompute: list[float] = []
    ideal: list[float] = []
    loaded: dict[str, list[float]] = {t: [] for t in loaders}
    always: dict[str, list[float]] = {t: [] for t in loaders}
    parts: dict[str, list[tuple[float, float]]] = {t: [] for t in loaders}
    loaded_tokens: dict[str, int] = {}
    decisions: dict[str, str] = {}
    predicted: dict[str, tuple[float, float]] = {}
    for _ in range(args.repeat):
        recompute.append(reference.prefill(prompt).ttft_s)
        cache = copy.deepcopy(prefix_cache)
        t = time.perf_counter()
        logits, _ = reference.forward(prompt[stored:], cache)
        int(torch.argmax(logits))
        ideal.append(time.perf_counter() - t)
        for name, worker in loaders.items():
            result = worker.prefill(prompt)
            loaded[name].append(result.ttft_s)
            loaded_tokens[name], decisions[name] = result.loaded_tokens, result.decision
            predicted[name] = (result.predicted_s, result.predicted_recompute_s)
            # The same worker made to load whatever is stored: what loading costs where auto declines it.
            worker.load_policy = "always"
            forced = worker.prefill(prompt)
            always[name].append(forced.ttft_s)
            parts[name].append((forced.load_s, forced.build_s))
            worker.load_policy = "auto"
    # prefill -> store -> decode in another process, against generate() in this one.
    first = writer.prefill(prompt, keep_logits=True)  # stores every block and the tail
    decoded = pool.submit("decode", 0, tokens=prompt.tolist(), first_token=first.first_token,
                          max_new_tokens=args.decode_tokens, keep_logits=True).result(timeout=600)  # fmt: skip
    match, diff, tol = _decode_matches(decoded, first.logits, _reference(model, prompt, args.decode_tokens),
                                       layout.torch_dtype)  # fmt: skip
    rows = []
    for name in loaders:
        t_loaded = _median(loaded[name])
        rows.append({
            "bench": "engines", "model": layout.model, "dtype": layout.dtype, "device": str(model.device),
            "prompt_tokens": n,
            "block_tokens": bt, "stored_fraction": fraction, "stored_tokens": stored,
            "loaded_tokens": loaded_tokens[name], "transport": name,
            "ttft_recompute_s": round(_median(recompute), 5), "ttft_suffix_only_s": round(_median(ideal), 5),
            "ttft_loaded_s": round(t_loaded, 5), "decision": decisions[name],
            "predicted_s": round(predicted[name][0], 5), "predicted_recompute_s": round(predicted[name][1], 5),
            "ttft_always_load_s": round(_median(always[name]), 5),
            "always_load_s": round(_median([a for a, _ in parts[name]]), 5),
            "always_build_s": round(_median([b for _, b in parts[name]]), 5),
            "efficiency": round(_median(ideal) / t_loaded, 4),
            "speedup": round(_median(recompute) / t_loaded, 3), "tokens_match": match,
            "max_abs_logit_diff": diff, "logit_tolerance": tol, "decode_tokens": len(decoded["tokens"]),
            "decode_tail": decoded["tail"], "tbt_s": decoded["tbt_s"],
        })  # fmt: skip
    return rows


def _measure_tail(
    args: argparse.Namespace, model: Any, layout: Any, pool: WorkerPool, writer: PrefillWorker, prompt: torch.Tensor
) -> dict[str, Any]:
    """The decode side of a prompt that ends inside a block: its last, partial block loaded or recomputed."""
    first = writer.prefill(prompt, keep_logits=True)  # stores the full blocks and the tail
    reference = _reference(model, prompt, args.decode_tokens)
    prepare: dict[str, list[float]] = {"transfer": [], "recompute": []}
    matches: dict[str, bool] = {}
    tails: dict[str, str] = {}
    for _ in range(args.repeat):
        for mode in prepare:
            d = pool.submit(
                "decode", 0, tokens=prompt.tolist(), first_token=first.first_token,
                max_new_tokens=args.decode_tokens, tail=mode, keep_logits=True,
            ).result(timeout=600)  # fmt: skip
            prepare[mode].append(d["prepare_s"])
            tails[mode] = d["tail"]
            matches[mode] = _decode_matches(d, first.logits, reference, layout.torch_dtype)[0]
    moved, redone = _median(prepare["transfer"]), _median(prepare["recompute"])
    return {
        "bench": "engines", "op": "decode_tail", "model": layout.model, "dtype": layout.dtype,
        "prompt_tokens": prompt.numel(), "tail_tokens": prompt.numel() % layout.block_tokens,
        "prepare_tail_transferred_s": round(moved, 5), "prepare_tail_recomputed_s": round(redone, 5),
        "ratio": round(redone / moved, 3), "tail_transferred": tails["transfer"] == "transferred",
        "tokens_match": matches["transfer"] and matches["recompute"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="JSON lines (the default output is JSON lines too)")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--fractions", default="0,0.5,0.75", help="stored fractions of the prompt")
    p.add_argument("--transports", default="tcp,auto", help="client transports to load with (tcp, auto, ucx)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--tail-tokens", type=int, default=128, help="a prompt this much past a block end for the tail line")
    p.add_argument("--calibrate-tokens", type=int, default=512)
    p.add_argument("--daemons", type=int, default=2)
    p.add_argument("--dram", default="512MiB", help="DRAM per daemon")
    engine_arguments(p)
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    for row in run(args):
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
