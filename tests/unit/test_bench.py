"""The benchmark runs and prints well-formed lines (figures are not checked: timing belongs to bench runs)."""

import json

import pytest

from bench import node_store


def test_node_store_bench_prints_every_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert node_store.main(["--json", "--total", "256KiB", "--sizes", "4096,65536", "--repeat", "1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    seen = {(line["op"], line.get("tier"), line.get("size")) for line in lines}
    for op in ("put", "get"):
        for tier in ("dram", "ssd"):
            for size in (4096, 65536):
                assert (op, tier, size) in seen
    for line in lines:
        if line["op"] != "alloc_free":
            assert line["GBps"] > 0 and line["baseline_GBps"] > 0 and line["ops"] > 0
            # The ratio, GBps and its baseline are each printed to 3 decimals: within 5%, once each is
            # widened by its rounding (0.0005: 8% of a slow machine's 0.006).
            low = (line["GBps"] - 5e-4) / (line["baseline_GBps"] + 5e-4)
            high = (line["GBps"] + 5e-4) / max(line["baseline_GBps"] - 5e-4, 1e-9)
            assert 0.95 * low <= line["ratio"] + 5e-4 and line["ratio"] - 5e-4 <= 1.05 * high, line
    alloc = next(line for line in lines if line["op"] == "alloc_free")
    assert alloc["pairs_per_s"] > 0 and 0 < alloc["utilization_first_failure_min"] <= 1
