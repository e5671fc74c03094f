"""The daemon's data-plane server: threaded, one thread per connection.

Each client connection gets a thread: frames arrive with a timeout, block
bytes go straight from the socket into the arena (``recv_into``) and straight
from the arena or LMDB's map to the socket (``sendmsg``). The master's
commands arrive the same way. The link the other way, from this daemon to the
master, is :mod:`server.daemon.master_link`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from kvstore.auth import ANYONE, Authority, Credential, cluster_credential
from kvstore.config import TlsConfig
from kvstore.errors import (
    AuthFailed,
    ConnectionFailed,
    CorruptBlock,
    GrantExpired,
    InvalidArgument,
    KVStoreError,
    NotLeader,
    ProtocolError,
    QuotaExceeded,
    RetryLater,
    Timeout,
)
from kvstore.keys import BlockKey, validate_key
from kvstore.protocol import (
    PUT_EXISTS,
    PUT_STORED,
    AuthHello,
    CommandReply,
    CommitBlocks,
    DemoteBlocks,
    DropBlocks,
    EndGrants,
    ErrorReply,
    FetchBlocks,
    FlushCommits,
    MasterHello,
    Message,
    OkReply,
    OpenGrant,
    PromoteBlocks,
    PutReply,
    ReadBlocks,
    ReadReply,
    ReadSlices,
    TenantsPolicy,
    WriteBlocks,
    WriteGranted,
    WriteReply,
    WriteSlices,
)
from kvstore.ratelog import RateLimitedLog
from kvstore.write_ids import check_write_ids
from server.daemon.commits import Committer, Refused
from server.daemon.gate import Gate
from server.daemon.grants import Grant, Grants
from server.daemon.master_link import MasterLink
from server.daemon.orphans import Orphans
from server.daemon.receivers import Receivers
from server.daemon.storage import NO_TARGET, BlockState, DaemonStorage, WriteBatch
from server.supervisor import Supervisor
from transfer.auth import accept
from transfer.rpc import Connection
from transfer.tls import contexts, server_context, wrap_server
from transfer.wire import (
    NoRequest,
    cut,
    keep_or_drop,
    recv_message,
    recv_parts,
    recv_read_reply,
    send_message,
    set_timeouts,
)

log = logging.getLogger("kvstore.daemon")

Handler = Callable[[Any, socket.socket, int], None]

_MASTER_COMMANDS: frozenset[type[Message]] = frozenset(
    {OpenGrant, EndGrants, DemoteBlocks, DropBlocks, PromoteBlocks, FetchBlocks, TenantsPolicy}
)
"""What only a master sends: refused on a connection whose master is older than the latest epoch."""


def _answer(
    keys: Sequence[BlockKey], todo: Sequence[int], outcome: Sequence[KVStoreError | None], verified: Sequence[bool],
    answer: Callable[[int], tuple[int, str]], codes: list[int], texts: list[str],
) -> None:  # fmt: skip
    """A PutReply's code and text for each block ``todo[j]`` of a write into a grant: the error that
    refused its local commit, CorruptBlock when its bytes failed their checksum, else ``answer(j)``
    (the master's, or STORED for a cached put)."""
    for j, i in enumerate(todo):
        err = outcome[j]
        if err is not None:
            codes[i], texts[i] = err.code, str(err)
        elif not verified[j]:
            codes[i], texts[i] = (
                CorruptBlock.code,
                f"block {keys[i]!r} arrived with another checksum than the writer said",
            )
        else:
            codes[i], texts[i] = answer(j)


class DaemonServer:
    def __init__(
        self,
        storage: DaemonStorage,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        rails: Sequence[str] = (),
        io_timeout: float = 30.0,
        idle_timeout: float = 600.0,
        tenant_idle_timeout: float = 60.0,
        max_connections: int = 4096,
        max_per_peer: int = 1024,
        secret: bytes | None = None,
        tls: TlsConfig | None = None,
        node_id: str = "",
        tenant_shm_writes: bool = False,
        orphan_check_s: float = 2.0,
        inventory_sweep_s: float = 600.0,
        commit_linger_s: float = 0.001,
    ) -> None:
        """Serve on ``host:port`` and on each further rail host (one per NIC; free ports), at most
        ``max_connections`` connections at once and ``max_per_peer`` from one address. With the
        cluster ``secret``, every connection authenticates first (:mod:`kvstore.auth`): the master
        and other daemons with the secret, tenants' clients with the master's tickets. With ``tls``
        and its ``data_plane``, connections (served, and fetches from other daemons) are TLS.
        ``node_id``: this node's name, which the master's seals of tenants' reservations name."""
        self.storage = storage
        self.node_id = node_id
        self._tls = server_context(tls) if tls is not None and tls.data_plane else None
        self.peer_tls = contexts(tls)[1]
        """The context of this daemon's connections to other daemons (fetches); None: plain."""
        self.authority = Authority(secret) if secret is not None else None
        self.credential: Credential | None = cluster_credential(secret) if secret is not None else None
        """What this daemon proves itself with to other daemons (fetches) and the master."""
        self.gate = Gate(self.authority, node_id, shm_writes=tenant_shm_writes)
        self.orphans = Orphans(
            storage,
            node_id,
            delay_s=orphan_check_s,
            sweep_s=inventory_sweep_s,
            drop=self._drop_orphans,
            pending=lambda key: self.committer.holds(key),
        )
        self.io_timeout = io_timeout
        self.idle_timeout = idle_timeout
        self.tenant_idle_timeout = tenant_idle_timeout
        """A tenant's idle session is closed after this (its client connects again), long before
        ``idle_timeout``: an idle session holds a slot of the tenant's ``max_sessions``."""
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self._per_peer: Counter[str] = Counter()
        self.refused_connections = 0
        """Connections closed at accept because a limit was reached."""
        self._refusals = RateLimitedLog(log)
        """Refused connections and handshakes, logged at most once a minute each (with a count)."""
        self._listeners: list[socket.socket] = []
        try:
            for i, h in enumerate([host, *rails]):
                self._listeners.append(socket.create_server((h, port if i == 0 else 0), backlog=128))
        except OSError as exc:
            for listener in self._listeners:
                listener.close()
            raise InvalidArgument(f"cannot listen on {h}: {exc.strerror or exc}") from None
        self.rails = [f"{h}:{lst.getsockname()[1]}" for h, lst in zip([host, *rails], self._listeners, strict=True)]
        self.address = self.rails[0]
        self._stop = threading.Event()
        self.supervisor = Supervisor()
        """This daemon's background loops (its master link's too): restarted after any exception, counted."""
        self._threads: list[threading.Thread] = []
        self._conns: dict[socket.socket, str] = {}
        """Open connections and the rail (listening address) each came in on."""
        self._conns_lock = threading.Lock()
        self.receivers = Receivers()
        self._transfer: Counter[str] = Counter()
        self._transfer_lock = threading.Lock()
        self.grants = Grants(storage.arena.capacity, storage.arena.alignment)
        """The master's grants for one-trip puts (see its module)."""
        self.epoch = 0
        """The latest master epoch this daemon knows of (see MasterHello); 0: no HA master yet."""
        self.master: MasterLink | None = None
        """Set once the link exists: one-trip puts commit through it, one-trip reads are reported to it."""
        self.committer = Committer(
            lambda: partial(self.master.commit_granted, cached=True) if self.master is not None else None,
            self._drop_refused, self.grants.release, self._stop, linger_s=commit_linger_s,
        )  # fmt: skip
        """The master's commits of cached puts, acknowledged before it knew of them (see its module)."""
        self._handlers: dict[type[Message], Handler] = {
            WriteBlocks: self._write,
            WriteGranted: self._write_granted,
            OpenGrant: self._open_grant,
            EndGrants: lambda m, s, r: self._command(s, r, self.end_grants(m.grant_ids)),
            FlushCommits: self._flush_commits,
            CommitBlocks: self._commit,
            ReadBlocks: self._read,
            ReadSlices: self._read_slices,
            WriteSlices: self._write_slices,
            DemoteBlocks: lambda m, s, r: self._command(s, r, self.storage.demote(self._keys(m.keys))),
            DropBlocks: lambda m, s, r: self._command(
                s, r, self._drop(self._keys(m.keys), m.tier, m.fences, m.void_until_ms, m.at, m.keep_pending)
            ),
            PromoteBlocks: lambda m, s, r: self._command(s, r, self.storage.promote(self._keys(m.keys), m.offsets)),
            FetchBlocks: lambda m, s, r: self._command(s, r, self._fetch(m)),
            MasterHello: lambda m, s, r: send_message(s, OkReply(), r),
            TenantsPolicy: self._tenants_policy,
            AuthHello: self._unauthenticated_hello,
        }

    def start(self) -> None:
        for listener, rail in zip(self._listeners, self.rails, strict=True):
            t = self.supervisor.thread("daemon-accept", self._accept_loop, self._stop, listener, rail)
            t.start()
            self._threads.append(t)
        if self.authority is not None or self._tls is not None:
            t = self.supervisor.thread("daemon-sweep", self._sweep_loop, self._stop)
            t.start()
            self._threads.append(t)
        t = self.supervisor.thread("daemon-cached-commits", self.committer.run, self._stop)
        t.start()
        self._threads.append(t)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(0.5):
            self.sweep()

    def _accept_loop(self, listener: socket.socket, rail: str) -> None:
        listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                sock, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return  # the listener was closed
                raise  # out of descriptors, say: the supervisor restarts the loop after a backoff
            host = str(peer[0])
            with self._conns_lock:
                refused = len(self._conns) >= self.max_connections or self._per_peer[host] >= self.max_per_peer
                if not refused:
                    self._conns[sock] = rail
                    self._per_peer[host] += 1
                    if self.authority is not None or self._tls is not None:
                        self.gate.accepted(sock)
                else:
                    self.refused_connections += 1
                    refusals = self.refused_connections
            if refused:
                # No thread, no buffer: a peer that opens connections without end costs a close each.
                self._refusals.warning(
                    "connection",
                    "refused connection from %s: %d open (limit %d), %d from it (limit %d); %d refused so far",
                    host, len(self._conns), self.max_connections, self._per_peer[host], self.max_per_peer, refusals,
                )  # fmt: skip
                sock.close()
                continue
            set_timeouts(sock, self.io_timeout)
            try:
                threading.Thread(target=self._serve, args=(sock, host), name="daemon-conn", daemon=True).start()
            except RuntimeError as exc:  # no thread to be had (a process or memory limit): this one goes
                log.warning("cannot serve a connection from %s: %s", host, exc)
                self._forget(sock, host)

    def raise_epoch(self, epoch: int) -> None:
        """A master of ``epoch`` leads now: commands on connections of older masters are refused."""
        self.epoch = max(self.epoch, epoch)

    def _serve(self, sock: socket.socket, host: str) -> None:
        epoch = 0  # the epoch of the master that opened this connection (MasterHello), if one did
        try:
            if self._tls is not None:
                try:
                    sock = self._wrap(sock)
                except (AuthFailed, ConnectionFailed, Timeout) as exc:
                    self._note_auth_failure(host, exc)
                    return
            identity = ANYONE
            if self.authority is not None:
                try:
                    identity = accept(sock, self.authority)[0]
                except AuthFailed as exc:
                    self._note_auth_failure(host, exc)
                    return
                try:
                    self.gate.authenticated(sock, identity)
                except QuotaExceeded as exc:
                    self._reply_error(sock, 0, exc)
                    return
            idle_since = time.monotonic()
            hold = self.gate.holder(identity)
            while not self._stop.is_set():
                try:
                    request_id, message = recv_message(sock, hold=hold)
                except QuotaExceeded as exc:  # the frame's bytes are not read: the stream is out of step
                    self._reply_error(sock, 0, exc)
                    return
                except NoRequest:
                    # No request within io_timeout: keep an idle connection up to idle_timeout.
                    idle = self.tenant_idle_timeout if identity.tenant is not None else self.idle_timeout
                    if time.monotonic() - idle_since > idle:
                        return
                    continue
                except ProtocolError as exc:
                    # The stream cannot be trusted past a bad frame: answer, then close.
                    self._reply_error(sock, 0, exc)
                    return
                idle_since = time.monotonic()
                if identity.tenant is not None:
                    try:
                        identity, message = self.gate.admit(identity, message)
                    except KVStoreError as exc:
                        self._reply_error(sock, request_id, exc)
                        if isinstance(exc, AuthFailed) or isinstance(message, WriteBlocks | WriteGranted | WriteSlices):
                            return  # the session is over, or a payload follows: the stream is out of step
                        continue
                if isinstance(message, MasterHello):
                    self.raise_epoch(message.epoch)
                    epoch = message.epoch
                if type(message) in _MASTER_COMMANDS and epoch < self.epoch:
                    self._reply_error(
                        sock, request_id,
                        NotLeader(f"a master of epoch {epoch} is deposed: this node follows epoch {self.epoch}"),
                    )  # fmt: skip
                    continue
                handler = self._handlers.get(type(message))
                if handler is None:
                    self._reply_error(
                        sock, request_id, ProtocolError(f"a daemon does not serve {type(message).__name__}")
                    )
                    continue
                try:
                    handler(message, sock, request_id)
                except KVStoreError as exc:
                    self._reply_error(sock, request_id, exc)
        except (ConnectionFailed, Timeout, OSError) as exc:
            # The peer went away or stalled; its next call reconnects.
            log.debug("connection closed: %s", exc)
        except Exception:
            log.exception("daemon connection handler failed")
        finally:
            self._forget(sock, host)

    def _wrap(self, sock: socket.socket) -> socket.socket:
        """``sock`` after the server's TLS handshake, in its place among the open connections."""
        assert self._tls is not None
        wrapped = wrap_server(sock, self._tls, self.io_timeout)
        with self._conns_lock:
            self._conns[wrapped] = self._conns.pop(sock)
        return wrapped

    def _note_auth_failure(self, host: str, exc: KVStoreError) -> None:
        """Count a refused handshake; log it at most once a minute (a peer guessing must not flood the log)."""
        failures = self.gate.refused()
        self._refusals.warning("handshake", "refused a connection from %s: %s (%d refused so far)", host, exc, failures)

    def _unauthenticated_hello(self, msg: AuthHello, sock: socket.socket, request_id: int) -> None:
        raise AuthFailed(f"daemon {self.address} does not authenticate (no cluster secret): connect without one")

    def _tenants_policy(self, m: TenantsPolicy, sock: socket.socket, request_id: int) -> None:
        """The master's word on tenants: taken, and every session it no longer allows is cut now."""
        if self.authority is None:
            raise InvalidArgument("a daemon without a cluster secret has no tenants")
        self.gate.take_policy(m)
        self.sweep()
        send_message(sock, OkReply(), request_id)

    def sweep(self) -> None:
        """Cut what the gate says must go (see :class:`Gate`)."""
        late, revoked = self.gate.sweep()
        for sock in late + revoked:
            cut(sock)
        if late:
            gate = self.gate
            self._refusals.warning("login-timeout", "cut %d connections that did not authenticate within %.0f s"
                                   " (%d so far)", len(late), gate.login_timeout, gate.login_timeouts)  # fmt: skip

    def _forget(self, sock: socket.socket, host: str) -> None:
        with self._conns_lock:
            self._conns.pop(sock, None)
        self.gate.forget(sock)
        with self._conns_lock:
            self._per_peer[host] -= 1
            if not self._per_peer[host]:
                del self._per_peer[host]
        sock.close()

    @staticmethod
    def _keys(keys: list[str]) -> list[BlockKey]:
        return [validate_key(k) for k in keys]

    def _reply_error(self, sock: socket.socket, request_id: int, exc: KVStoreError) -> None:
        with contextlib.suppress(OSError):
            send_message(sock, ErrorReply.from_error(exc), request_id)

    def count(self, transport: str, rail: str, direction: str, nbytes: int) -> None:
        """Add to the bytes moved by ``transport`` on ``rail`` in ``direction`` ("in" or "out")."""
        if nbytes:
            with self._transfer_lock:
                self._transfer[f"{transport}|{rail}|{direction}"] += nbytes

    def refusals(self) -> dict[str, int]:
        """What this daemon refused since it started, by kind (reported in heartbeats)."""
        return {"connections": self.refused_connections, "orphans_dropped": self.orphans.dropped,
                "cached_refused": self.committer.refused, **self.gate.counts()}  # fmt: skip

    def transfer_bytes(self) -> dict[str, int]:
        with self._transfer_lock:
            return dict(self._transfer)

    def _rail(self, sock: socket.socket) -> str:
        """The rail ``sock`` came in on (known since accept: no system call per request)."""
        return self._conns.get(sock, "?")

    def _fetch(self, msg: FetchBlocks) -> list[bool]:
        """Copy blocks from the daemon at ``msg.source`` into reserved extents here (a drain, a replicate),
        pinned as they are there."""
        keys = self._keys(msg.keys)
        if msg.pinned and len(msg.pinned) != len(keys):
            raise InvalidArgument(f"FetchBlocks of {len(keys)} blocks with {len(msg.pinned)} pins")
        batch = self.storage.write_batch(
            keys, msg.offsets, msg.sizes, msg.checksums, msg.pinned or False, fenced=True, write_ids=msg.write_ids
        )
        try:
            conn = Connection(msg.source, self.io_timeout, self.credential, self.peer_tls)
            try:
                request = ReadBlocks(list(keys), ["dram"] * len(keys), [0] * len(keys), list(msg.sizes))
                with conn.exchange(request) as (reply, sock):
                    got = recv_read_reply(reply, sock, batch.targets, f"ReadBlocks from {msg.source}")
            finally:
                conn.close()
        except BaseException:
            batch.abort()
            raise
        self.count("tcp", msg.source, "in", sum(n for n, ok in zip(msg.sizes, got, strict=True) if ok))
        return [ok and err is None for ok, err in zip(got, batch.finish(), strict=True)]

    def _command(self, sock: socket.socket, request_id: int, done: list[bool]) -> None:
        send_message(sock, CommandReply(done), request_id)

    def _write(self, msg: WriteBlocks, sock: socket.socket, request_id: int) -> None:
        keys = self._keys(msg.keys)
        self.orphans.wrote(keys)
        try:
            batch = self.storage.write_batch(
                keys, msg.offsets, msg.sizes, msg.checksums, msg.pinned, confirmed=False, write_ids=msg.write_ids
            )  # a two-trip put's: the master learns of it from its writer, after
        except InvalidArgument as exc:
            # The payload length is unknowable: the stream is out of step, so the connection must go.
            raise ConnectionFailed(f"WriteBlocks: {exc}") from None
        try:
            with self.receivers.receiving(sock, keys):
                sums = recv_parts(sock, keep_or_drop(batch.targets, msg.sizes), sums=True)  # one scatter receive
        except BaseException:
            batch.abort()
            raise
        self.count("tcp", self._rail(sock), "in", sum(msg.sizes))
        batch.verify(sums)
        self._write_reply(sock, request_id, batch.finish())

    # -- one-trip puts: writes into space the master granted -----------------------------------
    def _open_grant(self, msg: OpenGrant, sock: socket.socket, request_id: int) -> None:
        self.grants.open(msg.grant_id, msg.offset, msg.length, msg.ttl_ms, msg.owner, time.monotonic())
        self._command(sock, request_id, [True])

    def end_grants(self, grant_ids: Sequence[int], wait_s: float | None = None, cached: bool = True) -> list[bool]:
        """Take no more writes into ``grant_ids``; cut those receiving and wait until none is in flight
        (and, with ``cached``, until the master answered the commits of the cached puts in them)."""
        return self.grants.end(grant_ids, cut, self.io_timeout if wait_s is None else wait_s, cached)

    def reset_grants(self) -> None:
        """Forget every grant (a master that registers this node anew knows none of them). The
        cached puts' commits still queued are the registration's to carry (its inventory holds them)."""
        self.committer.registering()
        with contextlib.suppress(Timeout):
            # Not for cached puts' commits: what they committed here the inventory carries.
            self.end_grants(self.grants.ids(), cached=False)

    def _flush_commits(self, msg: FlushCommits, sock: socket.socket, request_id: int) -> None:
        self.committer.flush(self.io_timeout)
        send_message(sock, OkReply(), request_id)

    def _write_granted(self, msg: WriteGranted, sock: socket.socket, request_id: int) -> None:
        n = len(msg.keys)
        if not len(msg.offsets) == len(msg.sizes) == len(msg.checksums) == n or any(s <= 0 for s in msg.sizes):
            raise ConnectionFailed("WriteGranted with mismatched or non-positive sizes")  # payload unknowable
        try:
            write_ids = check_write_ids(msg.write_ids, n, "WriteGranted.write_ids")
        except InvalidArgument as exc:
            raise ConnectionFailed(str(exc)) from None  # refused before its payload: the stream is out of step
        keys = self._keys(msg.keys)
        tenant = self.gate.identity(sock).tenant
        grant: Grant | None = None
        refused: list[KVStoreError | None]
        if self.master is None or self.master.serving():
            grant, refused = self.grants.begin_write(
                msg.grant_id, tenant, keys, msg.offsets, msg.sizes, sock, time.monotonic()
            )
        else:  # lease over: the master may have fenced this node, and a cached put answered now could be lost
            refused = [GrantExpired("this node is fenced from the master; its grants ended")] * n
        try:
            self._write_into_grant(msg, keys, write_ids, refused, tenant, sock, request_id)
        finally:
            if grant is not None:
                self.grants.end_write(grant, sock)

    def _write_into_grant(
        self, msg: WriteGranted, keys: list[BlockKey], write_ids: list[int], refused: list[KVStoreError | None],
        tenant: str | None, sock: socket.socket, request_id: int,
    ) -> None:  # fmt: skip
        codes = [0] * len(keys)
        texts = [""] * len(keys)
        todo = [i for i, r in enumerate(refused) if r is None and not self.storage.holds(keys[i])]
        unvouched: list[tuple[BlockKey, int, int]] = []
        by_key = self.storage.serving_by_key()
        for i, r in enumerate(refused):
            if r is not None:
                codes[i], texts[i] = r.code, str(r)
            elif i in todo:
                continue
            elif not by_key:  # its lease to serve by key lapsed: the block held may be one removed since
                codes[i], texts[i] = RetryLater.code, f"block {keys[i]!r} is held here, unvouched for now: retry"
            elif self.storage.vouched(keys[i]):
                codes[i] = PUT_EXISTS  # stored here already
            else:  # a two-trip put's block the master has not vouched for: maybe an orphan, asked about now
                codes[i], texts[i] = RetryLater.code, f"block {keys[i]!r} here awaits the master's word; retry"
                unvouched.append((keys[i], msg.offsets[i], msg.sizes[i]))
        if unvouched and self.storage.on_conflict is not None:
            self.storage.on_conflict(unvouched)
        batch = self.storage.write_batch(
            [keys[i] for i in todo], [msg.offsets[i] for i in todo], [msg.sizes[i] for i in todo],
            [msg.checksums[i] for i in todo], msg.pinned, write_ids=[write_ids[i] for i in todo],
        )  # fmt: skip
        targets: list[memoryview] = []
        at = iter(batch.targets)
        wanted = set(todo)
        for i in range(len(msg.sizes)):
            targets.append(next(at) if i in wanted else NO_TARGET)
        try:
            with self.receivers.receiving(sock, [keys[i] for i in todo]):
                sums = recv_parts(sock, keep_or_drop(targets, msg.sizes), sums=True)  # checked as they land
        except BaseException:
            batch.abort()
            raise
        self.count("tcp", self._rail(sock), "in", sum(msg.sizes))
        verified = batch.verify([sums[i] for i in todo])
        # A tenant's puts are always visible: its quota and caps are checked at the commit, and a put
        # acknowledged before that could not be refused after without losing it.
        if msg.cached and self.master is not None and tenant is None:
            self._acknowledge_cached(msg, keys, write_ids, todo, batch, verified, codes, texts)
            send_message(sock, PutReply(codes, texts), request_id)
            return
        ask = [j for j, ok in enumerate(verified) if ok]
        answers: list[tuple[int, str]] = []
        if ask:
            try:
                if self.master is None:
                    raise ConnectionFailed("this daemon has no link to a master yet")
                answers = self.master.commit_granted(
                    msg.grant_id, [keys[todo[j]] for j in ask], [msg.offsets[todo[j]] for j in ask],
                    [msg.sizes[todo[j]] for j in ask], [msg.checksums[todo[j]] for j in ask], msg.pinned,
                    [write_ids[todo[j]] for j in ask],
                )  # fmt: skip
            except BaseException:
                batch.finish([False] * len(todo))
                raise
        told = dict(zip(ask, answers, strict=True))
        accept = [told.get(j, (-1, ""))[0] == PUT_STORED for j in range(len(todo))]
        outcome = batch.finish(accept)
        _answer(keys, todo, outcome, verified, told.__getitem__, codes, texts)
        send_message(sock, PutReply(codes, texts), request_id)

    def _acknowledge_cached(
        self, msg: WriteGranted, keys: list[BlockKey], write_ids: list[int], todo: list[int], batch: WriteBatch,
        verified: list[bool], codes: list[int], texts: list[str],
    ) -> None:  # fmt: skip
        """A cached put's blocks, checked: committed here and answered STORED now, their commit to
        the master queued (the grant held open until it is done)."""
        with self.committer.acknowledging([keys[i] for i in todo]):
            outcome = batch.finish(verified)
            _answer(keys, todo, outcome, verified, lambda j: (PUT_STORED, ""), codes, texts)
            done = [i for j, i in enumerate(todo) if outcome[j] is None and verified[j]]
            if not done:
                return
            grant = self.grants.hold(msg.grant_id)  # released by the committer once the master answered
            self.committer.add(
                msg.grant_id, [keys[i] for i in done], [msg.offsets[i] for i in done], [msg.sizes[i] for i in done],
                [msg.checksums[i] for i in done], msg.pinned, grant, [write_ids[i] for i in done],
            )  # fmt: skip

    def _write_slices(self, msg: WriteSlices, sock: socket.socket, request_id: int) -> None:
        n = len(msg.keys)
        if not len(msg.offsets) == len(msg.sizes) == len(msg.starts) == len(msg.lengths) == n or any(
            length <= 0 for length in msg.lengths
        ):
            raise ConnectionFailed("WriteSlices with mismatched or non-positive lengths")  # payload unknowable
        keys = self._keys(msg.keys)
        self.orphans.wrote(keys)
        views = self.storage.slice_views(list(zip(keys, msg.offsets, msg.sizes, msg.starts, msg.lengths, strict=True)))
        targets = [v if isinstance(v, memoryview) else NO_TARGET for v in views]
        # A failure here leaves the blocks being written: the master's revoke or expiry drops them.
        with self.receivers.receiving(sock, keys):
            recv_parts(sock, keep_or_drop(targets, msg.lengths))
        self.count("tcp", self._rail(sock), "in", sum(msg.lengths))
        self._write_reply(sock, request_id, [v if isinstance(v, KVStoreError) else None for v in views])

    def _commit(self, msg: CommitBlocks, sock: socket.socket, request_id: int) -> None:
        """Blocks whose bytes are in their extents already (copied by a same-host client, or written in
        slices): reserve where needed, check in place, commit."""
        keys = self._keys(msg.keys)
        self.orphans.wrote(keys)
        batch = self.storage.write_batch(
            keys,
            msg.offsets,
            msg.sizes,
            msg.checksums,
            msg.pinned,
            join=True,
            confirmed=False,
            write_ids=msg.write_ids,
        )  # a two-trip put's (see _write)
        outcome = batch.finish()
        self.count("shm", self.address, "in", sum(n for n, err in zip(msg.sizes, outcome, strict=True) if err is None))
        self.receivers.cut(keys)  # slices still coming for a committed block: stale
        self._write_reply(sock, request_id, outcome)

    def _drop(
        self, keys: list[BlockKey], tier: str = "", fences: Sequence[int] = (), void_until_ms: int = 0,
        at: Sequence[int] = (), keep_pending: bool = False,
    ) -> list[bool]:  # fmt: skip
        """The master's drop. ``at``: reservations given up, dropped only where reserved (a block of the
        key elsewhere is a cached put's, its commit not yet taken). ``keep_pending``: puts begun
        with an earlier master; a cached put's block here is not one (its commit is pending, or the
        master took it) and stays. Both decided under the storage lock with the drop itself."""
        keep = self.committer.ours if keep_pending else None
        self.gate.dropped(list(keys), void_until_ms)  # first: their reservations write nothing more
        if tier != "ssd":
            self.receivers.cut(keys, wait_s=self.io_timeout)
        done = self.storage.drop(keys, tier, fences, at, keep)
        if not tier:  # dropped while absent: bytes that come later may be an orphan's
            self.orphans.dropped_absent([k for k, held in zip(keys, done, strict=True) if not held])
        return done

    def _drop_refused(self, refused: list[Refused]) -> None:
        """Drop cached puts' blocks whose commit the master refused: each only as it was acknowledged,
        never another block written under its key since. NotReady while a registration runs."""
        acked = {k: BlockState(o, s, c) for k, o, s, c in refused}
        self.storage.drop(list(acked), keep=lambda key, state: state != acked[key])

    def _drop_orphans(self, blocks: list[tuple[BlockKey, BlockState]]) -> list[BlockKey]:
        """Drop orphans as the master's drops are made: their receivers cut first (no bytes land in
        an extent given back), their seals closed."""
        # A cached put's block is the master's to learn of (its commit is pending), never an orphan.
        blocks = [b for b in self.storage.unchanged(blocks) if not self.committer.holds(b[0])]
        keys = [k for k, _ in blocks]
        self.receivers.cut(keys, wait_s=self.io_timeout)
        self.gate.dropped(keys)
        return self.storage.drop_orphans(blocks)

    def _write_reply(self, sock: socket.socket, request_id: int, outcome: list[KVStoreError | None]) -> None:
        send_message(sock, WriteReply.from_outcomes(outcome), request_id)

    def _renewal_s(self) -> float:
        """How long a read waits for a lapsed serve lease to come back (see MasterLink.serving)."""
        return self.master.renewal_s if self.master is not None else 0.0

    def _read(self, msg: ReadBlocks, sock: socket.socket, request_id: int) -> None:
        if not len(msg.keys) == len(msg.tiers) == len(msg.offsets) == len(msg.sizes):
            raise InvalidArgument("ReadBlocks with mismatched keys, tiers, offsets and sizes")
        keys = self._keys(msg.keys)
        sums: list[int] = []
        tiers: list[str] = []
        with self.storage.read_views(keys, sums, tiers, self._renewal_s(), (msg.offsets, msg.sizes)) as views:
            sizes = [-1 if v is None else v.nbytes for v in views]
            send_message(sock, ReadReply(sizes, sums), request_id, [v for v in views if v is not None])
        self.count("tcp", self._rail(sock), "out", sum(n for n in sizes if n > 0))
        if self.master is not None:
            # A reader that knew the size asked the master, which counted the hit; one that did not
            # (size 0) came here first: the master learns of it from this node's access reports.
            served = [(k, tier) for k, want, tier in zip(keys, msg.sizes, tiers, strict=True) if not want and tier]
            self.master.note_access(served)

    def _read_slices(self, msg: ReadSlices, sock: socket.socket, request_id: int) -> None:
        if not len(msg.keys) == len(msg.starts) == len(msg.lengths):
            raise InvalidArgument("ReadSlices with mismatched keys, starts and lengths")
        keys = self._keys(msg.keys)
        with self.storage.read_views(keys, wait_s=self._renewal_s()) as views:
            parts = [
                v[start : start + length] if v is not None and start >= 0 and 0 < length <= v.nbytes - start else None
                for v, start, length in zip(views, msg.starts, msg.lengths, strict=True)
            ]
            try:
                sizes = [-1 if p is None else p.nbytes for p in parts]
                send_message(sock, ReadReply(sizes, [0] * len(sizes)), request_id, [p for p in parts if p is not None])
                self.count("tcp", self._rail(sock), "out", sum(n for n in sizes if n > 0))
            finally:
                for part in parts:
                    if part is not None:
                        part.release()

    def stop(self) -> None:
        self._stop.set()
        for listener in self._listeners:
            listener.close()
        with self._conns_lock:
            for sock in self._conns:
                cut(sock)
        for t in self._threads:
            t.join(timeout=2)
