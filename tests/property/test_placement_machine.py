"""The placement table under random operations, with daemons answering its commands in any order.

After every step the table's invariants hold: extents match allocators, LRUs
hold exactly the readable replicas, SSD bytes add up. A node may also restart
and re-register with what it holds; its commands in flight are then lost.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.metadata import NodeCommand, PlacementTable
from kvstore.policy import ActionKind, EvictionPolicy, TierName
from kvstore.protocol import InventoryItem

KEYS = st.sampled_from([f"k{i}" for i in range(12)])
SIZES = st.sampled_from([512, 1024, 1500, 2048])
NODES = ("a", "b")


class PlacementMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = PlacementTable(EvictionPolicy(0.9, 0.6, promote_after_hits=2), reservation_ms=1000, lease_ms=500)
        for n in NODES:
            self.t.register_node(n, f"{n}:1", 8192, 4096, 64, [], 0)
        self.now = 0
        self.commands: list[NodeCommand] = []
        self.pending: set[str] = set()

    @rule(keys=st.lists(KEYS, min_size=1, max_size=3, unique=True), size=SIZES, replicas=st.integers(1, 2))
    def put_start(self, keys: list[str], size: int, replicas: int) -> None:
        plan = self.t.put_start(keys, [size] * len(keys), replicas, None, False, self.now)
        self.commands += plan.commands
        for key, ticket in zip(keys, plan.tickets, strict=True):
            if ticket is not None and ticket.status == "ok":
                self.pending.add(key)

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def put_end(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pending)))
        self.pending.discard(key)
        if self.t.put_end([key], [1])[0]:
            assert self.t.exists([key]) == [True]

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def revoke(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pending)))
        self.pending.discard(key)
        self.commands += self.t.put_revoke([key])

    @rule(keys=st.lists(KEYS, min_size=1, max_size=3), release=st.booleans())
    def get(self, keys: list[str], release: bool) -> None:
        self.t.get_replicas(keys, self.now)
        if release:
            self.commands += self.t.release_leases(keys)

    @rule(keys=st.lists(KEYS, min_size=1, max_size=2))
    def remove(self, keys: list[str]) -> None:
        _, commands = self.t.remove(keys)
        self.commands += commands
        assert self.t.exists(keys) == [False] * len(keys)

    @rule(ms=st.integers(1, 1500))
    def advance(self, ms: int) -> None:
        self.now += ms
        for n in NODES:
            self.t.heartbeat(n, self.now)
        self.commands += self.t.expire(self.now)

    @precondition(lambda self: bool(self.commands))
    @rule(data=st.data())
    def daemon_answers(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.commands) - 1))
        command = self.commands.pop(i)
        done = [data.draw(st.booleans()) if command.kind is not ActionKind.DROP else True for _ in command.keys]
        self.t.apply(command, done)

    @rule(node=st.sampled_from(NODES))
    def reregister(self, node: str) -> None:
        held = [
            InventoryItem(e.key, r.tier.value, r.extent.offset if r.tier is TierName.DRAM and r.extent else -1,
                          e.size, e.checksum)
            for store in (self.t.objects, self.t._pending)
            for e in store.values()
            for r in e.replicas
            if r.node_id == node
        ]  # fmt: skip
        self.commands = [c for c in self.commands if c.node_id != node]
        self.commands += self.t.register_node(node, f"{node}:2", 8192, 4096, 64, held, self.now)

    @invariant()
    def invariants_hold(self) -> None:
        self.t.check()
        for node in self.t.nodes.values():
            if not any(c.node_id == node.node_id for c in self.commands):
                assert (node.inflight, node.dram_freeing, node.ssd_delta) == (0, 0, 0), node
        assert self.t.match_prefix([f"k{i}" for i in range(12)]) <= 12


TestPlacementTable = PlacementMachine.TestCase
