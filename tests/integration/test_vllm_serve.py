"""Real ``vllm serve`` OpenAI servers behind ``kvstore conductor --openai``, sharing one cluster.

Two servers of vLLM's CPU build (``scripts/vllm-env.sh``) with the KVStoreConnector, each
publishing its KV events (``--kv-events-config``), a real cluster and the conductor following
those events (``--engine-events``), each a process on loopback. What is checked against the
real thing: the conductor's answers (whole and streamed) against the same server's own answer
without the conductor; a server that never saw a prompt loading it from the store (vLLM's
own cached-token count) and answering the same tokens; a conversation's next turn sent back
to the server whose own cache holds it, and once that server evicted it (its own events say
so), scheduled on what the store holds and loaded from it; the blocks an answer completes
stored for the next turn (``save_decode``); bad requests; a server killed under the conductor.
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
from kvstore.engine_blocks import EngineBlocks
from kvstore.keys import block_keys
from kvstore_cli.cluster import LocalCluster
from kvstore_client import Store
from server.conductor.openai import parse_metrics
from transfer.kv_events import KVEventSubscriber

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


def layout(server: VllmServer) -> tuple[str, int]:
    """(namespace, tokens per block) of the server's store keys (its layout metric)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        scheme, _ = parse_metrics(resp.read().decode())
    assert scheme is not None, "the server publishes no kvstore layout"
    return scheme[0], scheme[1]


def wait_stored(master: str, server: VllmServer, tokens: list[int], timeout_s: float = 60.0) -> None:
    """Until the store holds every whole block of ``tokens`` under the server's keys (its layout metric)."""
    namespace, block_tokens = layout(server)
    keys = block_keys(tokens, block_tokens, namespace)
    deadline = time.monotonic() + timeout_s
    with Store.connect(master) as store:
        while not all(store.exists_many(keys)):
            assert time.monotonic() < deadline, f"the store never held the {len(keys)} blocks the server saved"
            time.sleep(0.2)


def wait_followed(conductor: Conductor, servers: list[VllmServer], timeout_s: float = 30.0) -> None:
    """Until the conductor applied every KV event batch the servers published so far (it learns what
    a server caches after the fact: a request sent the moment the last one was answered may beat
    the events). The servers' latest sequence numbers are read from their own streams, after a
    moment for a batch still on its way out of vLLM's publisher thread."""
    for i, server in enumerate(servers):
        last = -1
        with KVEventSubscriber([server.events], [server.replay], from_seq=0) as events:
            for delivered in [*events.catch_up(), *events.receive(0.3)]:
                last = delivered.seq
        applied = f'kvstore_conductor_engine_events_seq{{instance="engine-{i}"}}'
        deadline = time.monotonic() + timeout_s
        while metric(conductor.url, applied) < last:
            assert time.monotonic() < deadline, f"the conductor did not follow server {i}'s events"
            time.sleep(0.1)


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
        servers = [VllmServer(model, tmp / f"server{i}.log", master=cluster.master_address, extra=extra, events=True)
                   for i in range(2)]  # fmt: skip
        try:
            for s in servers:
                s.wait()
            urls, events, replay = [s.url for s in servers], [s.events for s in servers], [s.replay for s in servers]
            with Conductor(cluster.master_address, urls, tmp / "conductor.log", events, replay) as conductor:
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
    wait_followed(conductor, servers)
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
    servers, conductor, _ = served
    context = prompt(1100, 13)
    turns = []
    for turn in range(3):
        body = {"prompt": context, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        status, out = post(conductor.url, body)
        assert status == 200, out
        turns.append(out["kvstore"])
        context = context + out["choices"][0]["token_ids"] + prompt(300, 100 + turn)
        wait_followed(conductor, servers)  # the next turn comes seconds later in a chat
    # On a failure: the conductor's predictions for each turn, and its log (a server taken down, a retry).
    engines = [t["engine"] for t in turns]
    assert engines[1] == engines[0] and engines[2] == engines[0], (turns, conductor.log_path.read_text()[-3000:])


def test_a_conversation_its_server_evicted_is_scheduled_on_the_store_and_loaded_from_it(served: Served) -> None:
    """A conversation's server evicts it: other prompts, sent to that server directly (the conductor
    never sees them), fill its small cache (48 pages of 128 tokens). Its own KV events say so, the
    conductor follows them, and the next turn is scheduled on what the store holds, no server
    holding the prefix; the server it goes to loads the prefix from the store. (Guessing from what
    it sent, as the conductor does without events, it would still place the prefix there.)"""
    servers, conductor, master = served
    body = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    status, out = post(conductor.url, body | {"prompt": prompt(1100, 17)})
    assert status == 200, out
    chosen = int(out["kvstore"]["engine"].split("-")[1])
    server, context = servers[chosen], prompt(1100, 17) + out["choices"][0]["token_ids"]
    wait_stored(master, server, context[:1024])
    namespace, block_tokens = layout(server)
    keys = [str(k) for k in block_keys(context[:1024], block_tokens, namespace)]
    mirror = EngineBlocks(namespace, block_tokens)  # the server's cache from its events, as the test reads them
    with KVEventSubscriber([server.events], [server.replay], from_seq=0) as events:
        seq = -1
        for delivered in events.catch_up():
            mirror.apply(delivered.batch.events)
            seq = delivered.seq
        assert mirror.held(keys) == len(keys), "the server's own events do not say it holds the conversation"
        for i in range(3):
            complete(server.url, {"model": "tiny", "prompt": prompt(3000, 300 + i), "max_tokens": 1})
        deadline = time.monotonic() + 60
        while mirror.held(keys):
            assert time.monotonic() < deadline, "the server's events never said it evicted the conversation"
            for delivered in events.receive(0.5):
                mirror.apply(delivered.batch.events)
                seq = delivered.seq
    applied = f'kvstore_conductor_engine_events_seq{{instance="engine-{chosen}"}}'
    deadline = time.monotonic() + 30
    while metric(conductor.url, applied) < seq:
        assert time.monotonic() < deadline, "the conductor did not follow the server's events"
        time.sleep(0.1)
    status, out = post(conductor.url, body | {"prompt": context + prompt(200, 18)})
    assert status == 200, out
    assert out["kvstore"]["engine_prefix_tokens"] == 0 and out["kvstore"]["stored_prefix_tokens"] >= 1024
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1024, "the prefix was not loaded from the store"


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
