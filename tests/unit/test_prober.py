"""The master's prober suspects a node that missed three heartbeats at once (puts waiting for room
on it plan again without it), but never for a silence that was the master's own stall."""

from __future__ import annotations

import asyncio

from kvstore.placement.table import PlacementTable
from kvstore.policy import EvictionPolicy
from kvstore.protocol import Nic, RegisterNode
from server.master.commands import Commands
from server.master.metrics import LoopStalls
from server.master.nodes import NodeRegistry
from server.master.probes import Prober

KB = 1024
HB_MS = 50


def _setup(stalls: LoopStalls) -> tuple[NodeRegistry, Prober]:
    nodes = NodeRegistry(PlacementTable(EvictionPolicy(0.9, 0.8, 2), node_ttl_ms=1000), command_timeout_s=1.0)
    for name in ("n0", "n1"):
        nodes.register(
            RegisterNode(name, f"127.0.0.1:{name[-1]}1", 64 * KB, 0, 64, [], [], "host", "", 0,
                         [Nic("lo", "127.0.0.1", -1, -1)], False, "", 0, []),
            now_ms=0,
        )  # fmt: skip
        nodes.table.membership.heartbeat(name, 0)
    commands = Commands(nodes, lambda coro, name: coro.close(), 1000)  # probes are not run here
    return nodes, Prober(commands, lambda coro, name: coro.close(), enabled=False, heartbeat_ms=HB_MS,
                         stalled_s=stalls.recent_s)  # fmt: skip


def test_a_node_silent_for_three_heartbeats_is_suspected_at_the_tick() -> None:
    nodes, prober = _setup(LoopStalls())
    prober.tick(nodes.table, 2 * HB_MS + 20)  # two heartbeats missed: probed, not suspected yet
    assert not nodes.table.nodes["n0"].suspect
    nodes.table.membership.heartbeat("n1", 3 * HB_MS)
    prober.tick(nodes.table, 3 * HB_MS + 20)
    assert nodes.table.nodes["n0"].suspect and not nodes.table.nodes["n1"].suspect
    assert nodes.table.counters["suspicions"] == 1
    nodes.table.membership.heartbeat("n0", 3 * HB_MS + 30)  # its next heartbeat clears it
    assert not nodes.table.nodes["n0"].suspect


def test_a_silence_the_master_stalled_through_suspects_nobody() -> None:
    """The master's loop stalled 120 ms (it read no heartbeat meanwhile): a node silent 170 ms was
    silent 50 ms of its own, not three heartbeats."""
    stalls = LoopStalls()
    stalls.record(0.12)
    nodes, prober = _setup(stalls)
    prober.tick(nodes.table, 170)
    assert not any(n.suspect for n in nodes.table.nodes.values())
    prober.tick(nodes.table, 300)  # silent 300 ms: past three heartbeats even less the stall
    assert all(n.suspect for n in nodes.table.nodes.values())


def test_a_suspicion_wakes_the_puts_waiting_for_room() -> None:
    async def run() -> bool:
        nodes, prober = _setup(LoopStalls())
        freed = prober.commands.room.next_freed
        prober.tick(nodes.table, 3 * HB_MS + 20)
        return freed.is_set()

    assert asyncio.run(run())
