"""AsyncLink's patience against a peer that takes no bytes (a frozen daemon, as TCP sees one: the
connection accepted by the kernel, nothing read): a request with patience is given up alone within
about it, even behind a megabyte of queued payload, and the link survives; one without waits the
link's timeout, which fails the link."""

from __future__ import annotations

import asyncio
import gc
import socket
import time
from collections.abc import Iterator

import pytest

from kvstore.errors import ConnectionFailed, Timeout
from kvstore.protocol import OkReply, WriteBlocks, decode_payload, encode
from transfer.aio import read_payload
from transfer.link import AsyncLink

MiB = 1 << 20


@pytest.fixture
def frozen() -> Iterator[str]:
    """A listening socket whose connections are accepted (by the kernel's backlog) and never read."""
    with socket.create_server(("127.0.0.1", 0), backlog=8) as server:
        yield f"127.0.0.1:{server.getsockname()[1]}"


def test_a_request_with_patience_is_given_up_behind_a_full_buffer_and_the_link_lives(frozen: str) -> None:
    async def run() -> None:
        link = AsyncLink(frozen, timeout=20.0)
        big = WriteBlocks(["k"], [0], [8 * MiB], [0], False)
        began = time.monotonic()
        with pytest.raises(Timeout, match="no reply began"):
            await link.request(big, OkReply, [bytes(8 * MiB)], patience=0.2)
        with pytest.raises(Timeout, match="no reply began"):  # the same link, not failed
            await link.request(big, OkReply, [bytes(MiB)], patience=0.2)
        assert time.monotonic() - began < 10.0  # half the link's timeout: only a wait for it fails this
        assert link._writer is not None and not link._writer.is_closing()
        await link.close()

    asyncio.run(run())


def test_a_request_queued_behind_others_replies_is_not_given_up_while_they_come() -> None:
    """A daemon answers one connection's requests one after another, each in 60 ms: the fifth of five
    sent at once is answered 300 ms later, past its 100 ms patience, though the node never went
    quiet. Each reply starts the patience again (the old link gave up all but the first: with one
    copy of each block, every give-up cost the master a question and the daemon its work)."""

    async def run() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while (payload := await read_payload(reader)) is not None:
                request_id, _ = decode_payload(payload)
                await asyncio.sleep(0.06)
                writer.write(encode(OkReply(), request_id))

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        link = AsyncLink(f"127.0.0.1:{server.sockets[0].getsockname()[1]}", timeout=20.0)
        replies = await asyncio.gather(
            *(link.request(OkReply(), OkReply, patience=0.1) for _ in range(5)), return_exceptions=True
        )
        assert replies == [(OkReply(), b"")] * 5
        await link.close()
        server.close()
        await server.wait_closed()

    asyncio.run(run())


def test_a_request_without_patience_waits_the_links_timeout_and_fails_it(frozen: str) -> None:
    async def run() -> None:
        link = AsyncLink(frozen, timeout=1.0)
        with pytest.raises(Timeout, match=r"no reply within 1\.0 s"):
            await link.request(WriteBlocks(["k"], [0], [8 * MiB], [0], False), OkReply, [bytes(8 * MiB)])
        await link.close()

    asyncio.run(run())


def test_a_failed_connections_reader_ends_with_it_when_the_link_reconnects(
    frozen: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A link failed by a timeout with bytes still queued for the peer (frozen: it reads nothing)
    connects anew for its next request. The old connection's reader task must end then, not be left
    pending until the collector destroys it ("Task was destroyed but it is pending", which bench.chaos's
    clients logged after client cuts), and a request failed with its link raises its error once
    (no "Future exception was never retrieved")."""

    async def run() -> None:
        link = AsyncLink(frozen, timeout=0.5)
        big = WriteBlocks(["k"], [0], [8 * MiB], [0], False)
        with pytest.raises(Timeout, match="no reply within"):
            await link.request(big, OkReply, [bytes(8 * MiB)])
        old = link._reader_task
        assert old is not None
        with pytest.raises(Timeout):
            await link.request(big, OkReply, [bytes(MiB)])
        await asyncio.sleep(0.1)
        assert old.done(), "the failed connection's reader task is still pending"
        await link.close()

    asyncio.run(run())
    gc.collect()
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def test_a_closed_link_connects_no_more_and_leaves_no_reader(frozen: str, caplog: pytest.LogCaptureFixture) -> None:
    """A link replaced (a new leader's) is closed while requests that took it before are still to
    send: they fail as unreachable (and go to the new link), never connect the old one anew: that
    made a connection and a reader task nobody closed, destroyed pending with the link (bench.chaos's
    hour run logged four "Task was destroyed but it is pending" of AsyncLink._read_replies)."""

    async def run() -> None:
        link = AsyncLink(frozen, timeout=5.0)
        small = WriteBlocks(["k"], [0], [4], [0], False)
        with pytest.raises(Timeout, match="no reply began"):
            await link.request(small, OkReply, [bytes(4)], patience=0.1)
        await link.close()
        with pytest.raises(ConnectionFailed, match="is closed"):
            await link.request(small, OkReply, [bytes(4)], patience=0.1)
        assert link._writer is None and not link._readers

    asyncio.run(run())
    gc.collect()
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]
