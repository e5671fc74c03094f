"""The SGLang HiCache backend against SGLang's own classes: built by its StorageBackendFactory as the
``dynamic`` backend, over a real host KV pool (MHATokenToKVPoolHost on a CPU device pool), with a
real cluster behind it. Runs only where SGLang imports (see the README); skips elsewhere."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.sglang
torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed (see the README)")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvstore.errors import InvalidArgument  # noqa: E402
from kvstore_cli.cluster import LocalCluster  # noqa: E402
from kvstore_client.adapters.sglang import KVStoreHiCache  # noqa: E402

LAYERS, HEADS, DIM, PAGE = 3, 2, 16, 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(1, dram="64MiB") as c:
        yield c


def host_pool(layout: str) -> Any:
    device = MHATokenToKVPool(256, PAGE, torch.float32, HEADS, DIM, LAYERS, "cpu", False, start_layer=0,
                              end_layer=LAYERS - 1)  # fmt: skip
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device.size, start_layer=device.start_layer, end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging,
    )  # fmt: skip


def mla_pool(layout: str) -> Any:
    device = MLATokenToKVPool(256, PAGE, torch.float32, 32, 8, LAYERS, "cpu", False, start_layer=0,
                              end_layer=LAYERS - 1)  # fmt: skip
    return MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device.size, start_layer=0, end_layer=LAYERS - 1, target_layer_num=LAYERS,
    )  # fmt: skip


def backend(
    master: str,
    pool: Any,
    *,
    v1: bool,
    tp_rank: int = 0,
    model: str = "tiny",
    timeout_s: float = 10.0,
    mla: bool = False,
) -> KVStoreHiCache:
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=False, is_page_first_layout=pool.layout != "layer_first", model_name=model,
        extra_config={"backend_name": "kvstore", "module_path": "kvstore_client.adapters.sglang",
                      "class_name": "KVStoreHiCache", "master": master, "interface_v1": int(v1),
                      "timeout_s": timeout_s},
    )  # fmt: skip
    made = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(made, KVStoreHiCache)
    made.register_mem_pool_host(pool)  # as SGLang's cache controller does after creating it
    return made


def fill(pool: Any, indices: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Random pages at ``indices`` (a page's first index per page); returns each page's flat data."""
    g = torch.Generator().manual_seed(seed)
    pages = []
    for start in indices[::PAGE].tolist():
        data = torch.randn(pool.get_dummy_flat_data_page().shape, generator=g)
        pool.set_from_flat_data_page(start, data)
        pages.append(data)
    return pages


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_zero_copy_pages_round_trip_through_the_store(cluster: LocalCluster, layout: str) -> None:
    pool = host_pool(layout)
    store = backend(cluster.master_address, pool, v1=True)
    keys = [f"{layout}-page-{i}" for i in range(5)]
    src = pool.alloc(5 * PAGE)
    pages = fill(pool, src, seed=1)
    assert store.batch_exists(keys) == 0
    assert store.batch_set_v1(keys, src) == [True] * 5
    assert store.batch_exists(keys) == 5 and store.exists(keys[2])
    assert store.batch_set_v1(keys[:2], src[: 2 * PAGE]) == [True, True]  # stored again: a no-op
    dst = pool.alloc(5 * PAGE)
    assert store.batch_get_v1(keys, dst) == [True] * 5
    for i, start in enumerate(dst[::PAGE].tolist()):
        assert torch.equal(pool.get_data_page(start), pages[i])
    # A page whose V half is gone: the prefix ends before it, and it does not load.
    store.store.remove(store._key(keys[3], "v"))
    assert store.batch_exists(keys) == 3
    assert store.batch_get_v1(keys, pool.alloc(5 * PAGE)) == [True, True, True, False, True]
    store.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_mla_pages_are_one_object_shared_by_every_rank(cluster: LocalCluster, layout: str) -> None:
    pool = mla_pool(layout)
    writer = backend(cluster.master_address, pool, v1=True, mla=True)
    keys = [f"mla-{layout}-{i}" for i in range(3)]
    src = pool.alloc(3 * PAGE)
    pages = fill(pool, src, seed=4)
    assert writer.batch_set_v1(keys, src) == [True] * 3
    reader = backend(cluster.master_address, pool, v1=True, mla=True, tp_rank=1)  # MLA KV is rank-replicated
    assert reader.batch_exists(keys) == 3
    dst = pool.alloc(3 * PAGE)
    assert reader.batch_get_v1(keys, dst) == [True] * 3
    for i, start in enumerate(dst[::PAGE].tolist()):
        assert torch.equal(pool.get_data_page(start), pages[i])
    writer.close()
    reader.close()


def test_generic_pages_round_trip_in_any_layout(cluster: LocalCluster) -> None:
    pool = host_pool("layer_first")
    store = backend(cluster.master_address, pool, v1=False)
    keys = [f"generic-page-{i}" for i in range(3)]
    src = pool.alloc(3 * PAGE)
    fill(pool, src, seed=2)
    assert store.batch_set(keys, [pool.get_data_page(s) for s in src[::PAGE].tolist()])
    assert store.batch_exists(keys) == 3
    got = store.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    for page, start in zip(got, src[::PAGE].tolist(), strict=True):
        assert page is not None and torch.equal(page, pool.get_data_page(start))
    assert store.get("generic-missing", pool.get_dummy_flat_data_page()) is None
    store.clear()
    assert store.batch_exists(keys) == 0
    store.close()


def test_pages_of_another_rank_model_or_layout_never_answer(cluster: LocalCluster) -> None:
    pool = host_pool("page_first")
    writer = backend(cluster.master_address, pool, v1=True)
    keys = [f"ns-page-{i}" for i in range(2)]
    src = pool.alloc(2 * PAGE)
    fill(pool, src, seed=3)
    assert writer.batch_set_v1(keys, src) == [True, True]
    others = [
        backend(cluster.master_address, pool, v1=True, tp_rank=1),
        backend(cluster.master_address, pool, v1=True, model="other"),
        backend(cluster.master_address, host_pool("page_first_direct"), v1=True),
        backend(cluster.master_address, pool, v1=False),
    ]
    for other in others:
        assert other.batch_exists(keys) == 0
        other.close()
    writer.close()


def test_zero_copy_refuses_a_layout_it_cannot_address(cluster: LocalCluster) -> None:
    with pytest.raises(InvalidArgument, match="page_first"):
        backend(cluster.master_address, host_pool("layer_first"), v1=True)


def test_a_store_that_went_away_gives_misses_not_errors() -> None:
    pool = host_pool("page_first")
    with LocalCluster(1, dram="16MiB") as cluster:
        store = backend(cluster.master_address, pool, v1=True, timeout_s=1.0)
    keys = ["gone-0", "gone-1"]
    src = pool.alloc(2 * PAGE)
    assert store.batch_set_v1(keys, src) == [False, False]
    assert store.batch_get_v1(keys, src) == [False, False]
    assert store.batch_exists(keys) == 0
    store.close()
