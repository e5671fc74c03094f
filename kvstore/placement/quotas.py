"""Tenants' byte quotas as rules over the placement table: what fits, and what of the tenant's own
blocks to evict so that more fits. Pure: they return the evictions as commands, and the master's
core carries them out (another tenant's blocks are never touched).

A tenant's quota counts everything it holds or reserves (:meth:`Accounts.tenant_held`): its keys,
stored or being written, and the space of its grants not yet written into. Room on the nodes is
another matter: a tenant's put never evicts another tenant's block for it
(:meth:`~kvstore.placement.tiering.Tiering.scope`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.placement.state import NodeCommand, charged
from kvstore.placement.table import PlacementTable


def fits(room: int, sizes: Sequence[int]) -> list[bool]:
    """Which blocks, taken in order, fit in ``room`` bytes (a block that does not fit takes none)."""
    out = []
    for size in sizes:
        out.append(size <= room)
        if size <= room:
            room -= size
    return out


@dataclass(frozen=True, slots=True)
class QuotaPlan:
    """A tenant's put against its quota: which of its keys are new (only those count), and the
    evictions of its own least recently used blocks that make room for them."""

    new: list[int]
    commands: list[NodeCommand]


def new_keys(table: PlacementTable, keys: Sequence[str]) -> list[int]:
    """Indexes of ``keys`` the table does not know, stored or being written: the ones a put adds."""
    return [i for i, k in enumerate(keys) if k not in table.objects and table.inspection.describe(k) is None]


def plan_put(table: PlacementTable, tenant: str, quota: int, keys: Sequence[str], sizes: Sequence[int]) -> QuotaPlan:
    """Plan a put of ``keys`` by ``tenant`` under ``quota`` bytes (see :func:`refused`)."""
    new = new_keys(table, keys)
    over = table.accounts.tenant_held(tenant) + sum(charged(sizes[i]) for i in new) - quota
    commands: list[NodeCommand] = []
    if over > 0:
        victims = table.moves.tenant_victims(tenant, over, keep=set(keys))
        if victims:
            _, _, commands = table.moves.evict_keys(victims, "quota")
    return QuotaPlan(new, commands)


def refused(table: PlacementTable, tenant: str, quota: int, sizes: Sequence[int], plan: QuotaPlan) -> list[int]:
    """Indexes of the new keys of ``plan`` that do not fit ``quota`` once its evictions are done."""
    ok = fits(quota - table.accounts.tenant_held(tenant), [charged(sizes[i]) for i in plan.new])
    return [i for i, fit in zip(plan.new, ok, strict=True) if not fit]


def over_caps(
    table: PlacementTable, tenant: str, max_objects: int, max_pinned: int, new: Sequence[int], pinned: bool
) -> dict[int, str]:
    """Of ``new`` (indexes of keys new to the table, in order), those that would take ``tenant`` past
    its caps on keys and pinned keys (0: none), each with what it holds; the others count against
    the caps in order."""
    objects, pins = table.accounts.tenant_keys(tenant)
    out: dict[int, str] = {}
    for i in new:
        if max_objects and objects >= max_objects:
            out[i] = f"{objects} keys (max_objects)"
        elif pinned and max_pinned and pins >= max_pinned:
            out[i] = f"{pins} pinned keys (max_pinned)"
        else:
            objects, pins = objects + 1, pins + pinned
    return out


def refusal_text(table: PlacementTable, tenant: str, quota: int, key: str, size: int) -> str:
    return (
        f"block {key[len(tenant) + 1 :]!r} of {size} bytes (charged {charged(size)}: at least an index slot) would"
        f" take tenant {tenant!r} past its quota of {quota} bytes"
        f" ({table.accounts.tenant_held(tenant)} held or reserved, none of it evictable)"
    )


def granted_fits(table: PlacementTable, tenant: str, quota: int, sizes: Sequence[int]) -> list[bool]:
    """Which blocks of a one-trip put (written into a grant already, whose space the quota counts
    already) fit the tenant's quota as it is now (it may have been lowered since the grant): the
    rest go the two-trip way, which evicts the tenant's own blocks or refuses them."""
    return fits(quota - table.accounts.tenant_held(tenant) + sum(sizes), [charged(s) for s in sizes])
