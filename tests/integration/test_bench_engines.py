"""The engine benchmark runs end to end on a tiny model and prints well-formed lines (figures are for bench runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bench import engines
from tests.integration.test_engines import TINY

pytestmark = pytest.mark.slow


def test_engines_bench_prints_every_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    args = ["--json", "--model-config", str(config), "--block-tokens", "16", "--prompt-tokens", "128",
            "--fractions", "0,0.5", "--repeat", "1", "--decode-tokens", "4", "--calibrate-tokens", "32",
            "--tail-tokens", "5", "--dram", "32MiB"]  # fmt: skip
    assert engines.main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rows = [r for r in lines if "stored_fraction" in r]
    assert {(r["stored_fraction"], r["transport"]) for r in rows} == {(f, t) for f in (0, 0.5) for t in ("tcp", "auto")}
    for r in rows:
        assert r["tokens_match"] and r["max_abs_logit_diff"] <= 1e-4
        assert r["ttft_recompute_s"] > 0 and r["ttft_suffix_only_s"] > 0 and r["efficiency"] > 0
        assert r["stored_tokens"] == (64 if r["stored_fraction"] else 0)
    (tail,) = [r for r in lines if r.get("op") == "decode_tail"]
    assert tail["tail_tokens"] == 5 and tail["tail_transferred"] and tail["tokens_match"]
