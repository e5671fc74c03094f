"""Tenants' accounts: what each tenant holds or reserves, for its quota and caps
(:mod:`kvstore.placement.quotas` holds the rules over them).

A tenant holds its keys, stored or being written (charged once each, however many replicas:
:func:`~kvstore.placement.state.charged`), the pieces of its open grants, and what requests of its
were admitted under its quota and are still placing (:meth:`Accounts.admit` to
:meth:`Accounts.settle`), so that requests served at once cannot each find the same room.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvstore.placement.state import Catalog


class Accounts:
    """Reads the catalog's counts by owner; changes only the tenants' names and what was admitted."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._admitted: Counter[str] = Counter()
        """Bytes of tenants' requests admitted under their quotas and not yet in the table (puts
        waiting for room, grants being opened): :meth:`tenant_held` counts them, so that requests
        served at once cannot each find the same room under a quota."""
        self._admitted_keys: Counter[tuple[str, bool]] = Counter()
        """The same for keys (tenant, pinned): :meth:`tenant_keys` counts them."""

    def set_tenants(self, names: Iterable[str]) -> None:
        """The names that are tenants now (a master reads them from its tenants file each tick): only
        their keys get an LRU of their own, which their puts evict from (``put_start``'s ``tenant``)."""
        self.catalog.tenants = frozenset(names)

    def usage(self, tenant: str) -> int:
        """Bytes of the tenant's keys, pending and stored (each once, however many replicas)."""
        return self.catalog.usage.get(tenant, 0)

    def num_objects_of(self, owner: str) -> int:
        """Stored keys (not being removed) of ``owner``: its keys by owner when kept, else a scan."""
        cat = self.catalog
        if cat.keys_by_owner:
            rec, owned = cat.rec, cat.owned.get(owner, ())
            return sum(1 for k in owned if (slot := rec.index.get(k)) is not None and rec.in_service(slot))
        prefix = f"{owner}/"
        return sum(1 for k, _ in cat.rec.served_items() if k.startswith(prefix))

    def granted(self, owner: str) -> tuple[int, int]:
        """The open grants of ``owner`` and the bytes they still reserve (a grant returned or expired
        takes no more writes: its rest is on its way back to the pool, and counts no more)."""
        grants = [g for g in self.catalog.grants.values() if g.owner == owner and not g.ending]
        return len(grants), sum(p.length for g in grants for p in g.pieces)

    def tenant_held(self, tenant: str) -> int:
        """Everything the tenant holds or reserves: its keys (:meth:`usage`), its grants' pieces, and
        what requests of its admitted under its quota are still placing (:meth:`admit`)."""
        return self.usage(tenant) + self.granted(tenant)[1] + self._admitted[tenant]

    def tenant_keys(self, tenant: str) -> tuple[int, int]:
        """The tenant's keys and pinned keys, stored or being written or admitted (:meth:`admit`)."""
        cat, admitted = self.catalog, self._admitted_keys
        objects = len(cat.owned.get(tenant, ())) + admitted[tenant, False] + admitted[tenant, True]
        return objects, cat.pinned_keys[tenant] + admitted[tenant, True]

    def admit(self, tenant: str, nbytes: int, keys: int = 0, pinned: bool = False) -> None:
        """Count ``nbytes`` (and ``keys``, ``pinned`` or not) that a request of ``tenant`` was
        admitted for under its quota and will place (after waits for room) as held, until
        :meth:`settle` says they are placed or given up. The caller admits in the same step as it
        checked the quota, with no wait in between."""
        self._admitted[tenant] += nbytes
        self._admitted_keys[tenant, pinned] += keys

    def settle(self, tenant: str, nbytes: int, keys: int = 0, pinned: bool = False) -> None:
        """``nbytes`` and ``keys`` admitted for ``tenant`` are in the table now (or were given up)."""
        left = self._admitted[tenant] - nbytes
        assert left >= 0, f"tenant {tenant!r} settled {nbytes} bytes of {self._admitted[tenant]} admitted"
        if left:
            self._admitted[tenant] = left
        else:
            del self._admitted[tenant]
        self._admitted_keys[tenant, pinned] -= keys
        if self._admitted_keys[tenant, pinned] <= 0:
            del self._admitted_keys[tenant, pinned]
