"""What one client knows lately of the nodes it reads from and writes to: :class:`NodeMarks`.

A daemon that did not answer this client marks its node for a while; the client's reads and puts
go elsewhere first, or wait less, while the mark holds. Each mark holds until a time
(``time.monotonic()``), and goes sooner when the node's daemon answers this client:

- suspected (:data:`SUSPECT_S`): a read waited the whole timeout, or the master named the node
  as one it suspects;
- slow (:data:`~kvstore_client.hedging.SLOW_S`): a read gave it up at its patience;
- silent (:data:`UNREACHED_S`): either, until its daemon answers again;
- unreached (:data:`UNREACHED_S`): a read or a write could not reach it, named to the master so
  that this client's puts and grants go there last.

A node whose daemon refused or dropped a connection is reported to the master
(:data:`REPORT_GAP_S`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

from kvstore.errors import ConnectionFailed, Timeout
from kvstore_client.hedging import SLOW_S, ReadTimes

SUSPECT_S = 1.0
"""How long after one of its daemons did not answer within the whole timeout this client suspects
that node: a block with another replica is read there, one without is read with the failover
patience (a miss within it, not another whole timeout), and reads by remembered location ask the
master. An answer from the node ends it sooner (the master fences a silent node within its TTL,
1 s by default, and lists it no more). The nodes the master names as suspected with a get's
replicas are suspected so too."""

UNREACHED_S = 5.0
"""At most how long a node this client could not reach (:meth:`NodeMarks.unreached`) is named to
the master as one to place this client's puts and grants on last: an answer from the node ends it
sooner."""

REPORT_GAP_S = 0.25
"""A node this client could not reach is reported to the master (ReportNode) at most this often: the
master then looks whether its daemon is gone and fences it at once if so (a killed daemon costs its
keys' removes and puts milliseconds, not the node TTL)."""


class NodeMarks:
    """One client's marks of nodes, and its reports of them to the master.

    Its core's, shared by every operation of the client; each mark changes only through the verbs
    here. Thread-safe as the blocking face needs: single dict operations, never an iteration of a
    dict another thread may change."""

    def __init__(self, failover_s: float, read_times: ReadTimes) -> None:
        """``failover_s``: the failover patience (a read given up at it or later failed, one given
        up sooner was a hedge); ``read_times``: the client's hedging, told of the reads given up."""
        self.failover_s = failover_s
        self.read_times = read_times
        self._suspects: dict[str, float] = {}
        """Nodes this client reads nothing from until a time (time.monotonic()); see :data:`SUSPECT_S`."""
        self._slow: dict[str, float] = {}
        """Nodes this client reads last until a time (see :meth:`slow`)."""
        self._silent: dict[str, float] = {}
        """Node -> until when a read's last copy there gets the failover patience (see :meth:`silent`)."""
        self._unreached: dict[str, float] = {}
        """Node -> until when this client names it to the master as one it could not reach lately
        (see :meth:`unreached`)."""
        self.reporter: Callable[[str], None] = lambda node_id: None
        """Sends ReportNode for a node in the background (the face's: nothing waits for it)."""
        self._reported: dict[str, float] = {}
        """Node -> when this client last reported it (see :data:`REPORT_GAP_S`)."""
        # Read-only views, for a test of emptiness on the read path without a call (a calm client's
        # reads ask nothing of any node); a mark in them may be spent: the verbs below say.
        self.suspected_until: Mapping[str, float] = MappingProxyType(self._suspects)
        self.slow_until: Mapping[str, float] = MappingProxyType(self._slow)
        self.silent_until: Mapping[str, float] = MappingProxyType(self._silent)
        self.unreached_until: Mapping[str, float] = MappingProxyType(self._unreached)

    def slow(self, node_id: str) -> bool:
        """Whether a read gave ``node_id`` up lately (see :data:`~kvstore_client.hedging.SLOW_S`): its
        blocks are read at their other replicas first, reads by remembered location ask the master."""
        return _marked(self._slow, node_id)

    def suspected(self, node_id: str) -> bool:
        """Whether this client suspects ``node_id`` now (see :data:`SUSPECT_S`)."""
        return _marked(self._suspects, node_id)

    def note_suspects(self, suspects: list[str]) -> None:
        """The nodes the master says it suspects (frozen or cut off, as far as it knows): no wait on
        them (:meth:`suspected`) until they answer this client, :data:`SUSPECT_S` at most."""
        if suspects:
            until = time.monotonic() + SUSPECT_S
            for node_id in suspects:
                self._suspects[node_id] = max(self._suspects.get(node_id, 0.0), until)

    def clear_suspect(self, node_id: str) -> None:
        """A suspected node's daemon answered a read: suspected no more."""
        self._suspects.pop(node_id, None)

    def note_unreachable(self, node_id: str, outcome: object, patience_s: float) -> None:
        """A read from ``node_id`` ended with ``outcome``: a node silent for the whole timeout is
        suspected for :data:`SUSPECT_S`; one that did not answer within a read's ``patience_s`` (a
        hedge, or the failover) is read last for :data:`~kvstore_client.hedging.SLOW_S`
        (:meth:`slow`: the reads behind it, and this read's next round, go elsewhere first). Either
        is :meth:`silent` until its daemon answers this client again. One that refused or dropped
        the connection is not suspected (that costs no wait, and a daemon restarted is read again at
        once), but it is reported to the master (:meth:`report`)."""
        if not isinstance(outcome, Timeout):
            self.report(node_id, outcome)
            return
        now = time.monotonic()
        self._silent[node_id] = now + UNREACHED_S
        if not patience_s:
            self._suspects[node_id] = now + SUSPECT_S
            self.mark_unreached(node_id)
            return
        self.read_times.gave_up(patience_s)  # given up at the read's patience: slow now, read last a while
        self._slow[node_id] = now + SLOW_S
        if patience_s >= self.failover_s:  # a failed attempt, not a hedge
            self.mark_unreached(node_id)

    def silent(self, node_id: str) -> bool:
        """Whether a read gave ``node_id`` up (at its patience, or the whole timeout) and its daemon
        has not answered this client since (:data:`UNREACHED_S` at most): a block's last copy there
        is read with the failover patience, a miss within it, not a wait of the whole timeout on a
        node that already did not answer (frozen, dead, or cut off from this client: 2.5-5 s reads
        in bench.chaos's client cuts). A slow node that is alive answers some read of this client
        meanwhile (its fast path, another thread's): its last copies are waited for again."""
        return bool(self._silent) and _marked(self._silent, node_id)

    def mark_unreached(self, node_id: str) -> None:
        """This client could not reach ``node_id`` (a write given up or refused, a read failed): see
        :meth:`unreached`."""
        self._unreached[node_id] = time.monotonic() + UNREACHED_S

    def answered(self, node_id: str) -> None:
        """``node_id``'s daemon answered this client: it is reached (see :meth:`unreached`), and not
        :meth:`silent`."""
        if self._unreached:
            self._unreached.pop(node_id, None)
        if self._silent:
            self._silent.pop(node_id, None)

    def unreached(self) -> list[str]:
        """The nodes this client could not reach lately, to place its puts and grants on last
        (``PutStart.avoid``): a write there given up at its patience or refused, a read given up
        at the failover patience or the whole timeout, until the node's daemon answers this client
        again (at most :data:`UNREACHED_S`). The master may reach such a node (cut off from this
        client alone) or not yet suspect it (frozen): it placed puts there again and again (2-3 s
        puts in bench.chaos's client cuts, 1 s in daemon SIGSTOPs)."""
        if not self._unreached:
            return []
        now = time.monotonic()  # callers' threads share it (the blocking face): no iteration of the dict itself
        for node_id, until in list(self._unreached.items()):
            if until <= now:
                self._unreached.pop(node_id, None)
        return sorted(self._unreached.copy())

    def report(self, node_id: str, outcome: object) -> None:
        """Tell the master that ``node_id``'s daemon refused or dropped this client's connection
        (``outcome`` a ConnectionFailed; anything else is not reported), at most every
        :data:`REPORT_GAP_S`: it fences the node at once when the daemon's process is gone."""
        if not isinstance(outcome, ConnectionFailed):
            return
        self.mark_unreached(node_id)
        now = time.monotonic()
        if now - self._reported.get(node_id, -REPORT_GAP_S) >= REPORT_GAP_S:
            self._reported[node_id] = now
            self.reporter(node_id)


def _marked(marks: dict[str, float], node_id: str) -> bool:
    """Whether ``node_id``'s mark in ``marks`` (until a time.monotonic()) still holds; a spent one goes."""
    until = marks.get(node_id)
    if until is None:
        return False
    if time.monotonic() < until:
        return True
    marks.pop(node_id, None)
    return False
