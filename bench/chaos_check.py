"""The checker of ``bench.chaos``: judges a history of operations against a cache's promises.

A history is a list of records, one per operation (dicts, as the chaos workers write them):

- ``{"op": "put", "key", "v", "pin", "mode", "t0", "t1", "ok", "res": "stored"|"exists", "err"}``:
  ``v`` names the value (its bytes are made from the key and ``v``, see :func:`value_bytes`);
  ``mode`` the put's ("visible", the default, or "cached": see :func:`check`);
- ``{"op": "get"|"get_many", "key", "res": value id | None | "bad:<why>"}``: one record per key
  read (a batch's records share its times); ``bad:`` when the bytes were no put's bytes;
- ``{"op": "exists", "key", "res": bool}``, ``{"op": "remove", "key", "res": bool}``;
- ``{"op": "evict", "key", "res": n}``: an operator's eviction of one key (``n`` blocks evicted);
- ``{"op": "evicted", "key", "reason"}``: an eviction in a master's log (``w`` names the master
  process, ``n`` the log's number; ``t0``..``t1`` when it may have happened): not an operation;
- ``{"op": "match", "keys", "res": n}``; and ``{"begin": n, "w", "t0"}`` before each worker's op
  ``n`` (an op begun and never ended hung).

Every record has ``w`` (the worker), ``n`` (its op number), ``t0``/``t1`` (CLOCK_MONOTONIC, ns:
one clock for every process of the host), ``ok`` and, when it failed, ``err`` ("Type: message",
and ``expected``: whether it was one of the store's typed errors).

What it checks (a violation names the rule, the record and why):

- ``wrong_bytes``: a read returned bytes that are no put's bytes of that key;
- ``unknown_value`` / ``value_from_future`` / ``value_of_exists_put``: a read returned the value
  of no put of that key, of one that began after the read ended, or of one answered EXISTS
  (which writes nothing) outside any fault (during one, an attempt of the put may have landed
  while its answer was lost: ``own_exists_in_faults``, PutStatus.EXISTS says so);
- ``read_after_remove``: a read that began after a remove of its key was acknowledged returned
  a value whose put ended before that remove began (an eviction promises no such thing: the
  daemons drop evicted blocks in the background);
- ``lost``: a read began after a put of its key was acknowledged STORED and missed, with no
  remove or eviction of the key that could explain it (one that began before the read ended
  and ended after the put began, acknowledged or not; the masters' logged evictions count);
  with ``lru_evictions`` (evictions happened that the history may lack) only pinned puts count.
  EXISTS promises nothing of its own (the key is stored, or another put of it is being
  written). A miss while a fault is on, or within ``grace_s`` of its healing, is unavailability
  (``misses_in_faults``), not a loss: a loss is a miss once the cluster is whole again;
- ``hang``: an op that ran longer than ``hang_s``, or began and never ended;
- ``unexpected_error``: an op failed with something other than the store's typed errors.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

READS = ("get", "get_many")
REMOVALS = ("remove", "evict", "evicted")


def value_bytes(key: str, vid: str, size: int) -> bytes:
    """The bytes of value ``vid`` of ``key``: a header naming both and the size, repeated."""
    head = f"{key}|{vid}|{size}#".encode()
    return (head * (size // len(head) + 1))[:size]


def read_value(key: str, data: bytes | None) -> str | None:
    """The value id of ``data`` read for ``key`` (None for a miss), or ``bad:<why>`` when its
    bytes are not exactly some value's bytes of that key (checked by content, every byte)."""
    if data is None:
        return None
    head, sep, _ = bytes(data[:256]).partition(b"#")
    parts = head.decode(errors="replace").split("|")
    if not sep or len(parts) != 3 or not parts[2].isdigit():
        return f"bad:no header in {len(data)} bytes"
    got_key, vid, size = parts[0], parts[1], int(parts[2])
    if got_key != key:
        return f"bad:bytes of key {got_key!r}"
    if len(data) != size or data != value_bytes(key, vid, size):
        return f"bad:bytes of {vid} altered ({len(data)} of {size} bytes)"
    return vid


@dataclass
class Verdict:
    ops: int = 0
    ok: int = 0
    violations: list[dict[str, Any]] = field(default_factory=list)
    by_kind: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    misses_in_faults: int = 0
    """Reads that missed an acknowledged put while a fault was on (or just healed)."""
    own_exists_in_faults: int = 0
    """Reads of a put's bytes that it answered EXISTS, the put running while a fault was on."""
    cached_misses_in_lag: int = 0
    """Other clients' reads that missed a cached put within ``cached_lag_s`` of its answer (allowed)."""
    puts_by_mode: dict[str, int] = field(default_factory=dict)
    """Acknowledged puts, by mode."""

    def add(self, kind: str, record: dict[str, Any], why: str) -> None:
        self.by_kind[kind] += 1
        self.violations.append({"kind": kind, "why": why, "op": record})


def _may_remove(r: dict[str, Any]) -> bool:
    """Whether ``r`` may have taken its key away: a remove however it ended, a master's logged
    eviction; an operator's eviction unless it was answered with nothing evicted."""
    return r["op"] in ("remove", "evicted") or (r["op"] == "evict" and not (r.get("ok") and r.get("res") == 0))


class _Latest:
    """Records ordered by one of their times; of those before a given time, the one whose other time
    is the greatest (a prefix maximum: each question is one binary search)."""

    def __init__(self, records: Iterable[dict[str, Any]], by: str, most: str) -> None:
        ordered = sorted(records, key=lambda r: r[by])
        self.times = [r[by] for r in ordered]
        self.best: list[dict[str, Any]] = []
        for r in ordered:
            self.best.append(r if not self.best or r[most] > self.best[-1][most] else self.best[-1])

    def before(self, t: int) -> dict[str, Any] | None:
        i = bisect.bisect_left(self.times, t)
        return self.best[i - 1] if i else None


def check(
    history: Iterable[dict[str, Any]], faults: Sequence[dict[str, Any]] = (), *, hang_s: float = 60.0,
    end_ns: int | None = None, grace_s: float = 3.0, lru_evictions: bool = False, cached_lag_s: float = 1.0,
) -> Verdict:  # fmt: skip
    """Judge ``history``; ``faults``: the nemesis's (``kind``, ``t0``, ``t1``: injected, healed);
    ``end_ns``: when the run ended (an op begun ``hang_s`` before it and never ended hung).

    A put of ``mode`` "cached" is judged by its own rules: its writer's gets (the same worker: one
    client) may not miss it from its answer on, like a visible one; its writer's ``exists`` (the
    master's answer) and another client only from its commit, which the checker allows to come
    ``cached_lag_s`` after the answer, or, when a fault was on meanwhile, ``cached_lag_s`` after
    the fault healed (plus ``grace_s``): the daemon retries the commit until a master takes it. A
    miss sooner is counted (``cached_misses_in_lag``), and a remove that began before the commit
    may come before it: the key then holds the cached put's value (a client that needs the order
    flushes first)."""
    lag = int(cached_lag_s * 1e9)
    windows = sorted((f["t0"], f["t1"] + int(grace_s * 1e9)) for f in faults)
    records = [r for r in history if "begin" not in r]
    begins = [r for r in history if "begin" in r]
    ops = [r for r in records if r["op"] != "evicted"]
    verdict = Verdict(ops=len({(r["w"], r["n"]) for r in ops}))
    verdict.ok = len({(r["w"], r["n"]) for r in ops if r.get("ok")})
    puts: dict[str, dict[str, Any]] = {}
    stored: dict[str, list[dict[str, Any]]] = defaultdict(list)
    removals: dict[str, list[dict[str, Any]]] = defaultdict(list)
    own: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["op"] == "put":
            puts[r["v"]] = r
            r["tv"] = _visible_at(r, windows, lag)  # seen by every client from then on
            if r.get("ok"):
                mode = r.get("mode", "visible")
                verdict.puts_by_mode[mode] = verdict.puts_by_mode.get(mode, 0) + 1
            if r.get("ok") and r.get("res") == "stored" and (r.get("pin") or not lru_evictions):
                stored[r["key"]].append(r)
                own[r["key"], r["w"]].append(r)
        elif r["op"] in REMOVALS and _may_remove(r):
            removals[r["key"]].append(r)
    # A miss is a loss when the acknowledged put that began last before it is explained by no removal
    # (one that explains a put explains every put that began earlier): that put, and the removal
    # that ended last of those begun before the read ended. A value read is stale when a remove
    # acknowledged before the read began, and begun after the value's put ended, exists: the one
    # acknowledged before the read that began last.
    last_put = {k: _Latest(v, "tv", "t0") for k, v in stored.items()}
    last_own_put = {k: _Latest(v, "t1", "t0") for k, v in own.items()}
    unlagged = {k: _Latest(v, "t1", "t0") for k, v in stored.items()}  # cached puts from their answer
    last_removal = {k: _Latest(v, "t0", "t1") for k, v in removals.items()}
    last_remove = {
        k: _Latest([rm for rm in v if rm["op"] == "remove" and rm.get("ok")], "t1", "t0") for k, v in removals.items()
    }
    ended = {(r["w"], r["n"]) for r in records}
    for b in begins:
        if (b["w"], b["begin"]) not in ended and (end_ns is None or end_ns - b["t0"] > hang_s * 1e9):
            verdict.add("hang", b, "began and never ended")
    for r in records:
        if r["t1"] - r["t0"] > hang_s * 1e9:
            verdict.add("hang", r, f"took {(r['t1'] - r['t0']) / 1e9:.1f} s")
        if not r.get("ok") and not r.get("expected", True):
            verdict.add("unexpected_error", r, str(r.get("err")))
        if not r.get("ok") or r["op"] not in (*READS, "exists"):
            continue
        key, res = r["key"], r["res"]
        if res is None or res is False:
            put = last_put[key].before(r["t0"]) if key in last_put else None
            # The writer gets its cached put at once (from its node); exists asks the master, as others do.
            writer_gets = r["op"] in READS and (key, r["w"]) in last_own_put
            mine = last_own_put[key, r["w"]].before(r["t0"]) if writer_gets else None
            if mine is not None and (put is None or mine["t0"] > put["t0"]):
                put = mine
            early = unlagged[key].before(r["t0"]) if key in unlagged else None
            rm = last_removal[key].before(r["t1"]) if key in last_removal else None
            if put is not None and (rm is None or rm["t1"] <= put["t0"]):
                _miss(verdict, r, put, windows)
            elif early is not None and early is not put and (rm is None or rm["t1"] <= early["t0"]):
                verdict.cached_misses_in_lag += 1  # another client's cached put, not yet past its lag
        elif res is True:
            continue  # exists: True says nothing of which value
        elif res.startswith("bad:"):
            verdict.add("wrong_bytes", r, res[4:])
        else:
            _check_value(verdict, r, puts.get(res), last_remove.get(key), windows)
    return verdict


def _check_value(
    verdict: Verdict, r: dict[str, Any], put: dict[str, Any] | None, removes: _Latest | None,
    windows: Sequence[tuple[int, int]],
) -> None:  # fmt: skip
    if put is None or put["key"] != r["key"]:
        verdict.add("unknown_value", r, f"value {r['res']} was put by no one under {r['key']!r}")
        return
    if put["t0"] > r["t1"]:
        verdict.add("value_from_future", r, f"its put began {(put['t0'] - r['t1']) / 1e6:.1f} ms after the read ended")
    elif put.get("ok") and put.get("res") == "exists":
        if any(a < put["t1"] and put["t0"] < b for a, b in windows):
            verdict.own_exists_in_faults += 1  # an attempt of it landed, its answer lost to the fault
        else:
            verdict.add("value_of_exists_put", r, f"put {put['v']} answered EXISTS: it wrote nothing")
    elif put.get("ok") and removes is not None:
        rm = removes.before(r["t0"])
        if rm is not None and put["tv"] < rm["t0"]:
            verdict.add(
                "read_after_remove", r,
                f"remove by {rm['w']} (acknowledged {(r['t0'] - rm['t1']) / 1e6:.1f} ms before this read began) "
                f"came after {put.get('mode', 'visible')} put {put['v']} ended",
            )  # fmt: skip


def _visible_at(put: dict[str, Any], windows: Sequence[tuple[int, int]], lag: int) -> int:
    """When every client may be held to see ``put``: its answer for a visible put; for a cached one,
    ``lag`` after its answer, pushed past every fault window (with its grace) that the lag meets."""
    if put.get("mode") != "cached":
        return int(put["t1"])
    at = put["t1"] + lag
    for a, b in windows:  # sorted by start
        if a < at and b > put["t1"]:
            at = max(at, b + lag)
    return int(at)


def _miss(verdict: Verdict, r: dict[str, Any], put: dict[str, Any], windows: Sequence[tuple[int, int]]) -> None:
    """A miss no removal explains: a loss, or unavailability while a fault was on."""
    if any(a < r["t1"] and r["t0"] < b for a, b in windows):
        verdict.misses_in_faults += 1
        return
    verdict.add(
        "lost", r,
        f"put {put['v']}{' (pinned)' if put.get('pin') else ''}{' (cached)' if put.get('mode') == 'cached' else ''}"
        " was acknowledged "
        f"{(r['t0'] - put['t1']) / 1e6:.1f} ms before this read began; no remove or eviction since",
    )  # fmt: skip


def fault_class(fault: dict[str, Any]) -> str:
    """A fault's kind, split by what it hit where that changes who must answer for it: a SIGSTOP of
    the leading master (``sigstop_leader``) or of a daemon (``sigstop_daemon``); a partition of a
    daemon from the masters (``partition_daemon``) or of a client from a daemon (``partition_client``)."""
    kind, target = fault["kind"], str(fault.get("target", ""))
    if kind == "sigstop":
        return "sigstop_leader" if target.startswith("master") else "sigstop_daemon"
    if kind == "partition":
        return "partition_daemon" if target.endswith("|masters") else "partition_client"
    return str(kind)


def get_p99_ms(history: Iterable[dict[str, Any]], faults: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """The p99 latency (ms) of the reads (get and get_many, a batch once) that overlapped no fault
    (``calm``) and of those that overlapped one (``faults``, from its start until it healed); None
    where there were none."""
    spans = sorted((f["t0"], f["t1"]) for f in faults)
    starts = [a for a, _ in spans]
    calm: list[int] = []
    hit: list[int] = []
    seen: set[tuple[Any, Any]] = set()
    for r in history:
        if r.get("op") not in ("get", "get_many") or "begin" in r or not r.get("ok") or (r["w"], r["n"]) in seen:
            continue
        seen.add((r["w"], r["n"]))
        t0, t1 = r["t0"], r["t1"]
        i = bisect.bisect_right(starts, t1)  # faults that began before the read ended: any still on at t0?
        overlaps = any(b >= t0 for _, b in spans[max(0, i - 8) : i])  # faults are apart: a few suffice
        (hit if overlaps else calm).append(t1 - t0)

    def p99(values: list[int]) -> float | None:
        if not values:
            return None
        values.sort()
        return round(values[min(len(values) - 1, int(len(values) * 0.99))] / 1e6, 2)

    return {"calm": p99(calm), "faults": p99(hit)}


def longest_reads(history: Iterable[dict[str, Any]], faults: Sequence[dict[str, Any]]) -> dict[str, float]:
    """By fault class (:func:`fault_class`), the longest read (get or get_many, answered or failed)
    that overlapped a fault of that class (seconds): what a fault costs a reader, apart from the
    writers that wait on a frozen node (which :func:`unavailability` counts too)."""
    spans = sorted((f["t0"], f["t1"], fault_class(f)) for f in faults)
    starts = [a for a, _, _ in spans]
    worst: dict[str, float] = {}
    for r in history:
        if r.get("op") not in ("get", "get_many") or "begin" in r:
            continue
        t0, t1 = r["t0"], r["t1"]
        i = bisect.bisect_right(starts, t1)
        for _, b, kind in spans[max(0, i - 8) : i]:
            if b >= t0:
                worst[kind] = round(max(worst.get(kind, 0.0), (t1 - t0) / 1e9), 3)
    return worst


def unavailability(
    history: Iterable[dict[str, Any]], faults: Sequence[dict[str, Any]]
) -> tuple[float, dict[str, float]]:
    """The longest stretch with no successful operation (seconds) from each fault's start until the
    first success after it healed: overall, and the worst by fault class (:func:`fault_class`)."""
    done = sorted(r["t1"] for r in history if "begin" not in r and r.get("ok"))
    worst: dict[str, float] = {}
    for f in faults:
        a, b = f["t0"], f["t1"]
        i = bisect.bisect_left(done, a)
        j = bisect.bisect_right(done, b)
        points = [a, *done[i:j]]
        if j < len(done):
            points.append(done[j])
        gap = max((q - p for p, q in itertools.pairwise(points)), default=0) / 1e9
        kind = fault_class(f)
        worst[kind] = round(max(worst.get(kind, 0.0), gap), 3)
    return max(worst.values(), default=0.0), worst


_SHARED = ("w", "op", "key", "mode", "res", "v", "reason", "node")
"""Fields whose strings repeat across records: one object each (an hour's history is ~13 M records)."""


def load(directory: str | Path) -> list[dict[str, Any]]:
    """The records of the ``history-*.jsonl`` files in ``directory`` (a run kept with ``--keep``),
    read a line at a time and kept small: a ``begin`` record only for an op that never ended (the
    only ones :func:`check` looks at), a batch's ``keys`` left out (each of its keys has its own
    record), repeated strings shared."""
    out: list[dict[str, Any]] = []
    intern = sys.intern
    for path in sorted(Path(directory).glob("history-*.jsonl")):
        begun: dict[tuple[str, int], dict[str, Any]] = {}  # a writer's begin line comes before its record
        with path.open() as lines:
            for line in lines:
                if not line.strip():
                    continue
                r = json.loads(line)
                for name in _SHARED:
                    value = r.get(name)
                    if type(value) is str:
                        r[name] = intern(value)
                if "begin" in r:
                    begun[r["w"], r["begin"]] = r
                    continue
                r.pop("keys", None)
                begun.pop((r["w"], r.get("n")), None)
                out.append(r)
        out.extend(begun.values())
    return out


def main(argv: list[str] | None = None) -> int:
    """Judge the histories of a kept run again: ``python -m bench.chaos_check DIR [--lru-evictions]``."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("directory")
    parser.add_argument("--lru-evictions", action="store_true", help="evictions for room happened: hold only pins")
    parser.add_argument("--hang-s", type=float, default=60.0)
    parser.add_argument("--cached-lag-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    faults_file = Path(args.directory) / "faults.jsonl"
    faults = [json.loads(line) for line in faults_file.read_text().splitlines()] if faults_file.exists() else []
    verdict = check(load(args.directory), faults, hang_s=args.hang_s, lru_evictions=args.lru_evictions,
                    cached_lag_s=args.cached_lag_s)  # fmt: skip
    for v in verdict.violations:
        print(json.dumps(v))
    print(json.dumps({"ops": verdict.ops, "ok": verdict.ok, "violations": len(verdict.violations),
                      "by_kind": dict(verdict.by_kind), "misses_in_faults": verdict.misses_in_faults,
                      "own_exists_in_faults": verdict.own_exists_in_faults}))  # fmt: skip
    return 1 if verdict.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
