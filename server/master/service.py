"""The master: its RPC port and admin API over one core, assembled and kept ticking.

The parts, each with one job: :mod:`server.master.core` (what every request does to the placement
table and the daemons), :mod:`server.master.rpc` (connections, handshake, dispatch, idempotency),
:mod:`server.master.commands` (daemon commands: lanes, retries, fencing), :mod:`server.master.leadership`
(election, terms, readiness) and :mod:`server.master.nodes` (membership and daemon links). This
module builds them, starts and stops them, runs the tick, and gives the admin API
(:mod:`server.master.admin`) the one object it reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable
from typing import Any

from kvstore.auth import Authority, cluster_credential, secret_from
from kvstore.config import MasterConfig
from kvstore.errors import ConfigError, KVStoreError
from kvstore.placement.table import PlacementTable
from kvstore.policy import EvictionPolicy
from kvstore.protocol import Message, OkReply, TenantsPolicy
from kvstore.ratelog import RateLimitedLog
from kvstore.tenants import is_legacy
from server.master.answers import Answers
from server.master.commands import Commands, Lane
from server.master.core import MasterCore, now_ms
from server.master.events import KVEventPublisher
from server.master.evictions import EvictionLog
from server.master.leadership import Leadership
from server.master.metrics import LatencyHistogram, LoopStalls, Sampler
from server.master.nodes import NodeRegistry
from server.master.probes import Prober
from server.master.rpc import RpcServer
from transfer.tls import contexts, server_context
from transfer.topology import warn_if_open

POLICY_EVERY_S = 5.0
"""Every node is told the tenants' policy again this often, changed or not."""

log = logging.getLogger("kvstore.master")


class MasterService:
    """One master process's service (see the module's text)."""

    def __init__(self, config: MasterConfig | None = None) -> None:
        self.config = config = config or MasterConfig()
        secret = secret_from(config.cluster_secret_file)
        if config.tenants_file is not None and secret is None:
            raise ConfigError("a tenants file needs the cluster secret (cluster_secret_file or KVSTORE_CLUSTER_SECRET):"
                              " the daemons check the master's tickets with it")  # fmt: skip
        self.authority = (
            Authority(secret, config.tenants_file, config.ticket_ttl_s * 1000) if secret is not None else None
        )
        """What connections authenticate against; None: no authentication (every peer may do anything)."""
        if self.authority is not None:
            self.authority.default_max_sessions = config.tenant_max_sessions
            self.authority.default_max_inflight = config.tenant_max_inflight_bytes
        tls = config.tls
        self.tls = server_context(tls) if tls is not None else None
        """The context of the RPC port and the admin API (None: plain)."""
        self.nodes = NodeRegistry(
            self._new_table(), config.command_timeout_ms / 1000,
            cluster_credential(secret) if secret is not None else None, contexts(tls)[1], config.key_lease / 1000,
        )  # fmt: skip
        """The nodes, and through them the placement table (:attr:`table`)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._etcd_failures = RateLimitedLog(log)
        self.leadership = Leadership(config, lambda: set(self.nodes.table.nodes))
        self.leadership.on_ready = self._note_missing
        self._loading_absent = False
        self.commands = Commands(self.nodes, self._spawn, self.config.reservation_ms)
        self.stalls = LoopStalls()
        """How long the event loop went without turning (the longest wait any client had for another's work)."""
        self.prober = Prober(self.commands, self._spawn, enabled=config.fence_refused,
                             heartbeat_ms=config.heartbeat_interval_ms, stalled_s=self.stalls.recent_s)  # fmt: skip
        """Fences nodes whose daemon is gone without waiting out their TTL."""
        self.commands.unreachable = lambda node_id: self.prober.suspect(node_id, "a command could not reach it")
        self.core = MasterCore(config, self.nodes, self.commands, self.leadership, self.authority)
        self.core.prober = self.prober
        self.admin_address = ""
        """Where the REST admin API (server.master.admin) serves, once whoever runs the master started it."""
        self.rpc = RpcServer(config, self.core, self.leadership, self.authority, self.tls, self._spawn,
                             lambda: self.admin_address)  # fmt: skip
        self.sampler = Sampler()
        self.core.loop_stall_max = lambda: self.stalls.max_s
        self.evictions = EvictionLog(config.eviction_log)
        self.events = (
            KVEventPublisher(config.kv_events, config.kv_events_replay, buffer=config.kv_events_buffer,
                             buffer_bytes=config.kv_events_buffer_bytes, topic=config.kv_events_topic)
            if config.kv_events is not None
            else None
        )  # fmt: skip
        """The KV events publisher (``--kv-events``); None when not asked for."""
        self.events_bound: tuple[str, str | None] | None = None
        """Where the KV events publish and replay, once started."""
        self._ticker: asyncio.Task[None] | None = None
        self._stall_probe: asyncio.Task[None] | None = None
        self._policy: TenantsPolicy | None = None
        self._policy_at = 0.0
        self._policy_loads = 0
        self._policy_told: set[str] = set()
        """Nodes told the current tenants' policy."""

    # -- what the admin API and /metrics read ------------------------------------------------------
    @property
    def table(self) -> PlacementTable:
        """The placement table of this term (a new one each time leadership is lost)."""
        return self.nodes.table

    @property
    def answers(self) -> Answers:
        return self.rpc.answers

    @property
    def latency(self) -> dict[str, LatencyHistogram]:
        return self.rpc.latency

    @property
    def rpc_errors(self) -> int:
        return self.rpc.rpc_errors

    @property
    def refused_connections(self) -> int:
        return self.rpc.refused_connections

    @property
    def requests_held(self) -> int:
        return self.rpc.parked_total

    def security(self) -> dict[str, int]:
        """Counters of refusals and revocations, and whether the tenants file loads, for /metrics."""
        authority = self.rpc.authority
        return {
            "auth_failures": self.rpc.auth_failures,
            "revoked_sessions": self.rpc.revoked_sessions,
            "stalled_frames": self.rpc.stalled_frames,
            "refused_inflight": self.rpc.refused_inflight,
            "refused_sessions": self.rpc.refused_sessions,
            "tenants_file_errors": authority.file_errors if authority is not None else 0,
            "tenants_file_bad": 1 if authority is not None and authority.file_error else 0,
            "legacy_verifiers": sum(is_legacy(t.stored_key) for t in authority.refresh_tenants().values())
            if authority is not None and authority.takes_tokens
            else 0,
        }

    def quotas(self) -> dict[str, int]:
        """Each tenant that has a quota, and its quota in bytes (for /metrics)."""
        authority = self.rpc.authority
        if authority is None or not authority.takes_tokens:
            return {}
        return {name: t.quota_bytes for name, t in authority.refresh_tenants().items() if t.quota_bytes}

    def leader_admin(self) -> str | None:
        """The admin API of the master that leads, when that is another one (None: this one leads, or
        it knows of no leader, or the leader serves no admin API)."""
        election = self.leadership.election
        if election is None or election.leading():
            return None
        leader = election.leader
        if leader is None or leader.address == self.leadership.address:
            return None
        return leader.admin

    def tenant_usage(self) -> list[dict[str, Any]]:
        """Each tenant of the tenants file: bytes held against its quota (0: none), sessions open on
        this master, and requests to it (so far, and per second lately)."""
        authority = self.rpc.authority
        if authority is None or not authority.takes_tokens:
            return []
        sessions = Counter(c.identity.tenant for c in self.rpc.connections if c.identity is not None)
        rates = self.sampler.tenant_rates()
        return [
            {"tenant": name, "held_bytes": self.table.accounts.tenant_held(name), "quota_bytes": t.quota_bytes,
             "sessions": sessions.get(name, 0), "requests": self.rpc.tenant_requests.get(name, 0),
             "requests_per_s": round(rates.get(name, 0.0), 2)}
            for name, t in sorted(authority.refresh_tenants().items())
        ]  # fmt: skip

    def tenants_file_error(self) -> str:
        """Why the tenants file does not load now ("" when it does, or there is none)."""
        authority = self.rpc.authority
        return authority.file_error if authority is not None else ""

    def refusal(self, kind: type[Message] | None = None) -> KVStoreError | None:
        return self.leadership.refusal(kind)

    def role(self) -> dict[str, Any]:
        return self.leadership.role()

    @staticmethod
    def now_ms() -> int:
        return now_ms()

    # -- terms ----------------------------------------------------------------------------------
    def _new_table(self) -> PlacementTable:
        ev = self.config.eviction
        table = PlacementTable(
            EvictionPolicy(ev.high_watermark, ev.low_watermark, ev.promote_after_hits),
            strategy=self.config.placement,
            reservation_ms=self.config.reservation_ms,
            lease_ms=self.config.lease_ms,
            hold_ms=self.config.kv_lease_ms,
            node_ttl_ms=self.config.node_ttl_ms,
            # Tenants' quotas evict by owner; without tenants that index is 40-odd bytes a key for nothing.
            keys_by_owner=self.authority is not None,
        )
        if self.authority is not None:
            table.accounts.set_tenants(self.authority.refresh_tenants())
        return table

    def _become_leader(self, epoch: int) -> None:
        """Lead with an empty table: it is rebuilt from the daemons' inventories as they register.
        Until the nodes they name are back (or ``ready_wait_ms`` passes) requests get NotReady."""
        self.nodes.epoch = epoch
        self.leadership.begin_term(epoch)
        if self.events is not None:
            self.events.new_term(self.table)
        self._loading_absent = False  # one of an earlier term (cancelled, maybe before it ran) is not this term's
        self._start_load_absent()

    def _become_standby(self) -> None:
        """Leadership lost: forget everything (a new leader owns the cluster now); a later
        election starts from an empty table again."""
        for task in list(self._tasks):
            task.cancel()
        if self.events is not None:
            self.events.end_term()
        for link in self.nodes.reset(self._new_table()):
            self._spawn(link.close(), "close-daemon-link")
        self.commands.retry = []
        self.rpc.answers.clear()
        self.leadership.end_term()

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> str:
        port = await self.rpc.start()
        if self.events is not None:
            self.events.may_publish = lambda: self.leadership.refusal() is None
            self.events_bound = self.events.start()
        self._ticker = asyncio.create_task(self._tick_forever(), name="master-ticker")
        self._stall_probe = asyncio.create_task(self._probe_stalls(), name="master-stall-probe")
        if self.authority is None:
            warn_if_open(log, "the master", self.config.host, port)
        self.leadership.address = self.config.advertise or f"{self.config.host}:{port}"
        if self.config.etcd is None:
            self._become_leader(0)
        return f"{self.config.host}:{port}"

    def start_election(self, admin_address: str | None) -> None:
        """Campaign in etcd (``config.etcd``); until elected this master answers NotLeader."""
        self.leadership.campaign(admin_address, self._become_leader, self._become_standby)

    async def stop(self) -> None:
        await self.leadership.stop()  # resigns: a standby takes over without waiting for the lease
        self.rpc.close()
        for loop in (self._ticker, self._stall_probe):
            if loop is not None:
                loop.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *(t for t in [self._ticker, self._stall_probe] if t), return_exceptions=True)
        for link in self.nodes.links() + self.nodes.take_stale():
            await link.close()
        if self.events is not None:
            await self.events.close()

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

    def _push_policy(self, now: float) -> None:
        """Tell the daemons which tenants' tickets to take (:class:`TenantsPolicy`): each node that
        has not heard the current one, and every node again when the tenants file changed or every
        :data:`POLICY_EVERY_S` (a push lost to a broken link is made good soon)."""
        authority = self.rpc.authority
        if authority is None or self.leadership.refusal() is not None:
            return
        policy = authority.policy()
        # Every load of the file is pushed, even one that restores what daemons heard last: a
        # tenant added and removed in between may hold tickets issued after that word.
        last = self._policy
        changed = (
            last is None
            or authority.loads != self._policy_loads
            # A rotated token's grace ends with no new load of the file.
            or (policy.names, policy.operations, policy.keys) != (last.names, last.operations, last.keys)
        )
        if changed or now - self._policy_at > POLICY_EVERY_S:
            self._policy, self._policy_at, self._policy_told = policy, now, set()
            self._policy_loads = authority.loads
        for node in [n.node_id for n in self.table.membership.up_nodes() if n.node_id not in self._policy_told]:
            self._policy_told.add(node)
            self._spawn(self._send_policy(node, policy), "tenants-policy")

    async def _send_policy(self, node_id: str, policy: TenantsPolicy) -> None:
        try:
            await self.commands.call(node_id, Lane.GRANTS, policy, OkReply)
        except KVStoreError as exc:
            log.warning("could not tell node %s the tenants' policy (retried): %s", node_id, exc)
            if policy is self._policy:
                self._policy_told.discard(node_id)

    def _note_missing(self, missing: list[str]) -> None:
        """The nodes a new term expected and did not see by its readiness are absent from then on (and
        no longer members in their records: a next leader does not wait for them)."""
        for node_id in missing:
            self.table.membership.note_absent(node_id, set())
            self.table.membership.record_changed(node_id)

    def _start_load_absent(self) -> None:
        """Read the nodes' records in the background (MasterCore.load_absent), once a term (again
        after a failure): until then the term is not ready."""
        if self.leadership.wants_absent() and not self._loading_absent:
            self._loading_absent = True
            self._spawn(self._load_absent(), "load-absent")

    async def _load_absent(self) -> None:
        try:
            await self.core.load_absent()
        except KVStoreError as exc:
            self._etcd_failures.warning("load-absent", "reading nodes' records from etcd failed (%s); will retry", exc)
        finally:
            self._loading_absent = False

    async def _save_records(self) -> None:
        """Keep the nodes' records in etcd (MasterCore.save_records), in the background."""
        try:
            await self.core.save_records()
        except KVStoreError as exc:
            self._etcd_failures.warning("save-records", "keeping nodes' records in etcd failed (%s); will retry", exc)

    async def _probe_stalls(self) -> None:
        period = self.stalls.period_s
        while True:
            began = time.monotonic()
            await asyncio.sleep(period)
            self.stalls.record(time.monotonic() - began - period)

    async def _tick_forever(self) -> None:
        period = self.config.tick_ms / 1000
        last = time.monotonic()
        while True:
            await asyncio.sleep(period)
            try:
                self.rpc.answers.prune()  # first: no failure below keeps a reply past its time
                now = time.monotonic()
                stalled = now - last > period + self.config.node_ttl_ms / 4000
                if stalled:
                    # This master stalled (a pause, an overload): the heartbeats it did not read are no
                    # daemon's silence. Fence none before they had time to be read, suspect none now.
                    self.table.membership.postpone_fences(now_ms(), self.config.node_ttl_ms // 2)
                last = now
                self.commands.tick(self.table, now_ms())
                if not stalled:
                    self.prober.tick(self.table, now_ms())
                self._start_load_absent()
                if self.table.membership.records_pending():  # without etcd only settles (see MasterCore.save_records)
                    self._spawn(self._save_records(), "save-records")
                self.evictions.add(self.table.tiering.take_evictions(), time.time())
                for link in self.nodes.take_stale():
                    self._spawn(link.close(), "close-daemon-link")
                self.rpc.reap(time.monotonic())
                if self.authority is not None:
                    self.table.accounts.set_tenants(self.authority.refresh_tenants())
                self._push_policy(time.monotonic())
                if self.sampler.due():
                    stats = self.table.stats()
                    self.sampler.sample(self.table.counters, int(stats["dram_used"]), int(stats["ssd_used"]),
                                        self.rpc.tenant_requests)  # fmt: skip
            except Exception:
                log.exception("master tick failed")
