"""The SGLang HiCache backend against SGLang's own classes: built by its StorageBackendFactory as the
``dynamic`` backend, over real host KV pools (MHATokenToKVPoolHost and MLATokenToKVPoolHost on CPU
device pools), with a real cluster behind it. Runs only where SGLang imports (see the README); skips
elsewhere."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytestmark = pytest.mark.sglang
torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed (see the README)")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry  # noqa: E402
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


def host_pool(
    layout: str,
    *,
    ratio: float = 2,
    heads: int = HEADS,
    page: int = PAGE,
    layers: int = LAYERS,
    dtype: Any = torch.float32,
    cls: Any = MHATokenToKVPoolHost,
) -> Any:
    """A host pool of ``ratio`` times its device pool's 256 tokens, as ``--hicache-ratio`` sizes one."""
    device = MHATokenToKVPool(256, page, dtype, heads, DIM, layers, "cpu", False, start_layer=0,
                              end_layer=layers - 1)  # fmt: skip
    return cls(
        device.get_device_pool_infos()[0].buffer_info, ratio, 0, page, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device.size, start_layer=device.start_layer, end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging,
    )  # fmt: skip


def mla_pool(layout: str, *, ratio: float = 2, kv_lora_rank: int = 32) -> Any:
    device = MLATokenToKVPool(256, PAGE, torch.float32, kv_lora_rank, 8, LAYERS, "cpu", False, start_layer=0,
                              end_layer=LAYERS - 1)  # fmt: skip
    return MLATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info, ratio, 0, PAGE, layout, pin_memory=False, device="cpu",
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
    metrics: bool = False,
) -> KVStoreHiCache:
    config = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
        enable_storage_metrics=metrics, is_page_first_layout=pool.layout != "layer_first", model_name=model,
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


def store_pages(store: KVStoreHiCache, pool: Any, keys: list[str], indices: torch.Tensor, *, v1: bool) -> bool:
    """Back pages up as SGLang's cache controller does with the interface it picked."""
    if v1:
        return all(store.batch_set_v1(keys, indices))
    return store.batch_set(keys, [pool.get_data_page(s) for s in indices[::PAGE].tolist()])


def load_pages(store: KVStoreHiCache, pool: Any, keys: list[str], indices: torch.Tensor, *, v1: bool) -> list[bool]:
    """Prefetch pages as SGLang's cache controller does with the interface it picked."""
    if v1:
        return store.batch_get_v1(keys, indices)
    got = store.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    for page, start in zip(got, indices[::PAGE].tolist(), strict=True):
        if page is not None:
            pool.set_from_flat_data_page(start, page)
    return [page is not None for page in got]


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


SHARED = [
    ("mha", "page_first", True), ("mha", "page_first_direct", True), ("mha", "layer_first", False),
    ("mha", "page_first", False), ("mha", "page_first_direct", False), ("mha", "page_head", False),
    ("mla", "page_first", True), ("mla", "page_first_direct", True), ("mla", "layer_first", False),
    ("mla", "page_first", False), ("mla", "page_first_direct", False),
]  # fmt: skip


@pytest.mark.parametrize(("attention", "layout", "v1"), SHARED)
def test_host_pools_of_different_sizes_share_pages(
    cluster: LocalCluster, attention: str, layout: str, v1: bool
) -> None:
    """Two servers started with different --hicache-ratio (or --hicache-size) serve each other's pages."""
    make = host_pool if attention == "mha" else mla_pool
    small, large = make(layout, ratio=2), make(layout, ratio=3)
    assert small.size < large.size
    for seed, (src_pool, dst_pool) in enumerate([(small, large), (large, small)]):
        writer = backend(cluster.master_address, src_pool, v1=v1, mla=attention == "mla")
        reader = backend(cluster.master_address, dst_pool, v1=v1, mla=attention == "mla")
        keys = [f"sizes-{attention}-{layout}-{v1}-{seed}-{i}" for i in range(3)]
        src = src_pool.alloc(3 * PAGE)
        pages = fill(src_pool, src, seed=10 + seed)
        assert store_pages(writer, src_pool, keys, src, v1=v1)
        assert reader.batch_exists(keys) == 3
        dst = dst_pool.alloc(3 * PAGE)
        assert load_pages(reader, dst_pool, keys, dst, v1=v1) == [True] * 3
        for i, start in enumerate(dst[::PAGE].tolist()):
            assert torch.equal(dst_pool.get_data_page(start), pages[i])
        writer.close()
        reader.close()


def test_host_pools_whose_pages_differ_never_share(cluster: LocalCluster) -> None:
    pool = host_pool("page_first")
    writer = backend(cluster.master_address, pool, v1=True)
    keys = [f"geometry-{i}" for i in range(2)]
    src = pool.alloc(2 * PAGE)
    fill(pool, src, seed=5)
    assert writer.batch_set_v1(keys, src) == [True, True]
    larger = backend(cluster.master_address, host_pool("page_first", ratio=3), v1=True)
    assert larger.batch_exists(keys) == 2  # only the capacity differs: shared
    others = {
        "dtype": host_pool("page_first", dtype=torch.bfloat16),
        "heads": host_pool("page_first", heads=2 * HEADS),
        "page size": host_pool("page_first", page=2 * PAGE),
        "layers": host_pool("page_first", layers=LAYERS + 1),
    }
    for what, other_pool in others.items():
        other = backend(cluster.master_address, other_pool, v1=True)
        assert other.batch_exists(keys) == 0, what
        assert other.batch_get_v1(keys, other_pool.alloc(2 * other_pool.page_size)) == [False, False], what
        other.close()
    mla_keys = ["geometry-mla-0"]
    mla = mla_pool("page_first")
    mla_writer = backend(cluster.master_address, mla, v1=True, mla=True)
    assert mla_writer.batch_set_v1(mla_keys, mla.alloc(PAGE)) == [True]
    wider = backend(cluster.master_address, mla_pool("page_first", kv_lora_rank=64), v1=True, mla=True)
    assert wider.batch_exists(mla_keys) == 0
    for store in (writer, larger, mla_writer, wider):
        store.close()


def test_get_stats_counts_what_the_backend_did(cluster: LocalCluster) -> None:
    pool = host_pool("page_first")
    page_bytes = 2 * LAYERS * PAGE * HEADS * DIM * 4
    store = backend(cluster.master_address, pool, v1=True, metrics=True)
    keys = [f"stats-{i}" for i in range(4)]
    src = pool.alloc(4 * PAGE)
    fill(pool, src, seed=6)
    assert store.batch_exists(keys) == 0
    assert store.batch_set_v1(keys[:3], src[: 3 * PAGE]) == [True] * 3
    assert store.batch_set_v1(keys[:2], src[: 2 * PAGE]) == [True] * 2  # already stored: no bytes move
    assert store.batch_get_v1(keys, pool.alloc(4 * PAGE)) == [True, True, True, False]
    assert store.batch_exists(keys) == 3
    stats = store.get_stats()
    counts = {name: getattr(stats, name) for name in type(stats).COUNTERS}
    assert counts == {
        "num_pages_read": 3, "num_bytes_read": 3 * page_bytes, "num_pages_missed": 1, "num_pages_read_failed": 0,
        "num_pages_written": 3, "num_bytes_written": 3 * page_bytes, "num_pages_already_stored": 2,
        "num_pages_write_failed": 0, "num_pages_looked_up": 8, "num_pages_found": 3, "num_pages_lookup_failed": 0,
    }  # fmt: skip
    # SGLang's own histograms (sglang:prefetch_pgs, ...): one sample per call that moved pages.
    assert stats.prefetch_pgs == [3] and stats.backup_pgs == [3]
    assert len(stats.prefetch_bandwidth) == 1 and len(stats.backup_bandwidth) == 1
    assert stats.prefetch_bandwidth[0] > 0 and stats.backup_bandwidth[0] > 0
    # Each call reports what happened since the previous one.
    again = store.get_stats()
    assert not any(getattr(again, name) for name in type(again).COUNTERS) and again.backup_pgs == []

    generic = backend(cluster.master_address, host_pool("layer_first"), v1=False, metrics=True)
    flat = [torch.ones(page_bytes // 4) for _ in range(2)]
    assert generic.batch_set(keys[:2], flat)
    assert load_pages(generic, generic.mem_pool_host, keys[:3], generic.mem_pool_host.alloc(3 * PAGE), v1=False) == [
        True, True, False,
    ]  # fmt: skip
    stats = generic.get_stats()
    assert (stats.num_pages_written, stats.num_bytes_written) == (2, 2 * page_bytes)
    assert (stats.num_pages_read, stats.num_bytes_read, stats.num_pages_missed) == (2, 2 * page_bytes, 1)
    store.close()
    generic.close()


def test_get_stats_counts_every_page_of_concurrent_calls(cluster: LocalCluster) -> None:
    """SGLang backs pages up and prefetches them from different threads; no count is lost between them."""
    pool = host_pool("page_first", ratio=4)
    store = backend(cluster.master_address, pool, v1=True)
    threads, pages_each = 4, 5
    ranges = [pool.alloc(pages_each * PAGE) for _ in range(threads)]

    def work(t: int) -> None:
        keys = [f"threads-{t}-{i}" for i in range(pages_each)]
        for i in range(pages_each):
            assert store.batch_set_v1(keys[i : i + 1], ranges[t][i * PAGE : (i + 1) * PAGE]) == [True]
            assert store.batch_get_v1(keys[i : i + 1], ranges[t][i * PAGE : (i + 1) * PAGE]) == [True]

    with ThreadPoolExecutor(threads) as pool_threads:
        for done in [pool_threads.submit(work, t) for t in range(threads)]:
            done.result(timeout=60)
    stats = store.get_stats()
    assert (stats.num_pages_written, stats.num_pages_read) == (threads * pages_each, threads * pages_each)
    assert stats.backup_pgs == []  # SGLang's histograms only when it asks for them (enable_storage_metrics)
    store.close()


def test_a_store_that_went_away_counts_failures() -> None:
    pool = host_pool("page_first")
    with LocalCluster(1, dram="16MiB") as cluster:
        store = backend(cluster.master_address, pool, v1=True, timeout_s=1.0)
    src = pool.alloc(2 * PAGE)
    assert store.batch_set_v1(["gone-a", "gone-b"], src) == [False, False]
    assert store.batch_get_v1(["gone-a", "gone-b"], src) == [False, False]
    assert store.batch_exists(["gone-a", "gone-b"]) == 0
    stats = store.get_stats()
    assert (stats.num_pages_write_failed, stats.num_pages_read_failed, stats.num_pages_lookup_failed) == (2, 2, 2)
    assert (stats.num_pages_written, stats.num_pages_read, stats.num_pages_missed) == (0, 0, 0)
    store.close()


def entry(name: PoolName, pool: Any, *, anchor: bool = False) -> PoolEntry:
    return PoolEntry(name=name, host_pool=pool, device_pool=None, layer_mapper=lambda i: i,
                     is_primary_index_anchor=anchor)  # fmt: skip


def test_v2_registration_takes_the_kv_pool_and_refuses_any_other(cluster: LocalCluster) -> None:
    """SGLang's HybridCacheController registers every entry of its host pool group through v2 after the anchor
    (a KV-only model's group holds the KV pool alone); pools of hybrid models are refused, naming the pool."""
    pool = host_pool("page_first")
    store = backend(cluster.master_address, pool, v1=True)
    for e in HostPoolGroup([entry(PoolName.KV, pool, anchor=True)]).entries:
        store.register_mem_host_pool_v2(e.host_pool, e.name)
    store.on_host_pools_registered()
    keys = ["v2-kv-0"]
    assert store.batch_set_v1(keys, pool.alloc(PAGE)) == [True] and store.batch_exists(keys) == 1

    swa = host_pool("page_first")  # a hybrid sliding-window model's second pool is an MHA pool too
    hybrid = HostPoolGroup([entry(PoolName.KV, pool, anchor=True), entry(PoolName.SWA, swa)])
    with pytest.raises(InvalidArgument, match=r"'swa' pool \(MHATokenToKVPoolHost\)"):
        for e in hybrid.entries:
            store.register_mem_host_pool_v2(e.host_pool, e.name)
    with pytest.raises(InvalidArgument, match="'mamba' pool"):
        store.register_mem_host_pool_v2(swa, PoolName.MAMBA)
    with pytest.raises(InvalidArgument, match="not the host pool registered"):
        store.register_mem_host_pool_v2(swa, PoolName.KV)
    store.close()


def test_pools_the_backend_cannot_name_are_refused(cluster: LocalCluster) -> None:
    with pytest.raises(InvalidArgument, match="page_unified"):
        backend(cluster.master_address, host_pool("page_unified"), v1=False)
    with pytest.raises(InvalidArgument, match="page_head"):
        backend(cluster.master_address, host_pool("page_head"), v1=True)
    # A pool class whose page bytes this backend has not been checked against (SGLang's MXFP8, asymmetric and
    # HiSparse pools are subclasses like this one).
    subclass = type("MHATokenToKVPoolHostVariant", (MHATokenToKVPoolHost,), {})
    with pytest.raises(InvalidArgument, match="MHATokenToKVPoolHostVariant"):
        backend(cluster.master_address, host_pool("page_first", cls=subclass), v1=True)
