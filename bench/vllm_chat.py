"""A multi-turn chat on real ``vllm serve`` servers: vLLM alone against vLLM servers that share the store.

The same chat sessions (random token ids: ``--sessions`` users side by side, ``--turns``
turns each, every turn's prompt the whole conversation so far: a shared system prompt,
earlier messages and answers, the new message) run, in one run, against:

- ``vllm_alone``: one ``vllm serve``, its own prefix cache, no connector: what a vLLM user has;
- ``two_sticky``: two ``vllm serve`` without the store, each session always on the same server
  (the best a load balancer can do for their own prefix caches);
- ``two_store_sticky``: the same two servers with the KVStoreConnector on one cluster, sessions
  still sticky (what the store costs and gives without routing);
- ``two_store``: two ``vllm serve`` with the KVStoreConnector on one cluster, behind
  ``kvstore conductor --openai`` (routing by the store's prefix matches, the servers' own
  caches as the conductor guesses them from what it sent, and their queues);
- ``two_store_events``: the same, the servers publishing their KV events (``--kv-events-config``)
  and the conductor following them (``--engine-events``): what each server's cache holds is
  what the server said, evictions included.

Every server is vLLM's CPU build (``scripts/vllm-env.sh``) with the same settings: one
compute thread (``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` on a 2-core machine), ``--kv-blocks``
pages of ``--block-size`` tokens of KV cache (small on purpose: the sessions' contexts do
not all fit, as on a busy server), greedy decoding. Answers are streamed; the time to first
token is taken by the client at the first chunk. One JSON line per configuration (TTFT of
first and later turns, turns per second, the share of later turns' prompts vLLM reported
cached, the servers' own prefix-cache and store hit rates from their ``/metrics``, requests per
server) and a last line with the ratios. ``same_conversations`` counts
the conversations whose every token equals vLLM alone's: greedy decoding on a random-weight
model flips near-ties when the batch around a request changes, with or without the store (the
engine tests check tokens with one request at a time).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.processes import GroupProcess
from bench.vllm_serving import REPO, free_port, print_rows, save_model, vllm_python


class VllmServer(GroupProcess):
    """``vllm serve`` (its OpenAI API server) in a process group of its own, on loopback."""

    def __init__(
        self, model: Path, log: Path, *, block: int = 128, kv_blocks: int = 48, max_model_len: int = 4096,
        master: str = "", extra: dict[str, Any] | None = None, name: str = "tiny", start_timeout_s: float = 300,
        events: bool = False, connector: dict[str, Any] | None = None, env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        """``master``: the KVStoreConnector on that cluster (``extra``: its settings); ``connector``:
        another ``--kv-transfer-config`` instead. ``events``: the server publishes its KV events
        (vLLM's ``--kv-events-config``, ZMQ) at :attr:`events`, replayed from :attr:`replay`.
        ``env``: more environment (over the bench's)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        args = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", name, "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
                "--block-size", str(block), "--max-model-len", str(max_model_len), "--seed", "0",
                "--num-gpu-blocks-override", str(kv_blocks), "--host", "127.0.0.1", "--port", str(self.port),
                "--enable-prompt-tokens-details"]  # fmt: skip
        if master:
            config = {
                "kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore_client.adapters.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"master": master, **(extra or {})},
            }  # fmt: skip
            args += ["--kv-transfer-config", json.dumps(config)]
        elif connector:
            args += ["--kv-transfer-config", json.dumps(connector)]
        self.events = self.replay = ""
        if events:
            publish, replay = free_port(), free_port()
            # vLLM binds a wildcard endpoint (one it would connect to instead needs a subscriber that binds).
            args += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{publish}",
                "replay_endpoint": f"tcp://*:{replay}",
            })]  # fmt: skip
            self.events, self.replay = f"tcp://127.0.0.1:{publish}", f"tcp://127.0.0.1:{replay}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", **(env or {})}  # fmt: skip
        self.start_timeout_s = start_timeout_s
        super().__init__(args, log, env=env, cwd=REPO)

    def wait(self) -> VllmServer:
        """Until the server answers ``/health`` (servers started together start side by side)."""
        self.wait_http(f"{self.url}/health", self.start_timeout_s, "vllm serve")
        return self


class Conductor(GroupProcess):
    """``kvstore conductor --openai`` over ``urls``, in a process group of its own; with ``events``, following
    each server's KV events (``--engine-events``, in ``urls``' order, replayed from ``replay``)."""

    def __init__(
        self, master: str, urls: list[str], log: Path, events: Sequence[str] = (), replay: Sequence[str] = ()
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "kvstore_cli", "conductor", "--master", master, "--openai", *urls,
                "--port", str(self.port)]  # fmt: skip
        if events:
            args += ["--engine-events", *events]
        if replay:
            args += ["--engine-events-replay", *replay]
        super().__init__(args, log, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
        try:
            self.wait_http(f"{self.url}/health", 120, "the conductor")  # it serves once it found its servers
        except BaseException:
            self.close()
            raise


def complete(url: str, body: dict[str, Any], timeout_s: float = 300) -> dict[str, Any]:
    """One streamed completion: its tokens, the time to its first chunk and in all, cached prompt tokens,
    and the conductor's choice where there is one (``X-KVStore-Engine``)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(payload), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{url} answered {resp.status}: {resp.read()[:300]!r}")
    tokens: list[int] = []
    first = None
    cached = 0
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if "error" in chunk:
            raise RuntimeError(f"{url}: {chunk['error']}")
        for part in chunk.get("choices") or []:
            first = first or time.perf_counter()
            tokens += part.get("token_ids") or []
        details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") or cached
    conn.close()
    end = time.perf_counter()
    return {"tokens": tokens, "ttft_s": (first or end) - start, "total_s": end - start, "cached": cached,
            "engine": resp.getheader("X-KVStore-Engine")}  # fmt: skip


def chat(urls: list[str], args: argparse.Namespace, *, sticky: bool) -> dict[str, Any]:
    """Every session's turns (sessions side by side); with ``sticky`` session ``s`` always on ``urls[s % n]``,
    else on ``urls[0]``. Returns the records and the final conversations."""
    from kvstore_client.adapters.pd import chat_sessions

    sessions = chat_sessions(args.sessions, args.turns, vocab_size=8192, system_tokens=args.system_tokens,
                             message_tokens=tuple(args.message_tokens), max_new_tokens=args.max_new_tokens,
                             seed=args.seed)  # fmt: skip
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def converse(i: int) -> None:
        s = sessions[i]
        url = urls[i % len(urls)] if sticky else urls[0]
        try:
            for turn, message in enumerate(s.messages):
                prompt = s.context + message
                out = complete(url, {"model": "tiny", "prompt": prompt, "max_tokens": s.max_new_tokens,
                                     "temperature": 0.0, "ignore_eos": True})  # fmt: skip
                s.context = prompt + out["tokens"]
                with lock:
                    records.append({"session": i, "turn": turn, "prompt_tokens": len(prompt), **out})
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    started = time.perf_counter()
    threads = [threading.Thread(target=converse, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return {"records": records, "elapsed_s": time.perf_counter() - started,
            "contexts": [s.context for s in sessions]}  # fmt: skip


CACHE_METRICS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
                 "vllm:external_prefix_cache_hits")  # fmt: skip
"""vLLM's own counters (tokens): its prefix cache (the GPU's; here the CPU's pages), and the connector's."""


def cache_counts(urls: list[str]) -> dict[str, float]:
    """:data:`CACHE_METRICS` summed over the servers at ``urls`` (their ``/metrics``)."""
    total = dict.fromkeys(CACHE_METRICS, 0.0)
    for url in urls:
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
            if name in total and not line.startswith("#"):
                total[name] += float(line.rsplit(" ", 1)[1])
    return total


def summarize(name: str, run: dict[str, Any]) -> dict[str, Any]:
    recs = run["records"]
    later = [r for r in recs if r["turn"] > 0]
    first = [r for r in recs if r["turn"] == 0]
    prompt_later = sum(r["prompt_tokens"] for r in later)
    return {
        "bench": "vllm_chat", "row": name, "requests": len(recs), "elapsed_s": round(run["elapsed_s"], 2),
        "turns_per_s": round(len(recs) / run["elapsed_s"], 3),
        "ttft_first_turn_s": round(statistics.median(r["ttft_s"] for r in first), 4),
        "ttft_later_turns_s": round(statistics.median(r["ttft_s"] for r in later), 4),
        "ttft_later_p90_s": round(sorted(r["ttft_s"] for r in later)[int(0.9 * (len(later) - 1))], 4),
        "later_cached_share": round(sum(r["cached"] for r in later) / prompt_later, 3) if prompt_later else 0.0,
        "engines": {e: sum(r["engine"] == e for r in recs) for e in sorted({r["engine"] for r in recs if r["engine"]})},
        **_hit_rates(run.get("cache") or {}),
    }  # fmt: skip


def _hit_rates(counts: dict[str, float]) -> dict[str, float]:
    """The servers' own hit rates (:func:`cache_counts`): of the prompt tokens they looked up, the
    share their prefix caches held, and of those left for the connector, the share the store held."""
    if not counts:
        return {}
    queries, hits = counts["vllm:prefix_cache_queries"], counts["vllm:prefix_cache_hits"]
    ext_queries, ext_hits = counts["vllm:external_prefix_cache_queries"], counts["vllm:external_prefix_cache_hits"]
    out = {"engine_hit_rate": round(hits / queries, 3) if queries else 0.0}
    if ext_queries:
        out["store_hit_rate"] = round(ext_hits / ext_queries, 3)
    return out


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    from kvstore_cli.cluster import LocalCluster

    work = Path(args.logs or tempfile.mkdtemp(prefix="bench-vllm-chat-"))
    work.mkdir(parents=True, exist_ok=True)
    model = save_model(work / "model", layers=args.layers)
    server = {"block": args.block_size, "kv_blocks": args.kv_blocks}
    rows = {}
    if "vllm_alone" in args.rows:
        with VllmServer(model, work / "alone.log", **server) as alone:
            rows["vllm_alone"] = chat([alone.wait().url], args, sticky=False)
            rows["vllm_alone"]["cache"] = cache_counts([alone.url])
        (work / "vllm_alone.json").write_text(json.dumps(rows["vllm_alone"]["records"]))
        yield summarize("vllm_alone", rows["vllm_alone"])
    if "two_sticky" in args.rows:
        with ExitStack() as stack:
            pair = [stack.enter_context(VllmServer(model, work / f"sticky{i}.log", **server)) for i in range(2)]
            rows["two_sticky"] = chat([s.wait().url for s in pair], args, sticky=True)
            rows["two_sticky"]["cache"] = cache_counts([s.url for s in pair])
        (work / "two_sticky.json").write_text(json.dumps(rows["two_sticky"]["records"]))
        yield summarize("two_sticky", rows["two_sticky"])
    for name in ("two_store_sticky", "two_store", "two_store_events"):
        if name not in args.rows:
            continue
        events = name == "two_store_events"
        with LocalCluster(daemons=1, dram=args.dram) as cluster, ExitStack() as stack:
            extra = {"model": "bench", "block_tokens": args.store_block_tokens, "save_decode": args.save_decode}
            master = cluster.master_address
            pair = [stack.enter_context(VllmServer(model, work / f"{name}{i}.log", master=master, extra=extra,
                                                   events=events, **server)) for i in range(2)]  # fmt: skip
            urls = [s.wait().url for s in pair]
            if name != "two_store_sticky":
                conductor = stack.enter_context(Conductor(
                    cluster.master_address, urls, work / f"{name}-conductor.log",
                    [s.events for s in pair if events], [s.replay for s in pair if events],
                ))  # fmt: skip
                rows[name] = chat([conductor.url], args, sticky=False)
            else:
                rows[name] = chat(urls, args, sticky=True)
            rows[name]["cache"] = cache_counts(urls)
        (work / f"{name}.json").write_text(json.dumps(rows[name]["records"]))
        yield summarize(name, rows[name])
    if {"two_store", "two_store_events"} <= rows.keys():
        guess, told = (summarize(n, rows[n]) for n in ("two_store", "two_store_events"))
        yield {
            "bench": "vllm_chat", "row": "engine_events", "sessions": args.sessions, "turns": args.turns,
            "later_ttft_events_vs_guess": round(told["ttft_later_turns_s"] / guess["ttft_later_turns_s"], 3),
            "throughput_events_vs_guess": round(told["turns_per_s"] / guess["turns_per_s"], 3),
            "engine_hit_rate": {"guess": guess.get("engine_hit_rate"), "events": told.get("engine_hit_rate")},
            "store_hit_rate": {"guess": guess.get("store_hit_rate"), "events": told.get("store_hit_rate")},
            "later_cached_share": {"guess": guess["later_cached_share"], "events": told["later_cached_share"]},
        }  # fmt: skip
    if not {"vllm_alone", "two_sticky", "two_store"} <= rows.keys():
        return
    base = rows["vllm_alone"]
    same = {n: sum(x == y for x, y in zip(r["contexts"], base["contexts"], strict=True)) for n, r in rows.items()}
    alone_row, sticky, store = (summarize(n, rows[n]) for n in ("vllm_alone", "two_sticky", "two_store"))
    yield {
        "bench": "vllm_chat", "row": "summary", "sessions": args.sessions, "turns": args.turns,
        "same_conversations": same,
        "later_ttft_store_vs_alone": round(store["ttft_later_turns_s"] / alone_row["ttft_later_turns_s"], 3),
        "later_ttft_store_vs_sticky": round(store["ttft_later_turns_s"] / sticky["ttft_later_turns_s"], 3),
        "throughput_store_vs_alone": round(store["turns_per_s"] / alone_row["turns_per_s"], 3),
        "throughput_store_vs_sticky": round(store["turns_per_s"] / sticky["turns_per_s"], 3),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_chat", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="JSON lines (the only output format)")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--message-tokens", type=int, nargs=2, default=(128, 384))
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128, help="vLLM's page size")
    p.add_argument("--kv-blocks", type=int, default=40, help="pages of KV cache per server")
    p.add_argument("--dram", default="1GiB", help="the store's DRAM")
    p.add_argument("--store-block-tokens", type=int, default=128, help="tokens per stored block (the connector's)")
    p.add_argument(
        "--rows",
        nargs="+",
        default=["vllm_alone", "two_sticky", "two_store"],
        choices=["vllm_alone", "two_sticky", "two_store_sticky", "two_store", "two_store_events"],
        help="what to run",
    )
    p.add_argument("--save-decode", action="store_true", help="the connector saves blocks completed while decoding")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None, help="directory for the servers' logs (default: a temporary one)")
    args = p.parse_args(argv)
    return print_rows(lambda: run(args), [("vLLM", vllm_python(), "scripts/vllm-env.sh")])


if __name__ == "__main__":
    raise SystemExit(main())
