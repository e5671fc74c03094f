"""``kvstore simulate`` and ``bench.conductor`` end to end on a small generated trace (figures are for bench runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import conductor
from kvstore.workload import chat_workload

REPO = Path(__file__).resolve().parents[2]


def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    with path.open("w") as fh:
        for r in chat_workload(num_sessions=60, seed=5):
            row = {"timestamp": r.timestamp_ms, "input_length": r.input_length, "output_length": r.output_length,
                   "hash_ids": list(r.hash_ids)}  # fmt: skip
            fh.write(json.dumps(row) + "\n")
    return path


def kvstore(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore_cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)  # fmt: skip


def test_simulate_prints_a_line_per_scheduler_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    trace = trace_file(tmp_path)
    plot = tmp_path / "rates.png"
    out = kvstore("simulate", str(trace), "--json", "--prefill", "4", "--decode", "2", "--early-rejection",
                  "--layers", "40", "--plot", str(plot), "--speeds", "1", "4")  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["scheduler"] for r in rows] == ["random", "load", "local", "global"]
    for r in rows:
        for key in ("mean_ttft_s", "p90_ttft_s", "mean_tbt_s", "p90_tbt_s", "slo_attainment", "hit_rate", "rejected"):
            assert key in r
        assert r["early_rejection"] and r["prefill"] == 4 and r["decode"] == 2
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    one = kvstore("simulate", str(trace), "--scheduler", "global", "--json")
    assert [json.loads(line)["scheduler"] for line in one.stdout.splitlines()] == ["global"]


def test_simulate_rejects_bad_input(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": -1, "hash_ids": []}\n')
    for args in (["simulate", str(bad)], ["simulate", str(tmp_path / "none.jsonl")],
                 ["simulate", str(trace_file(tmp_path)), "--prefill", "0"],
                 ["simulate", str(trace_file(tmp_path)), "--mfu", "0"]):  # fmt: skip
        out = kvstore(*args)
        assert out.returncode == 2 and "error:" in out.stderr, (args, out.stderr)


def test_conductor_bench_prints_every_op(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--json", "--trace", str(trace_file(tmp_path)), "--capacities", "100000", "--rate-seconds", "0.2"]
    assert conductor.main(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ops = {r["op"] for r in rows}
    assert ops == {"schedulers", "schedulers_order", "pool_vs_local", "early_rejection", "decision_rate",
                   "prefix_match"}  # fmt: skip
    assert {r["decode_load"] for r in rows if r["op"] == "early_rejection"} == {"none", "current", "predicted"}
    assert all(r["decisions_per_s"] > 0 for r in rows if r["op"] == "decision_rate")
    (match,) = [r for r in rows if r["op"] == "prefix_match"]
    assert match["match_prefix_us"] > 0 and match["match_prefix_nodes_us"] > 0
