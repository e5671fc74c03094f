"""OpenAI-compatible engine servers behind the conductor (``kvstore conductor --openai URL ...``).

Each server (``vllm serve`` with the store's ``KVStoreConnector``) prefills and decodes its
own requests, keeps its own prefix cache and loads from the store what other servers
computed. What the conductor reads of a server, at start:

- ``GET /v1/models``: the served model's name and its longest context;
- ``GET /metrics``: the connector's key scheme (``vllm:kvstore_layout_info``: namespace,
  tokens and bytes per block) and the engine's KV cache size (``vllm:cache_config_info``).
  The connector reports its scheme with its first statistics: a server that has not served
  a request yet is sent one of a single token first.

A prompt's locality is then two things: how much of it the store holds (the master's prefix
match on the keys the connector writes), and how much each server's own prefix cache
probably still holds (:class:`EngineCache`, the blocks the conductor sent it, least recently
used first out, as many as its KV cache takes): a turn of a conversation goes back to the
server that holds its history unless another one, loading it from the store, is predicted to
answer sooner.

Answers are streamed from the server whatever the client asked (the first chunk is the time to
first token the conductor learns from); a client that did not ask for a stream gets the chunks
merged into one completion (:func:`merge_chunks`).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from kvstore.engine_blocks import leading
from kvstore.errors import ConnectionFailed, InvalidArgument

NOMINAL_PREFILL = (0.02, 2e-4, 0.0)
"""Seconds per prefill (fixed, per token, per token pair) assumed of an OpenAI server until measured."""
ENGINE_CACHE_BYTES_PER_S = math.inf
"""A server's own prefix cache costs nothing to reuse (its load time is exactly 0)."""
UNKEYED_FIELDS = ("cache_salt", "prompt_embeds", "multi_modal_data", "lora_request")
"""Request fields that change the KV beyond the tokens (the connector's keys carry them; the conductor's do not)."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the conductor needs of one OpenAI server."""

    model: str
    models: tuple[str, ...]
    """Every name it serves: the model and its LoRA adapters."""
    max_model_len: int | None
    namespace: str
    block_tokens: int
    block_bytes: int
    kv_tokens: int | None
    """The engine's KV cache, in tokens (its prefix cache holds at most this much)."""

    def scheme(self) -> tuple[str, str, int, int]:
        return self.model, self.namespace, self.block_tokens, self.block_bytes


class EngineCache:
    """The blocks an engine's own prefix cache probably holds: those of the prompts and answers the
    conductor sent it, the least recently used dropped first once its KV cache is full."""

    def __init__(self, capacity_blocks: int | None) -> None:
        self.capacity = capacity_blocks
        self._keys: OrderedDict[str, None] = OrderedDict()

    def held(self, keys: Sequence[str]) -> int:
        """Leading blocks of ``keys`` held."""
        return leading(keys, self._keys)

    def touch(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while self.capacity is not None and len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        """The engine restarted or failed: its cache is gone."""
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)


async def discover(session: aiohttp.ClientSession, url: str, deadline: float) -> EngineInfo:
    """Read a server's model and the connector's key scheme; wait for the server until ``deadline``
    (monotonic); ConnectionFailed when it never answers, InvalidArgument when it has no KVStoreConnector."""
    models = await _get_json(session, url + "/v1/models", deadline)
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise InvalidArgument(f"{url}/v1/models lists no model")
    model = str(data[0]["id"])
    names = tuple(str(d["id"]) for d in data if isinstance(d, dict) and "id" in d)
    max_len = data[0].get("max_model_len")
    probed = False
    while True:
        metrics = await _get_text(session, url + "/metrics", deadline)
        scheme, kv_tokens = parse_metrics(metrics)
        if scheme is not None:
            namespace, block_tokens, block_bytes = scheme
            return EngineInfo(model, names, int(max_len) if isinstance(max_len, int) else None, namespace,
                              block_tokens, block_bytes, kv_tokens)  # fmt: skip
        if "vllm:kvstore_" not in metrics:
            raise InvalidArgument(
                f"{url} serves {model!r} without vllm:kvstore_ metrics: no KVStoreConnector, or vLLM's"
                " statistics are off (--disable-log-stats)"
            )
        if not probed:  # the connector reports its scheme with its first statistics: give it a step
            probed = True
            body = {"model": model, "prompt": [0], "max_tokens": 1}
            try:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()
            except (TimeoutError, aiohttp.ClientError):
                probed = False  # tried again on the next round, until the deadline
        if time.monotonic() > deadline:
            raise ConnectionFailed(f"{url} did not report the connector's key scheme (vllm:kvstore_layout_info)")
        await asyncio.sleep(0.5)


def parse_metrics(text: str) -> tuple[tuple[str, int, int] | None, int | None]:
    """((namespace, block tokens, block bytes) or None, KV cache tokens or None) from Prometheus text."""
    scheme = None
    kv_tokens = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "vllm:kvstore_layout_info" and sample.value == 1:
                scheme = (labels["namespace"], int(labels["block_tokens"]), int(labels["block_bytes"]))
            elif sample.name == "vllm:cache_config_info":
                size = labels.get("kv_cache_size_tokens", "")
                blocks, block = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
                if size.isdigit():
                    kv_tokens = int(size)
                elif blocks.isdigit() and block.isdigit():
                    kv_tokens = int(blocks) * int(block)
    return scheme, kv_tokens


async def _get_json(session: aiohttp.ClientSession, url: str, deadline: float) -> Any:
    while True:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    return await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise ConnectionFailed(f"{url} did not answer in time")
        await asyncio.sleep(0.5)


async def _get_text(session: aiohttp.ClientSession, url: str, deadline: float) -> str:
    while True:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    return await resp.text()
        except (TimeoutError, aiohttp.ClientError):
            pass
        if time.monotonic() > deadline:
            raise ConnectionFailed(f"{url} did not answer in time")
        await asyncio.sleep(0.5)


def merge_chunks(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """One completion from the chunks of its stream: texts, token ids and log-probabilities joined per
    choice, the last finish reason, the usage of the final chunk."""
    if not chunks:
        raise InvalidArgument("the stream carried no chunk")
    out = {k: v for k, v in chunks[0].items() if k not in ("choices", "usage")}
    out["object"] = "text_completion"
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.get("usage") or usage
        for part in chunk.get("choices") or []:
            index = int(part.get("index", 0))
            choice = choices.setdefault(index, {"index": index, "text": "", "logprobs": None, "finish_reason": None})
            choice["text"] += part.get("text") or ""
            for name in ("token_ids", "prompt_token_ids"):
                if part.get(name) is not None:
                    choice[name] = (choice.get(name) or []) + list(part[name]) if name == "token_ids" else part[name]
            if part.get("logprobs"):
                merged = choice["logprobs"] or {}
                for name, values in part["logprobs"].items():
                    merged[name] = (merged.get(name) or []) + list(values or [])
                choice["logprobs"] = merged
            for name in ("finish_reason", "stop_reason"):
                if part.get(name) is not None:
                    choice[name] = part[name]
    out["choices"] = [choices[i] for i in sorted(choices)]
    out["usage"] = usage
    return out


class ClientGone(Exception):
    """The client of a stream closed its connection."""


@dataclass(slots=True)
class Answer:
    """One answer of an OpenAI server, as it streams; ``on_first`` runs at its first token."""

    sent: float
    on_first: Callable[[float], None] | None = None
    first: float | None = None
    last: float | None = None
    output: list[int] = field(default_factory=list)
    """The token ids of the first choice."""
    cached: int | None = None
    chunks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Keep:
    """What of a server's chunks the client asked for (the conductor asks for token ids and usage)."""

    token_ids: bool
    usage: bool

    def chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        if not self.usage:
            chunk.pop("usage", None)
        if not self.token_ids:
            for part in chunk.get("choices") or []:
                part.pop("token_ids", None)
                part.pop("prompt_token_ids", None)
        return chunk


def upstream_body(body: dict[str, Any], model: str, prompt: list[int]) -> tuple[dict[str, Any], Keep]:
    """What the conductor sends a server for ``body`` (always a stream, with usage and, unless the prompt is
    echoed, token ids), and what of it goes back to the client."""
    stream = bool(body.get("stream"))
    given = body.get("stream_options")
    options: dict[str, Any] = given if isinstance(given, dict) else {}
    keep = Keep(bool(body.get("return_token_ids")), not stream or bool(options.get("include_usage")))
    upstream = {**body, "model": body.get("model") or model, "prompt": prompt, "stream": True,
                "stream_options": {**options, "include_usage": True}}  # fmt: skip
    if not body.get("echo"):  # vLLM leaves echoed prompt text empty when it returns token ids
        upstream["return_token_ids"] = True
    return upstream, keep


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def relay(
    reply: aiohttp.ClientResponse, answer: Answer, out: web.StreamResponse | None, keep: Keep
) -> None:  # fmt: skip
    """Read a server's event stream into ``answer``; pass each chunk on to a streaming client (ClientGone
    when it has left). A chunk that is not a JSON object raises ValueError."""
    async for raw in reply.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        chunk = json.loads(payload)
        if not isinstance(chunk, dict):
            raise ValueError(f"a stream chunk is a {type(chunk).__name__}")
        if "error" in chunk:
            error = chunk["error"]
            answer.error = str(error.get("message") if isinstance(error, dict) else error)
        now = time.perf_counter()
        for part in chunk.get("choices") or []:
            if not isinstance(part, dict) or part.get("index", 0) != 0:
                continue
            answer.output.extend(part.get("token_ids") or [])
            if answer.first is None:
                answer.first = now
                if answer.on_first is not None:
                    answer.on_first(now)
            answer.last = now
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                answer.cached = details["cached_tokens"]
        kept = keep.chunk(chunk)
        if out is None:
            answer.chunks.append(kept)
        elif kept.get("choices") or kept.get("usage") or "error" in kept:
            try:
                await out.write(sse(kept))
            except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one
                raise ClientGone(str(exc)) from None
