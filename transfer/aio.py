"""Asyncio frame I/O: read whole frames from a stream, and a request/reply connection.

Every wait is bounded: reads by the caller's timeout, connects and calls by
the connection's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import ssl
import struct
from typing import TypeVar

from kvstore.auth import ClientHandshake, Credential
from kvstore.errors import ConnectionFailed, ConnectionRefused, KVStoreError, ProtocolError, Timeout
from kvstore.protocol import FRAME_HEADER, MAX_FRAME_BYTES, ErrorReply, Message, decode_payload, encode
from transfer.tls import refusal
from transfer.wire import parse_address

M = TypeVar("M", bound=Message)

HANDSHAKE_FRAME = 1024
"""Largest frame a server reads before its peer is authenticated (and a client during the handshake)."""


async def read_payload(reader: asyncio.StreamReader, max_frame: int = MAX_FRAME_BYTES) -> bytes | None:
    """The next frame's payload; None at a clean end of stream. Raises ProtocolError for an oversize frame."""
    try:
        header = await reader.readexactly(FRAME_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ConnectionFailed("stream ended inside a frame header") from None
        return None
    (length,) = FRAME_HEADER.unpack(header)
    if length > max_frame:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_frame}")
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ConnectionFailed(f"stream ended inside a frame of {length} bytes") from None


async def open_stream(
    address: str, timeout: float, tls: ssl.SSLContext | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to ``host:port`` within ``timeout`` (and run the TLS handshake, with a context); typed errors."""
    host, port = parse_address(address)
    try:
        return await asyncio.wait_for(asyncio.open_connection(host, port, ssl=tls), timeout)
    except TimeoutError:
        raise Timeout(f"connecting to {address}: no answer in {timeout} s") from None
    except ssl.SSLError as exc:
        raise refusal(exc, f"connecting to {address}") from None
    except ConnectionRefusedError:
        raise ConnectionRefused(f"cannot connect to {address}: nothing listens there") from None
    except OSError as exc:
        raise ConnectionFailed(f"cannot connect to {address}: {exc.strerror or exc}") from None


async def port_refuses(address: str, timeout: float) -> bool:
    """Whether ``host:port`` refuses a TCP connection: nothing listens there (a process gone). A
    connection made is closed at once, before any byte; one not answered in ``timeout`` (a frozen
    or cut-off host) is no refusal."""
    host, port = parse_address(address)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.close()
    return False


async def authenticate_stream(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, credential: Credential
) -> bytes:  # fmt: skip
    """The client's half on an asyncio stream (the caller bounds the wait)."""

    async def receive() -> Message:
        payload = await read_payload(reader, HANDSHAKE_FRAME)
        if payload is None:
            raise ConnectionFailed("the server closed the connection during the handshake")
        reply = decode_payload(payload)[1]
        if isinstance(reply, ErrorReply):
            raise reply.to_error()
        return reply

    handshake = ClientHandshake(credential)
    writer.write(encode(handshake.hello(), 0))
    challenge = await receive()
    writer.write(encode(handshake.proof(challenge), 0))
    return handshake.finish(await receive())


class AsyncConnection:
    """One request/reply connection; calls are serialised, and a failed call closes it."""

    def __init__(
        self,
        address: str,
        timeout: float = 5.0,
        hello: Message | None = None,
        credential: Credential | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``hello``: a request sent first on every new connection (a master's MasterHello), after the
        handshake of :mod:`kvstore.auth` when there is a ``credential``; ``tls``: over TLS."""
        self.address = address
        self.timeout = timeout
        self.hello = hello
        self.credential = credential
        self.tls = tls
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._aborted = False

    async def call(self, message: Message, expect: type[M]) -> M:
        async with self._lock:
            try:
                return await asyncio.wait_for(self._call(message, expect), self.timeout)
            except TimeoutError:
                await self._close()
                raise Timeout(f"{type(message).__name__} to {self.address}: no reply in {self.timeout} s") from None
            except KVStoreError:  # typed already (AuthFailed is an OSError too: not to be wrapped)
                await self._close()
                raise
            except (OSError, ConnectionError) as exc:
                await self._close()
                raise ConnectionFailed(f"{type(message).__name__} to {self.address}: {exc}") from None
            except RuntimeError as exc:
                # uvloop's write to a transport closed meanwhile (the peer reset it, or abort()); asyncio's
                # only logs. Anything else is a bug, raised as it is.
                closed = self._aborted or self._streams is None or self._streams[1].is_closing()
                await self._close()
                if not closed:
                    raise
                raise ConnectionFailed(f"{type(message).__name__} to {self.address}: closed ({exc})") from None
            except BaseException:
                await self._close()
                raise

    async def _call(self, message: Message, expect: type[M]) -> M:
        if self._aborted:  # no new connection either
            raise ConnectionFailed(f"the connection to {self.address} was given up")
        if self._streams is not None and (self._streams[1].is_closing() or self._streams[0].at_eof()):
            await self._close()  # the peer closed or reset it since the last call (nothing of this one sent): anew
        if self._streams is None:
            self._streams = await open_stream(self.address, self.timeout, self.tls)
            if self.credential is not None:
                await authenticate_stream(*self._streams, self.credential)
            if self.hello is not None:
                await self._exchange(self.hello, Message)
        return await self._exchange(message, expect)

    async def _exchange(self, message: Message, expect: type[M]) -> M:
        assert self._streams is not None
        reader, writer = self._streams
        if self._aborted:  # checked where nothing awaits before the write: none goes out after abort()
            raise ConnectionFailed(f"the connection to {self.address} was given up")
        request_id = next(self._ids)
        writer.write(encode(message, request_id))
        await writer.drain()
        payload = await read_payload(reader)
        if payload is None:
            raise ConnectionFailed(f"{self.address} closed the connection")
        reply_id, reply = decode_payload(payload)
        if reply_id != request_id:
            raise ProtocolError(f"reply to request {reply_id}, expected {request_id}")
        if isinstance(reply, ErrorReply):
            raise reply.to_error()
        if not isinstance(reply, expect):
            raise ProtocolError(f"{type(message).__name__} got {type(reply).__name__}, expected {expect.__name__}")
        return reply

    async def _close(self) -> None:
        if self._streams is not None:
            writer = self._streams[1]
            self._streams = None
            writer.close()
            with contextlib.suppress(OSError, TimeoutError, ConnectionError):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def close(self) -> None:
        async with self._lock:
            await self._close()

    def abort(self) -> None:
        """Give the connection up now, a call in flight included (it fails with ConnectionFailed, as
        does every later one, without connecting again): no request of it reaches the peer from now
        on, not even one TCP still holds to send again when a cut link heals. The socket is reset
        (SO_LINGER 0): a plain close would leave the kernel sending what it holds, from a socket
        nobody owns any more."""
        self._aborted = True
        if self._streams is not None:
            transport = self._streams[1].transport
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
