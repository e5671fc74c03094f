"""The client's operations, written once: :class:`ClientCore`, driven by both faces.

Every public operation of :class:`~kvstore_client.store.Store` and
:class:`~kvstore_client.aio.AsyncStore` is a generator here that checks its arguments, decides
what to send, yields the I/O as :mod:`effects <kvstore_client.effects>`, and decides what each
answer means. The faces only carry the effects out (blocking, or on the event loop), so both
offer the same methods, with the same failover and the same errors.

Reads: a key whose node the client remembers (from its own put or an earlier get) is read from
that node's daemon in one round trip, by key: the daemon is authoritative for the committed,
checksummed blocks it holds, and reports the hit to the master later. Other keys (and hint
misses) ask the master where they are, then read each block from its replicas in turn
(:class:`~kvstore_client.reads.Failover`): a replica on a dead or stalled node is followed by the
next, and a block is a miss only when none serves it, never an error or a hang. Readers that
copy memory without the daemon (shared memory, UCX) get leases from the master.

Writes: with granted space (``ClientConfig.grant_bytes``), a put is one round trip to a daemon,
which checks the bytes and has the master commit them before it answers. Otherwise (several
replicas, blocks too large for a grant, a node that is not reached through its daemon's socket)
the master reserves extents, the bytes go to the daemons, and the master commits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Protocol, TypeVar

from kvstore.buffers import as_view
from kvstore.config import WRITE_FLOOR_BPS, ClientConfig
from kvstore.errors import (
    BufferTooSmall,
    ConnectionFailed,
    CorruptBlock,
    GrantExpired,
    InvalidArgument,
    KVStoreError,
    RetryLater,
    Timeout,
)
from kvstore.events import EngineBlock
from kvstore.keys import BlockKey, checksum, validate_key
from kvstore.protocol import (
    MAX_BATCH_KEYS,
    PUT_EXISTS,
    PUT_STORED,
    ClearReplicas,
    ClearReplicasReply,
    Exists,
    ExistsReply,
    GetReplicas,
    GetReplicasReply,
    GrantReply,
    GrantSpace,
    KeysReply,
    LabelBlocks,
    ListKeys,
    ListNodes,
    LocatedRef,
    MatchPrefix,
    MatchPrefixNodes,
    MatchPrefixNodesReply,
    MatchPrefixReply,
    NodeInfo,
    NodePrefix,
    NodesReply,
    OkReply,
    PrefixMatch,
    PutEnd,
    PutEndReply,
    PutRevoke,
    PutStart,
    PutStartReply,
    Remove,
    RemoveReply,
    ReplicaRef,
    Replicate,
    Replicated,
    ReplicateReply,
    ReturnGrants,
    Stats,
    StatsReply,
)
from kvstore.results import PutStatus
from kvstore.write_ids import next_write_id, same_write
from kvstore_client.effects import (
    Block,
    FlushCached,
    Job,
    Notify,
    Op,
    Pause,
    PutGranted,
    ReadDirect,
    ReadLocated,
    ReadRanges,
    WriteReserved,
    call,
    daemons,
)
from kvstore_client.grants import Carved, Grant, GrantPool, NeedGrant
from kvstore_client.hedging import ReadTimes
from kvstore_client.hints import LocationHints
from kvstore_client.marks import NodeMarks
from kvstore_client.puts import (
    Items,
    PutOptions,
    checked_options,
    checked_pairs,
    sort_tickets,
    take_commits,
    take_granted,
    take_write_codes,
)
from kvstore_client.reads import Failover, raise_failure, refused, unreachable

T = TypeVar("T")

_CONFIRMS = 3
"""How often a read asks the master about a node that has not begun answering for a block's last
copy (after the failover patience, then twice and four times that) before it waits for it the whole
timeout: a frozen node is suspected by the master past three missed heartbeats (its tick and its
probe: usually by the second asking; :meth:`ClientCore._confirm`)."""

_NO_NODES: frozenset[str] = frozenset()

_GRANTS_PAUSE_S = 10.0
"""After a grant on a node this client does not reach through its daemon, or a grant refused, how
long puts skip grants."""


class Transport(Protocol):
    """What the core asks a face about its data paths (answered without talking to daemons)."""

    @property
    def may_lease(self) -> bool:
        """Whether some path reads without the daemon (shared memory, UCX), so gets are leased."""

    def one_trip(self, node_id: str, address: str) -> bool:
        """Whether reads by key and writes into grants of this node go through its daemon's socket."""

    def local(self, replica: ReplicaRef) -> bool:
        """Whether this client copies ``replica`` without its daemon (its DRAM mapped on this host)."""


class OverTcp:
    """A face's data paths when it has only sockets: every node through its daemon, nothing leased."""

    may_lease = False

    def one_trip(self, node_id: str, address: str) -> bool:
        return True

    def local(self, replica: ReplicaRef) -> bool:
        return False


class LeaseQueue(Protocol):
    """Ids of read leases to end (see :class:`~kvstore_client.leases.LeaseReleaser`)."""

    def take(self) -> list[int]: ...

    def add(self, ids: Iterable[int]) -> None: ...


class ClientCore:
    """One client's operations and the state they share: its location hints and its grants.

    Owns ``hints`` and ``grants``; the face that drives it owns the connections and sets
    ``closed``. Thread-safe where the state is (hints and grants lock briefly, never across I/O)."""

    def __init__(self, config: ClientConfig, transport: Transport, leases: LeaseQueue | None = None) -> None:
        self.config = config
        self.transport = transport
        self.leases = leases
        self.hints = LocationHints(config.location_hints)
        self.grants = GrantPool(int(config.grant_bytes))
        self._grants_paused_until = 0.0
        self.read_times = ReadTimes(self.failover_s, config.hedge_reads)
        """Recent read times: the patience of a read with somewhere else to go (see kvstore_client.hedging)."""
        self.marks = NodeMarks(self.failover_s, self.read_times)
        """What this client knows lately of nodes (suspected, slow, silent, unreached), and its reports."""
        self.closed = False
        self._unflushed: set[tuple[str, str]] = set()
        """Nodes (node_id, address) that acknowledged cached puts of this client since its last flush."""
        self._unflushed_lock = threading.Lock()

    # -- writes ------------------------------------------------------------------------------
    def put_many(self, items: Iterable[tuple[Any, Any]], options: PutOptions | None) -> Op[list[PutStatus]]:
        """Store several blocks. Raises the first failure (after giving back what it reserved)."""
        opts = checked_options(options)
        checked = checked_pairs(items)
        if len(checked) > MAX_BATCH_KEYS:  # the master takes at most this many a request
            out: list[PutStatus] = []
            for part in _batches(checked):
                out += yield from self.put_many(part, opts)
            return out
        statuses: list[PutStatus | None] = [None] * len(checked)
        todo = list(range(len(checked)))
        unsure: list[int] = []
        write_id = next_write_id()  # every message of this put carries it, retries too
        if (
            (opts.replicas or self.config.replicas) == 1
            and self.config.grant_bytes
            and todo
            and time.monotonic() >= self._grants_paused_until
        ):
            todo = yield from self._put_granted(checked, todo, opts, statuses, unsure, write_id)
        done = yield from self._put_rounds(checked, todo, opts, statuses, unsure, write_id)
        return (yield from self._own_exists(checked, unsure, done, write_id))

    def _cached(self, options: PutOptions | None) -> bool:
        mode = options.mode if options is not None and options.mode is not None else self.config.put_mode
        return mode == "cached"

    def _acknowledged(self, job: PutGranted) -> None:
        """A node acknowledged cached puts of this client: :meth:`flush` waits for it."""
        with self._unflushed_lock:
            self._unflushed.add((job.node_id, job.address))

    def flush(self) -> Op[None]:
        """Wait until every cached put this client made so far is known to the master (visible to
        every client), or refused by it: each node that acknowledged one waits for its commits.
        Raises the first failure (the nodes not confirmed stay to flush again)."""
        with self._unflushed_lock:
            nodes, self._unflushed = sorted(self._unflushed), set()
        outcomes = yield from self._daemons([FlushCached(node_id, address) for node_id, address in nodes])
        failed = [(node, o) for node, o in zip(nodes, outcomes, strict=True) if isinstance(o, BaseException)]
        if failed:
            with self._unflushed_lock:
                self._unflushed.update(node for node, _ in failed)
            raise failed[0][1]

    def _own_exists(
        self, items: Items, unsure: list[int], statuses: list[PutStatus], write_id: int
    ) -> Op[list[PutStatus]]:
        """A write whose bytes went out but whose put did not end with them (no answer came, the
        daemon's commit failed or answered EXISTS, or a new leader did not know the reservation and
        a retry found the key) may have been committed all the same: a new leader adopts blocks from the daemons'
        inventories, and the retry then finds the key stored. Where the stored block is this put's
        write (its write id, or where the master knows none, its size and checksum), it was this put
        that stored it: STORED, not EXISTS. (A put that sent no bytes and found the key answers
        EXISTS without asking.)"""
        asked = sorted({i for i in unsure if statuses[i] is PutStatus.EXISTS})
        if asked:
            keys: list[str] = [items[i][0] for i in asked]
            reply = yield from call(GetReplicas(keys, [], False, write_ids=True), GetReplicasReply)
            ids = reply.write_ids if len(reply.write_ids) == len(keys) else [0] * len(keys)  # none named: unknown
            for i, size, check, stored in zip(asked, reply.sizes, reply.checksums, ids, strict=True):
                if size == items[i][1].nbytes and same_write(stored, check, write_id, checksum(items[i][1])):
                    statuses[i] = PutStatus.STORED
        return statuses

    def _put_rounds(
        self, items: Items, todo: list[int], opts: PutOptions, statuses: list[PutStatus | None], unsure: list[int],
        write_id: int,
    ) -> Op[list[PutStatus]]:  # fmt: skip
        """Put ``todo`` the two-trip way, retrying the keys that were busy; every item's status.
        ``unsure`` gets the indexes whose bytes went to a daemon (see :meth:`_own_exists`)."""
        for attempt in range(self.config.put_retries + 1):
            if not todo:
                break
            retry, unreached = yield from self._put_round(items, todo, opts, statuses, unsure, write_id, attempt)
            if not retry:
                break
            if attempt == self.config.put_retries:
                if unreached is not None:
                    raise unreached
                raise RetryLater(f"key {items[retry[0]][0]!r} stayed busy through {attempt} retries")
            yield Pause(min(0.01 * 2**attempt, 0.5))
            todo = retry
        return [s if s is not None else PutStatus.EXISTS for s in statuses]

    def granted_block(self, key: Any, data: Any, options: PutOptions | None) -> PutGranted | None:
        """A one-key put's job into the grant in hand, when it can go in one trip with no other
        step: one replica, a grant of the default placement that holds it, written through its
        daemon's socket. None otherwise (a bad item too): the caller takes :meth:`put_many`, which
        decides. The faces' put fast path; :meth:`granted_put` reads the job's outcome."""
        if type(key) is not str or self.closed or not self.config.grant_bytes or (options is not None and (
            type(options) is not PutOptions or options.preferred_node is not None or options.replicas not in (None, 1)
        )) or self.config.replicas != 1 or time.monotonic() < self._grants_paused_until:  # fmt: skip
            return None
        try:
            key, view = validate_key(key), as_view(data)
        except KVStoreError:
            return None
        if not view.nbytes or self._grants_unreached():
            return None  # put_many gives back a grant on a node this client could not reach, and asks anew
        carved = self.grants.carve_held([view.nbytes], None)
        if carved is None:
            return None  # put_many asks for a grant (and gives back the one it retires)
        grant, [offset] = carved
        if not self.transport.one_trip(grant.node_id, grant.address):
            return None
        block = Block(key, view, offset, checksum(view), write_id=next_write_id())
        pin = options is not None and options.pin
        return PutGranted(grant.node_id, grant.address, grant.grant_id, [block], pin, self._cached(options))

    def granted_put(self, job: PutGranted, outcome: Any) -> PutStatus | Op[list[PutStatus]]:
        """The status of a one-key put from its job's outcome (the daemon's codes, or the exception
        it raised); where that is not STORED or EXISTS, the rest of :meth:`put_many` from that
        answer on (the grant dropped and given back as there, then the two-trip way, or the
        failure raised), for the face to run."""
        self.marks.report(job.node_id, outcome)
        if isinstance(outcome, list) and len(outcome) == 1:
            self.marks.answered(job.node_id)
            code = outcome[0][0]
            if code == PUT_STORED:
                self.hints.note([(job.blocks[0].key, (job.node_id, job.address))])
                if job.cached:
                    self._acknowledged(job)
                return PutStatus.STORED
            if code == PUT_EXISTS:
                return self._granted_exists(job)
        return self._after_granted(job, outcome)

    def _granted_exists(self, job: PutGranted) -> Op[list[PutStatus]]:
        """EXISTS from a write into a grant: the block may be this put's own (see :meth:`_own_exists`)."""
        block = job.blocks[0]
        items: Items = [(BlockKey(block.key), block.view)]
        return (yield from self._own_exists(items, [0], [PutStatus.EXISTS], block.write_id))

    def _after_granted(self, job: PutGranted, outcome: Any) -> Op[list[PutStatus]]:
        block = job.blocks[0]
        items: Items = [(BlockKey(block.key), block.view)]
        statuses: list[PutStatus | None] = [None]
        grant = next(
            (
                g
                for g in self.grants.held()  # ids restart with a new master: the node too
                if (g.grant_id, g.node_id, g.address) == (job.grant_id, job.node_id, job.address)
            ),
            None,
        )
        unsure: list[int] = []
        todo = yield from self._granted_outcome(items, [0], grant, job, outcome, statuses, unsure)
        done = yield from self._put_rounds(items, todo, PutOptions(pin=job.pinned), statuses, unsure, block.write_id)
        return (yield from self._own_exists(items, unsure, done, block.write_id))

    def _grants_unreached(self) -> list[Grant]:
        """The grants this client holds on nodes it could not reach lately (see :meth:`NodeMarks.unreached`)."""
        if not self.marks.unreached_until:
            return []
        unreached = self.marks.unreached()
        return [g for g in self.grants.held() if g.node_id in unreached]

    def _carve(self, sizes: list[int], preferred: str | None) -> Op[Carved | None]:
        for grant in self._grants_unreached():  # given back: the next grant avoids its node
            yield from self._give_back(self.grants.drop(grant))
        step = self.grants.carve(sizes, preferred)
        if not isinstance(step, NeedGrant):
            return step
        try:
            yield from self._give_back(step.retired)
            reply = yield from call(GrantSpace(self.grants.size, preferred, self.marks.unreached()), GrantReply)
        except BaseException:
            self.grants.abandon(preferred)
            raise
        carved, back = self.grants.install(reply, preferred, sizes)
        yield from self._give_back(back)
        return carved

    def _give_back(self, grant_ids: list[int]) -> Op[None]:
        if grant_ids:
            yield Notify(ReturnGrants(grant_ids))  # best effort: a grant also ends by itself

    def _put_granted(
        self, items: Items, todo: list[int], opts: PutOptions, out: list[PutStatus | None], unsure: list[int],
        write_id: int,
    ) -> Op[list[int]]:  # fmt: skip
        """Put ``todo`` in one round trip into granted space; returns the indexes left to the two-trip way."""
        try:
            carved = yield from self._carve([items[i][1].nbytes for i in todo], opts.preferred_node)
        except (ConnectionFailed, Timeout):
            raise
        except KVStoreError:
            # No grant now (no room, no nodes, a tenant whose puts take more copies than a grant
            # holds): this put and those of the next while go the two-trip way, which says why if
            # it fails too, without asking for a grant each time.
            self._grants_paused_until = time.monotonic() + _GRANTS_PAUSE_S
            return todo
        if carved is None:
            return todo
        grant, offsets = carved
        if not self.transport.one_trip(grant.node_id, grant.address):
            # Granted space on a node this client reaches by shared memory, UCX or rails: those put
            # the two-trip way (their bytes do not go through the daemon's socket). Ask again later.
            yield from self._give_back(self.grants.drop(grant))
            self._grants_paused_until = time.monotonic() + _GRANTS_PAUSE_S
            return todo
        blocks = [
            Block(items[i][0], items[i][1], o, checksum(items[i][1]), write_id=write_id)
            for i, o in zip(todo, offsets, strict=True)
        ]
        job = PutGranted(grant.node_id, grant.address, grant.grant_id, blocks, opts.pin, self._cached(opts))
        [outcome] = yield from self._daemons([job])
        return (yield from self._granted_outcome(items, todo, grant, job, outcome, out, unsure))

    def _granted_outcome(
        self, items: Items, todo: list[int], grant: Grant | None, job: PutGranted, outcome: Any,
        out: list[PutStatus | None], unsure: list[int],
    ) -> Op[list[int]]:  # fmt: skip
        """Statuses from a one-trip put's outcome; returns the indexes left to the two-trip way.
        ``grant``: the client's grant the job wrote into, if it still holds it (dropped here when
        its node is unreachable or ended it). ``unsure`` gets the indexes left to the two-trip way:
        their write may have landed all the same (no answer came, or the daemon's commit was cut
        short by a change of leader after the bytes were in: a new leader adopts them from its
        inventory)."""
        if unreachable(outcome):
            self.marks.mark_unreached(job.node_id)
            if grant is not None:  # gone or stalled: the master places elsewhere
                yield from self._give_back(self.grants.drop(grant))
            unsure.extend(todo)
            return todo
        raise_failure(outcome)
        codes: list[tuple[int, str]] = outcome
        if grant is not None and any(code == GrantExpired.code for code, _ in codes):
            yield from self._give_back(self.grants.drop(grant))
        left, placed = take_granted(items, todo, codes, job.node_id, job.address, out)
        self.hints.note(placed)
        if job.cached and placed:
            self._acknowledged(job)
        # Refused or EXISTS here, but the block may be this put's own all the same (a retried write,
        # a master of another term that adopted it): see _own_exists.
        unsure.extend(i for i in todo if i in left or out[i] is PutStatus.EXISTS)
        return left

    def _put_round(
        self, items: Items, todo: list[int], opts: PutOptions, out: list[PutStatus | None], unsure: list[int],
        write_id: int, attempt: int = 0,
    ) -> Op[tuple[list[int], KVStoreError | None]]:  # fmt: skip
        """One put_start/write/put_end round over ``todo`` (the put's ``attempt``-th); returns the
        indexes to retry, and the failure of a daemon that was not reached or did not answer, if
        one was."""
        keys: list[str] = [items[i][0] for i in todo]
        sizes = [items[i][1].nbytes for i in todo]
        start = PutStart(
            keys,
            sizes,
            opts.replicas or self.config.replicas,
            opts.preferred_node,
            opts.pin,
            write_id,
            self.marks.unreached(),
        )
        plan = sort_tickets((yield from call(start, PutStartReply)), todo, out)
        sums = {i: checksum(items[i][1]) for group in plan.writes.values() for i, _ in group}
        jobs = [
            WriteReserved(group[0][1].node_id, address,
                  [Block(items[i][0], items[i][1], r.offset, sums[i], r.seal, write_id) for i, r in group], opts.pin,
                  self.write_patience_s(sum(items[i][1].nbytes for i, _ in group), attempt))
            for address, group in plan.writes.items()
        ]  # fmt: skip
        failed: set[int] = set()
        unsure.extend(sums)  # their bytes go out now: a commit cut short may keep them all the same
        for job, (address, group), outcome in zip(
            jobs, plan.writes.items(), (yield from self._daemons(jobs)), strict=True
        ):
            if unreachable(outcome):  # given up at its patience, or refused: the retry is placed elsewhere
                self.marks.mark_unreached(job.node_id)
            if isinstance(outcome, KVStoreError):
                codes = [(outcome.code, str(outcome))] * len(group)
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                codes = outcome
            take_write_codes(plan, items, address, group, codes, failed)
        done = [i for i in sums if i not in failed]
        if failed:
            yield from call(PutRevoke([items[i][0] for i in sorted(failed)], write_id), OkReply)
        if done:
            ending = PutEnd([items[i][0] for i in done], [sums[i] for i in done], write_id)
            committed = yield from call(ending, PutEndReply)
            self.hints.note(take_commits(plan, items, done, committed.committed, out))
            if plan.lost:
                yield from call(PutRevoke([items[i][0] for i in plan.lost], write_id), OkReply)
        if plan.failure is not None:
            raise plan.failure
        return plan.retry + plan.lost, plan.unreached

    # -- reads ---------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[Any], *, verify: bool) -> Op[list[bytes | None]]:
        got = yield from self._get([validate_key(k) for k in keys], None, verify)
        return [bytes(b) if b is not None else None for b in got]

    def get_many_into(
        self, keys: Sequence[Any], buffers: Sequence[Any], *, verify: bool, exact_size: bool
    ) -> Op[list[int | None]]:
        """Read blocks straight into ``buffers``; each its size, or None for a miss.

        A block larger than its buffer raises :class:`BufferTooSmall`; with ``exact_size`` a block
        whose size is not exactly its buffer's is a miss instead (a reader that knows what size
        every block must have, such as a KV layout, never takes a foreign object for one).
        """
        if len(keys) != len(buffers):
            raise InvalidArgument(f"get_many_into got {len(keys)} keys but {len(buffers)} buffers")
        checked = [validate_key(k) for k in keys]
        views = [as_view(b, writable=True, what="buffer") for b in buffers]
        got = yield from self._get(checked, views, verify, exact_size=exact_size)
        return [None if g is None else (g if isinstance(g, int) else len(g)) for g in got]

    def _get(
        self, keys: list[BlockKey], views: list[memoryview] | None, verify: bool, *, exact_size: bool = False
    ) -> Op[list[Any]]:
        """Per key: its size (read into ``views[i]``), or with ``views`` None a new buffer; None for a miss."""
        if len(keys) > MAX_BATCH_KEYS:
            got: list[Any] = []
            for start in range(0, len(keys), MAX_BATCH_KEYS):
                part = None if views is None else views[start : start + MAX_BATCH_KEYS]
                got += yield from self._get(keys[start : start + MAX_BATCH_KEYS], part, verify, exact_size=exact_size)
            return got
        out: list[Any] = [None] * len(keys)
        since = self.hints.now()  # what this read finds of a key says nothing of a hint set after this
        rest = yield from self._read_hinted(keys, views, verify, exact_size, out, since)
        if not rest:
            return out
        # The others: where the master says they are.
        located, first_lease = yield from self.locate([keys[i] for i in rest])
        try:
            if views is None:
                bufs = {i: bytearray(loc.size) for i, loc in zip(rest, located, strict=True) if loc is not None}
                targets = {i: memoryview(b) for i, b in bufs.items()}
            else:
                targets = {i: views[i] for i in rest}
            found: dict[int, tuple[LocatedRef, memoryview]] = {}
            for i, loc in zip(rest, located, strict=True):
                if loc is None or (exact_size and loc.size != targets[i].nbytes):
                    continue
                if targets[i].nbytes < loc.size:
                    raise BufferTooSmall(
                        f"buffer of {targets[i].nbytes} bytes cannot hold block {loc.key!r} of {loc.size} bytes"
                    )
                found[i] = (loc, targets[i])
            read = yield from self._read_located(found, verify)
            for i in read:
                out[i] = found[i][0].size if views is not None else bufs[i]
            self.hints.note(((keys[i], read.get(i)) for i in rest), since)  # where each was read; the rest forgotten
            return out
        finally:
            self.release(first_lease, located)

    def hinted(self, key: str) -> tuple[str, str] | None:
        """Where a read of ``key`` by key alone goes: its remembered node, when that node's reads by
        key go through its daemon's socket and it is not suspected (None: ask the master)."""
        place = self.hints.get(key)
        if place is None or not self.transport.one_trip(*place):
            return None
        if self.marks.suspected(place[0]) or self.marks.slow(place[0]):
            return None
        return place

    @property
    def failover_s(self) -> float:
        """How long a read waits for a daemon to begin answering when it has somewhere else to go
        (``ClientConfig.failover_ms``, in seconds)."""
        return self.config.failover_ms / 1000

    @property
    def read_patience_s(self) -> float:
        """How long a read with somewhere else to go (another replica, or the master for a read by
        remembered location) waits for its daemon to begin answering: the recent p99 read time when
        hedging (``ClientConfig.hedge_reads``), else :attr:`failover_s`."""
        return self.read_times.patience_s

    def write_patience_s(self, nbytes: int, attempt: int = 0) -> float:
        """How long a two-trip write of ``nbytes`` waits for its daemon to answer before the put gives
        it up (revoked, then put again, elsewhere: see :meth:`NodeMarks.unreached`): two read failovers (200 ms
        by default; a daemon answers a write in milliseconds once its bytes are in), doubled at each
        attempt of the put after its first (a node slower than that but alive serves a later one), and
        the bytes at 100 MB/s. 0 (the
        whole timeout) with ``failover_ms`` 0, or where that would reach the timeout. A write given up
        may still land: never served by key (the daemon waits for the master's word on a two-trip
        block), dropped by the revoke or as an orphan."""
        if not self.config.failover_ms:
            return 0.0
        patience = 2 * self.failover_s * 2 ** min(attempt, 16) + nbytes / WRITE_FLOOR_BPS
        return patience if patience < self.config.timeout_s else 0.0

    def _timed(self, began: float, outcomes: list[Any]) -> None:
        """A round of reads that began at ``began`` ended now: its time counts toward the hedge
        patience when every node served it (a round with a failure says nothing of read times)."""
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                return
        self.read_times.add(time.monotonic() - began)

    def _daemons(self, jobs: Sequence[Job]) -> Op[list[Any]]:
        """:func:`daemons`, reporting to the master the nodes that could not be reached."""
        outcomes = yield from daemons(jobs)
        for job, outcome in zip(jobs, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                self.marks.report(job.node_id, outcome)
            elif (self.marks.unreached_until or self.marks.silent_until) and self._through_daemon(job):
                self.marks.answered(job.node_id)
        return outcomes

    def _through_daemon(self, job: Job) -> bool:
        """Whether ``job``'s answer came from its node's daemon (a read of a DRAM copy in shared
        memory comes from the arena alone: a frozen daemon's too)."""
        return not isinstance(job, ReadLocated | ReadRanges) or not all(
            self.transport.local(r) for _, r, _ in job.blocks
        )

    def _read_hinted(
        self, keys: list[BlockKey], views: list[memoryview] | None, verify: bool, exact_size: bool, out: list[Any],
        since: int,
    ) -> Op[list[int]]:  # fmt: skip
        """Read the keys whose node is remembered, one trip to that node by key; returns the
        indexes still to read (misses there are forgotten: the master knows better; ``since``: the
        read's :meth:`LocationHints.now`)."""
        per_node: dict[tuple[str, str], list[int]] = {}
        for i, key in enumerate(keys):
            place = self.hinted(key)
            if place is not None:
                per_node.setdefault(place, []).append(i)
        if not per_node:
            return list(range(len(keys)))
        patience = self.read_patience_s  # a node that does not answer: the master's way instead
        jobs = [
            ReadDirect(node_id, address, [keys[i] for i in idx],
                       [views[i] for i in idx] if views is not None else [None] * len(idx), exact_size, patience)
            for (node_id, address), idx in per_node.items()
        ]  # fmt: skip
        missed: list[str] = []
        began = time.monotonic()
        outcomes = yield from self._daemons(jobs)
        self._timed(began, outcomes)
        for job, idx, outcome in zip(jobs, per_node.values(), outcomes, strict=True):
            raise_failure(outcome)
            if unreachable(outcome) or refused(outcome):  # the master's way: maybe another replica
                self.marks.note_unreachable(job.node_id, outcome, job.patience_s)
                missed.extend(keys[i] for i in idx)
                continue
            hits, made = outcome
            for i, hit, buf in zip(idx, hits, made, strict=True):
                if hit is None:
                    missed.append(keys[i])
                    continue
                target = buf if buf is not None else views[i] if views is not None else None
                assert target is not None
                if verify and checksum(memoryview(target)[: hit.size]) != hit.checksum:
                    raise CorruptBlock(f"block {keys[i]!r} read from {job.address} fails its checksum")
                out[i] = buf if buf is not None else hit.size
        self.hints.forget(missed, since)
        return [i for i in range(len(keys)) if out[i] is None]

    def locate(self, keys: list[str]) -> Op[tuple[list[LocatedRef | None], int]]:
        """Where ``keys`` are (None for a miss), and the first of their read leases (0: none), taken
        when a path may read without the daemon; hand both to :meth:`release` once the reads are over.
        The nodes the master says it suspects are suspected here too (:meth:`NodeMarks.suspected`: a block's
        copy there read last, or with the failover patience), until they answer this client."""
        lease = self.transport.may_lease
        taken = self.leases.take() if self.leases is not None else []
        reply = yield from call(GetReplicas(keys, taken, lease), GetReplicasReply)
        self.marks.note_suspects(reply.suspects)
        return reply.located(keys), (reply.first_lease if lease else 0)

    def release(self, first_lease: int, located: Sequence[LocatedRef | None]) -> None:
        """Queue the leases of a finished read for release (they ride on the next request)."""
        if first_lease and self.leases is not None:
            hits = sum(loc is not None for loc in located)
            self.leases.add(range(first_lease, first_lease + hits))

    def _read_located(
        self, blocks: dict[int, tuple[LocatedRef, memoryview]], verify: bool
    ) -> Op[dict[int, tuple[str, str]]]:
        """Read located blocks, each from its replicas in turn; returns the node each was read from.

        A block whose replica is on a suspected node is read at its next replica; on a slow node
        (:meth:`NodeMarks.slow`), at its next replica on a node that is not slow, and there last (when every
        later one is slow too, the marks say more of this client or its host than of any node: the
        replicas are read in order, each with the hedge patience while another is still to come).
        A node that does not begin answering within the patience is given up for the block's next
        replica and read again last (:meth:`Failover.defer`: it may be the one alive). The last
        replica is waited for, but on a node that is suspected, or :meth:`NodeMarks.silent` (a read gave it
        up and its daemon has not answered since), only the failover patience: a miss within it,
        not a wait of the whole timeout on a node that already did not answer (5 s reads in
        bench.chaos's client cuts, when every node was slow and the read came to rest on the cut one).

        A node holding both blocks with another replica and last copies of this read is asked for
        the former first, with their patience, and for its last copies in the next round: frozen,
        it is given up then, so its last copies are misses within the failover patience, and the
        others are read elsewhere (one job for both waited the last copies' patience for all:
        4.39 s in bench.chaos's daemon SIGSTOP, the master not yet suspecting a node frozen 10 ms
        before). A node that answers costs the last copies one more round trip.

        A last copy on a node neither suspected nor silent is not waited for blindly either: past
        the failover patience (then twice, four times that) the read asks the master where the block is and
        whether it suspects the node (:meth:`_confirm`): a node that stopped heartbeating makes
        its last copies misses, one that heartbeats is read again with twice the patience, after
        :data:`_CONFIRMS` askings with the whole timeout (a slow read of a live node completes). A
        node frozen just before the read was waited for until it was resumed: 2.9 s in bench.chaos's
        daemon SIGSTOP."""
        plan = Failover({i: loc for i, (loc, _) in blocks.items()})
        where: dict[int, tuple[str, str]] = {}
        rechecked: set[int] = set()
        asked: dict[str, int] = {}
        """Node -> how often this read asked the master about it and heard it is not suspected."""
        fail = self.failover_s
        while plan:
            rounds = plan.round()
            suspects: AbstractSet[str] = _NO_NODES
            if self.marks.suspected_until or self.marks.slow_until:  # a calm client marks no node: nothing to skip
                suspects = {node_id for node_id, _ in rounds if self.marks.suspected(node_id)}
                slow = {node_id for node_id, _ in rounds if self.marks.slow(node_id)}
                skipped = [
                    (i, node_id) for (node_id, _), group in rounds.items() if node_id in suspects or node_id in slow
                    for i, _ in group
                    if plan.has_next(i) and (node_id in suspects or any(not self.marks.slow(n) for n in plan.later(i)))
                ]  # fmt: skip
                if skipped:  # read at another replica: for good past a suspected node, a slow one's last
                    for i, node_id in skipped:
                        if node_id in suspects:
                            plan.missed(i)
                        else:
                            plan.defer(i)
                    continue
            if plan.not_held:  # a node answered it does not hold a block: before a wait on its last replica,
                doubted = [i for group in rounds.values() for i, _ in group if i not in rechecked and plan.doubted(i)]
                if doubted:  # is the block still there?
                    rechecked.update(doubted)
                    yield from self._recheck(plan, doubted, [blocks[i][0] for i in doubted])
                    continue
            jobs = []
            asking: dict[tuple[str, str], bool] = {}  # places whose last copies are read with a confirm patience
            for place, group in rounds.items():
                onward = plan.onward(group)
                if onward:  # somewhere else to go; a node's last copies wait for its answer to these (see above)
                    rounds[place] = group = onward
                    patience = self.read_patience_s
                else:
                    node_id = place[0]
                    if node_id in suspects or (self.marks.silent_until and self.marks.silent(node_id)):
                        patience = fail
                    elif (
                        fail and (times := asked.get(node_id, 0) if asked else 0) < _CONFIRMS
                        and (patience := fail * (1 << times)) < self.config.timeout_s
                    ):  # fmt: skip
                        asking[place] = True
                    else:
                        patience = 0.0
                jobs.append(ReadLocated(*place, [(blocks[i][0], r, blocks[i][1]) for i, r in group], patience))
            began = time.monotonic()
            outcomes = yield from self._daemons(jobs)
            self._timed(began, outcomes)
            to_confirm: list[int] = []
            for job, (place, group), outcome in zip(jobs, rounds.items(), outcomes, strict=True):
                if (
                    asking and place in asking and isinstance(outcome, Timeout)
                    and time.monotonic() - began < self.config.timeout_s
                ):  # fmt: skip
                    to_confirm.extend(i for i, _ in group)  # not begun within the confirm patience: ask
                    continue
                if isinstance(outcome, BaseException) and unreachable(outcome):
                    self.marks.note_unreachable(job.node_id, outcome, job.patience_s)
                elif job.node_id in suspects:
                    self.marks.clear_suspect(job.node_id)  # it answered: back

                def hit(i: int, size: object, place: tuple[str, str] = place) -> bool:
                    if size is None:
                        return False
                    loc, view = blocks[i]
                    if verify and checksum(view[: loc.size]) != loc.checksum:
                        raise CorruptBlock(f"block {loc.key!r} read from {place[1]} fails its checksum")
                    where[i] = place
                    return True

                plan.take(group, outcome, hit, gave_up=job.patience_s > 0 and job.node_id not in suspects)
            if to_confirm:
                yield from self._confirm(plan, to_confirm, [blocks[i][0] for i in to_confirm], asked)
        plan.finish()
        return where

    def _confirm(
        self, plan: Failover, blocks: list[int], located: list[LocatedRef], asked: dict[str, int]
    ) -> Op[None]:  # fmt: skip
        """Last copies of ``plan`` whose nodes did not begin answering within the confirm patience
        (see :meth:`_read_located`): where the master places each block now (:meth:`_recheck`), and
        a block whose last copy is still on a node the master suspects is a miss (the node missed
        heartbeats: frozen or cut off), the others read again (``asked`` counts the times per node).
        A master that does not answer leaves the nodes to the whole timeout (a leader's fault)."""
        nodes = {plan.current(i).node_id for i in blocks}
        suspects = yield from self._recheck(plan, blocks, located)
        for node_id in nodes:
            asked[node_id] = _CONFIRMS if suspects is None else asked.get(node_id, 0) + 1
        if suspects:
            for i in blocks:
                if plan.waiting(i) and not plan.has_next(i) and plan.current(i).node_id in suspects:
                    plan.missed(i)

    def _recheck(self, plan: Failover, blocks: list[int], located: list[LocatedRef]) -> Op[list[str] | None]:
        """Blocks of ``plan`` (``located`` as this read found them) whose last replica is to be read
        after another replica's node answered that it does not hold the block: where the master
        places the block now. A block removed, or put again with other bytes, is a miss now, not a
        wait on that last node (frozen, it would cost the whole timeout: 3.7 s in bench.chaos's
        daemon SIGSTOP); one still there is waited for as any last copy (the other node may only
        have lost its copy: evicted there); one moved is read where it is now, but for copies this
        client would read without the daemon (they need the lease this second look does not take).
        One master round trip, only after such a miss; a master that does not answer leaves the
        blocks as they were (the read needs no master to finish). Returns the nodes the master
        suspects (noted as :meth:`locate` notes them), None when it did not answer."""
        keys = [loc.key for loc in located]
        try:
            reply = yield from call(GetReplicas(keys, [], False), GetReplicasReply)
        except KVStoreError:
            return None
        self.marks.note_suspects(reply.suspects)
        for i, before, now in zip(blocks, located, reply.located(keys), strict=True):
            if now is None or now.checksum != before.checksum:
                plan.missed(i)
            else:
                plan.relocate(i, [r for r in now.replicas if r in before.replicas or not self.transport.local(r)])
        return reply.suspects

    def get_range_many_into(
        self, keys: Sequence[Any], start: int, length: int, buffers: Sequence[Any]
    ) -> Op[list[int | None]]:
        """Read bytes ``[start, start + length)`` of each block into its buffer: ``length`` each, or None.

        One layer of a KV block, say, without the rest of it. A block that is missing or
        shorter than ``start + length`` is a miss. A copy this client can read locally is read
        first, then the others in turn. The block checksum covers whole blocks only, so a range
        is not verified.
        """
        if type(start) is not int or type(length) is not int or start < 0 or length <= 0:
            raise InvalidArgument(f"a range needs start >= 0 and length > 0, got ({start!r}, {length!r})")
        if len(keys) != len(buffers):
            raise InvalidArgument(f"get_range_many_into got {len(keys)} keys but {len(buffers)} buffers")
        views = [as_view(b, writable=True, what="buffer") for b in buffers]
        for view in views:
            if view.nbytes < length:
                raise BufferTooSmall(f"buffer of {view.nbytes} bytes cannot hold a range of {length} bytes")
        checked: list[str] = [validate_key(k) for k in keys]
        located, first_lease = yield from self.locate(checked)
        try:
            long_enough = {i: loc for i, loc in enumerate(located) if loc is not None and loc.size >= start + length}
            plan = Failover(long_enough, self.transport.local)
            while plan:
                rounds = plan.round()
                jobs = [
                    ReadRanges(node_id, address, [(long_enough[i], r, views[i][:length]) for i, r in group],
                               start, length)
                    for (node_id, address), group in rounds.items()
                ]  # fmt: skip
                for group, outcome in zip(rounds.values(), (yield from self._daemons(jobs)), strict=True):
                    plan.take(group, outcome, lambda _, ok: bool(ok))
            plan.finish()
            return [length if i in plan.read else None for i in range(len(checked))]
        finally:
            self.release(first_lease, located)

    # -- queries -----------------------------------------------------------------------------------
    def nodes(self) -> Op[list[NodeInfo]]:
        return (yield from call(ListNodes(), NodesReply)).nodes

    def exists_many(self, keys: Sequence[Any]) -> Op[list[bool]]:
        out: list[bool] = []
        for part in _batches(_checked(keys)):
            out += (yield from call(Exists(part), ExistsReply)).exists
        return out

    def label_blocks(self, keys: Sequence[Any], labels: Sequence[EngineBlock]) -> Op[None]:
        """Name ``keys`` as an engine names their blocks, for the master's KV events (see
        :class:`~kvstore.protocol.LabelBlocks`)."""
        checked = _checked(keys)
        if len(checked) != len(labels):
            raise InvalidArgument(f"{len(checked)} keys but {len(labels)} labels")
        at = 0
        for part in _batches(checked):
            yield from call(LabelBlocks(part, list(labels[at : at + len(part)])), OkReply)
            at += len(part)

    def sizes(self, keys: Sequence[Any]) -> Op[list[int | None]]:
        """Each key's size in bytes, None for a miss; no bytes move."""
        out: list[int | None] = []
        for part in _batches(_checked(keys)):
            taken = self.leases.take() if self.leases is not None else []
            reply = yield from call(GetReplicas(part, taken, False), GetReplicasReply)
            out += [size if size >= 0 else None for size in reply.sizes]
        return out

    def match_prefix(self, keys: Sequence[Any]) -> Op[int]:
        """How many leading keys are stored: the longest stored prefix of a key list."""
        matched = 0
        for part in _batches(_checked(keys)):
            got = (yield from call(MatchPrefix(part), MatchPrefixReply)).matched
            matched += got
            if got < len(part):
                break
        return matched

    def match_prefix_nodes(self, keys: Sequence[Any]) -> Op[PrefixMatch]:
        """The longest stored prefix of a key list (as :meth:`match_prefix`), and per node how many
        leading keys it holds readable, in any tier (``total``) and in DRAM (``dram``)."""
        longest, nodes = 0, {}
        for part in _batches(_checked(keys)):
            match = (yield from call(MatchPrefixNodes(part), MatchPrefixNodesReply)).prefix_match(len(part))
            if not longest:
                nodes = dict(match.nodes)
            else:  # a node's leading run goes on only where it held every key before this batch
                for node_id, had in list(nodes.items()):
                    more = match.nodes.get(node_id)
                    if had.total == longest and more is not None:
                        dram = had.dram + more.dram if had.dram == longest else had.dram
                        nodes[node_id] = NodePrefix(dram, had.total + more.total)
            longest += match.longest
            if match.longest < len(part):
                break
        return PrefixMatch(longest, nodes)

    def replicate(self, keys: Sequence[Any], node_id: str, *, max_bytes: int) -> Op[Replicated]:
        """Copy stored blocks into the DRAM of ``node_id``, keeping their other replicas (hot blocks near
        their readers). Keys are taken in order while they fit the node's free DRAM (nothing is
        evicted for them) and ``max_bytes`` in all; keys not stored or already there are skipped.
        Raises NotFound for a node the master does not know."""
        if type(max_bytes) is not int or max_bytes < 0:
            raise InvalidArgument(f"max_bytes must be a non-negative int, got {max_bytes!r}")
        if not isinstance(node_id, str):
            raise InvalidArgument(f"node_id must be a str, got {type(node_id).__name__}")
        copied = moved = 0
        for part in _batches(_checked(keys)):
            reply = yield from call(Replicate(part, node_id, max_bytes - moved), ReplicateReply)
            copied, moved = copied + reply.copied, moved + reply.bytes
        return Replicated(copied, moved)

    def remove_report(self, keys: Sequence[Any], *, force: bool) -> Op[tuple[int, list[int]]]:
        """Remove blocks: how many were stored and removed, and the indexes of the keys left because
        a recent read holds them (only without ``force``)."""
        removed, held = 0, []
        checked: list[str] = [validate_key(k) for k in keys]
        for start in range(0, len(checked), MAX_BATCH_KEYS):
            part = checked[start : start + MAX_BATCH_KEYS]
            reply = yield from call(Remove(part, force), RemoveReply)
            self.hints.forget(part)
            removed += reply.removed
            held += [start + i for i in reply.held]
        return removed, held

    def clear_replicas(self, keys: Sequence[Any], node: str, *, force: bool) -> Op[tuple[list[int], list[int]]]:
        """Drop the replicas of ``keys`` on ``node`` (all when ""): the indexes of the keys cleared, and
        of those left because a recent read holds them (only without ``force``)."""
        cleared, held = [], []
        checked: list[str] = [validate_key(k) for k in keys]
        for start in range(0, len(checked), MAX_BATCH_KEYS):
            part = checked[start : start + MAX_BATCH_KEYS]
            reply = yield from call(ClearReplicas(part, node, force), ClearReplicasReply)
            self.hints.forget(part)
            cleared += [start + i for i in reply.cleared]
            held += [start + i for i in reply.held]
        return cleared, held

    def list_keys(self, prefix: str, *, after: str, limit: int) -> Op[tuple[list[str], str]]:
        """One page of stored keys starting with ``prefix``, in order after ``after``, and the cursor of
        the next page ("" after the last). A tenant lists its own keys."""
        if not isinstance(prefix, str) or not isinstance(after, str):
            raise InvalidArgument(f"prefix and after must be str, got {type(prefix).__name__}, {type(after).__name__}")
        if type(limit) is not int or limit < 1:
            raise InvalidArgument(f"limit must be a positive int, got {limit!r}")
        reply = yield from call(ListKeys(prefix, after, limit), KeysReply)
        return reply.keys, reply.next

    def stats(self) -> Op[dict[str, int | float]]:
        return (yield from call(Stats(), StatsReply)).stats

    def close(self) -> Op[None]:
        """Give back every grant; the face then closes its connections."""
        self.closed = True  # first: no put takes a new grant meanwhile
        yield from self._give_back(self.grants.close())


def _batches(items: list[T]) -> Iterator[list[T]]:
    """``items`` in runs of at most :data:`MAX_BATCH_KEYS` (one, perhaps empty, when it fits: a
    request goes out as before)."""
    if len(items) <= MAX_BATCH_KEYS:
        yield items
        return
    for start in range(0, len(items), MAX_BATCH_KEYS):
        yield items[start : start + MAX_BATCH_KEYS]


def _checked(keys: Sequence[Any]) -> list[str]:
    """The keys, each checked (InvalidArgument names the first bad one)."""
    return [validate_key(k) for k in keys]
