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
from kvstore.keys import validate_keys
from kvstore.placement.leases import Holder, LeaseId
from kvstore.placement.results import NodePrefix, PrefixMatch, ReplicaLookup
from kvstore.placement.state import COPYING, DRAM, DROPPING, READY, SSD, Catalog, NodeCommand, ObjectEntry, ReplicaState
from kvstore.placement.tiering import Tiering
from kvstore.policy import EvictionPolicy, TierName

_TIER_NAMES = {tier: tier.value for tier in TierName}
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

        Built flat, as the wire form is: this is the hottest call of the master.
        """
        cat = self.catalog
        objects, nodes = cat.objects, cat.nodes
        keys = validate_keys(keys)  # every key, before any is touched or counted
        # One get's leases are consecutive ids: the reply names the first, the reader releases them.
        first = cat.leases.next_id if lease else 0
        reply = ReplicaLookup(lease_ms=self.lease_ms, first_lease=first)
        sizes, checksums, counts = reply.sizes, reply.checksums, reply.counts
        expiry = now_ms + self.lease_ms
        counters = cat.counters
        leased: list[str] = []
        holders: list[tuple[Holder, ...]] = []
        held: list[ObjectEntry] = []
        hits = dram_hits = bytes_read = 0
        readable: list[ReplicaState]
        for key in keys:
            entry = objects.get(key)
            if entry is None or entry.removing or not entry.committed:
                readable = []
            else:
                readable = [r for r in entry.replicas if r.status is READY and nodes[r.node_id].up]
            if entry is not None and not readable and (moving := cat.in_motion(entry)):
                self._by_key(reply, entry, moving)  # mid-move: read through its daemon, by key
                if lease:  # a lease of no replica: the reply's lease ids stay consecutive, one per hit
                    leased.append(key)
                    holders.append(())
                if self.hold_ms:
                    held.append(entry)
                continue
            if entry is None or not readable:
                counters["misses"] += 1
                sizes.append(-1)
                checksums.append(0)
                counts.append(0)
                continue
            hits += 1
            cat.touch(entry)
            if self.hold_ms:
                held.append(entry)
            if len(readable) > 1:
                readable.sort(key=lambda r: r.tier is not DRAM)
            if lease:
                leased.append(key)
                holders.append(tuple([(r.node_id, r.tier) for r in readable]))
            for r in readable:
                node = nodes[r.node_id]
                reply.nodes.append(r.node_id)
                reply.addresses.append(node.address)
                reply.tiers.append(_TIER_NAMES[r.tier])
                reply.offsets.append(r.offset if r.tier is DRAM else -1)
            sizes.append(entry.size)
            checksums.append(entry.checksum)
            counts.append(len(readable))
            bytes_read += entry.size
            if readable[0].tier is DRAM:
                dram_hits += 1
            else:
                counters["ssd_hits"] += 1
                entry.ssd_hits += 1
                if self.policy.should_promote(entry.ssd_hits):
                    cat.want_promote.add(key)
        counters["gets"] += len(keys)
        counters["hits"] += hits
        counters["dram_hits"] += dram_hits
        counters["bytes_read"] += bytes_read
        if leased:
            cat.leases.grant_many(leased, holders, expiry)
        if held:
            self._hold(held, now_ms)  # after the reader's own leases, whose ids must be consecutive
        return reply

    def _by_key(self, reply: ReplicaLookup, entry: ObjectEntry, moving: list[ReplicaState]) -> None:
        """Answer a hit on a block whose replicas are all mid-move: as replicas with no extent (a
        reader then asks the daemon for the key, and it copies from whichever tier holds it under
        its lock), unleased (a lease could not stop a move under way)."""
        cat = self.catalog
        for r in moving:
            reply.nodes.append(r.node_id)
            reply.addresses.append(cat.nodes[r.node_id].address)
            reply.tiers.append(SSD.value)  # no extent to read: by key, through the daemon
            reply.offsets.append(-1)
        reply.sizes.append(entry.size)
        reply.checksums.append(entry.checksum)
        reply.counts.append(len(moving))
        counters = cat.counters
        counters["hits"] += 1
        counters["ssd_hits"] += 1  # read by key through the daemon, as an SSD block is
        counters["bytes_read"] += entry.size

    def _hold(self, entries: Iterable[ObjectEntry], now_ms: int) -> None:
        """Hold each entry for ``hold_ms`` from ``now_ms``: its readable replicas, under a lease of
        its own that replaces the entry's earlier hold."""
        cat = self.catalog
        leases = cat.leases
        until = now_ms + self.hold_ms
        entries = list({id(e): e for e in entries}.values())  # a key read twice in one call: one hold
        for entry in entries:
            if entry.hold:
                leases.release(LeaseId(entry.hold))
        holders = [tuple([(r.node_id, r.tier) for r in cat.readable(entry)]) for entry in entries]
        first = leases.grant_many([entry.key for entry in entries], holders, until)
        for i, entry in enumerate(entries):
            entry.hold = first + i
            entry.held_until_ms = until

    def held(self, keys: Sequence[str], now_ms: int) -> list[int]:
        """Indexes of the keys held at ``now_ms`` (read within ``hold_ms``): a remove without force leaves them."""
        objects = self.catalog.objects
        return [
            i for i, key in enumerate(keys)
            if (entry := objects.get(key)) is not None and not entry.removing and entry.held_until_ms > now_ms
        ]  # fmt: skip

    def release_leases(self, lease_ids: Iterable[int]) -> list[NodeCommand]:
        """A reader is done with these leases (ids from its gets' replies); one that ended already
        (expired) is skipped. Returns promotions now due."""
        leases = self.catalog.leases
        for lease_id in lease_ids:
            leases.release(LeaseId(lease_id))
        return self.tiering.plan_promotions()

    def record_access(self, node_id: str, keys: Sequence[str], tiers: Sequence[str], now_ms: int = 0) -> None:
        """Count reads ``node_id``'s daemon served by key (no master round trip) from ``tiers`` and
        touch their LRU (and hold them, with ``hold_ms`` and ``now_ms``). A hit counts in the tier it
        was read from, which the block may have left since: only a read from SSD counts towards
        promoting a block that is on SSD still."""
        if len(keys) != len(tiers):
            raise InvalidArgument(f"an access report of {len(keys)} keys with {len(tiers)} tiers")
        cat = self.catalog
        counters = cat.counters
        held: list[ObjectEntry] = []
        for key, served in zip(keys, tiers, strict=True):
            entry = cat.objects.get(key)
            if entry is None or entry.removing or not entry.committed:
                continue
            replica = next((r for r in entry.replicas if r.node_id == node_id and r.status is READY), None)
            if replica is None:
                continue
            counters["gets"] += 1
            counters["hits"] += 1
            counters["bytes_read"] += entry.size
            cat.touch(entry)
            if self.hold_ms and now_ms:
                held.append(entry)
            if served != SSD.value:
                counters["dram_hits"] += 1
            else:
                counters["ssd_hits"] += 1
                if replica.tier is SSD:
                    entry.ssd_hits += 1
                    if self.policy.should_promote(entry.ssd_hits) and not any(r.tier is DRAM for r in entry.replicas):
                        cat.want_promote.add(key)
        if held:
            self._hold(held, now_ms)

    def match_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys are committed and readable (a block between tiers included, as a
        get reads it through its daemon; not one being dropped)."""
        objects, found = self.catalog.objects, self.catalog.found
        for i, key in enumerate(keys):
            if not found(objects.get(key)):
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
        objects, nodes = self.catalog.objects, self.catalog.nodes
        total: dict[str, int] = {}
        dram: dict[str, int] = {}
        longest = len(keys)
        for i, key in enumerate(keys):
            entry = objects.get(key)
            if entry is None or entry.removing or not entry.committed:
                longest = i
                break
            readable = False
            for r in entry.replicas:
                if r.status is COPYING or r.status is DROPPING or not nodes[r.node_id].up:
                    continue
                readable = True
                node_id = r.node_id
                if total.get(node_id, 0) == i:
                    total[node_id] = i + 1
                    if r.tier is DRAM and r.status is READY and dram.get(node_id, 0) == i:
                        dram[node_id] = i + 1
            if not readable:
                longest = i
                break
        return PrefixMatch(longest, {n: NodePrefix(dram.get(n, 0), t) for n, t in total.items()})

    def exists(self, keys: Sequence[str], now_ms: int = 0) -> list[bool]:
        """Whether each key is readable (and, with ``hold_ms`` and ``now_ms``, hold those that are)."""
        cat = self.catalog
        objects = cat.objects
        entries = [objects.get(k) for k in validate_keys(keys)]
        found = list(map(cat.found, entries))
        if self.hold_ms and now_ms:
            self._hold([e for e, ok in zip(entries, found, strict=True) if ok and e is not None], now_ms)
        return found
