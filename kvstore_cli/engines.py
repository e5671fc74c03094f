"""Engine commands: ``kvstore worker`` and ``kvstore conductor`` serve a real model's prefill and decode
behind a KVCache-aware scheduler; ``kvstore pd-demo`` runs a chat through them on a cluster;
``kvstore compat-path`` points engines written for another store's API at ours.

torch and transformers are imported only when such a command runs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rich.console import Console

from kvstore.config import load
from kvstore.errors import InvalidArgument
from kvstore_cli.registry import arguments, command, print_metrics


def engine_arguments(p: argparse.ArgumentParser) -> None:
    """The model every engine command and benchmark takes."""
    p.add_argument("--model-config", type=Path, default=None, help="a transformers config.json (default: small Llama)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per stored KV block")
    p.add_argument("--device", default="cpu", help="where the model runs: cpu, or cuda where a GPU is present")


@arguments("compat-path")
def _compat_path_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("api", choices=["mooncake"], help="the API to serve: mooncake (mooncake.store)")


@command("compat-path", "print a directory that, on PYTHONPATH, makes another store's client import ours")
def _compat_path(args: argparse.Namespace) -> int:
    from kvstore_client.compat import compat_path

    print(compat_path(args.api))
    return 0


@arguments("worker")
def _worker_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--master", required=True, help="the store master: host:port or etcd://H:2379/ID")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0: any free port)")
    p.add_argument("--node", default=None, help="the store node on this worker's machine (the conductor's locality)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--tail", choices=["transfer", "recompute"], default="transfer", help="decode: the last block")
    p.add_argument("--load-policy", choices=["auto", "always", "never"], default="auto", help="prefill: loads")
    p.add_argument("--calibrate-tokens", type=int, default=512, help="prefill: tokens of the calibration run")
    engine_arguments(p)


@command("worker", "serve a prefill or decode worker of a real model over HTTP (what the conductor routes to)")
def _worker(args: argparse.Namespace) -> int:
    from kvstore_client.adapters.pd import EngineSpec
    from kvstore_client.adapters.serve import run_worker

    spec = EngineSpec(
        model_config=str(args.model_config) if args.model_config else None, seed=args.seed, dtype=args.dtype,
        block_tokens=args.block_tokens, threads=args.threads, load_policy=args.load_policy, tail=args.tail,
        calibrate_tokens=args.calibrate_tokens, device=args.device,
    )  # fmt: skip
    return run_worker(args, spec)


@arguments("conductor")
def _conductor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--master", default=None, help="the store master: host:port or etcd://H:2379/ID (without: load-only routing)"
    )
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill workers' base URLs")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode workers' base URLs")
    p.add_argument(
        "--openai", nargs="+", default=[], metavar="URL",
        help="instead of prefill and decode workers: OpenAI servers (vllm serve with the KVStoreConnector)",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8600, help="HTTP port (0: any free port)")
    p.add_argument("--policy", choices=["random", "load", "local", "global"], default="global")
    p.add_argument("--no-early-rejection", action="store_true", help="accept every request at arrival")
    p.add_argument("--decode-load", choices=["none", "current", "predicted"], default="predicted")
    p.add_argument("--ttft-slo", type=float, default=30.0, help="seconds")
    p.add_argument("--tbt-slo", type=float, default=1.0, help="seconds")
    p.add_argument("--replicate-tokens", type=int, default=0, help="fetched tokens copied to the prefill node")
    p.add_argument("--health-period", type=float, default=1.0, help="seconds between worker health checks")
    p.add_argument("--tokenizer", default=None, help="a local tokenizer directory, for text prompts")
    p.add_argument("--load-bytes-per-s", type=float, default=1e9, help="OpenAI servers: their load rate, to start")
    p.add_argument(
        "--engine-events", nargs="+", default=[], metavar="tcp://H:P",
        help="OpenAI servers: each one's KV events endpoint (vLLM's --kv-events-config), in --openai's order",
    )  # fmt: skip
    p.add_argument("--engine-events-replay", nargs="+", default=[], metavar="tcp://H:P",
                   help="OpenAI servers: each one's KV events replay endpoint")  # fmt: skip


@command("conductor", "schedule completion requests over prefill/decode workers or vLLM servers by where KV is stored")
def _conductor(args: argparse.Namespace) -> int:
    from kvstore.config import ConductorConfig
    from server.conductor.main import run_conductor

    workers = {name: urls for name in ("prefill", "decode", "openai") if (urls := getattr(args, name))}
    config = load(
        ConductorConfig, "conductor", host=args.host, port=args.port, master=args.master, policy=args.policy,
        early_rejection=not args.no_early_rejection, decode_load=args.decode_load, ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo, replicate_tokens=args.replicate_tokens, health_period_s=args.health_period,
        tokenizer=args.tokenizer, load_bytes_per_s=args.load_bytes_per_s, engine_events=args.engine_events,
        engine_events_replay=args.engine_events_replay, **workers,
    )  # fmt: skip
    return run_conductor(config)


@arguments("pd-demo")
def _pd_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", type=int, default=1, help="prefill worker processes")
    p.add_argument("--decode", type=int, default=1, help="decode worker processes")
    p.add_argument("--sessions", type=int, default=4, help="chat sessions")
    p.add_argument("--turns", type=int, default=3, help="turns per session")
    p.add_argument("--system-tokens", type=int, default=512, help="tokens of each shared system prompt")
    p.add_argument("--message-tokens", type=int, nargs=2, default=(64, 384), metavar=("MIN", "MAX"))
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: cores / workers)")
    p.add_argument("--tail", choices=["transfer", "recompute"], default="transfer", help="the prompt's last block")
    p.add_argument("--master", default=None, help="use the running cluster at host:port instead of starting one")
    p.add_argument("--daemons", type=int, default=2, help="daemons of the cluster started for the run")
    p.add_argument("--dram", default="512MiB", help="DRAM per daemon of the cluster started for the run")
    p.add_argument("--policy", choices=["random", "load", "local", "global"], default="global", help="conductor")
    p.add_argument("--logs", type=Path, default=None, help="directory for the workers' and conductor's logs")
    p.add_argument("--json", action="store_true", help="one JSON line per request, then a summary line")
    engine_arguments(p)


@command("pd-demo", "a multi-turn chat through a conductor, prefill and decode workers of a real model, and a cluster")
def _pd_demo(args: argparse.Namespace) -> int:
    if args.prefill < 1 or args.decode < 1:
        raise InvalidArgument(f"--prefill and --decode must be at least 1, got {args.prefill} and {args.decode}")

    from kvstore_cli.cluster import LocalCluster
    from kvstore_client.adapters.hf import layout_for, load_model_config
    from kvstore_client.adapters.pd import EngineSpec, chat_sessions, default_threads, run_chat, summarize
    from kvstore_client.adapters.serve import ServedEngines, conductor_client

    config = load_model_config(args.model_config)
    layout = layout_for(config, seed=args.seed, dtype=args.dtype, block_tokens=args.block_tokens, device=args.device)
    spec = EngineSpec(
        model_config=str(args.model_config) if args.model_config else None, seed=args.seed, dtype=args.dtype,
        block_tokens=args.block_tokens, threads=args.threads or default_threads(args.prefill + args.decode),
        tail=args.tail, device=args.device,
    )  # fmt: skip
    sessions = chat_sessions(
        args.sessions, args.turns, vocab_size=config.get_text_config().vocab_size, system_tokens=args.system_tokens,
        message_tokens=tuple(args.message_tokens), max_new_tokens=args.max_new_tokens, seed=args.seed,
    )  # fmt: skip
    console = Console(stderr=True)
    with ExitStack() as stack:
        master, nodes = args.master, []
        if master is None:
            cluster = stack.enter_context(LocalCluster(args.daemons, dram=args.dram))
            master, nodes = cluster.master_address, [cluster.node_name(i) for i in range(args.daemons)]
        logs = args.logs or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvstore-pd-")))
        if not args.json:
            console.print(f"starting {args.prefill} prefill and {args.decode} decode workers ({layout.model}) "
                          f"and a conductor ...")  # fmt: skip
        engines = stack.enter_context(ServedEngines(
            master, spec, prefill=args.prefill, decode=args.decode, nodes=nodes, workdir=logs,
            conductor_args=["--policy", args.policy],
        ))  # fmt: skip
        records = run_chat(
            conductor_client(engines.conductor_url), sessions, layout, on_result=lambda r: _print_request(r, args.json)
        )
    summary = summarize(records) | {"model": layout.model, "prefill": args.prefill, "decode": args.decode,
                                    "policy": args.policy}  # fmt: skip
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        _print_summary(summary)
    return 0


def _print_request(rec: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(rec), flush=True)
        return
    if "rejected" in rec:
        print(f"session {rec['session']} turn {rec['turn']}: rejected ({rec['rejected']})", flush=True)
        return
    n = rec["prompt_tokens"]
    print(
        f"session {rec['session']} turn {rec['turn']}: prompt {n:5d}  hit {rec['prefill_matched_tokens']:5d}"
        f" ({rec['prefill_matched_tokens'] / n:6.1%}, earlier turns stored {rec['expected_hit_tokens'] / n:6.1%})"
        f"  loaded {rec['prefill_loaded_tokens']:5d}  TTFT {rec['prefill_ttft_s'] * 1e3:7.1f} ms"
        f" (predicted {rec['predicted_ttft_s'] * 1e3:7.1f})  on {rec['prefill_worker']}/{rec['decode_worker']}"
        f"  TBT {rec['tbt_s'] * 1e3:6.1f} ms  tail {rec['decode_tail']}  [{rec['prefill_decision']}]",
        flush=True,
    )


def _print_summary(s: dict[str, Any]) -> None:
    rows = [
        ("requests (later turns)", f"{s['requests']} ({s['later_turns']})"),
        ("later turns: prefix hit", f"{s['later_hit_share']:.1%}"),
        ("later turns: stored by earlier turns", f"{s['later_expected_share']:.1%}"),
        ("later turns: loaded", f"{s['later_loaded_share']:.1%}"),
        (
            "TTFT first turns / later turns",
            f"{s['ttft_first_turn_s'] * 1e3:.0f} / {s['ttft_later_turns_s'] * 1e3:.0f} ms",
        ),
        ("TTFT p90", f"{s['ttft_p90_s'] * 1e3:.0f} ms"),
        (
            "TTFT prediction error, median / p90",
            f"{s['ttft_prediction_error_median']} / {s['ttft_prediction_error_p90']}",
        ),
        ("requests per prefill worker", ", ".join(f"{k}: {v}" for k, v in sorted(s["prefill_workers"].items()))),
        ("rejected", str(s["rejected"])),
        ("time between tokens", f"{s['tbt_s'] * 1e3:.1f} ms"),
        ("tokens generated", str(s["tokens_generated"])),
        ("decisions", ", ".join(f"{k}: {v}" for k, v in sorted(s["decisions"].items()))),
        ("elapsed", f"{s['elapsed_s']:.1f} s"),
    ]
    print_metrics("pd-demo summary", rows)
