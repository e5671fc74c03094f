"""What the conductor reads of OpenAI servers and how it keeps their answers: Prometheus text as vLLM
writes it, the engine-cache model, chunks merged into one completion, and when a server is down."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument
from server.conductor.openai import EngineCache, merge_chunks, parse_metrics
from server.conductor.workers import Worker

# Lines as vllm serve 0.32 with the KVStoreConnector writes them (copied from a running server's /metrics).
METRICS = """\
# HELP vllm:kvstore_lookups_total kvstore: lookups
# TYPE vllm:kvstore_lookups_total counter
vllm:kvstore_lookups_total{engine="0",model_name="tiny"} 1.0
# HELP vllm:kvstore_layout_info kvstore: the key scheme of the stored blocks
# TYPE vllm:kvstore_layout_info gauge
vllm:kvstore_layout_info{block_bytes="262144",block_tokens="256",engine="0",model_name="tiny",\
namespace="kv2//tmp/vs/model/bfloat16/4L-2H-32D/tp0of1"} 1.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",kv_cache_size_tokens="5120",\
num_gpu_blocks="40"} 1.0
"""


def test_the_key_scheme_and_the_cache_size_are_read_from_metrics() -> None:
    scheme, kv_tokens = parse_metrics(METRICS)
    assert scheme == ("kv2//tmp/vs/model/bfloat16/4L-2H-32D/tp0of1", 256, 262144)
    assert kv_tokens == 5120
    older = METRICS.replace('kv_cache_size_tokens="5120",', "")
    assert parse_metrics(older)[1] == 40 * 128  # blocks x block size where the size is not given
    assert parse_metrics("# nothing here\n") == (None, None)


def test_the_engine_cache_holds_leading_blocks_and_forgets_the_least_recently_used() -> None:
    cache = EngineCache(capacity_blocks=4)
    cache.touch(["a", "b", "c"])
    assert cache.held(["a", "b", "c", "d"]) == 3
    assert cache.held(["b", "c"]) == 2 and cache.held(["x", "a"]) == 0  # leading blocks only
    cache.touch(["a"])  # a is now the most recent: b goes first
    cache.touch(["d", "e"])
    assert len(cache) == 4 and cache.held(["a"]) == 1 and cache.held(["b"]) == 0
    cache.clear()
    assert cache.held(["a"]) == 0
    unbounded = EngineCache(None)
    unbounded.touch(str(i) for i in range(1000))
    assert len(unbounded) == 1000


def test_stream_chunks_merge_into_one_completion() -> None:
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny"}
    chunks = [
        head | {"choices": [{"index": 0, "text": "he", "token_ids": [1, 2], "prompt_token_ids": [9, 9],
                             "logprobs": {"tokens": ["h", "e"], "token_logprobs": [-1.0, -2.0]},
                             "finish_reason": None}]},
        head | {"choices": [{"index": 0, "text": "llo", "token_ids": [3], "logprobs": {"tokens": ["llo"],
                             "token_logprobs": [-0.5]}, "finish_reason": "length", "stop_reason": None}]},
        head | {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}},
    ]  # fmt: skip
    out = merge_chunks(chunks)
    assert out["object"] == "text_completion" and out["id"] == "cmpl-1"
    (choice,) = out["choices"]
    assert choice["text"] == "hello" and choice["token_ids"] == [1, 2, 3] and choice["prompt_token_ids"] == [9, 9]
    assert choice["logprobs"] == {"tokens": ["h", "e", "llo"], "token_logprobs": [-1.0, -2.0, -0.5]}
    assert choice["finish_reason"] == "length" and out["usage"]["total_tokens"] == 5
    with pytest.raises(InvalidArgument):
        merge_chunks([])


def test_choices_of_several_samples_stay_apart() -> None:
    chunks = [{"id": "c", "choices": [{"index": i, "text": t}]} for i, t in ((1, "b"), (0, "a"), (1, "c"))]
    out = merge_chunks(chunks)
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, "a"), (1, "bc")]


def test_a_worker_goes_down_after_three_silent_checks_or_one_refusal() -> None:
    """A server busy computing may answer /health late: one slow check keeps it up (its routing and the
    model of its prefix cache stay); three in a row take it down; a refusal takes it down at once; the
    first answer brings it back."""
    w = Worker("engine-0", "http://127.0.0.1:1", "engine", {})
    assert w.checked(None, True) and w.checked(None, True)
    assert not w.checked(None, True)  # the third silent check in a row
    assert not w.checked(None, False)  # silent while down: stays down
    assert w.checked(True, False)  # answered: up again, the count starts over
    assert w.checked(None, True) and w.checked(None, True) and w.checked(True, True)
    assert w.checked(None, True) and w.checked(None, True)  # two more: still up (the answer reset it)
    assert not w.checked(False, True)  # refused or unhealthy: down at once
