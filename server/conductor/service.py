"""The conductor service (``kvstore conductor``): an HTTP front door that schedules by where KV lives.

For each completion request it hashes the prompt into the workers' block keys,
asks the master which node holds how much of the prefix
(:class:`~kvstore.protocol.MatchPrefixNodes`), lets :class:`kvstore.scheduling.Scheduler`
choose a prefill and a decode worker (or reject with 429 and the reason), has
hot fetched blocks copied to the chosen prefill node, calls the prefill worker,
then the decode worker, and answers in the shape of OpenAI's completions API
with what it predicted and what it measured.

Its predictions learn from the workers: the prefill model starts from the
coefficients a prefill worker fitted at start (``/info``); once four prompt
shapes have been measured it is a fit of its own on the time to first token of
every prefill, less its wait for the engine and its load (``track="latest"``: a
busy machine is predicted busy); the load bandwidth and the decode step time follow each
response. A decode worker serves one request at a time, so its "TBT" under
load is ``step x requests``: the share of its token rate a request gets.

Failures: a worker that fails a call or a health check is marked down at once
(and up again when its health check passes); the request is retried once on
another worker. A master that cannot be reached turns routing to load-only
(``kvstore_conductor_master_reachable 0``) instead of failing requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstore.auth import cluster_credential, secret_from
from kvstore.config import ConductorConfig
from kvstore.costs import PrefillCostModel
from kvstore.errors import ConnectionFailed, InvalidArgument, KVStoreError, NoNodes
from kvstore.keys import block_keys
from kvstore.protocol import MAX_BATCH_KEYS, MatchPrefixNodes, MatchPrefixNodesReply, Replicate, ReplicateReply
from kvstore.scheduling import (
    NO_LOCALITY,
    Decision,
    DecodeInstance,
    DecodeModel,
    Locality,
    PrefillInstance,
    Request,
    Scheduler,
    Slo,
    TransferModel,
)
from server.conductor.engine_events import EngineEvents
from server.conductor.metrics import ConductorMetrics
from server.conductor.openai import (
    ENGINE_CACHE_BYTES_PER_S,
    NOMINAL_PREFILL,
    UNKEYED_FIELDS,
    Answer,
    ClientGone,
    EngineCache,
    discover,
    merge_chunks,
    relay,
    sse,
    upstream_body,
)
from server.conductor.workers import DECODE_FIELDS, PREFILL_FIELDS, Worker, WorkerError, check_fields
from transfer.discovery import MasterLocator
from transfer.leader_link import LeaderLink
from transfer.link import fixed_credential
from transfer.tls import contexts

log = logging.getLogger(__name__)


class Conductor:
    """Who changes what: request handlers schedule and report to the scheduler; the health loop marks
    workers up and down; nothing else touches the scheduler."""

    def __init__(self, config: ConductorConfig) -> None:
        self.config = config
        self.workers: dict[str, Worker] = {}
        self.scheduler: Scheduler | None = None
        self.namespace = ""
        self.block_tokens = 0
        self.vocab = 0
        self.model = ""
        self._session: aiohttp.ClientSession | None = None
        # To a master that authenticates, as the cluster (the secret of cluster_secret_file or
        # KVSTORE_CLUSTER_SECRET); over TLS where config.tls says.
        secret = secret_from(config.cluster_secret_file)
        credential = fixed_credential(cluster_credential(secret)) if secret is not None else None
        tls = contexts(config.tls)[0]
        # host:port, or etcd://.../id: the leader of an HA cluster, followed across failovers. Asked on
        # the event loop, one pipelined connection each.
        locator = MasterLocator(config.master, config.master_timeout_s) if config.master else None
        self._master = LeaderLink(locator, config.master_timeout_s, credential, tls) if locator else None
        # Copies wait for daemons: a connection of their own, so lookups never queue behind them.
        self._copier = LeaderLink(locator, 30.0, credential, tls) if locator else None
        self._copy: asyncio.Task[None] | None = None
        """The copy under way, or the last one."""
        self._master_down_until = 0.0
        self.master_reachable = config.master is not None
        self._ids = itertools.count(1)
        self._health_task: asyncio.Task[None] | None = None
        self._tokenizer: Any = None
        self._caches: dict[str, EngineCache | EngineEvents] = {}
        """OpenAI servers: what each one's own prefix cache holds: from its KV events where it
        publishes them (``engine_events``), else a guess from what the conductor sent it."""
        self._served: set[str] = set()
        """OpenAI servers: every model name they serve (LoRA adapters included)."""
        # A stream may run as long as its answer does: what is bounded is the silence between chunks.
        self._stream = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=config.request_timeout_s)
        self._step_s = 0.05
        self._measured = PrefillCostModel(track="latest")
        """Prefill times as this conductor measures them (calls, lookup and save included)."""
        self.metrics = ConductorMetrics()

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        # A vLLM stream's first chunk carries the prompt's token ids: lines far longer than aiohttp's default.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s),
                                              read_bufsize=_STREAM_LINE_BYTES)  # fmt: skip
        deadline = time.monotonic() + self.config.start_timeout_s
        if self.config.openai:
            self.scheduler = await self._start_engines(deadline)
        else:
            self.scheduler = await self._start_workers(deadline)
        for w in self.workers.values():
            self.metrics.up.labels(w.name, w.role).set(1)
        if self.config.tokenizer:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer, local_files_only=True)
        self.metrics.master.set(1 if self._master is not None else 0)
        for cache in self._caches.values():
            if isinstance(cache, EngineEvents):
                cache.start()
        self._health_task = asyncio.create_task(self._health_loop(), name="kvstore-conductor-health")
        self._health_task.add_done_callback(_log_death)

    async def _start_workers(self, deadline: float) -> Scheduler:
        """Prefill and decode workers (``kvstore worker``): each says what it serves at ``/info``."""
        for role, urls in (("prefill", self.config.prefill), ("decode", self.config.decode)):
            for i, url in enumerate(urls):
                info = await self._wait_info(url.rstrip("/"), deadline)
                if info.get("role") != role:
                    raise InvalidArgument(f"{url} is a {info.get('role')} worker, given as {role}")
                self.workers[f"{role}-{i}"] = Worker(f"{role}-{i}", url.rstrip("/"), role, info)
        prefill = [w for w in self.workers.values() if w.role == "prefill"]
        first = prefill[0].info
        for w in self.workers.values():
            if (w.info["namespace"], w.info["block_tokens"]) != (first["namespace"], first["block_tokens"]):
                raise InvalidArgument(f"{w.url} serves another model or layout than {prefill[0].url}")
        self.namespace, self.block_tokens = first["namespace"], int(first["block_tokens"])
        self.vocab, self.model = int(first["vocab_size"]), str(first["model"])
        bandwidth = float(first.get("load_bytes_per_s") or 1e9)
        top = max(4 * self.block_tokens, int(first.get("max_tokens") or 4096))
        return self._build_scheduler(
            first["prefill_coefficients"], top, int(first["block_bytes"]), bandwidth, bandwidth,
            float(first.get("load_latency_s") or 0.0),
        )  # fmt: skip

    async def _start_engines(self, deadline: float) -> Scheduler:
        """OpenAI servers (``vllm serve`` with the KVStoreConnector): each is its own prefill and decode
        instance, on a "node" of its own (its prefix cache); the store is where the others load from."""
        assert self._session is not None
        urls = [u.rstrip("/") for u in self.config.openai]
        infos = await asyncio.gather(*(discover(self._session, u, deadline) for u in urls))
        for i, (url, info) in enumerate(zip(urls, infos, strict=True)):
            if info.scheme() != infos[0].scheme():
                raise InvalidArgument(
                    f"{url} serves {info.model!r} under {info.namespace} in blocks of {info.block_tokens} tokens;"
                    f" {urls[0]} serves {infos[0].model!r} under {infos[0].namespace} in blocks of"
                    f" {infos[0].block_tokens}: servers behind one conductor must share their keys"
                )  # fmt: skip
            name = f"engine-{i}"
            self.workers[name] = Worker(name, url, "engine", {"node": name, "max_tokens": info.max_model_len})
            blocks = info.kv_tokens // info.block_tokens if info.kv_tokens else None
            endpoint = self.config.engine_events[i] if self.config.engine_events else ""
            cache: EngineCache | EngineEvents
            if endpoint:
                replay = self.config.engine_events_replay[i] if self.config.engine_events_replay else ""
                cache = EngineEvents(endpoint, replay, info.namespace, info.block_tokens)
                self.metrics.engine_events.labels(name).set_function(functools.partial(getattr, cache, "seq"))
            else:
                cache = EngineCache(blocks)
            self._caches[name] = cache
            self.metrics.engine_blocks.labels(name).set_function(functools.partial(len, cache))
        first = infos[0]
        self.namespace, self.block_tokens, self.model = first.namespace, first.block_tokens, first.model
        self._served = {m for info in infos for m in info.models}
        top = max(4 * self.block_tokens, first.max_model_len or 4096)
        # Until four prompt shapes are measured: a nominal CPU engine's cost (learned from then on).
        return self._build_scheduler(NOMINAL_PREFILL, top, first.block_bytes, self.config.load_bytes_per_s,
                                     ENGINE_CACHE_BYTES_PER_S, 0.0, colocated=True)  # fmt: skip

    def _build_scheduler(
        self, coefficients: Sequence[float], top: int, block_bytes: int, remote_bytes_per_s: float,
        local_bytes_per_s: float, latency_s: float, *, colocated: bool = False,
    ) -> Scheduler:  # fmt: skip
        """``colocated``: each instance decodes what it prefilled (a server batching its requests' steps:
        its step time is the learned ``base_s``, not a per-request share)."""
        model = PrefillCostModel()  # the seed, until the conductor has measured enough shapes
        a, b, c = coefficients
        for new in (self.block_tokens // 2, self.block_tokens, top // 4, top // 2, top):
            for past in (0, top // 2):
                model.observe(max(1, new), past, a + b * new + c * new * (new + 2 * past))
        per_token = max(1, block_bytes // self.block_tokens)
        sched = Scheduler(
            prefill_model=model,
            transfer=TransferModel(per_token, remote_bytes_per_s, local_bytes_per_s, latency_s),
            decode_model=DecodeModel(base_s=self._step_s, per_request_s=0.0) if colocated else
            DecodeModel(base_s=0.0, per_request_s=self._step_s),
            policy=self.config.policy, slo=Slo(self.config.ttft_slo_s, self.config.tbt_slo_s),
            early_rejection=self.config.early_rejection, decode_load=self.config.decode_load,
            balancing_threshold=self.config.balancing_threshold, replicate_max_tokens=self.config.replicate_tokens,
            decode_time_s=1.0, colocated=colocated,
        )  # fmt: skip
        for w in self.workers.values():
            if w.role in ("prefill", "engine"):
                sched.add_prefill(w.name, node=w.node, max_tokens=w.info.get("max_tokens"))
            if w.role in ("decode", "engine"):
                sched.add_decode(w.name)
        return sched

    async def _wait_info(self, url: str, deadline: float) -> dict[str, Any]:
        assert self._session is not None
        while True:
            try:
                async with self._session.get(url + "/info", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status == 200:
                        info: dict[str, Any] = await resp.json()
                        return info
            except (TimeoutError, aiohttp.ClientError):
                pass
            if time.monotonic() > deadline:
                raise ConnectionFailed(f"worker {url} did not answer /info within {self.config.start_timeout_s} s")
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        for cache in self._caches.values():
            if isinstance(cache, EngineEvents):
                await cache.close()
        for link in (self._master, self._copier):
            if link is not None:
                await link.close()
        if self._copy is not None:
            await asyncio.gather(self._copy, return_exceptions=True)  # ended by its link's close

    async def _health_loop(self) -> None:
        assert self._session is not None and self.scheduler is not None
        period = self.config.health_period_s
        while True:
            await asyncio.sleep(period)
            checks = [self._healthy(w, period) for w in self.workers.values()]
            for w, answer in zip(self.workers.values(), await asyncio.gather(*checks), strict=True):
                self._set_up(w, w.checked(answer, self._instance(w).up))

    async def _healthy(self, w: Worker, timeout: float) -> bool | None:
        """True: healthy; False: refused, or answered otherwise; None: no answer within ``timeout``."""
        assert self._session is not None
        try:
            async with self._session.get(w.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status == 200
        except TimeoutError:  # aiohttp's ServerTimeoutError too (it is both)
            return None
        except aiohttp.ClientError:
            return False

    def _instance(self, w: Worker) -> PrefillInstance | DecodeInstance:
        """The scheduler's instance of ``w`` (an engine's prefill side stands for both)."""
        assert self.scheduler is not None
        return self.scheduler.prefill.get(w.name) or self.scheduler.decode[w.name]

    def _set_up(self, w: Worker, up: bool) -> None:
        assert self.scheduler is not None
        if self._instance(w).up != up:
            log.warning("%s worker %s (%s) is %s", w.role, w.name, w.url, "up" if up else "down")
            self.scheduler.set_up(w.name, up)
            if w.name in self._caches:
                self._caches[w.name].clear()  # a server that went away may come back empty
        self.metrics.up.labels(w.name, w.role).set(1 if up else 0)

    # -- locality ----------------------------------------------------------------------------
    async def locality(self, keys: list[str]) -> Locality | None:
        """Where the prefix is, in tokens; None when the master cannot be asked (load-only routing)."""
        if self._master is None or not keys:
            return NO_LOCALITY if self._master is not None else None
        if time.monotonic() < self._master_down_until:
            return None
        try:
            reply = await asyncio.wait_for(self._match(keys), self.config.master_timeout_s * 2)
            match = reply.prefix_match(len(keys))
        except (KVStoreError, OSError, TimeoutError) as exc:
            if self.master_reachable:
                log.warning("master %s unreachable, routing by load only: %s", self.config.master, exc)
            self.master_reachable = False
            self.metrics.master.set(0)
            self._master_down_until = time.monotonic() + self.config.health_period_s
            return None
        self.master_reachable = True
        self.metrics.master.set(1)
        bt = self.block_tokens
        return Locality(match.longest * bt, {node: p.total * bt for node, p in match.nodes.items()})

    async def _match(self, keys: list[str]) -> MatchPrefixNodesReply:
        """The stored prefix of a request's first MAX_BATCH_KEYS blocks (what a request to the master
        may name; a longer prompt is placed by its first hundred thousand tokens or so). One attempt,
        and one more at once at a new leader (the first lookup after a failover finds it)."""
        assert self._master is not None
        message = MatchPrefixNodes(keys[:MAX_BATCH_KEYS])
        return await self._master.call(message, MatchPrefixNodesReply, retry_for=0.0, retry_moved=True)

    def _replicate_later(self, keys: list[str], first: int, tokens: int, worker: Worker) -> None:
        """Copy the fetched blocks ``keys[first:]`` (``tokens`` of them at most) to the worker's node, in the
        background; one copy at a time (a copy under way makes the next request skip its own)."""
        blocks = keys[first : first + min(tokens // self.block_tokens, MAX_BATCH_KEYS)]
        if not blocks or worker.node is None or self._copier is None:
            return
        if self._copy is not None and not self._copy.done():
            return
        budget = len(blocks) * int(worker.info["block_bytes"])
        task = asyncio.create_task(self._replicate(blocks, worker.node, budget), name="kvstore-conductor-copy")
        task.add_done_callback(_log_death)
        self._copy = task

    async def _replicate(self, keys: list[str], node: str, max_bytes: int) -> None:
        assert self._copier is not None
        try:
            message = Replicate(keys, node, max_bytes)
            reply = await self._copier.call(message, ReplicateReply, retry_for=0.0, retry_moved=True)
            self.metrics.replicated.inc(reply.copied)
        except (KVStoreError, OSError) as exc:
            log.info("copying %d blocks to %s failed: %s", len(keys), node, exc)

    # -- requests ----------------------------------------------------------------------------
    def parse(self, body: Any) -> tuple[list[int], int]:
        """(prompt token ids, tokens to generate) of a completions body; InvalidArgument names the fault."""
        if not isinstance(body, dict):
            raise InvalidArgument("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model and model not in self._served:
            raise LookupError(f"model {model!r} is not served here (this conductor serves {self.model!r})")
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            if self._tokenizer is None:
                raise InvalidArgument("text prompts need a conductor started with --tokenizer; send token ids")
            prompt = list(self._tokenizer.encode(prompt))
        if not isinstance(prompt, list) or not prompt:
            raise InvalidArgument("'prompt' must be a non-empty list of token ids (or text, with a tokenizer)")
        if not all(type(t) is int and 0 <= t < (self.vocab or 1 << 31) for t in prompt):
            raise InvalidArgument(f"'prompt' must hold token ids in [0, {self.vocab or 1 << 31})")
        new = body.get("max_tokens")
        new = 16 if new is None else new
        if type(new) is not int or not 1 <= new <= 1 << 16:
            raise InvalidArgument("'max_tokens' must be an integer in [1, 65536]")
        limit = min((int(w.info["max_tokens"]) for w in self.workers.values() if w.info.get("max_tokens")), default=0)
        if limit and len(prompt) + new > limit:
            raise InvalidArgument(f"{len(prompt)} prompt tokens + {new} to generate exceed the model's {limit}")
        return prompt, new

    async def complete(self, prompt: list[int], max_new: int) -> tuple[int, dict[str, Any]]:
        """Schedule and run one request; (HTTP status, body)."""
        sched = self.scheduler
        assert sched is not None
        received = time.perf_counter()
        keys = [str(k) for k in block_keys(prompt, self.block_tokens, self.namespace)]
        loc = await self.locality(keys)
        policy = None
        if loc is None:
            loc, policy = NO_LOCALITY, "load"
            self.metrics.fallback.inc()
        rid = next(self._ids)
        request = Request(rid, len(prompt), max_new)
        tried: list[str] = []
        try:
            while True:
                decision = sched.schedule(request, loc, time.perf_counter(), exclude=tried, policy=policy)
                if not decision.accepted:
                    return 429, self._rejected(decision)
                assert decision.prefill is not None and decision.decode is not None
                worker = self.workers[decision.prefill]
                if decision.replicate_tokens:
                    self._replicate_later(keys, decision.local_tokens // self.block_tokens,
                                          decision.replicate_tokens, worker)  # fmt: skip
                self.metrics.routed.labels(worker.name, "prefill").inc()
                attempt = time.perf_counter()
                try:
                    pre = check_fields(await self._call(worker, "/prefill", {"tokens": prompt}), PREFILL_FIELDS)
                    break
                except WorkerError as exc:
                    sched.forget(rid, time.perf_counter())
                    if 400 <= exc.status < 500:
                        raise InvalidArgument(str(exc)) from None
                    self._set_up(worker, False)
                    if tried:
                        raise
                    tried.append(worker.name)
                    self.metrics.retries.labels("prefill").inc()
            done = time.perf_counter()
            ttft = done - received
            self._learn_prefill(pre, done - attempt)  # this attempt only: a failed one is not the model's
            self.metrics.ttft.labels("predicted").observe(decision.ttft_s)
            self.metrics.ttft.labels("measured").observe(ttft)
            self.metrics.error.observe(abs(decision.ttft_s - ttft) / ttft if ttft > 0 else 0.0)
            self.metrics.prompt.inc(len(prompt))
            self.metrics.hit.inc(min(loc.longest, len(prompt)))
            self.metrics.loaded.inc(pre["loaded_tokens"])
            decode_name = sched.prefill_done(rid, time.perf_counter())
            dec, decode_name = await self._decode(rid, decode_name, prompt, pre["first_token"], max_new)
            sched.decode_done(rid, time.perf_counter())
        except BaseException:
            sched.forget(rid, time.perf_counter())  # whatever went wrong, the request holds no queue
            raise
        self._step_s += 0.2 * (float(dec.get("tbt_s") or self._step_s) - self._step_s)
        sched.decode_model = replace(sched.decode_model, per_request_s=self._step_s)
        self.metrics.requests.labels("ok").inc()
        tokens = dec["tokens"]
        text = self._tokenizer.decode(tokens) if self._tokenizer is not None else ""
        return 200, {
            "id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": self.model,
            "choices": [{"index": 0, "text": text, "tokens": tokens, "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens),
                      "total_tokens": len(prompt) + len(tokens)},
            "kvstore": {
                "prefill": worker.name, "decode": decode_name,
                "retried": bool(tried), "routing": policy or sched.policy_name,
                "ttft_s": round(ttft, 6), "predicted_ttft_s": round(decision.ttft_s, 6),
                "predicted_queue_s": round(decision.queue_s, 6), "stored_prefix_tokens": loc.longest,
                "local_prefix_tokens": decision.local_tokens, "tbt_s": dec.get("tbt_s"),
                "prefill_result": pre, "decode_result": {k: v for k, v in dec.items() if k != "tokens"},
            },
        }  # fmt: skip

    def _rejected(self, decision: Decision) -> dict[str, Any]:
        self.metrics.rejections.labels(decision.reason).inc()
        self.metrics.requests.labels("rejected").inc()
        return {"error": {
            "type": "rejected", "message": f"predicted to miss its SLO: {decision.reason}",
            "reason": decision.reason, "predicted_ttft_s": round(decision.ttft_s, 4),
            "predicted_tbt_s": round(decision.tbt_s, 4), "decode_load": round(decision.decode_load, 3),
        }}  # fmt: skip

    async def _decode(
        self, rid: int, name: str, prompt: list[int], first: int, max_new: int
    ) -> tuple[dict[str, Any], str]:
        """Run the decode on ``name``; on a failure there, once more on the least busy other decode worker."""
        sched = self.scheduler
        assert sched is not None
        body = {"tokens": prompt, "first_token": first, "max_new_tokens": max_new}
        for attempt in range(2):
            worker = self.workers[name]
            self.metrics.routed.labels(name, "decode").inc()
            try:
                return check_fields(await self._call(worker, "/decode", body), DECODE_FIELDS), name
            except WorkerError as exc:
                if 400 <= exc.status < 500:
                    raise InvalidArgument(str(exc)) from None
                self._set_up(worker, False)
                others = [d for d in sched.decode.values() if d.up and d.name != name]
                if attempt or not others:
                    raise
            name = min(others, key=lambda d: d.active_count).name
            sched.move_decode(rid, name, time.perf_counter())
            self.metrics.retries.labels("decode").inc()
        raise AssertionError("unreachable")

    async def _call(self, worker: Worker, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self._session is not None
        try:
            async with self._session.post(worker.url + path, json=body) as resp:
                data = await resp.json(content_type=None)
                if resp.status != 200:
                    error = data.get("error") if isinstance(data, dict) else None
                    message = error.get("message") if isinstance(error, dict) else error
                    raise WorkerError(f"{worker.name}{path}: {message or resp.reason}", resp.status)
                if not isinstance(data, dict):
                    raise WorkerError(f"{worker.name}{path} answered {type(data).__name__}, not an object")
                return data
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise WorkerError(f"{worker.name}{path} failed: {type(exc).__name__}: {exc}") from None

    def _learn_prefill(self, pre: dict[str, Any], ttft: float) -> None:
        """Follow the worker: the time to first token of the tokens it computed, without its queue wait and
        its load (the lookup, the calls and the save are in: they are part of what a caller waits for), and
        its load bandwidth."""
        sched = self.scheduler
        assert sched is not None
        computed, loaded, load_s = pre["computed_tokens"], pre["loaded_tokens"], pre["load_s"]
        waited = pre["service_s"] - pre["engine_s"]
        busy = ttft - waited - load_s
        if computed > 0 and busy > 0:
            self._measured.observe(computed, loaded, busy)  # checked fields: cannot raise
            if self._measured.samples >= 4:  # enough shapes for a fit of its own: stop leaning on the seed
                sched.prefill_model = self._measured
        t = sched.transfer
        if loaded > 0 and load_s > 0:
            rate = loaded * t.bytes_per_token / load_s
            bandwidth = t.remote_bytes_per_s + 0.3 * (rate - t.remote_bytes_per_s)
            sched.transfer = replace(t, remote_bytes_per_s=bandwidth, local_bytes_per_s=bandwidth)

    # -- OpenAI servers ------------------------------------------------------------------------
    async def _engine_locality(self, keys: list[str]) -> tuple[Locality, int]:
        """(locality, tokens the store holds): per server, the prefix its own cache probably holds (its
        "node"); what any server can load is what the store holds (nothing, without the master)."""
        found = await self.locality(keys)
        if found is None:
            self.metrics.fallback.inc()
        stored = found.longest if found is not None else 0
        held = {name: cache.held(keys) * self.block_tokens for name, cache in self._caches.items()}
        return Locality(stored, held), stored

    async def _forward(self, request: web.Request, body: Any, prompt: list[int], new: int) -> web.StreamResponse:
        """A completion on an OpenAI server: scheduled by locality and queues, streamed from the server,
        relayed as a stream or merged into one answer. A server that cannot be reached or is unavailable
        (502-504) before answering is marked down and the request tried once more on another; whatever
        happens after scheduling, the request leaves the scheduler's queues."""
        sched, session = self.scheduler, self._session
        assert sched is not None and session is not None
        received = time.perf_counter()
        upstream, keep = upstream_body(body, self.model, prompt)
        # The conductor's keys are the tokens' alone: a request whose KV also depends on an adapter, a salt
        # or embeddings shares no blocks with them, so it is routed by load and teaches the caches nothing.
        plain = body.get("model") in (None, self.model) and not any(body.get(k) for k in UNKEYED_FIELDS)
        keys = [str(k) for k in block_keys(prompt, self.block_tokens, self.namespace)] if plain else []
        loc, stored = await self._engine_locality(keys) if plain else (NO_LOCALITY, 0)
        rid = next(self._ids)
        tried: list[str] = []
        answer: Answer | None = None
        out: web.StreamResponse | None = None
        try:
            while True:
                try:
                    decision = sched.schedule(Request(rid, len(prompt), new), loc, time.perf_counter(),
                                              exclude=tried)  # fmt: skip
                except NoNodes as exc:
                    self.metrics.requests.labels("failed").inc()
                    return _error(503, f"NoNodes: {exc}")
                if not decision.accepted:
                    return web.json_response(self._rejected(decision), status=429)
                assert decision.prefill is not None
                worker = self.workers[decision.prefill]
                self.metrics.routed.labels(worker.name, "engine").inc()
                sent = time.perf_counter()
                try:
                    reply = await session.post(worker.url + "/v1/completions", json=upstream, timeout=self._stream)
                except (TimeoutError, aiohttp.ClientError) as exc:
                    failure = f"{worker.name} failed: {type(exc).__name__}: {exc}"
                else:
                    if reply.status == 200:
                        break
                    data = await reply.read()
                    reply.release()
                    if reply.status not in (502, 503, 504):  # the request's fault or the server's: its words
                        sched.forget(rid, time.perf_counter())
                        self.metrics.requests.labels("bad_request" if reply.status < 500 else "failed").inc()
                        return web.Response(body=data, status=reply.status, content_type="application/json")
                    failure = f"{worker.name} answered {reply.status}: {data[:200]!r}"
                sched.forget(rid, time.perf_counter())
                self._set_up(worker, False)
                if tried:
                    self.metrics.requests.labels("failed").inc()
                    return _error(503, failure)
                tried.append(worker.name)
                self.metrics.retries.labels("engine").inc()
            # The server computes or loads the prompt now: requests arriving meanwhile that share the
            # prefix find it there (its answer's blocks are added when it ends).
            self._caches[worker.name].touch(keys)

            def first_token(at: float) -> None:
                sched.prefill_done(rid, at)

            answer = Answer(sent, on_first=first_token)
            if body.get("stream"):
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                  "X-KVStore-Engine": worker.name})  # fmt: skip
                await out.prepare(request)
            try:
                await relay(reply, answer, out, keep)
            except (TimeoutError, aiohttp.ClientError, HttpProcessingError, ValueError) as exc:
                answer.error = f"{worker.name} failed mid-answer: {type(exc).__name__}: {exc}"
                self._set_up(worker, False)
            finally:
                reply.release()
        except ClientGone:
            self.metrics.requests.labels("cancelled").inc()  # released above: the server aborts the request
            if answer is not None:
                answer.error = "the client went away"
            assert out is not None
            return out
        finally:
            if answer is None or answer.first is None or answer.error is not None:
                sched.forget(rid, time.perf_counter())  # whatever went wrong, the request holds no queue
        if answer.first is None or answer.error is not None:
            self.metrics.requests.labels("failed").inc()
            message = answer.error or f"{worker.name} answered no token"
            if out is None:
                return _error(503, message)
            with contextlib.suppress(ConnectionError):
                await out.write(sse({"error": {"message": message, "status": 503}}))
                await out.write_eof()
            return out
        sched.decode_done(rid, time.perf_counter())
        self._learn_engine(decision, len(prompt), answer, received)
        self.metrics.hit.inc(min(stored, len(prompt)))
        self.metrics.requests.labels("ok").inc()
        if plain:
            self._caches[worker.name].touch(
                str(k) for k in block_keys(prompt + answer.output, self.block_tokens, self.namespace)
            )  # fmt: skip
        if out is not None:
            with contextlib.suppress(ConnectionError):
                await out.write(b"data: [DONE]\n\n")
                await out.write_eof()
            return out
        merged = merge_chunks(answer.chunks)
        merged["kvstore"] = {
            "engine": worker.name, "retried": bool(tried), "routing": sched.policy_name,
            "predicted_ttft_s": round(decision.ttft_s, 6), "predicted_queue_s": round(decision.queue_s, 6),
            "stored_prefix_tokens": stored, "engine_prefix_tokens": decision.local_tokens,
            "ttft_s": round(answer.first - received, 6),
        }  # fmt: skip
        return web.json_response(merged)

    def _learn_engine(self, decision: Decision, prompt_tokens: int, answer: Answer, received: float) -> None:
        """Follow the server: its time to first token for the tokens it computed (the prefix it reused: what
        it reports in usage where it does, else what was predicted), and its time per token since."""
        assert answer.first is not None and self.scheduler is not None
        sched = self.scheduler
        ttft = answer.first - answer.sent
        self.metrics.ttft.labels("predicted").observe(decision.ttft_s)
        self.metrics.ttft.labels("measured").observe(answer.first - received)
        self.metrics.error.observe(abs(decision.ttft_s - ttft) / ttft if ttft > 0 else 0.0)
        self.metrics.prompt.inc(prompt_tokens)
        reused = min(answer.cached if answer.cached is not None else decision.prefix_tokens, prompt_tokens - 1)
        if ttft > 0:
            self._measured.observe(prompt_tokens - reused, reused, ttft)
            if self._measured.samples >= 4:
                sched.prefill_model = self._measured
        if len(answer.output) > 1 and answer.last is not None:
            tbt = (answer.last - answer.first) / (len(answer.output) - 1)
            self._step_s += 0.2 * (tbt - self._step_s)
            # A server batches its requests' decode steps: the step it gives a request now, whatever the count.
            sched.decode_model = replace(sched.decode_model, base_s=self._step_s)

    # -- HTTP --------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes([
            web.post("/v1/completions", self._completions), web.get("/metrics", self._metrics_route),
            web.get("/health", self._health), web.get("/v1/models", self._models),
        ])  # fmt: skip
        return app

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            self.metrics.requests.labels("bad_request").inc()
            return _error(400, "the body is not JSON")
        try:
            prompt, new = self.parse(body)
            if self.config.openai:
                return await self._forward(request, body, prompt, new)
            status, out = await self.complete(prompt, new)
        except LookupError as exc:
            self.metrics.requests.labels("bad_request").inc()
            return _error(404, str(exc.args[0]))
        except InvalidArgument as exc:
            self.metrics.requests.labels("bad_request").inc()
            return _error(400, str(exc))
        except (NoNodes, WorkerError, KVStoreError) as exc:
            self.metrics.requests.labels("failed").inc()
            return _error(503, f"{type(exc).__name__}: {exc}")
        return web.json_response(out, status=status)

    async def _metrics_route(self, _: web.Request) -> web.Response:
        sched = self.scheduler
        if sched is not None:
            now = time.perf_counter()
            for p in sched.prefill.values():
                self.metrics.queue.labels(p.name).set(p.queue_s(now))
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _health(self, _: web.Request) -> web.Response:
        sched = self.scheduler
        up = {} if sched is None else {n: sched.prefill[n].up if n in sched.prefill else sched.decode[n].up
                                        for n in self.workers}  # fmt: skip
        return web.json_response({"ok": True, "master_reachable": self.master_reachable, "workers": up})

    async def _models(self, _: web.Request) -> web.Response:
        names = [self.model, *sorted(self._served - {self.model})]
        return web.json_response({"object": "list", "data": [{"id": n, "object": "model"} for n in names]})


_STREAM_LINE_BYTES = 1 << 22


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "status": status}}, status=status)


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("conductor task %s died: %r", task.get_name(), task.exception())
