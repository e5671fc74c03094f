"""``kvstore simulate``: replay a Mooncake-format trace through the conductor's scheduler, offline.

Every constant of the cost model is a flag (defaults: LLaMA3-70B on 8xA800, FAST'25
Table 1). ``--plot`` sweeps the request rate and draws mean TTFT and SLO
attainment against it for every scheduler (matplotlib, imported only then).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvstore.errors import InvalidArgument
from kvstore.scheduling import POLICIES, Slo
from kvstore.simulator import ClusterCost, SimConfig, simulate, sweep
from kvstore.workload import load_trace
from kvstore_cli.registry import arguments, command

_COST_FLAGS = {f.name: f for f in dataclasses.fields(ClusterCost)}


@arguments("simulate")
def _simulate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, help="a JSON-lines trace (timestamp, input_length, output_length, hash_ids)")
    p.add_argument(
        "--scheduler", action="append", choices=list(POLICIES), default=None,
        help="scheduling policy; repeat for several (default: all four)",
    )  # fmt: skip
    p.add_argument("--prefill", type=int, default=16, help="prefill instances")
    p.add_argument("--decode", type=int, default=16, help="decode instances")
    p.add_argument("--cache-tokens", type=int, default=3_000_000, help="DRAM cache per prefill node, in tokens")
    p.add_argument("--early-rejection", action="store_true", help="reject at arrival on predicted TTFT and decode load")
    p.add_argument(
        "--decode-load", choices=["none", "current", "predicted"], default="predicted",
        help="with --early-rejection: the decode load checked at arrival (none: TTFT only)",
    )  # fmt: skip
    p.add_argument("--ttft-slo", type=float, default=30.0, help="seconds")
    p.add_argument("--tbt-slo", type=float, default=0.1, help="seconds")
    p.add_argument("--speed", type=float, default=1.0, help="replay the trace this many times faster")
    p.add_argument("--balancing-threshold", type=float, default=1.0, help="fetch when pool prefix > local x this")
    p.add_argument("--replicate-tokens", type=int, default=2048, help="fetched tokens kept as a replica per request")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--seed", type=int, default=0)
    for name, f in _COST_FLAGS.items():
        flag = f"--{name.replace('_', '-')}"
        p.add_argument(flag, type=float, default=None, help=f"cost model (default {f.default})")
    p.add_argument("--plot", type=Path, default=None, help="draw TTFT and capacity against request rate to FILE.png")
    p.add_argument("--speeds", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0, 2.5, 3.0], help="for --plot")
    p.add_argument("--json", action="store_true", help="one JSON line per scheduler")


def config_from(args: argparse.Namespace) -> SimConfig:
    costs: dict[str, Any] = {}
    for name, f in _COST_FLAGS.items():
        value = getattr(args, name)
        if value is not None:
            costs[name] = type(f.default)(value) if isinstance(f.default, int) else value
    return SimConfig(
        prefill=args.prefill, decode=args.decode, cache_tokens=args.cache_tokens,
        early_rejection=args.early_rejection, decode_load=args.decode_load, slo=Slo(args.ttft_slo, args.tbt_slo),
        speed=args.speed, balancing_threshold=args.balancing_threshold, replicate_tokens=args.replicate_tokens,
        seed=args.seed, cost=ClusterCost(**costs),
    )  # fmt: skip


@command("simulate", "replay a trace through the conductor's scheduler over a simulated cluster")
def _simulate(args: argparse.Namespace) -> int:
    config = config_from(args)
    requests = list(load_trace(args.trace, args.limit))
    if not requests:
        raise InvalidArgument(f"{args.trace} holds no requests")
    schedulers = args.scheduler or list(POLICIES)
    rows = [simulate(requests, dataclasses.replace(config, scheduler=name)) for name in schedulers]
    if args.json:
        for row in rows:
            print(json.dumps(row), flush=True)
    else:
        table = Table(title=f"{len(requests)} requests, {config.prefill}P + {config.decode}D, speed {config.speed}")
        cols = ["scheduler", "mean_ttft_s", "p90_ttft_s", "mean_tbt_s", "p90_tbt_s", "slo_attainment", "hit_rate",
                "rejected"]  # fmt: skip
        for c in cols:
            table.add_column(c)
        for row in rows:
            table.add_row(*(str(row[c]) for c in cols))
        Console().print(table)
    if args.plot is not None:
        plot(sweep(requests, config, schedulers, args.speeds), args.plot)
    return 0


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Mean TTFT and SLO attainment against request rate, a line per scheduler."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgument("--plot needs matplotlib: pip install matplotlib") from None
    fig, (ax_ttft, ax_slo) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["scheduler"] for r in rows):
        mine = sorted((r for r in rows if r["scheduler"] == name), key=lambda r: r["request_rate"])
        rates = [r["request_rate"] for r in mine]
        ax_ttft.plot(rates, [r["mean_ttft_s"] for r in mine], marker="o", label=name)
        ax_slo.plot(rates, [r["slo_attainment"] for r in mine], marker="o", label=name)
    ax_ttft.set(xlabel="requests/s", ylabel="mean TTFT (s)", yscale="log", title="time to first token")
    ax_slo.set(xlabel="requests/s", ylabel="share meeting both SLOs", ylim=(0, 1.02), title="effective capacity")
    for ax in (ax_ttft, ax_slo):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
