"""Read leases under interleaved readers, against a simple model.

The model is a list of leases, each live until it is released or its expiry
passes. A replica is protected exactly while some live lease covers it.

:class:`LeasesMachine` drives :class:`Leases` alone, with releases of any lease,
live or ended, and of ids never granted. :class:`ReadersMachine` drives the
placement table as the master does: readers get keys (one lease per get and
key, named by the reply's ``first_lease``) and release those ids (the wire's
``ReleaseLeases``), at any time, also long after their lease expired and twice
(a retry), while time passes; an operator's eviction must take exactly the
blocks no live lease covers. Besides the model, each reader that has not
released and whose lease has not expired must find every replica it was handed
still protected: no release, early or late, ends another reader's lease.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.placement.leases import Holder, LeaseId, Leases
from kvstore.placement.table import PlacementTable
from kvstore.policy import ActionKind, EvictionPolicy, TierName
from kvstore.protocol import GetReplicasReply

KEYS = ("k0", "k1", "k2", "k3")
HOLDERS: tuple[Holder, ...] = (("a", TierName.DRAM), ("a", TierName.SSD), ("b", TierName.DRAM))
LEASE_MS = 1000


@dataclass
class ModelLease:
    key: str
    holders: frozenset[Holder]
    expiry: int
    ended: bool = False


class Model:
    def __init__(self) -> None:
        self.leases: list[ModelLease] = []

    def grant(self, key: str, holders: frozenset[Holder], expiry: int) -> ModelLease:
        lease = ModelLease(key, holders, expiry)
        self.leases.append(lease)
        return lease

    def expire(self, now: int) -> int:
        ended = [lease for lease in self.leases if not lease.ended and lease.expiry <= now]
        for lease in ended:
            lease.ended = True
        return len(ended)

    def protected(self, holder: Holder, key: str) -> bool:
        return any(not lease.ended and lease.key == key and holder in lease.holders for lease in self.leases)


class LeasesMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.leases = Leases()
        self.model = Model()
        self.now = 0
        self.granted: list[tuple[LeaseId, ModelLease]] = []

    @rule(key=st.sampled_from(KEYS), holders=st.sets(st.sampled_from(HOLDERS), min_size=1), ms=st.integers(1, 2000))
    def grant(self, key: str, holders: set[Holder], ms: int) -> None:
        lease_id = self.leases.grant(key, sorted(holders, key=str), self.now + ms)
        self.granted.append((lease_id, self.model.grant(key, frozenset(holders), self.now + ms)))

    @precondition(lambda self: bool(self.granted))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease_id, lease = data.draw(st.sampled_from(self.granted))
        assert self.leases.release(lease_id) is not lease.ended
        lease.ended = True

    @rule(ahead=st.integers(0, 3))
    def release_unknown(self, ahead: int) -> None:
        assert not self.leases.release(LeaseId(self.leases.next_id + ahead))  # never granted: ends nothing

    @rule(ms=st.integers(0, 1500))
    def advance(self, ms: int) -> None:
        self.now += ms
        assert self.leases.expire(self.now) == self.model.expire(self.now)

    @invariant()
    def protected_exactly_while_a_live_lease_covers_it(self) -> None:
        self.leases.check()
        for holder in HOLDERS:
            expected = {k for k in KEYS if self.model.protected(holder, k)}
            assert {k for k in KEYS if self.leases.is_leased(*holder, k)} == expected
            assert set(self.leases.leased_keys(*holder)) == expected
            assert self.leases.num_leased(*holder) == len(expected)
        assert len(self.leases) == sum(not lease.ended for lease in self.model.leases)


@dataclass
class Reader:
    lease: ModelLease
    lease_id: int
    released: bool = False


class ReadersMachine(RuleBasedStateMachine):
    """Two nodes of DRAM, blocks of one or two replicas; the table's leases last LEASE_MS."""

    def __init__(self) -> None:
        super().__init__()
        self.t = PlacementTable(EvictionPolicy(1.0, 1.0), lease_ms=LEASE_MS)
        for node in ("a", "b"):
            self.t.membership.register_node(node, f"{node}:1", 8 * 1024, 0, 64, [], 0)
        self.model = Model()
        self.now = 0
        self.readers: list[Reader] = []
        for key in KEYS:
            self.store(key)

    def store(self, key: str) -> None:
        plan = self.t.writes.put_start([key], [1024], 2, None, False, self.now)
        assert plan.commands == [] and plan.tickets[0] is not None and plan.tickets[0].status == "ok"
        assert self.t.writes.put_end([key], [1]) == [True]

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3))
    def get(self, keys: list[str]) -> None:
        reply = GetReplicasReply.from_lookup(self.t.reads.get_replicas(keys, self.now))
        for i, loc in enumerate(reply.located(keys)):
            assert loc is not None
            holders = frozenset((r.node_id, TierName(r.tier)) for r in loc.replicas)
            lease = self.model.grant(loc.key, holders, self.now + LEASE_MS)
            self.readers.append(Reader(lease, reply.first_lease + i))

    @precondition(lambda self: bool(self.readers))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        # Any reader, before or after its lease expired, however late, once or again (a retry).
        reader = data.draw(st.sampled_from(self.readers))
        reader.released = True
        reader.lease.ended = True
        self.t.reads.release_leases([reader.lease_id])

    @rule(ms=st.integers(0, 1200))
    def advance(self, ms: int) -> None:
        self.now += ms
        for node in ("a", "b"):
            self.t.membership.heartbeat(node, self.now)
        assert self.t.expire(self.now) == []
        self.model.expire(self.now)

    @rule(node=st.sampled_from(("a", "b")))
    def evict(self, node: str) -> None:
        """An operator empties the node's DRAM: exactly the blocks no live lease covers there go."""
        lru = self.t.nodes[node].dram_lru
        expected = {k for k in lru if not self.model.protected((node, TierName.DRAM), k)}
        count, commands = self.t.moves.evict_tier(node, TierName.DRAM)
        dropped = {k for c in commands for k in c.keys}
        assert all(c.kind is ActionKind.DROP for c in commands)
        assert count == len(dropped) and dropped == expected
        for c in commands:
            self.t.apply(c, [True] * len(c.keys))
        for key in sorted(dropped):
            if self.t.reads.exists([key]) == [False]:
                self.store(key)

    def leased(self) -> dict[tuple[Holder, str], bool]:
        """Per readable replica, whether the table says it is leased."""
        out = {}
        for key in KEYS:
            described = self.t.inspection.describe(key)
            assert described is not None
            for r in described["replicas"]:  # type: ignore[attr-defined]
                out[(r["node_id"], TierName(r["tier"])), key] = bool(r["leased"])
        return out

    @invariant()
    def protected_exactly_while_a_live_lease_covers_it(self) -> None:
        self.t.check()
        for (holder, key), leased in self.leased().items():
            assert leased is self.model.protected(holder, key), (key, holder)

    @invariant()
    def no_release_ends_another_readers_lease(self) -> None:
        leased = self.leased()
        for reader in self.readers:
            if not reader.released and reader.lease.expiry > self.now:
                for holder in reader.lease.holders:
                    assert leased.get((holder, reader.lease.key), True), reader


TestLeases = LeasesMachine.TestCase
TestReaders = ReadersMachine.TestCase
