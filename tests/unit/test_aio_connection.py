"""transfer.aio.AsyncConnection, the master's link to a daemon (its commands', its probes'): when the
peer resets the connection between two calls the next call connects anew, on either event loop the
master may run (uvloop raised RuntimeError writing to the closed transport, which killed the
master's node-probe task); abort() gives a connection up at once, the call in flight included."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop

from kvstore.errors import ConnectionFailed
from kvstore.protocol import MasterHello, OkReply, decode_payload, encode
from transfer.aio import AsyncConnection, read_payload

LOOPS: dict[str, Callable[[Coroutine[Any, Any, None]], None]] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


async def _closing_server(connections: list[int], reset: bool) -> asyncio.Server:
    """Answers one request per connection with OkReply, then closes it: with ``reset`` a reset (RST:
    SO_LINGER 0, as a peer that died), else a plain close (FIN, as a daemon that exits)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        payload = await read_payload(reader)
        assert payload is not None
        request_id, _ = decode_payload(payload)
        writer.write(encode(OkReply(), request_id))
        await writer.drain()
        if reset:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        else:
            writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("reset", [True, False], ids=["reset", "closed"])
def test_a_call_after_the_peer_closed_the_connection_connects_anew(loop: str, reset: bool) -> None:
    async def run() -> None:
        connections: list[int] = []
        server = await _closing_server(connections, reset)
        port = server.sockets[0].getsockname()[1]
        conn = AsyncConnection(f"127.0.0.1:{port}", timeout=5.0)
        try:
            for _ in range(3):
                assert isinstance(await conn.call(MasterHello(1), OkReply), OkReply)
                await asyncio.sleep(0.1)  # the reset or the end of stream lands
            assert len(connections) == 3
        finally:
            await conn.close()
            server.close()
            await server.wait_closed()

    LOOPS[loop](run())


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_abort_fails_the_call_in_flight_and_sends_nothing_more(loop: str) -> None:
    """A peer that reads requests and never answers (a daemon cut off: the master fences it and
    gives its links up). The call in flight fails at once with ConnectionFailed, not after the
    connection's timeout (an hour here: waiting for it fails the test's own bound); later calls
    fail the same way, connecting no more, and none of their bytes reach the peer."""

    async def run() -> None:
        received: list[bytes] = []
        connections: list[int] = []
        read_one = asyncio.Event()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(1)
            with contextlib.suppress(ConnectionError):
                while payload := await read_payload(reader):
                    received.append(payload)
                    read_one.set()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        conn = AsyncConnection(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", timeout=3600.0)
        try:
            call = asyncio.ensure_future(conn.call(MasterHello(1), OkReply))
            await asyncio.wait_for(read_one.wait(), 10.0)
            conn.abort()
            with pytest.raises(ConnectionFailed):
                await asyncio.wait_for(call, 10.0)
            with pytest.raises(ConnectionFailed, match="given up"):
                await asyncio.wait_for(conn.call(MasterHello(2), OkReply), 10.0)
            await asyncio.sleep(0.1)
            assert len(received) == 1 and len(connections) == 1
        finally:
            await conn.close()
            server.close()
            await server.wait_closed()

    LOOPS[loop](run())
