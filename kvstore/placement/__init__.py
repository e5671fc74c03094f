"""The master's placement table, split by concern; :class:`kvstore.placement.table.PlacementTable`
is the one face the rest of the code uses."""
