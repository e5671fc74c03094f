"""The vLLM connector's store client, behind a circuit breaker, so that a sick store never makes vLLM
slower than recomputing: while the breaker is open, callers skip the store and a background thread
probes it. Each role's connector holds one (the scheduler's with the lookup timeout, a worker's with
the load and save timeout)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Literal

from kvstore.config import ClientConfig
from kvstore.errors import KVStoreError
from kvstore_client.adapters.health import CircuitBreaker
from kvstore_client.store import Store

log = logging.getLogger("kvstore_client.adapters.vllm")  # the connector's: its lines go where its do


class GuardedStore:
    """A store client, connected on first use, and the breaker that says whether to use it.

    Thread-safe: the scheduler, or a worker's forward pass and its loader and saver threads, share one.
    Callers ask :meth:`available` before a call, report a failed call to :meth:`failed`, and may close
    the breaker with ``breaker.success()`` after one that worked. ``breaker``: one of the caller's (a
    test's, on its own clock); by default a :class:`CircuitBreaker` of the default cooldowns."""

    def __init__(
        self,
        master: str,
        *,
        timeout_s: float,
        put_mode: Literal["visible", "cached"],
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self.master = master
        self._timeout_s = timeout_s
        self._put_mode: Literal["visible", "cached"] = put_mode
        self._store: Store | None = None
        self._lock = threading.Lock()
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self._probe: threading.Thread | None = None

    @property
    def client(self) -> Store:
        """The store client (connected now if it was not)."""
        with self._lock:
            if self._store is None:
                config = ClientConfig(timeout_s=self._timeout_s, put_mode=self._put_mode)
                self._store = Store.connect(self.master, config)
            return self._store

    @property
    def connected(self) -> Store | None:
        """The store client if it was ever connected; None, without connecting, if not."""
        return self._store

    def available(self) -> bool:
        """Whether to use the store now. While the breaker is open, a background thread probes it."""
        if self.breaker.is_closed:
            return True
        if self.breaker.allow():
            probe = threading.Thread(target=self._probe_store, name="kvstore-vllm-probe", daemon=True)
            self._probe = probe
            probe.start()
        return False

    def _probe_store(self) -> None:
        try:
            self.client.stats()
        except KVStoreError as exc:
            log.info("store still unavailable: %s", exc)
            self.failed(None)
        else:
            log.info("store %s answers again: using it", self.master)
            self.breaker.success()

    def failed(self, exc: BaseException | None, what: str = "") -> None:
        """A store call failed (``exc``, while doing ``what``): the breaker opens, and says so once."""
        was_closed = self.breaker.is_closed
        self.breaker.failure()
        if exc is not None and was_closed:
            log.warning("%s failed, skipping the store for %.0f s: %s", what, self.breaker.cooldown_s, exc)

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None


def repair(store: Store, keys: Sequence[str], sizes: Sequence[int | None], want: int) -> int:
    """Remove stored blocks of the wrong size under our keys, so that the next request saves them anew.
    Returns how many were removed."""
    bad = [key for key, size in zip(keys, sizes, strict=True) if size is not None and size != want]
    if bad:
        log.warning("removing %d stored blocks of the wrong size (a block is %d bytes)", len(bad), want)
        store.remove_many(bad)
    return len(bad)
