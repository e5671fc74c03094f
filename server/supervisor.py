"""Background threads that cannot die silently.

A server's loops (accepting connections, sweeping sessions, heartbeats, reports, orphan checks)
run in threads of their own; one that raised an exception nobody caught used to end there and
then, with a traceback on stderr and the work it did gone for the rest of the process's life (a
daemon's sweep died on one seal it could not find and never cut a late login again).
:meth:`Supervisor.thread` runs a loop's body again after any exception: logged (at most once a
minute a loop, with a count), counted by loop name (:attr:`Supervisor.failures`, served as
``kvstore_daemon_loop_failures_total`` and alerted on), and restarted after a backoff that grows
from 0.1 to 5 s while the body keeps failing. A body that returns is done (its loop was told to
stop); so is one that fails once its ``stop`` is set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvstore.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
HEALTHY_S = 30.0
"""A body that ran this long before failing starts the backoff over."""


class Supervisor:
    """The supervised threads of one server. Thread-safe; :attr:`failures` may be read any time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.failures: Counter[str] = Counter()
        """Exceptions each loop raised (and was restarted after), by the loop's name; every loop
        started is here from its start, at 0."""
        self._log = RateLimitedLog(log)

    def thread(
        self, name: str, body: Callable[..., object], stop: threading.Event, *args: Any, daemon: bool = True
    ) -> threading.Thread:
        """A thread (not started) that runs ``body(*args)`` until it returns, again after every
        exception unless ``stop`` is set by then."""
        with self._lock:
            self.failures[name] += 0
        return threading.Thread(target=self._run, args=(name, body, stop, args), name=name, daemon=daemon)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.failures)

    def _run(self, name: str, body: Callable[..., object], stop: threading.Event, args: tuple[Any, ...]) -> None:
        backoff = 0.1
        while True:
            began = time.monotonic()
            try:
                body(*args)
                return
            except Exception:
                with self._lock:
                    self.failures[name] += 1
                    count = self.failures[name]
                self._log.warning(
                    name, "background loop %s failed (%d so far); restarting it", name, count, exc_info=True
                )
            if time.monotonic() - began > HEALTHY_S:
                backoff = 0.1
            if stop.wait(backoff):
                return
            backoff = min(backoff * 2, MAX_BACKOFF_S)
