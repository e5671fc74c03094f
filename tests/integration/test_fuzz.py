"""The fuzz benchmark, small: schema frames, garbled frames and admin requests against a live
cluster leave every process up, log no handler failure, answer no 5xx, and serve byte-exact."""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.fuzz import run

pytestmark = pytest.mark.slow


def test_a_short_fuzz_leaves_the_cluster_up_and_exact() -> None:
    lines: list[dict[str, Any]] = []
    summary = run(4000, seed=7, emit=lines.append)
    print(json.dumps(summary))
    assert {line["target"] for line in lines} == {"baseline", "master", "daemon", "admin", "native", "summary"}
    assert summary["inputs"] == 4000
    assert summary["crashes"] == 0, summary
    assert summary["unhandled"] == 0, summary["unhandled_examples"]
    assert summary["http_5xx"] == 0, lines
    assert summary["healthy_after"] and summary["reference_wrong"] == 0, summary
    assert summary["native_mismatches"] == 0, [line for line in lines if line["target"] == "native"]


def test_a_short_fuzz_of_a_cluster_that_authenticates() -> None:
    lines: list[dict[str, Any]] = []
    summary = run(4000, seed=11, emit=lines.append, auth=True)
    print(json.dumps(summary))
    assert {line["target"] for line in lines} == {
        "baseline", "master", "daemon", "master-unauthenticated", "daemon-unauthenticated", "admin", "native", "summary"
    }  # fmt: skip
    assert summary["inputs"] == 4000 and summary["auth"]
    assert summary["crashes"] == 0 and summary["unhandled"] == 0, summary
    assert summary["http_5xx"] == 0, lines
    assert summary["healthy_after"] and summary["reference_wrong"] == 0, summary
