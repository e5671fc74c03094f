"""The network client: :class:`Store` (blocking, thread-safe) and :class:`AsyncStore`.

A put asks the master where to write (``put_start``), writes the bytes straight
from the caller's buffers to each replica's daemon, and commits
(``put_end``); a failed write revokes the reservation. A get asks the master
for leased replicas and reads each block straight into the caller's buffer,
trying the next replica when a daemon does not answer: a block on a dead node
reads as a miss, never as an error or a hang. A key whose node the client
remembers (from its own put or an earlier get) is asked of that daemon before
the master is, so the two round trips overlap; its bytes are taken only where
the master's answer confirms them. Every network wait is bounded by
``ClientConfig.timeout_s``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any, Self, TypeVar

from kvstore.buffers import as_view
from kvstore.config import ClientConfig
from kvstore.errors import (
    BufferTooSmall,
    ConnectionFailed,
    CorruptBlock,
    InvalidArgument,
    KVStoreError,
    ProtocolError,
    RetryLater,
    StoreClosed,
    Timeout,
    error_from_code,
)
from kvstore.keys import BlockKey, checksum, validate_key
from kvstore.node_store import PutStatus
from kvstore.protocol import (
    CommitBlocks,
    Exists,
    ExistsReply,
    GetReplicas,
    GetReplicasReply,
    ListNodes,
    LocatedRef,
    MatchPrefix,
    MatchPrefixNodes,
    MatchPrefixNodesReply,
    MatchPrefixReply,
    NodeInfo,
    NodesReply,
    OkReply,
    PrefixMatch,
    PutEnd,
    PutEndReply,
    PutRevoke,
    PutStart,
    PutStartReply,
    ReadBlocks,
    ReadReply,
    ReadSlices,
    ReleaseLeases,
    Remove,
    RemoveReply,
    Replica,
    ReplicaRef,
    Replicate,
    Replicated,
    ReplicateReply,
    Stats,
    StatsReply,
    WriteBlocks,
    WriteReply,
)
from kvstore.tiers.dram import ArenaMapping
from transfer import topology
from transfer.rails import RailSet
from transfer.rpc import ConnectionPool, PendingReply
from transfer.transports import ucx
from transfer.transports.shm import ShmTransport
from transfer.transports.ucx import UcxClient
from transfer.wire import recv_into, recv_read_reply, skip

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PutOptions:
    replicas: int | None = None
    """Copies on distinct nodes; None takes ``ClientConfig.replicas``."""
    pin: bool = False
    """Never evict the block (until it is removed)."""
    preferred_node: str | None = None
    """Node to place the first replica on when it has room (local-first placement)."""


class Store:
    def __init__(self, master: str, config: ClientConfig | None = None) -> None:
        self.master = master
        self.config = config or ClientConfig()
        self._master = ConnectionPool(master, self.config.timeout_s, size=4)
        self._daemons: dict[str, ConnectionPool] = {}
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None  # for batches that span several daemons
        self._hints: dict[str, str] = {}  # key -> the daemon address it was last seen at
        self._hints_lock = threading.Lock()
        self._shm = ShmTransport() if self.config.transport == "auto" else None
        self._nodes: dict[str, NodeInfo] = {}
        self._nodes_checked = 0.0
        self._not_tcp: set[str] = set()  # daemon addresses this client reaches by shm or UCX: no speculation
        self._ucx: UcxClient | None = None
        self._railsets: dict[str, RailSet] = {}
        self._closed = False
        # Leases end once reads are done: the keys ride on the next GetReplicas, or, when no get
        # follows soon, a background thread sends them.
        self._to_release: list[str] = []
        self._release_lock = threading.Lock()
        self._stop_releaser = threading.Event()
        self._releaser = threading.Thread(target=self._release_loop, name="kvstore-lease-release", daemon=True)
        self._releaser.start()

    @classmethod
    def connect(cls, master: str, config: ClientConfig | None = None) -> Self:
        """A store connected to the master at ``host:port``; raises ConnectionFailed when it does not answer."""
        store = cls(master, config)
        try:
            with store._master.connection() as conn:
                conn.call(Stats(), StatsReply)  # fail fast: nobody is there yet to wait for
        except BaseException:
            store.close()
            raise
        return store

    def _call(self, message: Any, expect: type[Any]) -> Any:
        if self._closed:
            raise StoreClosed("this Store is closed")
        with self._master.connection() as conn:
            # Ride out a master restart or failover: the same request, with backoff, up to the timeout.
            return conn.call(message, expect, retry_for=self.config.timeout_s)

    def _pool(self, address: str) -> ConnectionPool:
        with self._lock:
            pool = self._daemons.get(address)
            if pool is None:
                pool = ConnectionPool(address, self.config.timeout_s, self.config.connections_per_daemon)
                self._daemons[address] = pool
            return pool

    # -- nodes and transports ------------------------------------------------------------------
    def nodes(self) -> list[NodeInfo]:
        """Every registered node: its rails, host, arena and NICs, and whether it is up."""
        reply: NodesReply = self._call(ListNodes(), NodesReply)
        with self._lock:
            self._nodes = {n.node_id: n for n in reply.nodes}
            self._nodes_checked = time.monotonic()
        return reply.nodes

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

    def _local_arena(self, node_id: str) -> ArenaMapping | None:
        """The node's DRAM arena, mapped, when it shares this host (and the transport allows it)."""
        if self._shm is None:
            return None
        node = self._node(node_id)
        arena = self._shm.arena(node) if node is not None else None
        if arena is not None and node is not None:
            self._not_tcp.update(node.rails)
        return arena

    def _ucx_address(self, node_id: str) -> str | None:
        """The node's UCX address when this client should use it: asked for, or RDMA at both ends."""
        if self.config.transport == "tcp":
            return None
        node = self._node(node_id)
        if node is None or not node.ucx_address:
            return None
        if self.config.transport == "auto" and not (node.rdma and topology.has_rdma() and ucx.available()):
            return None
        self._not_tcp.update(node.rails)
        return node.ucx_address

    def _railset(self, node_id: str) -> RailSet | None:
        """Slicing and failover over the node's rails when it serves on more than one."""
        node = self._node(node_id)
        if node is None or len(node.rails) < 2:
            return None
        with self._lock:
            railset = self._railsets.get(node_id)
            if railset is None or [r.address for r in railset.rails] != node.rails:
                if railset is not None:
                    railset.close()
                cfg = self.config
                railset = RailSet(
                    node.rails, timeout=cfg.rail_timeout_s, slice_bytes=cfg.slice_bytes,
                    max_inflight=cfg.max_slices_in_flight, cooldown_s=cfg.rail_cooldown_s,
                )  # fmt: skip
                self._railsets[node_id] = railset
            self._not_tcp.update(node.rails)
            return railset

    def _ucx_client(self) -> UcxClient:
        with self._lock:
            if self._ucx is None:
                self._ucx = UcxClient(self.config.timeout_s)
            return self._ucx

    # -- writes ------------------------------------------------------------------------------
    def put(self, key: Any, data: Any, options: PutOptions | None = None) -> PutStatus:
        """Store ``data`` under ``key``; an existing key keeps its bytes and reports EXISTS."""
        return self.put_many([(key, data)], options)[0]

    put_from = put

    def put_many(self, items: Iterable[tuple[Any, Any]], options: PutOptions | None = None) -> list[PutStatus]:
        """Store several blocks in one master round trip per phase. Raises the first failure, after revoking."""
        opts = options or PutOptions()
        checked = [(validate_key(k), as_view(d)) for k, d in items]
        for key, view in checked:
            if view.nbytes == 0:
                raise InvalidArgument(f"block {key!r} is empty; blocks must hold at least one byte")
        statuses: list[PutStatus | None] = [None] * len(checked)
        todo = list(range(len(checked)))
        for attempt in range(self.config.put_retries + 1):
            retry = self._put_round(checked, todo, opts, statuses)
            if not retry:
                break
            if attempt == self.config.put_retries:
                raise RetryLater(f"key {checked[retry[0]][0]!r} stayed busy through {attempt} retries")
            time.sleep(min(0.01 * 2**attempt, 0.5))
            todo = retry
        return [s if s is not None else PutStatus.EXISTS for s in statuses]

    def _put_round(
        self, items: list[tuple[BlockKey, memoryview]], todo: list[int], opts: PutOptions, out: list[PutStatus | None]
    ) -> list[int]:
        """One put_start/write/put_end round over ``todo``; returns the indexes to retry."""
        reply: PutStartReply = self._call(
            PutStart(
                [items[i][0] for i in todo],
                [items[i][1].nbytes for i in todo],
                opts.replicas or self.config.replicas,
                opts.preferred_node,
                opts.pin,
            ),
            PutStartReply,
        )
        retry: list[int] = []
        failure: KVStoreError | None = None
        writes: dict[str, list[tuple[int, Replica]]] = {}
        placed: dict[int, str] = {}
        tickets = reply.tickets()
        if len(tickets) != len(todo):
            raise ProtocolError(f"the master answered {len(tickets)} tickets for {len(todo)} keys")
        for i, ticket in zip(todo, tickets, strict=True):
            if ticket.status == "exists":
                out[i] = PutStatus.EXISTS
            elif ticket.status == "error":
                if ticket.error_code == RetryLater.code:
                    retry.append(i)
                elif failure is None:
                    failure = error_from_code(ticket.error_code, ticket.error)
            else:
                for replica in ticket.replicas:
                    writes.setdefault(replica.address, []).append((i, replica))
                if ticket.replicas:
                    placed[i] = ticket.replicas[0].address
        sums = {i: checksum(items[i][1]) for group in writes.values() for i, _ in group}
        failed: set[int] = set()
        outcomes = self._fan_out(
            [
                partial(
                    self._write,
                    address,
                    group[0][1].node_id,
                    [(items[i][0], items[i][1], r.offset, sums[i]) for i, r in group],
                    opts.pin,
                )
                for address, group in writes.items()
            ]
        )
        for (address, group), outcome in zip(writes.items(), outcomes, strict=True):
            if isinstance(outcome, KVStoreError):
                codes = [(outcome.code, str(outcome))] * len(group)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                codes = outcome
            for (i, _), (code, text) in zip(group, codes, strict=True):
                if code:
                    failed.add(i)
                    failure = failure or error_from_code(code, f"writing {items[i][0]!r} to {address}: {text}")
        done = [i for i in sums if i not in failed]
        if failed:
            self._call(PutRevoke([items[i][0] for i in sorted(failed)]), OkReply)
        if done:
            committed: PutEndReply = self._call(
                PutEnd([items[i][0] for i in done], [sums[i] for i in done]), PutEndReply
            )
            if len(committed.committed) != len(done):
                raise ProtocolError(f"the master answered {len(committed.committed)} commits for {len(done)} keys")
            stored = []
            for i, ok in zip(done, committed.committed, strict=True):
                if ok:
                    out[i] = PutStatus.STORED
                    stored.append(i)
                elif failure is None:
                    failure = Timeout(f"the reservation of {items[i][0]!r} expired before the put finished")
            self._hint([(items[i][0], placed[i]) for i in stored if i in placed])
        if failure is not None:
            raise failure
        return retry

    def _write(
        self, address: str, node_id: str, blocks: list[tuple[str, memoryview, int, int]], pinned: bool = False
    ) -> list[tuple[int, str]]:
        """Write blocks to one daemon: through its arena when it shares this host, else over the network."""
        keys, offsets = [k for k, _, _, _ in blocks], [o for _, _, o, _ in blocks]
        sizes, sums = [v.nbytes for _, v, _, _ in blocks], [c for _, _, _, c in blocks]
        arena = self._local_arena(node_id)
        ucx_address = self._ucx_address(node_id) if arena is None else None
        if arena is not None:
            assert self._shm is not None
            self._shm.write_many(arena, [(offset, view) for _, view, offset, _ in blocks])
            message: WriteBlocks | CommitBlocks = CommitBlocks(keys, offsets, sizes, sums, pinned)
            payload: list[memoryview] = []
        else:
            message = WriteBlocks(keys, offsets, sizes, sums, pinned)
            payload = [v for _, v, _, _ in blocks]
        railset = self._railset(node_id) if arena is None and ucx_address is None else None
        if ucx_address is not None:
            assert isinstance(message, WriteBlocks)
            reply = self._ucx_client().write(message, ucx_address, payload)
        elif railset is not None:
            return railset.write(keys, offsets, sums, [v for _, v, _, _ in blocks], pinned)
        else:
            with self._pool(address).connection() as conn:
                reply = conn.call(message, WriteReply, payload=payload)
        if len(reply.codes) != len(blocks):
            raise ProtocolError(f"{address} answered {len(reply.codes)} results for {len(blocks)} writes")
        return list(zip(reply.codes, reply.errors, strict=True))

    # -- reads ---------------------------------------------------------------------------------
    def get(self, key: Any, *, verify: bool = False) -> bytes | None:
        return self.get_many([key], verify=verify)[0]

    def get_many(self, keys: Sequence[Any], *, verify: bool = False) -> list[bytes | None]:
        buffers: list[bytearray] = []
        sizes = self._get(keys, None, verify, buffers)
        return [bytes(b) if n is not None else None for b, n in zip(buffers, sizes, strict=True)]

    def get_into(self, key: Any, buffer: Any, *, verify: bool = False) -> int | None:
        return self.get_many_into([key], [buffer], verify=verify)[0]

    def get_many_into(
        self, keys: Sequence[Any], buffers: Sequence[Any], *, verify: bool = False, exact_size: bool = False
    ) -> list[int | None]:
        """Read blocks straight into ``buffers``; each its size, or None for a miss.

        A block larger than its buffer raises :class:`BufferTooSmall`; with ``exact_size`` a block
        whose size is not exactly its buffer's is a miss instead (a reader that knows what size
        every block must have, such as a KV layout, never takes a foreign object for one).
        """
        if len(keys) != len(buffers):
            raise InvalidArgument(f"get_many_into got {len(keys)} keys but {len(buffers)} buffers")
        views = [as_view(b, writable=True, what="buffer") for b in buffers]
        return self._get(keys, views, verify, None, exact_size=exact_size)

    def get_range_many_into(
        self, keys: Sequence[Any], start: int, length: int, buffers: Sequence[Any]
    ) -> list[int | None]:
        """Read bytes ``[start, start + length)`` of each block into its buffer: ``length`` each, or None.

        One layer of a KV block, say, without the rest of it. A block that is missing or
        shorter than ``start + length`` is a miss. The block checksum covers whole blocks
        only, so a range is not verified.
        """
        if type(start) is not int or type(length) is not int or start < 0 or length <= 0:
            raise InvalidArgument(f"a range needs start >= 0 and length > 0, got ({start!r}, {length!r})")
        if len(keys) != len(buffers):
            raise InvalidArgument(f"get_range_many_into got {len(keys)} keys but {len(buffers)} buffers")
        views = [as_view(b, writable=True, what="buffer") for b in buffers]
        for view in views:
            if view.nbytes < length:
                raise BufferTooSmall(f"buffer of {view.nbytes} bytes cannot hold a range of {length} bytes")
        checked: list[str] = [validate_key(k) for k in keys]
        located = self._locate(checked)
        out: list[int | None] = [None] * len(checked)
        wanted = [loc if loc is not None and loc.size >= start + length else None for loc in located]
        per_address: dict[str, list[int]] = {}
        for i, loc in enumerate(wanted):
            if loc is None:
                continue
            for replica in loc.replicas:  # a local DRAM copy first, else the first replica's daemon
                arena = self._local_arena(replica.node_id) if replica.tier == "dram" else None
                if arena is not None:
                    ShmTransport.read(arena, replica.offset + start, length, views[i])
                    out[i] = length
                    break
            else:
                per_address.setdefault(loc.replicas[0].address, []).append(i)
        jobs = [partial(self._read_ranges, address, [checked[i] for i in idx], start, length,
                        [views[i][:length] for i in idx]) for address, idx in per_address.items()]  # fmt: skip
        for idx, outcome in zip(per_address.values(), self._fan_out(jobs), strict=True):
            if isinstance(outcome, ConnectionFailed | Timeout):
                continue  # the node is gone or stalled: misses
            if isinstance(outcome, BaseException):
                raise outcome
            for i, ok in zip(idx, outcome, strict=True):
                out[i] = length if ok else None
        with self._release_lock:
            self._to_release.extend(loc.key for loc in located if loc is not None)
        return out

    def _read_ranges(
        self, address: str, keys: list[str], start: int, length: int, targets: list[memoryview]
    ) -> list[bool]:
        message = ReadSlices(keys, [start] * len(keys), [length] * len(keys))
        with self._pool(address).connection() as conn, conn.exchange(message) as (reply, sock):
            return recv_read_reply(reply, sock, targets, f"ReadSlices from {address}")

    def _get(
        self,
        keys: Sequence[Any],
        views: list[memoryview] | None,
        verify: bool,
        allocated: list[bytearray] | None,
        *,
        exact_size: bool = False,
    ) -> list[int | None]:
        """Locate ``keys`` and read them into ``views`` (or into new buffers appended to ``allocated``).

        Keys whose node the client remembers are asked of that daemon before the master is:
        its bytes wait in the socket while the master answers, and are taken only where the
        master confirms the block (same node, same size); a lease-less read is never kept.
        """
        checked: list[str] = [validate_key(k) for k in keys]
        out: list[int | None] = [None] * len(checked)
        with ExitStack() as stack:
            speculative = self._speculate(stack, checked)
            leased_located = self._locate(checked)
            located = leased_located
            if views is None:
                assert allocated is not None
                allocated.extend(bytearray(loc.size) if loc is not None else bytearray(0) for loc in located)
                views = [memoryview(b) for b in allocated]
            elif exact_size:
                located = [r if r is None or r.size == v.nbytes else None for r, v in zip(located, views, strict=True)]
            for loc, view in zip(located, views, strict=True):
                if loc is not None and view.nbytes < loc.size:
                    raise BufferTooSmall(
                        f"buffer of {view.nbytes} bytes cannot hold block {loc.key!r} of {loc.size} bytes"
                    )
            for address, idx, pending in speculative:
                self._take_speculative(address, idx, pending, located, views, verify, out)
        self._read_local(located, views, verify, out)
        rest = [loc if out[i] is None else None for i, loc in enumerate(located)]
        for i, size in enumerate(self._read(rest, views, verify)):
            if size is not None:
                out[i] = size
        leased = [loc.key for loc in leased_located if loc is not None]
        if leased:
            with self._release_lock:
                self._to_release.extend(leased)
        self._remember(checked, leased_located)
        return out

    def _speculate(self, stack: ExitStack, keys: list[str]) -> list[tuple[str, list[int], PendingReply]]:
        """Send a read to each remembered node of ``keys``; the replies are read after the master's."""
        if not self.config.location_hints:
            return []
        per_address: dict[str, list[int]] = {}
        hints = self._hints
        for i, key in enumerate(keys):
            address = hints.get(key)
            if address is not None and address not in self._not_tcp:
                per_address.setdefault(address, []).append(i)
        out = []
        for address, idx in per_address.items():
            message = ReadBlocks([keys[i] for i in idx], ["dram"] * len(idx), [0] * len(idx), [0] * len(idx))
            try:
                conn = stack.enter_context(self._pool(address).connection())
                out.append((address, idx, stack.enter_context(conn.pipelined(message))))
            except KVStoreError:
                continue  # the node is gone or busy: the master's answer decides
        return out

    def _take_speculative(
        self,
        address: str,
        idx: list[int],
        pending: PendingReply,
        located: list[LocatedRef | None],
        views: list[memoryview],
        verify: bool,
        out: list[int | None],
    ) -> None:
        """Read a speculative reply: keep each block the master placed at ``address`` with this size."""
        try:
            reply, sock = pending.receive()
            if not isinstance(reply, ReadReply) or len(reply.sizes) != len(idx):
                raise ProtocolError(f"{address} sent a malformed reply to ReadBlocks")
            for i, size in zip(idx, reply.sizes, strict=True):
                if size < 0:
                    continue
                loc = located[i]
                if loc is None or size != loc.size or all(r.address != address for r in loc.replicas):
                    skip(sock, size)  # removed, replaced or moved meanwhile: the master's word wins
                    continue
                recv_into(sock, views[i][:size])
                if verify and checksum(views[i][:size]) != loc.checksum:
                    raise CorruptBlock(f"block {loc.key!r} read from {address} fails its checksum")
                out[i] = size
        except (ConnectionFailed, Timeout, ProtocolError):
            pending.abandon()  # whatever was not read yet goes the usual way

    def _read_local(
        self, located: list[LocatedRef | None], views: list[memoryview], verify: bool, out: list[int | None]
    ) -> None:
        """Copy blocks held in the DRAM of daemons on this host straight from their arenas (under the leases)."""
        if self._shm is None:
            return
        reads: list[tuple[ArenaMapping, int, int, memoryview]] = []
        done: list[tuple[int, LocatedRef, str]] = []
        for i, loc in enumerate(located):
            if loc is None or out[i] is not None:
                continue
            for replica in loc.replicas:
                arena = self._local_arena(replica.node_id) if replica.tier == "dram" else None
                if arena is not None:
                    reads.append((arena, replica.offset, loc.size, views[i]))
                    done.append((i, loc, replica.node_id))
                    break
        if not reads:
            return
        self._shm.read_many(reads)
        for i, loc, node_id in done:
            if verify and checksum(views[i][: loc.size]) != loc.checksum:
                raise CorruptBlock(f"block {loc.key!r} copied from {node_id}'s arena fails its checksum")
            out[i] = loc.size

    def _remember(self, keys: Sequence[str], located: Sequence[LocatedRef | None]) -> None:
        """Note where each key was found, and forget the misses."""
        self._hint((k, loc.replicas[0].address if loc is not None and loc.replicas else None)
                   for k, loc in zip(keys, located, strict=True))  # fmt: skip

    def _hint(self, places: Iterable[tuple[str, str | None]]) -> None:
        """Remember each key's node (None: forget the key), within ``location_hints`` entries, oldest out first."""
        cap = self.config.location_hints
        if not cap:
            return
        hints = self._hints
        with self._hints_lock:
            for key, address in places:
                hints.pop(key, None)  # re-inserted last: the dict's order is the order of last use
                if address is not None:
                    hints[key] = address
            while len(hints) > cap:
                del hints[next(iter(hints))]

    def _locate(self, checked: list[str]) -> list[LocatedRef | None]:
        with self._release_lock:
            release, self._to_release = self._to_release, []
        reply: GetReplicasReply = self._call(GetReplicas(checked, release), GetReplicasReply)
        return reply.located(checked)

    def _read(self, located: list[LocatedRef | None], views: list[memoryview], verify: bool) -> list[int | None]:
        out: list[int | None] = [None] * len(located)
        attempt = {i: 0 for i, loc in enumerate(located) if loc is not None}
        while attempt:
            per_address: dict[str, list[int]] = {}
            for i, n in attempt.items():
                loc = located[i]
                assert loc is not None
                per_address.setdefault(loc.replicas[n].address, []).append(i)
            next_attempt: dict[int, int] = {}
            jobs: list[Callable[[], list[int | None]]] = []
            for address, idx in per_address.items():
                blocks = []
                for i in idx:
                    loc = located[i]
                    assert loc is not None
                    blocks.append((loc, loc.replicas[attempt[i]], views[i]))
                jobs.append(partial(self._read_from, address, blocks))
            for (address, idx), outcome in zip(per_address.items(), self._fan_out(jobs), strict=True):
                if isinstance(outcome, ConnectionFailed | Timeout):
                    got: list[int | None] = [None] * len(idx)  # the node is gone or stalled: a miss
                elif isinstance(outcome, BaseException):
                    raise outcome
                else:
                    got = outcome
                for i, size in zip(idx, got, strict=True):
                    loc = located[i]
                    assert loc is not None
                    if size is not None:
                        if verify and checksum(views[i][:size]) != loc.checksum:
                            raise CorruptBlock(f"block {loc.key!r} read from {address} fails its checksum")
                        out[i] = size
                    elif attempt[i] + 1 < len(loc.replicas):
                        next_attempt[i] = attempt[i] + 1
            attempt = next_attempt
        return out

    def _fan_out(self, jobs: Sequence[Callable[[], T]]) -> list[T | BaseException]:
        """Run one job per daemon, in parallel when there are several; each outcome or its exception."""
        if len(jobs) == 1:
            try:
                return [jobs[0]()]
            except Exception as exc:
                return [exc]
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvstore-io")
        futures = [self._executor.submit(job) for job in jobs]
        out: list[T | BaseException] = []
        for future in futures:
            failure = future.exception()
            out.append(failure if failure is not None else future.result())
        return out

    def _read_from(self, address: str, blocks: list[tuple[LocatedRef, ReplicaRef, memoryview]]) -> list[int | None]:
        node_id = blocks[0][1].node_id
        railset = self._railset(node_id)
        if railset is not None:
            return railset.read(
                [loc.key for loc, _, _ in blocks], [loc.size for loc, _, _ in blocks],
                [loc.checksum for loc, _, _ in blocks], [view for _, _, view in blocks],
            )  # fmt: skip
        ucx_address = self._ucx_address(node_id)
        if ucx_address is not None:
            return self._ucx_client().read(
                ucx_address, [loc.key for loc, _, _ in blocks], [loc.size for loc, _, _ in blocks],
                [view for _, _, view in blocks],
            )  # fmt: skip
        message = ReadBlocks(
            [loc.key for loc, _, _ in blocks], [r.tier for _, r, _ in blocks], [r.offset for _, r, _ in blocks],
            [loc.size for loc, _, _ in blocks],
        )  # fmt: skip
        targets = [view[: loc.size] for loc, _, view in blocks]
        with self._pool(address).connection() as conn, conn.exchange(message) as (reply, sock):
            # A block of another size than the master described is a stale copy: a miss.
            got = recv_read_reply(reply, sock, targets, f"ReadBlocks from {address}")
        return [loc.size if ok else None for ok, (loc, _, _) in zip(got, blocks, strict=True)]

    def _release_loop(self, period: float = 0.05) -> None:
        """Send leases that no get carried within ``period`` seconds."""
        held: list[str] = []
        while not self._stop_releaser.wait(period):
            with self._release_lock:
                # Keys still here after a whole period were not carried by a get: send them now.
                waiting = set(self._to_release)
                due = [k for k in held if k in waiting]
                held = list(self._to_release)
                if due:
                    gone = set(due)
                    self._to_release = [k for k in self._to_release if k not in gone]
            if due:
                self._send_releases(due)

    def _send_releases(self, keys: list[str]) -> None:
        try:
            with self._master.connection() as conn:
                conn.call(ReleaseLeases(keys), OkReply)
        except KVStoreError:
            pass  # best effort: a lease also ends by itself

    # -- queries -----------------------------------------------------------------------------------
    def exists(self, key: Any) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: Sequence[Any]) -> list[bool]:
        reply: ExistsReply = self._call(Exists([validate_key(k) for k in keys]), ExistsReply)
        return reply.exists

    def match_prefix(self, keys: Sequence[Any]) -> int:
        """How many leading keys are stored: the longest stored prefix of a key list."""
        reply: MatchPrefixReply = self._call(MatchPrefix([validate_key(k) for k in keys]), MatchPrefixReply)
        return reply.matched

    def match_prefix_nodes(self, keys: Sequence[Any]) -> PrefixMatch:
        """The longest stored prefix of a key list (as :meth:`match_prefix`), and per node how many
        leading keys it holds readable, in any tier (``total``) and in DRAM (``dram``)."""
        checked: list[str] = [validate_key(k) for k in keys]
        reply: MatchPrefixNodesReply = self._call(MatchPrefixNodes(checked), MatchPrefixNodesReply)
        return reply.prefix_match(len(checked))

    def replicate(self, keys: Sequence[Any], node_id: str, *, max_bytes: int) -> Replicated:
        """Copy stored blocks into the DRAM of ``node_id``, keeping their other replicas (hot blocks near
        their readers). Keys are taken in order while they fit the node's free DRAM (nothing is
        evicted for them) and ``max_bytes`` in all; keys not stored or already there are skipped.
        Raises NotFound for a node the master does not know."""
        if type(max_bytes) is not int or max_bytes < 0:
            raise InvalidArgument(f"max_bytes must be a non-negative int, got {max_bytes!r}")
        if not isinstance(node_id, str):
            raise InvalidArgument(f"node_id must be a str, got {type(node_id).__name__}")
        checked: list[str] = [validate_key(k) for k in keys]
        message = Replicate(checked, node_id, max_bytes)
        reply: ReplicateReply = self._call(message, ReplicateReply)
        return Replicated(reply.copied, reply.bytes)

    def remove(self, key: Any) -> bool:
        return self.remove_many([key]) == 1

    def remove_many(self, keys: Sequence[Any]) -> int:
        checked: list[str] = [validate_key(k) for k in keys]
        reply: RemoveReply = self._call(Remove(checked), RemoveReply)
        self._hint((k, None) for k in checked)
        return reply.removed

    def stats(self) -> dict[str, int | float]:
        reply: StatsReply = self._call(Stats(), StatsReply)
        return reply.stats

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_releaser.set()
        self._releaser.join(timeout=self.config.timeout_s)
        with self._release_lock:
            release, self._to_release = self._to_release, []
        if release:
            self._send_releases(release)
        self._master.close()
        if self._shm is not None:
            self._shm.close()
        if self._ucx is not None:
            self._ucx.close()
        for railset in self._railsets.values():
            railset.close()
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            for pool in self._daemons.values():
                pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncStore:
    """The same API for asyncio code: each call runs the blocking client in a worker thread."""

    def __init__(self, store: Store) -> None:
        self._store = store

    @classmethod
    async def connect(cls, master: str, config: ClientConfig | None = None) -> AsyncStore:
        return cls(await asyncio.to_thread(Store.connect, master, config))

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if not callable(method) or name.startswith("_"):
            raise AttributeError(name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.to_thread(method, *args, **kwargs)

        return call

    async def close(self) -> None:
        await asyncio.to_thread(self._store.close)

    async def __aenter__(self) -> AsyncStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
