"""kvstore core: keys, errors, config, allocator, LRU and policies, tiers and the node store.

The core does no networking and imports none of the I/O layers.
"""

from kvstore.errors import KVStoreError
from kvstore.keys import block_keys
from kvstore.node_store import NodeStore, PutStatus

__version__ = "0.1.0"
__all__ = ["KVStoreError", "NodeStore", "PutStatus", "__version__", "block_keys"]
