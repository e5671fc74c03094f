"""Membership: nodes join by registering their inventory, stay up by heartbeats, go down when silent.

A daemon's (re)registration replaces everything the table knew of that node by
the daemon's inventory: the daemons are the source of truth, so a new master
rebuilds the whole table from them. A node silent for longer than ``ttl_ms``
is fenced: its daemon stopped serving by then (it serves only within a lease
shorter than ``ttl_ms`` from its last answered heartbeat), so every drop it had
not confirmed, and every one planned for it from then on, is done with at once
(a remove waiting for it is answered, the key placeable again), each block noted
in the node's ``gone``. Its other replicas stay, unread while it is down. The
node comes back only by registering: its inventory adopted, less what ``gone``
names. A node whose daemon's process is known gone (the master found its port
refusing connections) is fenced the same way at once (:meth:`Membership.fence_gone`).

A node of the cluster that is not in the table at all is *absent*: one a new
leader expected and that did not register within its readiness wait, or one an
earlier leader fenced or knew absent. The table cannot know which keys it holds,
so every key removed meanwhile is noted for it (:meth:`Membership.removed`): its
registration drops them rather than bringing a removed key back. An HA leader
keeps a :class:`NodeRecord` of every node in etcd (:meth:`Membership.take_records`),
which is how the next leader knows the nodes to wait for and those absent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvstore.allocator import Allocator, Extent, align_up
from kvstore.errors import InvalidArgument, InvalidKey
from kvstore.keys import validate_key
from kvstore.placement.records import MAX_CHECKSUM, S_DROPPING, T_DRAM
from kvstore.placement.state import DRAM, SSD, Catalog, NodeCommand, NodeState, ObjectEntry
from kvstore.policy import ActionKind, TierName
from kvstore.results import HeldBlock
from kvstore.write_ids import MAX_WRITE_ID

Gone = set[tuple[str, TierName, int]]
"""Blocks a node's registration must drop, not adopt: (key, tier, DRAM offset; -1: wherever it is)."""


def _gone_of(key: str, tier: TierName, offset: int, tier_only: bool) -> list[tuple[str, TierName, int]]:
    """The entries of a :data:`Gone` for a block given up: its copy in ``tier`` (in DRAM at ``offset``,
    -1: wherever), and unless ``tier_only`` any copy in the other tier (a demotion or promotion cut
    short leaves one there that the table does not know of)."""
    out = [(key, tier, offset if tier is DRAM else -1)]
    if not tier_only:
        out.append((key, SSD if tier is DRAM else DRAM, -1))
    return out


EVERYTHING = ("", DRAM, -1)
"""A :data:`Gone` entry that names every block (no key is empty): an absent node through more
removes than :data:`MAX_ABSENT_GONE` keeps track of drops its whole inventory at registration."""

MAX_ABSENT_GONE = 1024
"""Most entries the removes add to an absent node's ``gone`` before it becomes :data:`EVERYTHING`
(512 keys; in etcd as JSON at most ~280 KB, rewritten at each remove: kept small)."""


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """What an HA leader keeps in etcd of a node for the next leader: whether it was in the table and
    not fenced (``member``: the next leader waits for it), and what its registration must drop."""

    member: bool
    gone: frozenset[tuple[str, TierName, int]]


def _is_gone(gone: Gone, key: str, tier: TierName, offset: int) -> bool:
    return (key, tier, -1) in gone or (tier is DRAM and (key, tier, offset) in gone) or EVERYTHING in gone


MAX_NODE_BYTES = 1 << 50
"""Bound on a node's tier capacities and block sizes (1 PiB): beyond it a registration is refused."""


def _is_key(key: str) -> bool:
    try:
        validate_key(key)
    except InvalidKey:
        return False
    return True


def _check_registration(address: str, dram: int, ssd: int, alignment: int, max_blocks: int) -> None:
    """Refuse a registration whose numbers no daemon sends, before anything of the node is touched."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"node address {address!r} is not host:port")
    for name, value in (("dram capacity", dram), ("ssd capacity", ssd)):
        if not 0 <= value <= MAX_NODE_BYTES:
            raise InvalidArgument(f"{name} {value} is outside [0, {MAX_NODE_BYTES}]")
    if not 0 < alignment <= 1 << 20 or alignment & (alignment - 1) or dram < alignment:
        raise InvalidArgument(f"alignment {alignment} is not a power of two up to 1 MiB within a DRAM of {dram}")
    if not 0 <= max_blocks <= 1 << 32:
        raise InvalidArgument(f"max_blocks {max_blocks} is outside [0, 2**32]")


class Membership:
    """Adds and removes nodes of the catalog, and sets their ``up`` and ``last_seen_ms``."""

    def __init__(self, catalog: Catalog, *, ttl_ms: int) -> None:
        self.catalog = catalog
        self.ttl_ms = ttl_ms
        self.records_changed: set[str] = set()
        """Nodes whose :class:`NodeRecord` changed since :meth:`take_records` (an HA leader keeps
        them in etcd: a new leader must know them)."""
        self._absent: dict[str, Gone] = {}
        """Absent nodes (see the module's text), each with what its registration must drop."""
        self._noted_from: dict[str, int] = {}
        """Per absent node, the size of its ``gone`` before removes were noted (the bound is on those)."""
        self.owing: dict[str, Gone] = {}
        """Per node, blocks of removed keys it has not confirmed dropping, whose removes were answered
        without it (its lease to serve by key lapsed: see :meth:`owe`): in its record, so that a new
        leader drops them at its registration rather than adopt them."""

    def take_records(self) -> dict[str, NodeRecord | None]:
        """The records that changed since the last call; None for a node that left (none to keep)."""
        changed, self.records_changed = self.records_changed, set()
        nodes = self.catalog.nodes
        out: dict[str, NodeRecord | None] = {}
        for n in changed:
            node = nodes.get(n)
            if n in self._absent:
                out[n] = NodeRecord(False, frozenset(self._absent[n]))
            elif node is not None:
                out[n] = NodeRecord(not node.fenced, frozenset(node.gone | self.owing.get(n, set())))
            else:
                out[n] = None
        return out

    def records_pending(self) -> bool:
        """Whether some node's record changed since :meth:`take_records`."""
        return bool(self.records_changed)

    def record_changed(self, node_id: str) -> None:
        """``node_id``'s record is to be taken again (keeping it in etcd failed)."""
        self.records_changed.add(node_id)

    def take_settling(self) -> list[tuple[str, str]]:
        """The (node, key) drops of detached blocks (:meth:`Catalog.detach`) confirmed since the last
        call, which the records :meth:`take_records` gives no longer name: hand them to
        :meth:`records_kept` once those are kept (a node owes the key until then: a new leader
        reading its old record would drop a block of the key put there since). Take both at once."""
        settling = []
        for node in self.catalog.nodes.values():
            if node.settling:
                settling += [(node.node_id, key) for key in node.settling]
                node.settling.clear()
        return settling

    def records_kept(self, settling: list[tuple[str, str]]) -> None:
        """The records that :meth:`take_records` gave with ``settling`` are kept: those nodes owe
        those keys no more."""
        nodes = self.catalog.nodes
        for node_id, key in settling:
            node = nodes.get(node_id)
            if node is not None:
                self.catalog.settled(node, key)

    def records_not_kept(self, settling: list[tuple[str, str]]) -> None:
        """They were not: taken again at the next :meth:`take_records`."""
        nodes = self.catalog.nodes
        for node_id, key in settling:
            node = nodes.get(node_id)
            if node is not None and key in node.owes:
                node.settling.add(key)

    @property
    def absent(self) -> list[str]:
        """The absent nodes (see the module's text), in order."""
        return sorted(self._absent)

    def up_nodes(self) -> list[NodeState]:
        return self.catalog.up_nodes()

    def detach(self, key: str) -> bool:
        """Forget a removed key whose drops were answered without its nodes (see :meth:`Catalog.detach`)."""
        return self.catalog.detach(key)

    def note_absent(self, node_id: str, gone: Iterable[tuple[str, TierName, int]], recorded: bool = False) -> None:
        """``node_id`` is of the cluster but not in the table (see the module's text); its registration
        must drop ``gone`` (an earlier leader's list) and every key removed from now on. ``recorded``:
        etcd's record says as much already (a new leader reading it): not written again for this; a
        member's record says "member" until the term is ready without it (see MasterService)."""
        if node_id in self.catalog.nodes:
            return  # it registered meanwhile: what it owed was given to its registration
        drop = set(gone)
        held = self._absent.get(node_id)
        if held is None:
            held = self._absent[node_id] = drop
        elif EVERYTHING in held or drop <= held:
            return
        else:
            held |= drop
        self._noted_from[node_id] = len(held)
        if not recorded:
            self.records_changed.add(node_id)

    def removed(self, keys: Sequence[str]) -> None:
        """``keys`` were removed: an absent node that holds one must not bring it back."""
        if not keys or not self._absent:
            return
        entries = {(k, t, -1) for k in keys for t in (DRAM, SSD)}
        for node_id, held in self._absent.items():
            if EVERYTHING in held or entries <= held:
                continue
            held |= entries
            if len(held) > self._noted_from.get(node_id, 0) + MAX_ABSENT_GONE:
                held.clear()
                held.add(EVERYTHING)
            self.records_changed.add(node_id)

    def owe(self, node_id: str, keys: Iterable[str]) -> None:
        """A remove of ``keys`` is answered without ``node_id``'s drops of them (its daemon serves
        nothing by key any more, but may come back within its node lease, and a new leader would
        adopt its inventory): note the blocks they leave there in its record (:attr:`owing`)."""
        cat = self.catalog
        node = cat.nodes.get(node_id)
        if node is None:
            return
        rec = cat.rec
        entries: Gone = set()
        for key in keys:
            slot = rec.index.get(key)
            if slot is None or not rec.is_removing(slot):
                continue
            row = rec.row_on(slot, node.idx)
            if row >= 0:
                tier = DRAM if rec.r_tier[row] == T_DRAM else SSD
                entries.update(_gone_of(key, tier, rec.r_offset[row] if tier is DRAM else -1, False))
        held = self.owing.get(node_id, set())
        if not entries <= held:
            self.owing[node_id] = held | entries
            self.records_changed.add(node_id)

    def settled(self, command: NodeCommand) -> None:
        """``command``'s daemon answered it: a drop there owes its keys no more (see :meth:`owe`)."""
        held = self.owing.get(command.node_id)
        if not held or command.kind is not ActionKind.DROP:
            return
        keys = set(command.keys)
        done = {e for e in held if e[0] in keys}
        if done:
            held -= done
            if not held:
                del self.owing[command.node_id]
            self.records_changed.add(command.node_id)

    def record_at_registration(self, node_id: str, gone: Iterable[tuple[str, TierName, int]] | None) -> NodeRecord:
        """The record ``node_id`` is to have once registered with ``gone`` (an earlier leader's list):
        a member that must drop what its registration drops (an HA leader keeps it in etcd first)."""
        return NodeRecord(True, frozenset(self._owed(node_id, set(gone) if gone is not None else None)))

    def _owed(self, node_id: str, gone: Gone | None) -> Gone:
        """What a registration of ``node_id`` must drop rather than adopt: blocks whose drop is under
        way, what the node owed since its last registration, ``gone``, and what it owes as absent."""
        old = self.catalog.nodes.get(node_id)
        earlier = old.gone if old is not None else set()
        owed = self._dropping_on(node_id) | earlier | (gone or set()) | self._absent.get(node_id, set())
        return owed | self.owing.get(node_id, set())

    def register_node(
        self,
        node_id: str,
        address: str,
        dram_capacity: int,
        ssd_capacity: int,
        alignment: int,
        inventory: Sequence[HeldBlock],
        now_ms: int,
        max_blocks: int = 0,
        gone: Gone | None = None,
    ) -> list[NodeCommand]:
        """(Re)build what the table knows of ``node_id`` from its inventory (oldest use first).

        Returns drops for blocks the table cannot adopt: a key that another
        node holds with other bytes, an extent that overlaps another, or the
        second copy of a key the daemon holds in both tiers (a demotion or
        promotion cut short): the DRAM one is kept unless it disagrees with the
        bytes other nodes hold. Each drop names its tier, so that the daemon
        drops that copy and not the one kept. So are the blocks the table had
        given up on this node and whose drop the daemon had not confirmed (a
        removed key, an evicted copy): adopting them would bring back a key a
        remove took away; and so are those ``gone`` names (an earlier leader's, from etcd).
        """
        cat = self.catalog
        validate_key(node_id)
        _check_registration(address, dram_capacity, ssd_capacity, alignment, max_blocks)
        # Items that cannot be blocks (a bad key, a size out of range) are left out: no daemon writes them.
        inventory = [
            i for i in inventory
            if 0 < i.size <= MAX_NODE_BYTES and 0 <= i.checksum < MAX_CHECKSUM and 0 <= i.write_id < MAX_WRITE_ID
            and _is_key(i.key)
        ]  # fmt: skip
        gone = self._owed(node_id, gone)
        self.owing.pop(node_id, None)  # what it owed is dropped at this registration (see _owed)
        self._absent.pop(node_id, None)
        self._noted_from.pop(node_id, None)
        self.records_changed.add(node_id)  # a member now (and what it owes until its first heartbeat)
        commands = self._forget_node(node_id)
        capacity = dram_capacity - dram_capacity % alignment
        conflicts: dict[TierName, list[tuple[str, int]]] = {DRAM: [], SSD: []}
        dram_items = sorted((i for i in inventory if i.tier is DRAM), key=lambda i: i.offset)
        extents: list[tuple[int, int]] = []
        end = 0
        adopted: set[str] = set()
        for item in dram_items:
            misplaced = item.offset < end or item.offset % alignment or item.offset + item.size > capacity
            if misplaced or _is_gone(gone, item.key, DRAM, item.offset):
                conflicts[DRAM].append((item.key, item.offset))
            else:
                extents.append((item.offset, item.size))
                end = item.offset + align_up(item.size, alignment)
                adopted.add(item.key)
        # The table keeps every extent it hands out (one per replica): the allocator need not.
        alloc = Allocator.rebuild(dram_capacity, alignment, extents, track=False)
        node = cat.add_node(node_id, address, alloc, ssd_capacity, now_ms=now_ms, max_blocks=max_blocks)
        if gone:
            # Kept until the daemon's first heartbeat, which says it took this registration's answer
            # (and dropped them): one that lost the answer registers again, and must drop them then.
            # Nothing is placed on it meanwhile.
            node.gone, node.up = gone, False
        # A block to drop keeps its extent until the daemon confirms the drop (the DROP's answer frees
        # it): placed over before, a same-host writer would copy into a block the daemon still serves.
        for item in dram_items:
            if _is_gone(gone, item.key, DRAM, item.offset) and not (
                item.offset % alignment or item.offset + item.size > capacity
            ):
                kept = Extent(item.offset, alloc.round_up(item.size))
                if alloc.take(kept):
                    node.quarantine[item.key] = kept
        rec = cat.rec
        # DRAM first: of a key in both tiers, the DRAM copy is kept when it agrees with the table.
        for item in [i for i in inventory if i.tier is DRAM] + [i for i in inventory if i.tier is SSD]:
            tier = item.tier
            if tier is DRAM and item.key not in adopted:
                continue
            if _is_gone(gone, item.key, tier, item.offset):
                conflicts[tier].append((item.key, item.offset))
                continue
            slot = rec.index.get(item.key)
            if slot is not None and (
                not rec.in_service(slot)
                or rec.size[slot] != item.size
                or rec.checksum[slot] != item.checksum
                or rec.row_on(slot, node.idx) >= 0  # its copy in the other tier is kept
            ):
                conflicts[tier].append((item.key, item.offset))
                if tier is DRAM:  # kept out of the free space until its drop is confirmed (see above)
                    node.quarantine[item.key] = Extent(item.offset, alloc.round_up(item.size))
                continue
            if slot is None:
                slot = cat.new_key(
                    item.key, item.size, item.checksum, committed=True, pinned=item.pinned, write_id=item.write_id
                )
            elif item.write_id and rec.write_id[slot] != item.write_id:
                # The same bytes: of the write whose id this copy kept; copies that disagree, unknown.
                rec.write_id[slot] = 0 if rec.write_id[slot] else item.write_id
            extent = Extent(item.offset, alloc.round_up(item.size)) if tier is DRAM else None
            node.lru(tier).insert_row(cat.add_replica(slot, node, tier, extent))
            if tier is SSD:
                node.ssd_used += item.size
        # Each DRAM block dropped only where the inventory had it (``at``; its extent is quarantined):
        # a drop retried after a put of the key placed anew there must not take the new block.
        return commands + cat.issue(
            [
                NodeCommand(
                    node_id,
                    ActionKind.DROP,
                    tier,
                    tuple(k for k, _ in blocks),
                    release=True,
                    tier_only=True,
                    gens=(0,) * len(blocks),
                    at=tuple(o for _, o in blocks) if tier is DRAM else (),
                )
                for tier, blocks in conflicts.items()
                if blocks
            ]
        )

    def check_blocks(
        self, node_id: str, keys: Sequence[str], offsets: Sequence[int], sizes: Sequence[int],
        checksums: Sequence[int],
    ) -> list[bool]:  # fmt: skip
        """Per block a daemon holds (at its DRAM offset, -1 on SSD), whether it is an orphan: no put
        the table knows placed that key on that node (the put was given up before its bytes came, or
        the block has other bytes than the key's). An orphan's DRAM extent is taken out of the free
        space, where it still lies in it, until :meth:`release_quarantine`: the daemon drops the
        block, and nothing is placed over it meanwhile. An unknown node: nothing is an orphan (it
        registers again, and its inventory is adopted)."""
        if not len(keys) == len(offsets) == len(sizes) == len(checksums):
            raise InvalidArgument("a CheckBlocks whose lists differ in length")
        cat = self.catalog
        node = cat.nodes.get(node_id)
        if node is None:
            return [False] * len(keys)
        rec = cat.rec
        out: list[bool] = []
        for key, offset, size, csum in zip(keys, offsets, sizes, checksums, strict=True):
            slot = rec.index.get(key)
            row = rec.row_on(slot, node.idx) if slot is not None else -1
            known = (
                slot is not None
                and row >= 0
                and not rec.is_removing(slot)
                and rec.size[slot] == size
                and (
                    rec.checksum[slot] == csum
                    if rec.is_committed(slot)
                    # A put in flight is placed where it was reserved (it cannot move meanwhile).
                    else rec.r_offset[row] < 0 or rec.r_offset[row] == offset
                )
            )
            out.append(not known)
            if known:
                # The key is placed here now: an orphan of it kept out earlier is gone (a daemon
                # holds one block a key), so is its extent.
                self.release_quarantine(node_id, [key])
                continue
            if offset < 0 or key in node.quarantine or not 0 < size <= MAX_NODE_BYTES:
                continue
            cat.counters["orphans"] += 1
            extent = Extent(offset, node.alloc.round_up(size))
            if node.alloc.take(extent):
                node.quarantine[key] = extent
        return out

    def release_quarantine(self, node_id: str, keys: Sequence[str]) -> None:
        """The daemon dropped these orphans: their extents are free again."""
        node = self.catalog.nodes.get(node_id)
        if node is None:
            return
        for key in keys:
            extent = node.quarantine.pop(key, None)
            if extent is not None:
                node.alloc.free(extent)

    def _dropping_on(self, node_id: str, forget: bool = False) -> Gone:
        """The blocks on ``node_id`` whose drop is in flight (of a key being removed, or a copy evicted,
        demoted or promoted away), as :data:`Gone` entries; ``forget``: their replicas forgotten too."""
        cat = self.catalog
        node = cat.nodes.get(node_id)
        if node is None:
            return set()
        rec = cat.rec
        out: Gone = set()
        for slot in list(rec.index.values()):
            row = rec.row_on(slot, node.idx)  # a key has one replica a node
            key = rec.keys[slot]
            if row >= 0 and key is not None and (rec.is_removing(slot) or rec.r_status[row] == S_DROPPING):
                tier = DRAM if rec.r_tier[row] == T_DRAM else SSD
                out.update(_gone_of(key, tier, rec.r_offset[row] if tier is DRAM else -1, False))
                if forget:
                    cat.drop_row(row)
        return out

    def _forget_node(self, node_id: str) -> list[NodeCommand]:
        """Drop every replica on ``node_id``; returns revocations of its puts' replicas on other nodes."""
        cat = self.catalog
        node = cat.nodes.get(node_id)
        if node is None:
            return []
        # Its grants go with it: the daemon forgets them when it registers, and the allocator is rebuilt.
        for grant_id in [g.grant_id for g in cat.grants.values() if g.node_id == node_id]:
            del cat.grants[grant_id]
        rec = cat.rec
        broken: list[ObjectEntry] = []
        # Readable replicas and moving ones alike: the daemon's inventory now tells what it holds.
        for slot in list(rec.index.values()):
            row = rec.row_on(slot, node.idx)
            if row < 0:
                continue
            cat.drop_row(row)
            if rec.keys[slot] is not None and rec.is_writing(slot):
                broken.append(ObjectEntry(rec, slot))
        cat.remove_node(node_id)
        # A put that had a replica there cannot complete; its other replicas may hold bytes already.
        return cat.revoke(broken)

    def leave_node(self, node_id: str) -> list[NodeCommand]:
        """``node_id`` leaves for good (its daemon unmounted its segment): its replicas are forgotten
        (keys held nowhere else are gone), and its puts in flight revoked on their other nodes."""
        self.catalog.draining.discard(node_id)
        self.owing.pop(node_id, None)
        self._absent.pop(node_id, None)
        self._noted_from.pop(node_id, None)
        self.records_changed.add(node_id)
        return self._forget_node(node_id)

    def heartbeat(self, node_id: str, now_ms: int) -> bool:
        """Record that ``node_id`` is alive; False when the table does not know it or fenced it (it
        must register again: its inventory is what the table adopts)."""
        node = self.catalog.nodes.get(node_id)
        if node is None or node.fenced:
            return False
        node.last_seen_ms = now_ms
        node.up = True
        node.suspect = False
        if node.gone:
            node.gone = set()  # its registration's answer was taken (see register_node)
            self.records_changed.add(node_id)
        return True

    def ssd_health(self, node_id: str, capacity: int, configured: int, fault: str) -> None:
        """What the node's daemon says its SSD tier can hold now (``capacity``, of ``configured``) and
        why it is less; eviction plans with it from the next put on. -1: unchanged."""
        node = self.catalog.nodes.get(node_id)
        if node is None:
            return
        if configured >= 0:
            node.ssd_configured = configured
        if capacity >= 0:
            node.ssd_capacity = capacity
        node.ssd_fault = fault

    def fence_silent(self, now_ms: int) -> None:
        """Fence the nodes not heard from for longer than ``ttl_ms`` (see the module's text)."""
        for node in self.catalog.nodes.values():
            if not node.fenced and now_ms - node.last_seen_ms > self.ttl_ms:
                self.fence(node.node_id)

    def fence_gone(self, node_id: str, gen: int, seen_ms: int) -> bool:
        """Fence ``node_id`` now, ahead of its TTL, because its daemon's process is gone (its port
        refused a connection): only the registration ``gen`` the finding was about, and only if it
        was not heard from since ``seen_ms`` (a restarted daemon that registered or heartbeated
        since is not the one found gone). Whether it was fenced."""
        node = self.catalog.nodes.get(node_id)
        if node is None or node.fenced or node.gen != gen or node.last_seen_ms != seen_ms:
            return False
        self.fence(node_id)
        self.catalog.counters["fences_refused"] += 1
        return True

    def suspect(self, node_id: str, gen: int, seen_ms: int) -> bool:
        """Suspect ``node_id`` (registration ``gen``, not heard from since ``seen_ms``): it missed
        heartbeats and did not answer the master. New blocks go elsewhere first until its next
        heartbeat. Whether it is suspected now."""
        node = self.catalog.nodes.get(node_id)
        if node is None or node.fenced or node.gen != gen or node.last_seen_ms != seen_ms:
            return False
        if not node.suspect:
            node.suspect = True
            self.catalog.counters["suspicions"] += 1
        return True

    def postpone_fences(self, now_ms: int, by_ms: int) -> None:
        """Give every node not fenced at least ``by_ms`` from ``now_ms`` before it is: after the
        master itself stalled (it read no heartbeat meanwhile). Fencing later is always safe."""
        floor = now_ms - self.ttl_ms + by_ms
        for node in self.catalog.nodes.values():
            if not node.fenced:
                node.last_seen_ms = max(node.last_seen_ms, floor)

    def fence(self, node_id: str) -> None:
        """``node_id`` is down and fenced: only for a node whose daemon no longer serves (silent past
        its lease). Its drops in flight are done with: their replicas forgotten, noted in
        :attr:`NodeState.gone`; so are those of every command planned for it from now on
        (:meth:`settle_fenced`). Its other replicas stay, unread while it is down, for its
        registration to confirm."""
        node = self.catalog.nodes[node_id]
        node.up, node.fenced = False, True
        self.catalog.counters["fences"] += 1
        if (events := self.catalog.rec.events) is not None:
            events.append((False, node.idx, -1, ""))  # all its blocks: unread until it registers again
        node.gone |= self._dropping_on(node_id, forget=True)
        self.records_changed.add(node_id)

    def gone_with(self, command: NodeCommand) -> None:
        """Note in its fenced node's :attr:`NodeState.gone` the blocks ``command`` drops or demotes
        (a promotion is not made: the block stays where it is)."""
        cat = self.catalog
        node = cat.nodes.get(command.node_id)
        if node is None or node.gen != command.node_gen or command.kind is ActionKind.PROMOTE:
            return
        self.records_changed.add(node.node_id)
        gens = command.gens or (0,) * len(command.keys)
        at = command.at or (-1,) * len(command.keys)
        for key, gen, offset in zip(command.keys, gens, at, strict=True):
            if offset >= 0:  # a reservation given up there: a block of the key elsewhere is another put's
                node.gone.add((key, DRAM, offset))
            elif (found := cat.replica(key, node.node_id, gen) if gen else None) is not None:
                replica = found[1]
                where = replica.extent.offset if replica.extent is not None else -1
                node.gone.update(_gone_of(key, replica.tier, where, command.tier_only))
            else:
                node.gone.update(_gone_of(key, command.tier, -1, command.tier_only))
