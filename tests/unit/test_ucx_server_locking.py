"""The UCX server's reads and writes share one event loop: a write must never block that loop on
the storage lock while a read on the same loop holds it across an await (a slow reader's send),
or neither ever finishes. Driven with in-memory endpoints: no UCX library needed."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np

from kvstore.keys import BlockKey, checksum
from kvstore.protocol import ReadBlocks, WriteBlocks
from server.daemon.storage import DaemonStorage
from transfer.transports.ucx import UcxServer

KB = 1024


class _SlowReader:
    """An endpoint whose peer takes its time: every send of a block's bytes waits for ``go``."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.sending = asyncio.Event()

    async def send(self, buf: Any) -> None:
        if isinstance(buf, memoryview):
            self.sending.set()
            await self.go.wait()


class _Writer:
    """An endpoint that sends one block's bytes and takes the reply."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.replies = 0

    async def recv(self, target: Any) -> None:
        np.frombuffer(target, dtype=np.uint8)[:] = np.frombuffer(self.data, dtype=np.uint8)

    async def send(self, buf: Any) -> None:
        self.replies += 1


def _server(storage: DaemonStorage) -> UcxServer:
    server = object.__new__(UcxServer)  # its request handlers alone: no listener, no UCX library
    server.storage = storage
    server.port = 0
    server._count = lambda *args: None
    return server


def test_a_write_does_not_block_the_loop_a_slow_read_holds_the_lock_on(storage: DaemonStorage) -> None:
    [view] = storage.begin_writes([(BlockKey("held"), 0, 4 * KB)])
    assert isinstance(view, memoryview)
    view[:] = b"h" * 4 * KB
    assert storage.finish_writes([(BlockKey("held"), view, checksum(b"h" * 4 * KB))]) == [None]
    server = _server(storage)
    data = b"w" * 4 * KB
    reader, writer = _SlowReader(), _Writer(data)

    async def main() -> None:
        read = asyncio.create_task(server._read(reader, ReadBlocks(["held"], ["dram"], [0], [4 * KB]), 1))
        await reader.sending.wait()  # the read holds the lock, waiting for its peer
        write = asyncio.create_task(
            server._write(writer, WriteBlocks(["new"], [8 * KB], [4 * KB], [checksum(data)], False), 2)
        )
        await asyncio.sleep(0.05)
        reader.go.set()  # the peer reads on: possible only while the loop still runs
        await asyncio.wait_for(asyncio.gather(read, write), 10)

    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(main())
        except BaseException as exc:
            failure.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    assert done.wait(15), "the UCX loop hung: a write blocked it on the lock a read on it held"
    assert not failure, failure
    assert writer.replies == 2 and storage.holds(BlockKey("new"))
