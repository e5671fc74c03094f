"""LMCache on kvstore, against LMCache's own classes: its L2 adapter CLI parser and plugin loader
build the adapter, its allocator makes the memory objects, its Bitmap answers; a real cluster
behind it. Store, lookup-and-lock, load, unlock, delete, eviction by the store's LRU, a dead
store, tenants; then the legacy RemoteConnector through LMCache's ConnectorManager. Runs in the
LMCache environment (``scripts/lmcache-env.sh``); skips elsewhere, saying why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

pytestmark = pytest.mark.lmcache
torch = pytest.importorskip("torch")
pytest.importorskip("lmcache", reason="LMCache is not installed (scripts/lmcache-env.sh builds .venv-lmcache)")

from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry  # noqa: E402
from lmcache.v1.memory_allocators.tensor_memory_allocator import TensorMemoryAllocator  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402

from kvstore_cli.cluster import LocalCluster  # noqa: E402
from kvstore_client.adapters.lmcache import KVStoreL2Adapter, object_key  # noqa: E402
from kvstore_client.store import Store  # noqa: E402

T = TypeVar("T")
SHAPE = torch.Size([2, 2, 16, 64])  # LMCache's KV_2LTD chunk: K/V, layers, tokens, hidden
CHUNK_BYTES = SHAPE.numel() * 2  # bfloat16


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="4MiB", master_args=("--default-kv-lease-ttl", "2000")) as c:
        yield c


@pytest.fixture(scope="module")
def allocator() -> TensorMemoryAllocator:
    return TensorMemoryAllocator(torch.empty(64 << 20, dtype=torch.uint8))


def plugin(params: dict[str, Any]) -> KVStoreL2Adapter:
    """The adapter as LMCache builds it from its ``--l2-adapter`` JSON: its parser, its plugin loader."""
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    spec = {"type": "plugin", "module_path": "kvstore_client.adapters.lmcache", "class_name": "KVStoreL2Adapter",
            "config_class_name": "KVStoreL2AdapterConfig", "adapter_params": params}  # fmt: skip
    config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    adapter = create_l2_adapter_from_registry(config.adapters[0])
    assert isinstance(adapter, KVStoreL2Adapter)
    return adapter


def chunk(allocator: TensorMemoryAllocator, seed: int) -> Any:
    obj = allocator.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_2LTD)
    assert obj is not None
    obj.tensor.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
    return obj


def keys(n: int, model: str = "meta-llama/Llama-3.1-8B", salt: str = "") -> list[ObjectKey]:
    return [ObjectKey(os.urandom(32), model, 0, cache_salt=salt) for _ in range(n)]


def finish(fd: int, query: Callable[[], T | None], timeout: float = 15.0) -> T:
    """Wait for the task's event fd, then its result (each result is answered once)."""
    deadline = time.monotonic() + timeout
    while True:
        got = query()
        if got is not None:
            return got
        left = deadline - time.monotonic()
        assert left > 0, "the task did not complete"
        select.select([fd], [], [], min(left, 0.05))


def bits(bitmap: Any, n: int) -> list[bool]:
    return [bool(bitmap.test(i)) for i in range(n)]


def store(adapter: KVStoreL2Adapter, ks: list[ObjectKey], objs: list[Any]) -> Any:
    task = adapter.submit_store_task(ks, objs)
    results = finish(adapter.get_store_event_fd(), lambda: adapter.pop_completed_store_tasks() or None)
    assert list(results) == [task]
    return results[task]


def look_up(adapter: KVStoreL2Adapter, ks: list[ObjectKey]) -> list[bool]:
    task = adapter.submit_lookup_and_lock_task(ks, {})
    return bits(finish(adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(task)),
                len(ks))  # fmt: skip


def load(adapter: KVStoreL2Adapter, ks: list[ObjectKey], objs: list[Any]) -> list[bool]:
    task = adapter.submit_load_task(ks, objs)
    return bits(finish(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task)), len(ks))


def test_store_lookup_load_unlock_delete_through_lmcaches_own_classes(
    cluster: LocalCluster, allocator: TensorMemoryAllocator
) -> None:
    adapter = plugin({"master": cluster.master_address, "namespace": "lmc-test", "num_workers": 2})
    try:
        ks = keys(4)
        objs = [chunk(allocator, i) for i in range(3)]
        result = store(adapter, ks[:3], objs)
        assert result.is_successful() and result.bytes_transferred() == 3 * CHUNK_BYTES
        assert adapter.get_usage().total_bytes_used == 3 * CHUNK_BYTES  # LMCache's accounting, fed by ours
        assert look_up(adapter, ks) == [True, True, True, False]
        assert adapter.report_status()["locked_key_count"] == 3
        into = [allocator.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_2LTD) for _ in ks]
        assert load(adapter, ks, into) == [True, True, True, False]
        for src, dst in zip(objs, into[:3], strict=True):
            assert torch.equal(src.tensor, dst.tensor)  # the bytes LMCache stored, back in its own objects
        adapter.submit_unlock(ks)
        assert adapter.report_status()["locked_key_count"] == 0
        with Store.connect(cluster.master_address) as plain:  # one block per chunk, under LMCache's spelling
            assert plain.sizes([object_key("lmc-test", k) for k in ks]) == [CHUNK_BYTES] * 3 + [None]
        assert store(adapter, ks[:1], objs[:1]).bytes_transferred() == 0  # there already: nothing moved
        adapter.delete(ks[:2])
        assert look_up(adapter, ks[:3]) == [False, False, True]
        assert adapter.get_usage().total_bytes_used == CHUNK_BYTES
        assert adapter.report_status()["is_healthy"]
    finally:
        adapter.close()


def test_the_stores_lru_evicts_what_lmcache_stored_and_lookups_say_so(allocator: TensorMemoryAllocator) -> None:
    with LocalCluster(1, dram="1MiB") as c:  # 128 chunks of 8 KiB at most, less the index's share
        adapter = plugin({"master": c.master_address, "namespace": "lmc-evict"})
        try:
            ks = keys(256)
            batch = [chunk(allocator, i) for i in range(16)]
            for at in range(0, 256, 16):
                assert store(adapter, ks[at : at + 16], batch).is_successful()
            found = look_up(adapter, ks)
            assert found[-16:] == [True] * 16  # the newest stay
            assert not any(found[:64]), "the oldest were not evicted"
            assert adapter.get_usage().total_bytes_used == 256 * CHUNK_BYTES  # what LMCache was told it stored
        finally:
            adapter.close()


def test_a_dead_store_fails_tasks_not_the_caller(allocator: TensorMemoryAllocator) -> None:
    with LocalCluster(1, dram="4MiB") as c:
        adapter = plugin({"master": c.master_address, "timeout_s": 1.0})
        ks = keys(2)
        objs = [chunk(allocator, 1), chunk(allocator, 2)]
        assert store(adapter, ks, objs).is_successful()
        c.kill_master()
        c.kill_daemon(0)
    try:
        start = time.monotonic()
        assert not store(adapter, keys(1), objs[:1]).is_successful()
        assert look_up(adapter, ks) == [False, False]
        assert load(adapter, ks, [allocator.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_2LTD)] * 2) == [False] * 2
        assert time.monotonic() - start < 30
        status = adapter.report_status()
        assert not status["is_healthy"] and status["failures"] >= 3
    finally:
        adapter.close()


def test_tenants_see_only_their_own(allocator: TensorMemoryAllocator) -> None:
    with LocalCluster(1, dram="8MiB", authenticate=True) as c:
        alice, bob = c.add_tenant("alice"), c.add_tenant("bob")
        a = plugin({"master": c.master_address, "token": alice})
        b = plugin({"master": c.master_address, "token": bob})
        try:
            ks = keys(2)
            assert store(a, ks, [chunk(allocator, 1), chunk(allocator, 2)]).is_successful()
            assert look_up(a, ks) == [True, True] and look_up(b, ks) == [False, False]
            with pytest.raises(ValueError, match="unknown kvstore adapter settings"):
                plugin({"master": c.master_address, "tokn": alice})
        finally:
            a.close()
            b.close()


def test_the_remote_connector_through_lmcaches_connector_manager(
    cluster: LocalCluster, allocator: TensorMemoryAllocator
) -> None:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector import ConnectorManager

    config = LMCacheEngineConfig.from_defaults(
        chunk_size=16, remote_url=f"kvstore://{cluster.master_address}/lmc-remote", remote_serde="naive",
        remote_storage_plugins=["kvstore"],
        extra_config={"remote_storage_plugin.kvstore.module_path": "kvstore_client.adapters.lmcache",
                      "remote_storage_plugin.kvstore.class_name": "KVStoreConnectorAdapter"},
    )  # fmt: skip
    metadata = LMCacheMetadata(model_name="tiny", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 2, 32), chunk_size=16)  # fmt: skip

    class Backend:  # what a connector asks of LMCache's LocalCPUBackend: its config, metadata and allocator
        def __init__(self) -> None:
            self.config, self.metadata = config, metadata

        def allocate(self, shapes: Any, dtypes: Any, fmt: Any = MemoryFormat.KV_2LTD) -> Any:
            return allocator.allocate(shapes, dtypes, fmt)

    loop = asyncio.new_event_loop()
    try:
        manager = ConnectorManager(config.remote_url, loop, Backend(), config, metadata)  # type: ignore[arg-type]
        connector = manager.create_connector()
        key = CacheEngineKey("tiny", 1, 0, 12345, torch.bfloat16)
        obj = chunk(allocator, 7)
        assert not loop.run_until_complete(connector.exists(key))
        loop.run_until_complete(connector.put(key, obj))
        assert loop.run_until_complete(connector.exists(key)) and connector.exists_sync(key)
        got = loop.run_until_complete(connector.get(key))
        assert got is not None and torch.equal(got.tensor, obj.tensor)
        assert loop.run_until_complete(connector.list()) == [key.to_string()]
        assert connector.batched_contains([key, CacheEngineKey("tiny", 1, 0, 999, torch.bfloat16)]) == 1
        assert connector.remove_sync(key) and loop.run_until_complete(connector.get(key)) is None
        assert connector._store.config.transport == "auto"
        loop.run_until_complete(connector.close())
        config.extra_config["kvstore.transport"] = "tcp"  # the store's ClientConfig, from LMCache's config
        over_tcp = ConnectorManager(config.remote_url, loop, Backend(), config, metadata).create_connector()  # type: ignore[arg-type]
        assert over_tcp._store.config.transport == "tcp"
        loop.run_until_complete(over_tcp.put(key, obj))
        got = loop.run_until_complete(over_tcp.get(key))
        assert got is not None and torch.equal(got.tensor, obj.tensor)
        loop.run_until_complete(over_tcp.close())
    finally:
        loop.close()
