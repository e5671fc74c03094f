"""Blocking socket I/O for kvstore frames: whole frames in, frames plus zero-copy payloads out.

Every wait is bounded by the socket's timeout; a timeout becomes
:class:`kvstore.errors.Timeout`, a broken or refused connection
:class:`kvstore.errors.ConnectionFailed`.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType

from kvstore.errors import ConnectionFailed, KVStoreError, ProtocolError, Timeout
from kvstore.keys import checksum
from kvstore.protocol import FRAME_HEADER, MAX_FRAME_BYTES, Message, decode_payload, encode
from transfer import native

# sendmsg takes at most IOV_MAX buffers per call.
_IOV_MAX = 1024


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); raises :class:`kvstore.errors.InvalidArgument` when malformed."""
    from kvstore.errors import InvalidArgument

    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


@contextmanager
def io_errors(what: str) -> Iterator[None]:
    """Turn socket failures into kvstore's typed errors, naming ``what`` was being done."""
    try:
        yield
    except KVStoreError:
        raise  # typed already (AuthFailed is an OSError too: a refusal is not a broken connection)
    except (TimeoutError, BlockingIOError):
        raise Timeout(f"{what}: timed out") from None
    except (ConnectionError, OSError) as exc:
        raise ConnectionFailed(f"{what}: {exc.strerror or exc}") from None


def set_timeouts(sock: socket.socket, timeout: float) -> None:
    """Bound every send and receive on ``sock`` by ``timeout`` seconds, in the kernel.

    A Python-level timeout polls before every call; SO_RCVTIMEO/SO_SNDTIMEO
    bound the same waits with one system call each. A wait that runs out
    fails with EAGAIN, which :func:`io_errors` reports as a Timeout.
    """
    sock.settimeout(None)
    value = _timeval(timeout)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def set_recv_timeout(sock: socket.socket, timeout: float) -> None:
    """Bound the receives on ``sock`` by ``timeout`` seconds from now on (a TLS socket's Python-level
    timeout bounds its sends too, until it is set back)."""
    if sock.gettimeout() is not None:
        sock.settimeout(timeout)
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout))


def _timeval(timeout: float) -> bytes:
    """``timeout`` seconds as the kernel's struct timeval (SO_RCVTIMEO, SO_SNDTIMEO)."""
    seconds = int(timeout)
    return struct.pack("ll", seconds, int((timeout - seconds) * 1e6))


def cut(sock: socket.socket) -> None:
    """Shut ``sock`` down from another thread: its reader sees the end of the stream. Under TLS, the
    socket below is shut (the TLS layer must not be torn from under a thread reading through it)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def connect(address: str, timeout: float) -> socket.socket:
    host, port = parse_address(address)
    with io_errors(f"connecting to {address}"):
        sock = socket.create_connection((host, port), timeout=timeout)
    set_timeouts(sock, timeout)
    return sock


def _loops(sock: socket.socket) -> ModuleType | None:
    """The native loops, when they may drive ``sock`` (a plain blocking socket with kernel timeouts,
    see :func:`set_timeouts`); None for TLS, a Python-level timeout, or no native part loaded."""
    if type(sock) is socket.socket and sock.gettimeout() is None:
        return native.lib
    return None


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of a list of buffers: whole ones, then the head of a partly done one."""
    done = 0
    while n and done < len(views):
        head = views[done]
        if n >= head.nbytes:
            n -= head.nbytes
            done += 1
        else:
            views[done] = head[n:]
            n = 0
    del views[:done]


_COALESCE = 64 * 1024
"""Over TLS, buffers of at most this much in all go out as one record (one copy, one call)."""


def send_all(sock: socket.socket, buffers: Sequence[memoryview | bytes]) -> None:
    """Send every buffer, in order, with scatter-gather and no copies (over TLS, which has no
    scatter-gather: small ones joined, large ones one call each)."""
    if (loops := _loops(sock)) is not None:
        loops.send_buffers(sock.fileno(), buffers)
        return
    views = [memoryview(b).cast("B") if not isinstance(b, memoryview) else b for b in buffers if len(b)]
    if isinstance(sock, ssl.SSLSocket):
        if sum(v.nbytes for v in views) <= _COALESCE:
            views = [memoryview(b"".join(views))]
        for view in views:
            sock.sendall(view)
        return
    while views:
        _advance(views, sock.sendmsg(views[:_IOV_MAX]))


def send_message(
    sock: socket.socket, message: Message, request_id: int, payload: Sequence[memoryview | bytes] = ()
) -> None:
    send_all(sock, [encode(message, request_id), *payload])


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` exactly from the socket."""
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionFailed("peer closed the connection mid-message")
        got += k


def recv_all_into(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view, in order, with scatter receives (as few system calls as the kernel allows)."""
    pending = [v for v in views if v.nbytes]
    if isinstance(sock, ssl.SSLSocket):  # no recvmsg_into over TLS
        for view in pending:
            recv_into(sock, view)
        return
    while pending:
        got = sock.recvmsg_into(pending[:_IOV_MAX])[0]
        if got == 0:
            raise ConnectionFailed("peer closed the connection mid-message")
        _advance(pending, got)


_SCRATCH = 1 << 20
_MAX_RUN = (1 << 63) - 1
"""The longest run recv_parts drops (PY_SSIZE_T_MAX): a length past it came from no real stream."""


def recv_parts(sock: socket.socket, parts: Sequence[memoryview | int], sums: bool = False) -> list[int | None]:
    """Receive, in order, into each view of ``parts``, and drop the number of bytes each int says
    (a payload read only to keep the stream in step). Views in a row go in one scatter receive;
    dropped bytes pass through one scratch buffer of at most 1 MiB, so what is held never depends
    on a size the sender named. With ``sums``: each view's checksum (:func:`kvstore.keys.checksum`;
    None for a dropped run), which the native loops compute as the bytes land; else []."""
    if (loops := _loops(sock)) is not None:
        try:
            got: list[int | None] = loops.recv_parts(sock.fileno(), parts, sums) or []
        except (EOFError, ValueError) as exc:
            raise ConnectionFailed(str(exc)) from None
        return got
    _recv_parts(sock, parts)
    return [None if isinstance(p, int) else checksum(p) for p in parts] if sums else []


def _recv_parts(sock: socket.socket, parts: Sequence[memoryview | int]) -> None:
    for i, part in enumerate(parts):  # before a byte is read, as the native loops do
        if isinstance(part, int) and not 0 <= part <= _MAX_RUN:
            raise ConnectionFailed(f"recv_parts: part {i} drops {part} bytes")  # a length no stream carries
    run: list[memoryview] = []
    scratch: memoryview | None = None
    for part in parts:
        if not isinstance(part, int):
            run.append(part)
            continue
        if run:
            recv_all_into(sock, run)
            run = []
        left = part
        while left > 0:
            if scratch is None:
                scratch = memoryview(bytearray(min(part, _SCRATCH)))
            n = min(left, scratch.nbytes)
            recv_into(sock, scratch[:n])
            left -= n
    if run:
        recv_all_into(sock, run)


def keep_or_drop(targets: Sequence[memoryview], sizes: Sequence[int]) -> list[memoryview | int]:
    """Parts for :func:`recv_parts`: each target that has its block's size, else the size to drop
    (none for a negative size: nothing was sent)."""
    return [t if t.nbytes == n else max(n, 0) for t, n in zip(targets, sizes, strict=True)]


def recv_read_reply(reply: Message, sock: socket.socket, targets: Sequence[memoryview], what: str) -> list[bool]:
    """Take a ReadReply's payloads off ``sock``: each into its target when it has exactly the target's
    size (True); one of another size is read and dropped (False: not the block asked for); a
    negative size sent nothing (False). Raises ProtocolError for a reply of another shape."""
    from kvstore.protocol import ReadReply

    if not isinstance(reply, ReadReply) or len(reply.sizes) != len(targets):
        raise ProtocolError(f"{what}: a malformed reply")
    recv_parts(sock, keep_or_drop(targets, reply.sizes))  # as few receives as the kernel allows
    return [n == t.nbytes for n, t in zip(reply.sizes, targets, strict=True)]


_EAGER_FRAME = 64 * 1024
"""Frames up to this size get their whole buffer at once; larger ones grow as their bytes arrive."""


class NoRequest(Exception):
    """No byte of a next frame arrived within the socket's timeout (an idle peer; the stream is in step)."""


def recv_message(
    sock: socket.socket, max_frame: int = MAX_FRAME_BYTES, hold: Callable[[int], Callable[[], None]] | None = None
) -> tuple[int, Message]:
    """The next whole frame, decoded. Raises ProtocolError for a bad frame, ConnectionFailed at EOF,
    NoRequest when nothing arrived in time, BlockingIOError when a frame stalled halfway.

    ``hold``, given the length of a frame too large to come in one receive, counts it against
    a budget before any of it is read (raising to refuse it) and returns what gives it back."""
    if (loops := _loops(sock)) is not None:
        try:
            got = loops.recv_frame(sock.fileno(), max_frame, _EAGER_FRAME)
        except EOFError as exc:
            raise ConnectionFailed(str(exc)) from None
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        if got is None:
            raise NoRequest()
        if not isinstance(got, int):
            return decode_payload(got)
        length = got
    else:
        try:
            header = sock.recv(FRAME_HEADER.size)
        except (BlockingIOError, TimeoutError):  # the kernel's timeout; a TLS socket's own
            raise NoRequest() from None
        if not header:
            raise ConnectionFailed("peer closed the connection")
        if len(header) < FRAME_HEADER.size:
            header += _recv_bytes(sock, FRAME_HEADER.size - len(header))
        (length,) = FRAME_HEADER.unpack(header)
        if length > max_frame:
            raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_frame}")
    if length <= _EAGER_FRAME:
        # One receive for a frame that came whole (most do): bytes straight from the call, no copies.
        payload = sock.recv(length) if length else b""
        if len(payload) < length:
            if not payload:
                raise ConnectionFailed("peer closed the connection mid-message")
            payload += _recv_bytes(sock, length - len(payload))
        return decode_payload(payload)
    # Never allocated ahead of the bytes: a peer that announces a huge frame and stalls holds
    # no more memory than it sent.
    release = hold(length) if hold is not None else None
    try:
        grown = bytearray()
        while len(grown) < length:
            chunk = sock.recv(min(length - len(grown), _SCRATCH))  # a chunk as it comes, 1 MiB at most
            if not chunk:
                raise ConnectionFailed("peer closed the connection mid-message")
            grown += chunk
        return decode_payload(bytes(grown))
    finally:
        if release is not None:
            release()


def _recv_bytes(sock: socket.socket, n: int) -> bytearray:
    """Exactly ``n`` more bytes of a frame (at most :data:`_EAGER_FRAME`), to add to the bytes it has."""
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return buf
