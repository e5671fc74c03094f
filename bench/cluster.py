"""Cluster benchmark: put and get through the network client against a daemon in another process.

One JSON line per (op, size, batch): ``GBps``, ``ops`` (blocks/s), ``p50_us``
and ``p99_us`` per call, beside the same run's raw loopback-TCP baseline (a
plain socket pair between two processes moving the same bytes with the same
request/reply pattern) as ``baseline_GBps`` and ``ratio``. Like the peers'
scripts, a run reuses one source and one destination buffer.

Also: ``match_prefix`` on a placement table of 1M keys (the master's own cost)
and through the master's RPC; and, where ../shared/peers/run.sh exists, the
Redis and Mooncake Store figures of the same run, with our batch-1 ratios
against them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import struct
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench import put_modes
from kvstore.config import ClientConfig, parse_size
from kvstore.placement.table import PlacementTable
from kvstore.policy import EvictionPolicy
from kvstore_cli.cluster import LocalCluster
from kvstore_client.aio import AsyncStore
from kvstore_client.store import Store
from transfer import native

SIZES = [4 * 1024, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024]
PEERS = Path(__file__).resolve().parents[2] / "shared" / "peers" / "run.sh"
_REQ = struct.Struct("!cQ")


def _sink(port_queue: Any, max_bytes: int) -> None:
    """Baseline server: per request, receive or send ``n`` bytes with recv_into/sendall."""
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(max_bytes))
    head = bytearray(_REQ.size)
    while True:
        if conn.recv_into(head, _REQ.size, socket.MSG_WAITALL) < _REQ.size:
            return
        op, n = _REQ.unpack(head)
        if op == b"p":
            got = 0
            while got < n:
                got += conn.recv_into(buf[got:n])
            conn.sendall(b"k")
        else:
            conn.sendall(buf[:n])


class RawTcp:
    def __init__(self, max_bytes: int) -> None:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        self.proc = ctx.Process(target=_sink, args=(q, max_bytes), daemon=True)
        self.proc.start()
        self.sock = socket.create_connection(("127.0.0.1", q.get(timeout=30)), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def put(self, data: memoryview) -> None:
        self.sock.sendall(_REQ.pack(b"p", data.nbytes))
        self.sock.sendall(data)
        self.sock.recv(1)

    def get(self, out: memoryview) -> None:
        self.sock.sendall(_REQ.pack(b"g", out.nbytes))
        got = 0
        while got < out.nbytes:
            got += self.sock.recv_into(out[got:])

    def close(self) -> None:
        self.sock.close()
        self.proc.join(timeout=5)


def _time_calls(calls: int, fn: Callable[[int], object]) -> tuple[float, list[float]]:
    lat = []
    start = time.perf_counter()
    for i in range(calls):
        t = time.perf_counter()
        fn(i)
        lat.append(time.perf_counter() - t)
    return time.perf_counter() - start, lat


def _line(op: str, size: int, batch: int, calls: int, seconds: float, lat: list[float], base: float) -> dict[str, Any]:
    nbytes = size * batch * calls
    gbps = nbytes / seconds / 1e9
    base_gbps = nbytes / base / 1e9
    lat_sorted = sorted(lat)
    return {
        "bench": "cluster",
        "op": op,
        "size": size,
        "batch": batch,
        "calls": calls,
        "GBps": round(gbps, 3),
        "ops": round(batch * calls / seconds),
        "p50_us": round(lat_sorted[len(lat) // 2] * 1e6, 1),
        "p99_us": round(lat_sorted[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6, 1),
        "baseline_GBps": round(base_gbps, 3),
        "ratio": round(gbps / base_gbps, 3),
    }


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class MasterCpu:
    """The master's CPU time over a row, per operation (``master_cpu_us``)."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self._start = 0.0

    def start(self) -> None:
        if self.pid is not None:
            self._start = cpu_seconds(self.pid)

    def per_op_us(self, ops: int) -> float | None:
        if self.pid is None or not ops:
            return None
        return round((cpu_seconds(self.pid) - self._start) / ops * 1e6, 1)


def bench_size(
    store: Store,
    raw: RawTcp,
    size: int,
    batch: int,
    total: int,
    tag: str,
    cpu: MasterCpu | None = None,
    mode: str = "visible",
) -> list[dict[str, Any]]:
    """The put and get rows of one (size, batch) with ``store`` (whose ``put_mode`` is ``mode``); a
    cached row's ``flush_ms`` is how long the flush after its puts took (its blocks visible to all)."""
    # All of a line's blocks stay stored until its gets are done: keep them within the daemon's DRAM.
    calls = max(2, min(total // (size * batch), 2000 // batch if batch > 1 else 2000))
    src = np.random.default_rng(size).integers(0, 256, (batch, size), dtype=np.uint8)
    dst = np.zeros_like(src)
    keys = [[f"{tag}-{size}-{batch}-{c}-{j}" for j in range(batch)] for c in range(calls)]
    rows_src, rows_dst = list(src), list(dst)

    def put(c: int) -> None:
        if batch == 1:
            store.put(keys[c][0], rows_src[0])  # what a caller of one block uses (as the peers' rows do)
        else:
            store.put_many(zip(keys[c], rows_src, strict=True))

    def get(c: int) -> None:
        got = store.get_many_into(keys[c], rows_dst)
        assert got == [size] * batch, f"get of {keys[c][0]}... returned {got[:3]}"

    cpu = cpu or MasterCpu(None)
    cpu.start()
    put_s, put_lat = _time_calls(calls, put)
    flushed = time.perf_counter()
    store.flush()
    flush_ms = round((time.perf_counter() - flushed) * 1e3, 2)
    put_cpu = cpu.per_op_us(calls * batch)
    cpu.start()
    get_s, get_lat = _time_calls(calls, get)
    get_cpu = cpu.per_op_us(calls * batch)
    assert np.array_equal(dst, src)
    flat_src, flat_dst = src.reshape(-1).data, dst.reshape(-1).data
    raw_put, _ = _time_calls(calls, lambda c: raw.put(flat_src))
    raw_get, _ = _time_calls(calls, lambda c: raw.get(flat_dst))
    for c in range(calls):
        store.remove_many(keys[c])
    put_row = {**_line("put", size, batch, calls, put_s, put_lat, raw_put), "mode": mode, "master_cpu_us": put_cpu}
    if mode == "cached":
        put_row["flush_ms"] = flush_ms
    return [put_row, {**_line("get", size, batch, calls, get_s, get_lat, raw_get), "master_cpu_us": get_cpu}]


def bench_exists(store: Store, raw: RawTcp, cpu: MasterCpu, calls: int = 2000) -> dict[str, Any]:
    """A master-only call: ``exists`` of one stored key, against a bare socket ping-pong (``baseline``)."""
    store.put("exists-probe", b"x")
    cpu.start()
    seconds, lat = _time_calls(calls, lambda c: store.exists("exists-probe"))
    per_op = cpu.per_op_us(calls)
    store.remove("exists-probe")
    one = memoryview(bytearray(1))
    _, base = _time_calls(calls, lambda c: raw.get(one))
    lat.sort()
    base.sort()
    return {"bench": "cluster", "op": "exists", "batch": 1, "calls": calls, "ops": round(calls / seconds),
            "p50_us": round(lat[len(lat) // 2] * 1e6, 1), "baseline_p50_us": round(base[len(base) // 2] * 1e6, 1),
            "master_cpu_us": per_op}  # fmt: skip


def bench_async_gets(master: str, config: ClientConfig, cpu: MasterCpu, size: int = 4096, concurrency: int = 64,
                     rounds: int = 200, loop: str = "asyncio") -> dict[str, Any]:  # fmt: skip
    """``concurrency`` gets at once from one event loop (AsyncStore), ``rounds`` times; ``loop``: the
    standard library's event loop or uvloop's (what vLLM's and SGLang's servers run)."""

    async def run() -> dict[str, Any]:
        async with await AsyncStore.connect(master, config) as astore:
            keys = [f"async-{size}-{i}" for i in range(concurrency)]
            data = np.random.default_rng(7).integers(0, 256, (concurrency, size), dtype=np.uint8)
            await astore.put_many(zip(keys, list(data), strict=True))
            out = np.zeros_like(data)
            rows = list(out)

            async def one_round() -> None:
                got = await asyncio.gather(*(astore.get_into(k, r) for k, r in zip(keys, rows, strict=True)))
                assert got == [size] * concurrency, got[:3]

            await one_round()
            lat = []
            cpu.start()
            start = time.perf_counter()
            for _ in range(rounds):
                t = time.perf_counter()
                await one_round()
                lat.append(time.perf_counter() - t)
            seconds = time.perf_counter() - start
            per_op = cpu.per_op_us(rounds * concurrency)
            assert np.array_equal(out, data)
            await astore.remove_many(keys)
            lat.sort()
            return {"bench": "cluster", "op": "get", "client": "async", "loop": loop, "size": size,
                    "concurrency": concurrency,
                    "calls": rounds * concurrency, "ops": round(rounds * concurrency / seconds),
                    "GBps": round(rounds * concurrency * size / seconds / 1e9, 3),
                    "p50_us": round(lat[len(lat) // 2] * 1e6, 1), "master_cpu_us": per_op}  # fmt: skip

    if loop == "uvloop":
        import uvloop

        return uvloop.run(run())
    return asyncio.run(run())


def bench_match_prefix(store: Store, num_keys: int = 1_000_000, query: int = 64) -> list[dict[str, Any]]:
    table = PlacementTable(EvictionPolicy())
    table.membership.register_node("n", "n:1", 1 << 40, 0, 64, [], 0)
    keys = [f"prefix-{i:08d}" for i in range(num_keys)]
    for s in range(0, num_keys, 10_000):
        chunk = keys[s : s + 10_000]
        table.writes.put_start(chunk, [64] * len(chunk), 1, None, False, 0)
        table.writes.put_end(chunk, [0] * len(chunk))
    queries = [keys[i : i + query] for i in range(0, num_keys, max(1, num_keys // 2000))][:2000]
    t = time.perf_counter()
    for q in queries:
        assert table.reads.match_prefix(q) == len(q)
    table_s = time.perf_counter() - t
    # Through the master's RPC: a prefix of stored keys, the way an engine asks.
    stored = [f"rpc-prefix-{i}" for i in range(query)]
    store.put_many((k, b"x" * 64) for k in stored)
    t = time.perf_counter()
    calls = 2000
    for _ in range(calls):
        store.match_prefix(stored)
    rpc_s = time.perf_counter() - t
    store.remove_many(stored)
    return [
        {"bench": "cluster", "op": "match_prefix", "where": "table", "table_keys": num_keys, "batch": query,
         "keys_per_s": round(len(queries) * query / table_s)},
        {"bench": "cluster", "op": "match_prefix", "where": "rpc", "batch": query,
         "keys_per_s": round(calls * query / rpc_s), "p50_us": round(rpc_s / calls * 1e6, 1)},
    ]  # fmt: skip


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


SECURITY = {
    "auth": {"authenticate": True},
    "tls": {"tls": True},
    "tls_data": {"tls_data": True},
    "auth_tls_data": {"authenticate": True, "tls_data": True},
}
"""What bench_security can turn on: LocalCluster settings, compared against the same rows with none."""


def bench_security(
    variant: str, cases: list[tuple[int, int]], total: int, dram: str, reps: int = 3, connects: int = 20
) -> list[dict[str, Any]]:
    """The cost of ``variant`` (a key of :data:`SECURITY`: authentication, TLS on the control plane,
    TLS on both planes, or both): the same rows against a cluster without it and one with it,
    alternated ``reps`` times, medians compared (``cluster_<variant>`` lines); and the cost of a new
    client's first put and get (handshakes, and a tenant's ticket)."""
    rows: list[dict[str, Any]] = []
    bench = f"cluster_{variant}"
    settings = SECURITY[variant]
    with LocalCluster(1, dram=dram) as plain, LocalCluster(1, dram=dram, **settings) as secured:  # type: ignore[arg-type]
        token = secured.add_tenant("bench") if settings.get("authenticate") else None
        configs = {
            "off": (plain, ClientConfig(transport="tcp")),
            "on": (secured, ClientConfig(transport="tcp", token=token, tls=secured.tls_config())),
        }
        stores = {mode: Store.connect(c.master_address, config) for mode, (c, config) in configs.items()}
        raw = RawTcp(max(size * batch for size, batch in cases))
        try:
            for size, batch in cases:
                got: dict[tuple[str, str], list[dict[str, Any]]] = {}
                for r in range(reps):
                    for mode, store in stores.items():
                        for line in bench_size(store, raw, size, batch, total, tag=f"{variant}-{mode}-{r}"):
                            got.setdefault((mode, line["op"]), []).append(line)
                for op in ("put", "get"):
                    off, on = got["off", op], got["on", op]
                    gbps_off, gbps_on = _median([x["GBps"] for x in off]), _median([x["GBps"] for x in on])
                    p50_off, p50_on = _median([x["p50_us"] for x in off]), _median([x["p50_us"] for x in on])
                    rows.append({
                        "bench": bench, "op": op, "size": size, "batch": batch, "reps": reps,
                        "off_GBps": gbps_off, "on_GBps": gbps_on,
                        "ratio": round(gbps_on / gbps_off, 3) if gbps_off else None,
                        "off_p50_us": p50_off, "on_p50_us": p50_on, "delta_p50_us": round(p50_on - p50_off, 1),
                    })  # fmt: skip
        finally:
            raw.close()
            for store in stores.values():
                store.close()
        first: dict[str, list[float]] = {"off": [], "on": []}
        for i in range(connects):
            for mode, (c, config) in configs.items():
                t = time.perf_counter()
                with Store.connect(c.master_address, config) as store:
                    store.put(f"first-{mode}-{i}", b"f" * 4096)
                    assert store.get(f"first-{mode}-{i}") == b"f" * 4096
                first[mode].append(time.perf_counter() - t)
        off_ms, on_ms = _median(first["off"]) * 1e3, _median(first["on"]) * 1e3
        rows.append({
            "bench": bench, "op": "connect_put_get", "size": 4096, "reps": connects,
            "off_ms": round(off_ms, 2), "on_ms": round(on_ms, 2), "delta_ms": round(on_ms - off_ms, 2),
        })  # fmt: skip
    return rows


def run_peers(sizes: list[int], total: int) -> list[dict[str, Any]]:
    out = []
    env = {**os.environ, "SIZES": ",".join(map(str, sizes)), "TOTAL": str(total)}
    for peer in ("redis", "mooncake"):
        try:
            done = subprocess.run(["bash", str(PEERS), peer], env=env, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            out.append({"bench": "cluster", "peer": peer, "error": str(exc)})
            continue
        for line in done.stdout.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            out.append({"bench": "cluster", "peer": row.pop("system", peer), **row})
        if done.returncode != 0 and not any(r.get("peer") == peer for r in out):
            out.append({"bench": "cluster", "peer": peer, "error": done.stderr.strip()[-300:]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Cluster put/get benchmark with same-run baselines.")
    parser.add_argument("--json", action="store_true", help="JSON lines (the only output form)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--total", default="256MiB", help="bytes per (op, size, batch)")
    parser.add_argument("--dram", default="1536MiB", help="the daemon's DRAM")
    parser.add_argument("--peers", choices=["auto", "no"], default="auto", help="run ../shared/peers when present")
    parser.add_argument("--match-keys", type=int, default=1_000_000, help="placement-table size for match_prefix")
    parser.add_argument(
        "--security", default="auth", metavar="V[,V]",
        help=f"also the same rows with each of these off and on (cluster_V lines): {', '.join(SECURITY)}; 'no': none",
    )  # fmt: skip
    parser.add_argument("--security-only", action="store_true", help="only the --security comparisons")
    parser.add_argument("--no-native", action="store_true", help="the pure-Python data-plane loops (client and"
                        " daemon), not the native ones; every row says which ran (\"native\")")  # fmt: skip
    parser.add_argument("--put-modes", type=put_modes, default="visible,cached", help="put rows in each of these"
                        " modes (visible: the master knows the block when put returns; cached: the daemon tells it"
                        " after)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.no_native:
        native.use(False)  # here and in the cluster's processes
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    total = parse_size(args.total)
    ours: list[dict[str, Any]] = []
    security_cases = sorted({(min(sizes), 1), (max(sizes), 1), (max(sizes), max(batches))})
    variants = [] if args.security == "no" else [v.strip() for v in args.security.split(",") if v.strip()]
    unknown = set(variants) - set(SECURITY)
    if unknown:
        parser.error(f"--security: unknown {sorted(unknown)}; there are {list(SECURITY)} and 'no'")

    def emit(line: dict[str, Any]) -> None:
        print(json.dumps({**line, "native": native.active()}), flush=True)

    def compare() -> None:
        for variant in variants:
            for line in bench_security(variant, security_cases, total, args.dram):
                emit(line)

    if args.security_only:
        compare()
        return 0
    # transport=tcp: these figures are the network data plane against raw TCP (same-host clients would use shm).
    config = ClientConfig(transport="tcp")
    modes: list[str] = args.put_modes
    with LocalCluster(1, dram=args.dram) as cluster, Store.connect(cluster.master_address, config) as store:
        raw = RawTcp(max(sizes) * max(batches))
        cpu = MasterCpu(cluster.master.pid if cluster.master is not None else None)
        cached = Store.connect(cluster.master_address, ClientConfig(transport="tcp", put_mode="cached"))
        try:
            for size in sizes:
                for batch in batches:
                    for mode in modes:
                        client = cached if mode == "cached" else store
                        for line in bench_size(client, raw, size, batch, total, tag=mode[0], cpu=cpu, mode=mode):
                            if line["op"] == "get" and mode != modes[0]:
                                continue  # the same gets: one row
                            ours.append(line)
                            emit(line)
            emit(bench_exists(store, raw, cpu))
            for loop in ("asyncio", "uvloop"):
                emit(bench_async_gets(cluster.master_address, config, cpu, loop=loop))
            for line in bench_match_prefix(store, args.match_keys):
                emit(line)
        finally:
            cached.close()
            raw.close()
    compare()
    if args.peers == "auto" and PEERS.exists():
        for row in run_peers(sizes, total):
            for op in ("put", "get"):
                row_modes: list[str | None] = [*modes] if op == "put" else [None]
                for row_mode in row_modes:
                    mine = next((o for o in ours if o["op"] == op and o["size"] == row.get("size")
                                 and o["batch"] == 1 and o.get("mode") == row_mode), None)  # fmt: skip
                    name = (f"kvstore_{op}_ratio" if row_mode in (None, "visible")
                            else f"kvstore_{row_mode}_{op}_ratio")  # fmt: skip
                    if mine and row.get(f"{op}_GBps"):
                        row[name] = round(mine["GBps"] / row[f"{op}_GBps"], 3)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
