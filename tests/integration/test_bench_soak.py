"""The soak benchmark runs end to end: its restarts happen, nothing pinned is lost, nothing read is
corrupt, and every line is well formed (its figures are for bench runs, not tests)."""

import json

import pytest

from bench import soak

pytestmark = pytest.mark.slow


def test_soak_bench_restarts_a_daemon_and_the_master_and_loses_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert soak.main(["--minutes", "0.4", "--sample-s", "3", "--dram", "32MiB", "--ssd", "64MiB", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    [baseline] = [r for r in lines if r["kind"] == "baseline"]
    assert baseline["ops_per_s"] > 0
    samples = [r for r in lines if r["kind"] == "rss"]
    assert len(samples) >= 3 and all(r["rss_mib"]["client"] > 0 for r in samples)
    [result] = [r for r in lines if r["kind"] == "soak"]
    assert [e["event"] for e in result["events"]] == ["daemon0 killed and restarted", "master killed and restarted"]
    assert result["ops"] > 0 and result["lost"] == 0 and result["corrupt"] == 0, result
    assert set(result["rss_growth_pct"]) == {"master", "daemon0", "daemon1", "client"}
