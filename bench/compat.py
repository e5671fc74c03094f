"""The Mooncake drop-in against our own client, on one cluster in one run.

One JSON line per (op, size): ``dropin_GBps`` (``MooncakeDistributedStore.put_from`` /
``get_into`` on registered memory) beside ``own_GBps`` (``Store.put`` / ``Store.get_into`` of the
same buffers) and ``ratio`` (drop-in / own; the target is >= 0.9), with ``memcpy_GBps`` of the
same bytes as the machine's bound. One call moves one block, as those APIs do. The two clients
alternate for ``--rounds`` rounds and the medians are compared. The master runs with
``--default-kv-lease-ttl``, as Mooncake's clients expect (every read then holds its key).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvstore.config import parse_size
from kvstore_cli.cluster import LocalCluster
from kvstore_client.compat.mooncake import MooncakeDistributedStore
from kvstore_client.store import Store


def _timed(calls: int, op: Callable[[int], Any]) -> float:
    start = time.perf_counter()
    for i in range(calls):
        op(i)
    return time.perf_counter() - start


def _round(
    own: Store, dropin: MooncakeDistributedStore, src: np.ndarray, dst: np.ndarray, own_keys: list[str],
    mc_keys: list[str],
) -> dict[tuple[str, str], float]:  # fmt: skip
    """Seconds for each client to put every row of ``src`` under its keys, then read each into ``dst``."""
    calls, size = src.shape
    return {
        ("own", "put"): _timed(calls, lambda i: own.put(own_keys[i], src[i])),
        ("dropin", "put"): _timed(calls, lambda i: _ok(dropin.put_from(mc_keys[i], src[i].ctypes.data, size))),
        ("own", "get"): _timed(calls, lambda i: own.get_into(own_keys[i], dst)),
        ("dropin", "get"): _timed(calls, lambda i: _ok(dropin.get_into(mc_keys[i], dst.ctypes.data, size) - size)),
    }


def run(sizes: list[int], total: int, rounds: int, lease_ms: int) -> list[dict[str, Any]]:
    lines = []
    master_args = ("--default-kv-lease-ttl", str(lease_ms))
    with LocalCluster(1, dram=f"{max(2 * total, 256 << 20)}", master_args=master_args) as cluster:
        own = Store.connect(cluster.master_address)
        dropin = MooncakeDistributedStore()
        assert dropin.setup("localhost", "P2PHANDSHAKE", 0, 1 << 30, "tcp", "", cluster.master_address) == 0
        try:
            for size in sizes:
                calls = max(8, total // size)
                src = np.random.default_rng(size).integers(0, 256, (calls, size), dtype=np.uint8)
                dst = np.zeros(size, dtype=np.uint8)
                assert dropin.register_buffer(src.ctypes.data, src.nbytes) == 0
                assert dropin.register_buffer(dst.ctypes.data, dst.nbytes) == 0
                times: dict[tuple[str, str], list[float]] = {}
                for r in range(rounds + 1):  # round 0 warms up connections and the arena
                    own_keys = [f"own-{size}-{r}-{i}" for i in range(calls)]
                    mc_keys = [f"mc-{size}-{r}-{i}" for i in range(calls)]
                    samples = _round(own, dropin, src, dst, own_keys, mc_keys)
                    own.remove_many(own_keys)
                    own.remove_many(mc_keys)
                    if r:
                        for key, seconds in samples.items():
                            times.setdefault(key, []).append(seconds)
                assert dropin.unregister_buffer(src.ctypes.data) == 0 and dropin.unregister_buffer(dst.ctypes.data) == 0
                copy = np.empty_like(src[0])
                start = time.perf_counter()
                for i in range(calls):
                    np.copyto(copy, src[i])
                memcpy = calls * size / (time.perf_counter() - start) / 1e9
                for op in ("put", "get"):
                    own_gbps = calls * size / statistics.median(times[("own", op)]) / 1e9
                    dropin_gbps = calls * size / statistics.median(times[("dropin", op)]) / 1e9
                    lines.append({
                        "bench": "compat_mooncake", "op": op, "size": size, "calls": calls, "rounds": rounds,
                        "own_GBps": round(own_gbps, 3), "dropin_GBps": round(dropin_gbps, 3),
                        "ratio": round(dropin_gbps / own_gbps, 3), "memcpy_GBps": round(memcpy, 3),
                        "own_us": round(1e6 * statistics.median(times[("own", op)]) / calls, 1),
                        "dropin_us": round(1e6 * statistics.median(times[("dropin", op)]) / calls, 1),
                    })  # fmt: skip
        finally:
            dropin.close()
            own.close()
    return lines


def _ok(code: int) -> None:
    if code:
        raise RuntimeError(f"the drop-in answered {code}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1MiB", help="comma-separated block sizes")
    p.add_argument("--total", type=parse_size, default=parse_size("128MiB"), help="bytes per client, op and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lease-ms", type=int, default=500, help="the master's --default-kv-lease-ttl")
    p.add_argument("--json", action="store_true", help="JSON lines only")
    args = p.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    for line in run(sizes, args.total, args.rounds, args.lease_ms):
        print(json.dumps(line) if args.json else line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
