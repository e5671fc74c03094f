"""LMCache on kvstore: an L2 adapter for LMCache's multiprocess storage manager, and a remote
connector for its older ``remote_url`` path. Neither needs a change to LMCache.

**L2 adapter** (LMCache's plugin type)::

    {"type": "plugin", "module_path": "kvstore_client.adapters.lmcache",
     "class_name": "KVStoreL2Adapter", "config_class_name": "KVStoreL2AdapterConfig",
     "adapter_params": {"master": "10.0.0.1:50051", "namespace": "lmcache"}}

``submit_store_task`` puts the memory objects' bytes under one key per ``ObjectKey`` (the
namespace, then the key as LMCache's native connectors spell it: model ``@`` rank ``@`` object
group ``@`` chunk hash [``@`` cache salt]); ``submit_lookup_and_lock_task`` answers which are
stored (a master run with ``--default-kv-lease-ttl`` holds each key found against eviction that
long: the lock; the adapter also counts locks, as LMCache's native adapters do);
``submit_load_task`` reads straight into the caller's memory objects; ``delete`` removes. Every
call is done by a small thread pool and signalled on the adapter's three event fds, as the
interface asks. A store that does not answer fails the task (store: the whole task, LMCache's
coarse rule; lookup and load: those keys), never the caller.

**Remote connector** (``remote_url: kvstore://HOST:PORT[/namespace]``)::

    remote_storage_plugins: ["kvstore"]
    extra_config:
      remote_storage_plugin.kvstore.module_path: kvstore_client.adapters.lmcache
      remote_storage_plugin.kvstore.class_name: KVStoreConnectorAdapter
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import xxhash
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier
from lmcache.v1.storage_backend.connector import ConnectorAdapter
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvstore.config import ClientConfig
from kvstore.errors import KVStoreError
from kvstore.keys import MAX_KEY_BYTES
from kvstore.results import PutStatus
from kvstore_client.store import PutOptions, Store

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryObj

log = logging.getLogger("kvstore.lmcache")

PUT_MODES = ("cached", "visible")


def object_key(namespace: str, key: ObjectKey) -> str:
    """The store's key of an LMCache ``ObjectKey``: ``namespace/`` and LMCache's native spelling
    (:func:`_spelled`)."""
    spelled = f"{key.model_name}@{key.kv_rank:08x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
    if key.cache_salt:
        spelled += f"@{key.cache_salt}"
    return _spelled(namespace, spelled)


class KVStoreL2AdapterConfig(L2AdapterConfigBase):
    """The adapter's settings, from ``adapter_params``:

    - ``master`` (str, required): the master's ``host:port``, or ``etcd://H:P/cluster`` (HA);
    - ``namespace`` (str, default ``lmcache``): the first segment of every key (within the
      tenant's own keys when ``token`` names one);
    - ``timeout_s`` (float, default 5): bound on each store call;
    - ``num_workers`` (int, default 4): threads that carry out the tasks;
    - ``put_mode`` (``cached`` or ``visible``, default ``cached``): a store task completes when the
      daemons hold the bytes, or once the master made them visible;
    - ``replicas`` (int, default 1): copies of each object;
    - ``token`` (a tenant's ``NAME.SECRET``) or ``cluster_secret_file``: for a cluster that
      authenticates.
    """

    def __init__(
        self,
        master: str,
        namespace: str = "lmcache",
        timeout_s: float = 5.0,
        num_workers: int = 4,
        put_mode: str = "cached",
        replicas: int = 1,
        cluster_secret_file: str | None = None,
        token: str | None = None,
    ) -> None:
        if not isinstance(master, str) or not master:
            raise ValueError("master must be the master's host:port (or etcd://H:P/cluster)")
        if not isinstance(namespace, str) or not namespace or "/" in namespace or "@" in namespace:
            raise ValueError(f"namespace must be a non-empty name without '/' or '@', not {namespace!r}")
        if put_mode not in PUT_MODES:
            raise ValueError(f"put_mode must be one of {PUT_MODES}, not {put_mode!r}")
        if not 0 < float(timeout_s) <= 600:
            raise ValueError(f"timeout_s must be in (0, 600], not {timeout_s!r}")
        if not 1 <= int(replicas) <= 16:
            raise ValueError(f"replicas must be from 1 to 16, not {replicas!r}")
        self.master = master
        self.namespace = namespace
        self.timeout_s = float(timeout_s)
        self.num_workers = L2AdapterConfigBase._validate_num_workers(num_workers)
        self.put_mode = put_mode
        self.replicas = int(replicas)
        self.cluster_secret_file = cluster_secret_file
        self.token = token

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVStoreL2AdapterConfig:
        known = {"master", "namespace", "timeout_s", "num_workers", "put_mode", "replicas",
                 "cluster_secret_file", "token"}  # fmt: skip
        unknown = sorted(set(d) - known - {"type"})
        if unknown:
            raise ValueError(f"unknown kvstore adapter settings {unknown}; known: {sorted(known)}")
        if "master" not in d:
            raise ValueError("the kvstore adapter needs 'master' (the master's host:port)")
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def help(cls) -> str:
        return cls.__doc__ or ""

    def client_config(self) -> ClientConfig:
        fields: dict[str, Any] = {"timeout_s": self.timeout_s, "put_mode": self.put_mode}
        if self.cluster_secret_file:
            fields["cluster_secret_file"] = self.cluster_secret_file
        if self.token:
            fields["token"] = self.token
        return ClientConfig(**fields)


class KVStoreL2Adapter(L2AdapterInterface):
    """LMCache's L2 adapter interface on a kvstore cluster (see the module's text). Thread-safe."""

    def __init__(self, config: KVStoreL2AdapterConfig | dict[str, Any], l1_memory_desc: Any = None) -> None:
        if isinstance(config, dict):
            config = KVStoreL2AdapterConfig.from_dict(config)
        super().__init__(max_capacity_bytes=0)  # the store evicts by its own LRU, across its nodes
        self._backend_name = "kvstore"
        self._shared = True
        self.config = config
        self._store = Store.connect(config.master, config.client_config())
        self._options = PutOptions(replicas=config.replicas)
        self._pool = ThreadPoolExecutor(config.num_workers, thread_name_prefix="kvstore-lmcache")
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id = 0
        self._stored: dict[L2TaskId, L2StoreResult] = {}
        self._looked_up: dict[L2TaskId, Bitmap] = {}
        self._loaded: dict[L2TaskId, Bitmap] = {}
        self._locks: dict[ObjectKey, int] = {}
        self._failures = 0
        self._last_error = ""
        self._closed = False

    # -- event fds -----------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # -- tasks ---------------------------------------------------------------------------------
    def _task(self) -> L2TaskId:
        with self._lock:
            if self._closed:
                raise RuntimeError("the kvstore L2 adapter is closed")
            self._next_id += 1
            return self._next_id

    def _keys(self, keys: list[ObjectKey]) -> list[str]:
        return [object_key(self.config.namespace, k) for k in keys]

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self._failures += 1
            self._last_error = f"{what}: {exc}"
        log.warning("kvstore L2 adapter: %s failed: %s", what, exc)

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} memory objects")
        task = self._task()
        self._pool.submit(self._store_now, task, keys, objects)
        return task

    def _store_now(self, task: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        result = L2StoreResult(False, 0)
        stored: list[ObjectKey] = []
        sizes: list[int] = []
        try:
            views = [obj.byte_array for obj in objects]
            statuses = self._store.put_many(zip(self._keys(keys), views, strict=True), self._options)
            for key, view, status in zip(keys, views, statuses, strict=True):
                if status is PutStatus.STORED:
                    stored.append(key)
                    sizes.append(len(view))
            result = L2StoreResult(True, sum(sizes))
        except (KVStoreError, ValueError, TypeError) as exc:
            self._failed(f"storing {len(keys)} objects", exc)
        with self._lock:
            self._stored[task] = result
        if stored:
            self._notify_keys_stored(stored, sizes)
        self._store_efd.notify()

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stored = self._stored, {}
        return done

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        task = self._task()
        self._pool.submit(self._look_up_now, task, keys)
        return task

    def _look_up_now(self, task: L2TaskId, keys: list[ObjectKey]) -> None:
        found = Bitmap(len(keys))
        try:
            sizes = self._store.sizes(self._keys(keys))
        except KVStoreError as exc:
            self._failed(f"looking up {len(keys)} objects", exc)
            sizes = [None] * len(keys)
        with self._lock:
            for i, (key, size) in enumerate(zip(keys, sizes, strict=True)):
                if size is not None:
                    found.set(i)
                    self._locks[key] = self._locks.get(key, 0) + 1
            self._looked_up[task] = found
        self._lookup_efd.notify()

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._looked_up.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for key in keys:
                held = self._locks.get(key, 0)
                if held <= 1:
                    self._locks.pop(key, None)
                else:
                    self._locks[key] = held - 1

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys but {len(objects)} memory objects")
        task = self._task()
        self._pool.submit(self._load_now, task, keys, objects)
        return task

    def _load_now(self, task: L2TaskId, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        loaded = Bitmap(len(keys))
        accessed: list[ObjectKey] = []
        try:
            views = [obj.byte_array for obj in objects]
            got = self._store.get_many_into(self._keys(keys), views, exact_size=True)
            for i, (key, size) in enumerate(zip(keys, got, strict=True)):
                if size is not None:
                    loaded.set(i)
                    accessed.append(key)
        except KVStoreError as exc:
            self._failed(f"loading {len(keys)} objects", exc)
        if accessed:
            self._notify_keys_accessed(accessed)
        with self._lock:
            self._loaded[task] = loaded
        self._load_efd.notify()

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loaded.pop(task_id, None)

    # -- eviction, status, close ---------------------------------------------------------------
    def delete(self, keys: list[ObjectKey]) -> None:
        names = self._keys(keys)
        try:
            sizes = self._store.sizes(names)
            self._store.remove_many(names)
        except KVStoreError as exc:
            self._failed(f"deleting {len(keys)} objects", exc)
            return
        gone = [(k, s) for k, s in zip(keys, sizes, strict=True) if s is not None]
        if gone:
            self._notify_keys_deleted([k for k, _ in gone], [s for _, s in gone])

    def report_status(self) -> dict[str, Any]:
        with self._lock:
            failures, last, locked = self._failures, self._last_error, len(self._locks)
        healthy = True
        try:
            self._store.stats()
        except KVStoreError as exc:
            healthy, last = False, f"the master does not answer: {exc}"
        return {"is_healthy": healthy, "type": "KVStoreL2Adapter", "master": self.config.master,
                "namespace": self.config.namespace, "failures": failures, "last_error": last,
                "locked_key_count": locked}  # fmt: skip

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self._store.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()


def parse_kvstore_url(url: str) -> tuple[str, str]:
    """(master ``host:port``, namespace) of ``kvstore://HOST:PORT[/namespace]``."""
    parsed = urlparse(url)
    if parsed.scheme != "kvstore" or not parsed.hostname or parsed.port is None:
        raise ValueError(f"a kvstore remote URL is kvstore://HOST:PORT[/namespace], not {url!r}")
    namespace = parsed.path.strip("/") or "lmcache"
    return f"{parsed.hostname}:{parsed.port}", namespace


def _spelled(namespace: str, key: str) -> str:
    """``namespace/key``; past the longest key, ``namespace/`` and the xxh3-128 of ``key``."""
    out = f"{namespace}/{key}"
    if len(out.encode()) > MAX_KEY_BYTES:
        out = f"{namespace}/h{xxhash.xxh3_128_hexdigest(key.encode())}"
    return out


class KVStoreRemoteConnector(RemoteConnector):
    """LMCache's ``RemoteConnector`` (its ``remote_url`` path) on kvstore: each chunk is one block
    under ``namespace/`` and ``CacheEngineKey.to_string()``, its bytes as LMCache lays them out (a
    partial chunk is read back by its length, as LMCache's other raw-bytes connectors do). Calls
    run on a small thread pool off LMCache's event loop."""

    def __init__(self, url: str, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any = None) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        master, self.namespace = parse_kvstore_url(url)
        extra = dict(getattr(local_cpu_backend.config, "extra_config", None) or {})
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        fields: dict[str, Any] = {"timeout_s": float(extra.get("kvstore.timeout_s", 5.0))}
        if extra.get("kvstore.token"):
            fields["token"] = str(extra["kvstore.token"])
        if extra.get("kvstore.transport"):  # ClientConfig's: auto (shared memory on one host), tcp, ucx
            fields["transport"] = str(extra["kvstore.transport"])
        self._store = Store.connect(master, ClientConfig(**fields))
        self._pool = ThreadPoolExecutor(int(extra.get("kvstore.num_workers", 4)), thread_name_prefix="kvstore-lmc")

    def _key(self, key: Any) -> str:
        return _spelled(self.namespace, key.to_string())

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await self.loop.run_in_executor(self._pool, fn, *args)

    def _allocate(self) -> Any:
        return self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)

    def _read(self, keys: list[Any]) -> list[Any]:
        objs = [self._allocate() for _ in keys]
        wanted = [i for i, obj in enumerate(objs) if obj is not None]
        got: list[int | None] = [None] * len(keys)
        if wanted:
            try:
                sizes = self._store.get_many_into([self._key(keys[i]) for i in wanted],
                                                  [objs[i].byte_array for i in wanted])  # fmt: skip
            except KVStoreError as exc:
                log.warning("kvstore remote connector: reading %d chunks failed: %s", len(wanted), exc)
                sizes = [None] * len(wanted)
            for i, size in zip(wanted, sizes, strict=True):
                got[i] = size
        out: list[Any] = []
        for obj, size in zip(objs, got, strict=True):
            if obj is None:
                out.append(None)
            elif size is None or size == 0:
                obj.ref_count_down()
                out.append(None)
            else:
                out.append(self.reshape_partial_chunk(obj, size))
        return out

    def _write(self, keys: list[Any], objs: list[Any]) -> None:
        self._store.put_many(zip([self._key(k) for k in keys], [o.byte_array for o in objs], strict=True))

    def _exists(self, keys: list[Any]) -> list[bool]:
        return [s is not None for s in self._store.sizes([self._key(k) for k in keys])]

    async def exists(self, key: Any) -> bool:
        found: list[bool] = await self._run(self._exists, [key])
        return found[0]

    def exists_sync(self, key: Any) -> bool:
        return self._exists([key])[0]

    async def get(self, key: Any) -> Any:
        got: list[Any] = await self._run(self._read, [key])
        return got[0]

    async def put(self, key: Any, memory_obj: Any) -> None:
        await self._run(self._write, [key], [memory_obj])

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        got: list[Any] = await self._run(self._read, list(keys))
        return got

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        await self._run(self._write, list(keys), list(memory_objs))

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[Any]) -> int:
        """How many leading keys are stored."""
        return self._store.match_prefix([self._key(k) for k in keys])

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        try:
            await self._run(self._store.stats)
        except KVStoreError:
            return 1
        return 0

    def remove_sync(self, key: Any) -> bool:
        return self._store.remove_many([self._key(key)]) == 1

    async def list(self) -> list[str]:
        prefix = f"{self.namespace}/"
        keys: list[str] = await self._run(lambda: list(self._store.iter_keys(prefix)))
        return [k[len(prefix) :] for k in keys]

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._store.close()


class KVStoreConnectorAdapter(ConnectorAdapter):
    """Makes a :class:`KVStoreRemoteConnector` of ``kvstore://HOST:PORT[/namespace]`` URLs (see the
    module's text for the ``remote_storage_plugins`` lines that register it)."""

    def __init__(self) -> None:
        super().__init__("kvstore://")

    def can_parse(self, url: str) -> bool:
        return url.startswith(self.schema)

    def create_connector(self, context: Any) -> RemoteConnector:
        return KVStoreRemoteConnector(context.url, context.loop, context.local_cpu_backend, context.config)
