"""Everything the master knows about its storage nodes, in one place.

The placement table (:mod:`kvstore.placement`) keeps what placement needs of a node: its
allocator, tiers, LRU lists, whether it is up. The registry keeps the rest beside it — how
clients reach the node (:class:`NodeInfo`), what its daemon reported moving, and the master's
link to it — and is the one way in: registering, heartbeats and leaving go through it, so the
parts cannot disagree about which nodes exist. The admin API reads nodes through
:class:`NodeView`, a snapshot it cannot change.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from msgspec.structs import replace

from kvstore.auth import Credential
from kvstore.placement.state import NodeCommand, NodeState
from kvstore.placement.table import PlacementTable
from kvstore.policy import TierName
from kvstore.protocol import InventoryItem, MasterHello, NodeInfo, RegisterNode
from kvstore.results import HeldBlock
from transfer.aio import AsyncConnection


def held_blocks(inventory: list[InventoryItem]) -> list[HeldBlock]:
    """A daemon's inventory as the placement table takes it."""
    return [HeldBlock(i.key, TierName(i.tier), i.offset, i.size, i.checksum, i.pinned, i.write_id) for i in inventory]


@dataclass
class _Entry:
    info: NodeInfo
    transfer_bytes: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    links: dict[str, AsyncConnection] = field(default_factory=dict)
    """The master's connections to the daemon, one per lane (see :meth:`NodeRegistry.link`)."""


@dataclass(frozen=True)
class NodeView:
    """A node as the admin API shows it: placement state and how to reach it, read-only."""

    node_id: str
    info: NodeInfo
    state: NodeState
    """The table's own record; read it, never write it (the table's invariants live there)."""
    draining: bool
    transfer_bytes: Mapping[str, int]
    """Bytes the node's daemon moved by "transport|rail|direction" (from its heartbeats)."""
    tiers: Mapping[str, Mapping[str, int]]
    refusals: Mapping[str, int] = field(default_factory=dict)
    """What the node's daemon refused, by kind (from its heartbeats)."""


class NodeRegistry:
    """The nodes of one placement table: membership goes through here, and so do daemon links.

    Nodes enter the table only by registering through :meth:`register`, and leave it only through
    :meth:`leave` (a daemon unmounting its segment) or with a new term, so the registry's entries
    and the table's nodes are the same set.

    ``table`` is replaced (with :meth:`reset`) when the master stops leading: a new term starts
    with no nodes, and the links of the old one are handed back for closing.
    """

    def __init__(
        self,
        table: PlacementTable,
        command_timeout_s: float,
        credential: Credential | None = None,
        tls: ssl.SSLContext | None = None,
        key_lease_s: float = 0.0,
    ) -> None:
        """``credential``: what the master proves itself with to daemons that authenticate; ``tls``:
        the context of its links to daemons (None: plain); ``key_lease_s``: the daemons' lease to
        serve by key (:meth:`key_lease_end`; 0: none apart from the node TTL's)."""
        self.table = table
        self.key_lease_s = key_lease_s
        self._key_leases: dict[str, float] = {}
        """Node -> when (time.monotonic()) the last lease to serve by key this master granted it ends."""
        self._term_start = time.monotonic()
        self.command_timeout_s = command_timeout_s
        self.credential = credential
        self.tls = tls
        self.epoch = 0
        """Sent in the MasterHello of every new link: daemons refuse commands of older masters."""
        self._entries: dict[str, _Entry] = {}
        self._stale: list[AsyncConnection] = []

    # -- membership ----------------------------------------------------------------------------
    def register(
        self, m: RegisterNode, now_ms: int, gone: set[tuple[str, TierName, int]] | None = None
    ) -> list[NodeCommand]:
        """(Re)register a node from its daemon's message; returns drops for blocks the table
        could not adopt (and those ``gone`` names: see Membership.register_node). A node that
        comes back at another address gets a new link."""
        commands = self.table.membership.register_node(
            m.node_id,
            m.address,
            m.dram_capacity,
            m.ssd_capacity,
            m.alignment,
            held_blocks(m.inventory),
            now_ms,
            m.max_blocks,
            gone,
        )
        info = NodeInfo(
            m.node_id, m.address, m.rails or [m.address], m.host_id, m.arena_path, m.arena_inode, m.nics, m.rdma,
            m.ucx_address, True,
        )  # fmt: skip
        old = self._entries.get(m.node_id)
        links = old.links if old is not None else {}
        if any(link.address != m.address for link in links.values()):
            self._stale.extend(links.values())  # the daemon moved: its old links go
            links = {}
        self._entries[m.node_id] = _Entry(info, links=links)
        self._key_leases[m.node_id] = time.monotonic() + self.key_lease_s  # its answer starts one
        return commands

    def leave(self, node_id: str) -> list[NodeCommand]:
        """Forget a node for good (see Membership.leave_node); its link is handed over with
        :meth:`take_stale`. Returns the revocations of its puts' replicas on other nodes."""
        entry = self._entries.pop(node_id, None)
        if entry is not None:
            self._stale.extend(entry.links.values())
        return self.table.membership.leave_node(node_id)  # an absent node leaves too

    def heartbeat(
        self, node_id: str, transfer_bytes: dict[str, int], now_ms: int, refusals: dict[str, int] | None = None
    ) -> bool:  # fmt: skip
        """Whether the node is known (a daemon that is not must register again)."""
        entry = self._entries.get(node_id)
        if entry is None or not self.table.membership.heartbeat(node_id, now_ms):
            return False
        entry.transfer_bytes = transfer_bytes
        entry.refusals = refusals or {}
        return True

    def reset(self, table: PlacementTable) -> list[AsyncConnection]:
        """Start over with ``table`` and no nodes; returns the old links, for the caller to close."""
        links = self.links() + self.take_stale()
        self.table = table
        self._entries = {}
        self._key_leases = {}
        self._term_start = time.monotonic()
        return links

    # -- leases to serve by key ------------------------------------------------------------------
    def key_lease_end(self, node_id: str) -> float:
        """When (time.monotonic()) the node's daemon stops serving reads by key alone unless renewed:
        the end of the last lease this master granted it, or, before this master granted any, a
        whole lease from the start of its term (a former leader's grants ended before that)."""
        return self._key_leases.get(node_id, self._term_start + self.key_lease_s)

    def key_lease_lapsed(self, node_id: str, now: float) -> bool:
        """Whether the node's daemon serves nothing by key at ``now`` (time.monotonic()) but what a
        renewal allows: a drop sent to it that it has not confirmed cannot be read past (see
        :meth:`server.master.commands.Commands.dropping`). Never, without such leases."""
        return bool(self.key_lease_s) and now >= self.key_lease_end(node_id)

    def renew_key_lease(self, node_id: str, owes_drops: bool) -> bool:
        """A heartbeat of the node is answered now: renew its lease to serve by key, unless it lapsed
        while the node owes drops (the removes waiting for them were answered on its lapse: the
        daemon must not serve those blocks by key again until it dropped them). Whether renewed."""
        now = time.monotonic()
        if owes_drops and self.key_lease_lapsed(node_id, now):
            return False
        self._key_leases[node_id] = now + self.key_lease_s
        return True

    # -- daemon links ----------------------------------------------------------------------------
    def link(self, node_id: str, lane: str) -> AsyncConnection:
        """The master's connection to the node's daemon for ``lane``, opened on first use.

        A connection serves one call at a time, so each kind of command has its own (see
        :mod:`server.master.commands`): a drop waiting out a slow receiver never delays a grant."""
        entry = self._entries[node_id]
        link = entry.links.get(lane)
        if link is None:
            address = self.table.nodes[node_id].address
            hello = MasterHello(self.epoch) if self.epoch else None  # fences the commands of older masters
            link = entry.links[lane] = AsyncConnection(
                address, self.command_timeout_s, hello=hello, credential=self.credential, tls=self.tls
            )
        return link

    def cut_links(self, node_id: str) -> None:
        """Give up the master's connections to a node just fenced, the commands in flight on them
        included (they fail; the fence settled them): a request TCP still holds for a cut-off daemon
        would reach it when the cut heals, after its registration (a drop deleting a block put
        there since), and would hold every later command of its lane until then. Its next command
        connects anew."""
        entry = self._entries.get(node_id)
        if entry is None:
            return
        links, entry.links = entry.links, {}
        for link in links.values():
            link.abort()

    def links(self) -> list[AsyncConnection]:
        return [link for e in self._entries.values() for link in e.links.values()]

    def take_stale(self) -> list[AsyncConnection]:
        """Links to addresses their nodes left, for the caller to close."""
        stale, self._stale = self._stale, []
        return stale

    # -- reading -------------------------------------------------------------------------------
    def infos(self) -> list[NodeInfo]:
        """Every registered node with how to reach it, up or down, by node id (ListNodes)."""
        nodes = self.table.nodes
        return [replace(e.info, up=nodes[n].up) for n, e in sorted(self._entries.items())]

    def view(self, node_id: str) -> NodeView | None:
        entry = self._entries.get(node_id)
        return None if entry is None else self._view(node_id, entry)

    def _view(self, node_id: str, entry: _Entry) -> NodeView:
        state = self.table.nodes[node_id]
        return NodeView(
            node_id, replace(entry.info, up=state.up), state, self.table.moves.is_draining(node_id),
            MappingProxyType(dict(entry.transfer_bytes)), MappingProxyType(self.table.inspection.tier_usage(state)),
            MappingProxyType(dict(entry.refusals)),
        )  # fmt: skip

    def views(self) -> list[NodeView]:
        return [self._view(n, e) for n, e in sorted(self._entries.items())]
