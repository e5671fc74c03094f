"""The cluster benchmark runs end to end and prints well-formed lines (figures are for bench runs, not tests)."""

import json

import pytest

from bench import cluster

pytestmark = pytest.mark.slow


def test_cluster_bench_prints_every_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--json", "--peers", "no", "--sizes", "4096,65536", "--batches", "1,8", "--total", "256KiB",
            "--dram", "64MiB", "--match-keys", "20000", "--security", "auth,tls_data"]  # fmt: skip
    assert cluster.main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    seen = {(r["op"], r.get("size"), r.get("batch")) for r in lines}
    for op in ("put", "get"):
        for size in (4096, 65536):
            for batch in (1, 8):
                assert (op, size, batch) in seen
    for r in lines:
        if r["op"] in ("put", "get") and "client" not in r and r["bench"] == "cluster":
            assert r["GBps"] > 0 and r["baseline_GBps"] > 0 and r["p50_us"] <= r["p99_us"]
            assert r["master_cpu_us"] is not None and r["master_cpu_us"] >= 0
    [exists] = [r for r in lines if r["op"] == "exists"]
    assert exists["p50_us"] > 0 and exists["baseline_p50_us"] > 0
    asynchronous = {r["loop"]: r for r in lines if r.get("client") == "async"}
    assert set(asynchronous) == {"asyncio", "uvloop"}
    assert all(r["concurrency"] == 64 and r["ops"] > 0 for r in asynchronous.values())
    assert {r["where"] for r in lines if r["op"] == "match_prefix"} == {"table", "rpc"}
    for variant in ("auth", "tls_data"):
        compared = [r for r in lines if r["bench"] == f"cluster_{variant}"]
        assert {(r["op"], r.get("size"), r.get("batch")) for r in compared} == {
            (op, size, batch) for op in ("put", "get") for size, batch in [(4096, 1), (65536, 1), (65536, 8)]
        } | {("connect_put_get", 4096, None)}
        assert all(r["ratio"] > 0 for r in compared if "ratio" in r)
