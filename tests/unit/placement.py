"""Helpers for the placement table's unit tests: a table of empty nodes, puts that commit, and the
daemons' answers to its commands."""

from __future__ import annotations

from kvstore.placement.state import Move, NodeCommand
from kvstore.placement.table import PlacementTable
from kvstore.policy import EvictionPolicy, TierName
from kvstore.protocol import GetReplicasReply, LocatedRef
from kvstore.results import HeldBlock, ReplicaLookup, Ticket

KB = 1024
DRAM, SSD = TierName.DRAM, TierName.SSD
EXACT = EvictionPolicy(1.0, 1.0, promote_after_hits=2)


def table(*nodes: str, dram: int = 4 * KB, ssd: int = 0, policy: EvictionPolicy = EXACT, **kw: int) -> PlacementTable:
    t = PlacementTable(policy, **kw)  # type: ignore[arg-type]
    for n in nodes:
        assert t.membership.register_node(n, f"{n}:1", dram, ssd, 64, [], now_ms=0) == []
    return t


def put(t: PlacementTable, *keys: str, size: int = KB, now: int = 0, **kw: object) -> list[Ticket | None]:
    plan = t.writes.put_start(list(keys), [size] * len(keys), int(kw.get("replicas", 1)), kw.get("node"), False, now)  # type: ignore[arg-type]
    assert plan.commands == [] and plan.waiting == [], plan
    ok = [k for k, tk in zip(keys, plan.tickets, strict=True) if tk is not None and tk.status == "ok"]
    assert t.writes.put_end(ok, [7] * len(ok)) == [True] * len(ok)
    t.check()
    return plan.tickets


def got(reply: ReplicaLookup) -> list[int]:
    """The lease ids a get's reply hands its reader: consecutive from ``first_lease``, one per hit."""
    hits = sum(size >= 0 for size in reply.sizes)
    return list(range(reply.first_lease, reply.first_lease + hits)) if reply.first_lease else []


def leased(t: PlacementTable, key: str) -> list[bool]:
    """Per replica of ``key``, whether the table says it is leased."""
    described = t.inspection.describe(key)
    assert described is not None
    return [bool(r["leased"]) for r in described["replicas"]]  # type: ignore[attr-defined]


def run(t: PlacementTable, commands: list[NodeCommand], ok: bool = True) -> None:
    for c in commands:
        t.apply(c, [ok] * len(c.keys))
    t.check()


def located(lookup: ReplicaLookup, keys: list[str]) -> list[LocatedRef | None]:
    """A lookup as a reader sees it, through the wire reply the master makes of it."""
    return GetReplicasReply.from_lookup(lookup).located(keys)


def placed(layout: dict[str, list[tuple[str, str]]], dram: int = 8 * KB, ssd: int = 8 * KB) -> PlacementTable:
    """A table rebuilt from inventories: per node, (key, tier) in order, each block KB bytes."""
    t = PlacementTable(EXACT)
    for node, items in layout.items():
        inventory = [
            HeldBlock(k, TierName(tier), i * KB if tier == "dram" else -1, KB, 7) for i, (k, tier) in enumerate(items)
        ]
        assert t.membership.register_node(node, f"{node}:1", dram, ssd, 64, inventory, 0) == []
    t.check()
    return t


def copy(t: PlacementTable, keys: list[str], node: str, max_bytes: int = 1 << 30, ok: bool = True) -> list[Move]:
    """Plan copies and have the target make them (or fail them all)."""
    moves = t.moves.plan_replicas(keys, node, max_bytes)
    t.check()
    copied, drops = t.moves.finish_replicas(moves, [ok] * len(moves))
    assert drops == [] and copied == (moves if ok else [])
    t.check()
    return moves
