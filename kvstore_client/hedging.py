"""Hedged reads: how long a read waits for its daemon when it has somewhere else to go.

A read whose blocks all have another replica (or that a remembered location sends to a node the
master can stand in for) need not wait for a daemon that is slow right now (a pause, a busy core,
a disk stall): past :data:`MULTIPLE` times this client's recent p99 read time it reads the next
replica instead (over the last :data:`WINDOW` reads, at least :data:`FLOOR_S`), never later than
``ClientConfig.failover_ms`` (what a dead or frozen node costs without hedging). So that a
slowdown of every node does not double the load, at most :data:`BUDGET` of the reads of a window
are hedged; past it a read waits ``failover_ms`` again until the next window.

A node a read gave up on is read last for :data:`SLOW_S`. The first read is given up, not
raced: on the blocking face its connection is closed (a new one is made for the next read), on the
asyncio face the request alone is abandoned on its link and its late reply dropped. Either way the
read is served by the next replica.
"""

from __future__ import annotations

import threading
from array import array

WINDOW = 512
"""Read times kept: the p99 is that of the last this many reads (a power of two)."""

EVERY = 64
"""The p99 is computed again after this many reads (a sort of :data:`WINDOW` floats; a power of two)."""

FLOOR_S = 0.005
"""The least patience: below it a give-up costs more (a new connection, a batch read again through
the master) than it saves."""

MULTIPLE = 3
"""The patience is this many times the recent p99. A give-up is not a race: the daemon's work for
the first read is lost and a batch of reads by key is read again through the master, so at the p99
itself (1% of reads given up by definition) a calm AsyncStore with 64 gets in flight lost up to a
third of its gets/s in bench.cluster; three p99s hold calm reads and still cut a 30 ms pause."""

BUDGET = 0.05
"""The most reads of a window that may be hedged; past it reads wait ``failover_ms``."""

SLOW_S = 0.05
"""A node a read gave up on is read last (its blocks read at their other replicas, reads by
remembered location asking the master) for this long: the reads behind it do not each wait out the
patience while the node is paused. (Calm reads are seldom given up at three p99s: a one-off costs
one node's reads a master round trip each for this long.)"""


class ReadTimes:
    """This client's recent read times and hedges, and the patience they give (thread-safe)."""

    def __init__(self, ceiling_s: float, enabled: bool = True) -> None:
        """``ceiling_s``: the patience without hedging (``failover_ms``); ``enabled``: hedge at all."""
        self.ceiling_s = ceiling_s
        self.enabled = enabled and ceiling_s > FLOOR_S
        self._times = array("d", bytes(8 * WINDOW))
        self._count = 0
        self._hedges = 0
        """Reads given up at the hedge patience in the current window."""
        self._window_start = 0
        self._patience = ceiling_s
        self._lock = threading.Lock()
        self.hedged = 0
        """Reads given up for the next replica at a patience below ``ceiling_s``, since the start."""

    @property
    def patience_s(self) -> float:
        """How long a read with somewhere else to go waits for its daemon to begin answering."""
        return self._patience

    def add(self, seconds: float) -> None:
        """A read took ``seconds`` (a served one: a give-up is :meth:`gave_up`). On every read's path:
        no lock (two threads adding at once may lose a sample, which a p99 of 512 does not miss)."""
        if self.enabled:
            n = self._count
            self._times[n & (WINDOW - 1)] = seconds
            self._count = n + 1
            if not (n + 1) & (EVERY - 1):
                with self._lock:
                    self._update()

    def gave_up(self, patience_s: float) -> None:
        """A read was given up after ``patience_s``: a hedge when that was below the ceiling."""
        if not self.enabled or patience_s >= self.ceiling_s:
            return
        with self._lock:
            self.hedged += 1
            self._hedges += 1
            if self._hedges > BUDGET * WINDOW:
                self._patience = self.ceiling_s  # over budget: until the window ends

    def _update(self) -> None:
        if self._count - self._window_start >= WINDOW:
            self._window_start, self._hedges = self._count, 0
        if self._count < WINDOW // 4 or self._hedges > BUDGET * WINDOW:
            self._patience = self.ceiling_s  # too few reads to know, or over budget
            return
        held = sorted(self._times[: min(self._count, WINDOW)])
        p99 = held[min(len(held) - 1, int(len(held) * 0.99))]
        self._patience = min(self.ceiling_s, max(FLOOR_S, MULTIPLE * p99))
