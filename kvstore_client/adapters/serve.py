"""A prefill or decode worker behind HTTP (``kvstore worker``): what the conductor routes requests to.

One process, one model, one request at a time in arrival order (a single engine
thread), so a worker's queue is what the conductor predicts it is. Routes:

- ``POST /prefill`` ``{"tokens": [...]}`` -> the prefill's record (first token,
  matched/loaded/computed tokens, decision, timings) plus ``engine_s`` (its time
  on the engine) and ``service_s`` (with the wait for the engine);
- ``POST /decode`` ``{"tokens": [...], "first_token": t, "max_new_tokens": n}``
  -> the generated tokens, their times between tokens, and timings;
- ``GET /info`` -> role, model, key namespace, block size and bytes, node, the
  longest prompt it takes, and its fitted cost models (the conductor starts its
  predictions from them);
- ``GET /health`` -> ``{"ok": true, "queued": n}``.

Bad input is a 400 naming what was wrong; a failure inside the engine is a 500
with the error's type and text; the worker keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from kvstore.errors import ConnectionFailed, InvalidArgument, KVStoreError, Timeout
from kvstore_client.adapters.pd import EngineSpec, Role

log = logging.getLogger(__name__)


def _ints(body: dict[str, Any], name: str, *, vocab: int) -> list[int]:
    value = body.get(name)
    if not isinstance(value, list) or not value:
        raise InvalidArgument(f"{name!r} must be a non-empty list of token ids")
    if not all(type(t) is int and 0 <= t < vocab for t in value):
        raise InvalidArgument(f"{name!r} must hold token ids in [0, {vocab})")
    return value


class WorkerApp:
    """The HTTP face of one :class:`PrefillWorker` or :class:`DecodeWorker`."""

    def __init__(self, role: Role, worker: Any, spec: EngineSpec, *, node: str | None, info: dict[str, Any]) -> None:
        self.role = role
        self.worker = worker
        self.spec = spec
        self.node = node
        self.calibration = info
        self.config = worker.config.get_text_config()
        self.vocab = int(self.config.vocab_size)
        self.max_tokens = int(getattr(self.config, "max_position_embeddings", 0) or 0) or None
        self.queued = 0
        self._engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvstore-{role}")

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes([
            web.get("/health", self._health), web.get("/info", self._info),
            web.post("/prefill", self._prefill), web.post("/decode", self._decode),
        ])  # fmt: skip
        app.on_cleanup.append(self._cleanup)
        return app

    async def _cleanup(self, _: web.Application) -> None:
        self._engine.shutdown(wait=False, cancel_futures=True)

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"ok": True, "role": self.role, "queued": self.queued})

    async def _info(self, _: web.Request) -> web.Response:
        lay = self.worker.layout
        out: dict[str, Any] = {
            "role": self.role, "model": lay.model, "namespace": lay.namespace, "block_tokens": lay.block_tokens,
            "block_bytes": lay.block_bytes(), "node": self.node, "max_tokens": self.max_tokens,
            "vocab_size": self.vocab, "calibration": self.calibration,
        }  # fmt: skip
        if self.role == "prefill":
            out["prefill_coefficients"] = list(self.worker.prefill_cost.coefficients)
            out["load_bytes_per_s"] = self.worker.load_cost.bytes_per_s
            out["load_latency_s"] = self.worker.load_cost.latency_s
        return web.json_response(out)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise InvalidArgument("the body is not JSON") from None
        if not isinstance(body, dict):
            raise InvalidArgument("the body must be a JSON object")
        return body

    async def _run(self, request: web.Request, role: Role, fn: Any) -> web.Response:
        if self.role != role:
            return _error(400, f"this is a {self.role} worker, not a {role} worker")
        try:
            body = await self._body(request)
            call = fn(body)
        except InvalidArgument as exc:
            return _error(400, str(exc))
        self.queued += 1
        started = time.perf_counter()

        def timed() -> dict[str, Any]:
            t = time.perf_counter()
            out: dict[str, Any] = call()
            out["engine_s"] = round(time.perf_counter() - t, 6)  # without the wait for the engine thread
            return out

        try:
            record = await asyncio.get_running_loop().run_in_executor(self._engine, timed)
        except InvalidArgument as exc:
            return _error(400, str(exc))
        except (KVStoreError, RuntimeError, ValueError) as exc:
            log.exception("%s failed", role)
            return _error(500, f"{type(exc).__name__}: {exc}")
        finally:
            self.queued -= 1
        record["service_s"] = round(time.perf_counter() - started, 6)
        return web.json_response(record)

    async def _prefill(self, request: web.Request) -> web.Response:
        def parse(body: dict[str, Any]) -> Any:
            tokens = _ints(body, "tokens", vocab=self.vocab)
            if self.max_tokens is not None and len(tokens) > self.max_tokens:
                raise InvalidArgument(f"a prompt of {len(tokens)} tokens is longer than the model's {self.max_tokens}")
            return lambda: self.worker.prefill(tokens).record()

        return await self._run(request, "prefill", parse)

    async def _decode(self, request: web.Request) -> web.Response:
        def parse(body: dict[str, Any]) -> Any:
            tokens = _ints(body, "tokens", vocab=self.vocab)
            first = body.get("first_token")
            new = body.get("max_new_tokens", 16)
            if type(first) is not int or not 0 <= first < self.vocab:
                raise InvalidArgument(f"'first_token' must be a token id in [0, {self.vocab})")
            if type(new) is not int or new < 1:
                raise InvalidArgument("'max_new_tokens' must be a positive integer")
            if self.max_tokens is not None and len(tokens) + new > self.max_tokens:
                raise InvalidArgument(f"{len(tokens)} + {new} tokens exceed the model's {self.max_tokens}")

            def run() -> dict[str, Any]:
                d = self.worker.decode(tokens, first, new)
                return d.record() | {"step_s": [round(x, 6) for x in d.step_s]}

            return run

        return await self._run(request, "decode", parse)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "status": status}}, status=status)


def build(role: Role, master: str, spec: EngineSpec, *, node: str | None) -> WorkerApp:
    """Build the model, connect to the store, and (prefill) calibrate the cost models."""
    import torch

    from kvstore.config import ClientConfig
    from kvstore_client.adapters.workers import DecodeWorker, PrefillWorker
    from kvstore_client.store import Store

    torch.set_num_threads(spec.threads)
    model, layout = spec.build()
    store = Store.connect(master, ClientConfig(timeout_s=spec.timeout_s))
    worker: PrefillWorker | DecodeWorker
    if role == "prefill":
        worker = PrefillWorker(model, layout, store, load_policy=spec.load_policy)
        info: dict[str, Any] = worker.calibrate(spec.calibrate_tokens)
    else:
        worker = DecodeWorker(model, layout, store, tail=spec.tail)
        info = {}
    return WorkerApp(role, worker, spec, node=node, info=info)


async def serve(app: WorkerApp, host: str, port: int) -> None:
    runner = web.AppRunner(app.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0]
    print(f"kvstore {app.role} worker on http://{bound[0]}:{bound[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    app.worker.store.close()


def run_worker(args: argparse.Namespace, spec: EngineSpec) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = build(args.role, args.master, spec, node=args.node)
    asyncio.run(serve(app, args.host, args.port))
    return 0


# -- processes: workers and a conductor on this machine (pd-demo, tests) ---------------------------


def spec_args(spec: EngineSpec) -> list[str]:
    """The ``kvstore worker`` flags that rebuild ``spec`` in another process."""
    out = ["--seed", str(spec.seed), "--dtype", spec.dtype, "--block-tokens", str(spec.block_tokens),
           "--threads", str(spec.threads), "--tail", spec.tail, "--load-policy", spec.load_policy,
           "--calibrate-tokens", str(spec.calibrate_tokens), "--device", spec.device]  # fmt: skip
    return out + (["--model-config", spec.model_config] if spec.model_config else [])


class ServedEngines:
    """N prefill and M decode ``kvstore worker`` processes and a ``kvstore conductor`` in front of them.

    Prefill worker ``i`` is placed on store node ``nodes[i % len(nodes)]`` (the conductor's locality).
    Each process's output goes to a log file in ``workdir``; :meth:`close` stops them all.
    """

    def __init__(
        self, master: str, spec: EngineSpec, *, prefill: int, decode: int, nodes: list[str], workdir: Path,
        conductor_args: Sequence[str] = (), start_timeout_s: float = 600.0,
    ) -> None:  # fmt: skip
        if prefill < 1 or decode < 1:
            raise InvalidArgument(f"need at least one prefill and one decode worker, got {prefill} and {decode}")
        self.master, self.spec, self.nodes, self.workdir = master, spec, nodes, workdir
        self.num_prefill, self.num_decode = prefill, decode
        self.conductor_args = list(conductor_args)
        self.start_timeout_s = start_timeout_s
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.urls: dict[str, str] = {}
        self.conductor_url = ""

    def start(self) -> ServedEngines:
        try:
            for role, count in (("prefill", self.num_prefill), ("decode", self.num_decode)):
                for i in range(count):
                    node = ["--node", self.nodes[i % len(self.nodes)]] if role == "prefill" and self.nodes else []
                    self._spawn(f"{role}-{i}", ["worker", role, "--master", self.master, "--port", "0", *node,
                                                *spec_args(self.spec)])  # fmt: skip
            for name in list(self.procs):
                self.urls[name] = self._wait_url(name)
            prefill = [self.urls[f"prefill-{i}"] for i in range(self.num_prefill)]
            decode = [self.urls[f"decode-{i}"] for i in range(self.num_decode)]
            self._spawn("conductor", ["conductor", "--master", self.master, "--port", "0", "--prefill", *prefill,
                                      "--decode", *decode, *self.conductor_args])  # fmt: skip
            self.conductor_url = self._wait_url("conductor")
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, name: str, args: list[str]) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log_file = open(self.workdir / f"{name}.log", "w")  # noqa: SIM115 - the child owns it
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "kvstore_cli", *args], stdout=log_file, stderr=subprocess.STDOUT, text=True
        )
        log_file.close()

    def _wait_url(self, name: str) -> str:
        deadline = time.monotonic() + self.start_timeout_s
        path = self.workdir / f"{name}.log"
        while time.monotonic() < deadline:
            for line in path.read_text(errors="replace").splitlines():
                if " on http://" in line:
                    return line.rsplit(" on ", 1)[1].strip()
            if self.procs[name].poll() is not None:
                tail = path.read_text(errors="replace")[-2000:]
                raise ConnectionFailed(f"{name} exited while starting:\n{tail}")
            time.sleep(0.1)
        raise Timeout(f"{name} did not start within {self.start_timeout_s:.0f} s")

    def kill(self, name: str) -> None:
        """Kill one process (fault tests)."""
        proc = self.procs[name]
        proc.kill()
        proc.wait(timeout=10)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def __enter__(self) -> ServedEngines:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def conductor_client(url: str, *, timeout_s: float = 600.0) -> Any:
    """``submit(prompt, max_new_tokens)`` for :func:`~kvstore_client.adapters.pd.run_chat`: one POST to
    the conductor's completions route; a 429 comes back as its error body, other failures raise."""

    def submit(prompt: list[int], max_new: int) -> dict[str, Any]:
        body = json.dumps({"prompt": prompt, "max_tokens": max_new}).encode()
        req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                out: dict[str, Any] = json.loads(resp.read())
                return out
        except urllib.error.HTTPError as exc:
            detail = json.loads(exc.read() or b"{}")
            if exc.code == 429:
                return dict(detail)
            raise error_from_status(exc.code, (detail.get("error") or {}).get("message", exc.reason)) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ConnectionFailed(f"conductor {url}: {exc}") from None

    return submit


def error_from_status(status: int, message: str) -> KVStoreError:
    return InvalidArgument(message) if 400 <= status < 500 else ConnectionFailed(f"HTTP {status}: {message}")
