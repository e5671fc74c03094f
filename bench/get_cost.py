"""What one get costs the client: Python calls (deterministic), CPU and wall time per get.

bench.cluster's get rows measure throughput, which this shared two-core machine moves by more
than the 5% a change to the read path may cost; this measures the client alone. One JSON line per
block size: ``calls_per_get`` (cProfile's count of Python calls: the same on every machine for the
same code), ``cpu_us`` and ``wall_us`` per get (the best of ``--passes`` passes of 1,024 gets of
256 keys, a batch of one each, from a daemon on this host: the shared-memory path), and the same
run's baseline ``memcpy_us`` (numpy copying the block). Compare two commits by running this from
each, alternated::

    python -m bench.get_cost --json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import numpy as np

from kvstore_cli.cluster import LocalCluster
from kvstore_client.store import Store

KEYS = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="JSON lines (the default output)")
    parser.add_argument("--sizes", default="4096,1048576", help="block sizes in bytes, comma-separated")
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    dram = f"{max(sizes) * KEYS * 3 // 2 + (64 << 20)}"
    with LocalCluster(1, dram=dram) as cluster, Store.connect(cluster.master_address) as store:
        for size in sizes:
            src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
            dst = np.zeros_like(src)
            keys = [f"cost-{size}-{i}" for i in range(KEYS)]
            for key in keys:
                store.put(key, src)
            for key in keys:  # warm: connections, leases, hints
                store.get_many_into([key], [dst])
            assert np.array_equal(src, dst)
            profile = cProfile.Profile()
            profile.enable()
            for key in keys:
                store.get_many_into([key], [dst])
            profile.disable()
            calls = pstats.Stats(profile).total_calls / KEYS  # type: ignore[attr-defined]
            best_cpu, best_wall = float("inf"), float("inf")
            for _ in range(args.passes):
                cpu0, wall0 = time.process_time(), time.perf_counter()
                for _ in range(4):
                    for key in keys:
                        store.get_many_into([key], [dst])
                n = 4 * KEYS
                best_cpu = min(best_cpu, (time.process_time() - cpu0) / n)
                best_wall = min(best_wall, (time.perf_counter() - wall0) / n)
            copies = 0
            t0 = time.perf_counter()
            while copies < 1024:
                np.copyto(dst, src)
                copies += 1
            memcpy = (time.perf_counter() - t0) / copies
            print(json.dumps({
                    "bench": "get_cost", "size": size, "calls_per_get": round(calls, 1),
                    "cpu_us": round(best_cpu * 1e6, 1), "wall_us": round(best_wall * 1e6, 1),
                    "memcpy_us": round(memcpy * 1e6, 1),
                }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
