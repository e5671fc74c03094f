"""Soak: hours of traffic in minutes, to see what grows and what breaks.

``python -m bench.soak --minutes N --json`` runs a local cluster (a master with its admin API and
two daemons with DRAM and SSD tiers small enough that eviction runs all the time) under mixed
traffic from one client: puts of 64 KiB to 1 MiB, gets, removes and evictions (through the admin
API), over a key space that keeps growing, so the master's table is bounded by eviction and not by
the keys used. A third of the way through a daemon is killed (SIGKILL) and started again; two
thirds of the way, the master. Every value is derived from its key, so every read is checked.

Prints JSON lines: ``{"kind": "rss", ...}`` every ``--sample-s`` (resident memory of every process,
MiB), then one ``{"kind": "soak", ...}`` line with, per process, ``rss_growth_pct`` from its first
sample a minute or more after it (re)started to the last one; ``ops``, ``errors`` (typed failures:
a put refused while a daemon or the master is down), ``lost`` (pinned blocks that did not read
back: nothing may evict them, and a restarted daemon re-attaches its arena) and ``corrupt`` (reads
that returned other bytes). The baseline, measured in the same run on the same op mix: a directory
of plain files (``{"kind": "baseline", ...}``), and the soak's ops/s beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import KVStoreError
from kvstore_cli.cluster import LocalCluster
from kvstore_cli.ops import AdminClient
from kvstore_client.puts import PutOptions
from kvstore_client.store import Store

KiB = 1024
PINNED = 32
"""Pinned blocks put at the start and read at every check: none may ever be lost."""


def value(key: str) -> bytes:
    """The bytes of ``key``: 64 KiB to 1 MiB, derived from the key alone (any read can be checked)."""
    seed = hashlib.sha256(key.encode()).digest()
    size = (64 + seed[0] * 960 // 255) * KiB
    return (seed * (size // len(seed) + 1))[:size]


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@dataclass
class Tally:
    ops: int = 0
    errors: int = 0
    corrupt: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    by_op: dict[str, int] = field(default_factory=dict)

    def count(self, op: str) -> None:
        self.ops += 1
        self.by_op[op] = self.by_op.get(op, 0) + 1


class Traffic:
    """One client's mixed operations over a growing key space (see the module docstring)."""

    def __init__(self, store: Store, admin: str, rng: random.Random) -> None:
        self.store, self.admin, self.rng = store, AdminClient(admin), rng
        self.live: list[str] = []
        """Keys put and not removed (maybe evicted since): the ones gets and removes pick from."""
        self.next_key = 0
        self.tally = Tally()

    def pinned_keys(self) -> list[str]:
        return [f"soak/pinned/{i}" for i in range(PINNED)]

    def put_pinned(self) -> None:
        for key in self.pinned_keys():
            self.store.put(key, value(key), PutOptions(pin=True))

    def check_pinned(self) -> None:
        keys = self.pinned_keys()
        for key, got in zip(keys, self.store.get_many(keys), strict=True):
            if got is None:
                self.tally.lost.append(key)
            elif got != value(key):
                self.tally.corrupt.append(key)

    def step(self) -> None:
        r = self.rng.random()
        try:
            if r < 0.45 or not self.live:
                key = f"soak/{self.next_key}"
                self.next_key += 1
                self.store.put(key, value(key))
                self.live.append(key)
                self.tally.count("put")
            elif r < 0.9:
                key = self.rng.choice(self.live)
                got = self.store.get(key)
                if got is not None and got != value(key):
                    self.tally.corrupt.append(key)
                self.tally.count("get")
            elif r < 0.98:
                key = self.live.pop(self.rng.randrange(len(self.live)))
                self.store.remove(key)
                self.tally.count("remove")
            else:
                key = self.rng.choice(self.live)
                self.admin.post("/api/v1/evict", {"key": key})
                self.tally.count("evict")
        except (KVStoreError, OSError):
            self.tally.errors += 1
        if len(self.live) > 20_000:  # the client's own list stays bounded: forget the oldest
            del self.live[:10_000]


def baseline(seconds: float, rng: random.Random) -> dict[str, Any]:
    """The same op mix on a directory of plain files: ops/s with no network, no master, no eviction."""
    root = Path(tempfile.mkdtemp(prefix="kvstore-soak-baseline-"))
    live: list[str] = []
    ops, n = 0, 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            r = rng.random()
            if r < 0.45 or not live:
                key = f"soak-{n}"
                n += 1
                (root / key).write_bytes(value(key))
                live.append(key)
            elif r < 0.9:
                key = rng.choice(live)
                assert (root / key).read_bytes() == value(key)
            else:
                (root / live.pop(rng.randrange(len(live)))).unlink()
            ops += 1
            if len(live) > 256:  # a working set of the size the tiers hold
                (root / live.pop(0)).unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"kind": "baseline", "store": "plain files", "seconds": seconds, "ops_per_s": round(ops / seconds, 1)}


def growth(samples: list[tuple[float, float]], since: float) -> float | None:
    """Percent change of RSS from the first sample at or after ``since`` to the last one."""
    after = [(t, rss) for t, rss in samples if t >= since]
    if len(after) < 2:
        return None
    return round(100 * (after[-1][1] - after[0][1]) / after[0][1], 1)


Emit = Callable[[dict[str, Any]], None]


def soak(minutes: float, sample_s: float, dram: str, ssd: str, emit: Emit) -> dict[str, Any]:
    rng = random.Random(0)
    base = baseline(min(10.0, minutes * 6), random.Random(0))
    emit(base)
    total = minutes * 60
    with LocalCluster(2, dram=dram, ssd=ssd, admin=True) as cluster, Store.connect(cluster.master_address) as store:
        traffic = Traffic(store, cluster.admin_address, rng)
        traffic.put_pinned()
        started = time.monotonic()
        procs: dict[str, Callable[[], int | None]] = {
            "master": lambda: cluster.master.pid if cluster.master else None,
            "daemon0": lambda: cluster.daemons[0].pid if cluster.daemons[0] else None,
            "daemon1": lambda: cluster.daemons[1].pid if cluster.daemons[1] else None,
            "client": os.getpid,
        }
        born = dict.fromkeys(procs, 0.0)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in procs}
        events: list[dict[str, Any]] = []
        next_sample, restarted_daemon, restarted_master = 0.0, False, False
        while (now := time.monotonic() - started) < total:
            traffic.step()
            if now >= next_sample:
                rss = {name: rss_mib(pid) if (pid := get()) else None for name, get in procs.items()}
                for name, mib in rss.items():
                    if mib is not None:
                        samples[name].append((now, mib))
                emit({"kind": "rss", "t_s": round(now, 1), "rss_mib": rss, "ops": traffic.tally.ops,
                      "objects": store.stats().get("objects") if cluster.master else None})  # fmt: skip
                next_sample = now + sample_s
            if not restarted_daemon and now >= total / 3:
                restarted_daemon = True
                cluster.kill_daemon(0, signal.SIGKILL)
                cluster.restart_daemon(0)
                born["daemon0"] = time.monotonic() - started
                traffic.check_pinned()
                events.append({"t_s": round(now, 1), "event": "daemon0 killed and restarted"})
            if not restarted_master and now >= 2 * total / 3:
                restarted_master = True
                cluster.kill_master(signal.SIGKILL)
                cluster.restart_master()
                born["master"] = time.monotonic() - started
                traffic.check_pinned()
                events.append({"t_s": round(now, 1), "event": "master killed and restarted"})
        traffic.check_pinned()
        elapsed = time.monotonic() - started
        tally = traffic.tally
        per_process = {name: growth(samples[name], born[name] + 60) for name in procs}
        known = [g for g in per_process.values() if g is not None]
        return {
            "kind": "soak", "minutes": minutes, "dram": dram, "ssd": ssd, "ops": tally.ops,
            "ops_per_s": round(tally.ops / elapsed, 1),
            "ops_vs_plain_files": round(tally.ops / elapsed / base["ops_per_s"], 3),
            "by_op": tally.by_op, "errors": tally.errors,
            "lost": len(tally.lost), "corrupt": len(tally.corrupt), "lost_keys": tally.lost[:10],
            "corrupt_keys": tally.corrupt[:10], "rss_growth_pct": per_process,
            "max_rss_growth_pct": max(known) if known else None, "events": events,
            "rss_mib_last": {name: s[-1][1] if s else None for name, s in samples.items()},
        }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between RSS samples")
    parser.add_argument("--dram", default="128MiB", help="DRAM per daemon")
    parser.add_argument("--ssd", default="256MiB", help="SSD per daemon")
    parser.add_argument("--json", action="store_true", help="JSON lines only (the default prints them too)")
    args = parser.parse_args(argv)

    def emit(line: dict[str, Any]) -> None:
        print(json.dumps(line), flush=True)

    emit(soak(args.minutes, args.sample_s, args.dram, args.ssd, emit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
