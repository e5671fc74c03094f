"""The ``kvstore`` command line. Subcommands register themselves in :data:`COMMANDS`."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstore.config import NodeConfig, format_size, load, parse_size
from kvstore.errors import KVStoreError
from kvstore.node_store import NodeStore
from kvstore.workload import TraceRequest, chat_workload, load_trace, lru_prefix_hit_rate
from kvstore_client.replay import ReplaySummary, replay


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {}


def command(
    name: str, help: str
) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    def register(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        adder = _ARGUMENTS.pop(name)
        COMMANDS[name] = Command(help, adder, fn)
        return fn

    return register


_ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {}


def arguments(
    name: str,
) -> Callable[[Callable[[argparse.ArgumentParser], None]], Callable[[argparse.ArgumentParser], None]]:
    def register(fn: Callable[[argparse.ArgumentParser], None]) -> Callable[[argparse.ArgumentParser], None]:
        _ARGUMENTS[name] = fn
        return fn

    return register


# -- replay and demo ----------------------------------------------------------------


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except KVStoreError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _store_arguments(p: argparse.ArgumentParser, dram: str, ssd: str) -> None:
    p.add_argument("--block-bytes", type=_size_arg, default=64 * 1024, help="bytes per block (default 64KiB)")
    p.add_argument("--dram", type=_size_arg, default=parse_size(dram), help=f"DRAM tier capacity (default {dram})")
    p.add_argument(
        "--ssd", type=_size_arg, default=parse_size(ssd), help=f"SSD tier capacity, 0 for none (default {ssd})"
    )
    p.add_argument("--ssd-dir", type=Path, default=None, help="SSD tier directory (default: a temporary one)")
    p.add_argument("--verify", action="store_true", help="check every loaded byte")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")


@contextmanager
def _scratch_store(args: argparse.Namespace) -> Iterator[NodeStore]:
    """A NodeStore for one run, whose arena and SSD directory are removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-run-"))
    ssd_dir = args.ssd_dir or tmp / "ssd"
    config = load(
        NodeConfig,
        "node",
        dram={"capacity": args.dram, "name": f"run-{os.getpid()}"},
        ssd={"capacity": args.ssd, "path": ssd_dir if args.ssd else None},
    )
    store = NodeStore(config)
    try:
        yield store
    finally:
        store.destroy()
        shutil.rmtree(tmp, ignore_errors=True)


def _run_replay(args: argparse.Namespace, requests: list[TraceRequest], title: str) -> int:
    total_blocks = sum(len(r.hash_ids) for r in requests)
    console = Console(stderr=True)
    with _scratch_store(args) as store:
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
            summary = replay(
                store,
                requests,
                block_bytes=args.block_bytes,
                verify=args.verify,
                on_request=lambda n: progress.advance(task, n),
            )
        stats = store.stats()
    capacity_blocks = (args.dram + args.ssd) // args.block_bytes
    reference = lru_prefix_hit_rate(requests, capacity_blocks)
    record = summary.to_dict() | {
        "lru_reference_hit_rate": round(reference, 6),
        "capacity_blocks": capacity_blocks,
        "dram_hits": stats.dram_hits,
        "ssd_hits": stats.ssd_hits,
        "demotions": stats.demotions,
        "promotions": stats.promotions,
        "evictions": stats.dram_drops + stats.ssd_drops,
    }
    if args.json:
        print(json.dumps(record), flush=True)
    else:
        _print_summary(summary, record)
    return 0


def _print_summary(summary: ReplaySummary, record: dict[str, float | int]) -> None:
    table = Table(title="replay summary", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
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
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


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


# -- entry point ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="kvstore: a distributed KVCache store.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except KVStoreError as exc:
        print(f"kvstore {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
