"""What the master measures of itself: latency histograms per request kind, and counters sampled
once a second for rates and the dashboard's history.

The service records into these; the admin API (:mod:`server.master.admin`) reads them for
``/metrics``, ``/api/v1/cluster`` and ``/api/v1/history``. Nothing here knows either.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from kvstore.ratelog import RateLimitedLog

log = logging.getLogger("kvstore.master")

STALL_LOG_S = 0.1
"""A stall of the master's event loop longer than this is logged (every client waited that long; the
first every 10 s, the others counted)."""

HISTORY_SECONDS = 300


class LatencyHistogram:
    """Seconds per request in fixed buckets, the form Prometheus wants."""

    BOUNDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, float("inf"))

    def __init__(self) -> None:
        self.counts = [0] * len(self.BOUNDS)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.BOUNDS, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts per upper bound."""
        out, running = [], 0
        for bound, count in zip(self.BOUNDS, self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out


class LoopStalls:
    """How long the master's event loop went without turning: a probe asks to wake every
    ``period_s`` and records how late it woke. Every client of the master waits while one request
    holds the loop (the placement table is synchronous), so this is the longest any of them waited
    for another's work, give or take a period."""

    def __init__(self, period_s: float = 0.01) -> None:
        self.period_s = period_s
        self.max_s = 0.0
        """The longest stall since the start."""
        self.histogram = LatencyHistogram()
        """Every probe's lateness."""
        self._log = RateLimitedLog(log, interval_s=10.0)
        self._late: deque[tuple[float, float]] = deque()
        """(when it was seen, time.monotonic(); how late) of the probes late by over a period, in order."""

    def record(self, late_s: float) -> None:
        late_s = max(late_s, 0.0)
        self.histogram.observe(late_s)
        self.max_s = max(self.max_s, late_s)
        if late_s > self.period_s:
            self._late.append((time.monotonic(), late_s))
            if late_s > STALL_LOG_S:
                self._log.warning("stall", "the master's event loop did not turn for %.3f s (one request's work, a "
                                  "collection, or the machine): every request waited", late_s)  # fmt: skip

    def recent_s(self, window_s: float) -> float:
        """The longest stall seen within the last ``window_s`` (0: none past a period): silences of
        daemons shorter than it may be this master's, which read no heartbeat meanwhile."""
        late, since = self._late, time.monotonic() - window_s
        while late and late[0][0] < since:
            late.popleft()
        return max((s for _, s in late), default=0.0)


_Point = tuple[float, dict[str, int], int, int]
"""(time, counters, DRAM bytes used, SSD bytes used)."""


class HistorySample(NamedTuple):
    """One second of the history: its end, the rates over it, and the tiers' use at its end."""

    t: float
    hit_rate: float | None
    gets_per_s: float
    puts_per_s: float
    read_bytes_per_s: float
    written_bytes_per_s: float
    dram_used: int
    ssd_used: int


class Sampler:
    """Counters sampled once a second: rates and the dashboard's history (the last HISTORY_SECONDS).

    ``clock`` gives seconds since the epoch; tests pass their own."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.points: deque[_Point] = deque(maxlen=HISTORY_SECONDS + 1)
        self._tenants: deque[tuple[float, dict[str, int]]] = deque(maxlen=6)

    def due(self) -> bool:
        """Whether a second has passed since the last sample."""
        return not self.points or self.clock() - self.points[-1][0] >= 1.0

    def sample(
        self, counters: Mapping[str, int], dram_used: int, ssd_used: int, tenants: Mapping[str, int] | None = None
    ) -> None:
        """One second's counters; ``tenants``: each tenant's requests so far (for :meth:`tenant_rates`)."""
        now = self.clock()
        self.points.append((now, dict(counters), dram_used, ssd_used))
        if tenants is not None:
            self._tenants.append((now, dict(tenants)))

    def tenant_rates(self) -> dict[str, float]:
        """Each tenant's requests per second over the last few seconds sampled."""
        if len(self._tenants) < 2:
            return {}
        (t0, a), (t1, b) = self._tenants[0], self._tenants[-1]
        dt = max(t1 - t0, 1e-6)
        return {name: (count - a.get(name, 0)) / dt for name, count in b.items()}

    @staticmethod
    def _rates(a: _Point, b: _Point) -> dict[str, Any]:
        dt = max(b[0] - a[0], 1e-6)

        def d(name: str) -> float:
            return (b[1].get(name, 0) - a[1].get(name, 0)) / dt

        lookups = d("hits") + d("misses")
        return {
            "hit_rate": d("hits") / lookups if lookups else None,
            "gets_per_s": d("gets"),
            "puts_per_s": d("puts"),
            "hits_per_s": d("hits"),
            "read_bytes_per_s": d("bytes_read"),
            "written_bytes_per_s": d("bytes_written"),
        }

    def rates(self, window: int = 5) -> dict[str, Any]:
        if len(self.points) < 2:
            return dict.fromkeys(("hit_rate", "gets_per_s", "puts_per_s", "hits_per_s", "read_bytes_per_s",
                                  "written_bytes_per_s"), 0.0)  # fmt: skip
        return self._rates(self.points[max(0, len(self.points) - 1 - window)], self.points[-1])

    def history(self) -> list[HistorySample]:
        pts = list(self.points)
        out = []
        for a, b in itertools.pairwise(pts):
            r = self._rates(a, b)
            del r["hits_per_s"]
            out.append(HistorySample(t=b[0], dram_used=b[2], ssd_used=b[3], **r))
        return out
