"""The client side of the two-host (network namespace) runs; started inside host ``a`` by tests and bench.

``python -m bench.netns_client MASTER MODE --blocks N --block-bytes B`` waits for
the daemon to register, puts N random blocks over the daemon's rails, prints
``ready`` and then, per mode:

- ``get``: waits for a line on stdin, gets every block back over all rails,
  checks every byte, and prints one JSON line (bytes per rail, seconds, ok).
- ``bench``: reads the blocks through one rail and through all rails and
  prints one JSON line with both rates.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from kvstore.config import ClientConfig, parse_size
from kvstore.errors import KVStoreError
from kvstore.protocol import NodeInfo
from kvstore_client.dataplane import RailPath
from kvstore_client.store import Store
from transfer.rails import RailSet


def _railset(store: Store, node: NodeInfo) -> RailSet | None:
    """The rails this client sprays the node's transfers over (None when it reaches it otherwise)."""
    path = store._path(node.node_id, node.address)
    return path.railset if isinstance(path, RailPath) else None


def _wait_for_node(master: str, config: ClientConfig, timeout: float = 60.0) -> Store:
    deadline = time.monotonic() + timeout
    while True:
        try:
            store = Store.connect(master, config)
            if store.stats()["nodes_up"] >= 1:
                return store
            store.close()
        except KVStoreError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"no daemon registered with {master} within {timeout} s")
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("master")
    parser.add_argument("mode", choices=["get", "bench"])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--block-bytes", type=parse_size, default=parse_size("4MiB"))
    parser.add_argument("--slice-bytes", type=parse_size, default=parse_size("1MiB"))
    parser.add_argument("--rail-timeout", type=float, default=1.0)
    args = parser.parse_args(argv)
    config = ClientConfig(
        transport="tcp", slice_bytes=args.slice_bytes, rail_timeout_s=args.rail_timeout, timeout_s=30.0
    )
    with _wait_for_node(args.master, config) as store:
        [node] = store.nodes()
        blocks = np.random.default_rng(11).integers(0, 256, (args.blocks, args.block_bytes), dtype=np.uint8)
        keys = [f"netns-{i}" for i in range(args.blocks)]
        for i in range(0, args.blocks, 4):
            store.put_many(zip(keys[i : i + 4], blocks[i : i + 4], strict=True))
        print("ready", flush=True)
        out = np.zeros_like(blocks)
        if args.mode == "get":
            sys.stdin.readline()
            railset = _railset(store, node)
            assert railset is not None, f"node {node.node_id} has one rail: {node.rails}"
            before = {r.address: r.bytes_moved for r in railset.rails}
            start = time.perf_counter()
            got = store.get_many_into(keys, list(out), verify=True)
            seconds = time.perf_counter() - start
            result = {
                "ok": got == [args.block_bytes] * args.blocks and bool(np.array_equal(out, blocks)),
                "seconds": round(seconds, 3),
                "rail_bytes": {r.address: r.bytes_moved - before[r.address] for r in railset.rails},
                "paused": [r.address for r in railset.rails if r.paused_until > time.monotonic()],
            }
        else:
            with store._located(keys) as located:
                sizes = [loc.size for loc in located if loc is not None]
                checksums = [loc.checksum for loc in located if loc is not None]
            rates = {}
            for name, rails in (("one", node.rails[:1]), ("all", node.rails)):
                railset = RailSet(rails, timeout=5.0, slice_bytes=args.slice_bytes, max_inflight=8, cooldown_s=5.0)
                try:
                    railset.read(keys[:1], sizes[:1], checksums[:1], [memoryview(out[0])])  # warm the connections
                    start = time.perf_counter()
                    got = railset.read(keys, sizes, checksums, [memoryview(row) for row in out])
                    rates[name] = blocks.nbytes / (time.perf_counter() - start) / 1e9
                    assert got == sizes and np.array_equal(out, blocks)
                finally:
                    railset.close()
            result = {"links": len(node.rails), "GBps": round(rates["all"], 4), "one_link_GBps": round(rates["one"], 4),
                      "ratio_vs_one": round(rates["all"] / rates["one"], 3)}  # fmt: skip
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
