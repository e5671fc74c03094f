"""Grants: DRAM of one node reserved for a client to write into without asking per put.

``grant_space`` reserves a bounded, expiring piece of one node's arena (placed
as a put is, evicting by LRU first). ``commit_granted`` turns an extent of a
grant into a committed block (or answers ``exists``); a grant's unused pieces
return to the pool only after its daemon confirmed the grant ended
(``end_grants`` then ``finish_end_grants``), so no write into it can land in
reused space.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from kvstore.allocator import Extent
from kvstore.errors import CapacityError, GrantExpired, InvalidArgument, KVStoreError, NoNodes, RetryLater
from kvstore.keys import validate_key
from kvstore.placement.records import MAX_CHECKSUM
from kvstore.placement.state import (
    DRAM,
    Catalog,
    Grant,
    NodeCommand,
    NodeState,
    no_room_text,
    shunned_refusal,
    suspects_last,
)
from kvstore.placement.tiering import Tiering
from kvstore.placement.writes import Strategy
from kvstore.results import PUT_EXISTS, PUT_STORED
from kvstore.write_ids import check_write_ids, same_write


@dataclass(slots=True)
class GrantPlan:
    grant: Grant | None
    commands: list[NodeCommand]
    waiting: bool
    """No room yet, but evictions in ``commands`` (or in flight) will make some: ask again."""
    error: KVStoreError | None = None


class Grants:
    """Opens, commits into and ends the grants of ``Catalog.grants``."""

    def __init__(self, catalog: Catalog, tiering: Tiering, strategy: Strategy, rng: random.Random) -> None:
        self.catalog = catalog
        self.open: Mapping[int, Grant] = MappingProxyType(catalog.grants)
        """The grants open now (and those ending, until their daemons answer), by id: read-only."""
        self.tiering = tiering
        self.strategy = strategy
        self.rng = rng
        self._next_grant = 1

    def grant_space(
        self, length: int, preferred_node: str | None, ttl_ms: int, now_ms: int, owner: str = "",
        avoid: Collection[str] = (),
    ) -> GrantPlan:  # fmt: skip
        """Reserve ``length`` bytes of one node's DRAM (placement as for a put, evicting by LRU first
        when the node is above its high watermark) for ``ttl_ms``, for tenant ``owner``; nodes in
        ``avoid`` (its client could not reach them) last."""
        cat = self.catalog
        cat.know_tenant(owner)
        if type(length) is not int or length <= 0:
            raise InvalidArgument(f"grant length must be a positive int, got {length!r}")
        if type(ttl_ms) is not int or ttl_ms <= 0:
            raise InvalidArgument(f"grant ttl must be a positive int of milliseconds, got {ttl_ms!r}")
        placeable = cat.placeable()
        if not placeable:
            return GrantPlan(None, [], False, NoNodes("no storage node is up"))
        commands: list[NodeCommand] = []
        waiting = False
        ordered, shunned = suspects_last(self.strategy(placeable, preferred_node, self.rng), avoid)
        if all(n.node_id in shunned for n in ordered if n.alloc.capacity >= length):
            shunned = frozenset()  # no other node can hold it: they are waited for as any node
        passed: NodeState | None = None  # a shunned node without room now
        for node in ordered:
            if node.alloc.capacity < length:
                continue
            if node.node_id in shunned:
                # Its evictions and commands in flight may go unanswered until its fence: only the
                # room it has now, and only when no other node has room coming (as for puts).
                if waiting:
                    break
                extent = self.tiering.take(node, length)
                evicting = False
                if extent is None:
                    passed = node
                    continue
            else:
                extent, evicting = self.tiering.reserve(node, length, commands, owner)
            if extent is not None:
                grant = Grant(self._next_grant, node.node_id, [extent], now_ms + ttl_ms, owner=owner)
                self._next_grant += 1
                cat.grants[grant.grant_id] = grant
                cat.counters["grants"] += 1
                return GrantPlan(grant, commands, False)
            waiting = waiting or evicting or node.inflight > 0
            if commands:
                break  # room is being made on this node: ask again once it is
        if waiting:
            return GrantPlan(None, commands, True)
        if passed is not None:
            return GrantPlan(None, [], False, shunned_refusal(cat, f"a grant of {length} bytes", passed))
        if not any(n.alloc.capacity >= length for n in placeable):
            return GrantPlan(
                None, [], False, CapacityError(f"a grant of {length} bytes is larger than every node's DRAM")
            )
        if any(cat.busy(n) for n in placeable):
            cat.counters["room_refused_leased"] += 1
            return GrantPlan(None, [], False, RetryLater(f"no room for a grant of {length} bytes yet"))
        if owner:
            cat.counters["room_refused_tenants"] += 1
            return GrantPlan(None, [], False, CapacityError(no_room_text(f"a grant of {length} bytes", owner)))
        cat.counters["room_refused_pinned"] += 1
        return GrantPlan(None, [], False, CapacityError(f"no room for a grant of {length} bytes: DRAM is pinned"))

    def confirm_grant(self, grant_id: int, deadline_ms: int) -> None:
        """Set the grant's deadline once its daemon took it (the daemon's own deadline ends earlier)."""
        grant = self.catalog.grants.get(grant_id)
        if grant is not None:
            grant.deadline_ms = deadline_ms

    def expired_grants(self, now_ms: int) -> dict[str, list[int]]:
        """Grants past their deadline, now ending, by node: their daemons must be told (then
        :meth:`finish_end_grants`)."""
        due = [g.grant_id for g in self.catalog.grants.values() if not g.ending and g.deadline_ms <= now_ms]
        self.catalog.counters["grants_expired"] += len(due)
        return self.end_grants(due)

    def end_grants(self, grant_ids: Iterable[int]) -> dict[str, list[int]]:
        """Stop committing into these grants; by node, the grants its daemon must close."""
        out: dict[str, list[int]] = {}
        for grant_id in grant_ids:
            grant = self.catalog.grants.get(grant_id)
            if grant is None or grant.ending:
                continue
            grant.ending = True
            out.setdefault(grant.node_id, []).append(grant_id)
        return out

    def finish_end_grants(self, node_id: str, grant_ids: Iterable[int]) -> None:
        """The daemon closed these grants: their unused pieces return to the pool."""
        grants = self.catalog.grants
        node = self.catalog.nodes.get(node_id)
        for grant_id in grant_ids:
            grant = grants.get(grant_id)
            if grant is None or grant.node_id != node_id:
                continue
            del grants[grant_id]
            if node is not None:
                for piece in grant.pieces:
                    node.alloc.free(piece)

    def commit_granted(
        self,
        node_id: str,
        grant_id: int,
        keys: Sequence[str],
        offsets: Sequence[int],
        sizes: Sequence[int],
        checksums: Sequence[int],
        pinned: bool,
        cached: bool = False,
        write_ids: Sequence[int] = (),
    ) -> list[tuple[int, str]]:
        """Commit blocks a daemon holds written into a grant, each at its extent, by its put's write id
        (``write_ids``: one per block, or none); per block (PUT_STORED, "") or (PUT_EXISTS, "") or an
        error's (code, text). Idempotent: a block already committed at that extent by that write
        (:func:`kvstore.write_ids.same_write`) answers PUT_STORED again.

        ``cached``: the daemon acknowledged them already. A key still being written by another
        put (reserved, not committed) is then answered RetryLater, not EXISTS: the daemon keeps its
        block (its writer reads it) and asks again once the other put committed (EXISTS: the block
        is dropped, readers find the other) or gave up (STORED). Refusing it at once would leave
        the key with neither block readable until the other put commits."""
        cat = self.catalog
        if not len(keys) == len(offsets) == len(sizes) == len(checksums):
            raise InvalidArgument("commit_granted got lists of different lengths")
        ids = check_write_ids(write_ids, len(keys))
        grant = cat.grants.get(grant_id)
        node = cat.nodes.get(node_id)
        out: list[tuple[int, str]] = []
        for key, offset, size, check, write_id in zip(keys, offsets, sizes, checksums, ids, strict=True):
            key = validate_key(key)
            entry = cat.entry(key)
            if entry is not None:
                same = entry.committed and any(
                    r.node_id == node_id and r.extent is not None and r.extent.offset == offset for r in entry.replicas
                )
                if same and entry.size == size and same_write(entry.write_id, entry.checksum, write_id, check):
                    out.append((PUT_STORED, ""))
                elif entry.removing:
                    out.append((RetryLater.code, f"key {key!r} is being moved or removed; retry"))
                elif cached and not entry.committed:
                    out.append((RetryLater.code, f"key {key!r} is being written by another put; retry"))
                else:
                    cat.counters["put_exists"] += 1
                    if entry.committed:
                        cat.touch(entry.slot)
                    out.append((PUT_EXISTS, ""))
                continue
            # An ending grant still takes commits: its space is freed only once its daemon has ended it,
            # which waits for the commits of the blocks it acknowledged (cached puts).
            if grant is None or grant.node_id != node_id or node is None:
                out.append((GrantExpired.code, f"grant {grant_id} on {node_id} has ended"))
                continue
            if type(size) is not int or size <= 0 or type(offset) is not int:
                out.append((InvalidArgument.code, f"block {key!r}: bad extent ({offset!r}, {size!r})"))
                continue
            if type(check) is not int or not 0 <= check < MAX_CHECKSUM:
                out.append((InvalidArgument.code, f"block {key!r}: checksum {check!r} is not in [0, 2**64)"))
                continue
            extent = Extent(offset, node.alloc.round_up(size))
            at = next((i for i, p in enumerate(grant.pieces) if p.offset <= offset and extent.end <= p.end), None)
            if at is None or offset % node.alloc.alignment:
                out.append(
                    (InvalidArgument.code, f"block {key!r}: extent {extent} is not free space of grant {grant_id}")
                )
                continue
            grant.pieces[at : at + 1] = node.alloc.carve(grant.pieces[at], extent)
            slot = cat.new_key(key, size, check, committed=True, pinned=pinned, write_id=write_id)
            node.dram_lru.insert_row(cat.add_replica(slot, node, DRAM, extent))
            cat.counters["puts"] += 1
            cat.counters["bytes_written"] += size
            out.append((PUT_STORED, ""))
        return out
