"""The master's placement table, split by concern: :class:`kvstore.placement.table.PlacementTable`
composes the parts over one catalog and hands them out (``table.writes``, ``table.reads``, ...)."""
