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
            assert line["ratio"] == pytest.approx(line["GBps"] / line["baseline_GBps"], rel=0.05)
    alloc = next(line for line in lines if line["op"] == "alloc_free")
    assert alloc["pairs_per_s"] > 0 and 0 < alloc["utilization_first_failure_min"] <= 1
