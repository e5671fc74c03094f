"""Real ``vllm serve`` OpenAI servers behind ``kvstore conductor --openai``, sharing one cluster.

Two servers of vLLM's CPU build (``scripts/vllm-env.sh``) with the KVStoreConnector, a real
cluster and the conductor, each a process on loopback. What is checked against the real
thing: the conductor's answers (whole and streamed) against the same server's own answer
without the conductor; a server that never saw a prompt loading it from the store (vLLM's
own cached-token count) and answering the same tokens; a conversation's next turn sent back
to the server whose own cache holds it; the blocks an answer completes stored for the
next turn (``save_decode``); bad requests; a server killed under the conductor.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.vllm_chat import Conductor, VllmServer, complete
from bench.vllm_serving import prompt, save_model, vllm_python
from kvstore.keys import block_keys
from kvstore_cli.cluster import LocalCluster
from kvstore_client import Store
from server.conductor.openai import parse_metrics

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

if not Path(vllm_python()).exists():
    pytest.skip(f"no vLLM environment at {vllm_python()} (scripts/vllm-env.sh builds one)", allow_module_level=True)

P = prompt(1500, 11)
Served = tuple[list[VllmServer], Conductor, str]


def post(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_stored(master: str, server: VllmServer, tokens: list[int], timeout_s: float = 60.0) -> None:
    """Until the store holds every whole block of ``tokens`` under the server's keys (its layout metric)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        scheme, _ = parse_metrics(resp.read().decode())
    assert scheme is not None, "the server publishes no kvstore layout"
    keys = block_keys(tokens, scheme[1], scheme[0])
    deadline = time.monotonic() + timeout_s
    with Store.connect(master) as store:
        while not all(store.exists_many(keys)):
            assert time.monotonic() < deadline, f"the store never held the {len(keys)} blocks the server saved"
            time.sleep(0.2)


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[VllmServer], Conductor, str]]:
    tmp = tmp_path_factory.mktemp("vllm-serve")
    model = save_model(tmp / "model")
    with LocalCluster(daemons=1, dram="512MiB") as cluster:
        extra = {"model": "t", "save_decode": True}
        servers = [VllmServer(model, tmp / f"server{i}.log", master=cluster.master_address, extra=extra)
                   for i in range(2)]  # fmt: skip
        try:
            for s in servers:
                s.wait()
            with Conductor(cluster.master_address, [s.url for s in servers], tmp / "conductor.log") as conductor:
                yield servers, conductor, cluster.master_address
        finally:
            for s in servers:
                s.close()


def test_the_conductor_answers_what_the_server_answers_and_a_second_server_loads_it_from_the_store(
    served: Served,
) -> None:
    servers, conductor, master = served
    body = {"prompt": P, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    status, first = post(conductor.url, body | {"return_token_ids": True})
    assert status == 200, first
    info = first["kvstore"]
    assert info["stored_prefix_tokens"] == 0 and info["engine_prefix_tokens"] == 0
    tokens = first["choices"][0]["token_ids"]
    assert len(tokens) == 8 and first["usage"]["prompt_tokens"] == len(P)
    chosen = int(info["engine"].split("-")[1])
    # The connector puts the prompt's blocks from a thread behind the answer: on a loaded machine the
    # store may not hold them yet when the answer arrives, so wait for them before asking again.
    wait_stored(master, servers[chosen], P[:1280])
    # Again: the same server (its own cache holds the prompt), the same tokens; without token ids asked, none.
    status, again = post(conductor.url, body)
    assert status == 200 and again["kvstore"]["engine"] == info["engine"]
    assert again["kvstore"]["engine_prefix_tokens"] == again["kvstore"]["stored_prefix_tokens"] == 1280
    assert "token_ids" not in again["choices"][0]
    # The other server never saw the prompt: it loads the stored blocks and answers the same tokens.
    other = servers[1 - chosen]
    direct = complete(other.url, {"model": "tiny", **body})
    assert direct["tokens"] == tokens
    assert direct["cached"] >= 1280, "the second server did not load the prompt from the store"
    assert metric(other.url, "vllm:kvstore_loaded_blocks_total") >= 5
    assert metric(servers[chosen].url, "vllm:kvstore_saved_blocks_total") >= 5
    # Streamed through the conductor: the same tokens, chunk by chunk, then [DONE].
    streamed = complete(conductor.url, body)
    assert streamed["tokens"] == tokens and streamed["engine"] in ("engine-0", "engine-1")
    assert metric(conductor.url, 'kvstore_conductor_requests_total{outcome="ok"}') >= 3


def test_a_streamed_answer_ends_with_done_and_carries_only_what_was_asked(
    served: Served,
) -> None:
    _, conductor, _ = served
    conn = http.client.HTTPConnection("127.0.0.1", conductor.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt(300, 12), "max_tokens": 3, "stream": True,
                 "ignore_eos": True}), {"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream")
    events = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(len(c["choices"]) for c in chunks) == 3
    assert all("token_ids" not in part and "usage" not in c for c in chunks for part in c["choices"])


def test_a_conversation_goes_back_to_the_server_that_holds_it(served: Served) -> None:
    _, conductor, _ = served
    context = prompt(1100, 13)
    turns = []
    for turn in range(3):
        body = {"prompt": context, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        status, out = post(conductor.url, body)
        assert status == 200, out
        turns.append(out["kvstore"])
        context = context + out["choices"][0]["token_ids"] + prompt(300, 100 + turn)
    # On a failure: the conductor's predictions for each turn, and its log (a server taken down, a retry).
    engines = [t["engine"] for t in turns]
    assert engines[1] == engines[0] and engines[2] == engines[0], (turns, conductor.log_path.read_text()[-3000:])


def test_blocks_an_answer_completes_are_stored_for_the_next_turn(served: Served) -> None:
    servers, _, master = served
    first = prompt(1250, 15)  # 4 whole blocks of 256; 40 answer tokens complete the fifth while decoding
    body = {"model": "tiny", "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    answer = complete(servers[0].url, body | {"prompt": first})["tokens"]
    wait_stored(master, servers[0], (first + answer)[:1280])  # saved behind the answer, off the engine's path
    following = first + answer + prompt(60, 16)
    turn = complete(servers[1].url, body | {"prompt": following, "max_tokens": 1})
    assert turn["cached"] == 1280, "the block the answer completed was not stored (save_decode)"


def test_bad_requests_get_a_clear_error(served: Served) -> None:
    _, conductor, _ = served
    assert post(conductor.url, {"prompt": "words", "max_tokens": 2})[0] == 400  # no tokenizer: token ids only
    assert post(conductor.url, {"prompt": [1, 2], "model": "another"})[0] == 404
    status, out = post(conductor.url, {"prompt": prompt(4000, 14), "max_tokens": 200})
    assert status == 400 and "exceed" in out["error"]["message"]
    status, out = post(conductor.url, {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": -3})
    assert status == 400, out  # the server's own refusal, passed on


def test_a_server_killed_under_the_conductor_is_routed_around(served: Served) -> None:
    servers, conductor, _ = served
    victim = servers[1]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(30)
    for i in range(4):
        status, out = post(conductor.url, {"prompt": prompt(200, 200 + i), "max_tokens": 2, "ignore_eos": True})
        assert status == 200, out
        assert out["kvstore"]["engine"] == "engine-0"
    deadline = time.monotonic() + 15  # the health check (every second) marks it down if no request did
    while metric(conductor.url, 'kvstore_conductor_instance_up{instance="engine-1",role="engine"}') != 0:
        assert time.monotonic() < deadline, "the conductor never marked the killed server down"
        time.sleep(0.5)
