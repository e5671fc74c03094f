"""The table's KV events: each replica stored on a node's tier or no longer, as an engine's router
reads them (:mod:`kvstore.events`), with the names engines gave their blocks.

The records note each replica that joins or leaves a tier's LRU (:attr:`Records.events`) while
events are told; :class:`KvEvents` turns what was noted into events, and keeps the engines' labels.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import InvalidArgument
from kvstore.events import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, EngineBlock, removed, stored
from kvstore.placement.state import Catalog, owner_of

LABELS_UNPLACED = 65_536
"""Labels (:meth:`KvEvents.label`) kept for keys not in the table (a put about to write them)."""


class KvEvents:
    """Tells the replicas stored and dropped since it was last asked; changes only the catalog's
    event list (:attr:`Records.events`) and its labels."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    def tell_changes(self, on: bool = True) -> None:
        """Keep (or stop keeping) each replica stored or dropped, for :meth:`take_events`."""
        self.catalog.rec.events = [] if on else None
        self.catalog.labels_gone.clear()

    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The replicas stored on a node's tier (joined its LRU: committed, promoted, demoted there,
        found in an inventory) or no longer (evicted, demoted, removed, its node gone) since the
        last call, in order, as KV events (:mod:`kvstore.events`); [] when not kept. A node fenced
        is an ``AllBlocksCleared`` of its ``backend_id``: its replicas stay in the table, unread
        until its daemon registers again, and that registration tells them as stored anew (the
        removals it makes first are of blocks a follower already forgot)."""
        cat = self.catalog
        rec = cat.rec
        changes = rec.events
        if not changes:
            return []
        rec.events = []
        names, labels, gone, tenants = rec.node_ids, cat.labels, cat.labels_gone, cat.tenants
        out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        for joined, node, tier, key in changes:
            if tier < 0:  # a node fenced: what it holds is unread until its registration tells it anew
                out.append(AllBlocksCleared(names[node]))
                continue
            # A removal names the block as it was labelled (a key forgotten and put again since
            # has a new label); a store, as it is labelled now.
            label = labels.get(key) if joined or key not in gone else gone[key]
            owner = owner_of(key) if tenants else ""
            tenant = owner if owner and tenants and owner in tenants else None
            make = stored if joined else removed
            out.append(make(key, names[node], MEDIA[tier], tenant, label))
        gone.clear()
        return out

    def label(self, keys: Sequence[str], labels: Sequence[EngineBlock]) -> None:
        """Name ``keys`` as an engine names their blocks, for the KV events of their replicas (a put
        labels its keys before writing them; a key stored already keeps the name its events gave it,
        so that its removal names what its store did); kept only while events are told. Labels
        of keys not in the table are kept for a while: past :data:`LABELS_UNPLACED`, forgotten."""
        if len(keys) != len(labels):
            raise InvalidArgument(f"{len(keys)} keys but {len(labels)} labels")
        if self.catalog.rec.events is None:
            return  # no events told: nothing to name
        got = self.catalog.labels
        rec = self.catalog.rec
        for key, label in zip(keys, labels, strict=True):
            slot = rec.index.get(key)
            if slot is None or not rec.is_committed(slot):  # a stored key keeps the name it was told by
                got[key] = label
        if len(got) > len(self.catalog.rec.index) + LABELS_UNPLACED:
            index = self.catalog.rec.index
            for key in [k for k in got if k not in index]:
                del got[key]
