"""A request with a patience against a peer cut off from this host (its SYNs dropped: here a
listener whose accept queue is full, which the kernel answers with silence) is given up within
about the connection's bound (transfer.rpc.CONNECT_PATIENCE_S), as a reply that does not begin
would be: a Timeout, so that a read moves to its next replica instead of waiting out the whole
timeout on the connection. Without a patience the connection waits the timeout, as before."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from kvstore.errors import Timeout
from kvstore.protocol import OkReply, Stats
from transfer.link import AsyncLink
from transfer.rpc import CONNECT_PATIENCE_S, Connection, connect_timeout

TIMEOUT_S = 20.0


@pytest.fixture
def cut_off() -> Iterator[str]:
    """An address whose new connections are never answered: a listener with its one queued
    connection never accepted, so the kernel drops every further SYN."""
    with socket.create_server(("127.0.0.1", 0), backlog=0) as server:
        address = server.getsockname()
        held = []
        try:
            for _ in range(4):  # fill the accept queue until a connect no longer completes
                sock = socket.socket()
                sock.settimeout(0.3)
                try:
                    sock.connect(address)
                except OSError:
                    sock.close()
                    break
                held.append(sock)
            yield f"127.0.0.1:{address[1]}"
        finally:
            for sock in held:
                sock.close()


def test_the_bound_is_the_patience_or_the_connections_own_never_past_the_timeout() -> None:
    assert connect_timeout(10.0, 0.0) == 10.0
    assert connect_timeout(10.0, 0.05) == CONNECT_PATIENCE_S
    assert connect_timeout(10.0, 2.0) == 2.0
    assert connect_timeout(0.08, 0.05) == 0.08


def test_a_blocking_request_with_patience_gives_a_cut_off_peer_up_at_the_connection(cut_off: str) -> None:
    conn = Connection(cut_off, timeout=TIMEOUT_S)
    try:
        began = time.monotonic()
        with pytest.raises(Timeout, match="connecting"):
            conn.call(Stats(), OkReply, patience=0.05)
        assert time.monotonic() - began < TIMEOUT_S / 2  # the connection's bound, not the timeout
    finally:
        conn.close()


def test_an_async_request_with_patience_gives_a_cut_off_peer_up_at_the_connection(cut_off: str) -> None:
    async def run() -> None:
        link = AsyncLink(cut_off, timeout=TIMEOUT_S)
        began = time.monotonic()
        with pytest.raises(Timeout, match="connecting"):
            await link.request(Stats(), OkReply, patience=0.05)
        assert time.monotonic() - began < TIMEOUT_S / 2
        await link.close()

    asyncio.run(run())


def test_without_patience_the_connection_waits_the_timeout(cut_off: str) -> None:
    conn = Connection(cut_off, timeout=1.0)
    try:
        with pytest.raises(Timeout, match="connecting"):
            conn.call(Stats(), OkReply)
    finally:
        conn.close()
