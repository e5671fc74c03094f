"""The placement table's per-key records, kept as columns: one row of arrays per key and per replica.

A master holds millions of keys. As Python objects each key cost an entry, a replica list, a
replica and a handful of int objects, an LRU node and an allocator entry: ~630 bytes, and as many
cache misses per lookup. Here a key is one dict entry (its key string to its slot) plus a few
bytes in each column, and a replica a few bytes in each replica column; node ids are interned as
small ints. The rules live in the table's parts; this module stores, links, and answers what a
key's state is.

- Keys: ``index`` maps a key to its slot; the slot's columns hold its size, checksum, write id
  (:mod:`kvstore.write_ids`), state, last use, SSD hits and its first replica's row (``head``).
  Slots of removed keys are reused. A key's state is bits that only this module reads: the parts
  ask it named questions (:meth:`Records.in_service`, :meth:`Records.is_writing`, ...), one key at
  a time or a batch at once on the hot paths (:meth:`Records.served_slots`, :meth:`Records.commit_keys`).
- Replicas: rows linked from ``head`` through ``r_next``; each names its key's slot, its node (an
  index into ``node_ids``), tier, status, DRAM offset (-1 without one; its length is the key's size
  rounded up to the node's alignment), generation, and its place in its node's tier LRU.
- :class:`TierLRU`: one node's tier in exact least-recently-used order, kept as an append-only log
  of (stamp, row): a row is in the LRU while its ``r_lru`` bit is set, at the position of the log
  entry whose stamp is the row's current one; older entries of the row are skipped and dropped
  when the log is compacted. Insert and touch are one append each, remove one bit.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from kvstore.errors import NotFound

_COMMITTED, _PINNED, _REMOVING = 1, 2, 4
"""Bits of a key's ``_state``: visible to readers once put; never evicted; gone once its daemons
confirm. Read only in this module: the rest of the table asks :class:`Records` by name."""
_LIVE = _COMMITTED | _REMOVING
"""Of a key's bits, those that tell its phase: being written (neither), stored (committed only),
being removed (removing, committed or not)."""

Phase = Literal["writing", "committed", "removing"]
"""Where a key is in its life (:meth:`Records.phase`)."""

T_DRAM, T_SSD = 0, 1
"""A replica's tier, as its column holds it."""

S_READY, S_MOVING, S_COPYING, S_DROPPING = 0, 1, 2, 3
"""A replica's status, as its column holds it (:class:`~kvstore.placement.state.ReplicaStatus`)."""

MAX_CHECKSUM = 1 << 64


class NodeUp(Protocol):
    """What :meth:`Records.is_found` reads of a node: whether it is up."""

    @property
    def up(self) -> bool: ...


_DTYPES = {"q": np.int64, "Q": np.uint64, "B": np.uint8, "I": np.uint32, "i": np.int32, "H": np.uint16}


def gather(column: array[int], at: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``column[at]`` for an index array ``at``, as a new array (the column is seen only meanwhile:
    an array.array cannot grow while a view of it lives)."""
    return np.frombuffer(column, _DTYPES[column.typecode])[at]


def scatter(column: array[int], at: np.ndarray[Any, Any], values: Any) -> None:
    """``column[at] = values`` for an index array ``at``."""
    np.frombuffer(column, _DTYPES[column.typecode])[at] = values


class Records:
    """Columns of keys and replicas, with slot and row reuse. Not thread-safe; the table owns it."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.keys: list[str | None] = []
        self.size = array("q")
        self.checksum = array("Q")
        self.write_id = array("Q")
        """Slot -> the write id of the put that reserved or wrote it (0: not known)."""
        self._state = array("B")
        """Slot -> the key's state bits (:data:`_COMMITTED` ...): read only through the predicates below."""
        self.last_use = array("q")
        self.ssd_hits = array("I")
        self.head = array("i")
        self.owner = array("H")
        """Slot -> its key's owner (:meth:`intern_owner`; 0: none), for the owners' LRU logs."""
        self._free_slots: list[int] = []
        self.deadlines: dict[int, int] = {}
        """Slots of uncommitted keys -> their reservation's deadline (committed keys have none)."""
        self.holds: dict[int, tuple[int, int]] = {}
        """Slots of held keys -> (the hold's lease id, when it ends): only with ``hold_ms``."""
        self.committed = 0
        """Keys committed (:meth:`is_committed`); the rest of ``index`` is being written."""
        self.r_slot = array("i")
        self.r_next = array("i")
        self.r_node = array("H")
        self.r_tier = array("B")
        self.r_status = array("B")
        self.r_lru = array("B")
        self.r_offset = array("q")
        self.r_gen = array("q")
        self.r_stamp = array("q")
        self._free_rows: list[int] = []
        self.stamp = 0
        """The last LRU stamp handed out: stamps grow, so a log's order is its stamps' order."""
        self.node_ids: list[str] = []
        """Node index -> node id; a node keeps its index across registrations."""
        self.node_index: dict[str, int] = {}
        self.alignment: list[int] = []
        """Node index -> its arena's alignment (a DRAM replica's extent is its size rounded up to it)."""
        self.owner_ids: dict[str, int] = {"": 0}
        """Owner (a tenant) -> its small int; "" (keys of no tenant) is 0."""
        self.owners_used = False
        """Whether any key has an owner other than 0 (else every LRU has the one log)."""
        self.events: list[tuple[bool, int, int, str]] | None = None
        """When a list (a master that publishes KV events): each replica that joins or leaves a
        :class:`TierLRU` (stored on that node and tier, or not), as (joined, node index, tier, key),
        and each node fenced, as (False, node index, -1, ""), in order. Its reader takes the list
        and puts an empty one in its place."""

    def __len__(self) -> int:
        return len(self.index)

    # -- nodes -------------------------------------------------------------------------------------
    def intern_node(self, node_id: str, alignment: int) -> int:
        idx = self.node_index.get(node_id)
        if idx is None:
            idx = self.node_index[node_id] = len(self.node_ids)
            if idx >= 1 << 16:
                raise OverflowError("more than 65536 node ids seen by one master")
            self.node_ids.append(node_id)
            self.alignment.append(alignment)
        else:
            self.alignment[idx] = alignment
        return idx

    def intern_owner(self, owner: str) -> int:
        """The small int of ``owner`` (made on first use; "" is 0)."""
        idx = self.owner_ids.get(owner)
        if idx is None:
            idx = len(self.owner_ids)
            if idx >= 1 << 16:
                raise OverflowError("more than 65535 tenants seen by one master")
            self.owner_ids[owner] = idx
            self.owners_used = True
        return idx

    def length(self, slot: int, node: int) -> int:
        """The DRAM extent length of the key in ``slot`` on node index ``node``."""
        mask = self.alignment[node] - 1
        return (self.size[slot] + mask) & ~mask

    # -- keys --------------------------------------------------------------------------------------
    def add_key(
        self, key: str, size: int, checksum: int, last_use: int, owner: int = 0, write_id: int = 0, *,
        committed: bool = False, pinned: bool = False,
    ) -> int:  # fmt: skip
        """A new key (not in ``index``) of ``owner`` (:meth:`intern_owner`), written by ``write_id``,
        ``committed`` (stored) or being written, ``pinned`` or not; its slot."""
        state = (_COMMITTED if committed else 0) | (_PINNED if pinned else 0)
        free = self._free_slots
        if free:
            slot = free.pop()
            self.keys[slot] = key
            self.size[slot] = size
            self.checksum[slot] = checksum
            self.write_id[slot] = write_id
            self._state[slot] = state
            self.last_use[slot] = last_use
            self.ssd_hits[slot] = 0
            self.head[slot] = -1
            self.owner[slot] = owner
        else:
            slot = len(self.keys)
            self.keys.append(key)
            self.size.append(size)
            self.checksum.append(checksum)
            self.write_id.append(write_id)
            self._state.append(state)
            self.last_use.append(last_use)
            self.ssd_hits.append(0)
            self.head.append(-1)
            self.owner.append(owner)
        self.index[key] = slot
        if committed:
            self.committed += 1
        return slot

    def add_run(self, keys: Sequence[str], sizes: Sequence[int], last_use: range, node: int, offsets: list[int],
                gens: range, deadline: int, owners: Sequence[int] | int = 0, write_id: int = 0, *,
                pinned: bool = False) -> None:  # fmt: skip
        """New keys (distinct, none in ``index``, not committed), each with one DRAM replica on node
        index ``node`` at its offset (in no LRU): :meth:`add_key` and :meth:`add_replica` for a whole
        batch, appended as columns when no slot or row is free to reuse. ``owners``: each key's, or
        one for all; ``write_id``: the put's, for all; ``pinned``: for all."""
        n = len(keys)
        if self._free_slots or self._free_rows:
            each = [owners] * n if isinstance(owners, int) else owners
            for key, size, clock, offset, gen, owner in zip(keys, sizes, last_use, offsets, gens, each, strict=True):
                slot = self.add_key(key, size, 0, clock, owner, write_id, pinned=pinned)
                self.add_replica(slot, node, T_DRAM, offset, S_READY, gen)
                self.deadlines[slot] = deadline
            return
        base, rbase = len(self.keys), len(self.r_slot)
        slots = range(base, base + n)
        self.keys.extend(keys)
        self.size.extend(sizes)
        self.checksum.extend(array("Q", [0]) * n)
        self.write_id.extend(array("Q", [write_id]) * n)
        self._state.extend(array("B", [_PINNED if pinned else 0]) * n)
        self.last_use.extend(last_use)
        self.ssd_hits.extend(array("I", [0]) * n)
        self.head.extend(range(rbase, rbase + n))
        self.owner.extend(array("H", [owners]) * n if isinstance(owners, int) else owners)
        self.index.update(zip(keys, slots, strict=True))
        self.deadlines.update(dict.fromkeys(slots, deadline))
        self.r_slot.extend(slots)
        self.r_next.extend(array("i", [-1]) * n)
        self.r_node.extend(array("H", [node]) * n)
        zeros = bytes(n)
        self.r_tier.frombytes(zeros)
        self.r_status.frombytes(zeros)
        self.r_lru.frombytes(zeros)
        self.r_offset.extend(offsets)
        self.r_gen.extend(gens)
        self.r_stamp.extend(array("q", [0]) * n)

    def drop_key(self, slot: int) -> None:
        """Forget the key in ``slot`` (its replicas are gone already); the slot is reused."""
        assert self.head[slot] == -1, "a key dropped with replicas"
        key = self.keys[slot]
        assert key is not None
        del self.index[key]
        if self._state[slot] & _COMMITTED:
            self.committed -= 1
        self.keys[slot] = None
        self.deadlines.pop(slot, None)
        self.holds.pop(slot, None)
        self._free_slots.append(slot)

    # -- a key's state: the questions the table's parts ask -----------------------------------------
    def is_committed(self, slot: int) -> bool:
        """Whether the key was committed (its put ended, or it was found stored); it stays so once removed."""
        return bool(self._state[slot] & _COMMITTED)

    def is_pinned(self, slot: int) -> bool:
        """Whether the key is pinned (at its put, never changed): nothing evicts it."""
        return bool(self._state[slot] & _PINNED)

    def is_removing(self, slot: int) -> bool:
        """Whether the key was removed, revoked or expired: neither read nor placed again, and gone
        once its daemons confirm."""
        return bool(self._state[slot] & _REMOVING)

    def in_service(self, slot: int) -> bool:
        """Whether the key is stored: committed and not being removed (what a read may find)."""
        return self._state[slot] & _LIVE == _COMMITTED

    def is_writing(self, slot: int) -> bool:
        """Whether a put of the key is in flight: neither committed nor given up."""
        return not self._state[slot] & _LIVE

    def is_evictable(self, slot: int) -> bool:
        """Whether the key is stored (:meth:`in_service`) and not pinned."""
        return self._state[slot] & (_LIVE | _PINNED) == _COMMITTED

    def phase(self, slot: int) -> Phase:
        """Where the key is in its life: being written, committed (stored), or being removed
        (removed, revoked or expired, committed or not)."""
        state = self._state[slot]
        return "removing" if state & _REMOVING else "committed" if state & _COMMITTED else "writing"

    def mark_removing(self, slot: int) -> None:
        """Take the key out of service for good (:meth:`is_removing`)."""
        self._state[slot] |= _REMOVING

    def served_slots(self, keys: Iterable[str]) -> list[int | None]:
        """The slot of each of ``keys`` in service (:meth:`in_service`), None for each other one:
        the hot paths' question, asked of a batch in one pass."""
        get, state = self.index.get, self._state
        return [
            slot if (slot := get(key)) is not None and state[slot] & _LIVE == _COMMITTED else None
            for key in keys
        ]  # fmt: skip

    def is_found(self, slot: int, nodes: Sequence[NodeUp | None]) -> bool:
        """Whether a read finds the key in ``slot``: in service, with a replica READY or between
        tiers (neither being copied in nor dropped) on a node that is up (``nodes``: by node index,
        None once it left)."""
        if self._state[slot] & _LIVE != _COMMITTED:
            return False
        status, r_node, nxt = self.r_status, self.r_node, self.r_next
        row = self.head[slot]
        while row >= 0:
            if status[row] <= S_MOVING:
                node = nodes[r_node[row]]
                if node is not None and node.up:
                    return True
            row = nxt[row]
        return False

    def keys_committed(self, committed: bool) -> list[str]:
        """The keys committed (``committed``) or not yet, in ``index`` order."""
        state, want = self._state, _COMMITTED if committed else 0
        return [k for k, s in self.index.items() if state[s] & _COMMITTED == want]

    def served_items(self) -> Iterator[tuple[str, int]]:
        """(key, slot) of every key in service, lazily (``index`` must not change meanwhile)."""
        state = self._state
        return ((k, s) for k, s in self.index.items() if state[s] & _LIVE == _COMMITTED)

    def commit_keys(self, keys: Iterable[str], checksums: Iterable[int], write_id: int) -> tuple[list[bool], list[int]]:
        """Commit each of ``keys`` that the put ``write_id`` is writing (its reservation's deadline
        goes) with its checksum, and not the others (unknown, committed or removing already,
        another put's; a key twice: its second): whether each was, and the slots committed, in order."""
        index, state, ids, checksum, deadlines = self.index, self._state, self.write_id, self.checksum, self.deadlines
        out: list[bool] = []
        slots: list[int] = []
        for key, check in zip(keys, checksums, strict=True):
            slot = index.get(key)
            if slot is None or (bits := state[slot]) & _LIVE or ids[slot] != write_id:
                out.append(False)
                continue
            state[slot] = bits | _COMMITTED
            checksum[slot] = check
            del deadlines[slot]
            out.append(True)
            slots.append(slot)
        self.committed += len(slots)
        return out, slots

    def commit_run(self, at: np.ndarray[Any, Any], checksums: Sequence[int], write_id: int) -> bool:
        """:meth:`commit_keys` of distinct slots ``at`` (an index array), column-wise, when the put
        ``write_id`` is writing every one; False, having changed nothing, when it is not."""
        state = gather(self._state, at)
        if (state & _LIVE).any() or (gather(self.write_id, at) != write_id).any():
            return False
        scatter(self._state, at, state | _COMMITTED)
        scatter(self.checksum, at, np.array(checksums, np.uint64))
        deadlines = self.deadlines
        for slot in at.tolist():
            del deadlines[slot]
        self.committed += len(at)
        return True

    # -- replicas ----------------------------------------------------------------------------------
    def add_replica(self, slot: int, node: int, tier: int, offset: int, status: int, gen: int) -> int:
        """A replica of the key in ``slot``, last of its replicas; its row (in no LRU yet)."""
        free = self._free_rows
        if free:
            row = free.pop()
            self.r_slot[row] = slot
            self.r_next[row] = -1
            self.r_node[row] = node
            self.r_tier[row] = tier
            self.r_status[row] = status
            self.r_lru[row] = 0
            self.r_offset[row] = offset
            self.r_gen[row] = gen
            self.r_stamp[row] = 0
        else:
            row = len(self.r_slot)
            self.r_slot.append(slot)
            self.r_next.append(-1)
            self.r_node.append(node)
            self.r_tier.append(tier)
            self.r_status.append(status)
            self.r_lru.append(0)
            self.r_offset.append(offset)
            self.r_gen.append(gen)
            self.r_stamp.append(0)
        at = self.head[slot]
        if at < 0:
            self.head[slot] = row
        else:
            nxt = self.r_next
            while nxt[at] >= 0:
                at = nxt[at]
            nxt[at] = row
        return row

    def remove_replica(self, row: int) -> None:
        """Unlink ``row`` from its key (it must be out of every LRU); the row is reused."""
        assert not self.r_lru[row], "a replica removed while in an LRU"
        slot, nxt = self.r_slot[row], self.r_next
        at = self.head[slot]
        if at == row:
            self.head[slot] = nxt[row]
        else:
            while nxt[at] != row:
                at = nxt[at]
            nxt[at] = nxt[row]
        self.r_slot[row] = -1
        self._free_rows.append(row)

    def rows(self, slot: int) -> list[int]:
        """The rows of the key's replicas, in the order they were added."""
        out = []
        row, nxt = self.head[slot], self.r_next
        while row >= 0:
            out.append(row)
            row = nxt[row]
        return out

    def row_on(self, slot: int, node: int) -> int:
        """The row of the key's replica on node index ``node``; -1 when it has none there."""
        row, nxt, nodes = self.head[slot], self.r_next, self.r_node
        while row >= 0 and nodes[row] != node:
            row = nxt[row]
        return row

    def next_stamp(self) -> int:
        self.stamp += 1
        return self.stamp

    # -- for tests ---------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert that index, slots and replica chains agree."""
        live = {slot for slot, key in enumerate(self.keys) if key is not None}
        assert len(live) == len(self.index) and all(self.keys[s] == k for k, s in self.index.items())
        assert set(self._free_slots) == set(range(len(self.keys))) - live, "free slots drifted"
        assert self.committed == sum(1 for s in live if self._state[s] & _COMMITTED), "committed count drifted"
        assert set(self.deadlines) <= live and set(self.holds) <= live
        seen: set[int] = set()
        for slot in live:
            for row in self.rows(slot):
                assert row not in seen and self.r_slot[row] == slot, f"replica row {row} linked twice"
                seen.add(row)
        assert seen == {r for r in range(len(self.r_slot)) if self.r_slot[r] >= 0}, "a replica row of no key"
        assert set(self._free_rows) == set(range(len(self.r_slot))) - seen, "free rows drifted"


class _Log:
    """One owner's recency log in a :class:`TierLRU`: (stamp, row) entries appended in stamp order;
    ``members`` and ``nbytes``: its rows in the LRU now and their bytes (pins are never logged)."""

    __slots__ = ("members", "nbytes", "rows", "stamps", "start")

    def __init__(self) -> None:
        self.stamps = array("q")
        self.rows = array("i")
        self.start = 0
        self.members = 0
        self.nbytes = 0

    def append(self, stamp: int, row: int) -> None:
        self.stamps.append(stamp)
        self.rows.append(row)

    def grown(self) -> bool:
        """Whether the log holds more than twice its members (plus some): time to compact it."""
        return len(self.rows) > 2 * self.members + 1024

    def live(self, rec: Records) -> Iterator[int]:
        """Rows in order, least recently used first. Entries of no member at the head of the log
        are skipped for good (evictions take from the head: the next walk starts past them)."""
        lru, stamps = rec.r_lru, rec.r_stamp
        log_stamps, log_rows = self.stamps, self.rows
        head, end = self.start, len(log_rows)
        while head < end and not (lru[log_rows[head]] and stamps[log_rows[head]] == log_stamps[head]):
            head += 1
        self.start = head
        for i in range(head, end):
            row = log_rows[i]
            if lru[row] and stamps[row] == log_stamps[i]:
                yield row

    def compact(self, rec: Records) -> None:
        """Keep only the members' current entries, in order (column-wise: the log can hold millions)."""
        rows = np.frombuffer(self.rows, np.int32)[self.start :]
        stamps = np.frombuffer(self.stamps, np.int64)[self.start :]
        keep = (gather(rec.r_lru, rows) == 1) & (gather(rec.r_stamp, rows) == stamps)
        kept_rows, kept_stamps = rows[keep].tobytes(), stamps[keep].tobytes()
        del rows, stamps  # the views of the old log go before it does
        self.rows, self.stamps = array("i"), array("q")
        self.rows.frombytes(kept_rows)
        self.stamps.frombytes(kept_stamps)
        self.start = 0


class TierLRU:
    """One node's tier: its READY replicas of committed keys in least-recently-used order.

    Order contract (that of :class:`kvstore.lru.LRU`): iteration and :meth:`victims` go from the
    least recently used key to the most; :meth:`insert_row` and :meth:`touch_row` make a key the
    most recent. Pinned keys (:meth:`Records.is_pinned`, set at the put and never changed) are members
    kept apart, in :attr:`_pinned`, never in a recency log: nothing ever evicts them, so
    :meth:`victims` never walks past them (a node full of pins used to cost a scan of every pin per
    key put), and iteration gives them last, in no order. Leases are the table's
    (:class:`~kvstore.placement.leases.Leases`), passed in as ``skip``.

    Each owner (a tenant, :meth:`Records.intern_owner`; 0 for keys of none) has a log of its own, so
    that :meth:`victims` of one owner walks only that owner's keys (a tenant's put evicts only its
    own blocks, however many of other tenants' come before them); the whole tier's order merges
    the logs by stamp. A table without owners has one log, as before.
    """

    __slots__ = ("_len", "_logs", "_pinned", "_rec", "node", "num_pinned", "tier", "total_bytes")

    def __init__(self, records: Records, node: int, tier: int) -> None:
        self._rec = records
        self.node = node
        self.tier = tier
        self._logs: dict[int, _Log] = {0: _Log()}
        """Owner -> its log."""
        self._len = 0
        self.total_bytes = 0
        self.num_pinned = 0
        self._pinned: set[int] = set()
        """Rows of pinned members (not in a log)."""

    def __len__(self) -> int:
        return self._len

    def _log(self, owner: int) -> _Log:
        log = self._logs.get(owner)
        if log is None:
            log = self._logs[owner] = _Log()
        return log

    def _logged(self, log: _Log, stamps: Any, rows: Any, members: int, nbytes: int = 0) -> None:
        """Append (stamp, row) entries to ``log``, ``members`` of them new members of ``nbytes``."""
        log.stamps.extend(stamps)
        log.rows.extend(rows)
        log.members += members
        log.nbytes += nbytes
        if log.grown():
            log.compact(self._rec)  # removals leave entries behind as touches do

    def _one_owner(self, rows: list[int]) -> int:
        """The owner of every one of ``rows``, or -1 when they have several (a request's keys are
        usually one tenant's)."""
        owner, slots = self._rec.owner, self._rec.r_slot
        who = owner[slots[rows[0]]] if rows else 0
        for row in rows:
            if owner[slots[row]] != who:
                return -1
        return who

    def _by_owner(self, stamped: list[tuple[int, int]], new: bool) -> None:
        """Append (stamp, row) entries, each to its row's owner's log."""
        owner, slots, size = self._rec.owner, self._rec.r_slot, self._rec.size
        groups: dict[int, list[tuple[int, int]]] = {}
        for entry in stamped:
            groups.setdefault(owner[slots[entry[1]]], []).append(entry)
        for who, entries in groups.items():
            rows = [r for _, r in entries]
            nbytes = sum(size[slots[r]] for r in rows) if new else 0
            self._logged(self._log(who), [s for s, _ in entries], rows, len(rows) if new else 0, nbytes)

    def _tell(self, joined: bool, slots: Iterable[int]) -> None:
        """Note for :attr:`Records.events` that the keys in ``slots`` joined (or left) this LRU."""
        rec = self._rec
        keys, node, tier = rec.keys, self.node, self.tier
        rec.events.extend((joined, node, tier, keys[s]) for s in slots)  # type: ignore[union-attr,misc]

    # -- by row: the table's hot paths -----------------------------------------------------------
    def insert_row(self, row: int) -> None:
        """Add the replica in ``row`` (of this node and tier, in no LRU) as the most recently used."""
        rec = self._rec
        assert not rec.r_lru[row] and rec.r_node[row] == self.node and rec.r_tier[row] == self.tier
        slot = rec.r_slot[row]
        rec.stamp += 1
        rec.r_stamp[row] = rec.stamp
        rec.r_lru[row] = 1
        self._len += 1
        self.total_bytes += rec.size[slot]
        if rec.events is not None:
            rec.events.append((True, self.node, self.tier, rec.keys[slot]))  # type: ignore[arg-type]
        if rec._state[slot] & _PINNED:
            self.num_pinned += 1
            self._pinned.add(row)
            return
        log = self._log(rec.owner[slot])
        log.append(rec.stamp, row)
        log.members += 1
        log.nbytes += rec.size[slot]
        if log.grown():
            log.compact(rec)

    def insert_rows(self, rows: list[int]) -> None:
        """:meth:`insert_row` of each of ``rows``, in order."""
        rec = self._rec
        r_stamp, r_lru, r_slot, size, state = rec.r_stamp, rec.r_lru, rec.r_slot, rec.size, rec._state
        first = rec.stamp + 1
        rec.stamp += len(rows)
        total = 0
        pinned: list[int] = []
        for stamp, row in enumerate(rows, first):
            assert not r_lru[row]
            r_stamp[row] = stamp
            r_lru[row] = 1
            slot = r_slot[row]
            total += size[slot]
            if state[slot] & _PINNED:
                pinned.append(row)
        self._len += len(rows)
        self.total_bytes += total
        self.num_pinned += len(pinned)
        if rec.events is not None:
            self._tell(True, [r_slot[row] for row in rows])
        if pinned:
            self._pinned.update(pinned)
            kept = set(pinned)
            self._by_owner([(s, r) for s, r in enumerate(rows, first) if r not in kept], new=True)
        elif (who := self._one_owner(rows) if rec.owners_used else 0) >= 0:
            self._logged(self._log(who), range(first, first + len(rows)), rows, len(rows), total)
        else:
            self._by_owner(list(enumerate(rows, first)), new=True)

    def touch_rows(self, rows: list[int]) -> None:
        """:meth:`touch_row` of each of ``rows`` (all in this LRU), in order."""
        rec = self._rec
        if self._pinned:
            rows = [r for r in rows if r not in self._pinned]  # pins have no recency to keep
        r_stamp = rec.r_stamp
        first = rec.stamp + 1
        rec.stamp += len(rows)
        for stamp, row in enumerate(rows, first):
            r_stamp[row] = stamp
        who = self._one_owner(rows) if rec.owners_used else 0
        if who >= 0:
            self._logged(self._log(who), range(first, first + len(rows)), rows, 0)
        else:
            self._by_owner(list(enumerate(rows, first)), new=False)

    def insert_run(self, rows: np.ndarray[Any, Any]) -> None:
        """:meth:`insert_rows` of distinct ``rows`` (an index array), column-wise."""
        rec = self._rec
        n = len(rows)
        first = rec.stamp + 1
        rec.stamp += n
        stamps = np.arange(first, first + n, dtype=np.int64)
        scatter(rec.r_stamp, rows, stamps)
        scatter(rec.r_lru, rows, 1)
        slots = gather(rec.r_slot, rows)
        if rec.events is not None:
            self._tell(True, slots.tolist())
        pinned = (gather(rec._state, slots) & _PINNED) != 0
        self._len += n
        self.total_bytes += int(gather(rec.size, slots).sum())
        self.num_pinned += int(np.count_nonzero(pinned))
        if pinned.any():
            self._pinned.update(rows[pinned].tolist())
            rows, stamps, slots = rows[~pinned], stamps[~pinned], slots[~pinned]
        if not rec.owners_used:
            self._logged_run(self._logs[0], stamps, rows, slots)
            return
        owners = gather(rec.owner, slots)
        first = int(owners[0]) if len(owners) else 0
        if not (owners != first).any():  # one owner (a request's keys are its tenant's): no sort
            self._logged_run(self._log(first), stamps, rows, slots)
            return
        for who in set(owners.tolist()):
            at = owners == who
            self._logged_run(self._log(who), stamps[at], rows[at], slots[at])

    def _logged_run(
        self, log: _Log, stamps: np.ndarray[Any, Any], rows: np.ndarray[Any, Any], slots: np.ndarray[Any, Any]
    ) -> None:
        """Append new members (index arrays of stamps, rows and their slots) to ``log``."""
        log.stamps.frombytes(stamps.astype(np.int64).tobytes())
        log.rows.frombytes(rows.astype(np.int32).tobytes())
        log.members += len(rows)
        log.nbytes += int(gather(self._rec.size, slots).sum())
        if log.grown():
            log.compact(self._rec)

    def touch_row(self, row: int) -> None:
        """Make the replica in ``row`` the most recently used, if it is in this LRU."""
        rec = self._rec
        if not rec.r_lru[row] or row in self._pinned:
            return
        rec.stamp += 1
        rec.r_stamp[row] = rec.stamp
        log = self._log(rec.owner[rec.r_slot[row]])
        log.append(rec.stamp, row)
        if log.grown():
            log.compact(rec)

    def remove_row(self, row: int) -> bool:
        """Take the replica in ``row`` out of this LRU; whether it was in it."""
        rec = self._rec
        if not rec.r_lru[row]:
            return False
        rec.r_lru[row] = 0
        slot = rec.r_slot[row]
        if rec.events is not None:
            self._tell(False, (slot,))
        self._len -= 1
        self.total_bytes -= rec.size[slot]
        if rec._state[slot] & _PINNED:
            self.num_pinned -= 1
            self._pinned.discard(row)
        else:
            log = self._logs[rec.owner[slot]]
            log.members -= 1
            log.nbytes -= rec.size[slot]
        return True

    def _live(self, owner: int | None = None) -> Iterator[int]:
        """Rows of unpinned members, least recently used first: of ``owner`` only, or of all."""
        rec = self._rec
        if owner is not None:
            log = self._logs.get(owner)
            return log.live(rec) if log is not None else iter(())
        logs = [log for log in self._logs.values() if log.members]
        if len(logs) == 1:
            return logs[0].live(rec)
        stamps = rec.r_stamp
        return heapq.merge(*(log.live(rec) for log in logs), key=stamps.__getitem__)

    # -- by key: policies, operators and tests ---------------------------------------------------
    def row_of(self, key: object) -> int:
        """The row of ``key``'s replica in this LRU; -1 when it is not in it."""
        rec = self._rec
        slot = rec.index.get(key)  # type: ignore[call-overload]
        if slot is None:
            return -1
        row = rec.row_on(slot, self.node)
        return row if row >= 0 and rec.r_lru[row] and rec.r_tier[row] == self.tier else -1

    def __contains__(self, key: object) -> bool:
        return self.row_of(key) >= 0

    def __iter__(self) -> Iterator[str]:
        keys, slots = self._rec.keys, self._rec.r_slot
        for row in itertools.chain(list(self._live()), list(self._pinned)):
            key = keys[slots[row]]
            assert key is not None
            yield key

    def remove(self, key: str) -> int:
        """Forget ``key``; its size. Raises :class:`NotFound` if absent."""
        row = self.row_of(key)
        if row < 0:
            raise NotFound(f"key {key!r} is not in this LRU")
        self.remove_row(row)
        return self._rec.size[self._rec.r_slot[row]]

    def of(self, owner: int) -> OwnerVictims:
        """The victims of ``owner`` alone, as a policy reads an LRU (:class:`kvstore.policy.Victims`)."""
        return OwnerVictims(self, owner)

    def share(self, owner: int) -> tuple[float, float]:
        """``owner``'s part of this tier's evictable (unpinned) members: (of their bytes, of their count)."""
        log = self._logs.get(owner)
        if log is None or not log.members:
            return 0.0, 0.0
        members = self._len - self.num_pinned
        nbytes = sum(other.nbytes for other in self._logs.values())
        return log.nbytes / max(1, nbytes), log.members / max(1, members)

    def is_pinned(self, key: str) -> bool:
        row = self.row_of(key)
        return row >= 0 and bool(self._rec._state[self._rec.r_slot[row]] & _PINNED)

    def victims(self, skip: Collection[str] = (), owner: int | None = None) -> Iterator[tuple[str, int]]:
        """(key, size) of evictable keys, least recently used first: neither pinned nor in ``skip``;
        with ``owner``, only that owner's (:meth:`Records.intern_owner`), walking no other's.
        Do not change the LRU while iterating."""
        rec = self._rec
        keys, sizes, state, slots = rec.keys, rec.size, rec._state, rec.r_slot
        for row in self._live(owner):
            slot = slots[row]
            key = keys[slot]
            assert key is not None
            if not state[slot] & _PINNED and key not in skip:
                yield key, sizes[slot]

    def check(self) -> None:
        """Assert that the log holds each member once, in stamp order, and that the counts agree."""
        rec = self._rec
        logged = list(self._live())
        stamps = [rec.r_stamp[r] for r in logged]
        assert stamps == sorted(stamps), "an LRU's log is out of order"
        for who, log in self._logs.items():
            mine = list(log.live(rec))
            assert len(mine) == log.members, "an owner's log lost count of its members"
            assert log.nbytes == sum(rec.size[rec.r_slot[r]] for r in mine), "an owner's log lost count of its bytes"
            assert all(rec.owner[rec.r_slot[r]] == who for r in mine), "a row in another owner's log"
        assert not any(rec._state[rec.r_slot[r]] & _PINNED for r in logged), "a pinned member is in the log"
        assert all(rec.r_lru[r] and rec._state[rec.r_slot[r]] & _PINNED for r in self._pinned), "a pin drifted"
        rows = logged + list(self._pinned)
        assert len(rows) == len(set(rows)) == self._len, "an LRU's count drifted"
        members = {
            r for r in range(len(rec.r_slot))
            if rec.r_slot[r] >= 0 and rec.r_lru[r] and rec.r_node[r] == self.node and rec.r_tier[r] == self.tier
        }  # fmt: skip
        assert members == set(rows), "an LRU member is missing from its log"
        assert self.total_bytes == sum(rec.size[rec.r_slot[r]] for r in rows), "an LRU's bytes drifted"
        assert self.num_pinned == sum(1 for r in rows if rec._state[rec.r_slot[r]] & _PINNED)


class OwnerVictims:
    """One owner's evictable keys of a :class:`TierLRU` (:meth:`TierLRU.of`)."""

    __slots__ = ("lru", "owner")

    def __init__(self, lru: TierLRU, owner: int) -> None:
        self.lru = lru
        self.owner = owner

    def victims(self, skip: Collection[str] = ()) -> Iterator[tuple[str, int]]:
        return self.lru.victims(skip, owner=self.owner)
