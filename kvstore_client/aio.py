"""The asyncio face of the client: :class:`AsyncStore`, on the event loop, no worker threads.

Every operation is :class:`~kvstore_client.core.ClientCore`'s, as for
:class:`~kvstore_client.store.Store`: the same methods, failover and errors. Here its effects run
over TCP to every daemon (it asks for no leases, as every read goes through a daemon), one
pipelined connection per peer (:class:`~transfer.link.AsyncLink`; to the master, a
:class:`~transfer.leader_link.LeaderLink`, which follows its leader); the gets by key issued
to one node in the same turn of the event loop travel as one batched request, so many concurrent
small gets cost about what one batch does. Every wait is bounded by ``ClientConfig.timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Self, TypeVar

from kvstore.auth import Credential
from kvstore.buffers import as_view
from kvstore.config import ClientConfig
from kvstore.errors import KVStoreError, ProtocolError, StoreClosed
from kvstore.events import EngineBlock
from kvstore.keys import checksum
from kvstore.protocol import (
    FlushCommits,
    GetTicket,
    Message,
    NodeInfo,
    OkReply,
    PrefixMatch,
    PutReply,
    ReadReply,
    Replicated,
    ReportNode,
    Stats,
    StatsReply,
    TicketReply,
    WriteReply,
)
from kvstore.results import PutStatus
from kvstore_client.core import ClientCore, OverTcp
from kvstore_client.credentials import Tickets, master_credential
from kvstore_client.effects import (
    Call,
    Daemons,
    Direct,
    Effect,
    FlushCached,
    Job,
    Notify,
    Op,
    Pause,
    PutGranted,
    ReadDirect,
    ReadLocated,
    ReadRanges,
    WriteReserved,
    granted_message,
    ranges_message,
    read_message,
    write_message,
)
from kvstore_client.links import ReadBatcher
from kvstore_client.puts import PutOptions, write_codes
from transfer.discovery import MasterLocator
from transfer.leader_link import LeaderLink
from transfer.link import AsyncLink, fixed_credential
from transfer.tls import contexts

R = TypeVar("R", bound=Message)
T = TypeVar("T")


class AsyncStore:
    def __init__(self, master: str, config: ClientConfig | None = None) -> None:
        self.master = master
        self.config = config or ClientConfig()
        # With etcd, a watch of the leader key: a failover is followed the moment etcd elects the successor.
        self._locator = MasterLocator(master, self.config.timeout_s, watch=True)
        credential = master_credential(self.config)
        self._credential = credential
        self._tickets = Tickets(credential.name) if credential is not None and credential.kind == "tenant" else None
        self._ticket_lock = asyncio.Lock()
        self._tls = contexts(self.config.tls)
        proof = fixed_credential(credential) if credential is not None else None
        self._master = LeaderLink(self._locator, self.config.timeout_s, proof, self._tls[0])
        self._links: dict[str, AsyncLink] = {}
        self._readers: dict[str, ReadBatcher] = {}
        self._core = ClientCore(self.config, OverTcp())
        self._core.marks.reporter = self._report
        self._reports: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(cls, master: str, config: ClientConfig | None = None) -> Self:
        """A store connected to the master at ``host:port``; raises ConnectionFailed when it does not answer."""
        store = cls(master, config)
        try:
            await store._master.follow()
            await store._master.request(Stats(), StatsReply)
        except BaseException:
            await store.close()
            raise
        return store

    # -- the driver ----------------------------------------------------------------------------
    async def _run(self, op: Op[T]) -> T:
        """Carry out ``op``'s effects in turn until it returns (an effect's error is thrown into it)."""
        if self._core.closed:
            op.close()
            raise StoreClosed("this AsyncStore is closed")
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                effect = op.throw(error) if error is not None else op.send(value)
            except StopIteration as stop:
                result: T = stop.value
                return result
            value, error = None, None
            try:
                value = await self._do(effect)
            except BaseException as exc:  # cancellation too: the operation's cleanup runs
                error = exc

    async def _do(self, effect: Effect) -> Any:
        if isinstance(effect, Call):
            return await self._call(effect.message, effect.expect)
        if isinstance(effect, Daemons):
            if len(effect.jobs) == 1:  # the common case, without gather's task and its callbacks
                return await self._one_job(effect.jobs[0])
            return await asyncio.gather(*(self._job(job) for job in effect.jobs), return_exceptions=True)
        if isinstance(effect, Notify):
            with contextlib.suppress(KVStoreError):
                await self._master.request(effect.message, OkReply)
            return None
        assert isinstance(effect, Pause)
        await asyncio.sleep(effect.seconds)
        return None

    async def _call(self, message: Message, expect: type[R]) -> R:
        return await self._master.call(message, expect)

    async def _one_job(self, job: Job) -> list[Any]:
        """``[outcome]`` of one daemon job, as gather(return_exceptions=True) would hand it back."""
        try:
            done: list[Any] = [await self._job(job)]
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            done = [exc]
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            # Python 3.11's wait_for can swallow a cancel that came with the reply; gather did not.
            raise asyncio.CancelledError
        return done

    async def _job(self, job: Job) -> Any:
        """One daemon job of the core, over this node's pipelined connection."""
        if isinstance(job, ReadDirect):
            return await self._read_direct(job)
        link = self._link(job.address)
        if isinstance(job, ReadLocated):
            reply, data = await link.request(read_message(job.blocks), ReadReply, patience=job.patience_s)
            targets = [view[: loc.size] for loc, _, view in job.blocks]
            return [size if size == loc.size else None for size, (loc, _, _) in  # another size: a stale copy
                    zip(_unpack(reply, data, targets, job), job.blocks, strict=True)]  # fmt: skip
        if isinstance(job, ReadRanges):
            keys = [loc.key for loc, _, _ in job.blocks]
            reply, data = await link.request(ranges_message(keys, job.start, job.length), ReadReply)
            return [size == job.length for size in _unpack(reply, data, [v for _, _, v in job.blocks], job)]
        if isinstance(job, FlushCached):
            await link.request(FlushCommits(), OkReply)
            return None
        views = [b.view for b in job.blocks]
        if isinstance(job, WriteReserved):
            wrote, _ = await link.request(
                write_message(job.blocks, job.pinned), WriteReply, views, patience=job.patience_s
            )
            return write_codes(wrote.codes, wrote.errors, len(job.blocks), job.address)
        assert isinstance(job, PutGranted)
        put, _ = await link.request(granted_message(job.grant_id, job.blocks, job.pinned, job.cached), PutReply, views)
        return write_codes(put.codes, put.errors, len(job.blocks), job.address)

    def _batcher(self, address: str, patience: float) -> ReadBatcher:
        """The batching of this node's reads by key, the next batch given up after ``patience`` (the
        read patience of the read that asks: a batch takes the last one given)."""
        batcher = self._readers.get(address)
        if batcher is None:
            batcher = self._readers[address] = ReadBatcher(self._link(address))
        batcher.patience = patience
        return batcher

    async def _read_direct(self, job: ReadDirect) -> tuple[list[Direct | None], list[Any]]:
        batcher = self._batcher(job.address, job.patience_s)
        answers: list[Any]
        if len(job.keys) == 1:
            answers = [await batcher.read(job.keys[0])]  # its failure is the job's, raised as below
        else:
            answers = await asyncio.gather(*(batcher.read(key) for key in job.keys), return_exceptions=True)
        failure = next((a for a in answers if isinstance(a, BaseException)), None)
        if failure is not None:
            raise failure  # the batch's: one answer for the job (every future was given it, and retrieved)
        hits: list[Direct | None] = [None] * len(job.keys)
        made: list[Any] = [None] * len(job.keys)
        for i, (answer, view) in enumerate(zip(answers, job.views, strict=True)):
            if answer is None or isinstance(answer, BaseException):
                continue
            size, check, data = answer
            if view is None:
                made[i] = data
            elif size > view.nbytes or (job.exact_size and size != view.nbytes):
                continue  # not this block: a miss
            else:
                view[:size] = data
            hits[i] = Direct(size, check)
        return hits, made

    # -- connections ---------------------------------------------------------------------------
    def _link(self, address: str) -> AsyncLink:
        link = self._links.get(address)
        if link is None:
            credential = self._daemon_credential if self._credential is not None else None
            link = self._links[address] = AsyncLink(address, self.config.timeout_s, credential, self._tls[1])
        return link

    async def _daemon_credential(self) -> Credential:
        """The cluster secret, or for a tenant a current ticket (asked of the master when needed)."""
        assert self._credential is not None
        if self._tickets is None:
            return self._credential
        async with self._ticket_lock:
            ticket = self._tickets.fresh()
            if ticket is None:
                reply = await self._call(GetTicket(), TicketReply)
                # The key of the connection that answered (the link _call ended on, after any failover).
                ticket = self._tickets.take(reply, self._master.session_key)
            return ticket

    # -- nodes -------------------------------------------------------------------------------
    async def nodes(self) -> list[NodeInfo]:
        """Every registered node: its rails, host, arena and NICs, and whether it is up."""
        return await self._run(self._core.nodes())

    # -- writes ------------------------------------------------------------------------------
    async def put(self, key: Any, data: Any, options: PutOptions | None = None) -> PutStatus:
        """Store ``data`` under ``key``; an existing key keeps its bytes and reports EXISTS."""
        job = self._core.granted_block(key, data, options)
        if job is not None:
            # One trip into the grant in hand, without the core's generator (its way for anything else).
            status = self._core.granted_put(job, (await self._one_job(job))[0])
            return status if isinstance(status, PutStatus) else (await self._run(status))[0]
        return (await self.put_many([(key, data)], options))[0]

    put_from = put

    async def flush(self) -> None:
        """As ``Store.flush``: every cached put of this client visible to all (or refused)."""
        await self._run(self._core.flush())

    async def put_many(self, items: Iterable[tuple[Any, Any]], options: PutOptions | None = None) -> list[PutStatus]:
        """Store several blocks. Raises the first failure (after giving back what it reserved)."""
        return await self._run(self._core.put_many(items, options))

    # -- reads ---------------------------------------------------------------------------------
    async def get(self, key: Any, *, verify: bool = False) -> bytes | None:
        data = await self._hit(key, verify)
        if data is not None:
            return bytes(data[1])
        return (await self.get_many([key], verify=verify))[0]

    async def get_many(self, keys: Sequence[Any], *, verify: bool = False) -> list[bytes | None]:
        return await self._run(self._core.get_many(keys, verify=verify))

    async def get_into(self, key: Any, buffer: Any, *, verify: bool = False) -> int | None:
        view = as_view(buffer, writable=True, what="buffer")
        data = await self._hit(key, verify, view.nbytes)
        if data is not None:
            view[: data[0]] = data[1]
            return data[0]
        return (await self.get_many_into([key], [buffer], verify=verify))[0]

    async def _hit(self, key: Any, verify: bool, room: int = -1) -> tuple[int, memoryview] | None:
        """One key read from its remembered node, batched with the other reads of this turn of the
        loop: (size, bytes) when it is there whole (and fits ``room``; its checksum holds with
        ``verify``). Anything else — no hint, a miss, an error, a bad key — is None, and the caller
        takes the core's way, which reads again and decides (this is only its fast path)."""
        if type(key) is not str or self._core.closed:
            return None
        place = self._core.hinted(key)
        if place is None:
            return None
        patience = self._core.read_patience_s
        since = self._core.hints.now()
        batcher = self._batcher(place[1], patience)
        began = time.monotonic()
        try:
            answer = await batcher.read(key)
        except KVStoreError as exc:
            self._core.marks.note_unreachable(place[0], exc, patience)
            answer = None
        else:
            self._core.read_times.add(time.monotonic() - began)
            self._core.marks.answered(place[0])
        if answer is None:
            # Not there, or its node failed: the core asks the master, not that node again (a
            # stalled node used to cost the get two timeouts).
            self._core.hints.forget([key], since)
            return None
        size, check, data = answer
        if (0 <= room < size) or (verify and checksum(data) != check):
            return None
        return size, data

    async def get_many_into(
        self, keys: Sequence[Any], buffers: Sequence[Any], *, verify: bool = False, exact_size: bool = False
    ) -> list[int | None]:
        """Read blocks into ``buffers``; each its size, or None for a miss (as ``Store.get_many_into``)."""
        return await self._run(self._core.get_many_into(keys, buffers, verify=verify, exact_size=exact_size))

    async def get_range_many_into(
        self, keys: Sequence[Any], start: int, length: int, buffers: Sequence[Any]
    ) -> list[int | None]:
        """Read bytes ``[start, start + length)`` of each block into its buffer: ``length`` each, or None."""
        return await self._run(self._core.get_range_many_into(keys, start, length, buffers))

    # -- queries -----------------------------------------------------------------------------------
    async def exists(self, key: Any) -> bool:
        return (await self.exists_many([key]))[0]

    async def exists_many(self, keys: Sequence[Any]) -> list[bool]:
        return await self._run(self._core.exists_many(keys))

    async def label_blocks(self, keys: Sequence[Any], labels: Sequence[EngineBlock]) -> None:
        """:meth:`Store.label_blocks`."""
        await self._run(self._core.label_blocks(keys, labels))

    async def sizes(self, keys: Sequence[Any]) -> list[int | None]:
        """Each key's size in bytes, None for a miss; no bytes move."""
        return await self._run(self._core.sizes(keys))

    async def match_prefix(self, keys: Sequence[Any]) -> int:
        return await self._run(self._core.match_prefix(keys))

    async def match_prefix_nodes(self, keys: Sequence[Any]) -> PrefixMatch:
        return await self._run(self._core.match_prefix_nodes(keys))

    async def replicate(self, keys: Sequence[Any], node_id: str, *, max_bytes: int) -> Replicated:
        """Copy stored blocks into the DRAM of ``node_id`` (as ``Store.replicate``)."""
        return await self._run(self._core.replicate(keys, node_id, max_bytes=max_bytes))

    async def remove(self, key: Any) -> bool:
        return await self.remove_many([key]) == 1

    async def remove_many(self, keys: Sequence[Any], *, force: bool = True) -> int:
        """Remove blocks; once it returns, no read (by anyone) returns their bytes (as Store.remove_many)."""
        return (await self.remove_report(keys, force=force))[0]

    async def remove_report(self, keys: Sequence[Any], *, force: bool = True) -> tuple[int, list[int]]:
        """As Store.remove_report: how many were removed, and the indexes of keys a recent read holds."""
        return await self._run(self._core.remove_report(keys, force=force))

    async def clear_replicas(self, keys: Sequence[Any], node: str = "", *, force: bool = False) -> list[str]:
        """:meth:`Store.clear_replicas`."""
        cleared, _ = await self._run(self._core.clear_replicas(keys, node, force=force))
        return [keys[i] for i in cleared]

    async def list_keys(self, prefix: str = "", *, after: str = "", limit: int = 1000) -> tuple[list[str], str]:
        """As Store.list_keys: one page of stored keys starting with ``prefix`` and the next page's cursor."""
        return await self._run(self._core.list_keys(prefix, after=after, limit=limit))

    async def iter_keys(self, prefix: str = "", *, page: int = 1000) -> AsyncIterator[str]:
        """Every stored key starting with ``prefix``, in order, a page at a time."""
        after = ""
        while True:
            keys, after = await self.list_keys(prefix, after=after, limit=page)
            for key in keys:
                yield key
            if not after:
                return

    async def stats(self) -> dict[str, int | float]:
        return await self._run(self._core.stats())

    def _report(self, node_id: str) -> None:
        """Send ReportNode in a task of its own (see NodeMarks.report); called on the loop."""
        task = asyncio.get_running_loop().create_task(self._send_report(node_id))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _send_report(self, node_id: str) -> None:
        if not self._core.closed:
            with contextlib.suppress(KVStoreError):  # best effort: the master fences the node by its TTL anyway
                await self._master.request(ReportNode(node_id), OkReply)

    async def close(self) -> None:
        if self._core.closed:
            return
        self._master.stop()  # a call riding out a failover ends: the store is closing
        with contextlib.suppress(KVStoreError):
            for effect in self._core.close():
                await self._do(effect)
        for task in self._reports:
            task.cancel()
        await self._master.close()
        for link in self._links.values():
            await link.close()
        await asyncio.to_thread(self._locator.close)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _unpack(reply: ReadReply, data: bytes, targets: Sequence[memoryview], job: ReadLocated | ReadRanges) -> list[int]:
    """Copy a ReadReply's blocks into ``targets``: per block the size sent (-1: not held). One of
    another size than its target is not the block asked for: dropped, as the blocking path does."""
    if len(reply.sizes) != len(targets):
        raise ProtocolError(f"{job.address} sent a malformed reply to {type(job).__name__}")
    view, at = memoryview(data), 0
    for size, target in zip(reply.sizes, targets, strict=True):
        if size < 0:
            continue
        if size == target.nbytes:
            target[:] = view[at : at + size]
        at += size
    return list(reply.sizes)
