"""Finding out at once that a daemon's process is gone, instead of waiting out its node TTL.

A silent node is fenced once its TTL passed: its daemon's lease is over by then, so it serves
nothing, and the drops it never confirmed count as made (a remove waiting for them is answered).
A killed or crashed daemon is known gone long before that: its port refuses connections. The
master looks (a MasterHello on a connection of its own, :attr:`Lane.PROBE`, within
:data:`PROBE_TIMEOUT_S`) when a client reports the node unreachable (ReportNode), when one of its
own commands to the node could not reach it, and when the node missed two heartbeats; a refusal
fences the node at once (``MasterConfig.fence_refused``). A frozen daemon (the kernel still accepts
its connections) and a cut-off one (nothing answers) are not refused: either may still serve a
client, so they are fenced by their TTL as before, suspected meanwhile (new blocks and grants go to
other nodes first, and no put waits on its evictions, until the node's next heartbeat). A node silent
for three of its heartbeats (beyond any stall of the master's own loop) is suspected without waiting
for the probe; a probe that finds the daemon answering changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Literal

from kvstore.config import MIN_HEARTBEAT_MS
from kvstore.errors import ConnectionFailed, ConnectionRefused, KVStoreError
from kvstore.placement.table import PlacementTable
from kvstore.protocol import MasterHello, OkReply
from server.master.commands import Commands, Lane, Spawn

log = logging.getLogger("kvstore.master")

PROBE_TIMEOUT_S = 0.2
"""How long a probe waits for the daemon to connect and answer (a busy one that takes longer is not
fenced: only a refusal fences)."""

PROBE_GAP_S = 0.1
"""A node is probed at most this often, however many reports come."""


class Prober:
    """Probes nodes suspected of being gone and fences those whose daemon's port refuses."""

    def __init__(
        self, commands: Commands, spawn: Spawn, *, enabled: bool, heartbeat_ms: int,
        stalled_s: Callable[[float], float] = lambda window_s: 0.0,
    ) -> None:  # fmt: skip
        """``stalled_s(window)``: the longest this master's own loop stalled within the last
        ``window`` seconds (:meth:`LoopStalls.recent_s`)."""
        self.commands = commands
        self.enabled = enabled
        self.heartbeat_ms = heartbeat_ms
        self.stalled_s = stalled_s
        self._spawn = spawn
        self._began: dict[str, float] = {}
        """Node -> when its last probe began (monotonic seconds)."""

    def suspect(self, node_id: str, why: str) -> None:
        """Look whether ``node_id``'s daemon is gone (``why``: what made it suspect, for the log)."""
        table = self.commands.nodes.table
        node = table.nodes.get(node_id)
        if not self.enabled or node is None or node.fenced:
            return
        now = time.monotonic()
        if now - self._began.get(node_id, -PROBE_GAP_S) < PROBE_GAP_S:
            return
        self._began[node_id] = now
        self._spawn(self._probe(table, node_id, node.gen, node.last_seen_ms, why), "node-probe")

    def tick(self, table: PlacementTable, now_ms: int) -> None:
        """Probe the nodes that missed two heartbeats, and suspect at once those silent for three
        (and forget nodes the table no longer has): a put waiting for room on a frozen node plans
        again without it (:meth:`MasterCore._evicted`) sooner than the probe's timeout would have
        it. A stall of this master's own loop meanwhile is no daemon's silence: it is not counted."""
        for node_id in [n for n in self._began if n not in table.nodes]:
            del self._began[node_id]
        beat_ms = max(self.heartbeat_ms, MIN_HEARTBEAT_MS)  # the daemon's own interval
        for node in list(table.nodes.values()):
            silent_ms = now_ms - node.last_seen_ms
            if node.fenced or silent_ms <= 2 * self.heartbeat_ms:
                continue
            if (
                not node.suspect and silent_ms - self.stalled_s(silent_ms / 1000) * 1000 > 3 * beat_ms
                and table.membership.suspect(node.node_id, node.gen, node.last_seen_ms)
            ):  # fmt: skip
                self.commands.room.freed()  # wakes the puts waiting on it
            self.suspect(node.node_id, f"no heartbeat for {silent_ms} ms")

    async def _probe(self, table: PlacementTable, node_id: str, gen: int, seen_ms: int, why: str) -> None:
        found = await self._look(node_id)
        if found == "silent" and self.commands.current(table) and table.membership.suspect(node_id, gen, seen_ms):
            self.commands.room.freed()  # new blocks elsewhere first until its next heartbeat; waiting puts plan again
        if found != "refused":
            return
        if self.commands.current(table) and table.membership.fence_gone(node_id, gen, seen_ms):
            self.commands.nodes.cut_links(node_id)
            log.warning("node %s fenced: its daemon's port refuses connections (the process is gone; suspected: "
                        "%s); its drops count as made, and it serves nothing until it registers again",
                        node_id, why)  # fmt: skip
            self.commands.room.freed()  # removes and revokes waiting for its drops are answered now

    async def _look(self, node_id: str) -> Literal["refused", "answered", "silent"]:
        """Whether the daemon's port refuses the master's connection, or the daemon answers it, or
        neither within :data:`PROBE_TIMEOUT_S` (frozen, cut off, overloaded: never refused). A link
        the daemon's death cut fails once before a new connection is tried: twice, then."""
        for _ in range(2):
            try:
                link = self.commands.nodes.link(node_id, Lane.PROBE)
            except KeyError:
                return "answered"  # the node left meanwhile: nothing to do
            try:
                await asyncio.wait_for(link.call(MasterHello(self.commands.nodes.epoch), OkReply), PROBE_TIMEOUT_S)
                return "answered"
            except ConnectionRefused:
                return "refused"
            except ConnectionFailed:
                continue
            except (KVStoreError, TimeoutError):
                break
        return "silent"
