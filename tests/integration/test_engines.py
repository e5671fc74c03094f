"""A real model's prefill and decode through a real cluster: tokens, loads, faults and bad input.

Tiny Llama-shaped models with seeded random weights (CPU torch, transformers); the
cluster's master and daemons are processes on loopback. Every token comparison is
against single-process ``generate`` on the same weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore.config import ClientConfig  # noqa: E402
from kvstore.errors import ConnectionFailed, NotFound  # noqa: E402
from kvstore_cli.cluster import LocalCluster  # noqa: E402
from kvstore_client.adapters.costs import LoadCostModel, PrefillCostModel  # noqa: E402
from kvstore_client.adapters.hf import blocks_from_cache, build_model, layout_for, load_model_config  # noqa: E402
from kvstore_client.adapters.layout import load_layer  # noqa: E402
from kvstore_client.adapters.pd import EngineSpec, WorkerPool  # noqa: E402
from kvstore_client.adapters.workers import DecodeWorker, PrefillWorker  # noqa: E402
from kvstore_client.store import Store  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "initializer_range": 0.05,
    "max_position_embeddings": 2048,
}  # fmt: skip
SHAPES = {
    "gqa-2-layers": {},
    "mha-1-layer": {"num_hidden_layers": 1, "num_key_value_heads": 4},
    "mha-3-layers": {"num_hidden_layers": 3, "num_key_value_heads": 6, "hidden_size": 96, "num_attention_heads": 6},
    "mqa-4-layers": {"num_hidden_layers": 4, "num_key_value_heads": 1},
}
BT = 16


def config_file(tmp_path: Path, **overrides: Any) -> Path:
    path = tmp_path / f"config-{len(list(tmp_path.glob('config-*')))}.json"
    path.write_text(json.dumps(TINY | overrides))
    return path


def engine(path: Path, *, seed: int = 0, dtype: str = "float32", block_tokens: int = BT) -> tuple[Any, Any]:
    config = load_model_config(path)
    return build_model(config, seed=seed, dtype=dtype), layout_for(config, seed=seed, dtype=dtype,
                                                                   block_tokens=block_tokens)  # fmt: skip


def generate(model: Any, prompt: torch.Tensor, n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(prompt.unsqueeze(0), max_new_tokens=n, do_sample=False)
    return out[0, prompt.numel() :].tolist()


def prompt_of(n: int, seed: int = 0, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="64MiB") as c:
        yield c


@pytest.fixture
def store(cluster: LocalCluster) -> Iterator[Store]:
    with Store.connect(cluster.master_address) as s:
        yield s


@pytest.mark.parametrize("shape", list(SHAPES))
def test_prefill_store_decode_gives_the_tokens_of_generate(
    shape: str, tmp_path: Path, store: Store, cluster: LocalCluster
) -> None:
    model, layout = engine(config_file(tmp_path, **SHAPES[shape]))
    prompt = prompt_of(100, seed=len(shape))
    prefill = PrefillWorker(model, layout, store, load_policy="always")
    first = prefill.prefill(prompt[:64])  # an earlier request stored the first 4 blocks
    assert first.decision == "miss" and first.stored_blocks == 4
    result = prefill.prefill(prompt)
    assert (result.matched_tokens, result.loaded_tokens, result.computed_tokens) == (64, 64, 36)
    assert result.decision == "load" and result.stored_blocks == 3  # blocks 4 and 5, and the tail
    with Store.connect(cluster.master_address) as other:  # the decode side has a client of its own
        decoded = DecodeWorker(model, layout, other).decode(prompt, result.first_token, 12)
    assert decoded.tail == "transferred" and decoded.loaded_tokens == 100 and decoded.recomputed_tokens == 0
    assert decoded.tokens == generate(model, prompt, 12)


def test_a_full_hit_still_computes_the_last_token(tmp_path: Path, store: Store) -> None:
    model, layout = engine(config_file(tmp_path))
    prompt = prompt_of(64, seed=7)
    prefill = PrefillWorker(model, layout, store, load_policy="always")
    prefill.prefill(prompt)
    again = prefill.prefill(prompt, keep_logits=True)
    assert (again.matched_tokens, again.loaded_tokens, again.computed_tokens) == (64, 63, 1)
    assert again.first_token == generate(model, prompt, 1)[0]


def test_one_layer_of_stored_blocks_reads_alone(tmp_path: Path, store: Store) -> None:
    model, layout = engine(config_file(tmp_path, num_hidden_layers=3))
    prompt = prompt_of(48, seed=37)
    worker = PrefillWorker(model, layout, store)
    worker.prefill(prompt)
    _, cache = worker.forward(prompt, None)
    expected = layout.staging(3)
    blocks_from_cache(cache, layout, 0, expected)
    staging = layout.staging(3).zero_()
    assert load_layer(store, layout.keys(prompt), layout, 1, staging) == 3
    assert torch.equal(staging[:, 1], expected[:, 1])
    assert not staging[:, 0].any() and not staging[:, 2].any()  # the other layers never moved


def test_keys_of_another_model_dtype_or_layout_are_never_loaded(tmp_path: Path, store: Store) -> None:
    path = config_file(tmp_path)
    model, layout = engine(path)
    prompt = prompt_of(96, seed=11)
    PrefillWorker(model, layout, store).prefill(prompt)
    assert store.match_prefix(layout.keys(prompt)) == 6
    for seed, dtype, block_tokens in [(1, "float32", BT), (0, "bfloat16", BT), (0, "float32", 32)]:
        other_model, other = engine(path, seed=seed, dtype=dtype, block_tokens=block_tokens)
        assert store.match_prefix(other.keys(prompt)) == 0, (seed, dtype, block_tokens)
        result = PrefillWorker(other_model, other, store, load_policy="always", store_new=False).prefill(prompt)
        assert result.matched_tokens == 0 and result.loaded_tokens == 0


def test_a_block_of_the_wrong_size_is_a_miss(tmp_path: Path, store: Store) -> None:
    model, layout = engine(config_file(tmp_path))
    prompt = prompt_of(48, seed=13)
    keys = layout.keys(prompt)
    store.put(keys[0], b"x" * (layout.block_bytes() + 8))  # someone else's bytes under our key
    store.put(keys[1], b"y" * 100)
    result = PrefillWorker(model, layout, store, load_policy="always").prefill(prompt)
    assert result.matched_tokens == 32 and result.loaded_tokens == 0
    assert result.decision.startswith("recompute: block 0 missing")
    assert result.first_token == generate(model, prompt, 1)[0]


def test_decode_of_kv_that_is_gone_recomputes_or_raises(tmp_path: Path, store: Store) -> None:
    model, layout = engine(config_file(tmp_path))
    prompt = prompt_of(40, seed=17)
    first = generate(model, prompt, 1)[0]
    with pytest.raises(NotFound, match="block 0 of 2"):
        DecodeWorker(model, layout, store, on_missing="error").decode(prompt, first, 5)
    decoded = DecodeWorker(model, layout, store).decode(prompt, first, 5)
    assert decoded.recomputed_tokens == 40 and decoded.tokens == generate(model, prompt, 5)
    with pytest.raises(Exception, match="max_new_tokens"):
        DecodeWorker(model, layout, store).decode(prompt, first, 0)


class Wrapped:
    """A real store with a fault injected in front of ``get_many_into``."""

    def __init__(self, store: Store, before_load: Any) -> None:
        self.store = store
        self.before_load = before_load

    def get_many_into(self, *args: Any, **kwargs: Any) -> Any:
        self.before_load()
        return self.store.get_many_into(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def fast_store_models(worker: PrefillWorker, per_token_s: float = 1e-4) -> None:
    """Cost models under which loading always pays (the tiny model computes faster than any store)."""
    worker.prefill_cost = PrefillCostModel()
    for new, past in [(16, 0), (64, 0), (128, 0), (16, 64)]:
        worker.prefill_cost.observe(new, past, per_token_s * new)
    worker.load_cost = LoadCostModel(latency_s=1e-5, bytes_per_s=1e12)


def test_a_slow_or_failed_load_falls_back_to_recompute(tmp_path: Path, store: Store) -> None:
    model, layout = engine(config_file(tmp_path))
    prompt = prompt_of(80, seed=19)
    PrefillWorker(model, layout, store).prefill(prompt[:64])
    expected = generate(model, prompt, 1)[0]
    slow = PrefillWorker(model, layout, Wrapped(store, lambda: time.sleep(0.5)), min_deadline_s=0.05)
    fast_store_models(slow)
    result = slow.prefill(prompt)
    assert result.decision.startswith("recompute: load slower than") and result.loaded_tokens == 0
    assert result.first_token == expected and result.ttft_s < 0.45

    def fail() -> None:
        raise ConnectionFailed("injected: the daemon is gone")

    failing = PrefillWorker(model, layout, Wrapped(store, fail))
    fast_store_models(failing)
    result = failing.prefill(prompt)
    assert result.decision.startswith("recompute: load failed (ConnectionFailed") and result.first_token == expected


def test_the_worker_recomputes_where_that_is_predicted_faster(tmp_path: Path, store: Store) -> None:
    model, layout = engine(config_file(tmp_path))
    prompt = prompt_of(80, seed=23)
    PrefillWorker(model, layout, store).prefill(prompt[:64])
    worker = PrefillWorker(model, layout, store, store_new=False)
    fast_store_models(worker)
    assert worker.prefill(prompt).decision == "load"
    worker.load_cost = LoadCostModel(latency_s=1.0, bytes_per_s=1e3)  # a store across a very slow link
    result = worker.prefill(prompt)
    assert result.decision == "recompute: predicted faster" and result.matched_tokens == 64
    assert result.loaded_tokens == 0 and result.predicted_s == pytest.approx(result.predicted_recompute_s)


def test_calibration_fits_the_prefill_and_measures_the_store(tmp_path: Path, store: Store) -> None:
    model, layout = engine(config_file(tmp_path))
    worker = PrefillWorker(model, layout, store)
    info = worker.calibrate(64)
    assert worker.prefill_cost.samples == 4 and worker.load_cost.observed >= 1
    # The fitted coefficients are timings: on a loaded machine either may come out 0 (clamped), so
    # only their signs and a positive prediction are checked, never their sizes.
    assert info["per_token_s"] >= 0 and info["per_token_pair_s"] >= 0
    assert worker.prefill_cost.predict(64, 0) > 0


def test_a_daemon_killed_while_a_prefill_loads(tmp_path: Path) -> None:
    model, layout = engine(config_file(tmp_path))
    prompt = prompt_of(80, seed=29)
    # tcp: a same-host client would still copy committed blocks out of the dead daemon's arena.
    config = ClientConfig(transport="tcp", timeout_s=3)
    with LocalCluster(1, dram="32MiB") as cluster, Store.connect(cluster.master_address, config) as store:
        PrefillWorker(model, layout, store).prefill(prompt[:64])
        worker = PrefillWorker(model, layout, Wrapped(store, lambda: cluster.kill_daemon(0)), load_policy="always")
        result = worker.prefill(prompt)
    assert result.matched_tokens == 64 and result.loaded_tokens == 0 and result.computed_tokens == 80
    assert result.first_token == generate(model, prompt, 1)[0]


@pytest.mark.slow
def test_worker_processes_hand_kv_from_prefill_to_decode(tmp_path: Path, cluster: LocalCluster) -> None:
    path = config_file(tmp_path, num_hidden_layers=3)
    model, _ = engine(path)
    prompt = prompt_of(70, seed=31)
    spec = EngineSpec(model_config=str(path), block_tokens=BT, calibrate_tokens=32)
    assert spec.put_mode == "cached"  # the prefill's saves are answered before the master knows them
    with WorkerPool(cluster.master_address, spec, prefill=1, decode=1) as pool:
        first = pool.submit("prefill", 0, tokens=prompt.tolist()).result(timeout=120)
        decoded = pool.submit("decode", 0, tokens=prompt.tolist(), first_token=first["first_token"],
                              max_new_tokens=10).result(timeout=120)  # fmt: skip
        assert decoded["tokens"] == generate(model, prompt, 10) and decoded["tail"] == "transferred"
        # ...and flushed before the hand-off: the decode, another client, loads every one of them.
        assert decoded["loaded_tokens"] == len(prompt) and decoded["recomputed_tokens"] == 0
        pool.kill("decode", 0)
        with pytest.raises(ConnectionFailed, match="decode worker 0"):
            pool.submit("decode", 0, tokens=prompt.tolist(), first_token=1, max_new_tokens=2).result(timeout=30)


@pytest.mark.slow
def test_pd_demo_later_turns_hit_what_earlier_turns_stored(tmp_path: Path) -> None:
    path = config_file(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "kvstore_cli", "pd-demo", "--json", "--model-config", str(path),
         "--block-tokens", "16", "--sessions", "3", "--turns", "3", "--system-tokens", "40",
         "--message-tokens", "10", "30", "--max-new-tokens", "6", "--dram", "32MiB"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    requests, summary = lines[:-1], lines[-1]
    assert summary["summary"] and summary["requests"] == len(requests) == 9 and summary["later_turns"] == 6
    assert summary["later_hit_share"] >= summary["later_expected_share"] - 0.02
    assert summary["later_expected_share"] > 0.4  # earlier turns and answers make most of a later prompt
    for r in requests:
        assert r["prefill_matched_tokens"] >= r["expected_hit_tokens"] - 0.02 * r["prompt_tokens"]
        assert r["prefill_ttft_s"] > 0 and r["answer_tokens"] == 6
        assert r["decode_tail"] in ("transferred", "none")


@pytest.mark.slow
def test_pd_demo_rejects_bad_arguments(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for args in (["--prefill", "0"], ["--model-config", str(bad)], ["--model-config", str(tmp_path / "none.json")]):
        out = subprocess.run([sys.executable, "-m", "kvstore_cli", "pd-demo", *args],
                             capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip
        assert out.returncode == 2 and "error:" in out.stderr, (args, out.stderr)
