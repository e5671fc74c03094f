"""Storage tiers of one node: the DRAM arena and the LMDB SSD tier, behind one interface."""

from kvstore.tiers.base import Tier, TierEntry
from kvstore.tiers.dram import DramArena
from kvstore.tiers.ssd import SsdTier

__all__ = ["DramArena", "SsdTier", "Tier", "TierEntry"]
