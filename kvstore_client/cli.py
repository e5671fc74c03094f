"""The ``kvstore`` command line. Subcommands register themselves in :data:`COMMANDS`."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstore.config import NodeConfig, format_size, load, parse_size
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.node_store import NodeStore
from kvstore.workload import TraceRequest, chat_workload, load_trace, lru_prefix_hit_rate
from kvstore_client.replay import ReplaySummary, ReplayTarget, replay_concurrently


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
    p.add_argument("--dram", type=_size_arg, default=parse_size(dram), help=f"total DRAM capacity (default {dram})")
    p.add_argument("--ssd", type=_size_arg, default=parse_size(ssd), help=f"total SSD capacity, 0 for none ({ssd})")
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
    from kvstore_client.store import Store
    from server.cluster import LocalCluster

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


def print_metrics(title: str, rows: Sequence[tuple[str, str]]) -> None:
    """A two-column table of named figures on standard output."""
    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


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


# -- processes -----------------------------------------------------------------------------


@arguments("master")
def _master_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="RPC port (0: any free port)")
    p.add_argument("--placement", default=None, help="local_first, free_ratio or random")
    p.add_argument("--reservation-ms", type=int, default=None, help="revoke an uncommitted put after this")
    p.add_argument("--lease-ms", type=int, default=None, help="read lease length")
    p.add_argument("--node-ttl-ms", type=int, default=None, help="mark a silent node down after this")
    p.add_argument("--heartbeat-ms", type=int, default=None, help="daemon heartbeat interval")
    p.add_argument("--admin-port", type=int, default=None, help="REST admin API, /metrics and dashboard port")


@command("master", "run the master (placement, eviction, leases, membership)")
def _master(args: argparse.Namespace) -> int:
    from kvstore.config import MasterConfig
    from server.master.main import run_master

    fields = {
        "placement": args.placement,
        "reservation_ms": args.reservation_ms,
        "lease_ms": args.lease_ms,
        "node_ttl_ms": args.node_ttl_ms,
        "heartbeat_interval_ms": args.heartbeat_ms,
        "admin_port": args.admin_port,
    }
    if os.environ.get("KVSTORE_ADMIN_TOKEN"):
        fields["admin_token"] = os.environ["KVSTORE_ADMIN_TOKEN"]
    overrides = {k: v for k, v in fields.items() if v is not None}
    return run_master(load(MasterConfig, "master", host=args.host, port=args.port, **overrides))


@arguments("daemon")
def _daemon_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master", required=True, help="the master's host:port")
    p.add_argument("--name", required=True, help="node id, unique in the cluster")
    p.add_argument("--arena", default=None, help="shared-memory arena name (default: the node id)")
    p.add_argument("--dram", type=_size_arg, default=parse_size("1GiB"), help="DRAM tier capacity")
    p.add_argument("--ssd", type=_size_arg, default=0, help="SSD tier capacity (0: none)")
    p.add_argument("--ssd-dir", type=Path, default=None, help="SSD tier directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="data-plane port (0: any free port)")
    p.add_argument(
        "--rail", action="append", default=[], metavar="HOST", help="also serve on this host's address (one per NIC)"
    )
    p.add_argument("--ucx-port", type=int, default=None, help="also serve over UCX on this port (0: any free port)")


@command("daemon", "run a storage daemon serving one node's DRAM and SSD")
def _daemon(args: argparse.Namespace) -> int:
    from kvstore.config import DaemonConfig
    from server.daemon.main import run_daemon

    config = load(
        DaemonConfig,
        "daemon",
        master=args.master,
        name=args.name,
        host=args.host,
        port=args.port,
        rails=args.rail,
        ucx_port=args.ucx_port,
        dram={"capacity": args.dram, "name": args.arena or args.name},
        ssd={"capacity": args.ssd, "path": args.ssd_dir if args.ssd else None},
    )
    return run_daemon(config)


@arguments("cluster")
def _cluster_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["up"], help="up: start a local cluster and keep it running until Ctrl-C")
    p.add_argument("--daemons", type=int, default=2)
    p.add_argument("--dram", default="256MiB", help="DRAM per daemon")
    p.add_argument("--ssd", default="0", help="SSD per daemon")
    p.add_argument("--port", type=int, default=50051, help="master port (0: any free port)")
    p.add_argument("--admin-port", type=int, default=50052, help="admin API and dashboard port (0: any free port)")


@command("cluster", "start a local cluster: a master and daemons as processes on loopback")
def _cluster(args: argparse.Namespace) -> int:
    import signal
    import time

    from server.cluster import LocalCluster

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through the ``with``: children stopped, arenas removed

    # Ctrl-C, kill (SIGTERM) and a closed terminal all stop the cluster cleanly; SIGINT too when
    # a non-interactive shell started us in the background with it ignored.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    with LocalCluster(
        args.daemons, dram=args.dram, ssd=args.ssd, master_port=args.port, admin=True, admin_port=args.admin_port
    ) as cluster:
        try:  # from the first line printed: a signal may come as soon as a reader sees the master
            print(f"master  {cluster.master_address}", flush=True)
            print(f"admin   http://{cluster.admin_address}  (REST API, /metrics, dashboard)", flush=True)
            for i, address in enumerate(cluster.daemon_addresses):
                print(f"daemon  {cluster.node_name(i)}  {address}", flush=True)
            print("cluster up; Ctrl-C stops it", flush=True)
            while all(p is not None and p.poll() is None for p in [cluster.master, *cluster.daemons]):
                time.sleep(0.5)
            print("a cluster process exited; stopping", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0


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


from kvstore_client import engine_cli, ops, sim_cli  # noqa: E402, F401 - register the operator, engine and simulator commands

if __name__ == "__main__":
    # Run as ``python -m``: use the imported module, in whose registry the operator commands live.
    from kvstore_client.cli import main as imported_main

    sys.exit(imported_main())
