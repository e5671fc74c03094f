"""Daemon commands: carrying out what the placement table plans for the daemons.

The table plans (drops, demotions, promotions, copies, grants to open or close); this module sends
them, applies the answers to the table that planned them, retries what a daemon did not answer, and
fences what a term that ended planned (a new leader plans its own from the daemons' inventories).

Each node has one connection per :class:`Lane`, because a connection serves one call at a time: a
drop that waits out a slow receiver (up to the daemon's I/O timeout) or a copy of many blocks must
never hold up the grant a put is waiting for.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import replace
from typing import TypeVar

from kvstore.errors import ConnectionFailed, KVStoreError
from kvstore.placement.state import Move, NodeCommand
from kvstore.placement.table import PlacementTable
from kvstore.policy import ActionKind
from kvstore.protocol import CommandReply, DemoteBlocks, DropBlocks, EndGrants, FetchBlocks, Message, PromoteBlocks
from kvstore.ratelog import RateLimitedLog
from server.master.nodes import NodeRegistry

log = logging.getLogger("kvstore.master")

Spawn = Callable[[Awaitable[object], str], None]
M = TypeVar("M", bound=Message)


class Lane(enum.StrEnum):
    """Which of a node's connections a command goes on."""

    GRANTS = "grants"
    """Opening and closing write grants: on a put's path, never queued behind anything slow."""
    BLOCKS = "blocks"
    """Drops, demotions and promotions (a drop may wait for the block's receivers)."""
    COPIES = "copies"
    """Copies of blocks between daemons (drain, replicate): the longest calls."""
    PROBE = "probe"
    """Whether the daemon's process is still there (:mod:`server.master.probes`): never behind anything."""


class Room:
    """Wakes the puts and grants waiting for space whenever some may have been freed (a command's
    answer applied, a grant closed, reservations expired): room is waited for, not polled."""

    def __init__(self) -> None:
        self._freed = asyncio.Event()

    def freed(self) -> None:
        self._freed.set()
        self._freed = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        """Until room is freed, or ``timeout_s`` passed (the caller plans again either way)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._freed.wait(), timeout_s)

    @property
    def next_freed(self) -> asyncio.Event:
        """Set when room is next freed (taken now: a free before its waiter runs is not missed)."""
        return self._freed


def _message(command: NodeCommand) -> Message:
    if command.kind is ActionKind.DEMOTE:
        return DemoteBlocks(list(command.keys))
    if command.kind is ActionKind.PROMOTE:
        return PromoteBlocks(list(command.keys), list(command.offsets))
    return DropBlocks(
        list(command.keys), command.tier.value if command.tier_only else "", list(command.offsets),
        command.void_until_ms, list(command.at),
    )  # fmt: skip


def _voids(command: NodeCommand) -> bool:
    return command.kind is ActionKind.DROP and command.release


class Commands:
    """Runs the table's commands on the daemons of :attr:`nodes` (see the module's text)."""

    def __init__(self, nodes: NodeRegistry, spawn: Spawn, reservation_ms: int = 0) -> None:
        """``reservation_ms``: how long a reservation's seal lasts (drops void every seal issued
        before them: those end within this of now)."""
        self.nodes = nodes
        self._spawn = spawn
        self.reservation_ms = reservation_ms
        self.void_until_ms = 0
        """The latest end of the seals a drop sent so far made void: every seal issued from now on
        must end after it (:meth:`seal_end`)."""
        self.retry: list[NodeCommand] = []
        """Commands a daemon did not answer: sent again at the next tick while their node is up."""
        self._dropping: dict[tuple[str, int], Counter[str]] = {}
        """Per node registration (id, gen), the keys with a drop on its way to its daemon, or waiting
        to be sent again: until it is made, a reader that goes to the daemon directly may still find
        the block (a remove waits for them; see :meth:`dropping`)."""
        self.room = Room()
        self.unreachable: Callable[[str], None] = lambda node_id: None
        """Told the node of every command that could not reach its daemon (the service's prober)."""
        self._failures = RateLimitedLog(log)
        """Failures that repeat every tick (a command a daemon keeps refusing): a line a minute each."""

    def current(self, table: PlacementTable) -> bool:
        """Whether ``table`` is this term's (commands planned on another are void)."""
        return table is self.nodes.table

    async def call(self, node_id: str, lane: Lane, message: Message, expect: type[M]) -> M:
        return await self.nodes.link(node_id, lane).call(message, expect)

    def spawn(self, coro: Awaitable[object], name: str) -> None:
        """Run ``coro`` in the background, as the service runs its tasks (a failure logged)."""
        self._spawn(coro, name)

    def later(self, commands: list[NodeCommand], name: str, table: PlacementTable | None = None) -> None:
        """Carry ``commands`` (planned on ``table``, the current one by default) out in the
        background (nothing waits for them)."""
        if commands:
            commands = self._stamped(commands)
            self._track(commands, 1)  # now: a remove that comes before the task runs sees its drops
            self._spawn(self._run(commands, table or self.nodes.table), name)

    def start(self, commands: list[NodeCommand], name: str) -> asyncio.Event:
        """:meth:`later`, returning an event set once every node answered its commands or failed."""
        finished = asyncio.Event()
        if not commands:
            finished.set()
            return finished
        commands = self._stamped(commands)
        self._track(commands, 1)

        async def run() -> None:
            try:
                await self._run(commands, self.nodes.table)
            finally:
                finished.set()

        self._spawn(run(), name)
        return finished

    def _stamped(self, commands: list[NodeCommand]) -> list[NodeCommand]:
        """Drops that give reservations or keys up (``release``: revokes, expiries, removals; an
        eviction's block was committed, its seal used) stamped with the end of the seals they make
        void (once: a retry keeps its stamp, never voiding a reservation made after it was planned)."""
        if not any(_voids(c) and not c.void_until_ms for c in commands):
            return commands
        until = self._void_bound()
        return [replace(c, void_until_ms=until) if _voids(c) and not c.void_until_ms else c for c in commands]

    def _void_bound(self) -> int:
        """The end of every seal issued so far (wall ms), for a drop to void: the latest one raised to it."""
        until = int(time.time() * 1000) + self.reservation_ms
        self.void_until_ms = max(self.void_until_ms, until)
        return until

    def seal_end(self, now_wall_ms: int) -> int:
        """When a reservation sealed now ends: ``reservation_ms`` from now, and after every seal a
        drop made void (a key put again within a millisecond of its drop is not refused)."""
        return max(now_wall_ms + self.reservation_ms, self.void_until_ms + 1)

    def _track(self, commands: Iterable[NodeCommand], sign: int) -> None:
        """Count the drops of ``commands`` in (1) or out (-1) of those under way (:meth:`dropping`)."""
        for c in commands:
            if c.kind is ActionKind.DROP:
                dropping = self._dropping.setdefault((c.node_id, c.node_gen), Counter())
                for key in c.keys:
                    dropping[key] += sign
                    if dropping[key] <= 0:
                        del dropping[key]
                if not dropping:
                    del self._dropping[c.node_id, c.node_gen]

    def dropping(self, keys: Iterable[str]) -> set[str]:
        """Of ``keys``, those with a drop under way to a node that may still serve them to a reader
        that goes to its daemon directly: one of its registration now, not fenced, its lease to
        serve by key not lapsed. (A fenced node's daemon serves nothing until it registers again,
        and its registration drops what it had not; a node registered anew was told in its
        registration's answer; one whose lease to serve by key lapsed serves none by key until its
        drops are made: :meth:`NodeRegistry.renew_key_lease`. A reader by location asks the master,
        which no longer places the keys there.)"""
        live = self._live(time.monotonic())
        return {k for k in keys if any(k in counter for _, counter in live)} if live else set()

    def _live(self, now: float) -> list[tuple[str, Counter[str]]]:
        """(node, its drops under way) of the nodes that may still serve them (see :meth:`dropping`)."""
        nodes, registry = self.nodes.table.nodes, self.nodes
        return [
            (node_id, counter) for (node_id, gen), counter in self._dropping.items()
            if (node := nodes.get(node_id)) is not None and node.gen == gen and not node.fenced
            and not registry.key_lease_lapsed(node_id, now)
        ]  # fmt: skip

    def owes(self, node_id: str) -> bool:
        """Whether a drop is under way to ``node_id`` (of its registration now)."""
        node = self.nodes.table.nodes.get(node_id)
        return node is not None and (node_id, node.gen) in self._dropping

    def next_lapse(self, keys: Iterable[str]) -> float | None:
        """The earliest end (time.monotonic()) of a lease to serve by key of a node that may still
        serve one of ``keys`` (see :meth:`dropping`): their wait may end then. None: no such node."""
        wanted = set(keys)
        ends = [
            self.nodes.key_lease_end(node_id)
            for node_id, counter in self._live(time.monotonic()) if not wanted.isdisjoint(counter)
        ]  # fmt: skip
        return min(ends) if ends and self.nodes.key_lease_s else None

    async def run(self, commands: list[NodeCommand], table: PlacementTable | None = None) -> bool:
        """Send commands (each node's in order, nodes in parallel) and apply the answers; whether
        every node answered (the others' are retried at the next tick)."""
        commands = self._stamped(commands)
        self._track(commands, 1)
        return await self._run(commands, table or self.nodes.table)

    async def _run(self, commands: list[NodeCommand], table: PlacementTable) -> bool:
        per_node: dict[str, list[NodeCommand]] = {}
        for c in commands:
            per_node.setdefault(c.node_id, []).append(c)
        return all(await asyncio.gather(*(self._run_node(cs, table) for cs in per_node.values())))

    async def _run_node(self, commands: list[NodeCommand], table: PlacementTable) -> bool:
        done = 0  # commands[:done] are out of dropping; the rest go out, or into retry, however this ends
        try:
            for i, command in enumerate(commands):
                if not self.current(table):
                    return True  # void: another term's table (nothing to retry)
                node = table.nodes.get(command.node_id)
                if node is None:
                    continue
                if node.fenced:  # its daemon serves nothing until it registers, which drops these
                    table.settle_fenced(command)
                else:
                    try:
                        reply = await self.call(command.node_id, Lane.BLOCKS, _message(command), CommandReply)
                    except KVStoreError as exc:
                        if isinstance(exc, ConnectionFailed):
                            self.unreachable(command.node_id)
                        self._failures.warning(f"command-{command.kind.value}-{command.node_id}",
                                               "command %s to %s failed (%s); will retry", command.kind.value,
                                               command.node_id, exc)  # fmt: skip
                        if self.current(table):
                            self.retry.extend(commands[i:])
                            done = len(commands)  # still dropping: they are sent again
                        return False
                    if not self.current(table):
                        return True  # answered to a term that ended while it ran: the new one rebuilds
                    table.apply(command, reply.done)
                self._track(commands[done : i + 1], -1)
                done = i + 1
                self.room.freed()
            return True
        finally:
            self._track(commands[done:], -1)

    def forget(self, node_id: str) -> None:
        """Drop the retries of a node that re-registered or left (its inventory supersedes them)."""
        self._track((c for c in self.retry if c.node_id == node_id), -1)
        self.retry = [c for c in self.retry if c.node_id != node_id]

    def tick(self, table: PlacementTable, now_ms: int) -> None:
        """Expire what ran out of time and send again what was not answered."""
        fenced = {n for n, node in table.nodes.items() if node.fenced}
        commands = table.expire(now_ms)
        for node_id, node in table.nodes.items():
            if node.fenced and node_id not in fenced:  # what an operator reads first after a fault
                self.nodes.cut_links(node_id)
                log.warning("node %s fenced: silent for over its TTL; its drops count as made, and it serves "
                            "nothing until it registers again", node_id)  # fmt: skip
        for node_id, grant_ids in table.grants.expired_grants(now_ms).items():
            self._spawn(self.close_grants(node_id, grant_ids), "grant-expiry")
        retry, self.retry = self.retry, []
        self._track(retry, -1)  # those sent again are counted again by later()
        nodes = table.nodes
        # Of the node as it is registered now: a registration since replaced what they were planned on.
        live = [c for c in retry if c.node_id in nodes and nodes[c.node_id].up and c.node_gen == nodes[c.node_id].gen]
        self.later(commands + live, "expiry-commands", table)
        self.room.freed()  # reservations that expired gave their space back

    async def close_grants(self, node_id: str, grant_ids: list[int]) -> None:
        """Have the daemon stop taking writes into ``grant_ids``, then free what is left of them.

        Unanswered, the grants stay held (nothing can be written into space handed out again);
        they are asked again at the next tick, and a re-registration of the node drops them."""
        table = self.nodes.table
        if node_id in table.nodes:
            try:
                await self.call(node_id, Lane.GRANTS, EndGrants(grant_ids), CommandReply)
            except KVStoreError as exc:
                log.warning("closing grants on %s failed (%s); will retry", node_id, exc)
                for grant_id in grant_ids:
                    grant = table.grants.open.get(grant_id)
                    if grant is not None:
                        grant.ending = False
                        grant.deadline_ms = 0  # expired again at the next tick
                return
        if self.current(table):
            table.grants.finish_end_grants(node_id, grant_ids)
            self.room.freed()

    def close_grants_later(self, per_node: dict[str, list[int]], name: str) -> None:
        for node_id, grant_ids in per_node.items():
            self._spawn(self.close_grants(node_id, grant_ids), name)

    async def fetch(self, target: str, source_address: str, group: list[Move], why: str) -> list[bool] | None:
        """Have ``target``'s daemon copy ``group`` from the daemon at ``source_address`` into the extents
        reserved for it; per block whether it is committed there, None when the target did not answer."""
        message = FetchBlocks(
            source_address, [m.key for m in group], [m.extent.offset for m in group], [m.size for m in group],
            [m.checksum for m in group], [m.pinned for m in group], [m.write_id for m in group],
        )  # fmt: skip
        try:
            done = (await self.call(target, Lane.COPIES, message, CommandReply)).done
        except KVStoreError as exc:
            log.warning("%s: %s could not copy from %s: %s", why, target, source_address, exc)
            return None
        return done if len(done) == len(group) else [False] * len(group)

    async def drop_everywhere(self, keys: list[str]) -> bool:
        """Have every up node drop ``keys``; whether all of them confirmed."""
        nodes = [n.node_id for n in self.nodes.table.membership.up_nodes()]
        # The earlier master's seals of them end by then; a cached put's block pending here is not theirs.
        drop = DropBlocks(keys, void_until_ms=self._void_bound(), keep_pending=True)
        answers = await asyncio.gather(
            *(self.call(n, Lane.BLOCKS, drop, CommandReply) for n in nodes), return_exceptions=True
        )
        return not any(isinstance(a, BaseException) for a in answers)
