"""One pipelined connection to a peer, on the event loop: :class:`AsyncLink`.

The blocking side pools connections instead (:class:`transfer.rpc.ConnectionPool`), one caller
at a time on each; on the event loop one connection carries every request to its peer at once,
and replies are matched to requests by id. The asyncio client keeps one per daemon and one to
the master (:class:`transfer.leader_link.LeaderLink`, which follows a new leader); the conductor
one to the master.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from kvstore.auth import Credential
from kvstore.config import WRITE_FLOOR_BPS
from kvstore.errors import ConnectionFailed, KVStoreError, ProtocolError, Timeout
from kvstore.protocol import ErrorReply, Message, ReadReply, decode_payload, encode
from transfer.aio import authenticate_stream, open_stream, read_payload
from transfer.rpc import connect_timeout, request_ids

AsyncCredential = Callable[[], Awaitable[Credential]]
"""What a link asks at each new connection for the credential it proves itself with."""
R = TypeVar("R", bound=Message)


def fixed_credential(credential: Credential) -> AsyncCredential:
    """``credential`` for every connection (a cluster's secret, a tenant's token: nothing to renew)."""

    async def proof() -> Credential:
        return credential

    return proof


BACKGROUND: set[asyncio.Future[None]] = set()
"""Tasks nobody awaits (a drain a request gave up waiting for, a batch of reads being sent), kept from
the collector."""


class _GaveUp(Exception):
    """A request's patience ran out before its reply began (see :meth:`AsyncLink.request`)."""


class AsyncLink:
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
        self._readers: set[asyncio.Task[None]] = set()
        """Every reader task not ended yet, this connection's and failed ones': held here because the
        event loop holds tasks weakly and a stream's protocol its reader too (one only the link held,
        dropped with the link, was destroyed pending)."""
        self._closed = False
        """:meth:`close`-d: it connects no more (a request still holding it fails)."""
        self._waiting: dict[int, asyncio.Future[tuple[Message, bytes]]] = {}
        self._begun: set[int] = set()
        """Requests whose reply's payload is being read now (past any patience of theirs)."""
        self._heard = 0.0
        """When (the loop's time) the last reply on this link was read whole."""
        self._connecting: asyncio.Lock = asyncio.Lock()

    async def _connect(self, timeout: float | None = None) -> asyncio.StreamWriter:
        """The link's connection, made (within ``timeout``, the link's by default) if there is none."""
        timeout = timeout or self.timeout
        async with self._connecting:
            if self._closed:
                raise ConnectionFailed(f"the connection to {self.address} is closed")
            if self._writer is None:
                reader, writer = await open_stream(self.address, timeout, self.tls)
                if self.credential is not None:
                    try:
                        credential = await self.credential()
                        self.session_key = await asyncio.wait_for(
                            authenticate_stream(reader, writer, credential), timeout
                        )
                    except BaseException as exc:
                        writer.close()
                        if isinstance(exc, TimeoutError):
                            raise Timeout(f"authenticating to {self.address}: no answer in {timeout} s") from None
                        if isinstance(exc, OSError | ConnectionError) and not isinstance(exc, KVStoreError):
                            raise ConnectionFailed(f"authenticating to {self.address}: {exc}") from None
                        raise
                if self._closed:  # while it connected: this connection would outlive the link
                    writer.transport.abort()
                    raise ConnectionFailed(f"the connection to {self.address} is closed")
                self._writer = writer
                task = self._reader_task = asyncio.create_task(
                    self._read_replies(reader, writer), name=f"kvstore-link-{self.address}"
                )
                self._readers.add(task)
                task.add_done_callback(self._readers.discard)
            return self._writer

    async def _read_replies(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        failure: KVStoreError = ConnectionFailed(f"{self.address} closed the connection")
        clock = asyncio.get_running_loop().time
        try:
            while True:
                payload = await read_payload(reader)
                if payload is None:
                    break
                request_id, reply = decode_payload(payload)
                data = b""
                if isinstance(reply, ReadReply):
                    total = sum(n for n in reply.sizes if n > 0)
                    if total:
                        self._begun.add(request_id)  # its patience is over: the bytes are coming
                        try:
                            data = await reader.readexactly(total)
                        finally:
                            self._begun.discard(request_id)
                self._heard = clock()
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

    def _fail_all(self, failure: KVStoreError, abort: bool = True) -> None:
        writer, self._writer = self._writer, None
        if writer is not None and abort:
            # A failed connection is aborted, not closed: a close waits to send what is queued, which
            # a frozen or cut-off peer never takes, and its reader task would wait on that until the
            # collector destroyed it pending.
            writer.transport.abort()
        elif writer is not None:
            writer.close()
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(failure)

    def _fail(self, writer: asyncio.StreamWriter, request_id: int, failure: KVStoreError) -> None:
        """Request ``request_id`` on ``writer`` failed with ``failure``, which it raises itself: the
        link fails with it, unless it has connected anew meanwhile (another request's failure ended
        that connection: the new one is not this request's to end)."""
        self._waiting.pop(request_id, None)  # raised by the request: not failed again, never read
        if self._writer is writer:
            self._fail_all(failure)

    def next_id(self) -> int:
        return next(self._ids)

    async def request(
        self, message: Message, expect: type[R], payload: Sequence[memoryview | bytes] = (), request_id: int = 0,
        patience: float = 0.0,
    ) -> tuple[R, bytes]:  # fmt: skip
        """One request and its reply; a retry passes the first attempt's ``request_id``. ``patience``:
        give this request up (a Timeout) when its reply has not begun within it, leaving the
        connection and the other requests on it be (a reply that comes later is read and dropped);
        a reply begun has the link's timeout, which fails them all."""
        writer = self._writer or await self._connect(connect_timeout(self.timeout, patience))
        request_id = request_id or next(self._ids)
        future: asyncio.Future[tuple[Message, bytes]] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        frame = encode(message, request_id)
        if payload:
            writer.writelines([frame, *payload])
        else:
            writer.write(frame)
        what = f"{type(message).__name__} to {self.address}"
        impatient: asyncio.TimerHandle | None = None
        try:
            if (queued := writer.transport.get_write_buffer_size()) > 1 << 20:
                if patience:  # a node that takes no bytes (frozen, cut off) is given up, as one that does not answer
                    await self._drain_within(writer, patience + queued / WRITE_FLOOR_BPS)
                else:
                    await asyncio.wait_for(writer.drain(), self.timeout)
            # The patience runs from here, as the sync face's from the end of its send: a payload
            # queued behind others' on this one connection is not given up before it went out.
            if patience:
                impatient = asyncio.get_running_loop().call_later(patience, self._give_up, request_id, patience)
            reply, data = await asyncio.wait_for(future, self.timeout)
        except _GaveUp:
            raise Timeout(f"{what}: no reply began within {patience} s") from None
        except KVStoreError:
            raise  # its connection failed under it (another request's timeout, the peer gone): failed already
        except TimeoutError:
            self._fail(writer, request_id, Timeout(f"{what}: no reply within {self.timeout} s"))
            raise Timeout(f"{what}: no reply within {self.timeout} s") from None
        except (OSError, ConnectionError) as exc:
            self._fail(writer, request_id, ConnectionFailed(f"{what}: {exc}"))
            raise ConnectionFailed(f"{what}: {exc}") from None
        finally:
            self._waiting.pop(request_id, None)
            if impatient is not None:
                impatient.cancel()
        if isinstance(reply, ErrorReply):
            raise reply.to_error()
        if not isinstance(reply, expect):
            raise ProtocolError(f"{what} got {type(reply).__name__}, expected {expect.__name__}")
        return reply, data

    async def _drain_within(self, writer: asyncio.StreamWriter, bound: float) -> None:
        """Wait until the link's buffer drained, for a request with patience: this request alone is
        given up (a Timeout; its frame stays queued, its late reply is dropped) when it has not
        within ``bound``, and the link fails only past its whole timeout, as for any request."""
        drained = asyncio.ensure_future(writer.drain())
        done, _ = await asyncio.wait({drained}, timeout=min(bound, self.timeout))
        if not done:
            if bound >= self.timeout:
                drained.cancel()
                raise TimeoutError
            BACKGROUND.add(drained)  # the buffer drains (or the link fails) without this request
            drained.add_done_callback(BACKGROUND.discard)
            drained.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: never logged
            raise _GaveUp
        drained.result()

    def _give_up(self, request_id: int, patience: float) -> None:
        """A request's patience ran out: unless its reply has begun, it ends (with _GaveUp) alone. A
        link that is reading another reply's payload, or read a whole reply within the patience, has
        a daemon that answers (its replies come one after another on one connection: this one is
        queued behind others'): the patience starts again from then, so that only a silent node is
        given up (a last copy's give-up costs the master a question and the daemon its work)."""
        if request_id in self._begun or request_id not in self._waiting:
            return
        loop = asyncio.get_running_loop()
        quiet = loop.time() - self._heard
        if self._begun or quiet < patience:
            loop.call_later(patience - quiet if not self._begun else patience, self._give_up, request_id, patience)
            return
        future = self._waiting.pop(request_id)
        if not future.done():
            future.set_exception(_GaveUp())

    async def close(self) -> None:
        """Close the connection and end its reader tasks; the link connects no more. (A request on
        it still in flight, one that took it before a new leader's link replaced it, say, would
        otherwise connect it anew: a connection, and its reader task, nobody closes.)"""
        self._closed = True
        self._fail_all(ConnectionFailed(f"the connection to {self.address} is closed"), abort=False)
        readers = list(self._readers)
        for task in readers:
            task.cancel()
        for task in readers:
            with contextlib.suppress(BaseException):
                await task
