"""Real vLLM engines (its CPU build) serving a model through the store's connector.

Each engine is a process of the vLLM environment (``scripts/vllm-env.sh`` builds it in
``.venv-vllm``; ``$KVSTORE_VLLM_PYTHON`` names another interpreter), driven by
``bench/vllm_engine.py``. Engines run one after another, never two at once (2 cores). The
model is a random-weight Llama (4 layers, hidden 256, 8 heads, 2 KV heads, bf16)
saved with ``save_pretrained``; the reference is the same engine without a connector.
What is checked against the real thing: the tokens of engines with the store against
the engine without it, the stored bytes against Hugging Face's own ``past_key_values``
for the same weights and tokens, and KV crossing between vLLM engines of different page
sizes and Hugging Face's prefill/decode workers, both ways.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.vllm_serving import VllmEngine, free_port, prompt, save_model, vllm_python
from kvstore_cli.cluster import LocalCluster
from kvstore_client import Store
from kvstore_client.adapters.layout import KVLayout, load_blocks
from tests.conftest import run_marked_tests_in

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PYTHON = vllm_python()
MODEL_NAME = "tiny-llama"  # the model's identity in the key namespace, shared with the Hugging Face side
LAYOUT = KVLayout(MODEL_NAME, num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16", block_tokens=256)
LAYOUT32 = KVLayout(MODEL_NAME, num_layers=4, num_kv_heads=2, head_dim=32, dtype="float32", block_tokens=256)

if not Path(PYTHON).exists():
    pytest.skip(
        f"no vLLM environment at {PYTHON} (scripts/vllm-env.sh builds one; or set KVSTORE_VLLM_PYTHON)",
        allow_module_level=True,
    )

P, Q, R, S, T = prompt(3000, 1), prompt(700, 2), prompt(1200, 3), prompt(1100, 4), prompt(900, 5)


def Engine(
    model: Path, workdir: Path, name: str, block: int = 128, master: str = "", dtype: str = "bfloat16", **extra: Any
) -> VllmEngine:
    """An engine with the store's connector when ``master`` is given (keys under :data:`MODEL_NAME`)."""
    return VllmEngine(model, workdir / f"{name}.log", block=block, master=master, dtype=dtype,
                      extra={"model": MODEL_NAME, **extra})  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model_dir(workdir: Path) -> Path:
    return save_model(workdir / "model")


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    model.generation_config.do_sample = False
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    return model


@pytest.fixture(scope="module")
def reference(model_dir: Path, workdir: Path) -> dict[str, list[int]]:
    """Greedy tokens of each prompt from the engine without a connector."""
    engine = Engine(model_dir, workdir, "reference")
    try:
        out = engine.run(P, Q, R, S, T)
    finally:
        engine.close()
    return dict(zip("PQRST", out["tokens"], strict=True))


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(daemons=1, dram="512MiB") as c:
        yield c


def full(tokens: list[int], block: int = 256) -> int:
    """Prompt tokens in whole stored blocks: what a second engine can be given."""
    return len(tokens) // block * block


@pytest.fixture(scope="module")
def stored(model_dir: Path, workdir: Path, cluster: LocalCluster) -> dict[str, Any]:
    """P, Q, R and S computed and stored by an engine with 128-token pages."""
    engine = Engine(model_dir, workdir, "pages-128", 128, cluster.master_address)
    try:
        return engine.run(P, Q, R, S)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def reader(model_dir: Path, workdir: Path, cluster: LocalCluster, stored: object) -> Iterator[VllmEngine]:
    """A second engine, with 256-token pages, after the first stored P, Q, R and S."""
    engine = Engine(model_dir, workdir, "pages-256", 256, cluster.master_address)
    yield engine
    engine.close()


def test_engines_share_kv_through_the_store_across_page_sizes(
    reference: dict[str, list[int]], model_dir: Path, workdir: Path, cluster: LocalCluster,
    stored: dict[str, Any], reader: VllmEngine,
) -> None:  # fmt: skip
    """KV a 128-page engine stored loads into a 256-page engine: every full block from the store, and
    the same greedy tokens as the engine computing everything itself.

    Tokens after a load are compared in float32. The model has random weights (nearly flat logits),
    and in bf16 an engine that loads a long prefix and computes only its tail rounds differently from
    one that computes it all: on AVX-512 vector kernels (a CPU without AMX) a 128-page engine loading
    P's 2816 tokens diverged from its own tokens from the fourth one on, exactly as the 256-page one
    did, while fresh 128- and 256-page engines agreed; in float32 all of them agree. The bf16 load is
    held to what it loaded and to vLLM's counters here, and to its tokens where only a short prefix
    is loaded (:func:`test_loaded_kv_is_used_a_bad_block_is_repaired_and_salts_never_mix`).
    """
    assert stored["tokens"] == [reference[p] for p in "PQRS"]
    assert stored["cached"] == [0, 0, 0, 0]
    loaded = reader.run(P, Q)
    assert loaded["cached"] == [full(P), full(Q)], reader.tail()  # every full block came from the store
    # vLLM's own counters say so too, and the connector's (exported through vLLM's KV connector stats).
    metrics = loaded["metrics"]
    assert metrics["vllm:external_prefix_cache_hits"] == full(P) + full(Q)
    assert metrics["vllm:kvstore_loaded_blocks"] == (full(P) + full(Q)) // 256
    assert metrics["vllm:kvstore_loaded_bytes"] == (full(P) + full(Q)) // 256 * LAYOUT.block_bytes()
    assert "vllm:kvstore_load_failed_blocks" not in metrics
    # float32: a 128-page engine computes and stores P and Q, a 256-page engine loads them.
    writer = Engine(model_dir, workdir, "fp32-pages-128", 128, cluster.master_address, dtype="float32")
    try:
        own = writer.run(P, Q)
    finally:
        writer.close()
    assert own["cached"] == [0, 0]
    with Store.connect(cluster.master_address) as store:
        for tokens in (P, Q):
            keys = LAYOUT32.keys(tokens)
            eventually(lambda keys=keys: store.match_prefix(keys) == len(keys))  # saved by a background thread
    reader32 = Engine(model_dir, workdir, "fp32-pages-256", 256, cluster.master_address, dtype="float32")
    try:
        got = reader32.run(P, Q)
    finally:
        reader32.close()
    assert got["cached"] == [full(P), full(Q)], reader32.tail()
    assert got["tokens"] == own["tokens"], reader32.tail()
    with Store.connect(cluster.master_address) as store:
        assert store.match_prefix(LAYOUT.keys(P)) == len(P) // 256


def test_stored_blocks_decode_to_the_models_own_kv(hf_model: Any, cluster: LocalCluster, stored: object) -> None:
    """The bytes vLLM's CPU backend stored, read through KVLayout, are Hugging Face's K and V."""
    with Store.connect(cluster.master_address) as store:
        keys = LAYOUT.keys(Q)
        staging = LAYOUT.staging(len(keys))
        assert load_blocks(store, keys, staging) == len(keys) == 2
    got = [
        tuple(staging[:, layer, part].reshape(512, 2, 32).permute(1, 0, 2)[None] for part in (0, 1))
        for layer in range(LAYOUT.num_layers)
    ]  # each [1, heads, tokens, dim], read straight from the blocks' bytes
    assert_same_kv(got, own_kv(hf_model, Q[:512]), torch.bfloat16)  # type: ignore[arg-type]


def assert_same_kv(got: list[tuple[torch.Tensor, torch.Tensor]], want: list[tuple[torch.Tensor, torch.Tensor]],
                   dtype: torch.dtype) -> None:  # fmt: skip
    """Two sides' K and V of the same tokens, layer by layer, equal within what ``dtype`` rounds to.

    bf16: the two compute in bf16 with different kernels and round at different steps, so a layer's
    values differ by a few bf16 steps (~1e-2 of their size); float32: they agree to ~1e-5.
    """
    assert len(got) == len(want)
    tol = {torch.bfloat16: 0.05, torch.float32: 1e-3}[dtype]
    for layer, (got_kv, want_kv) in enumerate(zip(got, want, strict=True)):
        for part, g, w in zip("KV", got_kv, want_kv, strict=True):
            assert g.dtype == w.dtype == dtype and g.shape == w.shape, (layer, part, g.dtype, w.dtype, g.shape, w.shape)
            cos = torch.nn.functional.cosine_similarity(g.float().flatten(), w.float().flatten(), dim=0)
            assert cos > 1 - tol / 50, f"layer {layer} {part}: cosine {cos:.6f}"
            torch.testing.assert_close(g.float(), w.float(), atol=tol, rtol=tol, msg=f"layer {layer} {part}")


def stored_kv(
    store: Store, layout: KVLayout, tokens: list[int], config: Any
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The K and V of every full block of ``tokens`` in the store, as a Hugging Face worker loads them."""
    from kvstore_client.adapters.hf import cache_from_blocks, cache_layers

    keys = layout.keys(tokens)
    staging = layout.staging(len(keys))
    assert load_blocks(store, keys, staging) == len(keys), "a block is missing"
    return cache_layers(cache_from_blocks([staging], layout, config, len(keys) * layout.block_tokens))


def own_kv(model: Any, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The K and V Hugging Face computes for ``tokens`` itself."""
    from kvstore_client.adapters.hf import cache_layers

    with torch.inference_mode():
        return cache_layers(model(torch.tensor([tokens]), use_cache=True).past_key_values)


def test_hugging_face_workers_and_vllm_read_each_others_kv(
    hf_model: Any, model_dir: Path, workdir: Path, cluster: LocalCluster, stored: object
) -> None:
    """What one side stores is, layer by layer, the K and V the other computes for the same tokens; and
    where greedy tokens can be compared, they are the same whichever side computed the KV.

    Tokens are compared in float32 only. The model has random weights, so its logits are nearly flat,
    and in bf16 the two implementations' KV differs by rounding (a few bf16 steps, which kernels vLLM
    picks decides: AMX or AVX-512 vector): enough to flip the first greedy token on one CPU and none on
    another. In float32 they agree to ~1e-5 and the tokens are a meaningful check.
    """
    from transformers import AutoModelForCausalLM

    from kvstore_client.adapters.workers import DecodeWorker, PrefillWorker

    with Store.connect(cluster.master_address) as store:
        # bf16, vLLM -> Hugging Face: every block the 128-page engine stored for P, as the decode worker
        # loads it, is HF's own KV of those tokens; the decode worker loads all of it and generates.
        assert_same_kv(stored_kv(store, LAYOUT, P, hf_model.config), own_kv(hf_model, P[: full(P)]), torch.bfloat16)
        decoded = DecodeWorker(hf_model, LAYOUT, store, save_output=False).decode(P, 0, 8)
        assert decoded.loaded_tokens == full(P) and decoded.recomputed_tokens == len(P) - full(P)
        assert len(decoded.tokens) == 8
    model32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model32.eval()
    model32.generation_config.pad_token_id = model32.generation_config.eos_token_id
    engine = Engine(model_dir, workdir, "fp32", 128, cluster.master_address, dtype="float32")
    try:
        own = engine.run(T)  # computes T, and stores its own KV
        assert own["cached"] == [0]
        with Store.connect(cluster.master_address) as store:
            keys = LAYOUT32.keys(T)
            eventually(lambda: store.match_prefix(keys) == len(keys))  # saves are put by a background thread
            # float32, vLLM -> Hugging Face: the KV, then the tokens of a decode worker that loads it.
            from_vllm = stored_kv(store, LAYOUT32, T, model32.config)
            assert_same_kv(from_vllm, own_kv(model32, T[: full(T)]), torch.float32)
            with torch.inference_mode():
                want = model32.generate(torch.tensor([T]), max_new_tokens=8, do_sample=False)[0, len(T) :].tolist()
            decoded = DecodeWorker(model32, LAYOUT32, store, save_output=False).decode(T, int(want[0]), 8)
            assert decoded.loaded_tokens == full(T) and decoded.tokens == want
            # float32, Hugging Face -> vLLM: HF's prefill worker stores T in place of vLLM's blocks.
            assert store.remove_many(keys) == len(keys)
            result = PrefillWorker(model32, LAYOUT32, store, load_policy="never", store_tail=False).prefill(T)
            assert result.stored_blocks == len(keys)
            assert_same_kv(stored_kv(store, LAYOUT32, T, model32.config), from_vllm, torch.float32)
        loaded = engine.run(T)  # now from Hugging Face's KV
    finally:
        engine.close()
    assert loaded["cached"] == [full(T)]
    assert loaded["tokens"] == own["tokens"]


def test_loaded_kv_is_used_a_bad_block_is_repaired_and_salts_never_mix(
    reference: dict[str, list[int]], cluster: LocalCluster, reader: VllmEngine
) -> None:
    with Store.connect(cluster.master_address) as store:
        # R: block 2 overwritten with garbage of the same size; S: block 1 removed; then one of the wrong size.
        r_keys, s_keys = LAYOUT.keys(R), LAYOUT.keys(S)
        assert store.match_prefix(r_keys) == len(r_keys) and store.match_prefix(s_keys) == len(s_keys)
        garbage = (torch.randn(LAYOUT.block_bytes() // 2) * 3).to(torch.bfloat16)
        assert store.remove(r_keys[2])
        store.put(r_keys[2], garbage.view(torch.uint8).numpy())
        assert store.remove(s_keys[1])
        out = reader.run(R, S)
        assert out["cached"] == [full(R), 256]
        assert out["tokens"][0] != reference["R"], "garbage KV left the output unchanged: was it loaded?"
        assert out["tokens"][1] == reference["S"]  # blocks 1.. recomputed, and stored again (in the background)
        eventually(lambda: store.match_prefix(s_keys) == len(s_keys))
        # A block of the wrong size is refused, removed and recomputed.
        assert store.remove(s_keys[2])
        store.put(s_keys[2], b"x" * 1000)
        again = reader.run(S)
        assert again["tokens"] == [reference["S"]] and again["cached"] == [512]
        eventually(lambda: store.sizes([s_keys[2]]) == [LAYOUT.block_bytes()])  # repaired: stored anew
        # A salted request shares nothing with unsalted ones, and everything with the same salt.
        salted = reader.run(P, salt="alice")
        assert salted["cached"] == [0] and salted["tokens"] == [reference["P"]]
        eventually(lambda: reader.run(P, salt="alice")["cached"] == [full(P)])
        assert reader.run(P, salt="bob")["cached"] == [0]


def eventually(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Saves are put by the connector's background thread after the step: wait for what they make true."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.2)


def test_a_dead_or_frozen_store_costs_nothing_but_its_hits(
    model_dir: Path, workdir: Path, reference: dict[str, list[int]]
) -> None:
    """Down at start, then up (used after the breaker's probe), frozen (SIGSTOP), killed: every answer right."""
    port = free_port()
    engine = Engine(model_dir, workdir, "sick-store", 128, f"127.0.0.1:{port}", lookup_timeout_s=1.0, timeout_s=2.0)
    timings: dict[str, float] = {}
    try:
        down = engine.run(P, Q)
        assert down["tokens"] == [reference["P"], reference["Q"]] and down["cached"] == [0, 0]
        timings["down"] = down["seconds"]
        with LocalCluster(daemons=1, dram="256MiB", master_port=port) as c:
            deadline = time.monotonic() + 120
            while engine.run(P)["cached"] != [full(P)]:  # the breaker's probe finds it; P is stored, then hit
                assert time.monotonic() < deadline, engine.tail()
                time.sleep(1.0)
            assert c.master is not None and c.daemons[0] is not None
            frozen = [c.master, c.daemons[0]]
            for proc in frozen:
                proc.send_signal(signal.SIGSTOP)
            try:
                out = engine.run(Q, R, P)
                timings["frozen"] = out["seconds"]
                assert out["tokens"] == [reference["Q"], reference["R"], reference["P"]], engine.tail()
            finally:
                for proc in frozen:
                    proc.send_signal(signal.SIGCONT)
        out = engine.run(S, P)  # the cluster is gone
        timings["killed"] = out["seconds"]
        assert out["tokens"] == [reference["S"], reference["P"]] and out["cached"] == [0, 0]
    finally:
        engine.close()
    print(json.dumps({"sick_store_seconds": timings}), file=sys.stderr)


def test_the_connector_against_vllms_scheduler_in_the_vllm_environment() -> None:
    """test_vllm_connector.py drives vLLM's own Scheduler step by step; it imports vLLM, so it runs there."""
    run_marked_tests_in(PYTHON, "vllm", "tests/integration/test_vllm_connector.py", timeout=600)
