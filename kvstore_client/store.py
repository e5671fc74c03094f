"""The network client: :class:`Store` (blocking, thread-safe).

Reads: a key whose node the client remembers (from its own put or an earlier get) is read
from that node's daemon in one round trip, by key: the daemon is authoritative for the
committed, checksummed blocks it holds, and reports the hit to the master later. Other keys
(and hint misses) ask the master where they are, then read from the daemon; a block on a
dead node reads as a miss, never as an error or a hang. Readers that copy memory without the
daemon (shared memory, UCX) get leases from the master.

Writes: with granted space (``ClientConfig.grant_bytes``), a put is one round trip to a
daemon, which checks the bytes and has the master commit them before it answers. Otherwise
(several replicas, blocks too large for a grant, a node reached by shared memory, UCX or
rails) the master reserves extents, the bytes go to the daemons, and the master commits.

Every network wait is bounded by ``ClientConfig.timeout_s``. Parts: :mod:`.dataplane` (one
data path per transport, chosen per node), :mod:`.hints`, :mod:`.leases`, :mod:`.grants`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Self, TypeVar

from kvstore.auth import Credential
from kvstore.buffers import as_view
from kvstore.config import ClientConfig
from kvstore.errors import (
    BufferTooSmall,
    ConnectionFailed,
    CorruptBlock,
    GrantExpired,
    InvalidArgument,
    KVStoreError,
    RetryLater,
    StoreClosed,
    Timeout,
)
from kvstore.keys import BlockKey, checksum, validate_key
from kvstore.node_store import PutStatus
from kvstore.protocol import (
    Exists,
    ExistsReply,
    GetReplicas,
    GetReplicasReply,
    GetTicket,
    GrantReply,
    GrantSpace,
    KeysReply,
    ListKeys,
    ListNodes,
    LocatedRef,
    MatchPrefix,
    MatchPrefixNodes,
    MatchPrefixNodesReply,
    MatchPrefixReply,
    Message,
    NodeInfo,
    NodesReply,
    OkReply,
    PrefixMatch,
    PutEnd,
    PutEndReply,
    PutRevoke,
    PutStart,
    PutStartReply,
    ReleaseLeases,
    Remove,
    RemoveReply,
    Replicate,
    Replicated,
    ReplicateReply,
    ReturnGrants,
    Stats,
    StatsReply,
    TicketReply,
)
from kvstore_client.credentials import Tickets, master_credential
from kvstore_client.dataplane import Block, ConnectionPool, DataPath, Located, PathSelector, ShmPath
from kvstore_client.grants import GrantPool
from kvstore_client.hints import LocationHints
from kvstore_client.leases import LeaseReleaser
from kvstore_client.puts import (
    PutOptions,
    checked_options,
    checked_pairs,
    sort_tickets,
    take_commits,
    take_granted,
    take_write_codes,
)
from transfer.discovery import MasterLocator
from transfer.tls import contexts
from transfer.transports.shm import ShmTransport

T = TypeVar("T")
R = TypeVar("R", bound=Message)


class Store:
    def __init__(self, master: str, config: ClientConfig | None = None) -> None:
        self.master = master
        self.config = config or ClientConfig()
        credential = master_credential(self.config)
        to_master, to_daemons = contexts(self.config.tls)
        self._master = ConnectionPool(
            MasterLocator(master, self.config.timeout_s), self.config.timeout_s, keep=4, credential=credential,
            tls=to_master,
        )  # fmt: skip
        self._tickets = Tickets(credential.name) if credential is not None and credential.kind == "tenant" else None
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None  # for batches that span several daemons
        self._nodes: dict[str, NodeInfo] = {}
        self._nodes_checked = 0.0
        self._paths = PathSelector(
            self.config, self._node, self._ticket if self._tickets is not None else credential, to_daemons
        )
        self._hints = LocationHints(self.config.location_hints)
        self._leases = LeaseReleaser(self._send_releases)
        self._grants = GrantPool(self._ask_grant, self._return_grants, self.config.grant_bytes)
        self._grants_paused_until = 0.0
        self._closed = False

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

    def _call(self, message: Message, expect: type[R]) -> R:
        if self._closed:
            raise StoreClosed("this Store is closed")
        conn = self._master.acquire()
        try:
            # Ride out a master restart or failover: the same request, with backoff, up to the timeout.
            return conn.call(message, expect, retry_for=self.config.timeout_s)
        finally:
            self._master.release(conn)

    # -- nodes -------------------------------------------------------------------------------
    def nodes(self) -> list[NodeInfo]:
        """Every registered node: its rails, host, arena and NICs, and whether it is up."""
        reply = self._call(ListNodes(), NodesReply)
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

    def _path(self, node_id: str, address: str) -> DataPath:
        return self._paths.path(node_id, address)

    # -- writes ------------------------------------------------------------------------------
    def put(self, key: Any, data: Any, options: PutOptions | None = None) -> PutStatus:
        """Store ``data`` under ``key``; an existing key keeps its bytes and reports EXISTS."""
        return self.put_many([(key, data)], options)[0]

    put_from = put

    def put_many(self, items: Iterable[tuple[Any, Any]], options: PutOptions | None = None) -> list[PutStatus]:
        """Store several blocks. Raises the first failure (after giving back what it reserved)."""
        if self._closed:
            raise StoreClosed("this Store is closed")
        opts = checked_options(options)
        checked = checked_pairs(items)
        statuses: list[PutStatus | None] = [None] * len(checked)
        todo = list(range(len(checked)))
        if (
            (opts.replicas or self.config.replicas) == 1
            and self.config.grant_bytes
            and todo
            and time.monotonic() >= self._grants_paused_until
        ):
            todo = self._put_granted(checked, todo, opts, statuses)
        for attempt in range(self.config.put_retries + 1):
            if not todo:
                break
            retry = self._put_round(checked, todo, opts, statuses)
            if not retry:
                break
            if attempt == self.config.put_retries:
                raise RetryLater(f"key {checked[retry[0]][0]!r} stayed busy through {attempt} retries")
            time.sleep(min(0.01 * 2**attempt, 0.5))
            todo = retry
        return [s if s is not None else PutStatus.EXISTS for s in statuses]

    def _ask_grant(self, length: int, preferred: str | None) -> GrantReply:
        return self._call(GrantSpace(length, preferred), GrantReply)

    def _return_grants(self, grant_ids: list[int]) -> None:
        with contextlib.suppress(KVStoreError):  # best effort: a grant also ends by itself
            self._master.call(ReturnGrants(grant_ids), OkReply)

    def _put_granted(
        self, items: list[tuple[BlockKey, memoryview]], todo: list[int], opts: PutOptions,
        out: list[PutStatus | None],
    ) -> list[int]:  # fmt: skip
        """Put ``todo`` in one round trip into granted space; returns the indexes left to the two-trip way."""
        try:
            carved = self._grants.carve([items[i][1].nbytes for i in todo], opts.preferred_node)
        except (ConnectionFailed, Timeout):
            raise
        except KVStoreError:
            return todo  # no grant now (no room, no nodes): the two-trip put says why, if it fails too
        if carved is None:
            return todo
        grant, offsets = carved
        path = self._path(grant.node_id, grant.address)
        if not path.direct:
            # Granted space on a node this client reaches by shared memory, UCX or rails: those put
            # the two-trip way (their bytes do not go through the daemon's socket). Ask again later.
            self._grants.drop(grant)
            self._grants_paused_until = time.monotonic() + 10.0
            return todo
        blocks = [Block(items[i][0], items[i][1], o, checksum(items[i][1])) for i, o in zip(todo, offsets, strict=True)]
        try:
            codes = path.write_granted(grant.grant_id, blocks, opts.pin)
        except (ConnectionFailed, Timeout):
            self._grants.drop(grant)  # the node is gone or stalled: the master places elsewhere
            return todo
        if any(code == GrantExpired.code for code, _ in codes):
            self._grants.drop(grant)
        left, placed = take_granted(items, todo, codes, grant, out)
        self._hints.note(placed)
        return left

    def _put_round(
        self, items: list[tuple[BlockKey, memoryview]], todo: list[int], opts: PutOptions, out: list[PutStatus | None]
    ) -> list[int]:
        """One put_start/write/put_end round over ``todo``; returns the indexes to retry."""
        reply = self._call(
            PutStart(
                [items[i][0] for i in todo],
                [items[i][1].nbytes for i in todo],
                opts.replicas or self.config.replicas,
                opts.preferred_node,
                opts.pin,
            ),
            PutStartReply,
        )
        plan = sort_tickets(reply, todo, out)
        sums = {i: checksum(items[i][1]) for group in plan.writes.values() for i, _ in group}
        failed: set[int] = set()
        jobs = []
        for address, group in plan.writes.items():
            path = self._path(group[0][1].node_id, address)
            blocks = [Block(items[i][0], items[i][1], r.offset, sums[i], r.seal) for i, r in group]
            jobs.append(partial(path.write, blocks, opts.pin))
        for (address, group), outcome in zip(plan.writes.items(), self._fan_out(jobs), strict=True):
            if isinstance(outcome, KVStoreError):
                codes = [(outcome.code, str(outcome))] * len(group)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                codes = outcome
            take_write_codes(plan, items, address, group, codes, failed)
        done = [i for i in sums if i not in failed]
        if failed:
            self._call(PutRevoke([items[i][0] for i in sorted(failed)]), OkReply)
        if done:
            committed = self._call(PutEnd([items[i][0] for i in done], [sums[i] for i in done]), PutEndReply)
            self._hints.note(take_commits(plan, items, done, committed.committed, out))
            if plan.lost:
                self._call(PutRevoke([items[i][0] for i in plan.lost]), OkReply)
        if plan.failure is not None:
            raise plan.failure
        return plan.retry + plan.lost

    # -- reads ---------------------------------------------------------------------------------
    def get(self, key: Any, *, verify: bool = False) -> bytes | None:
        return self.get_many([key], verify=verify)[0]

    def get_many(self, keys: Sequence[Any], *, verify: bool = False) -> list[bytes | None]:
        got = self._get([validate_key(k) for k in keys], None, verify)
        return [bytes(b) if b is not None else None for b in got]

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
        checked = [validate_key(k) for k in keys]
        views = [as_view(b, writable=True, what="buffer") for b in buffers]
        got = self._get(checked, views, verify, exact_size=exact_size)
        return [None if g is None else (g if isinstance(g, int) else len(g)) for g in got]

    def _get(
        self, keys: list[BlockKey], views: list[memoryview] | None, verify: bool, *, exact_size: bool = False
    ) -> list[Any]:
        """Per key: its size (read into ``views[i]``), or with ``views`` None a new bytearray; None for a miss."""
        if self._closed:
            raise StoreClosed("this Store is closed")
        n = len(keys)
        out: list[Any] = [None] * n
        # 1. Keys whose node is remembered: one trip to that node, by key.
        per_node: dict[tuple[str, str], list[int]] = {}
        hints = self._hints
        for i, key in enumerate(keys):
            place = hints.get(key)
            if place is not None:
                per_node.setdefault(place, []).append(i)
        rest = list(range(n))
        if per_node:
            jobs = []
            groups = []
            for (node_id, address), idx in per_node.items():
                path = self._path(node_id, address)
                if not path.direct:
                    continue
                sub = [views[i] for i in idx] if views is not None else [None] * len(idx)
                jobs.append(partial(path.read_direct, [keys[i] for i in idx], sub, exact_size))
                groups.append(idx)
            missed: list[str] = []
            for idx, outcome in zip(groups, self._fan_out(jobs), strict=True):
                if isinstance(outcome, ConnectionFailed | Timeout):
                    missed.extend(keys[i] for i in idx)  # gone or stalled: the master knows better
                    continue
                if isinstance(outcome, BaseException):
                    raise outcome
                found, made = outcome
                for i, hit, buf in zip(idx, found, made, strict=True):
                    if hit is None:
                        missed.append(keys[i])
                        continue
                    target = buf if buf is not None else views[i] if views is not None else None
                    assert target is not None
                    if verify and checksum(memoryview(target)[: hit.size]) != hit.checksum:
                        raise CorruptBlock(f"block {keys[i]!r} read from {self._hints.get(keys[i])} fails its checksum")
                    out[i] = buf if buf is not None else hit.size
            hints.forget(missed)
            rest = [i for i in range(n) if out[i] is None]
        if not rest:
            return out
        # 2. The others: where the master says they are.
        with self._located([keys[i] for i in rest]) as located:
            if views is None:
                bufs = {i: bytearray(loc.size) for i, loc in zip(rest, located, strict=True) if loc is not None}
                targets = {i: memoryview(b) for i, b in bufs.items()}
            else:
                targets = {i: views[i] for i in rest}
                if exact_size:
                    located = [
                        r if r is None or r.size == targets[i].nbytes else None
                        for i, r in zip(rest, located, strict=True)
                    ]
            for i, loc in zip(rest, located, strict=True):
                if loc is not None and targets[i].nbytes < loc.size:
                    raise BufferTooSmall(
                        f"buffer of {targets[i].nbytes} bytes cannot hold block {loc.key!r} of {loc.size} bytes"
                    )
            sizes = self._read(
                [(i, loc, targets[i]) for i, loc in zip(rest, located, strict=True) if loc is not None], verify
            )
            for i, size in sizes.items():
                out[i] = size if views is not None else bufs[i]
            self._hints.note(
                (keys[i], (r.replicas[0].node_id, r.replicas[0].address) if r is not None and r.replicas else None)
                for i, r in zip(rest, located, strict=True)
            )  # fmt: skip
            return out

    @contextlib.contextmanager
    def _located(self, keys: list[str]) -> Iterator[list[LocatedRef | None]]:
        """Where ``keys`` are, under read leases (when a path may read the arena directly) that
        are queued for release only when the block is left: once the reads are over."""
        lease = self._paths.may_lease
        reply = self._call(GetReplicas(keys, self._leases.take(), lease), GetReplicasReply)
        located = reply.located(keys)
        try:
            yield located
        finally:
            if lease and reply.first_lease:
                hits = sum(loc is not None for loc in located)
                self._leases.add(range(reply.first_lease, reply.first_lease + hits))

    def _read(self, blocks: list[tuple[int, LocatedRef, memoryview]], verify: bool) -> dict[int, int]:
        """Read located blocks, trying each block's next replica when a daemon does not answer."""
        out: dict[int, int] = {}
        attempt = {i: 0 for i, _, _ in blocks}
        by_index = {i: (loc, view) for i, loc, view in blocks}
        while attempt:
            per_node: dict[tuple[str, str], list[int]] = {}
            for i, a in attempt.items():
                replica = by_index[i][0].replicas[a]
                per_node.setdefault((replica.node_id, replica.address), []).append(i)
            jobs: list[Callable[[], list[int | None]]] = []
            for (node_id, address), idx in per_node.items():
                located: list[Located] = [
                    (by_index[i][0], by_index[i][0].replicas[attempt[i]], by_index[i][1]) for i in idx
                ]
                jobs.append(partial(self._path(node_id, address).read, located))
            next_attempt: dict[int, int] = {}
            for ((_, address), idx), outcome in zip(per_node.items(), self._fan_out(jobs), strict=True):
                if isinstance(outcome, ConnectionFailed | Timeout):
                    got: list[int | None] = [None] * len(idx)  # the node is gone or stalled: a miss
                elif isinstance(outcome, BaseException):
                    raise outcome
                else:
                    got = outcome
                for i, size in zip(idx, got, strict=True):
                    loc, view = by_index[i]
                    if size is not None:
                        if verify and checksum(view[:size]) != loc.checksum:
                            raise CorruptBlock(f"block {loc.key!r} read from {address} fails its checksum")
                        out[i] = size
                    elif attempt[i] + 1 < len(loc.replicas):
                        next_attempt[i] = attempt[i] + 1
            attempt = next_attempt
        return out

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
        with self._located(checked) as located:
            out: list[int | None] = [None] * len(checked)
            per_node: dict[tuple[str, str], list[int]] = {}
            for i, loc in enumerate(located):
                if loc is None or loc.size < start + length:
                    continue
                for replica in loc.replicas:  # a local DRAM copy first, else the first replica's daemon
                    path = self._path(replica.node_id, replica.address) if replica.tier == "dram" else None
                    if isinstance(path, ShmPath):
                        ShmTransport.read(path.arena, replica.offset + start, length, views[i])
                        out[i] = length
                        break
                else:
                    per_node.setdefault((loc.replicas[0].node_id, loc.replicas[0].address), []).append(i)
            jobs = [
                partial(self._path(node_id, address).read_ranges, [checked[i] for i in idx], start, length,
                        [views[i][:length] for i in idx])
                for (node_id, address), idx in per_node.items()
            ]  # fmt: skip
            for idx, outcome in zip(per_node.values(), self._fan_out(jobs), strict=True):
                if isinstance(outcome, ConnectionFailed | Timeout):
                    continue  # the node is gone or stalled: misses
                if isinstance(outcome, BaseException):
                    raise outcome
                for i, ok in zip(idx, outcome, strict=True):
                    out[i] = length if ok else None
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

    def _send_releases(self, lease_ids: list[int]) -> None:
        with contextlib.suppress(KVStoreError):  # best effort: a lease also ends by itself
            self._master.call(ReleaseLeases(lease_ids), OkReply)

    # -- queries -----------------------------------------------------------------------------------
    def exists(self, key: Any) -> bool:
        return self.exists_many([key])[0]

    def exists_many(self, keys: Sequence[Any]) -> list[bool]:
        return self._call(Exists([validate_key(k) for k in keys]), ExistsReply).exists

    def sizes(self, keys: Sequence[Any]) -> list[int | None]:
        """Each key's size in bytes, None for a miss; no bytes move."""
        checked: list[str] = [validate_key(k) for k in keys]
        reply = self._call(GetReplicas(checked, self._leases.take(), False), GetReplicasReply)
        return [size if size >= 0 else None for size in reply.sizes]

    def match_prefix(self, keys: Sequence[Any]) -> int:
        """How many leading keys are stored: the longest stored prefix of a key list."""
        return self._call(MatchPrefix([validate_key(k) for k in keys]), MatchPrefixReply).matched

    def match_prefix_nodes(self, keys: Sequence[Any]) -> PrefixMatch:
        """The longest stored prefix of a key list (as :meth:`match_prefix`), and per node how many
        leading keys it holds readable, in any tier (``total``) and in DRAM (``dram``)."""
        checked: list[str] = [validate_key(k) for k in keys]
        return self._call(MatchPrefixNodes(checked), MatchPrefixNodesReply).prefix_match(len(checked))

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
        reply = self._call(Replicate(checked, node_id, max_bytes), ReplicateReply)
        return Replicated(reply.copied, reply.bytes)

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
        checked: list[str] = [validate_key(k) for k in keys]
        reply = self._call(Remove(checked, force), RemoveReply)
        self._hints.forget(checked)
        return reply.removed, reply.held

    def list_keys(self, prefix: str = "", *, after: str = "", limit: int = 1000) -> tuple[list[str], str]:
        """One page of stored keys starting with ``prefix``, in order after ``after``, and the cursor of
        the next page ("" after the last). A tenant lists its own keys."""
        if not isinstance(prefix, str) or not isinstance(after, str):
            raise InvalidArgument(f"prefix and after must be str, got {type(prefix).__name__}, {type(after).__name__}")
        if type(limit) is not int or limit < 1:
            raise InvalidArgument(f"limit must be a positive int, got {limit!r}")
        reply = self._call(ListKeys(prefix, after, limit), KeysReply)
        return reply.keys, reply.next

    def iter_keys(self, prefix: str = "", *, page: int = 1000) -> Iterator[str]:
        """Every stored key starting with ``prefix``, in order, a page at a time."""
        after = ""
        while True:
            keys, after = self.list_keys(prefix, after=after, limit=page)
            yield from keys
            if not after:
                return

    def stats(self) -> dict[str, int | float]:
        return self._call(Stats(), StatsReply).stats

    def close(self) -> None:
        if self._closed:
            return
        self._leases.close(self.config.timeout_s)
        self._grants.close()
        self._closed = True
        self._master.close()
        self._paths.close()
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
