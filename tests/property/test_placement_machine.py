"""The placement table under random operations, with daemons answering its commands in any order.

After every step the table's invariants hold: extents match allocators, LRUs
hold exactly the readable replicas, SSD bytes add up, and the per-node prefix
match agrees with a plain count over the replicas. A node may also restart
and re-register with what it holds; its commands in flight are then lost.
Blocks are also copied to nodes (replicate), the copies answered in any
order, before or after the blocks are removed or their target restarts. An
operator evicts a node's tier, a drain moves a node's blocks away, and a node
goes quiet (down) and comes back.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore.placement.state import Move, NodeCommand, ReplicaStatus
from kvstore.placement.table import PlacementTable
from kvstore.policy import ActionKind, EvictionPolicy, TierName
from kvstore.results import HeldBlock, NodePrefix, PrefixMatch

KEYS = st.sampled_from([f"k{i}" for i in range(12)])
SIZES = st.sampled_from([512, 1024, 1500, 2048])
NODES = ("a", "b")


class PlacementMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = PlacementTable(EvictionPolicy(0.9, 0.6, promote_after_hits=2), reservation_ms=1000, lease_ms=500)
        for n in NODES:
            self.t.membership.register_node(n, f"{n}:1", 8192, 4096, 64, [], 0)
        self.now = 0
        self.commands: list[NodeCommand] = []
        self.pending: set[str] = set()
        self.copies: list[list[Move]] = []
        self.drains: list[tuple[str, list[Move], dict[str, int]]] = []
        """Drain rounds planned whose copies are not answered yet: (source, moves, registrations)."""

    @rule(keys=st.lists(KEYS, min_size=1, max_size=3, unique=True), size=SIZES, replicas=st.integers(1, 2))
    def put_start(self, keys: list[str], size: int, replicas: int) -> None:
        plan = self.t.writes.put_start(keys, [size] * len(keys), replicas, None, False, self.now)
        self.commands += plan.commands
        for key, ticket in zip(keys, plan.tickets, strict=True):
            if ticket is not None and ticket.status == "ok":
                self.pending.add(key)

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def put_end(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pending)))
        self.pending.discard(key)
        if self.t.writes.put_end([key], [1])[0]:
            assert self.t.reads.exists([key]) == [True]

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def revoke(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pending)))
        self.pending.discard(key)
        self.commands += self.t.writes.put_revoke([key])

    @rule(keys=st.lists(KEYS, min_size=1, max_size=3), release=st.booleans())
    def get(self, keys: list[str], release: bool) -> None:
        reply = self.t.reads.get_replicas(keys, self.now)
        if release and reply.first_lease:
            hits = sum(size >= 0 for size in reply.sizes)
            self.commands += self.t.reads.release_leases(range(reply.first_lease, reply.first_lease + hits))

    @rule(keys=st.lists(KEYS, min_size=1, max_size=2))
    def remove(self, keys: list[str]) -> None:
        _, commands = self.t.remove(keys)
        self.commands += commands
        assert self.t.reads.exists(keys) == [False] * len(keys)

    @rule(ms=st.integers(1, 1500))
    def advance(self, ms: int) -> None:
        self.now += ms
        for n in NODES:
            self.t.membership.heartbeat(n, self.now)
        self.commands += self.t.expire(self.now)

    @precondition(lambda self: bool(self.commands))
    @rule(data=st.data())
    def daemon_answers(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.commands) - 1))
        command = self.commands.pop(i)
        done = [data.draw(st.booleans()) if command.kind is not ActionKind.DROP else True for _ in command.keys]
        self.t.apply(command, done)

    @precondition(lambda self: bool(self.t.objects))
    @rule(data=st.data(), node=st.sampled_from(NODES), budget=st.integers(0, 6000))
    def replicate(self, data: st.DataObject, node: str, budget: int) -> None:
        stored = st.sampled_from(sorted(self.t.objects))
        keys = data.draw(st.lists(stored | KEYS, min_size=1, max_size=4))
        moves = self.t.moves.plan_replicas(keys, node, budget)
        assert sum(m.size for m in moves) <= budget
        assert all(m.target == node and m.source != node for m in moves)
        if moves:
            self.copies.append(moves)

    @precondition(lambda self: bool(self.copies))
    @rule(data=st.data())
    def copy_answered(self, data: st.DataObject) -> None:
        moves = self.copies.pop(data.draw(st.integers(0, len(self.copies) - 1)))
        done = [data.draw(st.booleans()) for _ in moves]
        copied, commands = self.t.moves.finish_replicas(moves, done, answered=data.draw(st.booleans()))
        assert all(ok for m, ok in zip(moves, done, strict=True) if m in copied)
        for move in copied:
            assert self.t.reads.exists([move.key]) == [True]
        self.commands += commands

    @precondition(lambda self: bool(self.copies or self.drains))
    @rule(data=st.data())
    def remove_while_copying(self, data: st.DataObject) -> None:
        moves = data.draw(st.sampled_from(self.copies + [m for _, m, _ in self.drains]))
        key = data.draw(st.sampled_from([m.key for m in moves]))
        entry = self.t.objects.get(key)
        copying = (
            {r.node_id for r in entry.replicas if r.status is ReplicaStatus.COPYING} if entry is not None else set()
        )
        _, commands = self.t.remove([key])
        self.commands += commands
        assert all(key not in c.keys for c in commands if c.node_id in copying)  # told once the copy is answered

    @rule(keys=st.lists(KEYS, max_size=6))
    def match(self, keys: list[str]) -> None:
        self.check_match(keys)

    def check_match(self, keys: list[str]) -> None:
        t = self.t

        def held(key: str, node: str, dram_only: bool) -> bool:
            # A replica between tiers is read by key through its daemon: it counts, though not as
            # DRAM; one being copied in or dropped does not.
            e = t.objects.get(key)
            return (
                e is not None and e.committed and not e.removing and t.nodes[node].up
                and any(r.node_id == node and r.status in (ReplicaStatus.READY, ReplicaStatus.MOVING)
                        and (not dram_only or (r.tier is TierName.DRAM and r.ready))
                        for r in e.replicas)
            )  # fmt: skip

        expected = {}
        for n in t.nodes:
            total = next((i for i, k in enumerate(keys) if not held(k, n, False)), len(keys))
            dram = next((i for i, k in enumerate(keys) if not held(k, n, True)), len(keys))
            if total:
                expected[n] = NodePrefix(dram, total)
        assert t.reads.match_prefix_nodes(keys) == PrefixMatch(t.reads.match_prefix(keys), expected)

    @rule(node=st.sampled_from(NODES), tier=st.sampled_from([TierName.DRAM, TierName.SSD]))
    def evict_tier(self, node: str, tier: TierName) -> None:
        _, commands = self.t.moves.evict_tier(node, tier)
        self.commands += commands

    @rule(node=st.sampled_from(NODES), limit=st.integers(1, 6))
    def drain_round(self, node: str, limit: int) -> None:
        """One round of a drain, as MasterService.drain runs it: copies planned, the source's drops
        sent; the copies are answered by ``drain_answered``. No block readable before is unreadable."""
        keys = sorted(self.t.objects)
        readable = [k for k, ok in zip(keys, self.t.reads.exists(keys), strict=True) if ok]
        self.t.moves.start_drain(node)
        moves, drops = self.t.moves.plan_moves(node, limit)
        assert all(self.t.reads.exists(readable))
        self.commands += drops
        if moves:
            self.drains.append((node, moves, {n.node_id: n.gen for n in self.t.nodes.values()}))
        self.t.moves.stop_drain(node)

    @precondition(lambda self: bool(self.drains))
    @rule(data=st.data())
    def drain_answered(self, data: st.DataObject) -> None:
        """A drain's copies answered (or not: the target may hold them, and gets drops that name
        their extents); no block readable before is unreadable after."""
        node, moves, registered = self.drains.pop(data.draw(st.integers(0, len(self.drains) - 1)))
        keys = sorted(self.t.objects)
        readable = [k for k, ok in zip(keys, self.t.reads.exists(keys), strict=True) if ok]
        answered = data.draw(st.booleans())
        done = [answered and data.draw(st.booleans()) for _ in moves]
        commands = self.t.moves.finish_moves(node, moves, done, answered=answered)
        for m, ok in zip(moves, done, strict=True):
            entry = self.t.objects.get(m.key)
            held = entry is not None and any(r.gen == m.gen for r in entry.replicas)
            if self.t.nodes[m.target].gen != registered[m.target]:
                continue  # the target re-registered: its inventory replaced the copy
            copy_dropped = any(m.key in c.keys and c.node_id == m.target for c in commands)
            # The extent a copy may be in stays reserved until its drop is answered; a copy that
            # was refused frees it now.
            assert held == (ok or not answered or copy_dropped), (m, ok, answered)
            if copy_dropped:
                [c] = [c for c in commands if c.node_id == m.target and m.key in c.keys]
                assert c.offsets[c.keys.index(m.key)] == m.extent.offset  # the drop names the copy's extent
        self.commands += commands
        assert all(self.t.reads.exists(readable))

    @rule(node=st.sampled_from(NODES))
    def goes_quiet(self, node: str) -> None:
        """``node`` misses its heartbeats until it is down (the next ``advance`` brings it back)."""
        self.now += self.t.membership.ttl_ms + 1
        for n in NODES:
            if n != node:
                self.t.membership.heartbeat(n, self.now)
        self.commands += self.t.expire(self.now)
        assert not self.t.nodes[node].up

    @rule(node=st.sampled_from(NODES))
    def reregister(self, node: str) -> None:
        held = [
            HeldBlock(e.key, r.tier, r.extent.offset if r.tier is TierName.DRAM and r.extent else -1,
                          e.size, e.checksum)
            for store in (self.t.objects, self.t.pending)
            for e in store.values()
            for r in e.replicas
            if r.node_id == node
        ]  # fmt: skip
        self.commands = [c for c in self.commands if c.node_id != node]
        self.commands += self.t.membership.register_node(node, f"{node}:2", 8192, 4096, 64, held, self.now)

    @invariant()
    def invariants_hold(self) -> None:
        self.t.check()
        for node in self.t.nodes.values():
            if not any(c.node_id == node.node_id for c in self.commands):
                assert (node.inflight, node.dram_freeing, node.ssd_delta) == (0, 0, 0), node
        self.check_match([f"k{i}" for i in range(12)])


TestPlacementTable = PlacementMachine.TestCase
