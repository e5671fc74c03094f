"""The batching of the asyncio client's gets by key per node (:class:`ReadBatcher`), over that
node's pipelined connection (:class:`transfer.link.AsyncLink`)."""

from __future__ import annotations

import asyncio

from kvstore.errors import ProtocolError
from kvstore.protocol import ReadReply
from kvstore_client.effects import read_by_key_message
from transfer.link import BACKGROUND, AsyncLink


class ReadBatcher:
    """Gets of one node issued in the same turn of the event loop, sent as one ReadBlocks by key."""

    def __init__(self, link: AsyncLink, patience: float = 0.0) -> None:
        """``patience``: as :meth:`AsyncLink.request`'s, for each batch."""
        self.link = link
        self.patience = patience
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
        BACKGROUND.add(task)
        task.add_done_callback(BACKGROUND.discard)

    async def _send(self, batch: list[tuple[str, asyncio.Future[tuple[int, int, memoryview] | None]]]) -> None:
        keys = [k for k, _ in batch]
        try:
            reply, data = await self.link.request(read_by_key_message(keys), ReadReply, patience=self.patience)
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
