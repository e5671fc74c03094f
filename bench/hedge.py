"""Gray failure: gets while one replica's daemon pauses now and then, with and without hedged reads.

Two daemons hold every key (``replicas=2``), half of them first on each (where reads go first). A
thread pauses daemon 0 (SIGSTOP, then SIGCONT) for ``--pause-ms`` every ``--period-ms``: a GC pause, a
busy core, a stalled disk, the slow node a healthy cluster always has somewhere. Each face (the
blocking Store, one thread; the AsyncStore, ``--tasks`` gets in flight) reads random keys for
``--seconds``: calm and paused, with ``hedge_reads`` off (a read waits ``failover_ms``, 100 ms, for
the paused daemon: the baseline of the same run) and on (it waits the client's recent p99 read time,
then reads the other replica). One JSON line per row: gets/s, p50/p99/p999/max in ms, and the reads
the client hedged; the paused row with hedging carries ``baseline_p99_ms`` and ``baseline_p999_ms``
(hedging off, same face, same run) and ``p99_ratio`` and ``p999_ratio``.

``python -m bench.hedge --json`` (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import threading
import time
from typing import Any

from kvstore.config import ClientConfig
from kvstore_cli.cluster import LocalCluster
from kvstore_client import PutOptions, Store
from kvstore_client.aio import AsyncStore


class Pauser:
    """Pauses a process for ``pause_s`` every ``period_s`` (from a thread) while it runs."""

    def __init__(self, pid: int, pause_s: float, period_s: float) -> None:
        self.pid, self.pause_s, self.period_s = pid, pause_s, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s - self.pause_s):
            os.kill(self.pid, signal.SIGSTOP)
            try:
                self._stop.wait(self.pause_s)
            finally:
                os.kill(self.pid, signal.SIGCONT)

    def __enter__(self) -> Pauser:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        os.kill(self.pid, signal.SIGCONT)


def _row(times: list[float], seconds: float) -> dict[str, Any]:
    times.sort()

    def at(q: float) -> float:
        return round(times[min(len(times) - 1, int(len(times) * q))] * 1000, 3)

    return {"gets_per_s": round(len(times) / seconds), "p50_ms": at(0.5), "p99_ms": at(0.99),
            "p999_ms": at(0.999), "max_ms": round(times[-1] * 1000, 3)}  # fmt: skip


def _sync(master: str, config: ClientConfig, keys: list[str], seconds: float) -> tuple[list[float], int]:
    rng = random.Random(1)
    times: list[float] = []
    with Store.connect(master, config) as store:
        end = time.monotonic() + seconds
        while (began := time.monotonic()) < end:
            if store.get(rng.choice(keys)) is None:
                raise AssertionError("a stored key was missed")
            times.append(time.monotonic() - began)
        return times, store._core.read_times.hedged


def _async(master: str, config: ClientConfig, keys: list[str], seconds: float, tasks: int) -> tuple[list[float], int]:
    async def main() -> tuple[list[float], int]:
        store = await AsyncStore.connect(master, config)
        times: list[float] = []
        end = time.monotonic() + seconds

        async def one(seed: int) -> None:
            rng = random.Random(seed)
            while (began := time.monotonic()) < end:
                if await store.get(rng.choice(keys)) is None:
                    raise AssertionError("a stored key was missed")
                times.append(time.monotonic() - began)

        try:
            await asyncio.gather(*(one(t) for t in range(tasks)))
            return times, store._core.read_times.hedged
        finally:
            await store.close()

    return asyncio.run(main())


def run(args: argparse.Namespace, emit: Any) -> None:
    keys = [f"hedge-{i}" for i in range(args.keys)]
    with LocalCluster(2, dram="64MiB") as cluster:
        with Store.connect(cluster.master_address, ClientConfig()) as store:
            for start in range(0, len(keys), 64):  # half the keys first on each node (where reads go first)
                part = keys[start : start + 64]
                first = cluster.node_name(start // 64 % 2)
                store.put_many([(k, os.urandom(args.size)) for k in part], PutOptions(replicas=2, preferred_node=first))
        daemon = cluster.daemons[0]
        assert daemon is not None
        for face in ("sync", "async"):
            baseline: dict[str, Any] = {}
            for paused in (False, True):
                for hedge in (False, True):
                    config = ClientConfig(hedge_reads=hedge, timeout_s=10.0, transport="tcp")  # not shm: via the daemon
                    with Pauser(daemon.pid, args.pause_ms / 1000, args.period_ms / 1000) if paused else _Calm():
                        if face == "sync":
                            times, hedged = _sync(cluster.master_address, config, keys, args.seconds)
                        else:
                            times, hedged = _async(cluster.master_address, config, keys, args.seconds, args.tasks)
                    row = {"bench": "hedge", "face": face, "paused": paused, "hedge_reads": hedge,
                           **_row(times, args.seconds), "hedged": hedged}  # fmt: skip
                    if paused and not hedge:
                        baseline = row
                    elif paused and baseline:
                        for q in ("p99", "p999"):
                            row[f"baseline_{q}_ms"] = baseline[f"{q}_ms"]
                            row[f"{q}_ratio"] = round(row[f"{q}_ms"] / baseline[f"{q}_ms"], 3)
                    emit(row)


class _Calm:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="JSON lines (the only output form)")
    parser.add_argument("--seconds", type=float, default=5.0, help="per row")
    parser.add_argument("--keys", type=int, default=2000)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--pause-ms", type=float, default=30.0)
    parser.add_argument("--period-ms", type=float, default=150.0)
    parser.add_argument("--tasks", type=int, default=8, help="AsyncStore gets in flight")
    args = parser.parse_args(argv)
    run(args, lambda line: print(json.dumps(line), flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
