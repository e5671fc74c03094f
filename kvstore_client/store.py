"""The blocking face of the client: :class:`Store` (thread-safe).

Every operation is :class:`~kvstore_client.core.ClientCore`'s, run here with sockets and threads:
master calls over a pool of connections that rides out a master restart or failover, daemon jobs
over the data path :class:`~kvstore_client.dataplane.PathSelector` picks per node (shared memory,
UCX, rails or TCP), in parallel when a batch spans several daemons. Every network wait is bounded
by ``ClientConfig.timeout_s``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self, TypeVar

from kvstore.auth import Credential
from kvstore.buffers import as_view
from kvstore.config import ClientConfig
from kvstore.errors import KVStoreError, StoreClosed
from kvstore.events import EngineBlock
from kvstore.keys import checksum
from kvstore.protocol import (
    GetTicket,
    LocatedRef,
    Message,
    NodeInfo,
    OkReply,
    PrefixMatch,
    ReleaseLeases,
    Replicated,
    ReportNode,
    Stats,
    StatsReply,
    TicketReply,
)
from kvstore.results import PutStatus
from kvstore_client.core import ClientCore
from kvstore_client.credentials import Tickets, master_credential
from kvstore_client.dataplane import DataPath, PathSelector
from kvstore_client.effects import Call, Daemons, Effect, Job, Notify, Op, Pause, drive
from kvstore_client.leases import LeaseReleaser
from kvstore_client.puts import PutOptions
from transfer.discovery import MasterLocator
from transfer.rpc import ConnectionPool
from transfer.tls import contexts

__all__ = ["PutOptions", "Store"]

T = TypeVar("T")
R = TypeVar("R", bound=Message)


class Store:
    def __init__(self, master: str, config: ClientConfig | None = None) -> None:
        self.master = master
        self.config = config or ClientConfig()
        credential = master_credential(self.config)
        to_master, to_daemons = contexts(self.config.tls)
        # With etcd, a watch of the leader key: a failover is followed the moment etcd elects the successor.
        self._locator = MasterLocator(master, self.config.timeout_s, watch=True)
        self._master = ConnectionPool(
            self._locator, self.config.timeout_s, 4, credential, to_master, bounded=False
        )  # fmt: skip
        self._tickets = Tickets(credential.name) if credential is not None and credential.kind == "tenant" else None
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None  # for batches that span several daemons
        self._nodes: dict[str, NodeInfo] = {}
        self._nodes_checked = 0.0
        self._paths = PathSelector(
            self.config, self._node, self._ticket if self._tickets is not None else credential, to_daemons
        )
        self._leases = LeaseReleaser(self._send_releases)
        self._core = ClientCore(self.config, self._paths, self._leases)
        self._core.marks.reporter = self._report

    @classmethod
    def connect(cls, master: str, config: ClientConfig | None = None) -> Self:
        """A store connected to the master at ``host:port``, or to the leader of an HA cluster named
        ``etcd://host:2379[,host:2379]/cluster-id`` (followed across failovers); raises
        ConnectionFailed when it does not answer."""
        store = cls(master, config)
        try:
            store._master.call(Stats(), StatsReply)  # fail fast: nobody is there yet to wait for
        except BaseException:
            store.close()
            raise
        return store

    # -- the driver ----------------------------------------------------------------------------
    def _run(self, op: Op[T]) -> T:
        """Carry out ``op``'s effects in turn until it returns (an effect's error is thrown into it)."""
        if self._core.closed:
            op.close()
            raise StoreClosed("this Store is closed")
        return drive(op, self._do)

    def _do(self, effect: Effect) -> Any:
        if isinstance(effect, Call):
            return self._call(effect.message, effect.expect)
        if isinstance(effect, Daemons):
            return self._fan_out(effect.jobs)
        if isinstance(effect, Notify):
            with contextlib.suppress(KVStoreError):
                self._master.call(effect.message, OkReply)
            return None
        assert isinstance(effect, Pause)
        time.sleep(effect.seconds)
        return None

    def _call(self, message: Message, expect: type[R]) -> R:
        if self._core.closed:
            raise StoreClosed("this Store is closed")
        # Ride out a master restart or failover: the same request, with backoff, up to the timeout.
        return self._master.call(message, expect, retry_for=self.config.timeout_s)

    def _fan_out(self, jobs: Sequence[Job]) -> list[Any]:
        """Run one job per daemon, in parallel when there are several; each outcome or its exception."""
        if len(jobs) == 1:
            try:
                return [self._paths.run(jobs[0])]
            except Exception as exc:
                return [exc]
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvstore-io")
        futures = [self._executor.submit(self._paths.run, job) for job in jobs]
        out: list[Any] = []
        for future in futures:
            failure = future.exception()
            out.append(failure if failure is not None else future.result())
        return out

    def _ticket(self) -> Credential:
        """A current ticket for this tenant's connections to daemons (asked of the master when needed)."""
        assert self._tickets is not None
        ticket = self._tickets.fresh()
        if ticket is not None:
            return ticket
        with self._tickets.lock:
            ticket = self._tickets.fresh()
            if ticket is None:
                conn = self._master.acquire()
                try:
                    reply = conn.call(GetTicket(), TicketReply, retry_for=self.config.timeout_s)
                    ticket = self._tickets.take(reply, conn.session_key)
                finally:
                    self._master.release(conn)
            return ticket

    def _node(self, node_id: str) -> NodeInfo | None:
        """What the master said of ``node_id``, asking again (at most twice a second) for a node not yet seen."""
        node = self._nodes.get(node_id)
        if node is None and time.monotonic() - self._nodes_checked > 0.5:
            try:
                self.nodes()
            except KVStoreError:
                return None
            node = self._nodes.get(node_id)
        return node

    def _path(self, node_id: str, address: str) -> DataPath:
        return self._paths.path(node_id, address)

    @contextlib.contextmanager
    def _located(self, keys: list[str]) -> Iterator[list[LocatedRef | None]]:
        """Where ``keys`` are, under read leases (when a path may read the arena directly) that
        are queued for release only when the block is left: once the reads are over."""
        located, first_lease = self._run(self._core.locate(keys))
        try:
            yield located
        finally:
            self._core.release(first_lease, located)

    def _report(self, node_id: str) -> None:
        """Send ReportNode in the background (rare: a node this client could not reach, see NodeMarks.report)."""
        threading.Thread(target=self._send_report, args=(node_id,), name="kvstore-report", daemon=True).start()

    def _send_report(self, node_id: str) -> None:
        if not self._core.closed:
            with contextlib.suppress(KVStoreError):  # best effort: the master fences the node by its TTL anyway
                self._master.call(ReportNode(node_id), OkReply)

    def _send_releases(self, lease_ids: list[int]) -> None:
        with contextlib.suppress(KVStoreError):  # best effort: a lease also ends by itself
            self._master.call(ReleaseLeases(lease_ids), OkReply)

    # -- nodes -------------------------------------------------------------------------------
    def nodes(self) -> list[NodeInfo]:
        """Every registered node: its rails, host, arena and NICs, and whether it is up."""
        nodes = self._run(self._core.nodes())
        with self._lock:
            self._nodes = {n.node_id: n for n in nodes}
            self._nodes_checked = time.monotonic()
        return nodes

    # -- writes ------------------------------------------------------------------------------
    def put(self, key: Any, data: Any, options: PutOptions | None = None) -> PutStatus:
        """Store ``data`` under ``key``; an existing key keeps its bytes and reports EXISTS."""
        job = self._core.granted_block(key, data, options)
        if job is not None:
            # One trip into the grant in hand, without the core's generator (its way for anything else).
            status = self._core.granted_put(job, self._fan_out([job])[0])
            return status if isinstance(status, PutStatus) else self._run(status)[0]
        return self.put_many([(key, data)], options)[0]

    put_from = put

    def put_many(self, items: Iterable[tuple[Any, Any]], options: PutOptions | None = None) -> list[PutStatus]:
        """Store several blocks. Raises the first failure (after giving back what it reserved)."""
        return self._run(self._core.put_many(items, options))

    def flush(self) -> None:
        """Wait until every ``cached`` put of this client (``PutOptions.mode``, ``ClientConfig.put_mode``)
        is visible to every client, or was refused by the master (another writer's block under its key:
        the store keeps that one). A prefill hands its KV to a decode after this. Nothing to wait for
        in ``visible`` mode."""
        self._run(self._core.flush())

    # -- reads ---------------------------------------------------------------------------------
    def get(self, key: Any, *, verify: bool = False) -> bytes | None:
        hit = self._hit(key, None, verify, False)
        if hit is not None:
            return bytes(hit[1])  # type: ignore[arg-type]
        return self.get_many([key], verify=verify)[0]

    def get_many(self, keys: Sequence[Any], *, verify: bool = False) -> list[bytes | None]:
        return self._run(self._core.get_many(keys, verify=verify))

    def get_into(self, key: Any, buffer: Any, *, verify: bool = False) -> int | None:
        return self.get_many_into([key], [buffer], verify=verify)[0]

    def get_many_into(
        self, keys: Sequence[Any], buffers: Sequence[Any], *, verify: bool = False, exact_size: bool = False
    ) -> list[int | None]:
        """Read blocks straight into ``buffers``; each its size, or None for a miss (see
        :meth:`ClientCore.get_many_into <kvstore_client.core.ClientCore.get_many_into>`)."""
        if len(keys) == 1 and len(buffers) == 1:
            hit = self._hit(keys[0], as_view(buffers[0], writable=True, what="buffer"), verify, exact_size)
            if hit is not None:
                return [hit[0]]
        return self._run(self._core.get_many_into(keys, buffers, verify=verify, exact_size=exact_size))

    def _hit(
        self, key: Any, view: memoryview | None, verify: bool, exact_size: bool
    ) -> tuple[int, bytes | bytearray | memoryview | None] | None:
        """One key read in one trip from its remembered node: (size, a new buffer when ``view`` is
        None) when it is there whole and fits (its checksum holding with ``verify``). Anything else
        — no hint, a miss, an error, a bad key — is None: the caller takes the core's way, which
        reads again and decides (this is only its fast path)."""
        if type(key) is not str or self._core.closed:
            return None
        place = self._core.hinted(key)
        if place is None:
            return None
        patience = self._core.read_patience_s
        since = self._core.hints.now()
        began = time.monotonic()
        try:
            [found], [made] = self._paths.path(*place).read_direct([key], [view], exact_size, patience)
        except KVStoreError as exc:
            self._core.marks.note_unreachable(place[0], exc, patience)
            found = None
        else:
            self._core.read_times.add(time.monotonic() - began)
            self._core.marks.answered(place[0])
        if found is None:
            # Not there, or its node failed: the core asks the master, not that node again (a
            # stalled node used to cost the get two timeouts).
            self._core.hints.forget([key], since)
            return None
        target = made if made is not None else view
        if verify and checksum(memoryview(target)[: found.size]) != found.checksum:  # type: ignore[arg-type]
            return None
        return found.size, made

    def get_range_many_into(
        self, keys: Sequence[Any], start: int, length: int, buffers: Sequence[Any]
    ) -> list[int | None]:
        """Read bytes ``[start, start + length)`` of each block into its buffer: ``length`` each, or None."""
        return self._run(self._core.get_range_many_into(keys, start, length, buffers))

    # -- queries -----------------------------------------------------------------------------------
    def exists(self, key: Any) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: Sequence[Any]) -> list[bool]:
        return self._run(self._core.exists_many(keys))

    def label_blocks(self, keys: Sequence[Any], labels: Sequence[EngineBlock]) -> None:
        """Name ``keys`` as an engine names their blocks (its block hashes, tokens): the master's KV
        events of their replicas carry those names (:mod:`kvstore.events`). Call before the put."""
        self._run(self._core.label_blocks(keys, labels))

    def sizes(self, keys: Sequence[Any]) -> list[int | None]:
        """Each key's size in bytes, None for a miss; no bytes move."""
        return self._run(self._core.sizes(keys))

    def match_prefix(self, keys: Sequence[Any]) -> int:
        """How many leading keys are stored: the longest stored prefix of a key list."""
        return self._run(self._core.match_prefix(keys))

    def match_prefix_nodes(self, keys: Sequence[Any]) -> PrefixMatch:
        """The longest stored prefix of a key list, and per node how many leading keys it holds."""
        return self._run(self._core.match_prefix_nodes(keys))

    def replicate(self, keys: Sequence[Any], node_id: str, *, max_bytes: int) -> Replicated:
        """Copy stored blocks into the DRAM of ``node_id`` (see :meth:`ClientCore.replicate
        <kvstore_client.core.ClientCore.replicate>`)."""
        return self._run(self._core.replicate(keys, node_id, max_bytes=max_bytes))

    def remove(self, key: Any) -> bool:
        return self.remove_many([key]) == 1

    def remove_many(self, keys: Sequence[Any], *, force: bool = True) -> int:
        """Remove blocks; once it returns, no read (by anyone) returns their bytes. Without ``force``
        a key held by a recent read (the master's ``--default-kv-lease-ttl``) is left: see
        :meth:`remove_report`."""
        return self.remove_report(keys, force=force)[0]

    def remove_report(self, keys: Sequence[Any], *, force: bool = True) -> tuple[int, list[int]]:
        """Remove blocks: how many were stored and removed, and the indexes of the keys left because
        a recent read holds them (only without ``force``)."""
        return self._run(self._core.remove_report(keys, force=force))

    def clear_replicas(self, keys: Sequence[Any], node: str = "", *, force: bool = False) -> list[str]:
        """Drop the replicas of ``keys`` on ``node`` (every replica when ""; a key left with none is
        removed), once the daemons dropped them: the keys cleared (stored, with a replica there).
        Without ``force`` a key a recent read holds is left (Mooncake's ``batch_replica_clear``)."""
        cleared, _ = self._run(self._core.clear_replicas(keys, node, force=force))
        return [keys[i] for i in cleared]

    def list_keys(self, prefix: str = "", *, after: str = "", limit: int = 1000) -> tuple[list[str], str]:
        """One page of stored keys starting with ``prefix``, in order after ``after``, and the cursor of
        the next page ("" after the last). A tenant lists its own keys."""
        return self._run(self._core.list_keys(prefix, after=after, limit=limit))

    def iter_keys(self, prefix: str = "", *, page: int = 1000) -> Iterator[str]:
        """Every stored key starting with ``prefix``, in order, a page at a time."""
        after = ""
        while True:
            keys, after = self.list_keys(prefix, after=after, limit=page)
            yield from keys
            if not after:
                return

    def stats(self) -> dict[str, int | float]:
        return self._run(self._core.stats())

    def close(self) -> None:
        if self._core.closed:
            return
        self._leases.close(self.config.timeout_s)
        with contextlib.suppress(KVStoreError):
            for effect in self._core.close():
                self._do(effect)
        self._master.close()
        self._locator.close()
        self._paths.close()
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
