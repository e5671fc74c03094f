"""The UCX data plane, on UCXX (``pip install kvstore[ucx]``; without it kvstore runs on tcp and shm).

Same frames as the tcp data plane, carried as tagged UCX messages on one
endpoint: a u64 frame length, the frame, then one message per block, each
sent from and received into the block's own buffer (arena extents, LMDB's
map, the caller's array) with no staging copy. UCX picks its transports;
on RDMA hosts that is verbs (rc/dc/ud), elsewhere TCP.

Settings, measured here between two processes on loopback (4 MiB echo,
raw Python sockets ~3-5 GB/s on the same machine):

- ``UCX_TCP_TX_SEG_SIZE``/``UCX_TCP_RX_SEG_SIZE`` = 1M: UCX's 8 KiB default
  segments cost a progress round per segment: 0.56 -> 1.43 GB/s.
- ``UCXPY_PROGRESS_MODE=blocking``: progress on the event loop, woken by the
  worker's event fd, instead of a progress thread: 1.43 -> 2.98 GB/s ("thread"
  mode made the store's 1 MiB gets 4x slower than tcp; "polling" reached
  4.8 GB/s but spins a core forever). UCXX 0.52 never re-arms the worker in
  this mode, so a client spun a core after its first transfer: see
  :func:`_rearm_blocking_progress`. A daemon still spins one core while a UCX
  client is connected (its posted receive keeps the worker busy), which is why
  the daemon serves UCX only when asked (``--ucx-port``).
- ``UCX_TLS=tcp,self`` on hosts without an RDMA device (UCX's own choice on
  loopback was slower: 0.45 GB/s).

Each is only a default: a variable already set in the environment wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any, TypeVar

import numpy as np

from kvstore.errors import ConnectionFailed, InvalidArgument, KVStoreError, ProtocolError, Timeout
from kvstore.keys import validate_key
from kvstore.protocol import (
    MAX_FRAME_BYTES,
    ErrorReply,
    Message,
    ReadBlocks,
    ReadReply,
    WriteBlocks,
    WriteReply,
    decode_payload,
    encode,
)
from transfer import topology
from transfer.wire import parse_address

log = logging.getLogger("kvstore.transfer.ucx")

T = TypeVar("T")


def available() -> bool:
    """Whether UCXX is installed (importing it is deferred: it loads UCX)."""
    return importlib.util.find_spec("ucxx") is not None


def tune_environment() -> dict[str, str]:
    """Set the measured defaults (see the module docstring) where the environment has none; returns them."""
    defaults = {
        "UCX_TCP_TX_SEG_SIZE": "1M",
        "UCX_TCP_RX_SEG_SIZE": "1M",
        "UCXPY_PROGRESS_MODE": "blocking",
        "UCX_WARN_UNUSED_ENV_VARS": "n",
    }
    if not topology.has_rdma():
        defaults["UCX_TLS"] = "tcp,self"
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in defaults}


def _import_ucxx() -> Any:
    if not available():
        raise InvalidArgument("the ucx transport needs UCXX: pip install 'kvstore[ucx]' (ucxx-cu12)")
    tune_environment()
    import ucxx

    _rearm_blocking_progress()
    return ucxx


def _rearm_blocking_progress() -> None:
    """Make UCXX's blocking progress mode sleep when idle.

    UCXX 0.52's ``BlockingMode`` progresses the worker when its epoll fd fires
    but never arms the worker again, so the fd stays readable and the event
    loop spins a core for good after the first transfer (measured: a daemon
    and a client each at 99% CPU while idle). ucx-py re-armed there; so do we.
    """
    from ucxx._lib_async.continuous_ucx_progress import BlockingMode

    if getattr(BlockingMode, "_kvstore_rearms", False):
        return

    def fd_reader_callback(self: Any) -> None:
        self.worker.progress()
        if self.arm_task is None or self.arm_task.done():
            self.arm_task = self.event_loop.create_task(self._arm_worker())

    BlockingMode._fd_reader_callback = fd_reader_callback
    BlockingMode._kvstore_rearms = True


class _LoopThread:
    """An asyncio loop in a daemon thread, for UCXX (which is asyncio-only) under blocking callers."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise Timeout(f"UCX operation took more than {timeout} s") from None

    def stop(self) -> None:
        """Cancel what still runs on the loop (UCXX's progress tasks too), then stop it."""

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(KVStoreError):  # a task that would not end: stop the loop anyway
            self.run(cancel_all(), 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


async def _send_frame(ep: Any, message: Message, request_id: int) -> None:
    frame = encode(message, request_id)
    await ep.send(np.array([len(frame)], dtype=np.uint64))
    await ep.send(np.frombuffer(frame, dtype=np.uint8))


async def _recv_frame(ep: Any) -> tuple[int, Message]:
    head = np.empty(1, dtype=np.uint64)
    await ep.recv(head)
    length = int(head[0])
    if not 4 < length <= MAX_FRAME_BYTES + 4:
        raise ProtocolError(f"UCX frame of {length} bytes is out of bounds")
    frame = np.empty(length, dtype=np.uint8)
    await ep.recv(frame)
    return decode_payload(frame.tobytes()[4:])


class UcxServer:
    """A daemon's UCX listener: ReadBlocks and WriteBlocks against its storage."""

    def __init__(self, storage: Any, port: int = 0, count: Callable[[str, str, str, int], None] | None = None) -> None:
        self._ucxx = _import_ucxx()
        self.storage = storage
        self._count = count or (lambda transport, rail, direction, nbytes: None)
        self._thread = _LoopThread("daemon-ucx")
        self._listener: Any = None
        self.port = self._thread.run(self._start(port), 30)

    async def _start(self, port: int) -> int:
        self._listener = self._ucxx.create_listener(self._serve, port)
        return int(self._listener.port)

    async def _serve(self, ep: Any) -> None:
        try:
            while True:
                request_id, message = await _recv_frame(ep)
                try:
                    if isinstance(message, ReadBlocks):
                        await self._read(ep, message, request_id)
                    elif isinstance(message, WriteBlocks):
                        await self._write(ep, message, request_id)
                    else:
                        raise ProtocolError(f"the UCX data plane does not serve {type(message).__name__}")
                except KVStoreError as exc:
                    if isinstance(exc, ConnectionFailed):
                        raise
                    await _send_frame(ep, ErrorReply.from_error(exc), request_id)
        except Exception as exc:  # the peer closed or broke the stream: this endpoint is done
            log.debug("UCX endpoint closed: %s", exc)
        finally:
            if not ep.closed:
                ep.abort()

    async def _read(self, ep: Any, msg: ReadBlocks, request_id: int) -> None:
        keys = [validate_key(k) for k in msg.keys]
        sums: list[int] = []
        with self.storage.read_views(keys, sums, asked=(msg.offsets, msg.sizes)) as views:  # checks their lengths
            sizes = [-1 if v is None else v.nbytes for v in views]
            await _send_frame(ep, ReadReply(sizes, sums), request_id)
            for view in views:
                if view is not None:
                    await ep.send(view)
            self._count("ucx", f":{self.port}", "out", sum(v.nbytes for v in views if v is not None))

    async def _write(self, ep: Any, msg: WriteBlocks, request_id: int) -> None:
        keys = [validate_key(k) for k in msg.keys]
        # The storage's exclusive steps run in a worker thread: on this loop they could wait for the
        # shared lock a read on this same loop holds across its sends, and neither would go on.
        try:
            batch = await asyncio.to_thread(  # a two-trip put's: unconfirmed until the master vouches
                partial(self.storage.write_batch, confirmed=False, write_ids=msg.write_ids), keys, msg.offsets,
                msg.sizes, msg.checksums, msg.pinned,
            )  # fmt: skip
        except InvalidArgument as exc:
            raise ConnectionFailed(f"WriteBlocks: {exc}") from None  # the payload is unknowable
        try:
            for target in batch.targets:
                await ep.recv(target)
        except BaseException:
            await asyncio.to_thread(batch.abort)
            raise
        self._count("ucx", f":{self.port}", "in", sum(msg.sizes))
        await _send_frame(ep, WriteReply.from_outcomes(await asyncio.to_thread(batch.finish)), request_id)

    def stop(self) -> None:
        async def close() -> None:
            if self._listener is not None:
                self._listener.close()

        try:
            self._thread.run(close(), 5)
        finally:
            self._thread.stop()


class UcxClient:
    """Blocking UCX calls to daemons: one endpoint per daemon, one call at a time on each."""

    def __init__(self, timeout: float) -> None:
        self._ucxx = _import_ucxx()
        self.timeout = timeout
        self._thread = _LoopThread("kvstore-ucx")
        self._endpoints: dict[str, tuple[Any, asyncio.Lock]] = {}
        self._ids = iter(range(1, 1 << 62))

    async def _endpoint(self, address: str) -> tuple[Any, asyncio.Lock]:
        known = self._endpoints.get(address)
        if known is not None and not known[0].closed:
            return known
        host, port = parse_address(address)
        try:
            ep = await self._ucxx.create_endpoint(host, port)
        except Exception as exc:
            raise ConnectionFailed(f"UCX connect to {address}: {exc}") from None
        entry = (ep, asyncio.Lock())
        self._endpoints[address] = entry
        return entry

    async def _call(
        self, address: str, message: Message, payload: Sequence[memoryview], views: Sequence[memoryview]
    ) -> Message:
        ep, lock = await self._endpoint(address)
        async with lock:
            try:
                request_id = next(self._ids)
                await _send_frame(ep, message, request_id)
                for buffer in payload:
                    await ep.send(buffer)
                reply_id, reply = await _recv_frame(ep)
                if reply_id != request_id:
                    raise ProtocolError(f"UCX reply to request {reply_id}, expected {request_id}")
                if isinstance(reply, ErrorReply):
                    raise reply.to_error()
                if isinstance(reply, ReadReply):
                    if len(reply.sizes) != len(views):
                        raise ProtocolError(f"{address} answered {len(reply.sizes)} sizes for {len(views)} reads")
                    for size, view in zip(reply.sizes, views, strict=True):
                        if size >= 0:
                            # A block of another size than the master said is a stale copy: taken and dropped.
                            await ep.recv(view[:size] if size <= view.nbytes else np.empty(size, dtype=np.uint8))
                return reply
            except KVStoreError:
                raise
            except asyncio.CancelledError:
                ep.abort()
                self._endpoints.pop(address, None)
                raise
            except Exception as exc:
                ep.abort()
                self._endpoints.pop(address, None)
                raise ConnectionFailed(f"UCX {type(message).__name__} to {address}: {exc}") from None

    def read(self, address: str, keys: list[str], sizes: list[int], views: list[memoryview]) -> list[int | None]:
        """Read blocks into ``views``; per block its size, or None when the daemon does not hold it as described."""
        message = ReadBlocks(keys, ["dram"] * len(keys), [0] * len(keys), sizes)
        reply = self._thread.run(self._call(address, message, (), views), self.timeout)
        assert isinstance(reply, ReadReply)
        return [n if n >= 0 and n == want else None for n, want in zip(reply.sizes, sizes, strict=True)]

    def write(self, message: WriteBlocks, address: str, payload: list[memoryview]) -> WriteReply:
        reply = self._thread.run(self._call(address, message, payload, ()), self.timeout)
        if not isinstance(reply, WriteReply):
            raise ProtocolError(f"WriteBlocks over UCX got {type(reply).__name__}")
        return reply

    def close(self) -> None:
        async def close_all() -> None:
            for ep, _ in self._endpoints.values():
                if not ep.closed:
                    ep.abort()
            self._endpoints.clear()

        try:
            self._thread.run(close_all(), 5)
        finally:
            self._thread.stop()
