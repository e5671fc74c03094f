"""What operators and tests read of the placement table: per-node usage, one key, pages of keys,
counters, and the table's invariants.

Invariants (:meth:`Inspection.check`): a committed, readable replica is in
exactly its node's tier LRU; each node's allocator holds exactly the extents of
that node's DRAM replicas (in whatever status) and the
pieces of its grants; no node holds two replicas of a block; a copy in flight
is not readable; SSD bytes add up; the leases agree with themselves.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterator

from kvstore.keys import validate_key
from kvstore.placement.records import S_READY, T_DRAM, T_SSD
from kvstore.placement.state import DRAM, DROPPING, READY, SSD, Catalog, NodeState, charged, owner_of


class Inspection:
    """Reads the catalog and changes nothing."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def tier_usage(self, node: NodeState) -> dict[str, dict[str, int]]:
        """Per tier: capacity (what it can hold now) and the configured one, used bytes, readable
        blocks, pinned and leased ones among them."""
        leases = self.catalog.leases
        out: dict[str, dict[str, int]] = {}
        ssd_configured = node.ssd_configured if node.ssd_configured >= 0 else node.ssd_capacity
        for tier, capacity, configured, used in (
            (DRAM, node.alloc.capacity, node.alloc.capacity, node.alloc.used),
            (SSD, node.ssd_capacity, ssd_configured, node.ssd_used),
        ):
            lru = node.lru(tier)
            out[tier.value] = {
                "capacity": capacity,
                "configured": configured,
                "used": used,
                "blocks": len(lru),
                "pinned": lru.num_pinned,
                "leased": sum(1 for key in leases.leased_keys(node.node_id, tier) if key in lru),
            }
        return out

    def describe(self, key: str) -> dict[str, object] | None:
        """What the table knows of one key (stored or being written); None when it knows nothing."""
        cat = self.catalog
        entry = cat.objects.get(validate_key(key)) or cat.pending.get(key)
        if entry is None:
            return None
        replicas = []
        for r in entry.replicas:
            node = cat.nodes.get(r.node_id)
            lru = node.lru(r.tier) if node is not None else None
            replicas.append({
                "node_id": r.node_id,
                "tier": r.tier.value,
                "offset": r.offset if r.tier is DRAM else -1,
                "status": r.status.value,
                "moving": r.status is not READY,
                "dropping": r.status is DROPPING,
                "leased": bool(lru is not None and key in lru and cat.leases.is_leased(r.node_id, r.tier, key)),
                "node_up": bool(node is not None and node.up),
            })  # fmt: skip
        state = cat.rec.phase(entry.slot)
        return {"key": entry.key, "size": entry.size, "checksum": entry.checksum, "write_id": entry.write_id,
                "pinned": entry.pinned, "state": state, "replicas": replicas}  # fmt: skip

    def _stored(self) -> Iterator[tuple[str, int]]:
        """(key, slot) of every stored key not being removed."""
        return self.catalog.rec.served_items()

    def num_objects(self) -> int:
        """Stored keys (committed, and being removed until their daemons confirm)."""
        return len(self.catalog.objects)

    def node_usage(self) -> list[dict[str, dict[str, int]]]:
        """:meth:`tier_usage` of every registered node."""
        return [self.tier_usage(n) for n in self.catalog.nodes.values()]

    def stored_keys(self, prefix: str) -> list[str]:
        """Every stored key (not being removed) that starts with ``prefix``, in no order."""
        return [k for k, _ in self._stored() if k.startswith(prefix)]

    def keys_page(self, prefix: str, after: str | None, limit: int) -> tuple[list[str], str | None]:
        """Stored keys starting with ``prefix``, in order, after ``after``: one page and the next page's cursor."""
        # One pass, keeping the smallest limit + 1 (no sort of every key: the event loop is shared).
        floor = after if after is not None else ""
        candidates = (k for k, _ in self._stored() if k > floor and k.startswith(prefix))
        page = heapq.nsmallest(limit + 1, candidates)
        return page[:limit], (page[limit - 1] if len(page) > limit else None)

    def blocks_on(self, node_id: str) -> int:
        """Blocks (stored or being written) with a replica on ``node_id``."""
        rec = self.catalog.rec
        idx = rec.node_index.get(node_id)
        return 0 if idx is None else sum(1 for slot in rec.index.values() if rec.row_on(slot, idx) >= 0)

    def stats(self) -> dict[str, int | float]:
        cat = self.catalog
        up = cat.up_nodes()
        out: dict[str, int | float] = dict(cat.counters)
        out.update(
            nodes=len(cat.nodes),
            nodes_up=len(up),
            objects=len(cat.objects),
            pending=len(cat.pending),
            dram_capacity=sum(n.alloc.capacity for n in cat.nodes.values()),
            dram_used=sum(n.alloc.used for n in cat.nodes.values()),
            ssd_capacity=sum(n.ssd_capacity for n in cat.nodes.values()),
            ssd_used=sum(n.ssd_used for n in cat.nodes.values()),
        )
        return out

    def check(self) -> None:
        """Assert the invariants of the module docstring (for tests)."""
        cat = self.catalog
        rec = cat.rec
        rec.check()
        cat.leases.check()
        usage: Counter[str] = Counter()
        for key, slot in rec.index.items():
            usage[owner_of(key)] += charged(rec.size[slot])
        assert +usage == cat.usage, f"usage drifted: {dict(cat.usage)} != {dict(usage)}"
        pins = Counter(owner_of(k) for k, slot in rec.index.items() if rec.is_pinned(slot))
        assert +pins == cat.pinned_keys, f"pins drifted: {dict(cat.pinned_keys)} != {dict(pins)}"
        owned = {o: {k for k in rec.index if owner_of(k) == o} for o in usage if o}
        assert owned == cat.owned if cat.keys_by_owner else not cat.owned, "the keys by owner drifted"
        for slot in rec.index.values():
            nodes = [rec.r_node[row] for row in rec.rows(slot)]
            assert nodes and len(set(nodes)) == len(nodes), f"{rec.keys[slot]}: no replica, or two on a node"
        assert cat.owed == Counter(k for n in cat.nodes.values() for k in n.owes), "owed drops miscounted"
        for node in cat.nodes.values():
            assert cat.node_at[node.idx] is node, f"{node.node_id}: interned under another index"
            rows = [r for r in range(len(rec.r_slot)) if rec.r_slot[r] >= 0 and rec.r_node[r] == node.idx]
            extents = [(rec.r_offset[r], rec.length(rec.r_slot[r], node.idx)) for r in rows if rec.r_offset[r] >= 0]
            extents += [
                (p.offset, p.length) for g in cat.grants.values() if g.node_id == node.node_id for p in g.pieces
            ]
            extents += list(node.quarantine.values()) + [e for _, e in node.parked]
            node.alloc.check(extents)
            held = {rec.keys[rec.r_slot[r]] for r in rows}
            assert held.isdisjoint(node.owes), f"{node.node_id}: owes the drop of a key placed on it"
            for tier, lru in ((T_DRAM, node.dram_lru), (T_SSD, node.ssd_lru)):
                lru.check()
                for r in rows:
                    readable = rec.in_service(rec.r_slot[r])
                    member = readable and rec.r_tier[r] == tier and rec.r_status[r] == S_READY
                    assert bool(rec.r_lru[r]) == member or rec.r_tier[r] != tier, (
                        f"{rec.keys[rec.r_slot[r]]}: in an LRU while not readable, or readable in none"
                    )
            ssd_bytes = sum(rec.size[rec.r_slot[r]] for r in rows if rec.r_tier[r] == T_SSD)
            assert ssd_bytes == node.ssd_used, f"{node.node_id}: ssd_used {node.ssd_used} != {ssd_bytes}"
        gone = [r for r in range(len(rec.r_slot)) if rec.r_slot[r] >= 0 and cat.node_at[rec.r_node[r]] is None]
        assert not gone, f"replicas on nodes that left: {gone[:4]}"
