"""The conductor service in front of real prefill and decode workers and a real cluster, all processes.

Tiny random-weight Llama (CPU torch); master, daemons, workers and conductors run as
processes on loopback. Covers routing by stored prefix, the completions and metrics
routes, rejection with 429, bad input, a worker that dies, and a master that cannot
be reached.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore_cli.cluster import LocalCluster
from kvstore_client.adapters.pd import EngineSpec
from kvstore_client.adapters.serve import ServedEngines

pytestmark = pytest.mark.slow

TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "initializer_range": 0.05,
    "max_position_embeddings": 512,
}  # fmt: skip
BT = 16


def post(url: str, body: Any, *, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/completions", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return str(resp.read().decode())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, ServedEngines]]:
    tmp = tmp_path_factory.mktemp("conductor")
    config = tmp / "config.json"
    config.write_text(json.dumps(TINY))
    spec = EngineSpec(model_config=str(config), block_tokens=BT, calibrate_tokens=64)
    with LocalCluster(2, dram="32MiB") as cluster:
        nodes = [cluster.node_name(i) for i in range(2)]
        with ServedEngines(
            cluster.master_address, spec, prefill=2, decode=2, nodes=nodes, workdir=tmp / "logs",
            conductor_args=["--health-period", "0.5"], start_timeout_s=240,
        ) as engines:  # fmt: skip
            yield cluster, engines


def conductor(engines: ServedEngines, tmp: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """Another conductor in front of the same workers."""
    prefill = [engines.urls[f"prefill-{i}"] for i in range(engines.num_prefill)]
    decode = [engines.urls[f"decode-{i}"] for i in range(engines.num_decode)]
    log = tmp / f"conductor-{time.monotonic_ns()}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore_cli", "conductor", "--port", "0", "--prefill", *prefill,
         "--decode", *decode, *args], stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if " on http://" in line:
                return proc, line.rsplit(" on ", 1)[1].strip()
        assert proc.poll() is None, log.read_text()
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the conductor did not start")


def test_completions_reuse_a_stored_prefix(served: tuple[LocalCluster, ServedEngines]) -> None:
    _, engines = served
    url = engines.conductor_url
    system = [(7 * i) % 500 for i in range(4 * BT)]
    status, first = post(url, {"prompt": [*system, 1, 2, 3], "max_tokens": 4})
    assert status == 200, first
    assert first["object"] == "text_completion" and len(first["choices"][0]["tokens"]) == 4
    assert first["usage"] == {"prompt_tokens": 4 * BT + 3, "completion_tokens": 4, "total_tokens": 4 * BT + 7}
    status, second = post(url, {"prompt": [*system, 9, 9], "max_tokens": 2})
    assert status == 200
    k = second["kvstore"]
    assert k["stored_prefix_tokens"] == 4 * BT  # what the first request stored, seen by the conductor
    assert k["prefill_result"]["matched_tokens"] == 4 * BT
    assert k["predicted_ttft_s"] > 0 and k["ttft_s"] > 0 and k["routing"] == "global"
    metrics = get(url + "/metrics")
    for series in ("kvstore_conductor_requests_total", "kvstore_conductor_instance_queue_seconds",
                   "kvstore_conductor_ttft_seconds_bucket", "kvstore_conductor_ttft_prediction_error_ratio",
                   "kvstore_conductor_prefix_hit_tokens_total", "kvstore_conductor_master_reachable 1.0"):  # fmt: skip
        assert series in metrics, series


def test_bad_requests_get_a_reason_and_the_conductor_keeps_serving(
    served: tuple[LocalCluster, ServedEngines],
) -> None:
    url = served[1].conductor_url
    cases: list[tuple[Any, int, str]] = [
        ({"prompt": "hello"}, 400, "tokenizer"),
        ({"prompt": []}, 400, "prompt"),
        ({"prompt": [1, "x"]}, 400, "token ids"),
        ({"prompt": [1, 100_000]}, 400, "token ids"),
        ({"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": [1, 2], "model": "gpt-9"}, 404, "not served"),
        ({"prompt": list(range(500)) + list(range(100))}, 400, "exceed the model's 512"),
        ({"prompt": list(range(500)), "max_tokens": 20}, 400, "exceed the model's 512"),
        ([1, 2, 3], 400, "JSON object"),
    ]
    for body, status, words in cases:
        got, out = post(url, body)
        assert got == status and words in out["error"]["message"], (body, out)
    got, out = post(url, None, raw=b"\xff not json")
    assert got == 400 and "JSON" in out["error"]["message"]
    assert post(url, {"prompt": [1, 2, 3], "max_tokens": 2})[0] == 200


def test_a_predicted_slo_miss_is_rejected_with_429(served: tuple[LocalCluster, ServedEngines], tmp_path: Path) -> None:
    cluster, engines = served
    proc, url = conductor(engines, tmp_path, "--master", cluster.master_address, "--ttft-slo", "0.000001")
    try:
        status, out = post(url, {"prompt": list(range(40)), "max_tokens": 2})
        assert status == 429 and out["error"]["reason"] == "ttft" and out["error"]["predicted_ttft_s"] > 0
        assert 'kvstore_conductor_rejections_total{reason="ttft"} 1.0' in get(url + "/metrics")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_an_unreachable_master_means_load_only_routing(
    served: tuple[LocalCluster, ServedEngines], tmp_path: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens here once closed
    proc, url = conductor(served[1], tmp_path, "--master", dead)
    try:
        status, out = post(url, {"prompt": list(range(40)), "max_tokens": 2})
        assert status == 200 and out["kvstore"]["routing"] == "load"
        metrics = get(url + "/metrics")
        assert "kvstore_conductor_master_reachable 0.0" in metrics
        assert "kvstore_conductor_load_only_routing_total 1.0" in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_text_prompts_go_through_a_configured_tokenizer(
    served: tuple[LocalCluster, ServedEngines], tmp_path: Path
) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["hello", "world", "the", "store", "loads", "prefix", "blocks"]
    tok = Tokenizer(models.WordLevel({"[UNK]": 0} | {w: i + 1 for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    cluster, engines = served
    proc, url = conductor(engines, tmp_path, "--master", cluster.master_address, "--tokenizer", str(tmp_path / "tok"))
    try:
        status, out = post(url, {"prompt": "hello world the store loads", "max_tokens": 3})
        assert status == 200, out
        assert out["usage"]["prompt_tokens"] == 5 and isinstance(out["choices"][0]["text"], str)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# Last: it kills a worker of the shared fixture.
def test_a_dead_prefill_worker_is_routed_around(served: tuple[LocalCluster, ServedEngines]) -> None:
    _, engines = served
    url = engines.conductor_url
    engines.kill("prefill-0")
    outs = [post(url, {"prompt": [5, 6, 7, i], "max_tokens": 2}) for i in range(4)]
    assert all(status == 200 for status, _ in outs), outs
    assert all(out["kvstore"]["prefill"] == "prefill-1" for _, out in outs)  # retried there, or routed there
    time.sleep(1.5)  # more than one health period
    health = json.loads(get(url + "/health"))
    assert health["workers"]["prefill-0"] is False and health["workers"]["prefill-1"] is True
    assert 'kvstore_conductor_instance_up{instance="prefill-0",role="prefill"} 0.0' in get(url + "/metrics")
    engines.kill("decode-0")
    outs = [post(url, {"prompt": [8, 9, i], "max_tokens": 2}) for i in range(4)]
    assert all(status == 200 and out["kvstore"]["decode"] == "decode-1" for status, out in outs), outs
    time.sleep(1.5)
    assert json.loads(get(url + "/health"))["workers"]["decode-0"] is False
