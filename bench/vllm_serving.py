"""Real vLLM engines on the store: time to first token with the store against without it, in one run.

Every engine is vLLM's CPU build in its own process (``python -m bench.vllm_engine`` in the
vLLM environment, ``scripts/vllm-env.sh``), one at a time. The model is a random-weight
Llama saved with ``save_pretrained`` (``--layers``, hidden 256, 8 heads, 2 KV heads, bf16).
Each prompt runs alone with ``max_tokens=1`` (prefill and the first token: the TTFT),
vLLM's own prefix cache reset before each. One JSON line per row, each with its
baseline from the same run, the engine without a connector on the same prompts:

- ``no_connector``: the baseline, fresh prompts;
- ``miss``: the connector on, nothing stored: lookups that miss and saves of every
  block (``overhead`` = miss / baseline - 1, the target is <= 5%);
- ``stored``: a second engine (another process, other page size) on the same prompts,
  all full blocks in the store (``speedup`` = baseline / stored); ``stored_whole``:
  the same with layer-wise loading off (every layer read before the forward pass);
- ``store_down``: the master's port refuses connections: the first request and the
  mean of the following ones (``first_s``, ``rest_s``) against the baseline;
- ``store_frozen``: the master and daemon SIGSTOPped with the engine's connections
  open: the same.

Times are medians over the prompts (``--prompts``, each ``--prompt-tokens`` long). The
baseline and ``miss`` engines run side by side, prompt by prompt in turn; the others
one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.processes import GroupProcess

REPO = Path(__file__).resolve().parents[1]
MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "vocab_size": 8192, "max_position_embeddings": 8192, "initializer_range": 0.05,
    "tie_word_embeddings": False,
}  # fmt: skip


def vllm_python() -> str:
    """The vLLM environment's interpreter: ``$KVSTORE_VLLM_PYTHON``, else ``.venv-vllm`` in the checkout."""
    return os.environ.get("KVSTORE_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def save_model(path: Path, *, layers: int = 4, seed: int = 0) -> Path:
    """A random-weight bf16 Llama of :data:`MODEL_CONFIG` (``layers`` deep), saved for vLLM to load."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(LlamaConfig(**{**MODEL_CONFIG, "num_hidden_layers": layers}))
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def prompt(n: int, seed: int, vocab: int = 8192) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


class VllmEngine(GroupProcess):
    """One vLLM engine process; :meth:`run` sends prompts and returns its answer (see ``vllm_engine.py``).
    Its stderr goes to the log; stdin and stdout carry the commands and answers."""

    def __init__(
        self, model: Path, log: Path, *, block: int = 128, master: str = "", dtype: str = "bfloat16",
        extra: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        args = [vllm_python(), "-m", "bench.vllm_engine", "--model", str(model), "--block-size", str(block),
                "--dtype", dtype]  # fmt: skip
        if master:
            args += ["--master", master, "--extra", json.dumps(extra or {})]
        super().__init__(args, log, env={**os.environ, "PYTHONPATH": str(REPO)}, pipes=True)
        try:
            self.ready = self._read()
        except BaseException:
            self.close()
            raise

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return dict(json.loads(line[2:]))
        raise RuntimeError(f"the vLLM engine died:\n{self.tail()}")

    def _send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def run(self, *prompts: list[int], max_tokens: int = 8, salt: str = "") -> dict[str, Any]:
        self._send({"prompts": list(prompts), "max_tokens": max_tokens, "salt": salt})
        return self._read()

    def close(self) -> None:
        self.stop(60, ask=lambda: self._send({"quit": True}))


def free_port() -> int:
    """A free port below the ephemeral range, so that no process's outgoing connection (vLLM's engines make
    several) takes it before the cluster started later on it binds it."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-30000")


def _row(name: str, times: list[float], base: float, **more: Any) -> dict[str, Any]:
    median = statistics.median(times)
    return {"bench": "vllm_serving", "row": name, "ttft_s": round(median, 4), "baseline_ttft_s": round(base, 4),
            "ratio": round(median / base, 3), **more}  # fmt: skip


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    from kvstore_cli.cluster import LocalCluster

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = save_model(work / "model", layers=args.layers)
    prompts = [prompt(args.prompt_tokens, 1000 + i) for i in range(args.prompts)]
    warm = prompt(args.prompt_tokens, 1)
    store = {"model": "bench"}
    with LocalCluster(daemons=1, dram="1GiB") as cluster:
        # The baseline and the connector with nothing stored, both up, prompt by prompt in turn:
        # the machine's noise falls on both alike.
        with (
            VllmEngine(model, work / "baseline.log") as plain,
            VllmEngine(model, work / "miss.log", master=cluster.master_address, extra=store) as engine,
        ):
            plain.run(warm, max_tokens=1)
            engine.run(warm, max_tokens=1)
            baseline: dict[str, list[Any]] = {"times": [], "tokens": []}
            miss: dict[str, list[Any]] = {"times": [], "tokens": []}
            for p in prompts:
                for out, eng in ((baseline, plain), (miss, engine)):
                    got = eng.run(p, max_tokens=1)
                    out["times"] += got["times"]
                    out["tokens"] += got["tokens"]
        base = statistics.median(baseline["times"])
        yield _row("no_connector", baseline["times"], base, prompt_tokens=args.prompt_tokens)
        assert miss["tokens"] == baseline["tokens"], "the connector changed the output"
        yield _row("miss", miss["times"], base, overhead=round(statistics.median(miss["times"]) / base - 1, 3))
        for name, extra in (("stored", {}), ("stored_whole", {"layerwise": False})):
            log = work / f"{name}.log"
            with VllmEngine(model, log, block=256, master=cluster.master_address, extra={**store, **extra}) as engine:
                engine.run(warm, max_tokens=1)
                hit = engine.run(*prompts, max_tokens=1)
            assert hit["tokens"] == baseline["tokens"], f"{name}: the loaded KV changed the output"
            yield _row(name, hit["times"], base, cached_tokens=hit["cached"][0],
                       speedup=round(base / statistics.median(hit["times"]), 2))  # fmt: skip
    yield from _sick_store(args, model, work, prompts, base, baseline["tokens"])


def _sick_store(
    args: argparse.Namespace, model: Path, work: Path, prompts: list[list[int]], base: float, want: list[Any]
) -> Iterator[dict[str, Any]]:
    from kvstore_cli.cluster import LocalCluster

    fresh = [prompt(args.prompt_tokens, 2000 + i) for i in range(args.prompts)]
    port = free_port()
    extra = {"model": "bench", "lookup_timeout_s": args.lookup_timeout_s, "timeout_s": args.timeout_s}
    with VllmEngine(model, work / "sick.log", master=f"127.0.0.1:{port}", extra=extra) as engine:
        down = engine.run(*prompts, max_tokens=1)
        assert down["tokens"] == want
        yield _sick_row("store_down", down["times"], base)
        with LocalCluster(daemons=1, dram="1GiB", master_port=port) as cluster:
            for _ in range(60):  # until the breaker's probe has found the store and a prompt hits
                if engine.run(prompts[0], max_tokens=1)["cached"][0]:
                    break
            assert cluster.master is not None and cluster.daemons[0] is not None
            frozen = [cluster.master, cluster.daemons[0]]
            for proc in frozen:
                proc.send_signal(signal.SIGSTOP)
            try:
                out = engine.run(*fresh, max_tokens=1)
            finally:
                for proc in frozen:
                    proc.send_signal(signal.SIGCONT)
        yield _sick_row("store_frozen", out["times"], base)


def _sick_row(name: str, times: list[float], base: float) -> dict[str, Any]:
    rest = statistics.mean(times[1:]) if len(times) > 1 else 0.0
    return {"bench": "vllm_serving", "row": name, "first_s": round(times[0], 4), "rest_s": round(rest, 4),
            "baseline_ttft_s": round(base, 4), "first_extra_s": round(times[0] - base, 4),
            "rest_ratio": round(rest / base, 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_serving", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="JSON lines (the only output format)")
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lookup-timeout-s", type=float, default=1.0)
    p.add_argument("--timeout-s", type=float, default=2.0)
    args = p.parse_args(argv)
    return print_rows(lambda: run(args), [("vLLM", vllm_python(), "scripts/vllm-env.sh")])


def print_rows(rows: Callable[[], Iterable[dict[str, Any]]], needs: Sequence[tuple[str, str, str]]) -> int:
    """A bench's main: 2, naming the script that builds it, where an environment in ``needs`` (what,
    its python, the script) is missing; else each of ``rows()`` as a JSON line, and 0."""
    for what, python, script in needs:
        if not Path(python).exists():
            print(f"no {what} environment at {python}: run {script}", file=sys.stderr)
            return 2
    for row in rows():
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
