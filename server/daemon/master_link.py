"""The daemon's link to the master: registration, heartbeats, access reports, one-trip commits.

A thread registers this node with the master (with its full inventory),
heartbeats (carrying transfer counters and the SSD tier's health), and
registers again whenever the master no longer knows the node (a master
restarted, or a new leader after a failover, found through etcd). Another
thread reports the blocks this daemon served by key on its own, each with the
tier it was read from, so that the master counts the hits and keeps its LRU
order. One-trip commits (blocks written into a grant) go over a pool of their
own, so that a slow report never holds one up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from kvstore.auth import Credential
from kvstore.config import MIN_HEARTBEAT_MS
from kvstore.errors import KVStoreError, ProtocolError
from kvstore.keys import BlockKey, validate_key
from kvstore.protocol import (
    AccessReport,
    CheckBlocksReply,
    CommitGranted,
    Heartbeat,
    HeartbeatReply,
    LeaveNode,
    OkReply,
    PutReply,
    RegisterNode,
    RegisterReply,
)
from kvstore.ratelog import RateLimitedLog
from server.daemon.orphans import Orphans
from server.daemon.storage import DaemonStorage
from server.supervisor import Supervisor
from transfer import topology
from transfer.discovery import MasterLocator
from transfer.rpc import LEADER_CHECK_S, Connection, ConnectionPool

log = logging.getLogger("kvstore.daemon")


_FIRST_RETRY_S = 0.01
"""The first retry after a failed registration or heartbeat, doubling to LEADER_CHECK_S: a new leader
the watch pushes may answer NotLeader for the moment between winning etcd's election and leading."""


class MasterLink:
    """Registers this node with the master, heartbeats, and re-registers whenever the master forgot it."""

    def __init__(
        self,
        master: str,
        node_id: str,
        address: str,
        storage: DaemonStorage,
        *,
        timeout: float = 5.0,
        rails: Sequence[str] = (),
        ucx_address: str = "",
        transfer_stats: Callable[[], dict[str, int]] | None = None,
        refusals: Callable[[], dict[str, int]] | None = None,
        orphans: Orphans | None = None,
        on_registered: Callable[[], None] | None = None,
        before_register: Callable[[], None] | None = None,
        registering: Callable[[], AbstractContextManager[None]] | None = None,
        report_period_s: float = 0.01,
        on_epoch: Callable[[int], None] | None = None,
        credential: Credential | None = None,
        tls: ssl.SSLContext | None = None,
        supervisor: Supervisor | None = None,
    ) -> None:
        """``credential`` and ``tls``: what connections to the master authenticate with and run over;
        ``supervisor``: what restarts (and counts) its loops when they fail (the daemon's own)."""
        self._transfer_stats = transfer_stats
        self._refusals = refusals
        self._orphans = orphans
        self._before_register = before_register
        self._registering = registering or contextlib.nullcontext
        self._on_epoch = on_epoch
        self._timeout = timeout
        # etcd://: the leader, followed across failovers; its watch wakes the link to register with a new one at once.
        locator = self._locator = MasterLocator(master, timeout, watch=True)
        self._wake = threading.Event()
        """Set to cut a pause short: a new leader pushed by the locator's watch, or stop."""
        self._registered_with: str | None = None
        locator.on_change(self._wake.set)
        self._calls = ConnectionPool(locator, timeout, size=4, credential=credential, tls=tls)  # one-trip commits
        # Access reports, apart: they never hold up a commit.
        self._reports = Connection(locator, timeout, credential, tls)
        self.peers: list[str] = []
        """The nodes the master last said were in the cluster (told to the next master we register with)."""
        # Reads served by key, with the tier each came from; a master too slow to take them loses the oldest.
        self._accessed: deque[tuple[BlockKey, str]] = deque(maxlen=1 << 20)
        self._report_period = report_period_s
        self.master = master
        self.rails = list(rails)
        self.ucx_address = ucx_address
        self.node_id = node_id
        self.address = address
        self.storage = storage
        self._conn = Connection(locator, timeout, credential, tls)
        self._stop = threading.Event()
        self._failures = RateLimitedLog(log)
        """A master down (or failing over) logs once, then once a minute with a count."""
        self._interval = 1.0
        self.last_answer: float | None = None
        """When (time.monotonic()) the master last answered a registration or a heartbeat."""
        self._lease_s = 0.0
        self._serve_until = 0.0
        """Until when (time.monotonic()) this node may serve blocks by key (:meth:`serving`)."""
        self._key_lease_s: float | None = None
        """The lease to serve reads by key alone (None: :attr:`_serve_until`'s; see :meth:`serving_by_key`)."""
        self._key_until = 0.0
        self._renewed = threading.Condition()
        """Notified whenever the lease is renewed (readers waiting in :meth:`serving`)."""
        self._lapses = RateLimitedLog(log)
        self.registrations = 0
        """Registrations a master answered: the first, then one after each failed heartbeat or
        registration (a master restarted, failed over or was cut off) or a master that forgot the node."""
        self.failures = 0
        """Registrations and heartbeats that got no answer."""
        self._on_registered = on_registered
        self.registered = threading.Event()
        self.supervisor = supervisor if supervisor is not None else Supervisor()
        self._thread = self.supervisor.thread("daemon-master-link", self._run, self._stop)
        self._reporter = self.supervisor.thread("daemon-access-reports", self._report_loop, self._stop)
        # Orphan checks, apart: they take the storage lock, which a heartbeat must never wait for.
        self._checks = Connection(locator, timeout, credential, tls)
        self._checker = self.supervisor.thread("daemon-orphan-checks", self._check_loop, self._stop)

    def start(self) -> None:
        self._thread.start()
        self._reporter.start()
        if self._orphans is not None:
            self._checker.start()

    def serving(self, wait_s: float = 0.0) -> bool:
        """Whether this node may serve blocks by key now: registered, with the blocks its registration
        did not get adopted dropped, and within its lease: a fraction of the master's node TTL from
        the sending of its last heartbeat (or registration) the master answered as known. The master
        fences a node silent for the whole TTL, counting the drops it sent there as done (a removed
        key placeable again at once), so by then this node must serve none of them: it stops
        first, and serves again only once registered anew (its registration drops them).

        A lease lapses in calm too, when the master stalls for most of the TTL: ``wait_s`` waits that
        long for a renewal (a heartbeat on its way), so that such a stall costs a reader time, not
        a wrong answer."""
        if time.monotonic() < self._serve_until:
            return True
        deadline = time.monotonic() + wait_s
        with self._renewed:
            while (now := time.monotonic()) >= self._serve_until:
                if now >= deadline:
                    if self.registered.is_set():
                        self._lapses.warning(
                            "lapsed", "node %s serves no block: its lease with the master lapsed %.2f s ago",
                            self.node_id, now - self._serve_until,
                        )  # fmt: skip
                    return False
                self._renewed.wait(deadline - now)
        return True

    def serving_by_key(self) -> bool:
        """Whether this node may serve reads by key alone now (a reader that did not ask the master:
        its remembered location): within the lease the master's heartbeat answers renew
        (``HeartbeatReply.key_lease``), shorter than :meth:`serving`'s, so that a remove waits that
        long, not the node TTL, for a frozen or cut-off node's drop: the master renews none while
        this node owes it drops past the lease."""
        if self._key_lease_s is None:
            return self.serving()
        return time.monotonic() < self._key_until and self.serving()

    @property
    def renewal_s(self) -> float:
        """How long a read waits for a lapsed lease to be renewed: two heartbeats, at most half a
        second (a registration on its way too: the master lists the node before its answer lands)."""
        return min(2 * self._interval, 0.5)

    def _renew(self, sent: float, by_key: bool = True) -> None:
        with self._renewed:
            self._serve_until = max(self._serve_until, sent + self._lease_s)
            if by_key and self._key_lease_s is not None:
                self._key_until = max(self._key_until, sent + self._key_lease_s)
            self._renewed.notify_all()

    def _check_loop(self) -> None:
        orphans = self._orphans
        assert orphans is not None
        while not self._stop.wait(self._interval):
            if self.registered.is_set():
                orphans.check(lambda m: self._checks.call(m, CheckBlocksReply))

    def commit_granted(
        self, grant_id: int, keys: list[BlockKey], offsets: list[int], sizes: list[int], checksums: list[int],
        pinned: bool, write_ids: list[int], cached: bool = False,
    ) -> list[tuple[int, str]]:  # fmt: skip
        """Have the master commit blocks written into a grant, each by its put's write id; per block
        (code, text) as in PutReply. ``cached``: puts this daemon answered already (see CommitGranted)."""
        ids = write_ids if any(write_ids) else []
        message = CommitGranted(self.node_id, grant_id, list(keys), offsets, sizes, checksums, pinned, cached, ids)
        # The same request id on every attempt: a commit the master made but whose answer was
        # lost is answered again, never made twice nor left unknown for a passing glitch.
        reply = self._calls.call(message, PutReply, retry_for=self._timeout)
        if not len(reply.codes) == len(reply.errors) == len(keys):
            raise ProtocolError(f"the master answered {len(reply.codes)} commits for {len(keys)} blocks")
        return list(zip(reply.codes, reply.errors, strict=True))

    def note_access(self, served: list[tuple[BlockKey, str]]) -> None:
        """Blocks served by key to readers that did not ask the master, each with the tier it was
        read from: reported within a period."""
        self._accessed.extend(served)

    def _report_loop(self) -> None:
        while not self._stop.wait(self._report_period):
            self.flush_reports()

    def flush_reports(self) -> None:
        accessed = self._accessed
        served = [accessed.popleft() for _ in range(min(len(accessed), 65536))]
        if not served:
            return
        keys, tiers = (list(column) for column in zip(*served, strict=True))
        try:
            self._reports.call(AccessReport(self.node_id, keys, tiers), OkReply)
        except KVStoreError as exc:
            log.debug("access report of %d keys lost: %s", len(keys), exc)  # LRU order only; never data

    def _register(self) -> None:
        if self._before_register is not None:
            self._before_register()
        arena = self.storage.arena
        ssd_capacity = self.storage.ssd.capacity if self.storage.ssd is not None else 0
        with self._registering():  # the inventory holds until the master has read it
            message = RegisterNode(
                self.node_id, self.address, arena.capacity, ssd_capacity, arena.alignment, self.storage.inventory(),
                list(self.rails or [self.address]), topology.host_id(), str(arena.path), os.stat(arena.path).st_ino,
                topology.local_nics(), topology.has_rdma(), self.ucx_address, arena.max_slots, self.peers,
            )  # fmt: skip
            sent = time.monotonic()
            reply = self._conn.call(message, RegisterReply)
            if len(reply.drops) != len(reply.drop_tiers) or not set(reply.drop_tiers) <= {"", "dram", "ssd"}:
                raise ProtocolError(
                    f"a registration's answer names {len(reply.drops)} drops, tiers {reply.drop_tiers!r:.80}"
                )
            self.storage.drop_unadopted([validate_key(k) for k in reply.drops], reply.drop_tiers)
        # A margin of a tenth (and 20 ms) for the two clocks' rates and the master's tick.
        self._lease_s = max(reply.node_ttl_ms * 0.9 - 20, 0) / 1000
        self._key_lease_s = max(reply.key_lease_ms * 0.9 - 20, 0) / 1000 if reply.key_lease_ms else None
        self._renew(sent)
        self.peers = reply.peers
        if self._on_epoch is not None:
            self._on_epoch(reply.epoch)
        self._interval = max(reply.heartbeat_interval_ms, MIN_HEARTBEAT_MS) / 1000
        self.registrations += 1
        self._registered_with = self._conn.address
        if not self.registered.is_set():
            self.registered.set()
            if self._on_registered is not None:
                self._on_registered()
        log.info("registered %s at %s with master %s", self.node_id, self.address, self._conn.address)

    def _run(self) -> None:
        backoff = _FIRST_RETRY_S
        known = False
        seen: str | None = None
        while not self._stop.is_set():
            try:
                leader = self._locator.current()
                if leader != seen:  # a new leader: its refusals (before it calls itself leader) are brief
                    seen, backoff = leader, _FIRST_RETRY_S
                if known and leader is not None and leader != self._registered_with:
                    known = False  # etcd elected another master: register with it now, not after a failed heartbeat
                if not known:
                    self._register()
                    known = True
                else:
                    stats = self._transfer_stats() if self._transfer_stats is not None else {}
                    capacity, configured, fault = self.storage.ssd_health()
                    refused = self._refusals() if self._refusals is not None else {}
                    beat = Heartbeat(self.node_id, stats, capacity, configured, fault, refused)
                    sent = time.monotonic()
                    reply = self._conn.call(beat, HeartbeatReply)
                    known = reply.known
                    if known:
                        self._renew(sent, reply.key_lease)
                        self.peers = reply.peers
                self.last_answer = time.monotonic()

                backoff = _FIRST_RETRY_S
                self._pause(self._interval if known else 0)
            except KVStoreError as exc:
                known = False
                self.failures += 1
                self._failures.warning(
                    "unreachable", "master %s unreachable (%s); retrying within 0.2 s", self._conn.address, exc
                )
                self._pause(backoff)  # at once for a leader the watch pushed meanwhile
                backoff = min(backoff * 2, LEADER_CHECK_S)  # a new leader is met within this

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds``, less when stopped or when a new leader is pushed."""
        self._wake.wait(seconds)
        self._wake.clear()

    def leave(self) -> bool:
        """Tell the master this node leaves for good (it forgets the node's blocks); False when it
        could not be told (it then marks the node down when its heartbeats stop). Heartbeats end
        first: one after this would register the node again."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        try:
            with self._calls.connection() as conn:
                conn.call(LeaveNode(self.node_id), OkReply, retry_for=self._timeout)
        except KVStoreError as exc:
            log.warning("could not tell the master that node %s leaves: %s", self.node_id, exc)
            return False
        return True

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        # A master that does not answer must not hold the stop up.
        for conn in (self._conn, self._reports, self._checks):
            conn.abort()
        for thread in (self._thread, self._reporter, self._checker):
            if thread.is_alive():  # a link never started stops too
                thread.join(timeout=5)
        self._conn.close()
        self._calls.close()
        self._reports.close()
        self._checks.close()
        self._locator.close()
