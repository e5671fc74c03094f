"""Ending read leases early: the ids of leases whose reads are done ride on the client's next
GetReplicas, or, when no get follows within a period, a background thread sends them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from kvstore.protocol import MAX_BATCH_KEYS


class LeaseReleaser:
    def __init__(self, send: Callable[[list[int]], None], period_s: float = 0.05) -> None:
        self._send = send
        self._period = period_s
        self._pending: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, ids: Iterable[int]) -> None:
        with self._lock:
            self._pending.extend(ids)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._loop, name="kvstore-lease-release", daemon=True)
                self._thread.start()

    def take(self, limit: int = MAX_BATCH_KEYS) -> list[int]:
        """What is waiting (the oldest ``limit``), to ride on a request about to go to the master."""
        if not self._pending:
            return []
        with self._lock:
            out, self._pending = self._pending[:limit], self._pending[limit:]
        return out

    def _loop(self) -> None:
        held: list[int] = []
        while not self._stop.wait(self._period):
            with self._lock:
                # Ids still here after a whole period were not carried by a get: send them now.
                waiting = set(self._pending)
                due = [k for k in held if k in waiting]
                held = list(self._pending)
                if due:
                    gone = set(due)
                    self._pending = [k for k in self._pending if k not in gone]
            for start in range(0, len(due), MAX_BATCH_KEYS):
                self._send(due[start : start + MAX_BATCH_KEYS])

    def close(self, timeout: float) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
        while rest := self.take():
            self._send(rest)
