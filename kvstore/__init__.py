"""kvstore core: keys, errors, config, allocator, LRU and policies, tiers and the node store.

The core does no networking and imports none of the I/O layers. :class:`NodeStore` is loaded on
first use: every ``import kvstore.<module>`` runs this file first, so a client importing the keys,
the errors or the wire protocol would otherwise load the tiers and LMDB with them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.errors import KVStoreError
from kvstore.keys import block_keys
from kvstore.results import PutStatus

if TYPE_CHECKING:
    from kvstore.node_store import NodeStore

__version__ = "0.1.0"
__all__ = ["KVStoreError", "NodeStore", "PutStatus", "__version__", "block_keys"]


def __getattr__(name: str) -> Any:
    if name == "NodeStore":
        from kvstore.node_store import NodeStore

        return NodeStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
