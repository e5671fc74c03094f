"""Transfer-engine benchmark: tcp, shm and ucx through the store, and two shaped links against one.

One JSON line per (transport, op, size): ``GBps`` beside the same run's
baseline (``baseline_GBps``, ``ratio``): a raw socket pair between two
processes moving the same bytes per call for tcp and ucx, numpy memcpy of
the same bytes (from as much distinct memory as the store reads) for shm.
Each call moves ``batch`` blocks. Then, where this
machine allows network namespaces, one line per slice size with ``links``
2, ``GBps`` and ``ratio_vs_one``: a get over two tbf-shaped veth links
against the same get over one of them (bench/netns.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from bench.cluster import RawTcp
from bench.netns import NetnsUnavailable, TwoHosts, stop
from kvstore.config import ClientConfig, parse_size
from kvstore_cli.cluster import LocalCluster
from kvstore_client.store import Store
from transfer.transports import ucx

SIZES = [64 * 1024, 1 << 20, 4 << 20]


def _memcpy_seconds(dst: np.ndarray, calls: int) -> float:
    """numpy memcpy of the same bytes per call as the store moves, from as much distinct memory as it reads
    (the arena's extents are distinct blocks), so that both sides meet the same caches."""
    sources = np.random.default_rng(0).integers(0, 256, (calls, dst.size), dtype=np.uint8)
    start = time.perf_counter()
    for c in range(calls):
        np.copyto(dst, sources[c])
    return time.perf_counter() - start


def bench_transport(transport: str, sizes: list[int], batch: int, total: int) -> list[dict[str, Any]]:
    daemon_args = ("--ucx-port", "0") if transport == "ucx" else ()
    config = ClientConfig(transport="auto" if transport == "shm" else transport)  # type: ignore[arg-type]
    lines = []
    with (
        LocalCluster(1, dram="1GiB", daemon_args=daemon_args) as cluster,
        Store.connect(cluster.master_address, config) as store,
    ):
        raw = RawTcp(max(sizes) * batch) if transport != "shm" else None
        # Warm up: connections, and for shm the one-time mapping of the daemon's arena (MAP_POPULATE).
        store.put("warm-up", b"w" * 4096)
        assert store.get("warm-up") == b"w" * 4096
        try:
            for size in sizes:
                calls = max(3, min(200, total // (size * batch)))
                src = np.random.default_rng(size).integers(0, 256, (batch, size), dtype=np.uint8)
                dst = np.zeros_like(src)
                keys = [[f"{transport}-{size}-{c}-{j}" for j in range(batch)] for c in range(calls)]
                start = time.perf_counter()
                for c in range(calls):
                    store.put_many(zip(keys[c], src, strict=True))
                put_s = time.perf_counter() - start
                start = time.perf_counter()
                for c in range(calls):
                    assert store.get_many_into(keys[c], list(dst)) == [size] * batch
                get_s = time.perf_counter() - start
                assert np.array_equal(src, dst)
                flat_src, flat_dst = src.reshape(-1), dst.reshape(-1)
                if raw is None:
                    base_put = base_get = _memcpy_seconds(flat_dst, calls)
                else:
                    start = time.perf_counter()
                    for _ in range(calls):
                        raw.put(flat_src.data)
                    base_put = time.perf_counter() - start
                    start = time.perf_counter()
                    for _ in range(calls):
                        raw.get(flat_dst.data)
                    base_get = time.perf_counter() - start
                nbytes = size * batch * calls
                for op, seconds, base in (("put", put_s, base_put), ("get", get_s, base_get)):
                    gbps, base_gbps = nbytes / seconds / 1e9, nbytes / base / 1e9
                    lines.append({"bench": "transfer", "transport": transport, "op": op, "size": size,
                                  "batch": batch, "GBps": round(gbps, 3), "baseline_GBps": round(base_gbps, 3),
                                  "baseline": "memcpy" if raw is None else "raw_tcp",
                                  "ratio": round(gbps / base_gbps, 3)})  # fmt: skip
                for c in range(calls):
                    store.remove_many(keys[c])
        finally:
            if raw is not None:
                raw.close()
    return lines


def bench_links(slice_sizes: list[int], rate: str) -> list[dict[str, Any]]:
    out = []
    for slice_bytes in slice_sizes:
        try:
            with TwoHosts(links=2, rate=rate) as hosts, tempfile.TemporaryDirectory() as tmp:
                master, procs = hosts.start_store(tmp)
                try:
                    argv = [sys.executable, "-m", "bench.netns_client", master, "bench", "--blocks", "8",
                            "--block-bytes", "4MiB", "--slice-bytes", str(slice_bytes)]  # fmt: skip
                    done = subprocess.run(hosts.exec_args("a", argv), capture_output=True, text=True, timeout=300)
                finally:
                    stop(procs)
        except NetnsUnavailable as exc:
            return [{"bench": "transfer", "links": 2, "skipped": str(exc)}]
        if done.returncode != 0:
            out.append({"bench": "transfer", "links": 2, "error": done.stderr.strip()[-300:]})
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        out.append({"bench": "transfer", "slice_bytes": slice_bytes, "link_rate": rate, **row})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Transfer-engine benchmark with same-run baselines.")
    parser.add_argument("--json", action="store_true", help="JSON lines (the only output form)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--batch", type=int, default=32, help="blocks per call (an engine loads a prefix at once)")
    parser.add_argument("--total", default="256MiB", help="bytes per (transport, op, size)")
    parser.add_argument("--transports", default="tcp,shm,ucx")
    parser.add_argument("--slice-sizes", default="256KiB,1MiB,4MiB", help="netns two-link run per slice size")
    parser.add_argument("--link-rate", default="200mbit", help="tc rate of each netns link")
    parser.add_argument("--links", choices=["auto", "no"], default="auto")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    for transport in args.transports.split(","):
        if transport == "ucx" and not ucx.available():
            print(json.dumps({"bench": "transfer", "transport": "ucx", "skipped": "UCXX is not installed"}))
            continue
        for line in bench_transport(transport, sizes, args.batch, parse_size(args.total)):
            print(json.dumps(line), flush=True)
    if args.links == "auto":
        for line in bench_links([parse_size(s) for s in args.slice_sizes.split(",")], args.link_rate):
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
