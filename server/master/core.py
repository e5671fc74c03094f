"""The master's operations: what each request does to the placement table and the daemons.

:class:`MasterCore` is the only caller of the placement table. Each operation takes its request
and the caller's identity and returns its reply; it knows nothing of connections, handshakes,
idempotency or timing (:mod:`server.master.rpc`) nor of elections (:mod:`server.master.leadership`),
so it is driven as readily by a test with no sockets as by the RPC server or the admin API. The
table is synchronous and only this event loop touches it, so an operation's table work between
two awaits is atomic; what the daemons must do is carried out by :mod:`server.master.commands`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable

from msgspec import structs

from kvstore.auth import ANYONE, Authority, Identity
from kvstore.config import MasterConfig
from kvstore.errors import (
    AuthFailed,
    CapacityError,
    InvalidArgument,
    KVStoreError,
    NotFound,
    NotLeader,
    QuotaExceeded,
    RetryLater,
    Timeout,
)
from kvstore.events import check_label
from kvstore.keys import validate_keys
from kvstore.placement import quotas
from kvstore.placement.leases import LeaseId
from kvstore.placement.nodes import EVERYTHING, NodeRecord
from kvstore.placement.state import Grant, Move, NodeCommand, charged
from kvstore.placement.table import PlacementTable
from kvstore.policy import ActionKind, TierName
from kvstore.protocol import (
    AccessReport,
    CheckBlocks,
    CheckBlocksReply,
    ClearReplicas,
    ClearReplicasReply,
    CommandReply,
    CommitGranted,
    Exists,
    ExistsReply,
    GetReplicas,
    GetReplicasReply,
    GrantReply,
    GrantSpace,
    Heartbeat,
    HeartbeatReply,
    KeysReply,
    LabelBlocks,
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
    PutEnd,
    PutEndReply,
    PutReply,
    PutRevoke,
    PutStart,
    PutStartReply,
    RegisterNode,
    RegisterReply,
    ReleaseLeases,
    Remove,
    RemoveReply,
    Replicate,
    Replicated,
    ReplicateReply,
    ReportNode,
    ReturnGrants,
    Stats,
    StatsReply,
)
from kvstore.ratelog import RateLimitedLog
from kvstore.results import Ticket
from kvstore.tenants import Tenant
from kvstore.write_ids import check_write_id, check_write_ids, same_write
from server.master.commands import Commands, Lane
from server.master.election import Election
from server.master.leadership import Leadership
from server.master.nodes import NodeRegistry
from server.master.probes import Prober
from server.master.removed import RecentRemovals

log = logging.getLogger("kvstore.master")

SLOW_SETTLE_S = 0.1
"""A remove (or revoke) whose drops took longer than this to settle is logged with where the time
went: waiting for daemons to confirm or for a frozen node's key lease to lapse, or etcd (the first
over this and the first over twice this every 10 s; the others counted)."""

# A put waits for at most this many rounds of evictions before its keys fail.
_MAX_EVICTION_ROUNDS = 64
_MAX_KEYS_PAGE = 10_000
"""Most keys one ListKeys answers (a page: the table is scanned once per page)."""

# A daemon's grant deadline runs from when it took the grant; the master's a margin later, so that
# the daemon has stopped taking writes into a grant before the master frees it. (Freeing waits for
# the daemon's EndGrants answer anyway; the margin keeps a lost answer from holding space long.)
_GRANT_MARGIN_MS = 1_000


_REVOKE_WAIT_S = 1.0
"""How long a PutRevoke waits for its daemons to drop (and fence) what it gives up."""


def _record_bytes(record: NodeRecord) -> bytes:
    """A node's record as :meth:`MasterCore.save_records` keeps it in etcd (UTF-8 JSON)."""
    drop = sorted([k, t.value, o] for k, t, o in record.gone)
    return json.dumps({"member": record.member, "drop": drop}, ensure_ascii=False).encode()


def _parse_record(node_id: str, value: bytes) -> NodeRecord:
    """A record :func:`_record_bytes` made (or, from before records, a bare list of blocks to drop).
    One that cannot be read costs the node its blocks, never a removed key read again: it drops all."""
    try:
        held = json.loads(value)
        member, drop = (False, held) if isinstance(held, list) else (bool(held["member"]), held["drop"])
        return NodeRecord(member, frozenset((str(k), TierName(t), int(o)) for k, t, o in drop))
    except (ValueError, TypeError, KeyError) as exc:
        log.error("etcd holds a malformed record of node %s (%s): it drops every block when it registers", node_id, exc)
        return NodeRecord(False, frozenset({EVERYTHING}))


def now_ms() -> int:
    return int(time.monotonic() * 1000)


class MasterCore:
    """The master's operations over :attr:`table` (see the module's text)."""

    def __init__(
        self,
        config: MasterConfig,
        nodes: NodeRegistry,
        commands: Commands,
        leadership: Leadership,
        authority: Authority | None,
    ) -> None:
        self.config = config
        self.nodes = nodes
        self.commands = commands
        self.leadership = leadership
        self.authority = authority
        """Tenants and their quotas, and the seals of their reservations (None: no tenants)."""
        self.prober: Prober | None = None
        """Looks whether a node clients report unreachable is gone (the service's; None: nobody looks)."""
        self.loop_stall_max: Callable[[], float] | None = None
        """The longest the event loop went without turning, in seconds (the service's probe), for Stats."""
        self._saving_records = asyncio.Lock()
        self._slow = RateLimitedLog(log, interval_s=10.0)
        """Slow settles: the first of each kind every 10 s, the others counted."""
        self._holds_of: PlacementTable | None = None
        self._holds: dict[str, bytes | None] = {}
        self._unplaced: Counter[str] = Counter()
        """Keys every node is dropping now (puts begun with an earlier master, see put_revoke), by
        drops under way: no commit of them is taken until the drop is over."""
        self._removals: tuple[PlacementTable, RecentRemovals] | None = None

    def _recent_removals(self) -> RecentRemovals:
        """This term's :class:`RecentRemovals` (a new table: a new term, nothing removed yet)."""
        table = self.table
        if self._removals is None or self._removals[0] is not table:
            self._removals = (table, RecentRemovals())
        return self._removals[1]

    @property
    def table(self) -> PlacementTable:
        """The placement table of this term (a new one each time leadership is lost)."""
        return self.nodes.table

    def _same_term(self, table: PlacementTable, what: str) -> None:
        """Raise NotLeader when ``table`` is no longer this master's (leadership lost meanwhile)."""
        if not self.commands.current(table):
            raise NotLeader(f"master {self.leadership.address} lost its leadership during {what}; ask the leader")

    async def _until_room(self) -> None:
        await self.commands.room.wait(self.config.tick_ms / 1000)

    async def _open_grant(self, table: PlacementTable, node_id: str, message: OpenGrant) -> None:
        """Have the daemon open a grant; given up (RetryLater: the client puts the two-trip way) once
        its node is suspected or down (frozen, cut off, gone: it waited up to the command timeout, 10 s,
        past a client's 5 s), not while a busy daemon that still heartbeats takes its time."""
        opening = asyncio.ensure_future(self.commands.call(node_id, Lane.GRANTS, message, CommandReply))
        try:
            while True:
                done, _ = await asyncio.wait({opening}, timeout=self.config.tick_ms / 1000)
                if done:
                    opening.result()
                    return
                node = table.nodes.get(node_id)
                if node is None or not node.up or node.suspect:
                    raise RetryLater(f"node {node_id} did not open a grant and is suspected or down; put again")
        finally:
            opening.cancel()

    async def _evicted(self, commands: list[NodeCommand]) -> None:
        """Send a put's or a grant's evictions and wait until their daemons answered, or until one
        of their nodes is suspected or down (frozen, cut off, fenced: the next round places without
        waiting on it, :meth:`Writes._place`), or the command timeout. (Waiting for the commands
        alone held a put until a frozen daemon came back, up to the command timeout, well past its
        fence; waiting until its fence held every put that asked it for room a second; planning
        again before they are answered evicted again for room the first evictions were freeing.)"""
        finished = self.commands.start(commands, "eviction")
        nodes = {c.node_id for c in commands}
        deadline = time.monotonic() + self.nodes.command_timeout_s
        while not finished.is_set() and time.monotonic() < deadline:
            table = self.table
            if any((node := table.nodes.get(n)) is None or not node.up or node.suspect for n in nodes):
                return
            # Woken by the answers, or by a suspicion (Prober: it frees room), or at the tick.
            freed = self.commands.room.next_freed
            waits = [asyncio.ensure_future(finished.wait()), asyncio.ensure_future(freed.wait())]
            try:
                await asyncio.wait(waits, timeout=self.config.tick_ms / 1000, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()

    # -- nodes ----------------------------------------------------------------------------------
    async def register(self, m: RegisterNode, caller: Identity = ANYONE) -> Message:
        self.leadership.expect(m.peers)  # before any wait: a term not ready yet must not go without them
        # What an earlier leader gave up on this node while it was fenced (a new leader knows it from etcd).
        stored = await self._load_record(m.node_id)
        gone = set(stored.gone) if stored is not None else None
        election, table = self.leadership.election, self.table
        async with self._saving_records:  # no save of an older record of it in between
            if election is not None:
                # In etcd before the node is in the table: a next leader waits for every node that this one
                # placed blocks on (and needs no moment for the daemons' peer lists to name them). After a
                # failover etcd mostly holds it already (a member, nothing owed): then nothing is written.
                await self._keep_record(election, m.node_id, table.membership.record_at_registration(m.node_id, gone))
                self._same_term(table, "the registration")
            commands = self.nodes.register(m, now_ms(), gone)
        self.commands.forget(m.node_id)  # the inventory superseded them
        # Sent as well, for the table's accounts (an extent freed on the answer); made before the daemon serves.
        own = [c for c in commands if c.node_id == m.node_id and c.kind is ActionKind.DROP]
        self.commands.later(commands, "register-drops")
        self.leadership.ready()  # the last node waited for makes the term ready now, not at the next request
        log.info("node %s registered at %s with %d blocks", m.node_id, m.address, len(m.inventory))
        return RegisterReply(
            self.config.heartbeat_interval_ms,
            self.config.node_ttl_ms,
            self.leadership.epoch,
            self._peers(),
            [k for c in own for k in c.keys],
            [c.tier.value if c.tier_only else "" for c in own for _ in c.keys],
            self.config.key_lease,
        )

    async def report_node(self, m: ReportNode, caller: Identity = ANYONE) -> Message:
        if self.prober is not None:
            self.prober.suspect(m.node_id, f"client {caller.name or '(anonymous)'} could not reach it")
        return OkReply()

    async def leave(self, m: LeaveNode, caller: Identity = ANYONE) -> Message:
        commands = self.nodes.leave(m.node_id)
        self.commands.forget(m.node_id)
        self.commands.later(commands, "leave-revokes")
        log.info("node %s left: its blocks are forgotten", m.node_id)
        return OkReply()

    async def _load_record(self, node_id: str) -> NodeRecord | None:
        """``node_id``'s record as an HA leader keeps it in etcd (see :meth:`save_records`): with the
        blocks it must drop at its registration; None without etcd or without a record. etcd
        unreachable: ConnectionFailed (the daemon registers again later: adopting its inventory
        blindly could bring back a removed key)."""
        election = self.leadership.election
        if election is None:
            return None
        value = await election.load(election.cluster.node_key(node_id))
        self._etcd_holds().setdefault(node_id, value)
        return None if value is None else _parse_record(node_id, value)

    def _etcd_holds(self) -> dict[str, bytes | None]:
        """What this term knows etcd holds as each node's record (read or written in it): a record equal
        to it is not written again. It stays true: only this term's leader writes there (Election.save)."""
        if self._holds_of is not self.table:
            self._holds_of, self._holds = self.table, {}
        return self._holds

    async def _keep_record(self, election: Election, node_id: str, record: NodeRecord | None) -> None:
        """Put ``record`` in etcd (None: delete it) unless etcd holds it already."""
        value = None if record is None else _record_bytes(record)
        holds = self._etcd_holds()
        if node_id in holds and holds[node_id] == value:
            return
        holds.pop(node_id, None)  # not known while the write is out (it may land or not)
        await election.save(election.cluster.node_key(node_id), value)
        holds[node_id] = value

    async def load_absent(self) -> None:
        """An HA leader's first step before it is ready: every node an earlier leader kept a record of
        and that has not registered in this term is absent in this one (the removes it answers are
        noted for it); those that were members then are waited for as well. ConnectionFailed when
        etcd does not answer."""
        election = self.leadership.election
        table = self.table
        members: list[str] = []
        recorded = False
        if election is not None:
            prefix = election.cluster.nodes_prefix
            # Each record by itself: all in one answer could pass gRPC's 4 MiB.
            keys = await election.list_prefix(prefix)
            recorded = bool(keys)
            values = await asyncio.gather(*(election.load(key) for key in keys))
            self._same_term(table, "the load of absent nodes")
            holds = self._etcd_holds()
            for key, value in zip(keys, values, strict=True):
                node_id = key[len(prefix) :].decode(errors="replace")
                holds.setdefault(node_id, value)
                if value is not None and node_id not in table.nodes:
                    record = _parse_record(node_id, value)
                    table.membership.note_absent(node_id, record.gone, recorded=True)
                    if record.member:
                        members.append(node_id)
            if table.membership.absent:
                log.info("nodes absent since the last term: %s (waiting for %s)", ", ".join(table.membership.absent),
                         ", ".join(members) or "none")  # fmt: skip
        self.leadership.know_absent(members, table.membership.absent, recorded)

    async def save_records(self) -> None:
        """Keep in etcd (an HA leader) the record of each node whose record changed: whether it is a
        member, and the blocks it must drop when it registers again (a fenced node's, an absent
        one's removed keys), so that a new leader knows them too; a remove whose drops a fence settled,
        or that was noted for an absent node, is answered only after this. Without etcd, a no-op.
        Raises ConnectionFailed or NotLeader when etcd did not take them (they are tried again)."""
        election = self.leadership.election
        if election is None:
            self.table.membership.take_records()
            self.table.membership.records_kept(self.table.membership.take_settling())
            return
        async with self._saving_records:  # one at a time: a later record never overwritten by an earlier one
            changes, settling = self.table.membership.take_records(), self.table.membership.take_settling()
            for node_id, record in changes.items():
                try:
                    await self._keep_record(election, node_id, record)
                except KVStoreError:
                    for again in changes:
                        self.table.membership.record_changed(again)
                    self.table.membership.records_not_kept(settling)
                    raise
            self.table.membership.records_kept(settling)

    def _peers(self) -> list[str]:
        """The nodes the daemons are told of (and name to a new leader): those up, and while this
        term is not ready, every node it has or waits for (a term that never became ready must not
        make the next one forget a node it was waiting for)."""
        peers = {n.node_id for n in self.table.membership.up_nodes()}
        peers |= self.leadership.waiting_for(self.table.nodes)
        return sorted(peers)

    async def check_blocks(self, m: CheckBlocks, caller: Identity = ANYONE) -> Message:
        """A daemon asks which of its blocks no put placed (orphans: it drops them), and tells which
        orphans of an earlier answer it dropped (their extents are free again)."""
        if m.dropped:
            self.table.membership.release_quarantine(m.node_id, m.dropped)
            self.commands.room.freed()
        return CheckBlocksReply(self.table.membership.check_blocks(m.node_id, m.keys, m.offsets, m.sizes, m.checksums))

    async def heartbeat(self, m: Heartbeat, caller: Identity = ANYONE) -> Message:
        known = self.nodes.heartbeat(m.node_id, m.transfer_bytes, now_ms(), m.refusals)
        if not known:
            return HeartbeatReply(False, [], False)
        self.table.membership.ssd_health(m.node_id, m.ssd_capacity, m.ssd_configured, m.ssd_fault)
        return HeartbeatReply(True, self._peers(), self.nodes.renew_key_lease(m.node_id, self.commands.owes(m.node_id)))

    async def list_nodes(self, m: ListNodes, caller: Identity = ANYONE) -> Message:
        """Every registered node with how to reach it, up or down."""
        return NodesReply(self.nodes.infos())

    async def access_report(self, m: AccessReport, caller: Identity = ANYONE) -> Message:
        self.table.reads.record_access(m.node_id, m.keys, m.tiers, now_ms())
        return OkReply()

    # -- puts -------------------------------------------------------------------------------------
    def quota(self, tenant: str) -> int:
        """The tenant's byte quota (0: none). A tenant no longer in the tenants file has none to
        spend: AuthFailed (never "no quota", which would be unlimited)."""
        return self._tenant(tenant).quota_bytes

    def _tenant(self, tenant: str) -> Tenant:
        known = self.authority.tenant(tenant) if self.authority is not None else None
        if known is None:
            raise AuthFailed(f"tenant {tenant!r} is not in the tenants file (removed since it logged in)")
        return known

    async def put_start(self, m: PutStart, caller: Identity = ANYONE) -> Message:
        keys, sizes = list(m.keys), list(m.sizes)
        if len(keys) != len(sizes):
            raise InvalidArgument(f"put_start got {len(keys)} keys but {len(sizes)} sizes")
        check_write_id(m.write_id, "PutStart.write_id")
        self._recent_removals().reserved(keys)  # a put of them begun now: its PutEnd is judged by the table
        tickets: list[Ticket | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        if busy := self._being_dropped(keys, todo):  # a block written now would go too
            for i, text in busy.items():
                tickets[i] = Ticket("error", [], RetryLater.code, text)
            todo = [i for i in todo if i not in busy]
        tenant = caller.tenant
        known = self._tenant(tenant) if tenant is not None else None
        if known is not None and known.replicas > m.replicas:
            m = structs.replace(m, replicas=known.replicas)  # the tenant's least copies, whatever its client asks
        admitted: set[int] = set()  # new keys counted against the quota until placed (Accounts.admit)
        if tenant is not None and known is not None and (known.quota_bytes or known.max_objects or known.max_pinned):
            quota = known.quota_bytes or 1 << 62
            plan = quotas.plan_put(self.table, tenant, quota, keys, sizes)
            if plan.commands:
                await self.commands.run(plan.commands)
                plan = quotas.QuotaPlan(quotas.new_keys(self.table, keys), [])  # which keys are new now
            # From the check to the admission, no wait: a concurrent put of the tenant's sees these bytes.
            for i in quotas.refused(self.table, tenant, quota, sizes, plan):
                text = quotas.refusal_text(self.table, tenant, quota, keys[i], sizes[i])
                tickets[i] = Ticket("error", [], QuotaExceeded.code, text)
            new = [i for i in plan.new if tickets[i] is None]
            for i, held in quotas.over_caps(
                self.table, tenant, known.max_objects, known.max_pinned, new, m.pin
            ).items():
                text = f"tenant {tenant!r} holds {held}, the most it may: {keys[i][len(tenant) + 1 :]!r} is refused"
                tickets[i] = Ticket("error", [], QuotaExceeded.code, text)
            todo = [i for i in todo if tickets[i] is None]
            admitted = {i for i in plan.new if tickets[i] is None}
        table = self.table  # admitted on this term's table, settled on it (a new term's starts clean)
        if admitted:
            assert tenant is not None
            table.accounts.admit(tenant, sum(charged(sizes[i]) for i in admitted), len(admitted), m.pin)
        try:
            return await self._place(m, keys, sizes, tickets, todo, tenant, admitted, table)
        finally:
            if admitted:
                assert tenant is not None
                table.accounts.settle(tenant, sum(charged(sizes[i]) for i in admitted), len(admitted), m.pin)

    async def _place(
        self, m: PutStart, keys: list[str], sizes: list[int], tickets: list[Ticket | None], todo: list[int],
        tenant: str | None, admitted: set[int], admitted_on: PlacementTable,
    ) -> Message:  # fmt: skip
        """The rounds of a put_start: place ``todo``, waiting for evictions to make room; each key
        placed (or refused) leaves ``admitted`` as it enters the table."""
        for _ in range(_MAX_EVICTION_ROUNDS):
            every = len(todo) == len(keys)
            placed = self.table.writes.put_start(
                keys if every else [keys[i] for i in todo], sizes if every else [sizes[i] for i in todo],
                m.replicas, m.preferred_node, m.pin, now_ms(), tenant or "", m.write_id, frozenset(m.avoid),
            )  # fmt: skip
            if every and not placed.waiting and tenant is None:
                # Every key answered at the first ask (the common case): the reply is the plan as it is.
                self.commands.later(placed.commands, "background-eviction")
                return PutStartReply(
                    placed.statuses, placed.error_codes, placed.errors, placed.counts,  # type: ignore[arg-type]
                    placed.nodes, placed.addresses, placed.offsets,
                )  # fmt: skip
            for j, ticket in zip(todo, placed.tickets, strict=True):
                tickets[j] = ticket
            todo = [todo[w] for w in placed.waiting]
            if admitted:
                assert tenant is not None
                done = admitted.difference(todo)
                admitted_on.accounts.settle(tenant, sum(charged(sizes[i]) for i in done), len(done), m.pin)
                admitted -= done
            if not todo:
                self.commands.later(placed.commands, "background-eviction")
                break
            if placed.commands:
                await self._evicted(placed.commands)
            else:
                await self._until_room()  # room is coming from commands another request sent
        stuck = Ticket("error", [], CapacityError.code, "no room after repeated rounds of eviction")
        final = [t if t is not None else stuck for t in tickets]
        seals = self._seals(tenant, keys, sizes, final) if tenant is not None and self.authority is not None else None
        return PutStartReply.from_tickets(final, seals)

    def _seals(self, tenant: str, keys: list[str], sizes: list[int], tickets: list[Ticket]) -> list[bytes]:
        """A seal per replica of ``tickets``, in order, for ``tenant``: daemons take a tenant's writes
        only into extents the master reserved for it (no squatting on free space or others' reservations)."""
        assert self.authority is not None
        expires = self.commands.seal_end(int(time.time() * 1000))  # wall clock: daemons check it
        seal = self.authority.seal
        return [
            seal(tenant, r.node_id, key, r.offset, size, expires)
            for t, key, size in zip(tickets, keys, sizes, strict=True)
            for r in t.replicas
        ]

    async def put_end(self, m: PutEnd, caller: Identity = ANYONE) -> Message:
        write_id = check_write_id(m.write_id, "PutEnd.write_id")
        committed = self.table.writes.put_end(m.keys, m.checksums, write_id)
        # A put begun with a master that has since gone: its block came back in its daemon's
        # inventory when the daemon registered here (with the put's write id), and may have been
        # removed since (see server.master.removed). Or this answer is a retry's, the first lost.
        objects, removals = self.table.objects, self._recent_removals()
        out, gone = [], []
        for k, c, ok in zip(m.keys, m.checksums, committed, strict=True):
            if ok or (
                (e := objects.get(k)) is not None and e.committed and same_write(e.write_id, e.checksum, write_id, c)
            ):
                out.append(True)
            elif removals.was_committed(k, c, write_id):
                out.append(True)
                if self.table.inspection.describe(k) is None:
                    gone.append(k)
            else:
                out.append(False)
        # Told committed, the writer revokes nothing: a copy of its write that no node's inventory had
        # when the remove dropped the key's (written after its daemon registered) is dropped here, as
        # the revoke of a put begun with an earlier master would drop it. Not where another put holds
        # the key now (a drop everywhere would take its block): a stray copy is then an orphan, which
        # its daemon's orphan check drops (no reservation of the key names that node and extent).
        if gone:
            # In the background: PutEnd is answered inline, and nothing may wait there (a late PutEnd
            # after a leader change is rare). No put of them is taken until every node dropped them.
            self._unplaced.update(gone)
            self.commands.spawn(self._late_drops(gone), "late-put-end-drops")
        return PutEndReply(out)

    async def _late_drops(self, keys: list[str]) -> None:
        if not await self._dropped_unplaced(keys):
            log.warning("a node did not confirm dropping %d removed keys a late PutEnd named", len(keys))

    async def put_revoke(self, m: PutRevoke, caller: Identity = ANYONE) -> Message:
        # Waited for (a second at most): once answered, the daemons refuse every write under the
        # reservations given up (their drops void the seals), so a writer cannot half-fill an extent
        # the master hands out again. A daemon that does not answer gets its drop in the background;
        # once its lease to serve by key lapsed the key is put again elsewhere, its extent there kept
        # out of the free space until the drop is confirmed (Catalog.detach).
        write_id = check_write_id(m.write_id, "PutRevoke.write_id")
        # Reserved by a master that has since gone, so nobody knows where it was written: every
        # node drops it, before the writer's retry can store it anew. (Known here: the revoke drops it.)
        unknown = [k for k in m.keys if self.table.inspection.describe(k) is None]
        self.commands.later(self.table.writes.put_revoke(m.keys, write_id), "revoke-drops")
        await self._settle(list(m.keys), _REVOKE_WAIT_S)
        if unknown and not await self._drop_unplaced(unknown):
            raise RetryLater("a node did not confirm dropping a put begun with an earlier master")
        return OkReply()

    def _being_dropped(self, keys: list[str], at: list[int]) -> dict[int, str]:
        """Of ``keys[i]`` for ``i`` in ``at``, those every node is dropping now (see _drop_unplaced),
        each with the text of its RetryLater: no put of them is taken until the drop is over."""
        unplaced = self._unplaced
        if not unplaced:
            return {}
        return {i: f"key {keys[i]!r} is being dropped on every node; retry" for i in at if keys[i] in unplaced}

    async def _drop_unplaced(self, keys: list[str]) -> bool:
        """Every node drops ``keys``, blocks of puts this term never placed; whether all confirmed.
        No commit of them is taken meanwhile: a cached put's commit that came in would be dropped
        with them (its daemon keeps a block whose commit is pending, and asks again after)."""
        self._unplaced.update(keys)
        return await self._dropped_unplaced(keys)

    async def _dropped_unplaced(self, keys: list[str]) -> bool:
        """:meth:`_drop_unplaced` for keys already marked unplaced."""
        try:
            return await self.commands.drop_everywhere(keys)
        finally:
            self._unplaced.subtract(keys)
            self._unplaced = +self._unplaced

    # -- grants (one-trip puts) ------------------------------------------------------------------
    async def grant_space(self, m: GrantSpace, caller: Identity = ANYONE) -> Message:
        """Reserve write space on one node (evicting first where needed) and open it on its daemon."""
        table = self.table
        owner = caller.tenant or ""
        least = self._tenant(owner).replicas if owner else 0
        if least > 1:
            raise InvalidArgument(
                f"tenant {owner!r}'s puts take {least} copies: a grant holds one; put the two-trip way"
            )
        length = m.length
        if table.nodes:  # no larger than a grant may be: the quota is checked for what is granted
            largest = max(n.alloc.capacity for n in table.nodes.values())
            length = min(length, max(int(largest * self.config.grant_fraction), 1))
        admitted = self._grant_quota(owner, length) if owner else 0
        length = admitted or length
        grant: Grant | None = None
        try:
            for _ in range(_MAX_EVICTION_ROUNDS):
                plan = table.grants.grant_space(
                    length, m.preferred_node, self.config.grant_ttl_ms, now_ms(), owner, frozenset(m.avoid)
                )
                if plan.error is not None:
                    raise plan.error
                if plan.grant is not None:
                    self.commands.later(plan.commands, "background-eviction")
                    grant = plan.grant
                    break
                if plan.commands:
                    await self._evicted(plan.commands)
                else:
                    await self._until_room()
        finally:
            if admitted:
                table.accounts.settle(owner, admitted)  # the grant counts itself from here (or was not made)
        if grant is None:
            raise CapacityError(f"no room for a grant of {m.length} bytes after repeated rounds of eviction")
        extent = grant.pieces[0]
        ttl = self.config.grant_ttl_ms
        try:
            message = OpenGrant(grant.grant_id, extent.offset, extent.length, ttl, owner)
            await self._open_grant(table, grant.node_id, message)
        except BaseException:
            # The daemon may have taken it: close it there before the space is reused.
            self.commands.close_grants_later(table.grants.end_grants([grant.grant_id]), "grant-close")
            raise
        if grant.grant_id not in table.grants.open:
            # The node re-registered meanwhile (its grants are forgotten, its space maybe handed
            # out again): the daemon must not keep this one.
            self.commands.close_grants_later({grant.node_id: [grant.grant_id]}, "grant-close")
            raise RetryLater(f"node {grant.node_id} re-registered while a grant was opened on it; retry")
        table.grants.confirm_grant(grant.grant_id, now_ms() + ttl + _GRANT_MARGIN_MS)
        node = table.nodes[grant.node_id]
        return GrantReply(
            grant.grant_id, grant.node_id, node.address, extent.offset, extent.length, ttl, node.alloc.alignment
        )

    def _grant_quota(self, tenant: str, length: int) -> int:
        """How much of a grant of ``length`` bytes the tenant may have (0: all of it, it has no
        quota): at most ``config.tenant_max_grants`` grants open, and what its quota leaves free
        (its grants count as held until returned), admitted under the quota at once
        (:meth:`Accounts.admit`; the caller settles it); QuotaExceeded when nothing is left.
        A grant never evicts the tenant's own blocks: the two-trip way does that, block by block,
        for what each put needs (a grant of 16 MiB used to evict six blocks held to write one of
        64 KiB)."""
        quota = self.quota(tenant)
        table = self.table
        open_grants, _ = table.accounts.granted(tenant)
        if open_grants >= self.config.tenant_max_grants:
            raise QuotaExceeded(
                f"tenant {tenant!r} has {open_grants} grants open, the most a tenant may: return or fill one first"
            )
        if not quota:
            return 0
        alignment = max((n.alloc.alignment for n in table.nodes.values()), default=1)
        room = (quota - table.accounts.tenant_held(tenant)) // alignment * alignment
        if room <= 0:
            raise QuotaExceeded(
                f"tenant {tenant!r} holds or reserves {table.accounts.tenant_held(tenant)} bytes of its"
                f" {quota}-byte quota:"
                " no room for a grant (puts go the two-trip way, which evicts its own blocks as each needs)"
            )
        granted = min(length, room)
        table.accounts.admit(tenant, granted)
        return granted

    async def return_grants(self, m: ReturnGrants, caller: Identity = ANYONE) -> Message:
        owner = caller.tenant
        grants = self.table.grants.open
        ids = m.grant_ids if owner is None else [g for g in m.grant_ids if g in grants and grants[g].owner == owner]
        self.commands.close_grants_later(self.table.grants.end_grants(ids), "grant-return")
        return OkReply()

    async def commit_granted(self, m: CommitGranted, caller: Identity = ANYONE) -> Message:
        grant = self.table.grants.open.get(m.grant_id)
        owner = grant.owner if grant is not None else ""
        try:
            known = self._tenant(owner) if owner else None
        except AuthFailed as exc:  # the grant's tenant was removed: nothing of it is committed
            self.commands.close_grants_later(self.table.grants.end_grants([m.grant_id]), "grant-revoked")
            return PutReply([exc.code] * len(m.keys), [str(exc)] * len(m.keys))
        keep = list(range(len(m.keys)))
        quota = known.quota_bytes if known is not None else 0
        if quota and len(m.keys) == len(m.sizes):
            # Over its quota, a tenant's one-trip put goes the two-trip way, which evicts its own
            # blocks for it or refuses it with QuotaExceeded.
            keep = [i for i, ok in enumerate(quotas.granted_fits(self.table, owner, quota, m.sizes)) if ok]
        if known is not None and (known.max_objects or known.max_pinned):
            new = set(quotas.new_keys(self.table, m.keys))  # a new key takes a key (and a pin) of the caps
            kept_new = [i for i in keep if i in new]
            over = quotas.over_caps(self.table, owner, known.max_objects, known.max_pinned, kept_new, m.pinned)
            keep = [i for i in keep if i not in over]
        outcome = [(QuotaExceeded.code, f"tenant {owner!r} is at its quota")] * len(m.keys)
        if busy := self._being_dropped(m.keys, keep):
            for i, text in busy.items():
                outcome[i] = (RetryLater.code, text)
            keep = [i for i in keep if i not in busy]
        ids = check_write_ids(m.write_ids, len(m.keys), "CommitGranted.write_ids")
        if len(keep) == len(m.keys):
            outcome = self.table.grants.commit_granted(
                m.node_id, m.grant_id, m.keys, m.offsets, m.sizes, m.checksums, m.pinned, m.cached, ids
            )
        else:
            part = self.table.grants.commit_granted(
                m.node_id, m.grant_id, [m.keys[i] for i in keep], [m.offsets[i] for i in keep],
                [m.sizes[i] for i in keep], [m.checksums[i] for i in keep], m.pinned, m.cached,
                [ids[i] for i in keep],
            )  # fmt: skip
            for i, result in zip(keep, part, strict=True):
                outcome[i] = result
        return PutReply([code for code, _ in outcome], [text for _, text in outcome])

    # -- reads ------------------------------------------------------------------------------------
    async def get_replicas(self, m: GetReplicas, caller: Identity = ANYONE) -> Message:
        if m.release:
            await self.release_leases(ReleaseLeases(m.release), caller)
        table = self.table
        reply = GetReplicasReply.from_lookup(table.reads.get_replicas(m.keys, now_ms(), m.lease))
        nodes = table.nodes
        suspects = [n for n in set(reply.nodes) if (node := nodes.get(n)) is not None and node.suspect]
        if suspects:
            reply = structs.replace(reply, suspects=suspects)
        if m.write_ids:  # a put that found its key stored asks whose the block is
            objects = self.table.objects
            ids = [e.write_id if (e := objects.get(k)) is not None and e.committed else 0 for k in m.keys]
            reply = structs.replace(reply, write_ids=ids)
        return reply

    async def release_leases(self, m: ReleaseLeases, caller: Identity = ANYONE) -> Message:
        lease_ids = m.lease_ids
        tenant = caller.tenant
        if tenant is not None:  # a tenant ends its own leases only (ids are sequential: guessable)
            leases, prefix = self.table.leases, f"{tenant}/"
            lease_ids = [i for i in lease_ids if (leases.key_of(LeaseId(i)) or "").startswith(prefix)]
        self.commands.later(self.table.reads.release_leases(lease_ids), "promotions")
        return OkReply()

    async def match_prefix(self, m: MatchPrefix, caller: Identity = ANYONE) -> Message:
        return MatchPrefixReply(self.table.reads.match_prefix(m.keys))

    async def match_prefix_nodes(self, m: MatchPrefixNodes, caller: Identity = ANYONE) -> Message:
        return MatchPrefixNodesReply.from_match(self.table.reads.match_prefix_nodes(m.keys))

    async def label_blocks(self, m: LabelBlocks, caller: Identity = ANYONE) -> Message:
        """Keep the engine's names of ``m.keys`` for the KV events (:meth:`KvEvents.label`)."""
        if len(m.keys) != len(m.labels):
            raise InvalidArgument(f"LabelBlocks: {len(m.keys)} keys but {len(m.labels)} labels")
        validate_keys(m.keys)
        for i, label in enumerate(m.labels):
            check_label(label, f"LabelBlocks.labels[{i}]")
        self.table.kv_events.label(m.keys, m.labels)
        return OkReply()

    async def exists(self, m: Exists, caller: Identity = ANYONE) -> Message:
        return ExistsReply(self.table.reads.exists(m.keys, now_ms()))

    async def list_keys(self, m: ListKeys, caller: Identity = ANYONE) -> Message:
        if not 1 <= m.limit <= _MAX_KEYS_PAGE:
            raise InvalidArgument(f"ListKeys.limit must be from 1 to {_MAX_KEYS_PAGE}, got {m.limit}")
        scope = caller.prefix  # a tenant lists its own namespace, and sees its keys as it named them
        keys, after = self.table.inspection.keys_page(scope + m.prefix, scope + m.after if m.after else None, m.limit)
        cut = len(scope)
        return KeysReply([k[cut:] for k in keys], after[cut:] if after is not None else "")

    async def stats(self, m: Stats, caller: Identity = ANYONE) -> Message:
        """The cluster's counters; for a tenant, its own only (what it holds, its quota, its grants)."""
        tenant = caller.tenant
        if tenant is None:
            stats: dict[str, int | float] = dict(self.table.stats())
            if self.loop_stall_max is not None:
                stats["loop_stall_max_ms"] = round(self.loop_stall_max() * 1000, 3)
            return StatsReply(stats)
        grants, granted = self.table.accounts.granted(tenant)
        return StatsReply({
            "objects": self.table.accounts.num_objects_of(tenant), "bytes": self.table.accounts.usage(tenant),
            "quota_bytes": self.quota(tenant), "grants": grants, "granted_bytes": granted,
        })  # fmt: skip

    # -- removal and eviction ---------------------------------------------------------------------
    async def remove(self, m: Remove, caller: Identity = ANYONE) -> Message:
        """Answered once the daemons dropped the blocks, this remove's and those of earlier removes of
        the same keys still under way: a reader that goes straight to a daemon (no lease, no master)
        must find nothing after remove returns. A daemon that does not answer gets its drop retried
        until its node is fenced (silent for the node TTL: it serves nothing from then until its
        registration, which drops the block), which ends the wait; one that keeps answering but not
        the drop makes the remove answer Timeout after the command timeout (unsure: retried)."""
        keys, held = self._unheld(m.keys, m.force)
        stored = self._stored_blocks(keys)
        removed, commands = self.table.remove(keys)
        self._recent_removals().removed(stored)
        self.commands.later(commands, "remove-drops")
        await self._settle_drops(keys)
        return RemoveReply(removed, held)

    async def _settle_drops(self, keys: list[str]) -> None:
        """Wait for the drops of ``keys`` (this request's and those of earlier removes of the same
        keys still unconfirmed: a reader that goes to the daemon directly finds the block until its
        drop is made), each until its daemon confirms it, its node's lease to serve by key lapses or
        its node is fenced (it serves nothing then: see PlacementTable.expire); then keep the nodes'
        records (drops settled by a fence or a lapse, removes noted for absent nodes: a new leader
        must know)."""
        if not await self._settle(keys, self.nodes.command_timeout_s, save=True):
            # The blocks are out of the table, but a daemon that did not confirm may still serve
            # them to a reader that goes to it directly: say so (the drop is retried until done).
            raise Timeout("a node holding removed blocks did not confirm dropping them yet; they are retried")

    async def _settle(self, keys: list[str], wait_s: float, save: bool = False) -> bool:
        """:meth:`_settle_drops` for at most ``wait_s``; whether all were settled. Keys settled by
        lapses leave the table once the records that name their blocks are kept (Catalog.detach:
        put again at once, elsewhere than on the nodes that owe their drops). ``save``: keep the
        records whatever settled them (else only for lapses)."""
        pending, lapse, lapsed = self._unsettled(keys)
        began = time.monotonic()
        deadline = began + wait_s
        while pending and time.monotonic() < deadline:
            # Until a drop is answered (room freed), or a node that owes one stops serving by key.
            await self.commands.room.wait(min(deadline, lapse + 0.001) - time.monotonic())
            pending, lapse, more = self._unsettled(pending)
            lapsed += more
        waited = time.monotonic()
        if save or lapsed:
            await self.save_records()
        for key in lapsed:
            self.table.membership.detach(key)
        if (took := time.monotonic() - began) > SLOW_SETTLE_S:
            self._slow.warning(
                "settle over 0.2 s" if took > 2 * SLOW_SETTLE_S else "settle over 0.1 s",
                "settling the drops of %d key(s) took %.3f s: %.3f s waiting for daemons (%d settled by a lapsed key "
                "lease, %d unsettled), %.3f s keeping node records in etcd", len(keys), took, waited - began,
                len(lapsed), len(pending), took - (waited - began),
            )  # fmt: skip
        return not pending

    async def clear_replicas(self, m: ClearReplicas, caller: Identity = ANYONE) -> Message:
        """Mooncake's ``batch_replica_clear`` (see :class:`ClearReplicas`): answered, as a remove is,
        once the daemons dropped what it cleared."""
        candidates, held = self._unheld(m.keys, m.force)
        stored = self._stored_blocks(candidates)
        cleared, commands = self.table.moves.clear_replicas(candidates, m.node)
        gone = set(cleared)
        # The keys that went whole are removed as a remove removes them (a put that lost its answer asks).
        objects = self.table.objects
        self._recent_removals().removed(
            [s for s in stored if s[0] in gone and (e := objects.get(s[0])) is not None and e.removing]
        )
        self.commands.later(commands, "clear-drops")
        await self._settle_drops(cleared)
        skip = set(held)
        return ClearReplicasReply([i for i, k in enumerate(m.keys) if k in gone and i not in skip], held)

    def _unheld(self, keys: list[str], force: bool) -> tuple[list[str], list[int]]:
        """``keys`` but those a recent read holds (the master's ``--default-kv-lease-ttl``; none with
        ``force``), and the indexes of those held."""
        if force or not self.table.reads.hold_ms:
            return keys, []
        held = self.table.reads.held(keys, now_ms())
        if not held:
            return keys, held
        skip = set(held)
        return [k for i, k in enumerate(keys) if i not in skip], held

    def _stored_blocks(self, keys: list[str]) -> list[tuple[str, int, int]]:
        """(key, write id, checksum) of those of ``keys`` stored and not being removed: what a remove
        of them takes away, for :meth:`_recent_removals`."""
        objects = self.table.objects
        return [
            (k, e.write_id, e.checksum)
            for k in keys
            if (e := objects.get(k)) is not None and e.committed and not e.removing
        ]

    def _unsettled(self, keys: list[str]) -> tuple[list[str], float, list[str]]:
        """Of ``keys``, those a reader that goes to a daemon directly may still find there: a drop
        of them under way (:meth:`Commands.dropping`), or removed with a replica not yet dropped on a
        node that serves by key (its lease for that not lapsed: see NodeRegistry.key_lease_end);
        the earliest end of such a lease (their wait may end then; inf: none); and those removed
        with every replica left on such nodes out of that lease (settled by lapses). A node frozen or
        cut off costs a remove its lease to serve by key, not the node TTL; the blocks it owes are
        noted in its record (Membership.owe: kept in etcd before the key leaves the table and
        the remove is answered, see :meth:`_settle`)."""
        now = time.monotonic()
        dropping = self.commands.dropping(keys)
        removing = set(self.table.reads.removing(keys))
        nodes, objects, pending_puts = self.nodes, self.table.objects, self.table.pending
        lapse = math.inf
        out: list[str] = []
        lapsed: list[str] = []
        for k in keys:
            if k in dropping:
                out.append(k)
            elif k in removing and (entry := objects.get(k) or pending_puts.get(k)) is not None:
                serving = [r.node_id for r in entry.replicas if not nodes.key_lease_lapsed(r.node_id, now)]
                if serving:
                    out.append(k)
                    if nodes.key_lease_s:
                        lapse = min(lapse, *(nodes.key_lease_end(n) for n in serving))
                else:  # settled by lapses: a new leader must drop the blocks, not adopt them
                    for r in entry.replicas:
                        self.table.membership.owe(r.node_id, [k])
                    lapsed.append(k)
        if out and nodes.key_lease_s:
            lapse = min(lapse, self.commands.next_lapse(out) or math.inf)
        return out, lapse, lapsed

    def evict_keys(self, keys: Iterable[str]) -> tuple[int, list[str]]:
        """An operator's eviction of stored blocks from every tier; returns how many went and the
        pinned ones that stayed (the daemons drop them in the background)."""
        evicted, pinned, commands = self.table.moves.evict_keys(keys)
        self.commands.later(commands, "admin-evict")
        return evicted, pinned

    def evict_tier(self, node_id: str, tier: TierName) -> int:
        """An operator's emptying of one tier of a node (see Moves.evict_tier)."""
        count, commands = self.table.moves.evict_tier(node_id, tier)
        self.commands.later(commands, "admin-evict-tier")
        return count

    # -- copies between nodes ---------------------------------------------------------------------
    async def drain(self, node_id: str, batch: int = 256) -> int:
        """Take ``node_id`` out of placement and move its blocks to other nodes; returns the blocks left on it.

        A block with a copy elsewhere loses this one; another is copied by a node with room
        (the target reads it from this node's daemon), then dropped here. Blocks nobody has
        room for stay (and are counted in the answer); a later drain tries again."""
        table = self.table
        if node_id not in table.nodes:
            raise NotFound(f"node {node_id!r} is not registered")
        table.moves.start_drain(node_id)
        source = table.nodes[node_id].address
        failed: set[str] = set()
        while True:
            moves, drops = table.moves.plan_moves(node_id, batch, skip=failed)
            if not moves and not drops:
                break
            await self.commands.run(drops, table)
            self._same_term(table, "the drain")
            per_target: dict[str, list[Move]] = {}
            for move in moves:
                per_target.setdefault(move.target, []).append(move)
            for target, group in per_target.items():
                got = await self.commands.fetch(target, source, group, "drain")
                done = got or [False] * len(group)
                self._same_term(table, "the drain")
                failed.update(mv.key for mv, ok in zip(group, done, strict=True) if not ok)
                await self.commands.run(table.moves.finish_moves(node_id, group, done, answered=got is not None), table)
                self._same_term(table, "the drain")
        return table.inspection.blocks_on(node_id)

    async def replicate(self, m: Replicate, caller: Identity = ANYONE) -> Message:
        return ReplicateReply(*await self.copy_into(m.keys, m.node_id, m.max_bytes))

    async def copy_into(self, keys: list[str], node_id: str, max_bytes: int) -> Replicated:
        """Copy stored blocks into the DRAM of ``node_id``, keeping their other replicas; returns the
        blocks and bytes copied. See :meth:`Moves.plan_replicas` for which are taken."""
        table = self.table
        moves = table.moves.plan_replicas(keys, node_id, max_bytes)
        per_source: dict[str, list[Move]] = {}
        for move in moves:
            per_source.setdefault(move.source, []).append(move)
        # Addresses now, before any await: a source that leaves meanwhile fails its copies in its daemon.
        todo = [(table.nodes[source].address, group) for source, group in per_source.items()]
        copied: list[Move] = []

        def finish(group: list[Move], done: list[bool] | None) -> None:
            made, drops = table.moves.finish_replicas(group, done or [False] * len(group), answered=done is not None)
            copied.extend(made)
            self.commands.later(drops, "replicate-drops", table)

        try:
            while todo:  # one source after another: the target's copy lane serialises them anyway
                address, group = todo[0]
                done = await self.commands.fetch(node_id, address, group, "replicate")
                todo.pop(0)
                finish(group, done)
        finally:
            for _, group in todo:  # cancelled: the target may hold what it was copying
                finish(group, None)
        return Replicated(len(copied), sum(mv.size for mv in copied))
