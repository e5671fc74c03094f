"""kvstore's client side: the network client (Store, AsyncStore), workload replay and the CLI."""

from kvstore_client.store import AsyncStore, PutOptions, Store

__all__ = ["AsyncStore", "PutOptions", "Store"]
