"""Blocking request/reply connections over kvstore frames, and pools of them.

A :class:`Connection` carries one call at a time; a call that fails in any
way closes it (the stream may be out of step), and the next call reconnects.
An :class:`~kvstore.protocol.ErrorReply` comes back as its typed
:class:`~kvstore.errors.KVStoreError`.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import queue
import secrets
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

from kvstore.errors import ConnectionFailed, KVStoreError, NotLeader, NotReady, ProtocolError, Timeout
from kvstore.protocol import ErrorReply, Message
from transfer.auth import CredentialSource, authenticate, current
from transfer.discovery import MasterLocator
from transfer.tls import wrap_client
from transfer.wire import (
    NoRequest,
    connect,
    cut,
    io_errors,
    parse_address,
    recv_message,
    send_message,
    set_recv_timeout,
)

M = TypeVar("M", bound=Message)

HA_ATTEMPT_S = 3.0
"""Bound on one attempt of a call to an HA master (see :func:`attempt_timeout`)."""

LEADER_CHECK_S = 0.2
"""How often a call waiting on an HA master's reply asks etcd whether another master leads now."""

WATCHED_CHECK_S = 0.01
"""How often it looks at the leader a watch pushed (:meth:`MasterLocator.current`: no I/O)."""

_NOT_RUN = frozenset({NotLeader.code, NotReady.code})
"""Answers of a master that ran nothing: a call with time left resends the same request."""


CONNECT_PATIENCE_S = 0.1
"""The longest a request with a patience waits for a new connection (TCP, TLS and the handshake)
before it is given up as its reply would be (a Timeout): a host cut off from this one (its SYNs
dropped) would otherwise hold it for the whole timeout. A request whose patience is longer gets
its patience (:func:`connect_timeout`): a connection within a data centre takes a millisecond, and
a connection given up is made again from scratch. The client's default failover (100 ms): at 0.5 s,
reads of replicated keys from a client cut off from a node took 0.5 s in the hour runs, against the
0.2 s that a read with a replica elsewhere may take."""


def connect_timeout(timeout: float, patience: float) -> float:
    """The bound on making a new connection for a request with ``patience`` (0: none)."""
    return min(timeout, max(patience, CONNECT_PATIENCE_S)) if patience else timeout


class Retry(enum.Enum):
    """What a call to the master does after a failure, while its time lasts."""

    GIVE_UP = "give up"
    AGAIN = "again"
    """The same request to the same master (one that is starting and ran nothing)."""
    ELSEWHERE = "elsewhere"
    """Ask where the master is now, then the same request again (same id: a master that ran it
    answers as the first time)."""


def after_failure(error: KVStoreError, *, dynamic: bool) -> Retry:
    """The one rule for riding out a master restart or failover, for the blocking and asyncio
    clients alike. ``dynamic``: the master is found through etcd, so a leader that went silent
    (partitioned, stopped) may have a successor that answers."""
    if isinstance(error, NotReady):
        return Retry.AGAIN
    if isinstance(error, NotLeader | ConnectionFailed) or (isinstance(error, Timeout) and dynamic):
        return Retry.ELSEWHERE
    return Retry.GIVE_UP


def attempt_timeout(timeout: float, *, dynamic: bool) -> float:
    """Bound on one attempt of a master call: for an HA master (``dynamic``) a short one, so that a
    silent leader is given up and its successor asked within the call's overall time."""
    return min(timeout, HA_ATTEMPT_S) if dynamic else timeout


def request_ids() -> itertools.count[int]:
    """Request ids for one connection, unique across clients with overwhelming odds (the master keeps
    the answers of non-idempotent requests by id, for retries). Drawn from the OS, never from
    ``random``: applications seed that alike in every process (vLLM does)."""
    return itertools.count(secrets.randbits(62) + 1)


class Connection:
    """Request/reply to one peer: a fixed address, or the master a :class:`MasterLocator` names
    (followed to a new leader after a failure or a NotLeader answer). With a ``credential``, each
    new connection runs the handshake of :mod:`kvstore.auth` before its first request."""

    def __init__(
        self,
        address: str | MasterLocator,
        timeout: float = 5.0,
        credential: CredentialSource | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls``: each new connection runs a TLS handshake first (:mod:`transfer.tls`)."""
        self.locator = address if isinstance(address, MasterLocator) else None
        self.address = address if isinstance(address, str) else address.spec
        self.timeout = timeout
        self.credential = credential
        self.tls = tls
        self.session_key = b""
        """The key the handshake of the current connection agreed (empty without a credential)."""
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._aborted = False
        # Ids unique across clients (with overwhelming odds), so the master can tell a retry from a new request.
        self._ids = request_ids()

    @contextmanager
    def exchange(
        self, message: Message, payload: Sequence[memoryview | bytes] = (), *, retry_for: float = 0.0,
        patience: float = 0.0,
    ) -> Iterator[tuple[Message, socket.socket]]:  # fmt: skip
        """Send ``message`` (and its payload) and yield the reply with the socket, for a payload that follows it.

        ``retry_for``: keep reconnecting and resending, with backoff, for up to this many seconds
        while the peer cannot be reached (a master restarting). The request keeps its id, so a
        peer that already ran it answers as the first time. ``patience``: a Timeout (the
        connection closed) when the reply has not begun within it; 0: the connection's timeout.
        """
        with self._lock:
            what = f"{type(message).__name__} to {self.address}"
            try:
                reply, sock = self._request(message, payload, what, retry_for, patience)
                with io_errors(what):
                    yield reply, sock
            except BaseException:
                self._close_locked()
                raise

    def _request(
        self, message: Message, payload: Sequence[memoryview | bytes], what: str, retry_for: float,
        patience: float = 0.0,
    ) -> tuple[Message, socket.socket]:  # fmt: skip
        """(Holding the lock) send ``message`` under a new id and take its reply: an ErrorReply raised,
        a reply to another request a ProtocolError. The caller closes the connection on any failure."""
        request_id = next(self._ids)
        reply_id, reply, sock = self._send(message, request_id, payload, what, retry_for, patience)
        if reply_id != request_id:
            raise ProtocolError(f"{what}: reply to request {reply_id}, expected {request_id}")
        if isinstance(reply, ErrorReply):
            raise reply.to_error()
        return reply, sock

    def _send(
        self, message: Message, request_id: int, payload: Sequence[memoryview | bytes], what: str, retry_for: float,
        patience: float = 0.0,
    ) -> tuple[int, Message, socket.socket]:  # fmt: skip
        """Send and read the reply frame. A pooled socket that the peer closed meanwhile is replaced
        at once; beyond that, attempts go on with backoff until ``retry_for`` runs out."""
        deadline = time.monotonic() + retry_for
        backoff = 0.01
        stale = self._sock is not None
        while True:
            if self._aborted:
                raise ConnectionFailed(f"{what}: the connection was closed")
            try:
                if self.locator is not None:
                    self._follow(self.locator.address)
                if self._sock is None:
                    self._sock = self._open(connect_timeout(self._attempt_timeout(), patience))
                    if self._aborted:  # aborted while it connected: abort() found no socket to cut
                        raise ConnectionFailed(f"{what}: the connection was closed")
                sock = self._sock
                with io_errors(what):
                    send_message(sock, message, request_id, payload)
                    self._await_leader_reply(sock, what, patience)
                    if patience:
                        set_recv_timeout(sock, patience)
                    try:
                        reply_id, reply = recv_message(sock)
                    except NoRequest:
                        raise Timeout(f"{what}: no reply within {patience or self.timeout} s") from None
                    if patience:
                        set_recv_timeout(sock, self.timeout)  # the payload behind it: the usual bound
                if not (isinstance(reply, ErrorReply) and reply.code in _NOT_RUN):
                    return reply_id, reply, sock
                if after_failure(reply.to_error(), dynamic=False) is Retry.ELSEWHERE:
                    self._relocate()
                if time.monotonic() + backoff > deadline:
                    return reply_id, reply, sock  # the caller raises it
            except (ConnectionFailed, NotLeader, Timeout) as exc:
                self._close_locked()
                dynamic = self.locator is not None and self.locator.dynamic
                if after_failure(exc, dynamic=dynamic) is Retry.GIVE_UP:
                    raise
                self._relocate()
                if stale and not isinstance(exc, Timeout):
                    stale = False  # a pooled socket the peer closed meanwhile: replaced at once
                    continue
                if time.monotonic() + backoff > deadline:
                    raise
            if self.locator is not None:
                self.locator.wait_moved(self.address, backoff)  # a new leader ends the wait
            else:
                time.sleep(backoff)
            backoff = min(2 * backoff, LEADER_CHECK_S if self.locator is not None and self.locator.dynamic else 0.5)

    def _await_leader_reply(self, sock: socket.socket, what: str, patience: float) -> None:
        """For an HA master (``dynamic``): until its reply begins, ask etcd every LEADER_CHECK_S who
        leads; a new leader (this one frozen, cut off or deposed) raises NotLeader, so that the
        request goes to it now rather than after the attempt's timeout. Waits for nothing otherwise."""
        locator = self.locator
        if locator is None or not locator.dynamic or patience:
            return
        now = time.monotonic()
        deadline, ask = now + self._attempt_timeout(), now + LEADER_CHECK_S
        # With a watch, a new leader is pushed: look at it often (no I/O); ask etcd as well, less often.
        step = WATCHED_CHECK_S if locator.watching else LEADER_CHECK_S
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLPRI)
        while not (isinstance(sock, ssl.SSLSocket) and sock.pending()):
            left = deadline - time.monotonic()
            if left <= 0 or poller.poll(min(left, step) * 1000):
                return  # readable (or out of time: the receive says so)
            leader = locator.current()
            if leader is not None and leader != self.address:
                raise NotLeader(f"{what}: {leader} leads cluster {locator.spec} now")
            if time.monotonic() < ask:
                continue
            ask = time.monotonic() + LEADER_CHECK_S
            try:
                leader = locator.refresh(min_interval=LEADER_CHECK_S)
            except KVStoreError:
                continue  # etcd unreachable, or an election under way: wait on
            if leader != self.address:
                raise NotLeader(f"{what}: {leader} leads cluster {locator.spec} now")

    def _open(self, timeout: float) -> socket.socket:
        """A new connection: over TLS when this one has a context, authenticated when it has a credential."""
        sock = connect(self.address, timeout)
        if self.tls is not None:
            host = parse_address(self.address)[0]
            sock = wrap_client(sock, self.tls, host, timeout, f"connecting to {self.address}")
        if self.credential is not None:
            try:
                with io_errors(f"authenticating to {self.address}"):
                    self.session_key = authenticate(sock, current(self.credential), f"connecting to {self.address}")
            except BaseException:
                sock.close()
                raise
        return sock

    def _attempt_timeout(self) -> float:
        return attempt_timeout(self.timeout, dynamic=self.locator is not None and self.locator.dynamic)

    def _follow(self, address: str) -> None:
        if address != self.address:
            self._close_locked()
            self.address = address

    def _relocate(self) -> None:
        """After a failure: ask where the master is now (a no-op for a fixed address)."""
        if self.locator is not None:
            # etcd unreachable or an election under way: the next attempt asks again.
            with contextlib.suppress(KVStoreError):
                self._follow(self.locator.refresh(min_interval=0.05))

    @contextmanager
    def pipelined(self, message: Message) -> Iterator[PendingReply]:
        """Send ``message`` now and read its reply later, doing other work meanwhile.

        Inside the ``with``, :meth:`PendingReply.receive` reads the reply frame; the caller
        then reads any payload behind it to the end, or calls :meth:`PendingReply.abandon`.
        A reply left unread when the ``with`` ends closes the connection (the stream would be
        out of step). No retries: a speculative request is worth less than waiting.
        """
        with self._lock:
            request_id = next(self._ids)
            what = f"{type(message).__name__} to {self.address}"
            try:
                if self.locator is not None:
                    self._follow(self.locator.address)
                if self._sock is None:
                    self._sock = self._open(self.timeout)
                with io_errors(what):
                    send_message(self._sock, message, request_id)
                pending = PendingReply(self, self._sock, request_id, what)
                yield pending
                if not pending.received:
                    self._close_locked()
            except BaseException:
                self._close_locked()
                raise

    def call(
        self, message: Message, expect: type[M], payload: Sequence[memoryview | bytes] = (), *, retry_for: float = 0.0,
        patience: float = 0.0,
    ) -> M:  # fmt: skip
        """Send ``message`` (and its payload) and return its reply, of type ``expect`` (see :meth:`exchange`,
        ``patience`` too; the same steps without its context managers: no payload follows a reply here)."""
        with self._lock:
            what = f"{type(message).__name__} to {self.address}"
            try:
                reply, _ = self._request(message, payload, what, retry_for, patience)
                if not isinstance(reply, expect):
                    raise ProtocolError(
                        f"{type(message).__name__} got {type(reply).__name__}, expected {expect.__name__}"
                    )
                return reply
            except BaseException:
                self._close_locked()
                raise

    def _close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def abort(self) -> None:
        """Close from another thread, at once: a call blocked in it (a peer that does not answer)
        ends with ConnectionFailed instead of running out its timeout, and no call starts again."""
        self._aborted = True
        sock = self._sock
        if sock is not None:
            cut(sock)  # the thread blocked on it then closes it, as after any failure
        if self._lock.acquire(blocking=False):
            try:
                self._close_locked()
            finally:
                self._lock.release()


class PendingReply:
    """The reply still to come to a request sent by :meth:`Connection.pipelined`."""

    def __init__(self, conn: Connection, sock: socket.socket, request_id: int, what: str) -> None:
        self._conn = conn
        self._sock = sock
        self._request_id = request_id
        self._what = what
        self.received = False

    def receive(self) -> tuple[Message, socket.socket]:
        """The reply frame and the socket its payload follows on; a failure closes the connection."""
        try:
            with io_errors(self._what):
                try:
                    reply_id, reply = recv_message(self._sock)
                except NoRequest:
                    raise Timeout(f"{self._what}: no reply within {self._conn.timeout} s") from None
            if reply_id != self._request_id:
                raise ProtocolError(f"{self._what}: reply to request {reply_id}, expected {self._request_id}")
            if isinstance(reply, ErrorReply):
                raise reply.to_error()
        except BaseException:
            self.abandon()
            raise
        self.received = True
        return reply, self._sock

    def abandon(self) -> None:
        """Give the connection up: its stream is no longer in step."""
        self.received = False
        self._conn._close_locked()


class ConnectionPool:
    """Connections to one peer, one caller at a time each; up to ``size`` idle ones are kept.

    ``bounded``: at most ``size`` are in use at once and a caller waits (up to four timeouts) for
    one to come free: a rail's slices in flight, a daemon's commits to its master. Unbounded, a
    caller that finds none idle opens another (a client's calls to a daemon never queue behind
    each other) and the ones beyond ``size`` are closed when given back. The one pool of both the
    client and the server side; the asyncio client pipelines one connection per peer instead
    (:class:`transfer.link.AsyncLink`)."""

    def __init__(
        self, address: str | MasterLocator, timeout: float = 5.0, size: int = 4,
        credential: CredentialSource | None = None, tls: ssl.SSLContext | None = None, *, bounded: bool = True,
    ) -> None:  # fmt: skip
        self.target = address
        self.address = address if isinstance(address, str) else address.spec
        self.timeout = timeout
        self.credential = credential
        self.tls = tls
        self.size = size
        self._idle: list[Connection] = []  # a list's pop/append are atomic: no lock on the hot path
        # Bounded: one token per connection in use, in a queue (its get and put are C, where a
        # threading.Semaphore's are Python under a Condition: a put's commit takes one of each).
        self._free: queue.SimpleQueue[None] | None = None
        if bounded:
            self._free = queue.SimpleQueue()
            for _ in range(size):
                self._free.put(None)
        self._closed = False

    def acquire(self) -> Connection:
        """A connection for this caller alone, until :meth:`release`."""
        if self._free is not None:
            try:
                self._free.get(timeout=4 * self.timeout)
            except queue.Empty:
                raise Timeout(f"no free connection to {self.address} within {4 * self.timeout:.0f} s") from None
        try:
            return self._idle.pop()
        except IndexError:
            return Connection(self.target, self.timeout, self.credential, self.tls)

    def release(self, conn: Connection) -> None:
        if self._closed or len(self._idle) >= self.size:
            conn.close()
        else:
            self._idle.append(conn)
        if self._free is not None:
            self._free.put(None)

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        conn = self.acquire()
        try:
            yield conn
        finally:
            self.release(conn)

    def call(
        self, message: Message, expect: type[M], payload: Sequence[memoryview | bytes] = (), *, retry_for: float = 0.0,
        patience: float = 0.0,
    ) -> M:  # fmt: skip
        conn = self.acquire()
        try:
            return conn.call(message, expect, payload, retry_for=retry_for, patience=patience)
        finally:
            self.release(conn)

    def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()
