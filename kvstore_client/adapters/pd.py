"""Prefill and decode worker processes, and a multi-turn chat run through them (``kvstore pd-demo``).

:class:`WorkerPool` starts N prefill and M decode workers as processes, each
building the same seeded model from an :class:`EngineSpec` and connecting to the
store's master; a request goes to a worker by index and comes back as a future.
A worker that dies fails its pending requests with :class:`ConnectionFailed`;
every wait is bounded.

:func:`run_chat` drives a chat workload whose turns resend the whole conversation
(system prompt, earlier messages and answers, the new message) through a
conductor (``kvstore conductor``), which picks the prefill and decode workers by
where the prefix is stored; the prefill hands its KV to the decode worker through
the store, and the next turn of the session starts when the answer is back. For
each request it records what the store held of its prefix against what earlier
turns stored (``expected_hit_tokens``), TTFT measured and predicted, and the time
between tokens.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import os
import queue
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from kvstore.engine_blocks import leading
from kvstore.errors import ConnectionFailed, InvalidArgument, Timeout, error_from_code

Role = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What every worker needs to build the same model and KV layout as its peers (picklable)."""

    model_config: str | None = None
    """Path of a transformers ``config.json``; None for the small default Llama."""
    seed: int = 0
    dtype: str = "float32"
    block_tokens: int = 256
    threads: int = 1
    """torch threads per worker process."""
    load_policy: Literal["auto", "always", "never"] = "auto"
    tail: Literal["transfer", "recompute"] = "transfer"
    calibrate_tokens: int = 512
    timeout_s: float = 10.0
    """The store client's bound on each network wait."""
    put_mode: Literal["visible", "cached"] = "cached"
    """The workers' put mode: ``cached`` answers a save before the master knows of it, and a
    prefill flushes its saves before its decode is told (see ``ClientConfig.put_mode``)."""
    device: str = "cpu"
    """Where the model runs (``cuda`` on a GPU); blocks are staged in host memory either way."""

    def build(self) -> tuple[Any, Any]:
        """(model, layout) — the same in every process for the same spec."""
        from kvstore_client.adapters.hf import build_model, layout_for, load_model_config

        config = load_model_config(self.model_config)
        model = build_model(config, seed=self.seed, dtype=self.dtype, device=self.device)
        layout = layout_for(
            config, seed=self.seed, dtype=self.dtype, block_tokens=self.block_tokens, device=self.device
        )
        return model, layout


def _worker_main(role: Role, index: int, master: str, spec: EngineSpec, inbox: Any, outbox: Any) -> None:
    """A worker process: build the model, connect, then serve requests from ``inbox`` until None."""
    import torch

    from kvstore.config import ClientConfig
    from kvstore_client.adapters.workers import DecodeWorker, PrefillWorker
    from kvstore_client.store import Store

    torch.set_num_threads(spec.threads)
    try:
        model, layout = spec.build()
        store = Store.connect(master, ClientConfig(timeout_s=spec.timeout_s, put_mode=spec.put_mode))
        worker: PrefillWorker | DecodeWorker
        if role == "prefill":
            worker = PrefillWorker(model, layout, store, load_policy=spec.load_policy)
            info: dict[str, Any] = worker.calibrate(spec.calibrate_tokens)
        else:
            worker = DecodeWorker(model, layout, store, tail=spec.tail)
            info = {}
    except BaseException as exc:
        outbox.put(("failed", role, index, None, (getattr(exc, "code", 1), f"{type(exc).__name__}: {exc}")))
        return
    outbox.put(("ready", role, index, None, info))
    while True:
        msg = inbox.get()
        if msg is None:
            break
        request_id, kwargs = msg
        try:
            if isinstance(worker, PrefillWorker):
                keep = kwargs.pop("keep_logits", False)
                result = worker.prefill(kwargs["tokens"], keep_logits=keep)
                record = result.record() | ({"logits": result.logits} if keep else {})
            else:
                keep = kwargs.pop("keep_logits", False)
                d = worker.decode(
                    kwargs["tokens"], kwargs["first_token"], kwargs["max_new_tokens"], keep_logits=keep,
                    tail=kwargs.get("tail"),
                )  # fmt: skip
                record = d.record() | {"step_s": d.step_s} | ({"logits": d.logits} if keep else {})
            outbox.put(("done", role, index, request_id, record))
        except BaseException as exc:  # the request fails, the worker stays
            outbox.put(("error", role, index, request_id, (getattr(exc, "code", 1), f"{type(exc).__name__}: {exc}")))
    store.close()


class WorkerPool:
    """N prefill and M decode worker processes; requests by worker index, results as futures."""

    def __init__(
        self, master: str, spec: EngineSpec, *, prefill: int = 1, decode: int = 1, start_timeout_s: float = 600.0
    ) -> None:
        if prefill < 0 or decode < 0 or prefill + decode == 0:
            raise InvalidArgument(f"need at least one worker, got {prefill} prefill and {decode} decode")
        self.master = master
        self.spec = spec
        self.num_prefill, self.num_decode = prefill, decode
        self.start_timeout_s = start_timeout_s
        self.info: dict[tuple[Role, int], dict[str, Any]] = {}
        ctx = multiprocessing.get_context("spawn")  # torch and threads do not survive fork
        self._outbox = ctx.Queue()
        self._inboxes: dict[tuple[Role, int], Any] = {}
        self._procs: dict[tuple[Role, int], Any] = {}
        roles: tuple[tuple[Role, int], ...] = (("prefill", prefill), ("decode", decode))
        for role, count in roles:
            for i in range(count):
                key = (role, i)
                self._inboxes[key] = ctx.Queue()
                self._procs[key] = ctx.Process(
                    target=_worker_main, args=(role, i, master, spec, self._inboxes[key], self._outbox),
                    name=f"kvstore-{role}-{i}", daemon=True,
                )  # fmt: skip
        self._pending: dict[int, tuple[tuple[Role, int], Future[dict[str, Any]]]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None

    def start(self) -> WorkerPool:
        for proc in self._procs.values():
            proc.start()
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while len(self.info) < len(self._procs):
                try:
                    kind, role, index, _, payload = self._outbox.get(timeout=0.5)
                except queue.Empty:
                    dead = [k for k, p in self._procs.items() if not p.is_alive() and k not in self.info]
                    if dead:
                        raise ConnectionFailed(f"{dead[0][0]} worker {dead[0][1]} exited while starting") from None
                    if time.monotonic() > deadline:
                        raise Timeout(f"workers did not start within {self.start_timeout_s:.0f} s") from None
                    continue
                if kind == "failed":
                    raise error_from_code(payload[0], f"{role} worker {index} failed to start: {payload[1]}")
                self.info[(role, index)] = payload
        except BaseException:
            self.close()
            raise
        self._reader = threading.Thread(target=self._read_results, name="kvstore-pd-results", daemon=True)
        self._reader.start()
        return self

    def _read_results(self) -> None:
        while not self._stop.is_set():
            try:
                kind, role, index, request_id, payload = self._outbox.get(timeout=0.2)
            except queue.Empty:
                self._fail_dead_workers()
                continue
            except (EOFError, OSError):
                return
            with self._lock:
                entry = self._pending.pop(request_id, None)
            if entry is None:
                continue
            if kind == "done":
                entry[1].set_result(payload)
            else:
                entry[1].set_exception(error_from_code(payload[0], f"{role} worker {index}: {payload[1]}"))

    def _fail_dead_workers(self) -> None:
        with self._lock:
            dead = {k for k, p in self._procs.items() if not p.is_alive()}
            lost = [(rid, fut, key) for rid, (key, fut) in self._pending.items() if key in dead]
            for rid, _, _ in lost:
                del self._pending[rid]
        for _, fut, key in lost:
            code = self._procs[key].exitcode
            fut.set_exception(ConnectionFailed(f"{key[0]} worker {key[1]} exited (code {code}) with the request"))

    def submit(self, role: Role, index: int, **kwargs: Any) -> Future[dict[str, Any]]:
        """Send a request to worker ``index`` of ``role``.

        prefill: ``tokens``, ``keep_logits``; decode: ``tokens``, ``first_token``, ``max_new_tokens``,
        ``keep_logits``, ``tail``.
        """
        key = (role, index)
        if key not in self._procs:
            raise InvalidArgument(f"there is no {role} worker {index}")
        if self._reader is None:
            raise InvalidArgument("the pool is not started")
        future: Future[dict[str, Any]] = Future()
        request_id = next(self._ids)
        with self._lock:
            if not self._procs[key].is_alive():
                raise ConnectionFailed(f"{role} worker {index} is not running")
            self._pending[request_id] = (key, future)
        self._inboxes[key].put((request_id, kwargs))
        return future

    def kill(self, role: Role, index: int) -> None:
        """Kill one worker (for fault tests): its pending requests fail."""
        proc = self._procs[(role, index)]
        proc.kill()
        proc.join(timeout=10)

    def close(self) -> None:
        self._stop.set()
        for key, inbox in self._inboxes.items():
            if self._procs[key].is_alive():
                with contextlib.suppress(OSError, ValueError):
                    inbox.put(None)
        for proc in self._procs.values():
            if proc.pid is None:
                continue
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=5)
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for _, fut in pending:
            fut.set_exception(ConnectionFailed("the worker pool closed"))

    def __enter__(self) -> WorkerPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- a multi-turn chat through the pool ------------------------------------------------------


@dataclass(slots=True)
class ChatSession:
    session: int
    system: list[int]
    messages: list[list[int]]
    """The user's message of each turn."""
    max_new_tokens: int
    context: list[int] = field(default_factory=list)
    """Everything before the next message: system prompt, earlier messages and answers."""
    turn: int = 0


def chat_sessions(
    num_sessions: int,
    turns: int,
    *,
    vocab_size: int,
    system_prompts: int = 2,
    system_tokens: int = 512,
    message_tokens: tuple[int, int] = (64, 384),
    max_new_tokens: int = 32,
    seed: int = 0,
) -> list[ChatSession]:
    """Sessions of ``turns`` turns sharing a few system prompts; random token ids, deterministic for ``seed``."""
    if num_sessions < 1 or turns < 1 or system_prompts < 1 or max_new_tokens < 1 or vocab_size < 2:
        raise InvalidArgument("a chat needs sessions, turns, system prompts, new tokens and a vocabulary")
    lo, hi = message_tokens
    if not 1 <= lo <= hi:
        raise InvalidArgument(f"message_tokens must be 1 <= low <= high, got {message_tokens}")
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab_size) for _ in range(system_tokens)] for _ in range(system_prompts)]
    out = []
    for s in range(num_sessions):
        msgs = [[rng.randrange(vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(turns)]
        system = list(systems[s % system_prompts])
        out.append(ChatSession(s, system, msgs, max_new_tokens, context=list(system)))
    return out


Submit = Callable[[list[int], int], dict[str, Any]]
"""Run one request to completion: (prompt token ids, tokens to generate) -> the conductor's answer."""


def run_chat(
    submit: Submit,
    sessions: list[ChatSession],
    layout: Any,
    *,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every turn of every session through ``submit`` (sessions side by side, each turn after the
    previous one's answer); one record per request, in completion order, then one with ``elapsed_s``."""
    stored: set[str] = set()  # keys that completed requests put into the store
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    started = time.perf_counter()

    def converse(session: ChatSession) -> None:
        while session.turn < len(session.messages):
            prompt = session.context + session.messages[session.turn]
            keys = layout.keys(prompt)
            with lock:
                expected = leading(keys, stored) * layout.block_tokens
            sent = time.perf_counter()
            out = submit(prompt, session.max_new_tokens)
            rec = {"session": session.session, "turn": session.turn, "prompt_tokens": len(prompt),
                   "expected_hit_tokens": expected} | _record(out)  # fmt: skip
            rec["latency_s"] = round(time.perf_counter() - sent, 6)
            answer = out["choices"][0]["tokens"] if "choices" in out else []
            with lock:
                if answer:
                    stored.update(layout.keys(prompt + answer[:-1]))
                records.append(rec)
                if on_result is not None:
                    on_result(rec)
            session.context = prompt + answer
            session.turn += 1

    with ThreadPoolExecutor(max_workers=max(1, len(sessions)), thread_name_prefix="kvstore-chat") as pool:
        for future in [pool.submit(converse, s) for s in sessions]:
            future.result()
    records.append({"elapsed_s": time.perf_counter() - started})
    return records


def _record(out: dict[str, Any]) -> dict[str, Any]:
    """The fields of a request record from a conductor's completion answer (or its rejection)."""
    if "error" in out:
        return {"rejected": out["error"].get("reason") or out["error"].get("message", "")}
    k = out["kvstore"]
    pre, dec = k["prefill_result"], k["decode_result"]
    return {
        "prefill_worker": k["prefill"], "decode_worker": k["decode"], "retried": k["retried"],
        "prefill_matched_tokens": pre["matched_tokens"], "prefill_loaded_tokens": pre["loaded_tokens"],
        "prefill_decision": pre["decision"], "prefill_ttft_s": k["ttft_s"], "predicted_ttft_s": k["predicted_ttft_s"],
        "predicted_queue_s": k["predicted_queue_s"], "prefill_engine_s": pre.get("engine_s"),
        "stored_prefix_tokens": k["stored_prefix_tokens"], "local_prefix_tokens": k["local_prefix_tokens"],
        "decode_tail": dec["tail"], "tbt_s": dec["tbt_s"], "answer_tokens": len(out["choices"][0]["tokens"]),
    }  # fmt: skip


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals of a chat run: hit share of later turns against what earlier turns stored, TTFT and TBT."""
    reqs = [r for r in records if "session" in r and "rejected" not in r]
    rejected = sum(1 for r in records if "rejected" in r)
    elapsed = next((r["elapsed_s"] for r in records if "elapsed_s" in r), 0.0)
    later = [r for r in reqs if r["turn"] > 0]
    first = [r for r in reqs if r["turn"] == 0]

    def share(rows: list[dict[str, Any]], field_name: str) -> float:
        total = sum(r["prompt_tokens"] for r in rows)
        return sum(r[field_name] for r in rows) / total if total else 0.0

    def mean(rows: list[dict[str, Any]], field_name: str) -> float:
        return statistics.fmean(r[field_name] for r in rows) if rows else 0.0

    ttfts = sorted(r["prefill_ttft_s"] for r in reqs)
    errors = [abs(r["predicted_ttft_s"] - r["prefill_ttft_s"]) / r["prefill_ttft_s"] for r in reqs
              if r.get("predicted_ttft_s") is not None and r["prefill_ttft_s"] > 0]  # fmt: skip
    return {
        "summary": True,
        "requests": len(reqs),
        "rejected": rejected,
        "later_turns": len(later),
        "later_hit_share": round(share(later, "prefill_matched_tokens"), 4),
        "later_expected_share": round(share(later, "expected_hit_tokens"), 4),
        "later_loaded_share": round(share(later, "prefill_loaded_tokens"), 4),
        "hit_shortfall_max": round(
            max((r["expected_hit_tokens"] - r["prefill_matched_tokens"]) / r["prompt_tokens"] for r in later), 4
        ) if later else 0.0,
        "ttft_first_turn_s": round(mean(first, "prefill_ttft_s"), 4),
        "ttft_later_turns_s": round(mean(later, "prefill_ttft_s"), 4),
        "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 4) if ttfts else 0.0,
        "tbt_s": round(mean(reqs, "tbt_s"), 5),
        "tokens_generated": sum(r["answer_tokens"] for r in reqs),
        "decisions": dict(Counter(r["prefill_decision"] for r in reqs)),
        "ttft_prediction_error_median": round(statistics.median(errors), 4) if errors else None,
        "ttft_prediction_error_p90": round(sorted(errors)[int(0.9 * (len(errors) - 1))], 4) if errors else None,
        "prefill_workers": dict(Counter(r["prefill_worker"] for r in reqs)),
        "elapsed_s": round(elapsed, 3),
    }  # fmt: skip


def default_threads(workers: int) -> int:
    """torch threads per worker so that the workers together use the machine's cores once."""
    return max(1, (os.cpu_count() or 1) // max(workers, 1))
