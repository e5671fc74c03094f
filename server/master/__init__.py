"""The master: membership, placement, eviction decisions and leases, over the placement table."""
