"""bench/hedge.py runs end to end for a short case: every row of both faces, no key missed (the bench
asserts each get finds its key), hedging off as the baseline of the paused row with it on."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a cluster and eight short rows: ~15 s

ROOT = Path(__file__).resolve().parents[2]


def test_hedge_bench_prints_every_row_with_its_baseline() -> None:
    args = ["--json", "--seconds", "0.5", "--keys", "200"]
    done = subprocess.run([sys.executable, "-m", "bench.hedge", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert {(r["face"], r["paused"], r["hedge_reads"]) for r in rows} == {
        (face, paused, hedge) for face in ("sync", "async") for paused in (False, True) for hedge in (False, True)
    }
    for r in rows:
        assert r["gets_per_s"] > 0 and r["p50_ms"] <= r["p99_ms"] <= r["p999_ms"] <= r["max_ms"], r
        assert r["hedged"] == 0 or r["hedge_reads"], r  # hedging off hedges nothing
        if r["paused"] and r["hedge_reads"]:
            baseline = next(b for b in rows if (b["face"], b["paused"], b["hedge_reads"]) == (r["face"], True, False))
            assert r["baseline_p999_ms"] == baseline["p999_ms"] and r["p999_ratio"] > 0
