"""The asyncio client: :class:`AsyncStore`, on the event loop, no worker threads.

The same operations, semantics and errors as :class:`~kvstore_client.store.Store`, over TCP to
every daemon (it asks for no leases, as every read goes through a daemon): gets of remembered
keys read from their node by key in one round trip, puts write into granted space in one round
trip, the rest asks the master first. Each peer gets one pipelined connection (replies are
matched to requests by id), and the gets issued to one node in the same turn of the event loop
travel as one batched request, so many concurrent small gets cost about what one batch does.
Every wait is bounded by ``ClientConfig.timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
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
    NotLeader,
    NotReady,
    ProtocolError,
    RetryLater,
    StoreClosed,
    Timeout,
)
from kvstore.keys import BlockKey, checksum, validate_key
from kvstore.node_store import PutStatus
from kvstore.protocol import (
    ErrorReply,
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
    PutReply,
    PutRevoke,
    PutStart,
    PutStartReply,
    ReadBlocks,
    ReadReply,
    Remove,
    RemoveReply,
    Replica,
    ReturnGrants,
    Stats,
    StatsReply,
    TicketReply,
    WriteBlocks,
    WriteGranted,
    WriteReply,
    decode_payload,
    encode,
)
from kvstore_client.credentials import Tickets, master_credential
from kvstore_client.grants import Grant, too_big_for
from kvstore_client.hints import LocationHints
from kvstore_client.puts import (
    PutOptions,
    checked_options,
    checked_pairs,
    sort_tickets,
    take_commits,
    take_granted,
    take_write_codes,
    write_codes,
)
from transfer.aio import authenticate_stream, open_stream, read_payload
from transfer.discovery import MasterLocator
from transfer.rpc import request_ids
from transfer.tls import contexts

AsyncCredential = Callable[[], Awaitable[Credential]]
R = TypeVar("R", bound=Message)

_BACKGROUND: set[asyncio.Future[None]] = set()
"""Tasks nobody awaits (a batch of reads being sent, a grant given back), kept from the collector."""


class _Link:
    """One pipelined connection: requests go out as they come; a reader task matches replies (and
    the block bytes behind a ReadReply) to their requests by id. A failure or a timeout closes it
    and fails every request in flight; the next request reconnects."""

    def __init__(
        self,
        address: str,
        timeout: float,
        credential: AsyncCredential | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``credential``: how to get what each new connection proves itself with (None: nothing);
        ``tls``: connect over TLS with this context."""
        self.address = address
        self.timeout = timeout
        self.credential = credential
        self.tls = tls
        self.session_key = b""
        """The key the current connection's handshake agreed."""
        self._ids = request_ids()
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._waiting: dict[int, asyncio.Future[tuple[Message, bytes]]] = {}
        self._connecting: asyncio.Lock = asyncio.Lock()

    async def _connect(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self._writer is None:
                reader, writer = await open_stream(self.address, self.timeout, self.tls)
                if self.credential is not None:
                    try:
                        credential = await self.credential()
                        self.session_key = await asyncio.wait_for(
                            authenticate_stream(reader, writer, credential), self.timeout
                        )
                    except BaseException as exc:
                        writer.close()
                        if isinstance(exc, TimeoutError):
                            raise Timeout(f"authenticating to {self.address}: no answer in {self.timeout} s") from None
                        if isinstance(exc, OSError | ConnectionError) and not isinstance(exc, KVStoreError):
                            raise ConnectionFailed(f"authenticating to {self.address}: {exc}") from None
                        raise
                self._writer = writer
                self._reader_task = asyncio.create_task(
                    self._read_replies(reader, writer), name=f"kvstore-link-{self.address}"
                )
            return self._writer

    async def _read_replies(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        failure: KVStoreError = ConnectionFailed(f"{self.address} closed the connection")
        try:
            while True:
                payload = await read_payload(reader)
                if payload is None:
                    break
                request_id, reply = decode_payload(payload)
                data = b""
                if isinstance(reply, ReadReply):
                    total = sum(n for n in reply.sizes if n > 0)
                    data = await reader.readexactly(total) if total else b""
                future = self._waiting.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_result((reply, data))
        except (OSError, asyncio.IncompleteReadError) as exc:
            failure = ConnectionFailed(f"{self.address}: {exc}")
        except KVStoreError as exc:
            failure = exc
        finally:
            if self._writer is writer:  # not a connection that was replaced meanwhile
                self._fail_all(failure)
            else:
                writer.close()

    def _fail_all(self, failure: KVStoreError) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(failure)

    def next_id(self) -> int:
        return next(self._ids)

    async def request(
        self, message: Message, expect: type[R], payload: Sequence[memoryview | bytes] = (), request_id: int = 0
    ) -> tuple[R, bytes]:
        """One request and its reply; a retry passes the first attempt's ``request_id``."""
        writer = self._writer or await self._connect()
        request_id = request_id or next(self._ids)
        future: asyncio.Future[tuple[Message, bytes]] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        frame = encode(message, request_id)
        if payload:
            writer.writelines([frame, *payload])
        else:
            writer.write(frame)
        what = f"{type(message).__name__} to {self.address}"
        try:
            if writer.transport.get_write_buffer_size() > 1 << 20:
                await asyncio.wait_for(writer.drain(), self.timeout)
            reply, data = await asyncio.wait_for(future, self.timeout)
        except TimeoutError:
            self._fail_all(Timeout(f"{what}: no reply within {self.timeout} s"))
            raise Timeout(f"{what}: no reply within {self.timeout} s") from None
        except (OSError, ConnectionError) as exc:
            self._fail_all(ConnectionFailed(f"{what}: {exc}"))
            raise ConnectionFailed(f"{what}: {exc}") from None
        finally:
            self._waiting.pop(request_id, None)
        if isinstance(reply, ErrorReply):
            raise reply.to_error()
        if not isinstance(reply, expect):
            raise ProtocolError(f"{what} got {type(reply).__name__}, expected {expect.__name__}")
        return reply, data

    async def close(self) -> None:
        self._fail_all(ConnectionFailed(f"the connection to {self.address} is closed"))
        if self._reader_task is not None:
            self._reader_task.cancel()
            with contextlib.suppress(BaseException):
                await self._reader_task


class _ReadBatcher:
    """Gets of one node issued in the same turn of the event loop, sent as one ReadBlocks by key."""

    def __init__(self, link: _Link) -> None:
        self.link = link
        self._pending: list[tuple[str, asyncio.Future[tuple[int, int, memoryview] | None]]] = []

    def read(self, key: str) -> asyncio.Future[tuple[int, int, memoryview] | None]:
        future: asyncio.Future[tuple[int, int, memoryview] | None] = asyncio.get_running_loop().create_future()
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append((key, future))
        return future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.ensure_future(self._send(batch))
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)

    async def _send(self, batch: list[tuple[str, asyncio.Future[tuple[int, int, memoryview] | None]]]) -> None:
        keys = [k for k, _ in batch]
        try:
            reply, data = await self.link.request(
                ReadBlocks(keys, ["dram"] * len(keys), [0] * len(keys), [0] * len(keys)), ReadReply
            )
            if not len(reply.sizes) == len(reply.checksums) == len(keys):
                raise ProtocolError(f"{self.link.address} sent a malformed reply to ReadBlocks")
        except BaseException as exc:
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        view = memoryview(data)
        at = 0
        for (_, future), size, check in zip(batch, reply.sizes, reply.checksums, strict=True):
            if future.done():
                at += max(size, 0)
                continue
            if size < 0:
                future.set_result(None)
            else:
                future.set_result((size, check, view[at : at + size]))
                at += size


class AsyncStore:
    def __init__(self, master: str, config: ClientConfig | None = None) -> None:
        self.master = master
        self.config = config or ClientConfig()
        self._locator = MasterLocator(master, self.config.timeout_s)
        credential = master_credential(self.config)
        self._credential = credential
        self._tickets = Tickets(credential.name) if credential is not None and credential.kind == "tenant" else None
        self._ticket_lock = asyncio.Lock()
        self._tls = contexts(self.config.tls)
        # For etcd://, re-pointed at the leader.
        self._master = self._new_link(master, self._master_credential, self._tls[0])
        self._links: dict[str, _Link] = {}
        self._readers: dict[str, _ReadBatcher] = {}
        self._hints = LocationHints(self.config.location_hints)
        self._grants: dict[str | None, Grant] = {}
        self._granting = asyncio.Lock()
        self._grant_size = int(self.config.grant_bytes)
        self._closed = False

    @classmethod
    async def connect(cls, master: str, config: ClientConfig | None = None) -> Self:
        """A store connected to the master at ``host:port``; raises ConnectionFailed when it does not answer."""
        store = cls(master, config)
        try:
            await store._follow_master()
            await store._master.request(Stats(), StatsReply)
        except BaseException:
            await store.close()
            raise
        return store

    async def _call(self, message: Message, expect: type[R]) -> R:
        if self._closed:
            raise StoreClosed("this AsyncStore is closed")
        deadline = time.monotonic() + self.config.timeout_s
        backoff = 0.01
        request_id = self._master.next_id()  # every attempt the same: the master answers a retry once
        while True:
            try:
                await self._follow_master()
                return (await self._master.request(message, expect, request_id=request_id))[0]
            except (ConnectionFailed, NotLeader, NotReady) as exc:
                # Ride out a master restart or failover: the same request, with backoff, up to the timeout.
                if not isinstance(exc, NotReady):
                    await self._relocate_master()
                if time.monotonic() + backoff > deadline:
                    raise
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 0.5)

    async def _follow_master(self) -> None:
        """Point the master link at the address the locator names (resolving etcd on first use)."""
        if self._locator.dynamic and self._master.address == self._locator.spec:
            await self._relocate_master()
            if self._master.address == self._locator.spec:
                raise NotLeader(f"no leader of {self._locator.spec} resolved yet")

    async def _relocate_master(self) -> None:
        if not self._locator.dynamic:
            return
        try:  # a blocking HTTP read of etcd, in a thread: only after a failure or at first use
            address = await asyncio.to_thread(self._locator.refresh, 0.05)
        except KVStoreError:
            return
        if address != self._master.address:
            old, self._master = self._master, self._new_link(address, self._master_credential, self._tls[0])
            await old.close()

    def _link(self, address: str) -> _Link:
        link = self._links.get(address)
        if link is None:
            link = self._links[address] = self._new_link(address, self._daemon_credential, self._tls[1])
        return link

    def _new_link(self, address: str, credential: AsyncCredential, tls: ssl.SSLContext | None) -> _Link:
        return _Link(address, self.config.timeout_s, credential if self._credential is not None else None, tls)

    async def _master_credential(self) -> Credential:
        assert self._credential is not None
        return self._credential

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

    def _reader(self, address: str) -> _ReadBatcher:
        batcher = self._readers.get(address)
        if batcher is None:
            batcher = self._readers[address] = _ReadBatcher(self._link(address))
        return batcher

    # -- writes ------------------------------------------------------------------------------
    async def put(self, key: Any, data: Any, options: PutOptions | None = None) -> PutStatus:
        """Store ``data`` under ``key``; an existing key keeps its bytes and reports EXISTS."""
        return (await self.put_many([(key, data)], options))[0]

    put_from = put

    async def put_many(self, items: Iterable[tuple[Any, Any]], options: PutOptions | None = None) -> list[PutStatus]:
        """Store several blocks. Raises the first failure (after giving back what it reserved)."""
        if self._closed:
            raise StoreClosed("this AsyncStore is closed")
        opts = checked_options(options)
        checked = checked_pairs(items)
        statuses: list[PutStatus | None] = [None] * len(checked)
        todo = list(range(len(checked)))
        if (opts.replicas or self.config.replicas) == 1 and self.config.grant_bytes and todo:
            todo = await self._put_granted(checked, todo, opts, statuses)
        for attempt in range(self.config.put_retries + 1):
            if not todo:
                break
            retry = await self._put_round(checked, todo, opts, statuses)
            if not retry:
                break
            if attempt == self.config.put_retries:
                raise RetryLater(f"key {checked[retry[0]][0]!r} stayed busy through {attempt} retries")
            await asyncio.sleep(min(0.01 * 2**attempt, 0.5))
            todo = retry
        return [s if s is not None else PutStatus.EXISTS for s in statuses]

    async def _carve(self, sizes: list[int], preferred: str | None) -> tuple[Grant, list[int]] | None:
        """As GrantPool.carve, on the event loop."""
        if too_big_for(sizes, self._grant_size):
            return None
        grant = self._grants.get(preferred)
        if grant is None or not grant.usable(sizes):
            async with self._granting:
                grant = self._grants.get(preferred)
                if grant is None or not grant.usable(sizes):
                    if grant is not None:
                        del self._grants[preferred]
                        await self._return([grant.grant_id])
                    reply = await self._call(GrantSpace(self._grant_size, preferred), GrantReply)
                    self._grant_size = min(self._grant_size, reply.length)  # the master's cap
                    grant = Grant.from_reply(reply)
                    if not grant.usable(sizes):
                        await self._return([grant.grant_id])
                        return None
                    self._grants[preferred] = grant
        offsets = grant.take(sizes)
        return (grant, offsets) if offsets is not None else None

    async def _return(self, grant_ids: list[int]) -> None:
        with contextlib.suppress(KVStoreError):
            await self._master.request(ReturnGrants(grant_ids), OkReply)

    def _drop_grant(self, grant: Grant) -> None:
        for where, known in list(self._grants.items()):
            if known is grant:
                del self._grants[where]
                task = asyncio.ensure_future(self._return([grant.grant_id]))
                _BACKGROUND.add(task)
                task.add_done_callback(_BACKGROUND.discard)

    async def _put_granted(
        self, items: list[tuple[BlockKey, memoryview]], todo: list[int], opts: PutOptions,
        out: list[PutStatus | None],
    ) -> list[int]:  # fmt: skip
        try:
            carved = await self._carve([items[i][1].nbytes for i in todo], opts.preferred_node)
        except (ConnectionFailed, Timeout):
            raise
        except KVStoreError:
            return todo
        if carved is None:
            return todo
        grant, offsets = carved
        views = [items[i][1] for i in todo]
        message = WriteGranted(
            grant.grant_id, [items[i][0] for i in todo], offsets, [v.nbytes for v in views],
            [checksum(v) for v in views], opts.pin,
        )  # fmt: skip
        try:
            reply, _ = await self._link(grant.address).request(message, PutReply, views)
        except (ConnectionFailed, Timeout):
            self._drop_grant(grant)
            return todo
        codes = write_codes(reply.codes, reply.errors, len(todo), grant.address)
        if GrantExpired.code in reply.codes:
            self._drop_grant(grant)
        left, placed = take_granted(items, todo, codes, grant, out)
        self._hints.note(placed)
        return left

    async def _put_round(
        self, items: list[tuple[BlockKey, memoryview]], todo: list[int], opts: PutOptions, out: list[PutStatus | None]
    ) -> list[int]:
        reply = await self._call(
            PutStart([items[i][0] for i in todo], [items[i][1].nbytes for i in todo],
                     opts.replicas or self.config.replicas, opts.preferred_node, opts.pin),
            PutStartReply,
        )  # fmt: skip
        plan = sort_tickets(reply, todo, out)
        sums = {i: checksum(items[i][1]) for group in plan.writes.values() for i, _ in group}

        async def write(address: str, group: list[tuple[int, Replica]]) -> list[tuple[int, str]]:
            seals = [r.seal for _, r in group] if any(r.seal for _, r in group) else []
            message = WriteBlocks(
                [items[i][0] for i, _ in group], [r.offset for _, r in group], [items[i][1].nbytes for i, _ in group],
                [sums[i] for i, _ in group], opts.pin, seals,
            )  # fmt: skip
            try:
                answer, _ = await self._link(address).request(message, WriteReply, [items[i][1] for i, _ in group])
            except KVStoreError as exc:
                return [(exc.code, str(exc))] * len(group)
            return write_codes(answer.codes, answer.errors, len(group), address)

        outcomes = await asyncio.gather(*(write(a, g) for a, g in plan.writes.items()))
        failed: set[int] = set()
        for (address, group), codes in zip(plan.writes.items(), outcomes, strict=True):
            take_write_codes(plan, items, address, group, codes, failed)
        done = [i for i in sums if i not in failed]
        if failed:
            await self._call(PutRevoke([items[i][0] for i in sorted(failed)]), OkReply)
        if done:
            committed = await self._call(PutEnd([items[i][0] for i in done], [sums[i] for i in done]), PutEndReply)
            self._hints.note(take_commits(plan, items, done, committed.committed, out))
            if plan.lost:
                await self._call(PutRevoke([items[i][0] for i in plan.lost]), OkReply)
        if plan.failure is not None:
            raise plan.failure
        return plan.retry + plan.lost

    # -- reads ---------------------------------------------------------------------------------
    async def get(self, key: Any, *, verify: bool = False) -> bytes | None:
        return (await self.get_many([key], verify=verify))[0]

    async def get_many(self, keys: Sequence[Any], *, verify: bool = False) -> list[bytes | None]:
        got = await self._get([validate_key(k) for k in keys], verify)
        return [None if g is None else bytes(g) for g in got]

    async def get_into(self, key: Any, buffer: Any, *, verify: bool = False) -> int | None:
        checked = validate_key(key)
        place = self._hints.get(checked)
        if place is None or self._closed:
            return (await self.get_many_into([checked], [buffer], verify=verify))[0]
        # The hot case, without the batch machinery: one key whose node is remembered.
        view = as_view(buffer, writable=True, what="buffer")
        try:
            answer = await self._reader(place[1]).read(checked)
        except (ConnectionFailed, Timeout):
            answer = None
        if answer is None:
            self._hints.forget([checked])
            return (await self.get_many_into([checked], [view], verify=verify))[0]
        size, check, data = answer
        if size > view.nbytes:
            raise BufferTooSmall(f"buffer of {view.nbytes} bytes cannot hold block {checked!r} of {size} bytes")
        if verify and checksum(data) != check:
            raise CorruptBlock(f"block {checked!r} read from {place[1]} fails its checksum")
        view[:size] = data
        return size

    async def get_many_into(
        self, keys: Sequence[Any], buffers: Sequence[Any], *, verify: bool = False, exact_size: bool = False
    ) -> list[int | None]:
        """Read blocks into ``buffers``; each its size, or None for a miss (see ``Store.get_many_into``)."""
        if len(keys) != len(buffers):
            raise InvalidArgument(f"get_many_into got {len(keys)} keys but {len(buffers)} buffers")
        checked = [validate_key(k) for k in keys]
        views = [as_view(b, writable=True, what="buffer") for b in buffers]
        got = await self._get(checked, verify)
        out: list[int | None] = []
        for key, data, view in zip(checked, got, views, strict=True):
            if data is None or (exact_size and data.nbytes != view.nbytes):
                out.append(None)
                continue
            if data.nbytes > view.nbytes:
                raise BufferTooSmall(f"buffer of {view.nbytes} bytes cannot hold block {key!r} of {data.nbytes} bytes")
            view[: data.nbytes] = data
            out.append(data.nbytes)
        return out

    async def _get(self, keys: list[BlockKey], verify: bool) -> list[memoryview | None]:
        if self._closed:
            raise StoreClosed("this AsyncStore is closed")
        out: list[memoryview | None] = [None] * len(keys)
        rest = list(range(len(keys)))
        hinted = [(i, place) for i in rest if (place := self._hints.get(keys[i])) is not None]
        if hinted:
            futures = [self._reader(address).read(keys[i]) for i, (_, address) in hinted]
            answers = await asyncio.gather(*futures, return_exceptions=True)
            missed = []
            for (i, (_, address)), answer in zip(hinted, answers, strict=True):
                if isinstance(answer, ConnectionFailed | Timeout) or answer is None:
                    missed.append(keys[i])
                    continue
                if isinstance(answer, BaseException):
                    raise answer
                _, check, data = answer
                if verify and checksum(data) != check:
                    raise CorruptBlock(f"block {keys[i]!r} read from {address} fails its checksum")
                out[i] = data
            self._hints.forget(missed)
            rest = [i for i in rest if out[i] is None]
        if not rest:
            return out
        reply = await self._call(GetReplicas([keys[i] for i in rest], [], False), GetReplicasReply)
        located = reply.located([keys[i] for i in rest])
        per_address: dict[str, list[tuple[int, Any]]] = {}
        for i, loc in zip(rest, located, strict=True):
            if loc is not None and loc.replicas:
                per_address.setdefault(loc.replicas[0].address, []).append((i, loc))

        async def read(address: str, group: list[tuple[int, Any]]) -> None:
            message = ReadBlocks(
                [loc.key for _, loc in group], [loc.replicas[0].tier for _, loc in group],
                [loc.replicas[0].offset for _, loc in group], [loc.size for _, loc in group],
            )  # fmt: skip
            try:
                answer, data = await self._link(address).request(message, ReadReply)
            except (ConnectionFailed, Timeout):
                return  # the node is gone or stalled: misses
            if len(answer.sizes) != len(group):
                raise ProtocolError(f"{address} sent a malformed reply to ReadBlocks")
            view, at = memoryview(data), 0
            for (i, loc), size in zip(group, answer.sizes, strict=True):
                if size < 0:
                    continue
                block = view[at : at + size]
                at += size
                if size != loc.size:
                    continue  # a stale copy: a miss
                if verify and checksum(block) != loc.checksum:
                    raise CorruptBlock(f"block {loc.key!r} read from {address} fails its checksum")
                out[i] = block
                self._hints.note([(loc.key, (loc.replicas[0].node_id, address))])

        await asyncio.gather(*(read(a, g) for a, g in per_address.items()))
        return out

    # -- queries -----------------------------------------------------------------------------------
    async def exists(self, key: Any) -> bool:
        return (await self.exists_many([key]))[0]

    async def exists_many(self, keys: Sequence[Any]) -> list[bool]:
        return (await self._call(Exists([validate_key(k) for k in keys]), ExistsReply)).exists

    async def match_prefix(self, keys: Sequence[Any]) -> int:
        return (await self._call(MatchPrefix([validate_key(k) for k in keys]), MatchPrefixReply)).matched

    async def match_prefix_nodes(self, keys: Sequence[Any]) -> PrefixMatch:
        checked: list[str] = [validate_key(k) for k in keys]
        return (await self._call(MatchPrefixNodes(checked), MatchPrefixNodesReply)).prefix_match(len(checked))

    async def remove(self, key: Any) -> bool:
        return await self.remove_many([key]) == 1

    async def remove_many(self, keys: Sequence[Any], *, force: bool = True) -> int:
        """Remove blocks; once it returns, no read (by anyone) returns their bytes (as Store.remove_many)."""
        return (await self.remove_report(keys, force=force))[0]

    async def remove_report(self, keys: Sequence[Any], *, force: bool = True) -> tuple[int, list[int]]:
        """As Store.remove_report: how many were removed, and the indexes of keys a recent read holds."""
        checked: list[str] = [validate_key(k) for k in keys]
        reply = await self._call(Remove(checked, force), RemoveReply)
        self._hints.forget(checked)
        return reply.removed, reply.held

    async def list_keys(self, prefix: str = "", *, after: str = "", limit: int = 1000) -> tuple[list[str], str]:
        """As Store.list_keys: one page of stored keys starting with ``prefix`` and the next page's cursor."""
        if not isinstance(prefix, str) or not isinstance(after, str):
            raise InvalidArgument(f"prefix and after must be str, got {type(prefix).__name__}, {type(after).__name__}")
        if type(limit) is not int or limit < 1:
            raise InvalidArgument(f"limit must be a positive int, got {limit!r}")
        reply = await self._call(ListKeys(prefix, after, limit), KeysReply)
        return reply.keys, reply.next

    async def nodes(self) -> list[NodeInfo]:
        return (await self._call(ListNodes(), NodesReply)).nodes

    async def stats(self) -> dict[str, int | float]:
        return (await self._call(Stats(), StatsReply)).stats

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True  # first: no put takes a new grant meanwhile
        ids = [g.grant_id for g in self._grants.values()]
        self._grants.clear()
        if ids:
            await self._return(ids)
        for link in [self._master, *self._links.values()]:
            await link.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
