"""``kvstore replay`` and ``kvstore demo``: a trace or a generated chat workload through a store with real bytes.

The store is an in-process node store (``--local``), the cluster at ``--master``, or a local
cluster started for the run and stopped after it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvstore.config import NodeConfig, format_size, load, parse_size
from kvstore.errors import InvalidArgument
from kvstore.node_store import NodeStore
from kvstore.workload import TraceRequest, chat_workload, load_trace, lru_prefix_hit_rate
from kvstore_cli.registry import arguments, command, print_metrics, size_arg
from kvstore_client.replay import ReplaySummary, ReplayTarget, replay_concurrently


def _store_arguments(p: argparse.ArgumentParser, dram: str, ssd: str) -> None:
    p.add_argument("--block-bytes", type=size_arg, default=64 * 1024, help="bytes per block (default 64KiB)")
    p.add_argument("--dram", type=size_arg, default=parse_size(dram), help=f"total DRAM capacity (default {dram})")
    p.add_argument("--ssd", type=size_arg, default=parse_size(ssd), help=f"total SSD capacity, 0 for none ({ssd})")
    p.add_argument("--master", default=None, help="use the running cluster at host:port instead of starting one")
    p.add_argument("--daemons", type=int, default=2, help="daemons of the cluster started for the run (default 2)")
    p.add_argument("--engines", type=int, default=4, help="concurrent simulated inference engines (default 4)")
    p.add_argument("--local", action="store_true", help="run on an in-process node store, without a cluster")
    p.add_argument("--realtime", action="store_true", help="follow the requests' timestamps")
    p.add_argument("--verify", action="store_true", help="check every loaded byte")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")


_COUNTERS = ("dram_hits", "ssd_hits", "demotions", "promotions", "evictions")


@contextmanager
def _local_store(args: argparse.Namespace) -> Iterator[tuple[ReplayTarget, Callable[[], dict[str, int]]]]:
    """An in-process NodeStore for one run, whose arena and SSD directory are removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-run-"))
    config = load(
        NodeConfig,
        "node",
        dram={"capacity": args.dram, "name": f"run-{os.getpid()}"},
        ssd={"capacity": args.ssd, "path": tmp / "ssd" if args.ssd else None},
    )
    store = NodeStore(config)

    def counters() -> dict[str, int]:
        s = store.stats()
        return dict(zip(_COUNTERS, (s.dram_hits, s.ssd_hits, s.demotions, s.promotions, s.dram_drops + s.ssd_drops),
                        strict=True))  # fmt: skip

    try:
        yield store, counters
    finally:
        store.destroy()
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _cluster_store(args: argparse.Namespace) -> Iterator[tuple[ReplayTarget, Callable[[], dict[str, int]]]]:
    """A client of the cluster at ``--master``, or of a local cluster started (and stopped) for the run."""
    from kvstore_cli.cluster import LocalCluster
    from kvstore_client.store import Store

    with ExitStack() as stack:
        master = args.master
        if master is None:
            if args.daemons < 1:
                raise InvalidArgument(f"--daemons must be at least 1, got {args.daemons}")
            cluster = LocalCluster(args.daemons, dram=args.dram // args.daemons, ssd=args.ssd // args.daemons)
            master = stack.enter_context(cluster).master_address
        store = stack.enter_context(Store.connect(master))

        def counters() -> dict[str, int]:
            stats = store.stats()
            return {name: int(stats.get(name, 0)) for name in _COUNTERS}

        yield store, counters


def _run_replay(args: argparse.Namespace, requests: list[TraceRequest], title: str) -> int:
    total_blocks = sum(len(r.hash_ids) for r in requests)
    console = Console(stderr=True)
    opened = _local_store(args) if args.local else _cluster_store(args)
    with opened as (store, counters):
        with Progress(
            TextColumn(f"[bold]{title}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("blocks"),
            TimeElapsedColumn(),
            console=console,
            disable=args.json or not console.is_terminal,
        ) as progress:
            task = progress.add_task(title, total=total_blocks)
            summary = replay_concurrently(
                store,
                requests,
                1 if args.local else args.engines,
                block_bytes=args.block_bytes,
                verify=args.verify,
                realtime=args.realtime,
                on_request=lambda n: progress.advance(task, n),
            )
        stats = counters()
    capacity_blocks = (args.dram + args.ssd) // args.block_bytes
    reference = lru_prefix_hit_rate(requests, capacity_blocks)
    record = summary.to_dict() | {
        "lru_reference_hit_rate": round(reference, 6),
        "capacity_blocks": capacity_blocks,
        "engines": 1 if args.local else args.engines,
        **stats,
    }
    if args.json:
        print(json.dumps(record), flush=True)
    else:
        _print_summary(summary, record)
    return 0


def _print_summary(summary: ReplaySummary, record: dict[str, float | int]) -> None:
    rows = [
        ("requests", f"{summary.requests:,}"),
        ("blocks", f"{summary.blocks:,}"),
        ("prefix hit rate", f"{summary.hit_rate:.1%}"),
        ("exact-LRU reference", f"{record['lru_reference_hit_rate']:.1%} at {record['capacity_blocks']:,} blocks"),
        ("hits from DRAM / SSD", f"{record['dram_hits']:,} / {record['ssd_hits']:,}"),
        ("loaded", format_size(summary.bytes_loaded)),
        ("stored", format_size(summary.bytes_stored)),
        (
            "demotions / promotions / evictions",
            f"{record['demotions']} / {record['promotions']} / {record['evictions']}",
        ),
        ("elapsed", f"{summary.seconds:.2f} s"),
        ("throughput", f"{record['requests_per_s']} req/s, {record['GBps']} GB/s"),
    ]
    print_metrics("replay summary", rows)


@arguments("replay")
def _replay_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, help="JSON-lines trace in Mooncake's format")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    _store_arguments(p, dram="1GiB", ssd="2GiB")


@command("replay", "replay a Mooncake-format trace through a store with real bytes")
def _replay(args: argparse.Namespace) -> int:
    requests = list(load_trace(args.trace, args.limit))
    return _run_replay(args, requests, f"replay {args.trace.name}")


@arguments("demo")
def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=1500, help="chat sessions (default 1500)")
    p.add_argument("--seed", type=int, default=0)
    _store_arguments(p, dram="16MiB", ssd="48MiB")


@command("demo", "replay a generated multi-turn chat workload through a store with real bytes")
def _demo(args: argparse.Namespace) -> int:
    requests = chat_workload(num_sessions=args.sessions, seed=args.seed)
    return _run_replay(args, requests, "demo chat")
