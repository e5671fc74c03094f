"""The load of ``bench.master`` on a master, with either store's client; one JSON line of figures.

Runs under this project's interpreter (``kvstore``) or under the peers' one (``mooncake``, where
only Mooncake's wheel and numpy exist): so it imports nothing of this project at the top. The
master's CPU time and resident memory are read from /proc for the pid it is given.

  python -m bench.master_load kvstore|mooncake MASTER_ADDRESS MASTER_PID KEYS SIZE SAMPLE [META_URL]

Every key is put; gets and exists go over SAMPLE of them, evenly spaced (all of them when SAMPLE is 0
or at least KEYS): a ten-million-key table is measured without reading it all back. The bytes put
cycle through at most 65,536 distinct rows (the master's work does not depend on them).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

PUT_BATCH, GET_BATCH, EXISTS_BATCH = 512, 64, 512


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def phase(pid: int, keys: list[str], batch: int, call: Callable[[list[str], int], int]) -> dict[str, Any]:
    """Run ``call`` over ``keys`` in batches; the master's CPU per key, per-call p50/p99 and the
    count ``call`` reported (keys stored, found or existing)."""
    lat = []
    count = 0
    cpu = cpu_seconds(pid)
    start = time.perf_counter()
    for s in range(0, len(keys), batch):
        t = time.perf_counter()
        count += call(keys[s : s + batch], s)
        lat.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    used = cpu_seconds(pid) - cpu
    lat.sort()
    return {
        "master_cpu_us_per_key": round(used / len(keys) * 1e6, 2),
        "keys_per_s": round(len(keys) / wall),
        "p50_us": round(lat[len(lat) // 2] * 1e6, 1),
        "p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6, 1),
        "count": count,
    }


def kvstore_ops(master: str, size: int, data: np.ndarray) -> tuple[Any, ...]:
    from kvstore.results import PutStatus
    from kvstore_client.store import Store

    store = Store.connect(master)
    out = [np.empty(size, np.uint8) for _ in range(GET_BATCH)]

    def put(keys: list[str], first: int) -> int:
        rows = data[np.arange(first, first + len(keys)) % len(data)]
        statuses = store.put_many(zip(keys, rows, strict=True))
        return sum(s is PutStatus.STORED for s in statuses)

    def get(keys: list[str], first: int) -> int:
        return sum(n is not None for n in store.get_many_into(keys, out[: len(keys)]))

    def exists(keys: list[str], first: int) -> int:
        return sum(store.exists_many(keys))

    return put, get, exists, store.close


def mooncake_ops(master: str, size: int, data: np.ndarray, meta: str) -> tuple[Any, ...]:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    # No segment of its own: the bytes go to the storage process ``bench.master`` started, as the peers' own
    # benchmark runs Mooncake. Gets use get_batch: this wheel's batch_get_into corrupted the client's heap
    # (glibc aborts) for batches of 64 here, with or without a local segment.
    rc = store.setup("127.0.0.1", meta, 0, max(256 << 20, 2 * data.nbytes), "tcp", "", master)
    assert rc == 0, rc
    store.register_buffer(data.ctypes.data, data.nbytes)
    base = data.ctypes.data

    def put(keys: list[str], first: int) -> int:
        ptrs = [base + ((first + i) % len(data)) * size for i in range(len(keys))]
        return sum(rc == 0 for rc in store.batch_put_from(keys, ptrs, [size] * len(keys)))

    def get(keys: list[str], first: int) -> int:
        return sum(len(b) == size for b in store.get_batch(keys))

    def exists(keys: list[str], first: int) -> int:
        return sum(r == 1 for r in store.batch_is_exist(keys))

    return put, get, exists, store.close


def main(argv: list[str]) -> int:
    system, master, pid_text, keys_text, size_text, sample_text = argv[:6]
    pid, n, size, sample = int(pid_text), int(keys_text), int(size_text), int(sample_text)
    data = np.random.default_rng(0).integers(0, 256, (min(n, 1 << 16), size), dtype=np.uint8)
    keys = [f"m-{i:09d}" for i in range(n)]
    sampled = keys[:: max(1, n // sample)][:sample] if 0 < sample < n else keys
    if system == "kvstore":
        put, get, exists, close = kvstore_ops(master, size, data)
    else:
        put, get, exists, close = mooncake_ops(master, size, data, argv[6])
    rss = rss_bytes(pid)
    row: dict[str, Any] = {"bench": "master", "system": system, "keys": n, "size": size, "sampled": len(sampled)}
    row["put"] = phase(pid, keys, PUT_BATCH, put)
    row["master_bytes_per_key"] = round((rss_bytes(pid) - rss) / n, 1)
    row["get"] = phase(pid, sampled, GET_BATCH, get)
    row["exists"] = phase(pid, sampled, EXISTS_BATCH, exists)
    row["readable"] = row["get"]["count"]
    close()
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
