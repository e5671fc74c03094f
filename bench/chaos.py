"""Chaos with a checker: clients run a mixed load on a real HA cluster while a nemesis kills, stops
and restarts its processes; every operation is recorded, and the history is judged at the end
(:mod:`bench.chaos_check`).

  python -m bench.chaos --json [--minutes N] [--seed S] [--faults leader_kill,daemon_kill,sigstop]

The cluster: a one-member etcd, two HA masters, three daemons with DRAM and SSD tiers, all
processes on loopback. The load: ``--workers`` client processes (sync ``Store`` and ``AsyncStore``
with several tasks, over TCP and over shared memory) putting (some pinned), getting, batch
getting, checking, removing and prefix-matching keys of a small key space, so that keys are
rewritten, removed and put again while faults land; an operator evicts keys through the admin
API now and then. The nemesis, on a schedule drawn from ``--seed`` (the same seed, the same
schedule): ``leader_kill`` (SIGKILL the leading master, restart it as a standby), ``daemon_kill``
(SIGKILL a daemon, restart it on its arena), ``sigstop`` (SIGSTOP a daemon or the leader for a
few seconds, then SIGCONT), ``partition`` (a daemon cut from both masters, or a client process
cut from a daemon: :class:`Partitions`, root and iptables), ``disk_full`` (fill the filesystem of a
daemon's SSD tier, a small tmpfs mounted for it: root only, then empty it again). By default every
kind this machine can inject.

Capacity is sized so that nothing is evicted for room (the key space fits every node's SSD):
a read that misses an acknowledged put that no remove or eviction explains is a loss. The
masters' eviction counters are read all along; if evictions for room happened anyway, only
pinned puts are held to that.

One JSON line per fault as it heals, then the summary (last line): ``ops``, ``ok``,
``violations`` (a count; ``first``: the first few in full), ``faults`` by kind,
``max_unavailable_s`` and ``unavailable_s`` by fault class (a SIGSTOP of the leader or of a
daemon, a partition of a daemon or of a client apart: :func:`bench.chaos_check.fault_class`),
``get_p99_ms`` of the reads outside faults (``calm``) and during them, ``read_max_s`` (the longest
read that overlapped a fault, by fault class: what a fault costs a reader, while
``unavailable_s`` counts the writers that wait on a frozen node too), ``replicas`` (``--replicas``:
the clients' default replicas of a put), ``max_op_s``, ``seed``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import put_modes
from bench.chaos_check import check, get_p99_ms, load, longest_reads, read_value, unavailability, value_bytes
from bench.chaos_faults import GROUPS, Partitions, Prometheus, SsdDisks, fill, judge_alerts
from kvstore.config import ClientConfig, parse_size
from kvstore.errors import KVStoreError
from kvstore_cli.cluster import LocalCluster, LocalEtcd
from kvstore_client.aio import AsyncStore
from kvstore_client.children import die_with_parent
from kvstore_client.puts import PutOptions, PutStatus
from kvstore_client.store import Store
from transfer.wire import parse_address

FAULTS = ("leader_kill", "daemon_kill", "sigstop", "partition", "disk_full")


def worker_gid(w: int) -> int:
    return GROUPS + 16 + w


def transport_of(w: int) -> str:
    """Client worker ``w``'s transport: every third over shared memory where it can, the others TCP."""
    return "auto" if w % 3 == 2 else "tcp"


CLUSTER_ID = "chaos"
SIZES = (4096, 32 * 1024, 128 * 1024)
OPS = (("put", 30), ("put_pinned", 4), ("get", 28), ("get_many", 10), ("exists", 6), ("remove", 10), ("match", 4))


def _pick(rng: random.Random) -> str:
    return rng.choices([op for op, _ in OPS], [w for _, w in OPS])[0]


class Recorder:
    """A worker's history file: a ``begin`` line before each op, its record after (line-buffered, so
    a worker killed mid-op leaves the begin behind)."""

    def __init__(self, path: Path, wid: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self.wid = wid
        self.n = 0
        self._lock = threading.Lock()

    def begin(self) -> tuple[int, int]:
        with self._lock:
            self.n += 1
            n = self.n
        t0 = time.monotonic_ns()
        self.file.write(json.dumps({"begin": n, "w": self.wid, "t0": t0}) + "\n")
        return n, t0

    def end(self, records: list[dict[str, Any]]) -> None:
        self.file.write("".join(json.dumps(r) + "\n" for r in records))

    def close(self) -> None:
        self.file.close()


async def _maybe(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value


async def one_op(
    face: Any, rng: random.Random, rec: Recorder, keys: list[str], modes: Sequence[str] = ("visible",)
) -> None:
    """One random operation through ``face`` (a Store or an AsyncStore), recorded; a put in one of
    ``modes`` (drawn), which its record names."""
    op = _pick(rng)
    n, t0 = rec.begin()
    base: dict[str, Any] = {"w": rec.wid, "n": n, "op": op, "t0": t0}
    out: list[dict[str, Any]] = []
    try:
        if op in ("put", "put_pinned"):
            key, size = rng.choice(keys), rng.choice(SIZES)
            base.update(op="put", key=key, v=f"{rec.wid}.{n}", pin=op == "put_pinned", mode=rng.choice(modes))
            data = value_bytes(key, base["v"], size)
            status = await _maybe(face.put(key, data, PutOptions(pin=base["pin"], mode=base["mode"])))
            out = [{**base, "res": "stored" if status == PutStatus.STORED else "exists"}]
        elif op == "get_many":
            batch = base["keys"] = rng.sample(keys, rng.randint(2, 8))
            got = await _maybe(face.get_many(batch))
            out = [{**base, "key": k, "res": read_value(k, g)} for k, g in zip(batch, got, strict=True)]
        elif op == "match":
            start = rng.randrange(len(keys))
            chain = base["keys"] = [keys[(start + i) % len(keys)] for i in range(rng.randint(1, 6))]
            out = [{**base, "res": await _maybe(face.match_prefix(chain))}]
        else:
            key = base["key"] = rng.choice(keys)
            if op == "get":
                out = [{**base, "res": read_value(key, await _maybe(face.get(key)))}]
            else:  # exists, remove
                out = [{**base, "res": bool(await _maybe(getattr(face, op)(key)))}]
        t1 = time.monotonic_ns()
        for r in out:
            r.update(t1=t1, ok=True)
    except Exception as exc:  # recorded: the checker judges whether it was one of the store's errors
        out = [{**base, "t1": time.monotonic_ns(), "ok": False, "err": f"{type(exc).__name__}: {exc}"[:500],
                "expected": isinstance(exc, KVStoreError)}]  # fmt: skip
    rec.end(out)


def worker(wid: str, master: str, seed: int, stop_at: float, keys: list[str], out: str, kind: str, tasks: int,
           transport: str, timeout_s: float, gid: int | None = None,
           modes: Sequence[str] = ("visible",), replicas: int = 1) -> None:  # fmt: skip
    """A client process: ops until ``stop_at`` (time.monotonic()), every one recorded to ``out``; with
    ``gid``, its sockets are that group's (a partition can cut it)."""
    if sys.platform == "linux":
        die_with_parent()  # a run interrupted or killed takes its clients with it
    if gid is not None:
        os.setgid(gid)
    rec = Recorder(Path(out), wid)
    config = ClientConfig(transport=transport, timeout_s=timeout_s, replicas=replicas)  # type: ignore[arg-type]

    async def run() -> None:
        if kind == "async":
            face: Any = await AsyncStore.connect(master, config)

            async def loop(t: int) -> None:
                rng = random.Random(f"{seed}-{wid}-{t}")
                while time.monotonic() < stop_at:
                    await one_op(face, rng, rec, keys, modes)

            try:
                await asyncio.gather(*(loop(t) for t in range(tasks)))
            finally:
                await face.close()
        else:
            face = Store.connect(master, config)
            rng = random.Random(f"{seed}-{wid}")
            try:
                while time.monotonic() < stop_at:
                    await one_op(face, rng, rec, keys, modes)
            finally:
                face.close()

    try:
        asyncio.run(run())
    finally:
        rec.close()


class Nemesis:
    """Faults at times drawn from a seed, each healed before the next; what it did, with times."""

    def __init__(self, cluster: LocalCluster, kinds: list[str], seed: int, log: Callable[[dict[str, Any]], None],
                 *, partitions: Partitions | None = None, workers: int = 0) -> None:  # fmt: skip
        self.cluster = cluster
        self.partitions = partitions
        self.workers = workers
        self.partitioned = 0
        self.error: str | None = None
        """Why the nemesis stopped early (a fault it could not inject or heal), if it did."""
        self.kinds = kinds
        self.rng = random.Random(f"nemesis-{seed}")
        self.log = log
        self.faults: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.released = threading.Event()
        self.record: Any = None
        self.hold = (3.0, 6.0)
        """How long a fault lasts (seconds, drawn between the two): long enough for a node to be
        marked down (3 s of silence), so that the alert an operator wants has something to see."""
        """Where each fault is written as it heals (a kept run's ``faults.jsonl``)."""

    def run(self, start_after: float, interval: float, until: float) -> None:
        try:
            self._run(start_after, interval, until)
        except Exception as exc:  # a fault that could not be injected or healed: no more faults, said so
            self.error = f"{type(exc).__name__}: {exc}"
            self.log({"nemesis_error": self.error})
        # The processes this thread restarted die with it (LocalCluster's die_with_parent is per
        # thread): it stays until the run is over.
        self.released.wait()

    def _run(self, start_after: float, interval: float, until: float) -> None:
        t = time.monotonic() + start_after
        deck: list[str] = []
        while self.kinds and not self.stop.wait(max(0.0, t - time.monotonic())) and time.monotonic() < until:
            if not deck:  # every kind once a round, in an order drawn from the seed
                deck = self.rng.sample(self.kinds, len(self.kinds))
            kind = deck.pop()
            hold = self.rng.uniform(*self.hold)
            fault: dict[str, Any] = {"kind": kind, "t0": time.monotonic_ns(), "wall0": time.time()}
            try:
                fault["target"] = self.inject(kind, hold)
            finally:  # a fault that failed half-way still counts: its window excuses what it did
                fault["t1"], fault["wall1"] = time.monotonic_ns(), time.time()
                fault.setdefault("target", "?")
                self.faults.append(fault)
            if self.record is not None:
                self.record.write(json.dumps(fault) + "\n")
            self.log({"fault": kind, "target": fault["target"], "held_s": round(hold, 2),
                      "healed_in_s": round((fault["t1"] - fault["t0"]) / 1e9, 2)})  # fmt: skip
            t = time.monotonic() + interval * self.rng.uniform(0.6, 1.4)

    def inject(self, kind: str, hold: float) -> str:
        c = self.cluster
        if kind == "leader_kill":
            m = self.cluster.leader_index(30.0)
            c.kill_ha_master(m)
            time.sleep(hold)
            c.start_ha_master(m)  # back as a standby
            self.cluster.leader_index(30.0)
            return f"master-{m}"
        if kind == "daemon_kill":
            i = self.rng.randrange(c.num_daemons)
            c.kill_daemon(i)
            time.sleep(hold)
            c.restart_daemon(i)
            return f"daemon-{i}"
        if kind == "sigstop":
            if self.rng.random() < 0.5:
                m = self.cluster.leader_index(30.0)
                proc, target = c.masters[m], f"master-{m}"
            else:
                i = self.rng.randrange(c.num_daemons)
                proc, target = c.daemons[i], f"daemon-{i}"
            assert proc is not None
            os.kill(proc.pid, signal.SIGSTOP)
            try:
                time.sleep(hold)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            c.wait_for_nodes(c.num_daemons)
            return target
        if kind == "partition":
            assert self.partitions is not None, "partitions need Partitions (root, iptables)"
            i = self.rng.randrange(c.num_daemons)
            daemon = [parse_address(c.daemon_addresses[i])[1]]
            self.partitioned += 1
            # Sides alternate, the first a daemon cut from both masters. A client cut from a daemon is one
            # over TCP (one over shared memory would still read the daemon's arena).
            tcp = [w for w in range(self.workers) if transport_of(w) == "tcp"]
            try:
                if self.partitioned % 2 or not tcp:
                    masters = [c.gid("master", m) for m in range(len(c.masters))]
                    ports = [parse_address(a)[1] for a in c.master_rpc]
                    target = f"daemon-{i}|masters"
                    self.partitions.cut([c.gid("daemon", i)], ports, masters, daemon)
                else:  # its packets to the daemon's port are dropped
                    w = self.rng.choice(tcp)
                    target = f"w{w}|daemon-{i}"
                    self.partitions.cut([worker_gid(w)], daemon)
                time.sleep(hold)
            finally:
                self.partitions.heal()
            c.wait_for_nodes(c.num_daemons)
            return target
        if kind == "disk_full":
            i = self.rng.randrange(c.num_daemons)
            fill(c.workdir / f"ssd-{i}" / "filler")
            try:
                time.sleep(hold)
            finally:
                (c.workdir / f"ssd-{i}" / "filler").unlink(missing_ok=True)
            return f"daemon-{i}"
        raise ValueError(f"unknown fault {kind!r}; there are {FAULTS}")


class Evictions:
    """What the masters evicted: each master process's eviction log (``GET /api/v1/evictions``), read
    every quarter second into ``history-evictions.jsonl`` as ``evicted`` records the checker counts as
    removals, and its counters (a master's start again at zero when it restarts). The log is whole
    when no page said entries were lost and no master counted more evictions than its log gave."""

    MARGIN_NS = 2_000_000_000
    """An eviction is logged when the master learns it is done (a daemon's drop confirmed, within a
    tick): it may have been decided, and its block unreadable, up to this long before."""

    def __init__(self, cluster: LocalCluster, path: Path) -> None:
        self.cluster = cluster
        self.seen: dict[tuple[int, int], dict[str, float]] = {}
        self.after: dict[tuple[int, int], int] = {}
        self.lost = 0
        self.stop = threading.Event()
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()
        self._offset = time.time_ns() - time.monotonic_ns()  # unix time -> this host's monotonic clock
        self._ticks = 0

    def run(self) -> None:
        while not self.stop.wait(0.25):
            self.read(counters=self._ticks % 4 == 0)
            self._ticks += 1

    def read(self, counters: bool = True) -> None:
        for m, proc in enumerate(self.cluster.masters):
            admin = self.cluster.master_admin[m]
            if proc is None or not admin:
                continue
            who = (m, proc.pid)
            self._read_log(m, who, admin)
            if counters:
                self._read_counters(who, admin)

    def _read_log(self, m: int, who: tuple[int, int], admin: str) -> None:
        while True:
            after = self.after.get(who, 0)
            try:
                with urllib.request.urlopen(f"http://{admin}/api/v1/evictions?after={after}&limit=10000",
                                            timeout=2) as resp:  # fmt: skip
                    page = json.loads(resp.read())
            except (OSError, ValueError):
                return
            self.lost += page["lost"]
            for e in page["evictions"]:
                t = int(e["at"] * 1e9) - self._offset
                self.file.write(json.dumps({
                    "w": f"master-{m}.{who[1]}", "n": e["seq"], "op": "evicted", "key": e["key"], "ok": True,
                    "res": 1, "t0": t - self.MARGIN_NS, "t1": t + 200_000_000, "node": e["node_id"],
                    "reason": e["reason"],
                }) + "\n")  # fmt: skip
            self.after[who] = page["next_after"]
            if len(page["evictions"]) < 10000:
                return

    def _read_counters(self, who: tuple[int, int], admin: str) -> None:
        try:
            with urllib.request.urlopen(f"http://{admin}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except OSError:
            return
        seen = self.seen.setdefault(who, {})
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in ("kvstore_evictions_total", "kvstore_demotions_failed_total"):
                seen[name] = max(seen.get(name, 0.0), float(value))

    def total(self, name: str) -> int:
        return int(sum(s.get(name, 0.0) for s in self.seen.values()))

    def whole(self) -> bool:
        """Whether every eviction the masters counted is in the log read."""
        return not self.lost and all(
            s.get("kvstore_evictions_total", 0.0) <= self.after.get(who, 0) for who, s in self.seen.items()
        )  # fmt: skip

    def close(self) -> None:
        self.file.close()


def operator(cluster: LocalCluster, nemesis: Nemesis, keys: list[str], rec: Recorder, rng: random.Random,
             stop: threading.Event, period: float) -> None:  # fmt: skip
    """Evict a key through the leader's admin API every ``period`` seconds or so, recorded."""
    while not stop.wait(period * rng.uniform(0.5, 1.5)):
        key = rng.choice(keys)
        n, t0 = rec.begin()
        record: dict[str, Any] = {"w": rec.wid, "n": n, "op": "evict", "key": key, "t0": t0}
        try:
            admin = cluster.master_admin[cluster.leader_index(5.0)]
            request = urllib.request.Request(
                f"http://{admin}/api/v1/evict", json.dumps({"key": key}).encode(),
                {"Content-Type": "application/json"}, method="POST",
            )  # fmt: skip
            with urllib.request.urlopen(request, timeout=10) as resp:
                body = json.loads(resp.read())
            record.update(ok=True, res=body["evicted"], pinned=bool(body["skipped_pinned"]))
        except (OSError, KVStoreError, KeyError, ValueError) as exc:  # refused (503 while taking over), or cut
            record.update(ok=False, err=f"{type(exc).__name__}: {exc}", expected=True)
        record["t1"] = time.monotonic_ns()
        rec.end([record])


def run(args: argparse.Namespace, emit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    seconds = args.minutes * 60
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    unknown = set(kinds) - set(FAULTS)
    if unknown:
        raise SystemExit(f"--faults: unknown {sorted(unknown)}; there are {list(FAULTS)}")
    skipped: dict[str, str] = {}
    for kind, can, why in (
        ("disk_full", SsdDisks.possible, "no tmpfs can be mounted here (root, and a container that allows it)"),
        ("partition", Partitions.possible, "no iptables rule with an owner match can be added here (root, iptables)"),
    ):  # fmt: skip
        if kind in kinds and args.faults == ",".join(FAULTS) and not can():
            kinds.remove(kind)  # the default asks for every kind this machine can inject
            skipped[kind] = why
            emit({"skipped_fault": kind, "why": why})
    modes: list[str] = args.put_modes
    keys = [f"c{i}" for i in range(args.keys)]
    etcd = LocalEtcd().start()
    workdir = etcd.dir / "run"
    workdir.mkdir()
    disks = SsdDisks(workdir, 3, parse_size(args.ssd) + (16 << 20)) if "disk_full" in kinds else None
    partitions: Partitions | None = None
    groups = GROUPS if "partition" in kinds else None
    try:
        if groups is not None:
            partitions = Partitions()
        with LocalCluster(
            3, dram=args.dram, ssd=args.ssd, workdir=workdir, etcd=etcd.endpoint, cluster_id=CLUSTER_ID, masters=2,
            admin=True, die_with_parent=True, env=dict(e.split("=", 1) for e in args.cluster_env), groups=groups,
            daemon_metrics=args.prometheus,
        ) as cluster:  # fmt: skip
            nemesis = Nemesis(cluster, kinds, args.seed, emit, partitions=partitions, workers=args.workers)
            nemesis.record = open(workdir / "faults.jsonl", "a", buffering=1)  # noqa: SIM115 - closed below
            nemesis.hold = (args.hold[0], args.hold[1])
            evictions = Evictions(cluster, workdir / "history-evictions.jsonl")
            prometheus = Prometheus(workdir, cluster.master_admin, cluster.daemon_metrics) if args.prometheus else None
            began = time.time()
            stop_at = time.monotonic() + seconds
            ctx = mp.get_context("spawn")
            procs = []
            for w in range(args.workers):
                kind = "async" if w % 2 else "sync"
                path = workdir / f"history-w{w}.jsonl"
                procs.append(ctx.Process(target=worker, daemon=True, args=(
                    f"w{w}", cluster.master_address, args.seed, stop_at, keys, str(path), kind, 4, transport_of(w),
                    args.client_timeout, None if groups is None else worker_gid(w), modes, args.replicas,
                )))  # fmt: skip
            for p in procs:
                p.start()
            rec = Recorder(workdir / "history-operator.jsonl", "operator")
            quiet = threading.Event()
            op_rng = random.Random(f"operator-{args.seed}")
            threads = [
                threading.Thread(
                    target=nemesis.run, args=(max(5.0, args.calm), args.interval, stop_at - 5.0), daemon=True
                ),
                threading.Thread(target=evictions.run, daemon=True),
                threading.Thread(
                    target=operator, args=(cluster, nemesis, keys, rec, op_rng, quiet, args.evict_period), daemon=True
                ),  # fmt: skip (an interrupted run must not wait for it)
            ]
            for t in threads:
                t.start()
            for p in procs:
                p.join(max(1.0, stop_at - time.monotonic() + args.hang_s + 10))
            end_ns = time.monotonic_ns()
            for p in procs:
                if p.is_alive():  # hung past every timeout: its open op is judged a hang
                    p.kill()
                    p.join(10)
            quiet.set()
            nemesis.stop.set()
            evictions.stop.set()
            for t in threads[1:]:
                t.join(60)
            evictions.read()
            evictions.close()
            rec.close()
            history = load(workdir)
            logged = [r for r in history if r.get("op") == "evicted"]
            room = sum(r["reason"] in ("lru", "demotion_failed") for r in logged)
            dropped = evictions.total("kvstore_demotions_failed_total")
            nemesis.record.close()
            # Every eviction is in the history (a full disk makes its tier smaller: the master evicts for
            # room, for real), so a miss is a loss unless one explains it; were the logs not whole, only
            # pinned puts could be held to that.
            whole = evictions.whole()
            verdict = check(history, nemesis.faults, hang_s=args.hang_s, end_ns=end_ns, grace_s=args.grace_s,
                            lru_evictions=not whole, cached_lag_s=args.cached_lag_s)  # fmt: skip
            worst, by_kind = unavailability(history, nemesis.faults)
            alerts: dict[str, Any] = {"skipped": "no prometheus (Debian: apt install prometheus)"}
            if prometheus is not None:
                # The cluster is whole and idle: alerts of the last faults get time to resolve.
                time.sleep(args.settle)
                firing = prometheus.firing(began, time.time())
                calm = (began + 10.0, began + args.calm) if args.calm > 10 else None  # 10 s: the first scrapes
                alerts = judge_alerts(firing, nemesis.faults, calm)
                prometheus.stop()
            nemesis.released.set()
            threads[0].join(60)
            faults: dict[str, int] = {}
            for f in nemesis.faults:
                faults[f["kind"]] = faults.get(f["kind"], 0) + 1
            durations = [r["t1"] - r["t0"] for r in history if "begin" not in r]
            return {
                "bench": "chaos", "seed": args.seed, "minutes": args.minutes, "ops": verdict.ops, "ok": verdict.ok,
                "violations": len(verdict.violations), "by_kind": dict(verdict.by_kind),
                "first": verdict.violations[: args.show], "misses_in_faults": verdict.misses_in_faults,
                "own_exists_in_faults": verdict.own_exists_in_faults, "put_modes": modes,
                "puts_by_mode": verdict.puts_by_mode, "cached_misses_in_lag": verdict.cached_misses_in_lag,
                "faults": faults, "replicas": args.replicas, "max_unavailable_s": worst, "unavailable_s": by_kind,
                "get_p99_ms": get_p99_ms(history, nemesis.faults), "read_max_s": longest_reads(history, nemesis.faults),
                "max_op_s": round(max(durations, default=0) / 1e9, 3),
                "evictions_for_room": room, "demotions_failed": dropped, "eviction_log_whole": whole,
                "nemesis_error": nemesis.error,
                "workers": args.workers,
                "alerts": alerts, "faults_skipped": skipped,
            }  # fmt: skip
    finally:
        if partitions is not None:
            partitions.remove()
        if disks is not None:
            disks.remove()
        if args.keep:
            emit({"kept": str(etcd.dir)})
            etcd.stop()
        else:
            etcd.remove()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Chaos with a checker: a mixed load judged while processes fail.")
    parser.add_argument("--json", action="store_true", help="JSON lines (the only output form)")
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", default=",".join(FAULTS),
                        help=f"comma-separated, of {', '.join(FAULTS)} (each once a round); '' for none")  # fmt: skip
    parser.add_argument("--interval", type=float, default=8.0, help="mean seconds between faults")
    parser.add_argument("--workers", type=int, default=4, help="client processes (odd ones async, 4 tasks each)")
    parser.add_argument("--keys", type=int, default=160, help="the key space")
    parser.add_argument("--dram", default="4MiB", help="each daemon's DRAM")
    parser.add_argument("--ssd", default="40MiB", help="each daemon's SSD (the key space must fit one node)")
    parser.add_argument("--client-timeout", type=float, default=5.0, help="the clients' timeout_s")
    parser.add_argument("--replicas", type=int, default=1, choices=range(1, 4), metavar="1..3",
                        help="the clients' default replicas of a put (three daemons)")  # fmt: skip
    parser.add_argument("--hang-s", type=float, default=60.0, help="an op running longer than this hung")
    parser.add_argument("--grace-s", type=float, default=3.0,
                        help="a miss this long after a fault healed is unavailability, not a loss")  # fmt: skip
    parser.add_argument("--evict-period", type=float, default=4.0, help="mean seconds between operator evictions")
    parser.add_argument("--show", type=int, default=5, help="violations printed in full")
    parser.add_argument("--hold", type=lambda v: [float(x) for x in v.split(",")], default=[3.0, 6.0],
                        metavar="MIN,MAX", help="seconds a fault lasts, drawn between the two")  # fmt: skip
    parser.add_argument("--calm", type=float, default=60.0,
                        help="seconds of load before the first fault, in which no alert may fire")  # fmt: skip
    parser.add_argument(
        "--prometheus",
        type=lambda v: v != "no",
        default=shutil.which("prometheus") is not None,
        metavar="auto|no",
        help="run Prometheus with docker/prometheus/alerts.yml (auto: when installed)",
    )
    parser.add_argument("--settle", type=float, default=0.0,
                        help="seconds to wait after the load for the last faults' alerts to resolve")  # fmt: skip
    parser.add_argument("--cluster-env", action="append", default=[], metavar="K=V",
                        help="an environment variable for the cluster's processes (repeatable)")  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the work directory (histories, logs)")
    parser.add_argument(
        "--put-modes",
        type=put_modes,
        default="visible,cached",
        help="each put in one of these modes, drawn (the checker judges each by its own rules)",
    )
    parser.add_argument("--cached-lag-s", type=float, default=1.0,
                        help="how long after its answer a cached put may stay unseen by reads (calm)")  # fmt: skip
    args = parser.parse_args(argv)

    def emit(line: dict[str, Any]) -> None:
        print(json.dumps(line), flush=True)

    emit(run(args, emit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
