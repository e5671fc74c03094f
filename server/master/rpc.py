"""The master's RPC port: connections, the handshake, dispatch, idempotency and timing.

A thin adapter over :class:`~server.master.core.MasterCore`: a frame is decoded, its sender's
rights checked (:mod:`kvstore.auth`), refused while this master does not lead (held while it takes
over, until it is ready: :mod:`server.master.leadership`), and handed to the core's operation for
its type. Requests whose
repetition would change the outcome are answered once per (sender, request id, request bytes); a
retry gets the first answer.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from kvstore.auth import ANYONE, Authority, Identity, ServerHandshake, as_refusal
from kvstore.config import MasterConfig
from kvstore.errors import AuthFailed, KVStoreError, NotReady, PermissionDenied, ProtocolError, QuotaExceeded
from kvstore.protocol import (
    MAX_FRAME_BYTES,
    AccessReport,
    AdminInfo,
    AdminInfoReply,
    AuthHello,
    CheckBlocks,
    ClearReplicas,
    CommitGranted,
    ErrorReply,
    Exists,
    FrameDecoder,
    GetReplicas,
    GetTicket,
    GrantSpace,
    Heartbeat,
    LabelBlocks,
    LeaveNode,
    ListKeys,
    ListNodes,
    MatchPrefix,
    MatchPrefixNodes,
    Message,
    PutEnd,
    PutRevoke,
    PutStart,
    RegisterNode,
    ReleaseLeases,
    Remove,
    Replicate,
    ReportNode,
    ReturnGrants,
    Stats,
    StatsReply,
    check_batch,
    check_frame,
    decode_payload,
    encode,
    request_id_of,
)
from kvstore.ratelog import RateLimitedLog
from server.master.answers import Answers, RequestId
from server.master.commands import Spawn
from server.master.core import MasterCore
from server.master.leadership import Leadership
from server.master.metrics import LatencyHistogram
from transfer.aio import HANDSHAKE_FRAME
from transfer.tls import HANDSHAKE_TIMEOUT_S

log = logging.getLogger("kvstore.master")

Handler = Callable[[Any, Identity], Awaitable[Message]]

# Requests whose handlers wait for daemons (they run in a task; the others are answered inline).
_WAITS: frozenset[type[Message]] = frozenset(
    {PutStart, PutRevoke, GrantSpace, Remove, ClearReplicas, Replicate, RegisterNode}
)

# Requests whose repetition would change the outcome: their answers are kept for retries.
_NOT_IDEMPOTENT: frozenset[type[Message]] = frozenset(
    {PutStart, PutEnd, PutRevoke, Remove, ClearReplicas, Replicate, GrantSpace, CommitGranted}
)

# Requests whose master-side latency is kept as a histogram (served at /metrics).
_TIMED: dict[type[Message], str] = {
    PutStart: "put_start", PutEnd: "put_end", GetReplicas: "get_replicas", MatchPrefix: "match_prefix",
    MatchPrefixNodes: "match_prefix_nodes", GrantSpace: "grant_space", CommitGranted: "commit_granted",
}  # fmt: skip


class _Connection(asyncio.Protocol):
    """One client's connection: frames are cut from the bytes as they arrive and answered at once.

    A client that stops reading its replies is stopped from sending more (reading pauses while
    the send buffer is over the transport's high-water mark)."""

    def __init__(self, server: RpcServer) -> None:
        self.server = server
        self.opened = self.last = time.monotonic()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        authority = server.authority
        self.identity: Identity | None = ANYONE if authority is None else None
        """Who is at the other end; None until the handshake is done (a master that authenticates)."""
        self.handshake = ServerHandshake(authority) if authority is not None else None
        self.key = b""
        """The key this connection's handshake agreed (masks the session keys of tickets)."""
        # Before authentication a peer can make the master hold one small frame, no more.
        self.decoder = FrameDecoder(HANDSHAKE_FRAME) if authority is not None else FrameDecoder()
        self.partial_since: float | None = None
        """When the frame now held back in part began to arrive (None: none is): a sender that
        stalls mid-frame must not hold its buffer (up to a frame's limit) for long."""
        self.held = 0
        """Bytes of a tenant's frame begun and not finished, counted in its server's ``inflight``."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)
        self.server.opened(self)

    def data_received(self, data: bytes) -> None:
        self.last = time.monotonic()
        try:
            for payload in self.decoder.feed(data):
                self.partial_since = None
                if self.identity is None:
                    self._authenticate(payload)
                    if self.transport.is_closing():
                        return
                    continue
                self.server.serve(self, payload)
            pending = self.decoder.pending
            if pending and self.partial_since is None:
                self.partial_since = self.last
            identity = self.identity
            if pending != self.held and identity is not None and identity.tenant is not None:
                self.server.hold(self, identity.tenant, pending)
        except ProtocolError as exc:
            # An oversize frame leaves the stream out of step: answer, then close.
            self.server.rpc_errors += 1
            self.reply(ErrorReply.from_error(exc), 0)
            self.transport.close()

    def _authenticate(self, payload: bytes) -> None:
        """One frame of the handshake: answer it, or refuse (naming why) and close."""
        assert self.handshake is not None
        request_id = request_id_of(payload)
        try:
            _, message = decode_payload(payload)
            if isinstance(message, AuthHello) or not self.handshake.expects_proof:
                self.reply(self.handshake.challenge(message), request_id)
                return
            identity, ok, self.key = self.handshake.verify(message)
        except KVStoreError as exc:  # a refusal, or a frame that is no handshake
            self.server.note_auth_failure(self.transport.get_extra_info("peername"), exc)
            self.reply(ErrorReply.from_error(as_refusal(exc)), request_id)
            self.transport.close()
            return
        if identity.tenant is not None:
            try:
                self.server.check_sessions(identity.tenant)
            except QuotaExceeded as exc:  # proven, but its tenant holds every session it may
                self.reply(ErrorReply.from_error(exc), request_id)
                self.transport.close()
                return
        self.identity = identity
        self.decoder.max_frame = MAX_FRAME_BYTES
        self.reply(ok, request_id)

    def reply(self, message: Message, request_id: int) -> None:
        if self.transport.is_closing():
            return
        try:
            frame = encode(message, request_id)
        except (OverflowError, ProtocolError, TypeError, ValueError) as exc:
            # A bug (a value the wire cannot carry): the client gets an error, the connection stays.
            log.error("reply %s to request %d cannot be sent: %s", type(message).__name__, request_id, exc)
            frame = encode(ErrorReply.from_error(ProtocolError(f"the master could not encode its reply: {exc}")),
                           request_id)  # fmt: skip
        self.transport.write(frame)

    def pause_writing(self) -> None:
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        if not self.transport.is_closing():
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.held and self.identity is not None and self.identity.tenant is not None:
            self.server.inflight[self.identity.tenant] -= self.held
            self.held = 0


def _revoked(conn: _Connection) -> AuthFailed:
    tenant = conn.identity.tenant if conn.identity is not None else None
    return AuthFailed(f"tenant {tenant!r} was removed from the tenants file or its token replaced: the session is over")


MAX_PARKED = 4096
"""Requests waiting for readiness at once; beyond them, NotReady at once."""


class RpcServer:
    """The RPC port of one master over ``core`` (see the module's text)."""

    def __init__(
        self,
        config: MasterConfig,
        core: MasterCore,
        leadership: Leadership,
        authority: Authority | None,
        tls: ssl.SSLContext | None,
        spawn: Spawn,
        admin_address: Callable[[], str],
    ) -> None:
        self.config = config
        self.core = core
        self.leadership = leadership
        self.authority = authority
        self.tls = tls
        self._spawn = spawn
        self._admin_address = admin_address
        self.connections: set[_Connection] = set()
        self.rpc_errors = 0
        self.auth_failures = 0
        self.refused_connections = 0
        """Connections closed at accept: ``config.max_connections`` were open."""
        self.revoked_sessions = 0
        """Tenants' sessions closed because the tenant was removed or its token replaced."""
        self.refused_sessions = 0
        """Logins refused because their tenant had as many sessions open as it may."""
        self.stalled_frames = 0
        """Connections closed because a frame they began did not arrive whole within ``frame_timeout_s``."""
        self.inflight: Counter[str] = Counter()
        """Per tenant, bytes of frames its connections began and did not finish (held in their buffers)."""
        self.refused_inflight = 0
        """Connections closed because they took their tenant past its ``max_inflight_bytes``."""
        self.tenant_requests: Counter[str] = Counter()
        """Per tenant, requests its sessions sent (admitted or refused), for its operations per second."""
        self.latency: dict[str, LatencyHistogram] = {}
        self.parked = 0
        """Requests waiting for this master to be ready (:meth:`_serve_when_ready`)."""
        self.parked_total = 0
        """Requests held for readiness so far (a takeover's, instead of NotReady)."""
        self._held: set[asyncio.Task[None]] = set()
        self.answers = Answers(config.answer_ttl_s, config.answer_cache)
        """Answers of requests that must not run twice, by (who sent it, request id, its bytes' hash)."""
        self._failures = RateLimitedLog(log)
        self._server: asyncio.Server | None = None
        self._handlers: dict[type[Message], Handler] = {
            RegisterNode: core.register, Heartbeat: core.heartbeat, LeaveNode: core.leave, PutStart: core.put_start,
            PutEnd: core.put_end, PutRevoke: core.put_revoke, GetReplicas: core.get_replicas,
            ReleaseLeases: core.release_leases, GrantSpace: core.grant_space, ReturnGrants: core.return_grants,
            CommitGranted: core.commit_granted, AccessReport: core.access_report, MatchPrefix: core.match_prefix,
            MatchPrefixNodes: core.match_prefix_nodes, Replicate: core.replicate, Exists: core.exists,
            Remove: core.remove, ListKeys: core.list_keys, ListNodes: core.list_nodes, Stats: self._stats,
            AdminInfo: self._admin_info, AuthHello: self._unauthenticated_hello, CheckBlocks: core.check_blocks,
            ReportNode: core.report_node, LabelBlocks: core.label_blocks,
            ClearReplicas: core.clear_replicas,
        }  # fmt: skip

    async def start(self) -> int:
        """Listen on ``config.host``/``config.port``; returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), self.config.host, self.config.port, ssl=self.tls,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if self.tls is not None else None,
        )  # fmt: skip
        return int(self._server.sockets[0].getsockname()[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.transport.close()

    def opened(self, conn: _Connection) -> None:
        """A connection was accepted: kept, or closed at once when ``config.max_connections`` are open."""
        if len(self.connections) >= self.config.max_connections:
            self.refused_connections += 1
            self._failures.warning(
                "refused-connection", "refused a connection: %d open (limit %d); %d refused so far",
                len(self.connections), self.config.max_connections, self.refused_connections,
            )  # fmt: skip
            conn.transport.close()
            return
        self.connections.add(conn)

    def check_sessions(self, tenant: str) -> None:
        """Raise QuotaExceeded when ``tenant`` has as many sessions open as it may (one token
        must not hold every connection the master serves)."""
        assert self.authority is not None
        cap = self.authority.max_sessions(tenant)
        open_ = sum(1 for c in self.connections if c.identity is not None and c.identity.tenant == tenant)
        if open_ >= cap:
            self.refused_sessions += 1
            raise QuotaExceeded(f"tenant {tenant!r} has {open_} sessions open, the most it may (max_sessions {cap})")

    def hold(self, conn: _Connection, tenant: str, pending: int) -> None:
        """``conn`` of ``tenant`` now holds ``pending`` bytes of a frame begun: counted; the connection is
        closed (its buffer freed) when that takes the tenant past its cap on bytes in flight, so one
        token's stalled or slow frames cannot hold the master's memory."""
        assert self.authority is not None
        total = self.inflight[tenant] + pending - conn.held
        self.inflight[tenant], conn.held = total, pending
        cap = self.authority.max_inflight(tenant)
        if total > cap and pending:
            self.refused_inflight += 1
            self._failures.warning(
                "inflight", "closed a connection of tenant %s: its frames in flight hold %d bytes, over its cap of %d"
                " (%d so far)", tenant, total, cap, self.refused_inflight,
            )  # fmt: skip
            exc = QuotaExceeded(f"tenant {tenant!r} has {total} bytes of frames in flight, over its cap of {cap}"
                                " (max_inflight_bytes)")  # fmt: skip
            conn.reply(ErrorReply.from_error(exc), 0)
            conn.transport.close()
            # Its buffer goes now, not when a peer that reads nothing lets the close finish.
            conn.decoder = FrameDecoder(HANDSHAKE_FRAME)
            self.inflight[tenant] -= pending
            conn.held = 0

    def reap(self, now: float) -> None:
        """Close connections idle for ``config.idle_timeout_s`` (a tenant's for ``tenant_idle_timeout_s``),
        not authenticated in time, in the middle of a frame for ``frame_timeout_s``, or of a tenant
        removed from the tenants file (or whose token was replaced) since it logged in."""
        config = self.config
        idle_since, unproven_since = now - config.idle_timeout_s, now - HANDSHAKE_TIMEOUT_S
        tenant_idle_since, frame_since = now - config.tenant_idle_timeout_s, now - config.frame_timeout_s
        if self.authority is not None:
            self.authority.refresh_tenants()
        for conn in list(self.connections):
            identity = conn.identity
            tenant = identity.tenant if identity is not None else None
            if identity is not None and tenant is not None and self._revalidate(conn, identity) is None:
                self.revoked_sessions += 1
                log.info("closed a session of tenant %r: %s", tenant, _revoked(conn))
                conn.transport.close()
            elif conn.partial_since is not None and conn.partial_since < frame_since:
                self.stalled_frames += 1
                self._failures.warning(
                    "stalled-frame", "closed a connection of %s holding %d bytes of a frame begun %.0f s ago"
                    " (%d so far)", tenant or "a client", conn.decoder.pending, now - conn.partial_since,
                    self.stalled_frames,
                )  # fmt: skip
                conn.transport.close()
            elif (
                conn.last < idle_since
                or (tenant is not None and conn.last < tenant_idle_since)
                or (identity is None and conn.opened < unproven_since)
            ):
                conn.transport.close()

    def _revalidate(self, conn: _Connection, identity: Identity) -> Identity | None:
        """The tenant's identity as the tenants file says it is now (its operations narrowed or
        widened in place); None when its session is over."""
        assert self.authority is not None
        now = self.authority.current(identity)
        if now is not None and now is not identity:
            conn.identity = now
        return now

    def note_auth_failure(self, peer: object, exc: KVStoreError) -> None:
        """Count a refused handshake; log it at most once a minute (a peer guessing must not flood the log)."""
        self.auth_failures += 1
        self._failures.warning(
            "auth-failure", "refused a connection from %s: %s (%d refused so far)", peer, exc, self.auth_failures
        )

    def serve(self, conn: _Connection, payload: bytes) -> None:
        """Answer one request. A handler that never waits (most: the table is synchronous) runs to
        its end right here, with no task and no turn of the event loop; the others (those that
        wait for daemons) run in a task. Replies carry their request ids, so they may overtake
        each other."""
        refused = check_frame(payload)  # an oversized batch is refused before it is decoded
        if refused is not None:
            conn.reply(ErrorReply.from_error(refused[1]), refused[0])
            return
        try:
            request_id, message = decode_payload(payload)
        except ProtocolError as exc:
            self.rpc_errors += 1
            conn.reply(ErrorReply.from_error(exc), request_id_of(payload))
            return
        try:
            check_batch(message)  # the other batches, before any work (a tenant's keys are not yet renamed)
        except KVStoreError as exc:
            conn.reply(ErrorReply.from_error(exc), request_id)
            return
        identity = conn.identity
        assert identity is not None
        if identity.tenant is not None:
            self.tenant_requests[identity.tenant] += 1
            identity = self._revalidate(conn, identity)
            if identity is None:
                conn.reply(ErrorReply.from_error(_revoked(conn)), request_id)
                conn.transport.close()
                return
            try:
                message = identity.admit(message)
            except KVStoreError as exc:
                conn.reply(ErrorReply.from_error(exc), request_id)
                return
        if isinstance(message, GetTicket):
            conn.reply(self._ticket(conn), request_id)
            return
        refusal = self.leadership.refusal(type(message))
        if refusal is not None:
            if isinstance(refusal, NotReady) and self.config.takeover_hold_ms and self.parked < MAX_PARKED:
                self.parked += 1
                self.parked_total += 1
                held = self._serve_when_ready(conn, message, request_id, identity, hash(payload))
                # Not the service's task: a term's end cancels those, and this one must still answer.
                task = asyncio.create_task(held, name=f"rpc-held-{type(message).__name__}")
                self._held.add(task)
                task.add_done_callback(self._held.discard)
                return
            conn.reply(ErrorReply.from_error(refusal), request_id)
            return
        # A retry resends the same bytes under the same id: the id and the bytes' hash name a request, so
        # two clients whose ids collide (ids drawn from a seeded generator) never get each other's answers.
        self._run(conn, message, request_id, identity, hash(payload))

    def _run(self, conn: _Connection, message: Message, request_id: int, identity: Identity, digest: int) -> None:
        """Dispatch an admitted request: inline, or in a task of the service's for one that waits."""
        coro = self.dispatch(message, request_id, identity, digest)
        if type(message) in _WAITS:
            self._spawn(self._reply_later(conn, coro, request_id), f"rpc-{type(message).__name__}")
            return
        try:
            coro.send(None)
        except StopIteration as done:
            conn.reply(done.value, request_id)
            return
        coro.close()  # a handler outside _WAITS waited: a bug, answered as one
        log.error("handler of %s waited; it belongs in _WAITS", type(message).__name__)
        conn.reply(ErrorReply.from_error(KVStoreError(f"internal error serving {type(message).__name__}")), request_id)

    async def _reply_later(self, conn: _Connection, coro: Coroutine[Any, Any, Message], request_id: int) -> None:
        conn.reply(await coro, request_id)

    async def _serve_when_ready(
        self, conn: _Connection, message: Message, request_id: int, identity: Identity, digest: int
    ) -> None:  # fmt: skip
        """A request that came while this master takes over: run once it is ready (the last inventory
        in), up to ``takeover_hold_ms``, rather than refused and sent again after the client's backoff.
        Run in the term it came in or not at all (then refused: it ran nothing, the client sends it
        again)."""
        epoch = self.leadership.epoch
        try:
            await self.leadership.until_ready(self.config.takeover_hold_ms / 1000)
        finally:
            self.parked -= 1
        refusal = self.leadership.refusal(type(message))
        if refusal is None and self.leadership.epoch != epoch:
            refusal = NotReady(f"master {self.leadership.address} began another term; send the request again")
        if refusal is not None:
            conn.reply(ErrorReply.from_error(refusal), request_id)
            return
        self._run(conn, message, request_id, identity, digest)  # as if it came now

    def _ticket(self, conn: _Connection) -> Message:
        identity = conn.identity
        if self.authority is None or identity is None or identity.tenant is None:
            return ErrorReply.from_error(
                PermissionDenied("tickets are for tenants' connections to a master that authenticates")
            )
        if self.authority.tenant(identity.tenant) is None:  # removed from the tenants file since it logged in
            return ErrorReply.from_error(AuthFailed(f"tenant {identity.tenant!r} is no longer in the tenants file"))
        return self.authority.issue_ticket(identity, conn.key)

    async def dispatch(
        self, message: Message, request_id: int, caller: Identity = ANYONE, digest: int = 0
    ) -> Message:  # fmt: skip
        """The answer to one decoded request from ``caller`` (refusals of leadership aside)."""
        handler = self._handlers.get(type(message))
        if handler is None:
            self.rpc_errors += 1
            return ErrorReply.from_error(ProtocolError(f"the master does not serve {type(message).__name__}"))
        start = time.perf_counter()
        if type(message) in _NOT_IDEMPOTENT and request_id:
            reply = await self._once((caller.name, request_id, digest), handler, message, caller)
        else:
            reply = await self._handle(handler, message, caller)
        op = _TIMED.get(type(message))
        if op is not None:
            self.latency.setdefault(op, LatencyHistogram()).observe(time.perf_counter() - start)
        return reply

    async def _handle(self, handler: Handler, message: Message, caller: Identity) -> Message:
        try:
            return await handler(message, caller)
        except KVStoreError as exc:
            self.rpc_errors += 1
            return ErrorReply.from_error(exc)

    async def _once(self, request_id: RequestId, handler: Handler, message: Message, caller: Identity) -> Message:
        """Run a request that must not happen twice; a retry with its id gets the first answer.

        A client whose connection broke after sending resends the same request id on a new
        connection; without this, a retried put_start would find its own reservation and
        answer "exists" for a block nobody will write.
        """
        known = self.answers.get(request_id)
        if isinstance(known, asyncio.Future):  # being answered: wait for it
            return await asyncio.wait_for(asyncio.shield(known), self.config.command_timeout_ms / 1000 * 2)
        if known is not None:
            return known  # answered already (no wait: inline handlers must not)
        if type(message) not in _WAITS:  # answered before anything else runs: no retry can wait for it
            reply = await self._handle(handler, message, caller)
            self.answers.keep(request_id, reply)
            return reply
        answer = self.answers.start(request_id)
        try:
            reply = await self._handle(handler, message, caller)
        except BaseException:
            self.answers.abandon(request_id, answer)
            raise
        self.answers.finish(request_id, answer, reply)
        return reply

    # -- what only the RPC port answers ----------------------------------------------------------
    async def _stats(self, m: Stats, caller: Identity) -> Message:
        reply = await self.core.stats(m, caller)
        assert isinstance(reply, StatsReply)
        if caller.tenant is None:  # the cluster's own figure: a tenant sees only its own
            reply.stats["rpc_errors"] = self.rpc_errors
            reply.stats["requests_held"] = self.parked_total
        return reply

    async def _admin_info(self, m: AdminInfo, caller: Identity) -> Message:
        return AdminInfoReply(self._admin_address())

    async def _unauthenticated_hello(self, m: AuthHello, caller: Identity) -> Message:
        raise AuthFailed(
            f"master {self.leadership.address} does not authenticate (no cluster secret): connect without a token "
            "or secret"
        )
