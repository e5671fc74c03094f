"""bench.tenant_attacks, small: each attack line printed, with the master's loop stall beside it."""

from __future__ import annotations

import json

import pytest

from bench import tenant_attacks

pytestmark = pytest.mark.slow


def test_tenant_attacks_bench_prints_a_line_per_attack(capsys: pytest.CaptureFixture[str]) -> None:
    assert tenant_attacks.main(["--json", "--only", "huge_batch", "revoked_writes", "own_evictions"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["attack"] for line in lines] == ["huge_batch", "revoked_writes", "own_evictions"]
    assert all(line["loop_stall_ms"] >= 0 and "error" not in line for line in lines), lines
    assert lines[0]["put_200k"] == lines[0]["get_500k"] == "InvalidArgument"
    assert lines[1]["writes_taken"] == 0 and lines[2]["own_blocks_kept"] == 6
