"""Keeping an engine fast while its store is sick: a circuit breaker.

An inference engine must never be slower than recomputing because its cache is
dead or frozen. After a failure the breaker *opens*: callers skip the store
(every lookup a miss, every save dropped) for ``cooldown_s``; then one call is
let through as a probe. Its success closes the breaker; its failure opens it
again for twice as long, up to ``max_cooldown_s``. Pure and synchronous, with
the clock passed in, so tests own time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CircuitBreaker:
    """Closed (calls go through), open (calls are skipped) or half-open (one probe is out).

    Thread-safe: the engine's scheduler and its loader and saver threads share one.
    Invariant: ``open_until`` is 0 exactly when the breaker is closed.
    """

    def __init__(
        self, cooldown_s: float = 2.0, max_cooldown_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not 0 < cooldown_s <= max_cooldown_s:
            raise ValueError(f"need 0 < cooldown_s <= max_cooldown_s, got {cooldown_s}, {max_cooldown_s}")
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open_until = 0.0
        self._next_cooldown = cooldown_s
        self._probing = False
        self.trips = 0
        """Times the breaker opened (a closed breaker that failed, or a probe that failed)."""

    @property
    def is_closed(self) -> bool:
        with self._lock:
            return self._open_until == 0.0

    def allow(self) -> bool:
        """Whether to call the store now: always when closed; once per cooldown when open (the probe)."""
        with self._lock:
            if self._open_until == 0.0:
                return True
            if self._probing or self._clock() < self._open_until:
                return False
            self._probing = True
            return True

    def success(self) -> None:
        with self._lock:
            self._open_until = 0.0
            self._next_cooldown = self.cooldown_s
            self._probing = False

    def failure(self) -> None:
        with self._lock:
            if self._open_until and not self._probing:
                return  # another call that started while closed failed too: one trip, not several
            self._open_until = self._clock() + self._next_cooldown
            self._next_cooldown = min(self._next_cooldown * 2, self.max_cooldown_s)
            self._probing = False
            self.trips += 1
