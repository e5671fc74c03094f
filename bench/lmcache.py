"""LMCache on the store, end to end with real vLLM: time to first token with LMCache's L2 on the
store against vLLM alone, in one run.

LMCache's multiprocess server (``python -m lmcache.v1.multiprocess.http_server`` from the LMCache
environment, ``scripts/lmcache-env.sh``) keeps chunks of KV in its own memory (L1) and in its
L2 adapters; here one L2 adapter, the store's (``kvstore_client.adapters.lmcache``, loaded by
LMCache's plugin type) on a real cluster. ``vllm serve`` (vLLM's CPU build,
``scripts/vllm-env.sh``) reaches it through LMCache's own vLLM connector (``LMCacheMPConnector``,
vLLM's name for it), which on the CPU moves KV by engine-driven transfers (vLLM's pages copied
to and from the server's shared memory by the engine's process). vLLM imports LMCache from the
LMCache environment, put after its own packages on its path (a ``sitecustomize`` of this run's).

Rows, each prompt alone with ``max_tokens=1`` (prefill and the first token: the TTFT, the client's
time to the first streamed chunk), medians over ``--prompts`` prompts of ``--prompt-tokens``:

- ``vllm_alone``: a server without a connector (the baseline);
- ``lmcache_store``: a server with LMCache, fresh prompts: every chunk looked up (a miss) and
  saved into L1 and the store (its ``vs_alone`` - 1: the overhead);
- ``lmcache_l1``: a new server on the same LMCache server, the same prompts: hits in LMCache's
  own memory (its best case);
- ``lmcache_l2_store``: a new server and a new LMCache server (L1 empty): the same prompts, every
  hit read from the store through the L2 adapter.

Each row's ``vs_alone`` is its median TTFT over vLLM alone's, ``speedup`` the inverse.

Each row says how many prompt tokens vLLM reported it did not compute (``external_hit_tokens``,
its connector's counter) and whether every answer's token equals vLLM alone's
(``same_tokens``). Run in the vLLM environment's absence or the LMCache one's: exit 2, saying so.

    python -m bench.lmcache --json [--prompts 8] [--prompt-tokens 2048] [--layers 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.processes import GroupProcess
from bench.vllm_chat import VllmServer, cache_counts, complete
from bench.vllm_serving import REPO, free_port, print_rows, prompt, save_model, vllm_python

LMCACHE_VENV = REPO / ".venv-lmcache"
CHUNK_TOKENS = 256
"""LMCache's chunk (a whole number of vLLM's 128-token pages)."""


def lmcache_python() -> str:
    return str(LMCACHE_VENV / "bin" / "python")


def lmcache_site() -> str:
    """The LMCache environment's site-packages (what vLLM's process appends to its path)."""
    out = subprocess.run([lmcache_python(), "-c", "import lmcache, os; print(os.path.dirname(os.path.dirname("
                          "lmcache.__file__)))"], capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    return out.stdout.strip()


class LMCacheServer(GroupProcess):
    """LMCache's multiprocess server (HTTP frontend and MP cache server) with the store as its L2."""

    def __init__(self, master: str, log: Path, namespace: str, l1_gb: int = 1) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.shm = f"kvstore-bench-{os.getpid()}-{self.port}"
        adapter = {"type": "plugin", "module_path": "kvstore_client.adapters.lmcache", "class_name": "KVStoreL2Adapter",
                   "config_class_name": "KVStoreL2AdapterConfig",
                   "adapter_params": {"master": master, "namespace": namespace}}  # fmt: skip
        args = [lmcache_python(), "-m", "lmcache.v1.multiprocess.http_server", "--host", "127.0.0.1",
                "--port", str(self.port), "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                "--chunk-size", str(CHUNK_TOKENS), "--supported-transfer-mode", "engine_driven",
                "--shm-name", self.shm, "--l1-size-gb", str(l1_gb), "--l1-init-size-gb", str(l1_gb),
                "--eviction-policy", "LRU", "--l2-adapter", json.dumps(adapter)]  # fmt: skip
        super().__init__(args, log, cwd=REPO)

    def wait(self, timeout_s: float = 180.0) -> LMCacheServer:
        self.wait_http(f"http://127.0.0.1:{self.http_port}/healthcheck", timeout_s, "the LMCache server")
        return self

    def connector(self) -> dict[str, Any]:
        """vLLM's ``--kv-transfer-config`` for this server."""
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port,
                                              "lmcache.mp.mp_transfer_mode": "engine_driven"}}  # fmt: skip

    def close(self) -> None:
        super().close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{self.shm}")


def ttfts(url: str, prompts: list[list[int]]) -> tuple[list[float], list[list[int]]]:
    """Each prompt alone, one token: (times to the first chunk, the tokens answered)."""
    times, tokens = [], []
    for p in prompts:
        out = complete(url, {"model": "tiny", "prompt": p, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True})
        times.append(out["ttft_s"])
        tokens.append(out["tokens"])
    return times, tokens


def run(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    from kvstore_cli.cluster import LocalCluster
    from kvstore_client.store import Store

    work = Path(args.logs or tempfile.mkdtemp(prefix="bench-lmcache-"))
    work.mkdir(parents=True, exist_ok=True)
    model = save_model(work / "model", layers=args.layers)
    prompts = [prompt(args.prompt_tokens, 1000 + i) for i in range(args.prompts)]
    # vLLM imports LMCache from its environment, after vLLM's own packages (their pins differ).
    custom = work / "lmcache-path"
    custom.mkdir(exist_ok=True)
    (custom / "sitecustomize.py").write_text(f"import sys\nsys.path.append({lmcache_site()!r})\n")
    env = {"PYTHONPATH": f"{custom}:{REPO}"}
    server = {"block": 128, "kv_blocks": args.kv_blocks, "max_model_len": max(4096, args.prompt_tokens + 128)}

    with VllmServer(model, work / "alone.log", **server) as alone:
        base, base_tokens = ttfts(alone.wait().url, prompts)
    base_s = statistics.median(base)
    yield {"bench": "lmcache", "row": "vllm_alone", "ttft_s": round(base_s, 4), "prompts": len(prompts),
           "prompt_tokens": args.prompt_tokens}  # fmt: skip

    def row(name: str, times: list[float], tokens: list[list[int]], url: str, **more: Any) -> dict[str, Any]:
        counts = cache_counts([url])
        median = statistics.median(times)
        return {"bench": "lmcache", "row": name, "ttft_s": round(median, 4), "vs_alone": round(median / base_s, 3),
                "speedup": round(base_s / median, 3),
                "external_hit_tokens": int(counts["vllm:external_prefix_cache_hits"]),
                "same_tokens": sum(a == b for a, b in zip(tokens, base_tokens, strict=True)), **more}  # fmt: skip

    namespace = f"lmcache-bench-{os.getpid()}"
    with LocalCluster(daemons=1, dram=args.dram) as cluster:
        with LMCacheServer(cluster.master_address, work / "lmcache-1.log", namespace) as lmc:
            lmc.wait()
            with VllmServer(model, work / "store.log", connector=lmc.connector(), env=env, **server) as vllm:
                times, tokens = ttfts(vllm.wait().url, prompts)
                yield row(
                    "lmcache_store", times, tokens, vllm.url, overhead=round(statistics.median(times) / base_s - 1, 3)
                )
            with VllmServer(model, work / "l1.log", connector=lmc.connector(), env=env, **server) as vllm:
                times, tokens = ttfts(vllm.wait().url, prompts)
                yield row("lmcache_l1", times, tokens, vllm.url)
        with Store.connect(cluster.master_address) as store:
            stored = store.stats()
        with LMCacheServer(cluster.master_address, work / "lmcache-2.log", namespace) as lmc:
            lmc.wait()
            with VllmServer(model, work / "l2.log", connector=lmc.connector(), env=env, **server) as vllm:
                times, tokens = ttfts(vllm.wait().url, prompts)
                yield row("lmcache_l2_store", times, tokens, vllm.url, store_objects=stored.get("objects"),
                          store_dram_bytes=stored.get("dram_used"))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lmcache", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="JSON lines (the only output format)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=96, help="vLLM's pages of KV cache per server")
    p.add_argument("--dram", default="1GiB", help="the store's DRAM")
    p.add_argument("--logs", default=None, help="directory for the servers' logs (default: a temporary one)")
    args = p.parse_args(argv)
    needs = [("vLLM", vllm_python(), "scripts/vllm-env.sh"), ("LMCache", lmcache_python(), "scripts/lmcache-env.sh")]
    return print_rows(lambda: run(args), needs)


if __name__ == "__main__":
    raise SystemExit(main())
