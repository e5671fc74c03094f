"""The master benchmark runs end to end on our master and prints a well-formed line (figures are for
bench runs, not tests; Mooncake's row needs ../shared/peers and is left out here)."""

import json

import pytest

from bench import master


@pytest.mark.slow
def test_master_bench_prints_our_row(capsys: pytest.CaptureFixture[str]) -> None:
    assert master.main(["--json", "--peers", "no", "--keys", "3000", "--dram", "64MiB"]) == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["system"] == "kvstore" and row["keys"] == 3000 and row["readable"] == 3000
    for op in ("put", "get", "exists"):
        assert row[op]["count"] == 3000 and row[op]["master_cpu_us_per_key"] >= 0
        assert 0 < row[op]["p50_us"] <= row[op]["p99_us"]


def test_ratios_are_ours_over_theirs() -> None:
    ours = {op: {"master_cpu_us_per_key": 4.0} for op in ("put", "get", "exists")}
    theirs = {op: {"master_cpu_us_per_key": 2.0} for op in ("put", "get", "exists")}
    ours.update(master_bytes_per_key=300.0, readable=10)  # type: ignore[arg-type]
    theirs.update(master_bytes_per_key=600.0, readable=9)  # type: ignore[arg-type]
    r = master.ratios(ours, theirs)
    assert (r["put_cpu"], r["get_cpu"], r["exists_cpu"], r["memory"], r["readable"]) == (2.0, 2.0, 2.0, 0.5, [10, 9])
