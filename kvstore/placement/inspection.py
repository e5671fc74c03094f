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

from kvstore.keys import validate_key
from kvstore.placement.state import DRAM, DROPPING, READY, SSD, Catalog, NodeState, owner_of


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
        state = "removing" if entry.removing else "committed" if entry.committed else "writing"
        return {"key": entry.key, "size": entry.size, "checksum": entry.checksum, "pinned": entry.pinned,
                "state": state, "replicas": replicas}  # fmt: skip

    def stored_keys(self, prefix: str) -> list[str]:
        return [k for k, e in self.catalog.objects.items() if k.startswith(prefix) and not e.removing]

    def keys_page(self, prefix: str, after: str | None, limit: int) -> tuple[list[str], str | None]:
        """Stored keys starting with ``prefix``, in order, after ``after``: one page and the next page's cursor."""
        # One pass, keeping the smallest limit + 1 (no sort of every key: the event loop is shared).
        floor = after if after is not None else ""
        objects = self.catalog.objects
        candidates = (k for k, e in objects.items() if k > floor and k.startswith(prefix) and not e.removing)
        page = heapq.nsmallest(limit + 1, candidates)
        return page[:limit], (page[limit - 1] if len(page) > limit else None)

    def blocks_on(self, node_id: str) -> int:
        """Blocks (stored or being written) with a replica on ``node_id``."""
        cat = self.catalog
        return sum(
            1 for store in (cat.objects, cat.pending) for e in store.values()
            if any(r.node_id == node_id for r in e.replicas)
        )  # fmt: skip

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
        cat.leases.check()
        usage: Counter[str] = Counter()
        for store in (cat.objects, cat.pending):
            for e in store.values():
                usage[owner_of(e.key)] += e.size
        assert +usage == cat.usage, f"usage drifted: {dict(cat.usage)} != {dict(usage)}"
        owned = {o: {k for s in (cat.objects, cat.pending) for k in s if owner_of(k) == o} for o in usage if o}
        assert owned == cat.owned if cat.keys_by_owner else not cat.owned, "the keys by owner drifted"
        for store in (cat.objects, cat.pending):
            for e in store.values():
                assert len({r.node_id for r in e.replicas}) == len(e.replicas), f"{e.key}: two replicas on a node"
        for node in cat.nodes.values():
            node.alloc.check()
            extents = sorted(
                [
                    (r.extent.offset, r.extent.length)
                    for store in (cat.objects, cat.pending)
                    for e in store.values()
                    for r in e.replicas
                    if r.node_id == node.node_id and r.extent is not None
                ]
                + [(p.offset, p.length) for g in cat.grants.values() if g.node_id == node.node_id for p in g.pieces]
            )
            assert extents == sorted(node.alloc._allocated.items()), f"{node.node_id}: extents drifted"
            for tier in (DRAM, SSD):
                for key in node.lru(tier):
                    entry = cat.objects[key]
                    assert entry.committed and not entry.removing, f"{key} in an LRU while not readable"
                    assert any(
                        r.node_id == node.node_id and r.tier is tier and r.status is READY for r in entry.replicas
                    )
            ssd_bytes = sum(
                e.size for e in cat.objects.values() for r in e.replicas if r.node_id == node.node_id and r.tier is SSD
            )
            assert ssd_bytes == node.ssd_used, f"{node.node_id}: ssd_used {node.ssd_used} != {ssd_bytes}"
