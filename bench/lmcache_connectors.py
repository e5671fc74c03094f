"""LMCache's remote connectors (its ``remote_url`` path) on three stores, the same memory objects,
one run: LMCache's own code moves the chunks, only the store behind it changes.

Rows, each a process of the LMCache environment (``scripts/lmcache-env.sh``) that builds its
connector through LMCache's ``ConnectorManager`` and its chunks from LMCache's allocator:

- ``kvstore``: ``kvstore://`` (``kvstore_client.adapters.lmcache.KVStoreRemoteConnector``) on a
  local cluster of its own (a master and one daemon, processes of their own, room for every pass):
  on one host the client moves the bytes through the daemon's shared-memory arena;
- ``kvstore_tcp``: the same over TCP alone (``kvstore.transport: tcp``), Mooncake's transport here;
- ``mooncake_dropin``: LMCache's ``mooncakestore://`` connector, unchanged, on the store's Mooncake
  drop-in (``mooncake.store`` from ``kvstore compat-path mooncake``), on a cluster like it;
- ``mooncake``: the same connector on Mooncake Store itself (``mooncake-transfer-engine`` from the
  peers' environment, ``../shared/peers/setup.sh``, TCP transport): its master and a storage
  process holding the segment; the row is left out, saying why, where the peers are not set up.

Both Mooncake rows run the connector's zero-copy mode (``save_chunk_meta: false``: chunks by
``batch_put_from`` / ``batch_get_into`` from the registered allocator buffer), its fastest. A chunk
is LMCache's ``KV_2LTD`` of 256 tokens over 8 layers, ``--sizes`` bytes; ``--chunks`` of them are
put and read back in batches of ``--batch`` (as LMCache's storage manager hands them over), twice,
the second pass reported; every chunk read is checked against what was put. Baselines from the
same run: a memcpy of the same bytes and one TCP stream over loopback.

    python -m bench.lmcache_connectors --json [--sizes 256KiB,4MiB] [--chunks 64] [--batch 16] [--rows ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.peers import PEERS_VENV, mooncake_env, mooncake_site
from kvstore.config import parse_size
from kvstore_cli.cluster import free_port

REPO = Path(__file__).resolve().parents[1]
LMCACHE_PYTHON = REPO / ".venv-lmcache" / "bin" / "python"
TOKENS, LAYERS, BF16 = 256, 8, 2

MOONCAKE_STORAGE = """
import sys, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", sys.argv[1], int(sys.argv[3]), 64 << 20, "tcp", "", sys.argv[2])
assert rc == 0, rc
print("ready", flush=True)
while True:
    time.sleep(1)
"""
"""Mooncake's storage role: a process that contributes the segment and idles (the client row
contributes none, so every byte crosses processes, as a daemon's do)."""


# -- the worker: one connector, in the LMCache environment ---------------------------------------
class Backend:
    """What a connector asks of LMCache's ``LocalCPUBackend``: its config and metadata, an allocator,
    and the buffer behind it (``memory_allocator.pin_allocator.buffer``: what the Mooncake
    connector registers for its zero-copy calls)."""

    def __init__(self, config: Any, metadata: Any, buffer: Any, allocator: Any, fmt: Any) -> None:
        from types import SimpleNamespace

        self.config, self.metadata, self._allocator, self._fmt = config, metadata, allocator, fmt
        self.memory_allocator = SimpleNamespace(pin_allocator=SimpleNamespace(buffer=buffer))

    def allocate(self, shapes: Any, dtypes: Any, fmt: Any = None) -> Any:
        return self._allocator.allocate(shapes, dtypes, fmt or self._fmt)


def worker(url: str, extra: dict[str, Any], sizes: list[int], chunks: int, batch: int) -> None:
    import asyncio

    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector import ConnectorManager

    plugins = extra.pop("_plugins", None)  # a connector of a plugin's: its name (the rest is extra_config)
    for index, size in enumerate(sizes):
        hidden = size // (2 * LAYERS * TOKENS * BF16)
        heads = hidden // 128 if hidden % 128 == 0 else 1
        config = LMCacheEngineConfig.from_defaults(chunk_size=TOKENS, remote_url=url, remote_serde="naive",
                                                   extra_config=extra, remote_storage_plugins=plugins)  # fmt: skip
        metadata = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0,
                                   local_worker_id=0, kv_dtype=torch.bfloat16,
                                   kv_shape=(LAYERS, 2, TOKENS, heads, hidden // heads), chunk_size=TOKENS)  # fmt: skip
        buffer = torch.empty(2 * chunks * size + (64 << 20), dtype=torch.uint8)
        backend = Backend(config, metadata, buffer, TensorMemoryAllocator(buffer), MemoryFormat.KV_2LTD)
        loop = asyncio.new_event_loop()
        connector = ConnectorManager(url, loop, backend, config, metadata).create_connector()
        objs = [backend.allocate(metadata.get_shapes(), [torch.bfloat16]) for _ in range(chunks)]
        assert objs[0].get_size() == size, (objs[0].get_size(), size)
        for i, obj in enumerate(objs):
            seeded = torch.Generator().manual_seed(i)
            obj.raw_tensor.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=seeded))
        for rnd in range(2):
            hashes = [(rnd << 48) | (index << 32) | i for i in range(chunks)]
            keys = [CacheEngineKey("bench", 1, 0, h, torch.bfloat16) for h in hashes]
            t = time.perf_counter()
            for b in range(0, chunks, batch):
                loop.run_until_complete(connector.batched_put(keys[b : b + batch], objs[b : b + batch]))
            put_s = time.perf_counter() - t
            got: list[Any] = []
            get_s = 0.0
            for b in range(0, chunks, batch):
                t = time.perf_counter()
                got += loop.run_until_complete(connector.batched_get(keys[b : b + batch]))
                get_s += time.perf_counter() - t  # not the checks below
            bad = 0
            for want, obj in zip(objs, got, strict=True):
                if obj is None or not torch.equal(obj.raw_tensor[:size], want.raw_tensor):
                    bad += 1
                if obj is not None:
                    obj.ref_count_down()
            if rnd:
                print(json.dumps({"size": size, "chunks": chunks, "put_GBps": chunks * size / put_s / 1e9,
                                  "get_GBps": chunks * size / get_s / 1e9, "bad": bad}), flush=True)  # fmt: skip
        for obj in objs:
            obj.ref_count_down()
        loop.run_until_complete(connector.close())
        loop.close()


# -- the baselines -------------------------------------------------------------------------------
def memcpy_GBps(size: int, n: int) -> float:
    src, dst = os.urandom(size), bytearray(size)
    t = time.perf_counter()
    for _ in range(n):
        dst[:] = src
    return size * n / (time.perf_counter() - t) / 1e9


def tcp_GBps(size: int, n: int) -> float:
    """One stream of ``n`` messages of ``size`` bytes over loopback, received into one buffer."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        out = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
    total = size * n

    def receive() -> None:
        buf = memoryview(bytearray(1 << 20))
        left = total
        while left:
            left -= conn.recv_into(buf, min(left, len(buf)))

    payload = os.urandom(size)
    reader = threading.Thread(target=receive)
    t = time.perf_counter()
    reader.start()
    for _ in range(n):
        out.sendall(payload)
    reader.join()
    elapsed = time.perf_counter() - t
    out.close()
    conn.close()
    return total / elapsed / 1e9


# -- the run -------------------------------------------------------------------------------------
def run_row(
    name: str, url: str, extra: dict[str, Any], env: dict[str, str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    cmd = [str(LMCACHE_PYTHON), "-m", "bench.lmcache_connectors", "--worker", url, "--extra", json.dumps(extra),
           "--sizes", args.sizes, "--chunks", str(args.chunks), "--batch", str(args.batch)]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if out.returncode:
        return [{"bench": "lmcache_connectors", "row": name, "failed": f"exit {out.returncode}: {out.stderr[-2000:]}"}]
    return [{"bench": "lmcache_connectors", "row": name, **json.loads(line)} for line in out.stdout.splitlines()
            if line.startswith("{")]  # fmt: skip


def mooncake_missing() -> str | None:
    if not (PEERS_VENV / "bin" / "mooncake_master").exists() or mooncake_site() is None:
        return f"Mooncake Store is not set up in {PEERS_VENV} (../shared/peers/setup.sh)"
    return None


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


@contextlib.contextmanager
def mooncake_cluster(segment: int, log_dir: Path) -> Iterator[tuple[str, str, dict[str, str]]]:
    """Mooncake's master (with its HTTP metadata server) and a storage process: (master, metadata
    URL, the environment its Python needs)."""
    env = mooncake_env()
    port, http = free_port(), free_port()
    master, meta = f"127.0.0.1:{port}", f"http://127.0.0.1:{http}/metadata"
    log = log_dir / "mc-storage.log"
    procs: list[subprocess.Popen[bytes]] = []
    with open(log_dir / "mc-master.log", "w") as master_log, open(log, "w") as storage_log:
        try:
            procs.append(subprocess.Popen(
                [str(PEERS_VENV / "bin" / "mooncake_master"), f"--rpc_port={port}",
                 "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                 f"--http_metadata_server_port={http}", "--enable_metric_reporting=false"],
                stdout=master_log, stderr=subprocess.STDOUT, env=env))  # fmt: skip
            deadline = time.monotonic() + 30
            while not _listening(port):  # its RPC port open: it is up
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    raise RuntimeError(f"Mooncake's master did not start: see {log_dir / 'mc-master.log'}")
                time.sleep(0.1)
            procs.append(subprocess.Popen(
                [str(PEERS_VENV / "bin" / "python"), "-c", MOONCAKE_STORAGE, meta, master, str(segment)],
                stdout=storage_log, stderr=subprocess.STDOUT, env=env))  # fmt: skip
            deadline = time.monotonic() + 30
            while "ready" not in log.read_text():
                if time.monotonic() > deadline or procs[-1].poll() is not None:
                    raise RuntimeError(f"Mooncake's storage process did not start: {log.read_text()[-2000:]}")
                time.sleep(0.2)
            yield master, meta, env
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)


def mooncake_extra(master: str, meta: str) -> dict[str, Any]:
    """LMCache's Mooncake settings: ``mooncake_`` keys for the dict ``setup``, the plain ones for the
    positional one of older wheels (LMCache tries the first, then the second)."""
    return {"save_chunk_meta": False, "transfer_timeout": 60, "local_hostname": "127.0.0.1",
            "metadata_server": meta, "master_server_address": master, "mooncake_master_server_addr": master,
            "global_segment_size": 0, "local_buffer_size": 64 << 20, "protocol": "tcp"}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="JSON lines (the only output)")
    parser.add_argument("--sizes", default="256KiB,4MiB", help="chunk sizes, comma-separated")
    parser.add_argument("--chunks", type=int, default=64, help="chunks per size and pass")
    parser.add_argument("--batch", type=int, default=16, help="chunks per connector call")
    parser.add_argument("--rows", default="kvstore,kvstore_tcp,mooncake_dropin,mooncake", help="rows to run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]  # kvstore.config's: 256KiB, 4MiB, ...
    unit = 2 * LAYERS * TOKENS * BF16
    if any(size <= 0 or size % unit for size in sizes):
        parser.error(f"--sizes: each a multiple of {unit} bytes (K and V of {LAYERS} layers of {TOKENS} bf16 tokens)")
    if args.worker:
        worker(args.worker, json.loads(args.extra), sizes, args.chunks, args.batch)
        return
    if not LMCACHE_PYTHON.exists():
        print(json.dumps({"bench": "lmcache_connectors", "skipped": "no LMCache environment (scripts/lmcache-env.sh)"}))
        sys.exit(2)
    from kvstore_cli.cluster import LocalCluster
    from kvstore_client.compat import compat_path

    rows: list[dict[str, Any]] = []
    segment = 2 * args.chunks * sum(sizes) + (256 << 20)  # both passes of every size: nothing evicted
    base_env = {**os.environ, "PYTHONPATH": str(REPO)}
    kv_extra = {"kvstore.timeout_s": 60, "kvstore.num_workers": 4, "_plugins": ["kvstore"],
                "remote_storage_plugin.kvstore.module_path": "kvstore_client.adapters.lmcache",
                "remote_storage_plugin.kvstore.class_name": "KVStoreConnectorAdapter"}  # fmt: skip
    want = set(args.rows.split(","))
    if "kvstore" in want:
        with LocalCluster(1, dram=f"{segment >> 20}MiB") as c:  # a cluster of its own for each row
            rows += run_row("kvstore", f"kvstore://{c.master_address}/lmc-bench", kv_extra, base_env, args)
    if "kvstore_tcp" in want:
        with LocalCluster(1, dram=f"{segment >> 20}MiB") as c:
            tcp_extra = {**kv_extra, "kvstore.transport": "tcp"}
            rows += run_row("kvstore_tcp", f"kvstore://{c.master_address}/lmc-bench", tcp_extra, base_env, args)
    if "mooncake_dropin" in want:
        with LocalCluster(1, dram=f"{segment >> 20}MiB") as c:
            dropin_env = {**base_env, "PYTHONPATH": f"{compat_path('mooncake')}:{REPO}"}
            dropin_extra = mooncake_extra(c.master_address, "P2PHANDSHAKE")
            rows += run_row("mooncake_dropin", "mooncakestore://bench", dropin_extra, dropin_env, args)
    why = mooncake_missing() if "mooncake" in want else "not asked for (--rows)"
    if why is None:
        with tempfile.TemporaryDirectory() as tmp, mooncake_cluster(segment, Path(tmp)) as (master, meta, env):
            site = mooncake_site()
            assert site is not None
            (Path(tmp) / "path").mkdir()
            (Path(tmp) / "path" / "mooncake").symlink_to(site / "mooncake")
            rows += run_row("mooncake", "mooncakestore://bench", mooncake_extra(master, meta),
                            {**env, "PYTHONPATH": f"{Path(tmp) / 'path'}:{REPO}"}, args)  # fmt: skip
    else:
        rows.append({"bench": "lmcache_connectors", "row": "mooncake", "skipped": why})
    for size in sizes:
        n = max(8, min(256, (256 << 20) // size))
        rows.append({"bench": "lmcache_connectors", "row": "baseline", "size": size,
                     "memcpy_GBps": memcpy_GBps(size, n), "tcp_GBps": tcp_GBps(size, n)})  # fmt: skip
    by = {(r["row"], r.get("size")): r for r in rows}
    for size in sizes:
        theirs, base = by.get(("mooncake", size)), by[("baseline", size)]
        summary: dict[str, Any] = {"bench": "lmcache_connectors", "row": "ratios", "size": size}
        for name in ("kvstore", "kvstore_tcp"):
            ours = by.get((name, size))
            if ours is None or ours["bad"]:
                continue  # a row that failed or read wrong bytes has no ratio
            for op in ("put", "get"):
                summary[f"{name}_{op}_vs_tcp"] = ours[f"{op}_GBps"] / base["tcp_GBps"]
                if theirs is not None and not theirs["bad"]:
                    summary[f"{name}_{op}_vs_mooncake"] = ours[f"{op}_GBps"] / theirs[f"{op}_GBps"]
        rows.append(summary)
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
