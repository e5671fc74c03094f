"""bench/one_sided.py runs end to end for one tiny case: well-formed lines, the native TCP baseline, and for
each other transport either measured rows or a line saying why it could not run (figures are for bench runs)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.one_sided import TRANSPORTS
from transfer import native

pytestmark = pytest.mark.slow  # five transports, each a target and an initiator process: ~10 s

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not native.active(), reason=f"the native loops are not loaded ({native.reason})")
def test_one_sided_bench_prints_a_row_or_an_error_per_transport() -> None:
    args = ["--json", "--sizes", "65536", "--batches", "1", "--seconds", "0.2"]
    done = subprocess.run([sys.executable, "-m", "bench.one_sided", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines and all(line["bench"] == "one_sided" for line in lines)
    measured = [r for r in lines if "GBps" in r]
    for r in measured:
        assert r["GBps"] > 0 and r["verified"] is True, r
        assert (r["size"], r["batch"]) == (65536, 1)
    native_rows = {r["op"]: r for r in measured if r["transport"] == "native_tcp"}
    assert set(native_rows) == {"put", "get"}
    for transport in TRANSPORTS:
        ops = {r["op"] for r in measured if r["transport"] == transport}
        errors = [r["error"] for r in lines if r.get("transport") == transport and "error" in r]
        assert ops == {"put", "get"} or errors, f"{transport}: neither rows nor an error line"
        for r in measured:
            if r["transport"] == transport:
                assert r["baseline_GBps"] == native_rows[r["op"]]["GBps"]
