"""The alerts a master can judge by itself: docker/prometheus/alerts.yml's rules over its own metrics.

Prometheus evaluates alerts.yml over every master's and daemon's scrapes; where no Prometheus runs
(or the dashboard is not given its URL) the master judges the same rules over its own /metrics,
sampled every :data:`EVERY_S` for :data:`KEEP_S`: the same metric names, thresholds, windows and
``for`` durations. What it cannot judge from one process is listed in :data:`NOT_JUDGED` with the
reason (a scrape that failed, the other masters' view, a daemon's own metrics); a test checks that
the two lists together are alerts.yml's rules, with the same severities and durations.

One master's view differs from Prometheus's where the rule sums over masters: a standby does not
see the leader's failovers, and KvstoreNoLeader is this master's word that etcd names no leader. And
KvstoreEtcdUnreachable is judged only for a master that runs with etcd (the gauge is 0 without).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Labels = tuple[tuple[str, str], ...]
Series = dict[Labels, float]
Samples = dict[str, Series]
"""Metric name (as exposed: counters with ``_total``) -> labels -> value."""

EVERY_S = 5.0
"""Seconds between samples (Prometheus's scrape interval in docker/prometheus/prometheus.yml)."""

KEEP_S = 660.0
"""How far back samples are kept: the longest window of a rule (10 minutes) and a sample more."""

NOT_JUDGED = {
    "KvstoreMasterUnreachable": "a failed scrape of a master: Prometheus's view",
    "KvstoreSplitBrain": "the masters' leading gauges summed: Prometheus's view (each master knows only its own)",
    "KvstoreDaemonUnreachable": "a failed scrape of a daemon: Prometheus's view (the master's is KvstoreNodeDown)",
    "KvstoreDaemonCutFromMaster": "a daemon's own metrics (its silence from the masters)",
    "KvstoreDaemonLoopFailing": "a daemon's own metrics (its background loops)",
}
"""alerts.yml's rules no single master can judge, and why."""


@dataclass(frozen=True)
class Alert:
    """A rule that holds now for a series, and has held for at least its ``for``."""

    name: str
    severity: str
    labels: dict[str, str]
    value: float
    since_s: float
    """Seconds it has held (as far back as this master's samples reach)."""
    summary: str


class View:
    """The samples a rule reads: the newest, and increases over a window."""

    def __init__(self, points: deque[tuple[float, Samples]]) -> None:
        self._points = points

    def now(self, name: str) -> Series:
        return dict(self._points[-1][1].get(name, {})) if self._points else {}

    def increase(self, name: str, window_s: float) -> Series:
        """How much counter ``name`` grew over the last ``window_s``, per series: from its sample at the
        window's start, or its first sample within it (as Prometheus's ``increase`` takes a series it
        first saw within the window: a master's first takeover, counted at its start, is no change);
        a series that went back counts from its new value."""
        if not self._points:
            return {}
        t, newest = self._points[-1]
        base: Series = {}
        for at, samples in self._points:  # oldest first: the last sample at the window's start, else the first in it
            for labels, value in samples.get(name, {}).items():
                if at <= t - window_s or labels not in base:
                    base[labels] = value
        out = {}
        for labels, value in newest.get(name, {}).items():
            before = base.get(labels, value)
            out[labels] = value - before if value >= before else value
        return out

    def rate(self, name: str, window_s: float) -> Series:
        return {labels: v / window_s for labels, v in self.increase(name, window_s).items()}


def _by(series: Series, *keep: str, how: Callable[[Iterable[float]], float] = sum) -> Series:
    """``sum by (keep)`` (or ``max``, with ``how``) of ``series``."""
    groups: dict[Labels, list[float]] = {}
    for labels, value in series.items():
        key = tuple((k, v) for k, v in labels if k in keep)
        groups.setdefault(key, []).append(value)
    return {key: how(values) for key, values in groups.items()}


def _over(series: Series, threshold: float) -> Series:
    return {labels: v for labels, v in series.items() if v > threshold}


def _equal(series: Series, value: float) -> Series:
    return {labels: v for labels, v in series.items() if v == value}


def _when(condition: bool, value: float = 1.0) -> Series:
    return {(): value} if condition else {}


def _on(v: View, gauge: str) -> bool:
    """Whether 0/1 gauge ``gauge`` (of this master, no labels) is 1 now."""
    return v.now(gauge).get((), 0.0) == 1.0


@dataclass(frozen=True)
class Rule:
    name: str
    severity: str
    for_s: float
    holds: Callable[[View, Mapping[str, Any]], Series]
    """The series for which the rule's expression holds now (``facts``: see :meth:`OwnAlerts.sample`)."""
    summary: Callable[[dict[str, str], float], str]


RULES = (
    Rule("KvstoreNoLeader", "page", 10,
         lambda v, f: _when(not _on(v, "kvstore_master_leading") and not f["leader_known"]),
         lambda lb, x: "no master leads: puts and gets fail until one is elected"),
    Rule("KvstoreLeaderChanged", "warning", 0,
         lambda v, f: _over(_by(v.increase("kvstore_master_failovers_total", 60)), 0),
         lambda lb, x: "this master took over as leader in the last minute"),
    Rule("KvstoreFailoverStorm", "page", 0,
         lambda v, f: _over(_by(v.increase("kvstore_master_failovers_total", 600)), 3),
         lambda lb, x: f"this master took over {x:.0f} times in 10 minutes"),
    Rule("KvstoreLeaderNotReady", "page", 30,
         lambda v, f: _when(_on(v, "kvstore_master_leading") and not _on(v, "kvstore_master_ready")),
         lambda lb, x: "this master leads but does not answer reads and puts (waiting for its nodes)"),
    Rule("KvstoreEtcdUnreachable", "warning", 30,
         lambda v, f: _when(f["ha"] and not _on(v, "kvstore_master_etcd_reachable")),
         lambda lb, x: "etcd does not answer this master"),
    Rule("KvstoreAnswersCacheAtBound", "warning", 0,
         lambda v, f: _over(_by(v.increase("kvstore_master_answers_dropped_young_total", 600)), 0),
         lambda lb, x: f"{x:.0f} replies dropped for the bound while their clients may still retry"),
    Rule("KvstoreNodeDown", "warning", 0,
         lambda v, f: _equal(_by(v.now("kvstore_node_up"), "node", how=max), 0),
         lambda lb, x: f"node {lb.get('node')} stopped heartbeating: its blocks are not served"),
    Rule("KvstoreTierDegraded", "warning", 0,
         lambda v, f: _equal(_by(v.now("kvstore_tier_degraded"), "node", "tier", how=max), 1),
         lambda lb, x: f"{lb.get('tier')} tier of {lb.get('node')} holds less than configured"),
    Rule("KvstoreDemotionsFailing", "warning", 0,
         lambda v, f: _over(_by(v.increase("kvstore_demotions_failed_total", 300)), 0),
         lambda lb, x: "DRAM blocks are dropped instead of demoted to SSD (the SSD tier refuses writes)"),
    Rule("KvstoreRoomRefusedPinned", "page", 0,
         lambda v, f: _over(_by(v.increase("kvstore_room_refused_pinned_total", 300)), 0),
         lambda lb, x: "puts refused: every node's DRAM is pinned, nothing can be evicted for them"),
    Rule("KvstoreRoomRefusedLeased", "warning", 300,
         lambda v, f: _over(_by(v.rate("kvstore_room_refused_leased_total", 300)), 1),
         lambda lb, x: f"puts keep waiting for room held by read leases or puts in flight ({x:.1f}/s)"),
    Rule("KvstoreQuotaPressure", "warning", 300,
         lambda v, f: _over(_quota_used(v), 0.9),
         lambda lb, x: f"tenant {lb.get('tenant')} holds {100 * x:.0f}% of its quota"),
    Rule("KvstoreAuthFailuresSpiking", "warning", 60,
         lambda v, f: {**_over(_by(v.rate("kvstore_auth_failures_total", 300)), 0.5),
                       **_over(_by(_refusals(v.rate("kvstore_daemon_refusals_total", 300)), "kind"), 0.5)},
         lambda lb, x: f"logins or daemon connections are being refused at {x:.1f}/s"),
)  # fmt: skip
"""The rules this master judges, each as alerts.yml states it (name, severity, ``for``)."""


def _quota_used(v: View) -> Series:
    held = _by(v.now("kvstore_tenant_held_bytes"), "tenant", how=max)
    quota = _by(v.now("kvstore_tenant_quota_bytes"), "tenant", how=max)
    return {labels: held.get(labels, 0.0) / q for labels, q in quota.items() if q > 0}


def _refusals(series: Series) -> Series:
    return {labels: v for labels, v in series.items() if dict(labels).get("kind") not in ("orphans_dropped",
                                                                                      "cached_refused")}  # fmt: skip


class OwnAlerts:
    """:data:`RULES` over this master's samples: which hold, since when, and which have held long enough."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._points: deque[tuple[float, Samples]] = deque()
        self._holding: dict[tuple[str, Labels], float] = {}
        """(rule, series) -> when it began to hold, for the ``for`` clauses."""
        self._firing: list[Alert] = []

    def due(self) -> bool:
        return not self._points or self.clock() - self._points[-1][0] >= EVERY_S

    def sample(self, samples: Samples, facts: Mapping[str, Any]) -> None:
        """Record the metrics now and judge every rule (``facts``: ``ha``, whether this master runs
        with etcd; ``leader_known``, whether it knows of a leader, itself or another)."""
        now = self.clock()
        self._points.append((now, samples))
        while self._points and self._points[0][0] < now - KEEP_S:
            self._points.popleft()
        view = View(self._points)
        holding: dict[tuple[str, Labels], float] = {}
        firing = []
        for rule in RULES:
            for labels, value in rule.holds(view, facts).items():
                since = self._holding.get((rule.name, labels), now)
                holding[(rule.name, labels)] = since
                if now - since >= rule.for_s:
                    named = dict(labels)
                    firing.append(Alert(rule.name, rule.severity, named, value, round(now - since, 1),
                                        rule.summary(named, value)))  # fmt: skip
        self._holding = holding
        self._firing = firing

    def firing(self) -> list[Alert]:
        """The alerts firing at the last sample."""
        return list(self._firing)


def samples_of(families: Iterable[Any]) -> Samples:
    """Samples of Prometheus metric families (a collector's ``collect()``), by exposed name."""
    out: Samples = {}
    for family in families:
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = float(sample.value)
    return out
