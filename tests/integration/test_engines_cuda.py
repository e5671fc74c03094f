"""The engine path with the model and the paged KV on a GPU: blocks staged in pinned host memory,
copied to and from the device. Skips, saying so, where no CUDA device is present (as in CI)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from kvstore_cli.cluster import LocalCluster  # noqa: E402
from kvstore_client.adapters.hf import build_model, layout_for, load_model_config  # noqa: E402
from kvstore_client.adapters.layout import (  # noqa: E402
    KVLayout,
    PagedFormat,
    gather_paged,
    load_blocks,
    save_blocks,
    scatter_paged,
)
from kvstore_client.adapters.workers import DecodeWorker, PrefillWorker  # noqa: E402
from kvstore_client.store import Store  # noqa: E402
from tests.integration.test_engines import config_file, prompt_of  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="64MiB") as c:
        yield c


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_on_the_gpu_hands_kv_to_decode_on_the_gpu(tmp_path: Path, cluster: LocalCluster, dtype: str) -> None:
    config = load_model_config(config_file(tmp_path))
    model = build_model(config, seed=0, dtype=dtype, device="cuda")
    layout = layout_for(config, seed=0, dtype=dtype, block_tokens=16, device="cuda")
    prompt = prompt_of(100, seed=41)
    with Store.connect(cluster.master_address) as store, Store.connect(cluster.master_address) as other:
        prefill = PrefillWorker(model, layout, store, load_policy="always")
        assert prefill.pin and prefill.device.type == "cuda"
        prefill.prefill(prompt[:64])
        result = prefill.prefill(prompt)
        assert result.loaded_tokens == 64 and result.decision == "load"
        decoded = DecodeWorker(model, layout, other).decode(prompt, result.first_token, 10)
    with torch.inference_mode():
        ref = model.generate(prompt.unsqueeze(0).cuda(), max_new_tokens=10, do_sample=False)
    assert decoded.tail == "transferred" and decoded.tokens == ref[0, 100:].tolist()


def test_paged_kv_on_the_gpu_round_trips_through_the_store(cluster: LocalCluster) -> None:
    layout = KVLayout("cuda-paged", num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16", block_tokens=32)
    fmt = PagedFormat("BHNC", block_size=16)
    caches = [torch.randn(20, 2, 16, 32, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    keys = layout.keys(list(range(64)))
    staging = layout.staging(2, pin=True)
    assert gather_paged(caches, layout, fmt, [3, 9, 4, 11], staging) == 2
    with Store.connect(cluster.master_address) as store:
        save_blocks(store, keys, staging)
        back = layout.staging(2, pin=True).zero_()
        assert load_blocks(store, keys, back) == 2
    fresh = [torch.zeros_like(c) for c in caches]
    assert scatter_paged(back, fresh, layout, fmt, [0, 1, -1, 5]) == 2  # -1: a page the engine holds
    for src, dst in zip(caches, fresh, strict=True):
        assert torch.equal(dst[[0, 1, 5]], src[[3, 9, 11]]) and not dst[[2, 3, 4]].any()
