"""Conductor benchmark: the scheduling policies on a trace, early rejection, and the scheduler's decision rate.

JSON lines, all measured in this run:

- ``op: schedulers``: the trace (``--trace``, Mooncake's format; the public
  synthetic trace by default) through the simulator with every scheduler, 16
  prefill and 16 decode instances, 3M tokens of DRAM cache per prefill node. The
  baselines are the ``random`` and ``load`` schedulers of the same run.
- ``op: pool_vs_local``: prefix hit rate of the global pool against local-only
  caches at equal per-node capacity, for several capacities.
- ``op: early_rejection``: a decode-bound cluster (``--er-*`` flags) with rejection
  on TTFT only (the decode side turns requests away when they reach it: the
  baseline), on the current decode load, and on the predicted decode load.
- ``op: decision_rate``: decisions per second of the scheduling core with 16
  prefill and 16 decode instances and 4,000-token prompts, ~200 requests in flight;
  baseline: the ``random`` policy on the same instances.
- ``op: prefix_match``: the master's per-node prefix match against its plain
  ``match_prefix`` on the same placement table (pure, no network), for 32-key
  prompts over a 4-node table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Any

from kvstore.scheduling import Locality, Request, Scheduler, Slo
from kvstore.simulator import ClusterCost, SimConfig, simulate
from kvstore.workload import TraceRequest, chat_workload, load_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "synthetic_trace.jsonl"


def _trace(path: Path) -> tuple[str, list[TraceRequest]]:
    if path.exists():
        return str(path), list(load_trace(path))
    return "chat_workload (trace absent)", chat_workload(num_sessions=400, seed=0)


def schedulers(requests: list[TraceRequest], source: str) -> list[dict[str, Any]]:
    rows = []
    for name in ("random", "load", "local", "global"):
        started = time.perf_counter()
        row = simulate(requests, SimConfig(scheduler=name))
        rows.append({"bench": "conductor", "op": "schedulers", "trace": source, **row,
                     "sim_wall_s": round(time.perf_counter() - started, 3)})  # fmt: skip
    ttft = {r["scheduler"]: r["mean_ttft_s"] for r in rows}
    rows.append({
        "bench": "conductor", "op": "schedulers_order", "trace": source,
        "global_lt_local_lt_load_lt_random": ttft["global"] < ttft["local"] < ttft["load"] < ttft["random"],
        "global_vs_local_ttft": round(ttft["local"] / ttft["global"], 3),
    })  # fmt: skip
    return rows


def pool_vs_local(requests: list[TraceRequest], source: str, capacities: list[int]) -> list[dict[str, Any]]:
    rows = []
    for prefill in (16, 10):
        for cache in capacities:
            base = SimConfig(prefill=prefill, cache_tokens=cache)
            pool = simulate(requests, base)
            no_replica = simulate(requests, dataclasses.replace(base, replicate_tokens=0))
            local = simulate(requests, dataclasses.replace(base, scheduler="local"))
            rows.append({
                "bench": "conductor", "op": "pool_vs_local", "trace": source, "prefill": prefill,
                "cache_tokens": cache, "global_hit_rate": pool["hit_rate"],
                "global_no_replica_hit_rate": no_replica["hit_rate"], "local_hit_rate": local["hit_rate"],
                "hit_ratio": round(pool["hit_rate"] / local["hit_rate"], 3) if local["hit_rate"] else None,
                "global_mean_ttft_s": pool["mean_ttft_s"], "local_mean_ttft_s": local["mean_ttft_s"],
            })  # fmt: skip
    return rows


def early_rejection(requests: list[TraceRequest], source: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    cost = ClusterCost(mbu=args.er_mbu, hbm_bytes=args.er_hbm_gb * 8e9)
    base = SimConfig(
        prefill=args.er_prefill, decode=args.er_decode, speed=args.er_speed, cost=cost,
        slo=Slo(ttft_s=30.0, tbt_s=args.er_tbt_slo), early_rejection=True,
    )  # fmt: skip
    rows = []
    for mode in ("none", "current", "predicted"):
        row = simulate(requests, dataclasses.replace(base, decode_load=mode))
        rows.append({"bench": "conductor", "op": "early_rejection", "trace": source, "mbu": args.er_mbu,
                     "hbm_gb_per_gpu": args.er_hbm_gb, "tbt_slo_s": args.er_tbt_slo, **row})  # fmt: skip
    return rows


def decision_rate(policy: str, seconds: float, decode_load: str = "predicted") -> dict[str, Any]:
    cost = ClusterCost()
    sched = Scheduler(
        prefill_model=cost.fitted_prefill_model(), transfer=cost.transfer_model(), decode_model=cost.decode_model(),
        policy=policy, early_rejection=True, decode_load=decode_load,  # type: ignore[arg-type]
        slo=Slo(ttft_s=1e9, tbt_s=1e9), replicate_max_tokens=2048,
    )  # fmt: skip
    for i in range(16):
        sched.add_prefill(f"p{i}", node=f"n{i}")
        sched.add_decode(f"d{i}")
    rng = random.Random(0)
    locs = []
    for _ in range(512):
        nodes = {f"n{i}": rng.randrange(0, 8) * 512 for i in rng.sample(range(16), 4)}
        locs.append(Locality(max(nodes.values()) + 512 * rng.randrange(0, 2), nodes))
    rid = decisions = 0
    now = deciding = reporting = 0.0
    clock = time.perf_counter
    started = clock()
    while clock() - started < seconds:
        for loc in locs:
            now += 0.05
            t0 = clock()
            sched.schedule(Request(rid, 4000, 200), loc, now)
            t1 = clock()
            if rid >= 200:  # keep ~200 in flight: the oldest goes through prefill and decode
                sched.prefill_done(rid - 200, now)
                sched.decode_done(rid - 200, now)
            reporting += clock() - t1
            deciding += t1 - t0
            rid += 1
        decisions += len(locs)
    return {"bench": "conductor", "op": "decision_rate", "policy": policy, "decode_load": decode_load,
            "prefill_instances": 16, "decode_instances": 16, "prompt_tokens": 4000, "in_flight": 200,
            "decisions_per_s": round(decisions / deciding), "us_per_decision": round(1e6 * deciding / decisions, 2),
            "us_per_completion_report": round(1e6 * reporting / decisions, 2)}  # fmt: skip


def prefix_match(seconds: float) -> dict[str, Any]:
    from kvstore.placement.table import PlacementTable

    table = PlacementTable()
    keys_by_prompt = _fill_table(table)
    timings = {}
    for name in ("match_prefix", "match_prefix_nodes"):
        fn = getattr(table.reads, name)
        calls = 0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            for keys in keys_by_prompt:
                fn(keys)
            calls += len(keys_by_prompt)
        timings[name] = (time.perf_counter() - started) / calls
    return {"bench": "conductor", "op": "prefix_match", "keys_per_call": 32, "nodes": 4,
            "match_prefix_us": round(timings["match_prefix"] * 1e6, 2),
            "match_prefix_nodes_us": round(timings["match_prefix_nodes"] * 1e6, 2),
            "ratio": round(timings["match_prefix_nodes"] / timings["match_prefix"], 3)}  # fmt: skip


def _fill_table(table: Any) -> list[list[str]]:
    """Four nodes; 64 prompts of 32 blocks, of which a random leading share is stored, spread over nodes."""
    for i in range(4):
        table.membership.register_node(f"n{i}", f"127.0.0.1:{7000 + i}", 1 << 34, 0, 64, [], now_ms=0)
    rng = random.Random(1)
    prompts = []
    for p in range(64):
        keys = [f"{p:04x}{b:028x}" for b in range(32)]
        stored = keys[: rng.randrange(0, 33)]
        for key in stored:  # one block at a time, each on a node of its own choosing
            table.writes.put_start([key], [4096], 1, f"n{rng.randrange(4)}", False, 0)
        table.writes.put_end(stored, [0] * len(stored))
        prompts.append(keys)
    return prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.conductor", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="JSON lines (the default output is JSON lines too)")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--capacities", type=int, nargs="+", default=[3_000_000, 1_000_000, 300_000])
    p.add_argument("--er-prefill", type=int, default=8)
    p.add_argument("--er-decode", type=int, default=2)
    p.add_argument("--er-speed", type=float, default=2.0)
    p.add_argument("--er-mbu", type=float, default=0.15, help="decode's share of HBM bandwidth (decode-bound run)")
    p.add_argument("--er-hbm-gb", type=float, default=30.0, help="HBM per GPU of the decode-bound run")
    p.add_argument("--er-tbt-slo", type=float, default=0.2)
    p.add_argument("--rate-seconds", type=float, default=2.0, help="how long each decision-rate run lasts")
    p.add_argument("--skip", nargs="*", default=[], help="ops to leave out")
    args = p.parse_args(argv)
    source, requests = _trace(args.trace)
    ops = {
        "schedulers": lambda: schedulers(requests, source),
        "pool_vs_local": lambda: pool_vs_local(requests, source, args.capacities),
        "early_rejection": lambda: early_rejection(requests, source, args),
        "decision_rate": lambda: [
            decision_rate("global", args.rate_seconds),
            decision_rate("global", args.rate_seconds, "current"),
            decision_rate("random", args.rate_seconds),
        ],
        "prefix_match": lambda: [prefix_match(args.rate_seconds)],
    }
    for name, run in ops.items():
        if name in args.skip:
            continue
        for row in run():
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
