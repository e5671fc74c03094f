"""Reads: where keys are, read leases, and reads that daemons served on their own.

- ``get_replicas`` hands out replicas on up nodes only, touches their LRU and
  leases them for ``lease_ms`` (one lease per key and get, owned by
  :class:`~kvstore.placement.leases.Leases`): a leased replica is never
  evicted, demoted or promoted. A release ends one lease, never another
  reader's (see :mod:`kvstore.placement.leases`). An SSD-only block read
  ``promote_after_hits`` times is promoted to DRAM once its leases end.
  A block whose replicas are all mid-move (a demotion, promotion or drop in
  flight) is still a hit: its replicas come without an extent, so the reader
  asks the daemon by key (it copies from whichever tier holds the block under
  its lock; a move that failed and dropped it makes that read a miss), under
  a lease of no replica, which keeps the reply's lease ids one per hit.
- ``record_access`` counts reads a daemon served by key without the master
  (the one-trip read path) and touches the LRU as ``get_replicas`` does. Each
  counts in the tier it was read from: a report can come after a demotion,
  and a DRAM read must not then count as an SSD hit that promotes it back.
- Holds (Mooncake's "KV lease", off unless ``hold_ms`` > 0): a key found by a
  get, an exists or a daemon's access report is held for ``hold_ms`` — a lease
  the reader does not release, so it is neither evicted nor demoted meanwhile,
  and ``held`` tells a remove (without force) to leave it. One hold per key:
  a later read replaces it. A read served by a daemon alone holds the key from
  when its report arrives.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey, validate_keys
from kvstore.placement.leases import Holder, LeaseId
from kvstore.placement.records import S_COPYING, S_READY, T_DRAM, T_SSD, TierLRU
from kvstore.placement.state import DRAM, SSD, Catalog, NodeCommand, ObjectEntry, ReplicaState
from kvstore.placement.tiering import Tiering
from kvstore.policy import EvictionPolicy
from kvstore.results import NodePrefix, PrefixMatch, ReplicaLookup

_DRAM_NAME, _SSD_NAME = DRAM.value, SSD.value
"""Each tier's name, as a reply carries it (an Enum's ``value`` is a Python-level property)."""


class Reads:
    """Answers lookups from the catalog; changes only LRU order, hit counts, leases and wanted promotions."""

    def __init__(
        self, catalog: Catalog, tiering: Tiering, policy: EvictionPolicy, *, lease_ms: int, hold_ms: int = 0
    ) -> None:
        self.catalog = catalog
        self.tiering = tiering
        self.policy = policy
        self.lease_ms = lease_ms
        self.hold_ms = hold_ms

    def get_replicas(self, keys: Sequence[str], now_ms: int, lease: bool = True) -> ReplicaLookup:
        """Readable replicas of each key (DRAM first), leased for ``lease_ms`` when ``lease``; a miss
        has size -1. (A reader through the daemon needs no lease: the daemon copies under its lock.)

        Built flat, as the wire form is, from the records' columns: this is the hottest call of the master.
        """
        cat = self.catalog
        rec = cat.rec
        head, nxt, ssd_hits = rec.head, rec.r_next, rec.ssd_hits
        r_node, r_tier, r_status, r_offset = rec.r_node, rec.r_tier, rec.r_status, rec.r_offset
        node_at, holders_of = cat.node_at, cat.holders
        keys = validate_keys(keys)  # every key, before any is touched or counted
        served = rec.served_slots(keys)
        run = self._get_run(keys, served, now_ms, lease)
        if run is not None:
            return run
        # One get's leases are consecutive ids: the reply names the first, the reader releases them.
        first = cat.leases.next_id if lease else 0
        reply = ReplicaLookup(lease_ms=self.lease_ms, first_lease=first)
        sizes, checksums, counts = reply.sizes, reply.checksums, reply.counts
        r_nodes, r_addresses, r_tiers, r_offsets = reply.nodes, reply.addresses, reply.tiers, reply.offsets
        counters = cat.counters
        leased: list[str] = []
        holders: list[tuple[Holder, ...]] = []
        held: list[int] = []
        hits = dram_hits = bytes_read = misses = 0
        hold = self.hold_ms
        last_use, in_lru, size_of, checksum_of = rec.last_use, rec.r_lru, rec.size, rec.checksum
        clock = cat.clock
        # Touches of one-replica keys, in order, one append per run of the same LRU (a get's keys
        # are usually on one node); flushed before any other touch, so that each LRU sees the keys
        # in the order they were read.
        lru: TierLRU | None = None
        rows: list[int] = []
        for key, slot in zip(keys, served, strict=True):
            if slot is None:
                misses += 1
                sizes.append(-1)
                checksums.append(0)
                counts.append(0)
                continue
            row = head[slot]
            if nxt[row] < 0 and not r_status[row] and not r_tier[row] and in_lru[row]:
                node = node_at[r_node[row]]
                if node is not None and node.up:
                    # The common case, inline: one replica, READY in DRAM where the table says.
                    clock += 1
                    last_use[slot] = clock
                    if node.dram_lru is not lru:
                        if lru is not None:
                            lru.touch_rows(rows)
                        lru, rows = node.dram_lru, []
                    rows.append(row)
                    hits += 1
                    if hold:
                        held.append(slot)
                    if lease:
                        leased.append(key)
                        holders.append(holders_of[node.idx][0])
                    r_nodes.append(node.node_id)
                    r_addresses.append(node.address)
                    r_tiers.append(_DRAM_NAME)
                    r_offsets.append(r_offset[row])
                    size = size_of[slot]
                    sizes.append(size)
                    checksums.append(checksum_of[slot])
                    counts.append(1)
                    bytes_read += size
                    dram_hits += 1
                    continue
            # Anything else (replicas on several nodes, on SSD, mid-move, on a down node): the
            # touches so far first, then this key's, in order.
            if lru is not None:
                lru.touch_rows(rows)
                lru, rows = None, []
            cat.clock = clock
            readable = self._readable(slot)
            if not readable:
                moving = cat.in_motion(ObjectEntry(rec, slot))
                if moving:
                    self._by_key(reply, slot, moving)  # mid-move: read through its daemon, by key
                    if lease:  # a lease of no replica: the reply's lease ids stay consecutive, one per hit
                        leased.append(key)
                        holders.append(())
                    if hold:
                        held.append(slot)
                else:
                    misses += 1
                    sizes.append(-1)
                    checksums.append(0)
                    counts.append(0)
                continue
            cat.touch(slot)
            clock = cat.clock
            hits += 1
            if hold:
                held.append(slot)
            if lease:
                leased.append(key)
                holders.append(tuple([holders_of[r_node[r]][1][r_tier[r]] for r in readable]))
            for r in readable:
                node = node_at[r_node[r]]
                assert node is not None
                r_nodes.append(node.node_id)
                r_addresses.append(node.address)
                if r_tier[r]:
                    r_tiers.append(_SSD_NAME)
                    r_offsets.append(-1)
                else:
                    r_tiers.append(_DRAM_NAME)
                    r_offsets.append(r_offset[r])
            size = size_of[slot]
            sizes.append(size)
            checksums.append(checksum_of[slot])
            counts.append(len(readable))
            bytes_read += size
            if not r_tier[readable[0]]:
                dram_hits += 1
            else:
                counters["ssd_hits"] += 1
                ssd_hits[slot] = n = min(ssd_hits[slot] + 1, 0xFFFFFFFF)
                if self.policy.should_promote(n):
                    cat.want_promote.add(key)
        cat.clock = clock
        if lru is not None:
            lru.touch_rows(rows)
        counters["gets"] += len(keys)
        counters["misses"] += misses
        counters["hits"] += hits
        counters["dram_hits"] += dram_hits
        counters["bytes_read"] += bytes_read
        if leased:
            cat.leases.grant_many(leased, holders, now_ms + self.lease_ms)
        if held:
            self._hold(held, now_ms)  # after the reader's own leases, whose ids must be consecutive
        return reply

    def _get_run(self, keys: list[BlockKey], slots: list[int | None], now_ms: int, lease: bool) -> ReplicaLookup | None:
        """:meth:`get_replicas` of a batch whose keys (in service at ``slots``: :meth:`Records.served_slots`)
        are each stored once, READY in the DRAM of one node that is up (a prefix read back, the
        common case): checked first, changing nothing, then answered column by column. None for
        any other batch: it goes key by key."""
        cat = self.catalog
        rec = cat.rec
        if not slots or None in slots:
            return None
        nxt, r_node, r_status, r_tier, in_lru = rec.r_next, rec.r_node, rec.r_status, rec.r_tier, rec.r_lru
        rows = list(map(rec.head.__getitem__, slots))  # type: ignore[arg-type]
        idx = r_node[rows[0]]
        for row in rows:
            if nxt[row] >= 0 or r_status[row] or r_tier[row] or not in_lru[row] or r_node[row] != idx:
                return None
        node = cat.node_at[idx]
        if node is None or not node.up:
            return None
        n = len(slots)
        first = cat.leases.next_id if lease else 0
        last_use, start = rec.last_use, cat.clock + 1
        for clock, slot in enumerate(slots, start):
            last_use[slot] = clock  # type: ignore[index]
        cat.clock = start + n - 1
        node.dram_lru.touch_rows(rows)
        sizes = list(map(rec.size.__getitem__, slots))  # type: ignore[arg-type]
        reply = ReplicaLookup(
            sizes, list(map(rec.checksum.__getitem__, slots)), [1] * n, [node.node_id] * n,  # type: ignore[arg-type]
            [node.address] * n, [_DRAM_NAME] * n, list(map(rec.r_offset.__getitem__, rows)), self.lease_ms, first,
        )  # fmt: skip
        counters = cat.counters
        counters["gets"] += n
        counters["hits"] += n
        counters["dram_hits"] += n
        counters["bytes_read"] += sum(sizes)
        if lease:
            cat.leases.grant_many(list[str](keys), [cat.holders[idx][0]] * n, now_ms + self.lease_ms)
        if self.hold_ms:
            self._hold(slots, now_ms)  # type: ignore[arg-type]
        return reply

    def _readable(self, slot: int) -> list[int]:
        """Rows of the committed key's READY replicas on up nodes, DRAM first."""
        rec, node_at = self.catalog.rec, self.catalog.node_at
        out = []
        for row in rec.rows(slot):
            node = node_at[rec.r_node[row]]
            if rec.r_status[row] == S_READY and node is not None and node.up:
                out.append(row)
        if len(out) > 1:
            out.sort(key=rec.r_tier.__getitem__)
        return out

    def _by_key(self, reply: ReplicaLookup, slot: int, moving: list[ReplicaState]) -> None:
        """Answer a hit on a block whose replicas are all mid-move: as replicas with no extent (a
        reader then asks the daemon for the key, and it copies from whichever tier holds it under
        its lock), unleased (a lease could not stop a move under way)."""
        cat = self.catalog
        for r in moving:
            reply.nodes.append(r.node_id)
            reply.addresses.append(cat.nodes[r.node_id].address)
            reply.tiers.append(SSD.value)  # no extent to read: by key, through the daemon
            reply.offsets.append(-1)
        size = cat.rec.size[slot]
        reply.sizes.append(size)
        reply.checksums.append(cat.rec.checksum[slot])
        reply.counts.append(len(moving))
        counters = cat.counters
        counters["hits"] += 1
        counters["ssd_hits"] += 1  # read by key through the daemon, as an SSD block is
        counters["bytes_read"] += size

    def _hold(self, slots: Iterable[int], now_ms: int) -> None:
        """Hold each key for ``hold_ms`` from ``now_ms``: its readable replicas, under a lease of
        its own that replaces the key's earlier hold."""
        cat = self.catalog
        rec, leases = cat.rec, cat.leases
        until = now_ms + self.hold_ms
        unique = list(dict.fromkeys(slots))  # a key read twice in one call: one hold
        for slot in unique:
            old = rec.holds.get(slot)
            if old is not None:
                leases.release(LeaseId(old[0]))
        holders = [
            tuple([(r.node_id, r.tier) for r in cat.readable(ObjectEntry(rec, slot))]) for slot in unique
        ]  # fmt: skip
        keys = [rec.keys[slot] or "" for slot in unique]
        first = leases.grant_many(keys, holders, until)
        for i, slot in enumerate(unique):
            rec.holds[slot] = (first + i, until)

    def held(self, keys: Sequence[str], now_ms: int) -> list[int]:
        """Indexes of the keys held at ``now_ms`` (read within ``hold_ms``): a remove without force leaves them."""
        rec = self.catalog.rec
        out = []
        for i, slot in enumerate(rec.served_slots(keys)):
            if slot is None:
                continue
            if rec.holds.get(slot, (0, 0))[1] > now_ms:
                out.append(i)
        return out

    def removing(self, keys: Iterable[str]) -> list[str]:
        """Of ``keys``, those a remove took out of service whose drops are not all confirmed yet (the
        master's commands know of drops planned for keys the table has forgotten already)."""
        rec = self.catalog.rec
        return [k for k in keys if (slot := rec.index.get(k)) is not None and rec.is_removing(slot)]

    def release_leases(self, lease_ids: Iterable[int]) -> list[NodeCommand]:
        """A reader is done with these leases (ids from its gets' replies); one that ended already
        (expired) is skipped. Returns promotions now due."""
        self.catalog.leases.release_many(lease_ids)
        return self.tiering.plan_promotions() if self.catalog.want_promote else []

    def record_access(self, node_id: str, keys: Sequence[str], tiers: Sequence[str], now_ms: int = 0) -> None:
        """Count reads ``node_id``'s daemon served by key (no master round trip) from ``tiers`` and
        touch their LRU (and hold them, with ``hold_ms`` and ``now_ms``). A hit counts in the tier it
        was read from, which the block may have left since: only a read from SSD counts towards
        promoting a block that is on SSD still."""
        if len(keys) != len(tiers):
            raise InvalidArgument(f"an access report of {len(keys)} keys with {len(tiers)} tiers")
        cat = self.catalog
        rec = cat.rec
        idx = rec.node_index.get(node_id)
        if idx is None:
            return
        counters = cat.counters
        held: list[int] = []
        for key, slot, served in zip(keys, rec.served_slots(keys), tiers, strict=True):
            if slot is None:
                continue
            row = rec.row_on(slot, idx)
            if row < 0 or rec.r_status[row] != S_READY:
                continue
            size = rec.size[slot]
            counters["gets"] += 1
            counters["hits"] += 1
            counters["bytes_read"] += size
            cat.touch(slot)
            if self.hold_ms and now_ms:
                held.append(slot)
            if served != SSD.value:
                counters["dram_hits"] += 1
            else:
                counters["ssd_hits"] += 1
                if rec.r_tier[row] == T_SSD:
                    rec.ssd_hits[slot] = n = min(rec.ssd_hits[slot] + 1, 0xFFFFFFFF)
                    if self.policy.should_promote(n) and all(rec.r_tier[r] == T_SSD for r in rec.rows(slot)):
                        cat.want_promote.add(key)
        if held:
            self._hold(held, now_ms)

    def match_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys are committed and readable (a block between tiers included, as a
        get reads it through its daemon; not one being dropped)."""
        rec, node_at = self.catalog.rec, self.catalog.node_at
        index, found = rec.index, rec.is_found
        for i, key in enumerate(keys):
            slot = index.get(key)
            if slot is None or not found(slot, node_at):
                return i
        return len(keys)

    def match_prefix_nodes(self, keys: Sequence[str]) -> PrefixMatch:
        """The longest readable prefix of ``keys`` (as :meth:`match_prefix`) and, per node holding
        the first key, how many leading keys it holds readable: in any tier, and in DRAM (a block
        between tiers counts in any tier only: it may be on its way out of DRAM).

        One pass, O(keys x replicas): a node's count grows only while it equals the index of the
        key at hand, so a node that missed a key stops; the pass ends at the first key no node
        can serve, where every count has stopped too.
        """
        cat = self.catalog
        rec, node_at = cat.rec, cat.node_at
        index, in_service, rows_of, r_status, r_node, r_tier = (
            rec.index, rec.in_service, rec.rows, rec.r_status, rec.r_node, rec.r_tier,
        )  # fmt: skip
        total: dict[str, int] = {}
        dram: dict[str, int] = {}
        longest = len(keys)
        for i, key in enumerate(keys):
            slot = index.get(key)
            if slot is None or not in_service(slot):
                longest = i
                break
            readable = False
            for row in rows_of(slot):
                status = r_status[row]
                node = node_at[r_node[row]]
                if status >= S_COPYING or node is None or not node.up:
                    continue
                readable = True
                node_id = node.node_id
                if total.get(node_id, 0) == i:
                    total[node_id] = i + 1
                    if r_tier[row] == T_DRAM and status == S_READY and dram.get(node_id, 0) == i:
                        dram[node_id] = i + 1
            if not readable:
                longest = i
                break
        return PrefixMatch(longest, {n: NodePrefix(dram.get(n, 0), t) for n, t in total.items()})

    def exists(self, keys: Sequence[str], now_ms: int = 0) -> list[bool]:
        """Whether each key is readable (and, with ``hold_ms`` and ``now_ms``, hold those that are)."""
        cat = self.catalog
        index, found, node_at = cat.rec.index, cat.rec.is_found, cat.node_at
        slots = [index.get(k) for k in validate_keys(keys)]
        out = [slot is not None and found(slot, node_at) for slot in slots]
        if self.hold_ms and now_ms:
            self._hold([s for s, ok in zip(slots, out, strict=True) if ok and s is not None], now_ms)
        return out
