"""kvstore's client side: the network client (Store, AsyncStore), workload replay and the engine adapters."""

from kvstore_client.aio import AsyncStore
from kvstore_client.store import PutOptions, Store

__all__ = ["AsyncStore", "PutOptions", "Store"]
