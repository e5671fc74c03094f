"""Following KV events: the store's masters' (``--kv-events``) or an engine's (vLLM's
``--kv-events-config``). :class:`KVEventSubscriber` lives in :mod:`transfer.kv_events`, beside
the other transports; this is where clients import it from."""

from transfer.kv_events import Delivered, KVEventSubscriber, starts_term

__all__ = ["Delivered", "KVEventSubscriber", "starts_term"]
