"""The master's log of evictions: what left the cache without a client asking, and why.

The placement table keeps each eviction as it decides or confirms it (:class:`~kvstore.placement.state.Eviction`);
the master's tick takes them, stamps them with the time and a sequence number and keeps the last
``MasterConfig.eviction_log``. ``GET /api/v1/evictions?after=SEQ`` pages through them: an operator
learns what evicted a key, a tenant what it lost, and a checker (``bench.chaos``) tells an eviction
from a loss. The log is this master's: a new leader starts one of its own.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from typing import NamedTuple

from kvstore.placement.state import Eviction, EvictionReason


class LoggedEviction(NamedTuple):
    seq: int
    at: float
    """Unix time (seconds) the master learned of it: at most a tick after it was decided or confirmed."""
    key: str
    node_id: str
    reason: EvictionReason


class EvictionLog:
    """The last ``size`` evictions, numbered from 1 in order."""

    def __init__(self, size: int) -> None:
        self._entries: deque[LoggedEviction] = deque(maxlen=size)
        self.last = 0
        """The sequence number of the latest eviction (0: none yet)."""
        self.by_reason: Counter[str] = Counter()
        """Evictions logged so far, by reason (the log's bound does not drop these)."""

    def add(self, evictions: Iterable[Eviction], at: float) -> None:
        for e in evictions:
            self.last += 1
            self._entries.append(LoggedEviction(self.last, at, e.key, e.node_id, e.reason))
            self.by_reason[e.reason] += 1

    def page(self, after: int, limit: int, prefix: str = "") -> tuple[list[LoggedEviction], int, int]:
        """Up to ``limit`` evictions numbered after ``after`` whose key starts with ``prefix``; the
        number to ask after next, and how many after ``after`` the bound dropped already."""
        entries = self._entries
        first = entries[0].seq if entries else self.last + 1
        lost = max(0, min(first, self.last + 1) - 1 - after)
        out: list[LoggedEviction] = []
        seen = max(after, first - 1)
        for i in range(max(0, seen + 1 - first), len(entries)):
            e = entries[i]
            if len(out) == limit:
                break
            seen = e.seq
            if e.key.startswith(prefix):
                out.append(e)
        return out, seen, lost
