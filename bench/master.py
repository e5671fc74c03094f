"""The master's own cost beside Mooncake's C++ master, in one run: CPU time per key and resident
memory per key under one client's batched puts, gets and exists of many small objects.

Both masters get the same load (``bench/master_load.py``: puts batched by 512, gets by 64, exists by
512; every key new): ours behind two daemons with ``--dram`` each, Mooncake's behind one client
process holding a segment (the bytes move inside it: only the master's work is compared). CPU and
memory are the master process's, from /proc. Mooncake runs where ../shared/peers is set up (the
peers' venv, ``setup.sh``); without it only our row is printed.

  python -m bench.master --json [--keys 200000] [--size 256] [--dram 1GiB] [--sample 0]

``--sample N``: gets and exists over N of the keys, evenly spaced (a table of ten million keys is
measured at its full size without reading it all back; 0: every key).

Last line: the ratios ``put_cpu``, ``get_cpu``, ``exists_cpu`` and ``memory`` (ours over
Mooncake's: below 1 is cheaper). Our row's ``daemon_index``: the daemons' arena files beyond their
DRAM (header and index), over the blocks they hold (``bytes_per_block``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.peers import PEERS_VENV, mooncake_env
from kvstore.config import daemon_dram
from kvstore.tiers.arena_files import arena_path
from kvstore_cli.cluster import LocalCluster
from transfer.kv_events import KVEventSubscriber

REPO = Path(__file__).resolve().parents[1]
PEERS_BENCH = REPO.parent / "shared" / "peers" / "mooncake_bench.py"


def _load(python: str, args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    done = subprocess.run([python, "-m", "bench.master_load", *args], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            row: dict[str, Any] = json.loads(line)
            return row
    return {"bench": "master", "system": args[0], "error": (done.stderr or done.stdout).strip()[-600:]}


def run_kvstore(
    keys: int, size: int, dram: str, timeout: float, sample: int = 0, kv_events: bool = False
) -> dict[str, Any]:
    """Our master's costs; with ``kv_events`` it publishes KV events (``--kv-events``) to a live
    subscriber that reads them all, as a router would."""
    with LocalCluster(2, dram=dram, daemon_metrics=True, kv_events=kv_events) as cluster:
        assert cluster.master is not None
        env = dict(os.environ)
        args = ["kvstore", cluster.master_address, str(cluster.master.pid), str(keys), str(size), str(sample)]
        counter = _EventCounter(cluster.kv_events[0][0]) if kv_events else None
        try:
            row = _load(sys.executable, args, env, timeout)
        finally:
            received = counter.stop() if counter is not None else 0
        if "error" not in row:
            row["daemon_index"] = daemon_index(cluster)
            if counter is not None:
                row["system"] = "kvstore+kv_events"
                row["kv_events_received"] = received
        return row


class _EventCounter:
    """A subscriber that reads every KV event the master publishes (counting them) until stopped."""

    def __init__(self, endpoint: str) -> None:
        self._sub = KVEventSubscriber([endpoint])
        self._stop = threading.Event()
        self.events = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(0.3)  # the subscription reaches the publisher before the load begins

    def _run(self) -> None:
        while not self._stop.is_set():
            for d in self._sub.receive(0.1):
                self.events += len(d.batch.events)

    def stop(self) -> int:
        time.sleep(0.5)  # the last flush
        self._stop.set()
        self._thread.join(5)
        self._sub.close()
        return self.events


def daemon_index(cluster: LocalCluster) -> dict[str, Any]:
    """What the daemons' arena files hold beyond their data, over the blocks they hold: the files'
    sizes (from the file system) less their DRAM (from each daemon's metrics), and the blocks."""
    beyond = blocks = 0
    for i, address in enumerate(cluster.daemon_metrics):
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        metric = {name: float(v) for name, v in re.findall(r"^kvstore_daemon_(dram_\w+)\{[^}]*\} (\S+)$", text, re.M)}
        path = arena_path(daemon_dram(cluster.env, name=cluster.arena_name(i)))
        beyond += path.stat().st_size - int(metric["dram_capacity_bytes"])
        blocks += int(metric["dram_blocks"])
    per_block = round(beyond / blocks, 1) if blocks else None
    return {"blocks": blocks, "bytes_beyond_dram": beyond, "bytes_per_block": per_block}


def run_mooncake(keys: int, size: int, timeout: float, sample: int = 0) -> dict[str, Any] | None:
    python, master_bin = PEERS_VENV / "bin" / "python", PEERS_VENV / "bin" / "mooncake_master"
    if not python.exists() or not master_bin.exists() or not PEERS_BENCH.exists():
        return None
    env = mooncake_env()
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / "kvstore-bench-mc-master.log"
    with open(log_path, "w") as log:
        return _mooncake_with_master(python, master_bin, env, log, keys, size, timeout, sample)


def _mooncake_with_master(
    python: Path,
    master_bin: Path,
    env: dict[str, str],
    log: Any,
    keys: int,
    size: int,
    timeout: float,
    sample: int = 0,
) -> dict[str, Any]:
    rpc, http = 50151, 8181
    master = subprocess.Popen(
        [str(master_bin), "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={http}", f"--rpc_port={rpc}", "--enable_metric_reporting=false"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    storage: subprocess.Popen[str] | None = None
    try:
        time.sleep(2)
        storage = subprocess.Popen(
            [str(python), str(PEERS_BENCH), "storage"],
            env={**env, "SEG": str(segment_bytes(keys, size)), **_mc(rpc, http)},
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert storage.stdout is not None
        if "ready" not in storage.stdout.readline():
            return {"bench": "master", "system": "mooncake", "error": "Mooncake's storage process did not start"}
        args = [
            "mooncake",
            f"127.0.0.1:{rpc}",
            str(master.pid),
            str(keys),
            str(size),
            str(sample),
            f"http://127.0.0.1:{http}/metadata",
        ]
        return _load(str(python), args, env, timeout)
    finally:
        for proc in (storage, master):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(60)  # a master of ten million keys takes more than ten seconds to go
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def segment_bytes(keys: int, size: int) -> int:
    """The storage process's segment: room for every key, so that Mooncake evicts nothing (its
    allocator took ~1 KiB for each 256 B object here: 4 GiB held 4.19 million of them)."""
    return max(4 << 30, keys * max(1100, 2 * size))


def _mc(rpc: int, http: int) -> dict[str, str]:
    return {"MC_MASTER": f"127.0.0.1:{rpc}", "MC_META": f"http://127.0.0.1:{http}/metadata"}


def ratios(ours: dict[str, Any], theirs: dict[str, Any], label: str = "kvstore/mooncake") -> dict[str, Any]:
    def r(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    return {
        "bench": "master", "ratio": label,
        **{f"{op}_cpu": r(ours[op]["master_cpu_us_per_key"], theirs[op]["master_cpu_us_per_key"])
           for op in ("put", "get", "exists")},
        "memory": r(ours["master_bytes_per_key"], theirs["master_bytes_per_key"]),
        "readable": [ours["readable"], theirs["readable"]],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.master", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="JSON lines (the only output format)")
    parser.add_argument("--keys", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=256, help="bytes per object")
    parser.add_argument("--dram", default="1GiB", help="DRAM of each of our two daemons")
    parser.add_argument("--sample", type=int, default=0, help="gets and exists over this many keys (0: all)")
    parser.add_argument("--peers", choices=["auto", "no"], default="auto")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument(
        "--kv-events", action="store_true",
        help="also run our master publishing KV events to a live subscriber, and print its costs against ours",
    )  # fmt: skip
    args = parser.parse_args(argv)
    ours = run_kvstore(args.keys, args.size, args.dram, args.timeout, args.sample)
    print(json.dumps(ours), flush=True)
    if args.kv_events:
        evented = run_kvstore(args.keys, args.size, args.dram, args.timeout, args.sample, kv_events=True)
        print(json.dumps(evented), flush=True)
        if "error" not in ours and "error" not in evented:
            row = {**ratios(evented, ours, "kv_events/without"), "events": evented["kv_events_received"]}
            print(json.dumps(row), flush=True)
    theirs = run_mooncake(args.keys, args.size, args.timeout, args.sample) if args.peers == "auto" else None
    if theirs is not None:
        print(json.dumps(theirs), flush=True)
        if "error" not in ours and "error" not in theirs:
            print(json.dumps(ratios(ours, theirs)), flush=True)
    return 0 if "error" not in ours else 1


if __name__ == "__main__":
    sys.exit(main())
