"""The master's asyncio service: the RPC server around :class:`kvstore.placement.table.PlacementTable`.

Handlers are looked up by message type. The table is synchronous and only
this event loop touches it, so every handler's table work is atomic. Daemon
commands that a put waits for are awaited; the rest run as supervised
background tasks, and a command a daemon did not answer is retried every
tick until it is answered or its node re-registers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextvars import ContextVar
from typing import Any

import msgspec

from kvstore.auth import ANYONE, Authority, Identity, ServerHandshake, as_refusal, cluster_credential, secret_from
from kvstore.config import MasterConfig
from kvstore.errors import (
    AuthFailed,
    CapacityError,
    ConfigError,
    InvalidArgument,
    KVStoreError,
    NotFound,
    NotLeader,
    NotReady,
    PermissionDenied,
    ProtocolError,
    QuotaExceeded,
    RetryLater,
    Timeout,
)
from kvstore.placement.leases import LeaseId
from kvstore.placement.state import Grant, Move, NodeCommand
from kvstore.placement.table import PlacementTable
from kvstore.policy import ActionKind, EvictionPolicy
from kvstore.protocol import (
    MAX_FRAME_BYTES,
    AccessReport,
    AdminInfo,
    AdminInfoReply,
    AuthHello,
    CommandReply,
    CommitGranted,
    DemoteBlocks,
    DropBlocks,
    EndGrants,
    ErrorReply,
    Exists,
    ExistsReply,
    FetchBlocks,
    FrameDecoder,
    GetReplicas,
    GetReplicasReply,
    GetTicket,
    GrantReply,
    GrantSpace,
    Heartbeat,
    HeartbeatReply,
    KeysReply,
    LeaveNode,
    ListKeys,
    ListNodes,
    MatchPrefix,
    MatchPrefixNodes,
    MatchPrefixNodesReply,
    MatchPrefixReply,
    Message,
    NodesReply,
    OkReply,
    OpenGrant,
    PromoteBlocks,
    PutEnd,
    PutEndReply,
    PutReply,
    PutRevoke,
    PutStart,
    PutStartReply,
    PutTicket,
    RegisterNode,
    RegisterReply,
    ReleaseLeases,
    Remove,
    RemoveReply,
    Replicate,
    Replicated,
    ReplicateReply,
    ReturnGrants,
    Stats,
    StatsReply,
    decode_payload,
    encode,
    request_id_of,
)
from kvstore.ratelog import RateLimitedLog
from server.master.answers import Answers, RequestId
from server.master.election import Election
from server.master.metrics import LatencyHistogram, Sampler
from server.master.nodes import NodeRegistry
from transfer.aio import HANDSHAKE_FRAME, AsyncConnection
from transfer.discovery import EtcdCluster, MasterRecord, parse_endpoints
from transfer.tls import HANDSHAKE_TIMEOUT_S, contexts, server_context
from transfer.topology import warn_if_open

log = logging.getLogger("kvstore.master")

Handler = Callable[[Any], Awaitable[Message]]

# Requests whose handlers wait for daemons (they run in a task; the others are answered inline).
_WAITS: frozenset[type[Message]] = frozenset({PutStart, PutRevoke, GrantSpace, Remove, Replicate})

# Requests whose repetition would change the outcome: their answers are kept for retries.
_NOT_IDEMPOTENT: frozenset[type[Message]] = frozenset(
    {PutStart, PutEnd, PutRevoke, Remove, Replicate, GrantSpace, CommitGranted}
)

# Requests whose master-side latency is kept as a histogram (served at /metrics).
_TIMED: dict[type[Message], str] = {
    PutStart: "put_start", PutEnd: "put_end", GetReplicas: "get_replicas", MatchPrefix: "match_prefix",
    MatchPrefixNodes: "match_prefix_nodes", GrantSpace: "grant_space", CommitGranted: "commit_granted",
}  # fmt: skip

# A daemon's grant deadline runs from when it took the grant; the master's a margin later, so that
# the daemon has stopped taking writes into a grant before the master frees it. (Freeing waits for
# the daemon's EndGrants answer anyway; the margin keeps a lost answer from holding space long.)
_GRANT_MARGIN_MS = 1_000

# What a master answers while it is not ready (taking over: the daemons' inventories still coming in).
_WHILE_NOT_READY: frozenset[type[Message]] = frozenset(
    {RegisterNode, Heartbeat, AccessReport, CommitGranted, Stats, ListNodes, AdminInfo}
)

# A put waits for at most this many rounds of evictions before its keys fail.
_MAX_EVICTION_ROUNDS = 64
_MAX_KEYS_PAGE = 10_000
"""Most keys one ListKeys answers (a page: the table is scanned once per page)."""


def _now_ms() -> int:
    return int(time.monotonic() * 1000)


def _fits(room: int, sizes: list[int]) -> list[bool]:
    """Which blocks, taken in order, fit in ``room`` bytes (a block that does not fit takes none)."""
    fits = []
    for size in sizes:
        fits.append(size <= room)
        if size <= room:
            room -= size
    return fits


_caller: ContextVar[Identity] = ContextVar("caller", default=ANYONE)
"""Who sent the request being handled (set per request; a handler's task keeps its own)."""


class _RpcConnection(asyncio.Protocol):
    """One client's connection: frames are cut from the bytes as they arrive and answered at once.

    A client that stops reading its replies is stopped from sending more (reading pauses while
    the send buffer is over the transport's high-water mark)."""

    def __init__(self, service: MasterService) -> None:
        self.service = service
        self.opened = self.last = time.monotonic()
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        authority = service.authority
        self.identity: Identity | None = ANYONE if authority is None else None
        """Who is at the other end; None until the handshake is done (a master that authenticates)."""
        self.handshake = ServerHandshake(authority) if authority is not None else None
        self.key = b""
        """The key this connection's handshake agreed (masks the session keys of tickets)."""
        # Before authentication a peer can make the master hold one small frame, no more.
        self.decoder = FrameDecoder(HANDSHAKE_FRAME) if authority is not None else FrameDecoder()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport (uvloop's is no subclass)
        service = self.service
        if len(service._connections) >= service.config.max_connections:
            service.refused_connections += 1
            service._failures.warning(
                "refused-connection", "refused a connection: %d open (limit %d); %d refused so far",
                len(service._connections), service.config.max_connections, service.refused_connections,
            )  # fmt: skip
            transport.close()
            return
        service._connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.last = time.monotonic()
        try:
            for payload in self.decoder.feed(data):
                if self.identity is None:
                    self._authenticate(payload)
                    if self.transport.is_closing():
                        return
                    continue
                self.service._serve_payload(self, payload)
        except ProtocolError as exc:
            # An oversize frame leaves the stream out of step: answer, then close.
            self.service.rpc_errors += 1
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
            self.identity, ok, self.key = self.handshake.verify(message)
        except KVStoreError as exc:  # a refusal, or a frame that is no handshake
            self.service.note_auth_failure(self.transport.get_extra_info("peername"), exc)
            self.reply(ErrorReply.from_error(as_refusal(exc)), request_id)
            self.transport.close()
            return
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
        self.service._connections.discard(self)


class MasterService:
    def __init__(self, config: MasterConfig | None = None) -> None:
        self.config = config or MasterConfig()
        secret = secret_from(self.config.cluster_secret_file)
        if self.config.tenants_file is not None and secret is None:
            raise ConfigError("a tenants file needs the cluster secret (cluster_secret_file or KVSTORE_CLUSTER_SECRET):"
                              " the daemons check the master's tickets with it")  # fmt: skip
        self.authority = (
            Authority(secret, self.config.tenants_file, self.config.ticket_ttl_s * 1000) if secret is not None else None
        )
        """What connections authenticate against; None: no authentication (every peer may do anything)."""
        self.auth_failures = 0
        tls = self.config.tls
        self.tls = server_context(tls) if tls is not None else None
        """The context of the RPC port and the admin API (None: plain)."""
        self.nodes = NodeRegistry(
            self._new_table(), self.config.command_timeout_ms / 1000,
            cluster_credential(secret) if secret is not None else None, contexts(tls)[1],
        )  # fmt: skip
        """The nodes, and through them the placement table (:attr:`table`)."""
        self.address = ""
        self.election: Election | None = None
        """Set with ``config.etcd``: this master serves only while it leads."""
        self.epoch = 0
        self._leader_since = 0.0
        self._ready = False
        self._expected: set[str] = set()
        """Nodes the daemons said were in the cluster: a new leader waits for their inventories."""
        self.failovers = 0
        """Times this master took over as leader (HA), or 1 for a master without etcd."""
        self.latency: dict[str, LatencyHistogram] = {}
        self.sampler = Sampler()
        self.admin_address = ""
        """Where the REST admin API (server.master.admin) serves, once whoever runs the master started it."""
        self._retry: list[NodeCommand] = []
        self._failures = RateLimitedLog(log)
        """Failures that repeat every tick (a command a daemon keeps refusing): a line a minute each."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._connections: set[_RpcConnection] = set()
        self._ticker: asyncio.Task[None] | None = None
        self.rpc_errors = 0
        self.refused_connections = 0
        """Connections closed at accept: ``config.max_connections`` were open."""
        self.answers = Answers(self.config.answer_ttl_s, self.config.answer_cache)
        """Answers of requests that must not run twice, by (who sent it, request id)."""
        self._handlers: dict[type[Message], Handler] = {
            RegisterNode: self._register,
            Heartbeat: self._heartbeat,
            LeaveNode: self._leave,
            PutStart: self._put_start,
            PutEnd: self._put_end,
            PutRevoke: self._put_revoke,
            GetReplicas: self._get_replicas,
            ReleaseLeases: self._release_leases,
            GrantSpace: self._grant_space,
            ReturnGrants: self._return_grants,
            CommitGranted: self._commit_granted,
            AccessReport: self._access_report,
            MatchPrefix: self._match_prefix,
            MatchPrefixNodes: self._match_prefix_nodes,
            Replicate: self._replicate,
            Exists: self._exists,
            Remove: self._remove,
            ListKeys: self._list_keys,
            Stats: self._stats,
            ListNodes: self._list_nodes,
            AdminInfo: self._admin_info,
            AuthHello: self._unauthenticated_hello,
        }

    @property
    def table(self) -> PlacementTable:
        """The placement table of this term (a new one each time leadership is lost)."""
        return self.nodes.table

    def _new_table(self) -> PlacementTable:
        ev = self.config.eviction
        return PlacementTable(
            EvictionPolicy(ev.high_watermark, ev.low_watermark, ev.promote_after_hits),
            strategy=self.config.placement,
            reservation_ms=self.config.reservation_ms,
            lease_ms=self.config.lease_ms,
            hold_ms=self.config.kv_lease_ms,
            node_ttl_ms=self.config.node_ttl_ms,
        )

    # -- leadership and readiness --------------------------------------------------------------
    def _become_leader(self, epoch: int) -> None:
        """Lead with an empty table: it is rebuilt from the daemons' inventories as they register.
        Until the nodes they name are back (or ``ready_wait_ms`` passes) requests get NotReady."""
        self.epoch = epoch
        self.nodes.epoch = epoch
        self._leader_since = time.monotonic()
        self._ready = False
        self._expected = set()
        self.failovers += 1

    def _become_standby(self) -> None:
        """Leadership lost: forget everything (a new leader owns the cluster now); a later
        election starts from an empty table again."""
        for task in list(self._tasks):
            task.cancel()
        for link in self.nodes.reset(self._new_table()):
            self._spawn(link.close(), "close-daemon-link")
        self._retry = []
        self.answers.clear()
        self._ready = False

    def ready(self) -> bool:
        """Whether reads and puts can be answered truly: every expected node is back, or some node
        is and the wait for the rest ran out, or none came within three waits (a cluster starting)."""
        if self._ready:
            return True
        nodes = self.table.nodes
        waited = time.monotonic() - self._leader_since
        # A moment for the first daemons' peer lists to come in before "every expected node" holds.
        settle = min(2 * self.config.heartbeat_interval_ms / 1000, 0.2)
        wait = self.config.ready_wait_ms / 1000
        if (
            (nodes and self._expected <= nodes.keys() and waited >= settle)
            or (nodes and waited >= wait)
            or waited >= 3 * wait  # no daemon at all: a cluster still starting (or none left)
        ):
            self._ready = True
            missing = sorted(self._expected - nodes.keys())
            log.info(
                "ready after %.2f s with %d nodes%s", waited, len(nodes),
                f"; still missing {', '.join(missing)}" if missing else "",
            )  # fmt: skip
        return self._ready

    def refusal(self, kind: type[Message] | None = None) -> KVStoreError | None:
        """Why this master must not run a request of ``kind`` now, if it must not (without a
        kind: why it must not answer reads and puts)."""
        election = self.election
        if election is not None and not election.leading():
            leader = election.leader.address if election.leader is not None else "not elected yet"
            return NotLeader(
                f"master {self.address} does not lead cluster {election.cluster.cluster_id} (leader: {leader})"
            )
        if not self._ready and (kind is None or kind not in _WHILE_NOT_READY) and not self.ready():
            return NotReady(
                f"master {self.address} is taking over: waiting for the inventories of "
                f"{len(self._expected - self.table.nodes.keys()) or 'its'} nodes"
            )
        return None

    def role(self) -> dict[str, Any]:
        """Leadership as the admin API and /metrics show it."""
        base = {"ready": self.refusal() is None, "failovers": self.failovers}
        if self.election is None:
            return {
                **base, "role": "leader", "ha": False, "epoch": 0, "leader": self.address, "elections_won": 0,
                "leadership_lost": 0, "etcd_errors": 0, "etcd": [], "etcd_reachable": False, "cluster_id": "",
            }  # fmt: skip
        return {**base, "ha": True, **self.election.status()}

    # -- lifecycle ------------------------------------------------------------------------
    @staticmethod
    def now_ms() -> int:
        return _now_ms()

    def run_commands_later(self, commands: list[NodeCommand], name: str) -> None:
        self._run_later(commands, name)

    async def drain(self, node_id: str, batch: int = 256) -> int:
        """Take ``node_id`` out of placement and move its blocks to other nodes; returns the blocks left on it.

        A block with a copy elsewhere loses this one; another is copied by a node with room
        (the target reads it from this node's daemon), then dropped here. Blocks nobody has
        room for stay (and are counted in the answer); a later drain tries again."""
        table = self.table
        if node_id not in table.nodes:
            raise NotFound(f"node {node_id!r} is not registered")
        table.start_drain(node_id)
        source = table.nodes[node_id].address
        failed: set[str] = set()
        while True:
            moves, drops = table.plan_moves(node_id, batch, skip=failed)
            if not moves and not drops:
                break
            await self._run_commands(drops, table)
            self._same_term(table, "the drain")
            per_target: dict[str, list[Move]] = {}
            for move in moves:
                per_target.setdefault(move.target, []).append(move)
            for target, group in per_target.items():
                got = await self._fetch(target, source, group, "drain")
                done = got or [False] * len(group)
                self._same_term(table, "the drain")
                failed.update(m.key for m, ok in zip(group, done, strict=True) if not ok)
                await self._run_commands(table.finish_moves(node_id, group, done, answered=got is not None), table)
                self._same_term(table, "the drain")
        return table.blocks_on(node_id)

    def _same_term(self, table: PlacementTable, what: str) -> None:
        """Raise NotLeader when ``table`` is no longer this master's (leadership lost meanwhile)."""
        if table is not self.table:
            raise NotLeader(f"master {self.address} lost its leadership during {what}; ask the leader")

    async def _fetch(self, target: str, source_address: str, group: list[Move], why: str) -> list[bool] | None:
        """Have ``target``'s daemon copy ``group`` from the daemon at ``source_address`` into the extents
        reserved for it; per block whether it is committed there, None when the target did not answer."""
        message = FetchBlocks(
            source_address, [m.key for m in group], [m.extent.offset for m in group], [m.size for m in group],
            [m.checksum for m in group], [m.pinned for m in group],
        )  # fmt: skip
        try:
            done = (await self._daemon(target).call(message, CommandReply)).done
        except KVStoreError as exc:
            log.warning("%s: %s could not copy from %s: %s", why, target, source_address, exc)
            return None
        return done if len(done) == len(group) else [False] * len(group)

    async def replicate(self, keys: list[str], node_id: str, max_bytes: int) -> Replicated:
        """Copy stored blocks into the DRAM of ``node_id``, keeping their other replicas; returns the
        blocks and bytes copied. See :meth:`PlacementTable.plan_replicas` for which are taken."""
        table = self.table
        moves = table.plan_replicas(keys, node_id, max_bytes)
        per_source: dict[str, list[Move]] = {}
        for move in moves:
            per_source.setdefault(move.source, []).append(move)
        # Addresses now, before any await: a source that leaves meanwhile fails its copies in its daemon.
        todo = [(table.nodes[source].address, group) for source, group in per_source.items()]
        copied: list[Move] = []

        def finish(group: list[Move], done: list[bool] | None) -> None:
            made, drops = table.finish_replicas(group, done or [False] * len(group), answered=done is not None)
            copied.extend(made)
            self._run_later(drops, "replicate-drops", table)

        try:
            while todo:  # one source after another: the target's connection serialises them anyway
                address, group = todo[0]
                done = await self._fetch(node_id, address, group, "replicate")
                todo.pop(0)
                finish(group, done)
        finally:
            for _, group in todo:  # cancelled: the target may hold what it was copying
                finish(group, None)
        return Replicated(len(copied), sum(m.size for m in copied))

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _RpcConnection(self), self.config.host, self.config.port, ssl=self.tls,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if self.tls is not None else None,
        )  # fmt: skip
        self._ticker = asyncio.create_task(self._tick_forever(), name="master-ticker")
        port = self._server.sockets[0].getsockname()[1]
        if self.authority is None:
            warn_if_open(log, "the master", self.config.host, port)
        self.address = self.config.advertise or f"{self.config.host}:{port}"
        if self.config.etcd is None:
            self._become_leader(0)
        return f"{self.config.host}:{port}"

    def start_election(self, admin_address: str | None) -> None:
        """Campaign in etcd (``config.etcd``); until elected this master answers NotLeader."""
        assert self.config.etcd is not None and self.config.cluster_id is not None
        cluster = EtcdCluster(parse_endpoints(self.config.etcd), self.config.cluster_id)
        self.election = Election(
            cluster, MasterRecord(self.address, admin_address), self.config.etcd_lease_ttl_s,
            on_leader=self._become_leader, on_standby=self._become_standby,
        )  # fmt: skip
        self.election.start()

    async def stop(self) -> None:
        if self.election is not None:
            await self.election.stop()  # resigns: a standby takes over without waiting for the lease
        if self._server is not None:
            self._server.close()
        for client in list(self._connections):
            client.transport.close()
        if self._ticker is not None:
            self._ticker.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *(t for t in [self._ticker] if t), return_exceptions=True)
        for link in self.nodes.links() + self.nodes.take_stale():
            await link.close()

    def _spawn(self, coro: Awaitable[object], name: str) -> None:
        """Run ``coro`` in the background; its failure is logged, never lost."""

        async def supervised() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background task %s failed", name)

        task = asyncio.create_task(supervised(), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_ms / 1000)
            try:
                commands = self.table.expire(_now_ms())
                for node_id, grant_ids in self.table.expired_grants(_now_ms()).items():
                    self._spawn(self._close_grants(node_id, grant_ids), "grant-expiry")
                self.answers.prune()  # an idle master too keeps no reply past its time
                retry, self._retry = self._retry, []
                live = [c for c in retry if c.node_id in self.table.nodes and self.table.nodes[c.node_id].up]
                self._run_later(commands + live, "expiry-commands")
                now = time.monotonic()
                idle_since, unproven_since = now - self.config.idle_timeout_s, now - HANDSHAKE_TIMEOUT_S
                for conn in [c for c in self._connections
                             if c.last < idle_since or (c.identity is None and c.opened < unproven_since)]:  # fmt: skip
                    conn.transport.close()  # idle, or no handshake done in time
                if self.sampler.due():
                    stats = self.table.stats()
                    self.sampler.sample(self.table.counters, int(stats["dram_used"]), int(stats["ssd_used"]))
            except Exception:
                log.exception("master tick failed")

    # -- connections ------------------------------------------------------------------------
    def _serve_payload(self, conn: _RpcConnection, payload: bytes) -> None:
        """Answer one request. A handler that never waits (most: the table is synchronous) runs to
        its end right here, with no task and no turn of the event loop; the others (those that
        wait for daemons) run in a task. Replies carry their request ids, so they may overtake
        each other."""
        try:
            request_id, message = decode_payload(payload)
        except ProtocolError as exc:
            self.rpc_errors += 1
            conn.reply(ErrorReply.from_error(exc), request_id_of(payload))
            return
        identity = conn.identity
        assert identity is not None
        if identity.tenant is not None:
            try:
                message = identity.admit(message)
            except KVStoreError as exc:
                conn.reply(ErrorReply.from_error(exc), request_id)
                return
        if isinstance(message, GetTicket):
            conn.reply(self._ticket(conn), request_id)
            return
        refusal = self.refusal(type(message))
        if refusal is not None:
            conn.reply(ErrorReply.from_error(refusal), request_id)
            return
        _caller.set(identity)  # the handler's task (if any) takes a copy
        # A retry resends the same bytes under the same id: the id and the bytes' hash name a request, so
        # two clients whose ids collide (ids drawn from a seeded generator) never get each other's answers.
        coro = self._dispatch(message, request_id, identity.name, hash(payload))
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

    async def _reply_later(
        self, conn: _RpcConnection, coro: Coroutine[Any, Any, Message], request_id: int
    ) -> None:  # fmt: skip
        conn.reply(await coro, request_id)

    def _ticket(self, conn: _RpcConnection) -> Message:
        identity = conn.identity
        if self.authority is None or identity is None or identity.tenant is None:
            return ErrorReply.from_error(
                PermissionDenied("tickets are for tenants' connections to a master that authenticates")
            )
        if self.authority.tenant(identity.tenant) is None:  # removed from the tenants file since it logged in
            return ErrorReply.from_error(AuthFailed(f"tenant {identity.tenant!r} is no longer in the tenants file"))
        return self.authority.issue_ticket(identity, conn.key)

    def note_auth_failure(self, peer: object, exc: KVStoreError) -> None:
        """Count a refused handshake; log it at most once a minute (a peer guessing must not flood the log)."""
        self.auth_failures += 1
        self._failures.warning(
            "auth-failure", "refused a connection from %s: %s (%d refused so far)", peer, exc, self.auth_failures
        )

    async def _dispatch(self, message: Message, request_id: int, who: str = "", digest: int = 0) -> Message:
        handler = self._handlers.get(type(message))
        if handler is None:
            self.rpc_errors += 1
            return ErrorReply.from_error(ProtocolError(f"the master does not serve {type(message).__name__}"))
        start = time.perf_counter()
        if type(message) in _NOT_IDEMPOTENT and request_id:
            reply = await self._once((who, request_id, digest), handler, message)
        else:
            reply = await self._handle(handler, message)
        op = _TIMED.get(type(message))
        if op is not None:
            self.latency.setdefault(op, LatencyHistogram()).observe(time.perf_counter() - start)
        return reply

    async def _handle(self, handler: Handler, message: Message) -> Message:
        try:
            return await handler(message)
        except KVStoreError as exc:
            self.rpc_errors += 1
            return ErrorReply.from_error(exc)

    async def _once(self, request_id: RequestId, handler: Handler, message: Message) -> Message:
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
        answer = self.answers.start(request_id)
        try:
            reply = await self._handle(handler, message)
        except BaseException:
            self.answers.abandon(request_id, answer)
            raise
        self.answers.finish(request_id, answer, reply)
        return reply

    # -- daemon commands ---------------------------------------------------------------------
    def _daemon(self, node_id: str) -> AsyncConnection:
        return self.nodes.link(node_id)

    def _run_later(self, commands: list[NodeCommand], name: str, table: PlacementTable | None = None) -> None:
        """Carry ``commands`` (planned on ``table``, the current one by default) out in the
        background (nothing waits for them)."""
        if commands:
            self._spawn(self._run_commands(commands, table or self.table), name)

    async def _run_commands(self, commands: list[NodeCommand], table: PlacementTable | None = None) -> bool:
        """Send commands (each node's in order, nodes in parallel) and apply the answers; whether
        every node answered (the others' are retried later). Commands planned on ``table`` are
        void once it is not the table of this term (leadership was lost meanwhile): a new term
        plans its own from the daemons' inventories."""
        table = table or self.table
        per_node: dict[str, list[NodeCommand]] = {}
        for c in commands:
            per_node.setdefault(c.node_id, []).append(c)
        return all(await asyncio.gather(*(self._run_node_commands(cs, table) for cs in per_node.values())))

    async def _run_node_commands(self, commands: list[NodeCommand], table: PlacementTable) -> bool:
        for i, command in enumerate(commands):
            if table is not self.table:
                return True  # void: another term's table (nothing to retry)
            if command.node_id not in table.nodes:
                continue
            message: Message
            if command.kind is ActionKind.DEMOTE:
                message = DemoteBlocks(list(command.keys))
            elif command.kind is ActionKind.PROMOTE:
                message = PromoteBlocks(list(command.keys), list(command.offsets))
            else:
                message = DropBlocks(
                    list(command.keys), command.tier.value if command.tier_only else "", list(command.offsets)
                )
            try:
                reply = await self._daemon(command.node_id).call(message, CommandReply)
            except KVStoreError as exc:
                self._failures.warning(f"command-{command.kind.value}-{command.node_id}",
                                       "command %s to %s failed (%s); will retry", command.kind.value,
                                       command.node_id, exc)  # fmt: skip
                if table is self.table:
                    self._retry.extend(commands[i:])
                return False
            if table is not self.table:
                return True  # answered to a term that ended while it ran: the new one rebuilds
            table.apply(command, reply.done)
        return True

    async def _close_grants(self, node_id: str, grant_ids: list[int]) -> None:
        """Have the daemon stop taking writes into ``grant_ids``, then free what is left of them.

        Unanswered, the grants stay held (nothing can be written into space handed out again);
        they are asked again at the next tick, and a re-registration of the node drops them."""
        if node_id in self.table.nodes:
            try:
                await self._daemon(node_id).call(EndGrants(grant_ids), CommandReply)
            except KVStoreError as exc:
                log.warning("closing grants on %s failed (%s); will retry", node_id, exc)
                for grant_id in grant_ids:
                    grant = self.table.grants.get(grant_id)
                    if grant is not None:
                        grant.ending = False
                        grant.deadline_ms = 0  # expired again at the next tick
                return
        self.table.finish_end_grants(node_id, grant_ids)

    # -- handlers -------------------------------------------------------------------------------
    async def _register(self, m: RegisterNode) -> Message:
        commands = self.nodes.register(m, _now_ms())
        for link in self.nodes.take_stale():
            self._spawn(link.close(), "close-daemon-link")
        self._retry = [c for c in self._retry if c.node_id != m.node_id]  # the inventory superseded them
        self._run_later(commands, "register-drops")
        if not self._ready:
            self._expected.update(p for p in m.peers if p)
        log.info("node %s registered at %s with %d blocks", m.node_id, m.address, len(m.inventory))
        return RegisterReply(self.config.heartbeat_interval_ms, self.config.node_ttl_ms, self.epoch, self._peers())

    async def _leave(self, m: LeaveNode) -> Message:
        commands = self.nodes.leave(m.node_id)
        for link in self.nodes.take_stale():
            self._spawn(link.close(), "close-daemon-link")
        self._retry = [c for c in self._retry if c.node_id != m.node_id]
        self._run_later(commands, "leave-revokes")
        log.info("node %s left: its blocks are forgotten", m.node_id)
        return OkReply()

    def _peers(self) -> list[str]:
        return [n.node_id for n in self.table.up_nodes()]

    async def _heartbeat(self, m: Heartbeat) -> Message:
        known = self.nodes.heartbeat(m.node_id, m.transfer_bytes, _now_ms())
        if known:
            self.table.ssd_health(m.node_id, m.ssd_capacity, m.ssd_configured, m.ssd_fault)
        return HeartbeatReply(known, self._peers() if known else [])

    async def _put_start(self, m: PutStart) -> Message:
        keys, sizes = list(m.keys), list(m.sizes)
        if len(keys) != len(sizes):
            raise InvalidArgument(f"put_start got {len(keys)} keys but {len(sizes)} sizes")
        tickets: list[PutTicket | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        tenant = _caller.get().tenant
        quota = self._quota(tenant) if tenant is not None else 0
        if tenant is not None and quota:
            for i in await self._over_quota(tenant, quota, keys, sizes):
                text = self._quota_text(tenant, quota, keys[i], sizes[i])
                tickets[i] = PutTicket("error", [], QuotaExceeded.code, text)
            todo = [i for i in todo if tickets[i] is None]
        for _ in range(_MAX_EVICTION_ROUNDS):
            plan = self.table.put_start(
                [keys[i] for i in todo], [sizes[i] for i in todo], m.replicas, m.preferred_node, m.pin, _now_ms()
            )
            for j, ticket in zip(todo, plan.tickets, strict=True):
                tickets[j] = PutTicket.from_ticket(ticket) if ticket is not None else None
            todo = [todo[w] for w in plan.waiting]
            if not todo:
                self._run_later(plan.commands, "background-eviction")
                break
            if plan.commands:
                await self._run_commands(plan.commands)
            else:
                await asyncio.sleep(0.005)  # room is coming from commands another request sent
        stuck = PutTicket("error", [], CapacityError.code, "no room after repeated rounds of eviction")
        final = [t if t is not None else stuck for t in tickets]
        if tenant is not None and self.authority is not None:
            final = self._sealed(tenant, keys, sizes, final)
        return PutStartReply.from_tickets(final)

    def _sealed(self, tenant: str, keys: list[str], sizes: list[int], tickets: list[PutTicket]) -> list[PutTicket]:
        """``tickets`` with each replica sealed for ``tenant``: daemons take a tenant's writes only
        into extents the master reserved for it (no squatting on free space or others' reservations)."""
        assert self.authority is not None
        expires = int(time.time() * 1000) + self.config.reservation_ms  # wall clock: daemons check it
        seal = self.authority.seal
        return [
            msgspec.structs.replace(t, replicas=[
                msgspec.structs.replace(r, seal=seal(tenant, r.node_id, key, r.offset, size, expires))
                for r in t.replicas
            ]) if t.replicas else t
            for t, key, size in zip(tickets, keys, sizes, strict=True)
        ]  # fmt: skip

    # -- tenants' quotas ----------------------------------------------------------------------
    def _quota(self, tenant: str) -> int:
        """The tenant's byte quota (0: none)."""
        known = self.authority.tenant(tenant) if self.authority is not None else None
        return known.quota_bytes if known is not None else 0

    def _quota_text(self, tenant: str, quota: int, key: str, size: int) -> str:
        return (
            f"block {key[len(tenant) + 1 :]!r} of {size} bytes would take tenant {tenant!r} past its quota of "
            f"{quota} bytes ({self.table.usage(tenant)} held, none of it evictable)"
        )

    async def _over_quota(self, tenant: str, quota: int, keys: list[str], sizes: list[int]) -> list[int]:
        """Indexes of the new keys of a tenant's put that do not fit its ``quota``, after its own least
        recently used blocks were evicted for them (another tenant's blocks are never touched)."""
        table = self.table
        new = [i for i, k in enumerate(keys) if k not in table.objects and table.describe(k) is None]
        over = table.usage(tenant) + sum(sizes[i] for i in new) - quota
        if over > 0:
            victims = table.tenant_victims(tenant, over, keep=set(keys))
            if victims:
                _, _, commands = table.evict_keys(victims)
                await self._run_commands(commands)
        fits = _fits(quota - self.table.usage(tenant), [sizes[i] for i in new])
        return [i for i, ok in zip(new, fits, strict=True) if not ok]

    async def _put_end(self, m: PutEnd) -> Message:
        committed = self.table.put_end(m.keys, m.checksums)
        # A put begun with a master that has since gone: its block came back in its daemon's
        # inventory when the daemon registered here (the same bytes: the same checksum).
        objects = self.table.objects
        return PutEndReply([
            ok or ((e := objects.get(k)) is not None and e.committed and e.checksum == c)
            for k, c, ok in zip(m.keys, m.checksums, committed, strict=True)
        ])  # fmt: skip

    async def _put_revoke(self, m: PutRevoke) -> Message:
        commands = self.table.put_revoke(m.keys)
        self._run_later(commands, "revoke-drops")
        unknown = [k for k in m.keys if self.table.describe(k) is None]
        if unknown:
            # Reserved by a master that has since gone, so nobody knows where it was written: every
            # node drops it, before the writer's retry can store it anew.
            nodes = [n.node_id for n in self.table.up_nodes()]
            answers = await asyncio.gather(
                *(self._daemon(n).call(DropBlocks(unknown), CommandReply) for n in nodes), return_exceptions=True
            )
            if any(isinstance(a, BaseException) for a in answers):
                raise RetryLater("a node did not confirm dropping a put begun with an earlier master")
        return OkReply()

    async def _get_replicas(self, m: GetReplicas) -> Message:
        if m.release:
            await self._release_leases(ReleaseLeases(m.release))
        return GetReplicasReply.from_lookup(self.table.get_replicas(m.keys, _now_ms(), m.lease))

    async def _grant_space(self, m: GrantSpace) -> Message:
        """Reserve write space on one node (evicting first where needed) and open it on its daemon."""
        table = self.table
        owner = _caller.get().tenant or ""
        grant: Grant | None = None
        for _ in range(_MAX_EVICTION_ROUNDS):
            capped = m.length
            if table.nodes:
                largest = max(n.alloc.capacity for n in table.nodes.values())
                capped = min(m.length, max(int(largest * self.config.grant_fraction), 1))
            plan = table.grant_space(capped, m.preferred_node, self.config.grant_ttl_ms, _now_ms(), owner)
            if plan.error is not None:
                raise plan.error
            if plan.grant is not None:
                self._run_later(plan.commands, "background-eviction")
                grant = plan.grant
                break
            if plan.commands:
                await self._run_commands(plan.commands)
            else:
                await asyncio.sleep(0.005)
        if grant is None:
            raise CapacityError(f"no room for a grant of {m.length} bytes after repeated rounds of eviction")
        extent = grant.pieces[0]
        ttl = self.config.grant_ttl_ms
        try:
            await self._daemon(grant.node_id).call(
                OpenGrant(grant.grant_id, extent.offset, extent.length, ttl, owner), CommandReply
            )
        except BaseException:
            # The daemon may have taken it: close it there before the space is reused.
            for node_id, ids in table.end_grants([grant.grant_id]).items():
                self._spawn(self._close_grants(node_id, ids), "grant-close")
            raise
        if grant.grant_id not in table.grants:
            # The node re-registered meanwhile (its grants are forgotten, its space maybe handed
            # out again): the daemon must not keep this one.
            self._spawn(self._close_grants(grant.node_id, [grant.grant_id]), "grant-close")
            raise RetryLater(f"node {grant.node_id} re-registered while a grant was opened on it; retry")
        table.confirm_grant(grant.grant_id, _now_ms() + ttl + _GRANT_MARGIN_MS)
        node = table.nodes[grant.node_id]
        return GrantReply(
            grant.grant_id, grant.node_id, node.address, extent.offset, extent.length, ttl, node.alloc.alignment
        )

    async def _return_grants(self, m: ReturnGrants) -> Message:
        owner = _caller.get().tenant
        grants = self.table.grants
        ids = m.grant_ids if owner is None else [g for g in m.grant_ids if g in grants and grants[g].owner == owner]
        for node_id, grant_ids in self.table.end_grants(ids).items():
            self._spawn(self._close_grants(node_id, grant_ids), "grant-return")
        return OkReply()

    async def _commit_granted(self, m: CommitGranted) -> Message:
        grant = self.table.grants.get(m.grant_id)
        owner = grant.owner if grant is not None else ""
        quota = self._quota(owner) if owner else 0
        if quota and len(m.keys) == len(m.sizes):
            # Over its quota, a tenant's one-trip put goes the two-trip way, which evicts its own
            # blocks for it or refuses it with QuotaExceeded.
            fits = _fits(quota - self.table.usage(owner), m.sizes)
            if not all(fits):
                keep = [i for i, ok in enumerate(fits) if ok]
                part = self.table.commit_granted(
                    m.node_id, m.grant_id, [m.keys[i] for i in keep], [m.offsets[i] for i in keep],
                    [m.sizes[i] for i in keep], [m.checksums[i] for i in keep], m.pinned,
                )  # fmt: skip
                outcome = [(QuotaExceeded.code, f"tenant {owner!r} is at its quota")] * len(m.keys)
                for i, result in zip(keep, part, strict=True):
                    outcome[i] = result
                return PutReply([code for code, _ in outcome], [text for _, text in outcome])
        outcome = self.table.commit_granted(m.node_id, m.grant_id, m.keys, m.offsets, m.sizes, m.checksums, m.pinned)
        return PutReply([code for code, _ in outcome], [text for _, text in outcome])

    async def _access_report(self, m: AccessReport) -> Message:
        self.table.record_access(m.node_id, m.keys, m.tiers, _now_ms())
        return OkReply()

    async def _release_leases(self, m: ReleaseLeases) -> Message:
        lease_ids = m.lease_ids
        tenant = _caller.get().tenant
        if tenant is not None:  # a tenant ends its own leases only (ids are sequential: guessable)
            leases, prefix = self.table.leases, f"{tenant}/"
            lease_ids = [i for i in lease_ids if (leases.key_of(LeaseId(i)) or "").startswith(prefix)]
        commands = self.table.release_leases(lease_ids)
        self._run_later(commands, "promotions")
        return OkReply()

    async def _match_prefix(self, m: MatchPrefix) -> Message:
        return MatchPrefixReply(self.table.match_prefix(m.keys))

    async def _match_prefix_nodes(self, m: MatchPrefixNodes) -> Message:
        return MatchPrefixNodesReply.from_match(self.table.match_prefix_nodes(m.keys))

    async def _replicate(self, m: Replicate) -> Message:
        return ReplicateReply(*await self.replicate(m.keys, m.node_id, m.max_bytes))

    async def _exists(self, m: Exists) -> Message:
        return ExistsReply(self.table.exists(m.keys, _now_ms()))

    async def _remove(self, m: Remove) -> Message:
        """Answered once the daemons dropped the blocks: a reader that goes straight to a daemon
        (no lease, no master) must find nothing after remove returns. A daemon that does not answer
        gets its drop retried; it serves nobody meanwhile."""
        keys, held = m.keys, []
        if not m.force and self.table.hold_ms:
            held = self.table.held(keys, _now_ms())
            if held:
                skip = set(held)
                keys = [k for i, k in enumerate(keys) if i not in skip]
        removed, commands = self.table.remove(keys)
        if not await self._run_commands(commands):
            # The blocks are out of the table, but a daemon that did not confirm may still serve
            # them to a reader that goes to it directly: say so (the drop is retried until done).
            raise Timeout("a node holding removed blocks did not confirm dropping them yet; they are retried")
        return RemoveReply(removed, held)

    async def _list_keys(self, m: ListKeys) -> Message:
        if not 1 <= m.limit <= _MAX_KEYS_PAGE:
            raise InvalidArgument(f"ListKeys.limit must be from 1 to {_MAX_KEYS_PAGE}, got {m.limit}")
        scope = _caller.get().prefix  # a tenant lists its own namespace, and sees its keys as it named them
        keys, after = self.table.keys_page(scope + m.prefix, scope + m.after if m.after else None, m.limit)
        cut = len(scope)
        return KeysReply([k[cut:] for k in keys], after[cut:] if after is not None else "")

    async def _list_nodes(self, m: ListNodes) -> Message:
        """Every registered node with how to reach it, up or down."""
        return NodesReply(self.nodes.infos())

    async def _unauthenticated_hello(self, m: AuthHello) -> Message:
        raise AuthFailed(
            f"master {self.address} does not authenticate (no cluster secret): connect without a token or secret"
        )

    async def _admin_info(self, m: AdminInfo) -> Message:
        return AdminInfoReply(self.admin_address)

    async def _stats(self, m: Stats) -> Message:
        stats = self.table.stats()
        stats["rpc_errors"] = self.rpc_errors
        return StatsReply(stats)
