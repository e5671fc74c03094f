"""Logging a failure that repeats: once when it starts, then a count at most once per interval.

A tier whose disk fills fails every demotion from then on; a line per block
would bury everything else in the log (and cost more than the failure).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Kind:
    since: float
    suppressed: int = 0


class RateLimitedLog:
    """``warning(kind, ...)`` logs the first failure of a kind (one of a small fixed set) at once;
    later ones of the same kind within ``interval_s`` are only counted, and the next line logged
    for that kind says how many were left out. Safe to call from any thread."""

    def __init__(
        self, logger: logging.Logger, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._clock = clock
        self._kinds: dict[str, _Kind] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Log (or count) one failure of ``kind``; True when a line was written (with the exception
        being handled and its traceback when ``exc_info``)."""
        with self._lock:
            now = self._clock()
            seen = self._kinds.get(kind)
            if seen is not None and now - seen.since < self.interval_s:
                seen.suppressed += 1
                return False
            if seen is not None and seen.suppressed:
                msg += " (and %d more like it in the last %.0f s)"
                args = (*args, seen.suppressed, now - seen.since)
            self._kinds[kind] = _Kind(now)
        self.logger.warning(msg, *args, exc_info=exc_info)
        return True
