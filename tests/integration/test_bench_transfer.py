"""The transfer benchmark runs end to end and prints well-formed lines (figures are for bench runs, not tests)."""

import json

import pytest

from bench import transfer
from transfer.transports import ucx

pytestmark = pytest.mark.slow


def test_transfer_bench_prints_a_line_per_transport_op_and_size(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--json", "--transports", "tcp,shm,ucx", "--sizes", "65536,1048576", "--batch", "4",
            "--total", "4MiB", "--links", "no"]  # fmt: skip
    assert transfer.main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    measured = [r for r in lines if "GBps" in r]
    expected = {"tcp", "shm"} | ({"ucx"} if ucx.available() else set())
    assert {(r["transport"], r["op"], r["size"]) for r in measured} == {
        (t, op, size) for t in expected for op in ("put", "get") for size in (65536, 1048576)
    }
    for r in measured:
        assert r["GBps"] > 0 and r["baseline_GBps"] > 0
        assert r["baseline"] == ("memcpy" if r["transport"] == "shm" else "raw_tcp")
    if not ucx.available():
        assert any(r.get("skipped") for r in lines if r.get("transport") == "ucx")
