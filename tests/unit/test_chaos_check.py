"""The chaos checker judges histories: each promise it checks fails on a history that breaks it,
and a history that keeps them passes (with the fault windows and EXISTS answers it must allow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.chaos_check import (
    check,
    fault_class,
    get_p99_ms,
    load,
    longest_reads,
    read_value,
    unavailability,
    value_bytes,
)

MS = 1_000_000


def op(w: str, n: int, kind: str, t0: float, t1: float, **fields: Any) -> dict[str, Any]:
    return {"w": w, "n": n, "op": kind, "t0": int(t0 * MS), "t1": int(t1 * MS), "ok": True, **fields}


def put(n: int, key: str, t0: float, t1: float, res: str = "stored", w: str = "w0", **kw: Any) -> dict[str, Any]:
    return op(w, n, "put", t0, t1, key=key, v=f"{w}.{n}", res=res, **kw)


def get(n: int, key: str, t0: float, t1: float, res: str | None, w: str = "w1") -> dict[str, Any]:
    return op(w, n, "get", t0, t1, key=key, res=res)


def kinds(history: list[dict[str, Any]], **kw: Any) -> list[str]:
    return [v["kind"] for v in check(history, **kw).violations]


def test_bytes_are_judged_by_every_byte() -> None:
    data = value_bytes("k", "w0.1", 4096)
    assert read_value("k", data) == "w0.1" and read_value("k", None) is None
    flipped = bytearray(data)
    flipped[3000] ^= 1
    assert read_value("k", bytes(flipped)).startswith("bad:")  # type: ignore[union-attr]
    assert read_value("k", data[:4000]).startswith("bad:")  # type: ignore[union-attr]
    assert read_value("other", data) == "bad:bytes of key 'k'"
    assert read_value("k", b"\0" * 64) == "bad:no header in 64 bytes"


def test_a_history_that_keeps_every_promise_passes() -> None:
    history = [
        put(1, "k", 0, 1),
        get(1, "k", 2, 3, "w0.1"),
        put(2, "k", 4, 5, res="exists"),  # EXISTS: the key held a value
        op("w2", 1, "remove", 6, 7, key="k", res=True),
        get(2, "k", 8, 9, None),  # removed: a miss
        put(3, "k", 10, 11),
        get(3, "k", 10.5, 12, "w0.3"),  # in flight when read: allowed
        put(4, "j", 20, 21, res="exists", w="w3"),
        get(4, "j", 22, 23, None),  # EXISTS promises nothing of its own: another put may be in flight
    ]
    verdict = check(history)
    assert verdict.violations == [] and verdict.ops == 9 and verdict.ok == 9


def test_each_broken_promise_is_named() -> None:
    assert kinds([put(1, "k", 0, 1), get(1, "k", 2, 3, "bad:bytes of w0.1 altered")]) == ["wrong_bytes"]
    assert kinds([get(1, "k", 2, 3, "w9.9")]) == ["unknown_value"]
    assert kinds([put(1, "k", 5, 6), get(1, "k", 2, 3, "w0.1")]) == ["value_from_future"]
    assert kinds([put(1, "k", 0, 1, res="exists"), get(1, "k", 2, 3, "w0.1")]) == ["value_of_exists_put"]
    stale = [put(1, "k", 0, 1), op("w2", 1, "remove", 2, 3, key="k", res=True), get(1, "k", 4, 5, "w0.1")]
    assert kinds(stale) == ["read_after_remove"]
    assert kinds([put(1, "k", 0, 1), get(1, "k", 2, 3, None)]) == ["lost"]
    assert kinds([put(1, "k", 0, 1), op("w1", 1, "exists", 2, 3, key="k", res=False)]) == ["lost"]
    assert kinds([op("w1", 1, "get", 0, 70_000, key="k", res=None)], hang_s=60) == ["hang"]
    never = [{"begin": 1, "w": "w1", "t0": 0}]
    assert kinds(never, hang_s=60, end_ns=61_000 * MS) == ["hang"]
    failed = op("w1", 1, "get", 0, 1, key="k", ok=False, err="KeyError: 'x'", expected=False)
    assert kinds([failed]) == ["unexpected_error"]


def test_what_explains_a_miss_and_what_does_not() -> None:
    stored = put(1, "k", 0, 1)
    # A remove that began before the read ended explains it, acknowledged or not.
    cut = op("w2", 1, "remove", 1.5, 9, key="k", ok=False, err="Timeout: ...", expected=True)
    assert kinds([stored, cut, get(1, "k", 2, 3, None)]) == []
    # An operator's eviction explains a miss, unless it evicted nothing.
    evicted = op("operator", 1, "evict", 1.5, 1.6, key="k", res=1)
    assert kinds([stored, evicted, get(1, "k", 2, 3, None)]) == []
    nothing = op("operator", 1, "evict", 1.5, 1.6, key="k", res=0)
    assert kinds([stored, nothing, get(1, "k", 2, 3, None)]) == ["lost"]
    # ...and it does not make a later read of the value stale (the daemons drop in the background).
    assert kinds([stored, evicted, get(1, "k", 2, 3, "w0.1")]) == []
    # A remove after the read began does not.
    late = op("w2", 1, "remove", 4, 5, key="k", res=True)
    assert kinds([stored, late, get(1, "k", 2, 3, None)]) == ["lost"]
    # A miss while a fault is on (or just healed) is unavailability; the same miss later is a loss.
    fault = [{"kind": "daemon_kill", "t0": int(1.5 * MS), "t1": int(2.5 * MS)}]
    verdict = check([stored, get(1, "k", 2, 3, None)], fault, grace_s=0.001)
    assert verdict.violations == [] and verdict.misses_in_faults == 1
    assert kinds([stored, get(1, "k", 5, 6, None)], faults=fault, grace_s=0.001) == ["lost"]
    # An EXISTS put's bytes read: a violation, unless the put ran while a fault was on.
    exists_put = put(3, "e", 0, 1, res="exists")
    assert kinds([exists_put, get(3, "e", 2, 3, "w0.3")], faults=fault, grace_s=0.001) == ["value_of_exists_put"]
    during = check([put(4, "e", 1.6, 2, res="exists"), get(4, "e", 3, 4, "w0.4")], fault, grace_s=0.001)
    assert during.violations == [] and during.own_exists_in_faults == 1
    # A master's logged eviction explains a miss (and is no operation); one of another key, or one
    # logged before the put began, does not.
    logged = op("master-0.7", 1, "evicted", 1.2, 1.4, key="k", res=1, reason="lru")
    verdict = check([stored, logged, get(1, "k", 2, 3, None)])
    assert verdict.violations == [] and verdict.ops == 2
    other = op("master-0.7", 2, "evicted", 1.2, 1.4, key="j", res=1, reason="lru")
    assert kinds([stored, other, get(1, "k", 2, 3, None)]) == ["lost"]
    before = op("master-0.7", 3, "evicted", -2, -1, key="k", res=1, reason="lru")
    assert kinds([stored, before, get(1, "k", 2, 3, None)]) == ["lost"]
    # Where the log may lack evictions for room, only pinned puts must stay.
    pinned = put(2, "p", 0, 1, pin=True)
    assert kinds([stored, pinned, get(1, "k", 2, 3, None), get(2, "p", 2, 3, None)], lru_evictions=True) == ["lost"]


def test_unavailability_is_the_longest_gap_from_a_fault_until_the_first_success_after_it() -> None:
    seconds = 1000  # op() takes milliseconds
    history = [get(i, "k", t * seconds, t * seconds + 100, None) for i, t in enumerate([0, 1, 5, 6, 20])]
    history.append({**get(9, "k", 3 * seconds, 3 * seconds + 1, None), "ok": False, "expected": True})
    faults = [{"kind": "leader_kill", "t0": int(1.5 * seconds * MS), "t1": int(2 * seconds * MS)}]
    worst, by_kind = unavailability(history, faults)
    assert by_kind == {"leader_kill": 3.6} and worst == 3.6  # from 1.5 s to the success at 5.1 s


def test_unavailability_and_alerts_split_sigstops_and_partitions_by_what_they_hit() -> None:
    faults_hit = [
        ("sigstop", "master-1"), ("sigstop", "daemon-2"), ("partition", "daemon-0|masters"),
        ("partition", "w3|daemon-1"), ("leader_kill", "master-0"), ("daemon_kill", "daemon-1"),
    ]  # fmt: skip
    assert [fault_class({"kind": k, "target": t}) for k, t in faults_hit] == [
        "sigstop_leader", "sigstop_daemon", "partition_daemon", "partition_client", "leader_kill", "daemon_kill",
    ]  # fmt: skip
    history = [get(0, "k", 0, 100, None), get(1, "k", 5000, 5100, None)]
    faults = [{"kind": "sigstop", "target": "daemon-0", "t0": 1000 * MS, "t1": 2000 * MS}]
    assert unavailability(history, faults)[1] == {"sigstop_daemon": 4.1}


def test_read_p99_is_split_into_calm_and_fault_windows() -> None:
    history = [get(i, "k", i * 10, i * 10 + 1, None) for i in range(100)]  # 1 ms each, calm
    history += [get(100 + i, "k", 2000 + i, 2000 + i + 50, None) for i in range(10)]  # 50 ms, in the fault
    history.append({**get(200, "k", 2001, 2900, None), "ok": False})  # failed reads are not timed
    batch = [{**get(300, k, 1000, 1003, None), "op": "get_many"} for k in ("a", "b", "c")]  # one batch: once
    faults = [{"kind": "daemon_kill", "t0": 1990 * MS, "t1": 2100 * MS}]
    assert get_p99_ms(history + batch, faults) == {"calm": 1.0, "faults": 50.0}  # 101 calm reads: the batch is 1
    assert get_p99_ms(history[:100], []) == {"calm": 1.0, "faults": None}
    assert get_p99_ms(history[:10] + batch, []) == {"calm": 3.0, "faults": None}


def test_the_longest_read_in_a_fault_is_kept_by_its_class_failed_or_not() -> None:
    history = [get(0, "k", 0, 900, None)]  # calm: not counted, however long
    history.append({**get(1, "k", 1500, 1700, None), "ok": False})  # failed after 0.2 s: counted
    history.append(get(2, "k", 1900, 2050, None))  # began before the fault ended
    history.append({"w": "w0", "n": 7, "op": "put", "key": "k", "t0": 1000 * MS, "t1": 9000 * MS, "ok": True})
    faults = [
        {"kind": "sigstop", "target": "daemon-1", "t0": 1000 * MS, "t1": 2000 * MS},
        {"kind": "leader_kill", "target": "master-0", "t0": 5000 * MS, "t1": 6000 * MS},
    ]
    assert longest_reads(history, faults) == {"sigstop_daemon": 0.2}


def test_cached_puts_are_judged_by_their_own_rules() -> None:
    lag = {"cached_lag_s": 0.010}  # 10 ms
    cached = put(1, "k", 0, 1, mode="cached")
    # Another client may miss it within the lag (counted), not after it.
    verdict = check([cached, get(1, "k", 2, 3, None)], **lag)
    assert verdict.violations == [] and verdict.cached_misses_in_lag == 1
    assert verdict.puts_by_mode == {"cached": 1}
    assert kinds([cached, get(1, "k", 12, 13, None)], **lag) == ["lost"]
    # Its writer may not miss it at all: it reads its cached put at once.
    assert kinds([cached, get(1, "k", 2, 3, None, w="w0")], **lag) == ["lost"]
    # A visible put is seen by everyone from its answer.
    assert kinds([put(2, "v", 0, 1), get(2, "v", 2, 3, None)], **lag) == ["lost"]
    # A remove that began within the lag may come before its commit: the value read after it is no
    # stale read; a remove that began after the lag is, as for a visible put.
    early = op("w2", 1, "remove", 5, 6, key="k", res=True)
    assert kinds([cached, early, get(1, "k", 7, 8, "w0.1")], **lag) == []
    late = op("w2", 1, "remove", 20, 21, key="k", res=True)
    assert kinds([cached, late, get(1, "k", 22, 23, "w0.1")], **lag) == ["read_after_remove"]
    # Never other bytes, in either mode.
    assert kinds([cached, get(1, "k", 2, 3, "bad:bytes of w0.1 altered")], **lag) == ["wrong_bytes"]


def test_a_cached_put_whose_commit_a_fault_delays_is_held_to_it_once_the_fault_healed() -> None:
    lag = {"cached_lag_s": 0.010, "grace_s": 0.005}
    fault = [{"kind": "leader_kill", "t0": int(0.5 * MS), "t1": int(40 * MS)}]
    cached = put(1, "k", 0, 1, mode="cached")
    # The master was down: the commit waits for the next one; a remove meanwhile may come first.
    remove = op("w2", 1, "remove", 30, 31, key="k", res=True)
    assert kinds([cached, remove, get(1, "k", 32, 33, "w0.1")], faults=fault, **lag) == []
    assert kinds([cached, get(1, "k", 50, 51, None)], faults=fault, **lag) == []  # healed 10 ms ago: still lag
    # Once the fault healed and the lag passed, the usual rules.
    assert kinds([cached, get(1, "k", 60, 61, None)], faults=fault, **lag) == ["lost"]
    late = op("w2", 1, "remove", 60, 61, key="k", res=True)
    assert kinds([cached, late, get(1, "k", 62, 63, "w0.1")], faults=fault, **lag) == ["read_after_remove"]
    # A visible put is not excused by a fault: its remove is ordered after it.
    visible = put(2, "v", 0, 1)
    rm = op("w2", 2, "remove", 30, 31, key="v", res=True)
    assert kinds([visible, rm, get(2, "v", 32, 33, "w0.2")], faults=fault, **lag) == ["read_after_remove"]


def test_a_writers_exists_asks_the_master_and_may_miss_its_cached_put_within_the_lag() -> None:
    lag = {"cached_lag_s": 0.010}
    cached = put(1, "k", 0, 1, mode="cached")
    asked = op("w0", 2, "exists", 2, 3, key="k", res=False)
    assert kinds([cached, asked], **lag) == []
    assert kinds([cached, op("w0", 2, "exists", 20, 21, key="k", res=False)], **lag) == ["lost"]


def test_a_kept_history_loads_small_and_judges_the_same(tmp_path: Path) -> None:
    """An hour's history is ~27 M lines: load keeps a begin only for an op that never ended, and
    leaves a batch's key list out (each key has its record)."""
    lines = [
        {"begin": 1, "w": "w0", "t0": 1},
        {"begin": 2, "w": "w0", "t0": 2},
        {"w": "w0", "n": 1, "op": "put", "t0": 1, "key": "k", "v": "w0.1", "pin": False, "mode": "visible",
         "res": "stored", "t1": 3, "ok": True},
        {"begin": 3, "w": "w0", "t0": 4},
        {"w": "w0", "n": 3, "op": "get_many", "t0": 4, "keys": ["k", "j"], "key": "k", "res": "w0.1", "t1": 5,
         "ok": True},
        {"w": "w0", "n": 3, "op": "get_many", "t0": 4, "keys": ["k", "j"], "key": "j", "res": None, "t1": 5,
         "ok": True},
    ]  # fmt: skip
    (tmp_path / "history-w0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    history = load(tmp_path)
    assert [r.get("begin") for r in history if "begin" in r] == [2]  # began and never ended
    assert all("keys" not in r for r in history) and len(history) == 4
    verdict = check(history, end_ns=10**12)
    assert verdict.ops == 2 and verdict.ok == 2 and dict(verdict.by_kind) == {"hang": 1}
