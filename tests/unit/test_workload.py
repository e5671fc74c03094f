import json
from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument
from kvstore.workload import TraceRequest, chat_workload, load_trace, lru_prefix_hit_rate, parse_request

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "synthetic_trace.jsonl"


def test_parse_request() -> None:
    r = parse_request({"timestamp": 5, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]})
    assert r == TraceRequest(5, 1024, 3, (1, 2))


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ([], "JSON object"),
        ({"input_length": 1, "hash_ids": []}, "timestamp"),
        ({"timestamp": -1, "input_length": 1, "hash_ids": []}, "timestamp"),
        ({"timestamp": 0, "input_length": "9", "hash_ids": []}, "input_length"),
        ({"timestamp": 0, "input_length": 1, "hash_ids": [1, -2]}, "hash_ids"),
        ({"timestamp": 0, "input_length": 1, "hash_ids": "12"}, "hash_ids"),
    ],
)
def test_bad_requests_name_the_field(obj: object, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        parse_request(obj)


def test_load_trace_reads_lines_and_reports_bad_ones(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [0]}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\nnot json\n")
    it = load_trace(path)
    assert next(it).hash_ids == (0,) and next(it).hash_ids == (0,)
    with pytest.raises(InvalidArgument, match=r"t.jsonl:4: not valid JSON"):
        next(it)
    assert len(list(load_trace(path, limit=1))) == 1
    with pytest.raises(InvalidArgument, match="cannot read"):
        list(load_trace(tmp_path / "missing.jsonl"))


def test_chat_workload_is_deterministic_and_prefix_shaped() -> None:
    a, b = chat_workload(num_sessions=30, seed=1), chat_workload(num_sessions=30, seed=1)
    assert a == b and a != chat_workload(num_sessions=30, seed=2)
    assert [r.timestamp_ms for r in a] == sorted(r.timestamp_ms for r in a)
    # Every request starts with one of the shared system prompts (ids below 8 * 4).
    assert all(r.hash_ids[0] % 4 == 0 and r.hash_ids[0] < 32 for r in a)
    assert all(r.input_length == 512 * len(r.hash_ids) for r in a)


def test_lru_reference_counts_prefix_hits_until_the_first_miss() -> None:
    reqs = [TraceRequest(0, 0, 0, (1, 2, 3)), TraceRequest(1, 0, 0, (1, 2, 4)), TraceRequest(2, 0, 0, (5, 2, 3))]
    # Request 2 hits 1, 2; request 3 misses 5 first, so 2 and 3 do not count.
    assert lru_prefix_hit_rate(reqs, 100) == pytest.approx(2 / 9)
    # With room for 2 blocks, request 2 finds only 2 and 3 (1 was evicted), and no prefix.
    assert lru_prefix_hit_rate(reqs, 2) == 0


@pytest.mark.skipif(not TRACE.exists(), reason="shared trace not present")
def test_lru_reference_matches_the_published_figures() -> None:
    requests = list(load_trace(TRACE))
    assert len(requests) == 3993
    assert round(lru_prefix_hit_rate(requests, 5_000), 3) == 0.279
    assert round(lru_prefix_hit_rate(requests, 20_000), 3) == 0.571
    assert round(lru_prefix_hit_rate(requests, 50_000), 3) == 0.640
