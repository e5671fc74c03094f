"""One-sided transfers (RMA) on host memory against the native TCP loop, between two processes (issue 39).

A target process maps an arena like the daemon's (a MAP_SHARED|MAP_POPULATE mapping of a /dev/shm file),
serves it with one transport, and an initiator process puts blocks into it and gets them back: per call
``batch`` blocks of ``size`` bytes, each call timed to completion. One JSON line per (transport, op, size,
batch) with ``GBps``, ``ops`` (blocks/s), ``p50_us``/``p99_us`` per call, ``target_cpu_pct`` (the target
process's CPU time over the row, all its threads) and ``verified``, beside the same run's native TCP row
as ``baseline_GBps`` and ``ratio``.

Transports (``--transports``; ``native_tcp`` always runs, first, as the baseline):

- ``native_tcp``: the project's native loops (``send_buffers``/``recv_parts``): a request header, then the
  blocks; the target's loop receives them straight into the arena's slots and acks a put with one byte,
  or sends a get's blocks from the slots.
- ``python_tcp``: the same exchange with plain sockets (sendall/recv_into), as bench/cluster.py's RawTcp.
- ``nixl_ucx``: NIXL's UCX backend, one-sided. The target registers the arena and then only waits on its
  control pipe: NIXL's progress thread serves it. The initiator's put is a WRITE and its get a READ of a
  descriptor list (one descriptor per block), one transfer request per call (``initialize_xfer``,
  ``transfer``, ``check_xfer_state`` until DONE, release). The initiator runs no progress thread (its
  ``check_xfer_state`` progresses its worker). NIXL's Python API starts the target's progress thread with
  no delay between rounds; ``--nixl-progress-delay-us`` sets one.
- ``ucxx_tag`` and ``ucxx_tag_no_eh``: UCXX, two-sided: UCXX's Python API has no memory registration,
  remote key or put/get (its C++ library has them), so these are tagged send/receive, the target's
  Python thread posting each block's receive or send into/from the arena. ``ucxx_tag`` creates its
  endpoints with UCX's peer error handling (as kvstore's UCX transport does), ``ucxx_tag_no_eh``
  without it (UCX then may use shared memory and CMA where it otherwise uses TCP). Both sides progress
  their worker in blocking mode (an epoll wait on the worker's event fd).

Bytes are checked per row: after the puts, the target hashes every window the puts wrote (xxh3-64, over
its control pipe) against the source blocks; after the gets, the initiator compares what the last get
read with the source. A call's blocks go to slots ``windows`` apart (no two of its blocks adjacent in
the arena), call ``c`` to window ``c % windows``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import mmap
import multiprocessing as mp
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash

from kvstore.config import parse_size
from transfer import native
from transfer.wire import set_timeouts

TRANSPORTS = ["native_tcp", "python_tcp", "nixl_ucx", "ucxx_tag", "ucxx_tag_no_eh"]
ONE_SIDED = {"nixl_ucx"}
SIZES = [4 * 1024, 64 * 1024, 1024 * 1024]
WINDOWS = 8
"""At most this many windows of slots per (size, batch): calls rotate over them."""
TIMEOUT = 30.0
"""Every wait on the network or on the other process, in seconds."""
_HEAD = struct.Struct("!cxxxIII")  # op (b"p" put, b"g" get), block size, blocks, window
_HDR_TAG, _ACK_TAG, _DATA_TAG = 1, 2, 16
_SHM = Path("/dev/shm")


# ---------------------------------------------------------------------------------------------------------
# The arena and its slots


def _windows(arena_bytes: int, size: int, batch: int) -> int:
    return min(WINDOWS, arena_bytes // size // batch)


def _slot_index(block: int, window: int, windows: int) -> int:
    return block * windows + window


def _slots(arena: np.ndarray, size: int, batch: int, window: int, windows: int) -> np.ndarray:
    """The (batch, size) view of one window's slots: block j in slot j * windows + window."""
    grid = arena[: arena.nbytes // size * size].reshape(-1, size)
    return grid[window : window + batch * windows : windows]


def _digest(blocks: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(blocks).data)


class _Arena:
    """A MAP_SHARED|MAP_POPULATE mapping of a fresh tmpfs file (unlinked once mapped), as the daemon maps its arena."""

    def __init__(self, path: Path, nbytes: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
        self.array = np.frombuffer(self.mm, dtype=np.uint8)
        self.address = self.array.ctypes.data


# ---------------------------------------------------------------------------------------------------------
# Target side: one server per transport (threads or the transport's own progress thread), and a control loop


def _nixl_api() -> Any:
    """NIXL's Python API: ``nixl_cu12`` (the wheel ``nixl-cu12`` installs), else ``nixl``."""
    for name in ("nixl_cu12._api", "nixl._api"):
        with contextlib.suppress(ImportError):
            return importlib.import_module(name)
    raise ImportError("NIXL is not installed (pip install nixl-cu12)")


def _nixl_available() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ("nixl_cu12", "nixl"))


def _nixl_progress_delay(api: Any, delay_us: int) -> None:
    """Make the agents created from now on wait ``delay_us`` between progress rounds. nixl_agent sets the
    binding's ``pthrDelay`` to 0 and offers no parameter, so its config class is swapped for one that
    keeps ``delay_us``."""
    base = api.nixlBind.nixlAgentConfig

    class DelayedConfig(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, delay_us if name == "pthrDelay" else value)

    api.nixlBind.nixlAgentConfig = DelayedConfig


def _serve_nixl(arena: _Arena, opts: dict[str, Any], keep: list[Any]) -> dict[str, Any]:
    api = _nixl_api()
    if opts["nixl_progress_delay_us"]:
        _nixl_progress_delay(api, opts["nixl_progress_delay_us"])
    agent = api.nixl_agent("kvstore-target", api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise RuntimeError(f"NIXL has no UCX backend here (plugins: {agent.get_plugin_list()})")
    keep.append(agent)
    keep.append(agent.register_memory([(arena.address, arena.array.nbytes, 0, "")], "DRAM", backends=["UCX"]))
    return {"metadata": agent.get_agent_metadata(), "address": arena.address}


def _check_head(arena: _Arena, size: int, batch: int, window: int) -> int:
    windows = _windows(arena.array.nbytes, size, batch) if size and batch else 0
    if not windows or window >= windows:
        raise ValueError(f"a request the arena cannot hold: {batch} x {size} B, window {window}")
    return windows


def _serve_tcp(arena: _Arena, use_native: bool) -> dict[str, Any]:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(TIMEOUT)
    loops: Any = native.lib

    def serve() -> None:
        conn, _ = server.accept()
        server.close()
        if use_native:
            set_timeouts(conn, TIMEOUT)  # blocking, with kernel timeouts: what the native loops need
        else:
            conn.settimeout(TIMEOUT)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = bytearray(_HEAD.size)
        views: dict[tuple[int, int, int], list[memoryview]] = {}
        while True:
            try:
                if use_native:
                    loops.recv_parts(conn.fileno(), (memoryview(head),), False)
                elif conn.recv_into(head, _HEAD.size, socket.MSG_WAITALL) < _HEAD.size:
                    return
            except (BlockingIOError, TimeoutError):
                continue  # idle between rows
            except (EOFError, OSError):
                return
            op, size, batch, window = _HEAD.unpack(head)
            key = (size, batch, window)
            if key not in views:
                windows = _check_head(arena, size, batch, window)
                views[key] = [memoryview(row) for row in _slots(arena.array, size, batch, window, windows)]
            slots = views[key]
            if use_native:
                if op == b"p":
                    loops.recv_parts(conn.fileno(), tuple(slots), False)
                    loops.send_buffers(conn.fileno(), (b"k",))
                else:
                    loops.send_buffers(conn.fileno(), tuple(slots))
            elif op == b"p":
                for view in slots:
                    got = 0
                    while got < view.nbytes:
                        n = conn.recv_into(view[got:])
                        if not n:
                            return
                        got += n
                conn.sendall(b"k")
            else:
                for view in slots:
                    conn.sendall(view)

    threading.Thread(target=serve, name="tcp-target", daemon=True).start()
    return {"port": server.getsockname()[1]}


def _ucxx_wait(worker: Any, requests: list[Any], timeout: float | None = TIMEOUT) -> None:
    """Progress ``worker`` (blocking mode: epoll on its event fd, 100 ms at a time) until every request is done."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for request in requests:
        while not request.completed:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"a UCX request took more than {timeout} s")
            worker.progress_worker_event(100)
        request.check_error()


def _serve_ucxx(arena: _Arena, error_handling: bool) -> dict[str, Any]:
    """Two-sided: a Python thread owns the worker, receives each request's header, then posts one
    receive (put) or send (get) per block on the arena's slots."""
    ready: list[Any] = []
    started = threading.Event()

    def serve() -> None:
        try:
            ucp = importlib.import_module("ucxx._lib.libucxx")
            array = importlib.import_module("ucxx._lib.arr").Array
            worker = ucp.UCXWorker(ucp.UCXContext(feature_flags=(ucp.Feature.TAG, ucp.Feature.WAKEUP)))
            worker.init_blocking_progress_mode()
            endpoints: list[Any] = []
            listener: list[Any] = []

            def accept(request: Any) -> None:
                endpoints.append(listener[0].create_endpoint_from_conn_request(request, error_handling))

            listener.append(ucp.UCXListener.create(worker, 0, accept))
            ready.append(listener[0].port)
        except Exception as exc:
            ready.append(exc)
            raise
        finally:
            started.set()
        deadline = time.monotonic() + TIMEOUT
        while not endpoints and time.monotonic() < deadline:
            worker.progress_worker_event(100)
        if not endpoints:
            return
        ep = endpoints[0]
        head = np.zeros(4, dtype=np.uint64)  # op (0 put, 1 get), block size, blocks, window
        head_arr, ack = array(head), array(np.ones(1, dtype=np.uint8))
        arrays: dict[tuple[int, int, int], list[Any]] = {}
        while True:
            try:
                _ucxx_wait(worker, [ep.tag_recv(head_arr, ucp.UCXXTag(_HDR_TAG))], timeout=None)
            except Exception:
                return  # the initiator went away
            op, size, batch, window = (int(x) for x in head)
            key = (size, batch, window)
            if key not in arrays:
                windows = _check_head(arena, size, batch, window)
                arrays[key] = [array(row) for row in _slots(arena.array, size, batch, window, windows)]
            if op == 0:
                recvs = [ep.tag_recv(a, ucp.UCXXTag(_DATA_TAG + j)) for j, a in enumerate(arrays[key])]
                _ucxx_wait(worker, recvs)
                _ucxx_wait(worker, [ep.tag_send(ack, ucp.UCXXTag(_ACK_TAG))])
            else:
                _ucxx_wait(worker, [ep.tag_send(a, ucp.UCXXTag(_DATA_TAG + j)) for j, a in enumerate(arrays[key])])

    threading.Thread(target=serve, name="ucxx-target", daemon=True).start()
    if not started.wait(TIMEOUT) or not ready:
        raise TimeoutError("the UCXX listener did not start")
    if isinstance(ready[0], Exception):
        raise ready[0]
    return {"port": ready[0]}


def _target_main(kind: str, ctl: Connection, path: str, arena_bytes: int, opts: dict[str, Any]) -> None:
    """The target process: map the arena, start ``kind``'s server, send its connection details, then only
    answer control requests (reset, digests, CPU time) until told to stop or its parent is gone."""
    os.dup2(2, 1)  # what UCX and NIXL print (UCX_PROTO_INFO's tables, say) goes to stderr: stdout is JSON lines
    parent = os.getppid()
    keep: list[Any] = []
    try:
        arena = _Arena(Path(path), arena_bytes)
        if kind == "nixl_ucx":
            info = _serve_nixl(arena, opts, keep)
        elif kind in ("native_tcp", "python_tcp"):
            info = _serve_tcp(arena, use_native=kind == "native_tcp")
        else:
            info = _serve_ucxx(arena, error_handling=kind == "ucxx_tag")
        ctl.send(info)
        while True:
            if not ctl.poll(1.0):
                if os.getppid() != parent:
                    break
                continue
            msg = ctl.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "cpu":
                ctl.send(time.process_time())
                continue
            _, size, batch, count = msg
            windows = _windows(arena_bytes, size, batch)
            if msg[0] == "reset":
                for w in range(windows):
                    _slots(arena.array, size, batch, w, windows)[:] = 0
                ctl.send(True)
            else:  # digests of the first ``count`` windows
                ctl.send([_digest(_slots(arena.array, size, batch, w, windows)) for w in range(count)])
    except Exception as exc:
        with contextlib.suppress(OSError):
            ctl.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        # os._exit: NIXL's bundled libraries crash in their exit handlers here (libnl-route's destructor,
        # loaded with UCX's InfiniBand module), after everything is done; no cleanup is owed.
        os._exit(0)


# ---------------------------------------------------------------------------------------------------------
# Initiator side


class Client(Protocol):
    def prepare(self, size: int, batch: int, windows: int, src: np.ndarray, dst: np.ndarray) -> None: ...

    def put(self, window: int) -> None: ...

    def get(self, window: int) -> None: ...


def _block_descs(addresses: list[int], size: int) -> np.ndarray:
    descs = np.zeros((len(addresses), 3), dtype=np.uint64)
    descs[:, 0] = addresses
    descs[:, 1] = size
    return descs


class NixlClient:
    """WRITE (put) and READ (get) of one descriptor per block, one transfer request per call."""

    def __init__(self, info: dict[str, Any], local: np.ndarray) -> None:
        api = _nixl_api()
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent = api.nixl_agent("kvstore-initiator", config)
        self.registered = self.agent.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
        self.remote = self.agent.add_remote_agent(info["metadata"])
        self.agent.make_connection(self.remote)
        self.base = int(info["address"])
        self.descs: dict[str, Any] = {}
        self.windows: list[Any] = []

    def prepare(self, size: int, batch: int, windows: int, src: np.ndarray, dst: np.ndarray) -> None:
        def local(blocks: np.ndarray) -> Any:
            return self.agent.get_xfer_descs(_block_descs([row.ctypes.data for row in blocks], size), "DRAM")

        self.descs = {"WRITE": local(src), "READ": local(dst)}
        self.windows = []
        for w in range(windows):
            addresses = [self.base + _slot_index(j, w, windows) * size for j in range(batch)]
            self.windows.append(self.agent.get_xfer_descs(_block_descs(addresses, size), "DRAM"))

    def _xfer(self, op: str, window: int) -> None:
        handle = self.agent.initialize_xfer(op, self.descs[op], self.windows[window], self.remote)
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + TIMEOUT
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a NIXL {op} took more than {TIMEOUT} s")
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL {op}: {state}")
        finally:
            handle.release()

    def put(self, window: int) -> None:
        self._xfer("WRITE", window)

    def get(self, window: int) -> None:
        self._xfer("READ", window)


class TcpClient:
    """The request/reply exchange of the TCP targets: native loops or plain sockets."""

    def __init__(self, info: dict[str, Any], use_native: bool) -> None:
        self.sock = socket.create_connection(("127.0.0.1", info["port"]), timeout=TIMEOUT)
        self.native = use_native
        if use_native:
            set_timeouts(self.sock, TIMEOUT)
        else:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.fd = self.sock.fileno()
        self.loops: Any = native.lib
        self.ack = bytearray(1)
        self.size = self.batch = 0
        self.src: list[memoryview] = []
        self.dst: list[memoryview] = []
        self.src_all = self.dst_all = memoryview(b"")

    def prepare(self, size: int, batch: int, windows: int, src: np.ndarray, dst: np.ndarray) -> None:
        self.size, self.batch = size, batch
        self.src, self.dst = [memoryview(row) for row in src], [memoryview(row) for row in dst]
        self.src_all, self.dst_all = src.reshape(-1).data, dst.reshape(-1).data

    def _recv(self, view: memoryview) -> None:
        got = 0
        while got < view.nbytes:
            n = self.sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("the target closed the connection")
            got += n

    def put(self, window: int) -> None:
        head = _HEAD.pack(b"p", self.size, self.batch, window)
        if self.native:
            self.loops.send_buffers(self.fd, (head, *self.src))
            self.loops.recv_parts(self.fd, (memoryview(self.ack),), False)
        else:
            self.sock.sendall(head)
            self.sock.sendall(self.src_all)
            self._recv(memoryview(self.ack))

    def get(self, window: int) -> None:
        head = _HEAD.pack(b"g", self.size, self.batch, window)
        if self.native:
            self.loops.send_buffers(self.fd, (head,))
            self.loops.recv_parts(self.fd, tuple(self.dst), False)
        else:
            self.sock.sendall(head)
            self._recv(self.dst_all)


class UcxxClient:
    """Two-sided: a header, then one tagged send (put) or receive (get) per block; a put waits for the ack."""

    def __init__(self, info: dict[str, Any], error_handling: bool) -> None:
        self.ucp = importlib.import_module("ucxx._lib.libucxx")
        self.array = importlib.import_module("ucxx._lib.arr").Array
        self.worker = self.ucp.UCXWorker(
            self.ucp.UCXContext(feature_flags=(self.ucp.Feature.TAG, self.ucp.Feature.WAKEUP))
        )
        self.worker.init_blocking_progress_mode()
        self.ep = self.ucp.UCXEndpoint.create(self.worker, "127.0.0.1", info["port"], error_handling)
        self.head = np.zeros(4, dtype=np.uint64)
        self.head_arr, self.ack = self.array(self.head), self.array(np.zeros(1, dtype=np.uint8))
        self.src: list[Any] = []
        self.dst: list[Any] = []

    def prepare(self, size: int, batch: int, windows: int, src: np.ndarray, dst: np.ndarray) -> None:
        self.head[1:3] = size, batch
        self.src, self.dst = [self.array(row) for row in src], [self.array(row) for row in dst]

    def _tag(self, n: int) -> Any:
        return self.ucp.UCXXTag(n)

    def put(self, window: int) -> None:
        self.head[0], self.head[3] = 0, window
        requests = [self.ep.tag_send(self.head_arr, self._tag(_HDR_TAG))]
        requests += [self.ep.tag_send(a, self._tag(_DATA_TAG + j)) for j, a in enumerate(self.src)]
        requests.append(self.ep.tag_recv(self.ack, self._tag(_ACK_TAG)))
        _ucxx_wait(self.worker, requests)

    def get(self, window: int) -> None:
        self.head[0], self.head[3] = 1, window
        requests = [self.ep.tag_send(self.head_arr, self._tag(_HDR_TAG))]
        requests += [self.ep.tag_recv(a, self._tag(_DATA_TAG + j)) for j, a in enumerate(self.dst)]
        _ucxx_wait(self.worker, requests)


def _connect(kind: str, info: dict[str, Any], local: np.ndarray) -> Client:
    if kind == "nixl_ucx":
        return NixlClient(info, local)
    if kind in ("native_tcp", "python_tcp"):
        return TcpClient(info, use_native=kind == "native_tcp")
    return UcxxClient(info, error_handling=kind == "ucxx_tag")


def _ask(ctl: Connection, msg: tuple[Any, ...]) -> Any:
    ctl.send(msg)
    if not ctl.poll(TIMEOUT):
        raise TimeoutError(f"the target did not answer {msg[0]} within {TIMEOUT} s")
    return ctl.recv()


def _timed(call: Callable[[int], None], windows: int, seconds: float) -> tuple[int, float, list[float]]:
    """Calls of ``call(window)`` (window ``c % windows``) for ``seconds`` and at least 3 calls, after one untimed."""
    call(0)
    lat: list[float] = []
    start = time.perf_counter()
    while len(lat) < 3 or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        call(len(lat) % windows)
        lat.append(time.perf_counter() - t)
    return len(lat), time.perf_counter() - start, lat


def _row(kind: str, op: str, size: int, batch: int, timing: tuple[int, float, list[float]]) -> dict[str, Any]:
    calls, seconds, lat = timing
    lat = sorted(lat)
    return {
        "bench": "one_sided",
        "transport": kind,
        "sided": "one" if kind in ONE_SIDED else "two",
        "op": op,
        "size": size,
        "batch": batch,
        "calls": calls,
        "GBps": round(size * batch * calls / seconds / 1e9, 3),
        "ops": round(batch * calls / seconds),
        "p50_us": round(lat[len(lat) // 2] * 1e6, 1),
        "p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6, 1),
    }


def _bench_case(
    kind: str, client: Client, ctl: Connection, local: np.ndarray, size: int, batch: int, seconds: float, arena: int
) -> list[dict[str, Any]]:
    n = size * batch
    windows = _windows(arena, size, batch)
    src = local[:n].reshape(batch, size)
    dst = local[n : 2 * n].reshape(batch, size)
    src[:] = np.frombuffer(np.random.default_rng(size * 1000 + batch).bytes(n), dtype=np.uint8).reshape(batch, size)
    dst[:] = 0
    want = _digest(src)
    client.prepare(size, batch, windows, src, dst)
    _ask(ctl, ("reset", size, batch, windows))
    rows = []
    for op in ("put", "get"):
        cpu = _ask(ctl, ("cpu",))
        timing = _timed(client.put if op == "put" else client.get, windows, seconds)
        cpu = _ask(ctl, ("cpu",)) - cpu
        if op == "put":
            written = min(windows, timing[0])  # the warm-up call wrote window 0 too
            verified = _ask(ctl, ("digests", size, batch, written)) == [want] * written
            for w in range(written, windows):  # every window holds the blocks before the gets
                client.put(w)
        else:
            verified = bool(np.array_equal(dst, src))
        rows.append({**_row(kind, op, size, batch, timing), "verified": verified,
                     "target_cpu_pct": round(cpu / timing[1] * 100, 1)})  # fmt: skip
    return rows


def _initiator_main(
    kind: str, ctl: Connection, results: Connection, info: dict[str, Any], cases: list[tuple[int, int]],
    seconds: float, arena: int,
) -> None:  # fmt: skip
    os.dup2(2, 1)  # as the target's
    try:
        local = np.zeros(2 * max(s * b for s, b in cases), dtype=np.uint8)
        client = _connect(kind, info, local)
        for size, batch in cases:
            for row in _bench_case(kind, client, ctl, local, size, batch, seconds, arena):
                results.send(row)
        results.send(None)
    except Exception as exc:
        with contextlib.suppress(OSError):
            results.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        os._exit(0)  # as the target: NIXL's libraries may crash on a normal exit


# ---------------------------------------------------------------------------------------------------------
# The run


def _missing(kind: str) -> str | None:
    if kind == "native_tcp" and not native.active():
        return f"the native loops are not loaded ({native.reason})"
    if kind == "nixl_ucx" and not _nixl_available():
        return "NIXL is not installed (pip install nixl-cu12)"
    if kind.startswith("ucxx") and importlib.util.find_spec("ucxx") is None:
        return "UCXX is not installed (pip install 'kvstore[ucx]')"
    return None


def _stop(proc: Any) -> None:
    if proc is None:
        return
    proc.join(timeout=5)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=2)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=2)


def run_transport(
    kind: str, cases: list[tuple[int, int]], seconds: float, arena: int, opts: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    """The rows of one transport: a target and an initiator process, both stopped whatever happens."""
    ctx = mp.get_context("spawn")
    ctl, target_ctl = ctx.Pipe()
    results, initiator_results = ctx.Pipe(duplex=False)
    path = _SHM / f"kvstore-one-sided-{os.getpid()}-{kind}"
    target = initiator = None
    try:
        target = ctx.Process(target=_target_main, args=(kind, target_ctl, str(path), arena, opts), daemon=True)
        target.start()
        if not ctl.poll(60):
            raise TimeoutError("the target did not start within 60 s")
        info = ctl.recv()
        if "error" in info:
            raise RuntimeError(f"target: {info['error']}")
        initiator = ctx.Process(
            target=_initiator_main, args=(kind, ctl, initiator_results, info, cases, seconds, arena), daemon=True
        )
        initiator.start()
        while True:
            if not results.poll(TIMEOUT + 4 * seconds):
                raise TimeoutError(f"no row within {TIMEOUT + 4 * seconds:.0f} s")
            try:
                row = results.recv()
            except EOFError:
                initiator.join(timeout=5)
                raise RuntimeError(f"the initiator ended (exit code {initiator.exitcode})") from None
            if row is None:
                return
            if "error" in row:
                raise RuntimeError(f"initiator: {row['error']}")
            yield row
    except Exception as exc:
        yield {"bench": "one_sided", "transport": kind, "error": str(exc)}
    finally:
        _stop(initiator)
        with contextlib.suppress(OSError):
            ctl.send(("stop",))
        _stop(target)
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One-sided (RMA) transfers against the native TCP loop.")
    parser.add_argument("--json", action="store_true", help="JSON lines (the only output form)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="block sizes")
    parser.add_argument("--batches", default="1,64", help="blocks per call")
    parser.add_argument("--seconds", type=float, default=1.0, help="per row (op, size, batch)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS),
                        help=f"of {', '.join(TRANSPORTS)} (native_tcp runs anyway: it is the baseline)")  # fmt: skip
    parser.add_argument("--arena", default="256MiB", help="the target's arena")
    parser.add_argument("--nixl-progress-delay-us", type=int, default=0,
                        help="between the NIXL target's progress rounds (0: as NIXL's Python API: none)")  # fmt: skip
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    arena = parse_size(args.arena)
    kinds = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = set(kinds) - set(TRANSPORTS)
    if unknown:
        parser.error(f"--transports: unknown {sorted(unknown)}; there are {TRANSPORTS}")
    if any(_windows(arena, s, b) < 1 for s in sizes for b in batches):
        parser.error(f"--arena {arena} B cannot hold the largest call ({max(sizes)} B x {max(batches)})")
    cases = [(s, b) for s in sizes for b in batches]
    opts = {"nixl_progress_delay_us": args.nixl_progress_delay_us}
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # the child processes' environment
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    baseline: dict[tuple[str, int, int], float] = {}
    failed = False
    for kind in ["native_tcp", *(k for k in kinds if k != "native_tcp")]:
        if (why := _missing(kind)) is not None:
            print(json.dumps({"bench": "one_sided", "transport": kind, "error": why}), flush=True)
            continue
        for row in run_transport(kind, cases, args.seconds, arena, opts):
            if "GBps" in row:
                key = (row["op"], row["size"], row["batch"])
                if kind == "native_tcp":
                    baseline[key] = row["GBps"]
                base = baseline.get(key)
                row["baseline_GBps"] = base
                row["ratio"] = round(row["GBps"] / base, 3) if base else None
                failed |= not row["verified"]
                if kind.startswith("ucx") or kind.startswith("nixl"):
                    row["ucx_tls"] = os.environ.get("UCX_TLS", "default")
                if kind == "nixl_ucx":
                    row["nixl_progress_delay_us"] = args.nixl_progress_delay_us
            print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
