"""Whether this master may answer: leadership (with etcd), terms, and readiness after a takeover.

A master without etcd leads from its start, in term 0. With etcd it serves only while its
:class:`~server.master.election.Election` says it leads; each time it is elected it starts a new
term with an empty placement table, rebuilt from the daemons' inventories as they register, and it
answers reads and puts only once it is *ready*: it read the records of the nodes an earlier leader
kept in etcd (those not back are absent: see :mod:`kvstore.placement.nodes`), and every node that
was a member then or that the daemons name is back, or the wait for them ran out (those still
missing are absent from then on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvstore.config import MasterConfig
from kvstore.errors import KVStoreError, NotLeader, NotReady
from kvstore.protocol import AccessReport, AdminInfo, CommitGranted, Heartbeat, ListNodes, Message, RegisterNode, Stats
from server.master.election import Election
from transfer.discovery import EtcdCluster, MasterRecord, parse_endpoints

log = logging.getLogger("kvstore.master")

# What a master answers while it is not ready (taking over: the daemons' inventories still coming in).
_WHILE_NOT_READY: frozenset[type[Message]] = frozenset(
    {RegisterNode, Heartbeat, AccessReport, CommitGranted, Stats, ListNodes, AdminInfo}
)


_READY_POLL_S = 0.05
"""How often a request waiting for readiness looks whether a wait (``ready_wait_ms``, the settle) ran out."""


class Leadership:
    """Terms and readiness of one master; ``on_leader(epoch)`` and ``on_standby()`` are called as
    terms start and end (the service resets its table and its daemon commands there)."""

    def __init__(self, config: MasterConfig, nodes_up: Callable[[], set[str]]) -> None:
        """``nodes_up``: the ids of the nodes registered in this term's table."""
        self.config = config
        self._nodes = nodes_up
        self.address = ""
        self.election: Election | None = None
        self.epoch = 0
        self.failovers = 0
        """Times this master took over as leader (HA), or 1 for a master without etcd."""
        self._since = 0.0
        self._ready = False
        self._expected: set[str] = set()
        """Nodes the daemons said were in the cluster: a new leader waits for their inventories."""
        self._absent_known = True
        """Whether this term read the records earlier terms kept (without etcd: there are none)."""
        self._not_members: set[str] = set()
        """Nodes the records say were not members (fenced, absent): not waited for, whoever names them."""
        self._from_records = False
        """Whether there were records of earlier terms' nodes (then every node that registered with an
        earlier leader is in them: see MasterCore.register)."""
        self._readied = asyncio.Event()
        """Set when the term becomes ready or ends (requests waiting in :meth:`until_ready` look again)."""
        self.on_ready: Callable[[list[str]], None] = lambda missing: None
        """Called once a term is ready, with the expected nodes still missing (absent from then on)."""

    def begin_term(self, epoch: int) -> None:
        """Lead with an empty table; until the nodes it expects are back requests get NotReady."""
        self.epoch = epoch
        self._since = time.monotonic()
        self._ready = False
        self._expected = set()
        self._not_members = set()
        self._absent_known = self.election is None
        self._from_records = False
        self._readied = asyncio.Event()
        self.failovers += 1

    def end_term(self) -> None:
        self._ready = False
        self._readied.set()  # the requests waiting for readiness are answered NotLeader

    def expect(self, peers: list[str]) -> None:
        """Nodes a registering daemon named: a master taking over waits for them too."""
        if not self._ready:
            self._expected.update(p for p in peers if p)

    def wants_absent(self) -> bool:
        """Whether this term still has to load the nodes earlier terms left absent (MasterCore.load_absent)."""
        return not self._absent_known and self.election is not None and self.election.leading()

    def know_absent(self, members: Iterable[str], absent: Iterable[str], recorded: bool = False) -> None:
        """The records are read: ``members`` (not registered yet) are waited for; the other ``absent``
        nodes are not, even if a daemon names them. ``recorded``: there were records (every node an
        earlier leader had registered is in them: see MasterCore.register)."""
        members = set(members)
        self._expected |= members
        self._not_members = set(absent) - members
        self._absent_known = True
        self._from_records = recorded
        self.ready()

    def waiting_for(self, registered: Iterable[str]) -> set[str]:
        """While not ready: the nodes registered and those still waited for (the daemons are told of
        them, so that a next term waits for them too); once ready, none."""
        return set() if self._ready else set(registered) | self._awaited()

    def _awaited(self) -> set[str]:
        """The nodes this term waits for: those expected, less those the records call absent."""
        return self._expected - self._not_members

    def ready(self) -> bool:
        """Whether reads and puts can be answered truly: the nodes earlier terms left absent are
        known, and every expected node is back, or some node is and the wait for the rest ran out,
        or none came within three waits (a cluster starting)."""
        if self._ready:
            return True
        if not self._absent_known:
            return False
        nodes = self._nodes()
        waited = time.monotonic() - self._since
        # A moment for the first daemons' peer lists to come in before "every expected node" holds;
        # none when the records named the nodes (each registration was in them before it was answered).
        settle = 0.0 if self._from_records else min(2 * self.config.heartbeat_interval_ms / 1000, 0.2)
        wait = self.config.ready_wait_ms / 1000
        expected = self._awaited()
        if (
            (nodes and expected <= nodes and waited >= settle)
            or (nodes and waited >= wait)
            or waited >= 3 * wait  # no daemon at all: a cluster still starting (or none left)
        ):
            self._ready = True
            missing = sorted(expected - nodes)
            log.info(
                "ready after %.2f s with %d nodes%s", waited, len(nodes),
                f"; still missing {', '.join(missing)} (absent: removes are noted for them)" if missing else "",
            )  # fmt: skip
            self.on_ready(missing)
            self._readied.set()
        return self._ready

    async def until_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for this term to be ready (a request that came while the master
        takes over waits for it, rather than being refused and sent again after a backoff); False
        when it is not (or the term ended meanwhile)."""
        deadline = time.monotonic() + timeout
        readied = self._readied
        while not self.ready():
            left = deadline - time.monotonic()
            if left <= 0 or readied.is_set():
                return False
            with contextlib.suppress(TimeoutError):
                # Woken by a registration that made it ready; looked at again for the waits that run out.
                await asyncio.wait_for(readied.wait(), min(left, _READY_POLL_S))
        return True

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
                f"{len(self._awaited() - self._nodes()) or 'its'} nodes"
            )
        return None

    def role(self) -> dict[str, Any]:
        """Leadership as the admin API and /metrics show it."""
        base = {"ready": self.refusal() is None, "failovers": self.failovers}
        if self.election is None:
            return {
                **base, "role": "leader", "ha": False, "epoch": 0, "leader": self.address, "elections_won": 0,
                "leadership_lost": 0, "etcd_errors": 0, "etcd": [], "etcd_reachable": False, "cluster_id": "",
                "leader_epoch": 0, "lease_confirmed_s_ago": None,
            }  # fmt: skip
        return {**base, "ha": True, **self.election.status()}

    def campaign(
        self, admin_address: str | None, on_leader: Callable[[int], None], on_standby: Callable[[], None]
    ) -> None:
        """Campaign in etcd (``config.etcd``); until elected this master answers NotLeader."""
        assert self.config.etcd is not None and self.config.cluster_id is not None
        cluster = EtcdCluster(parse_endpoints(self.config.etcd), self.config.cluster_id)
        self.election = Election(
            cluster, MasterRecord(self.address, admin_address), self.config.etcd_lease_ttl_s,
            on_leader=on_leader, on_standby=on_standby, revoke_gone=self.config.fence_refused,
        )  # fmt: skip
        self.election.start()

    async def stop(self) -> None:
        if self.election is not None:
            await self.election.stop()  # resigns: a standby takes over without waiting for the lease
