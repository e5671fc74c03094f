"""What the master measures of itself: latency histograms per request kind, and counters sampled
once a second for rates and the dashboard's history; and its Prometheus collector.

The service records into these; the admin API (:mod:`server.master.admin`) reads them for
``/api/v1/cluster`` and ``/api/v1/history``, and serves ``/metrics`` from :class:`MasterCollector`,
which reads the service at each scrape. Nothing here knows either: the collector reads them
through the protocols it declares.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, get_args

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvstore.placement.state import EvictionReason
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


# -- Prometheus -----------------------------------------------------------------------------------------
# What the collector reads of the master, as protocols: this module is the lowest layer of
# server.master (pyproject.toml's master-layers), so it names none of the classes that answer them
# (MasterService, PlacementTable, NodeRegistry, RpcServer, Answers, AdminGuard); mypy checks that
# they do where the admin API builds the collector.
class Liveness(Protocol):
    @property
    def up(self) -> bool: ...


class NodeReadings(Protocol):
    """One node as its view (server.master.nodes.NodeView) shows it."""

    @property
    def node_id(self) -> str: ...

    @property
    def info(self) -> Liveness: ...

    @property
    def tiers(self) -> Mapping[str, Mapping[str, int]]: ...

    @property
    def refusals(self) -> Mapping[str, int]: ...

    @property
    def transfer_bytes(self) -> Mapping[str, int]: ...


class RegistryReadings(Protocol):
    def views(self) -> Sequence[NodeReadings]: ...


class InspectionReadings(Protocol):
    def num_objects(self) -> int: ...


class AccountsReadings(Protocol):
    def tenant_held(self, tenant: str) -> int: ...


class TableReadings(Protocol):
    @property
    def counters(self) -> Mapping[str, int]: ...

    @property
    def inspection(self) -> InspectionReadings: ...

    @property
    def accounts(self) -> AccountsReadings: ...


class EvictionReadings(Protocol):
    @property
    def by_reason(self) -> Mapping[str, int]: ...


class RpcReadings(Protocol):
    @property
    def tenant_requests(self) -> Mapping[str, int]: ...


class AnswersReadings(Protocol):
    def __len__(self) -> int: ...

    @property
    def bytes(self) -> int: ...

    @property
    def dropped_early(self) -> int: ...

    @property
    def dropped_young(self) -> int: ...


class GuardReadings(Protocol):
    """The admin port's guard (server.master.admin_guard.AdminGuard)."""

    @property
    def open(self) -> int: ...

    @property
    def refused(self) -> int: ...

    @property
    def header_timeouts(self) -> int: ...

    @property
    def body_timeouts(self) -> int: ...


class ServiceReadings(Protocol):
    """The master's service (server.master.service.MasterService), as /metrics reads it."""

    @property
    def table(self) -> TableReadings: ...

    @property
    def nodes(self) -> RegistryReadings: ...

    @property
    def evictions(self) -> EvictionReadings: ...

    @property
    def rpc(self) -> RpcReadings: ...

    @property
    def answers(self) -> AnswersReadings: ...

    @property
    def latency(self) -> Mapping[str, LatencyHistogram]: ...

    @property
    def stalls(self) -> LoopStalls: ...

    @property
    def refused_connections(self) -> int: ...

    @property
    def rpc_errors(self) -> int: ...

    @property
    def requests_held(self) -> int: ...

    def quotas(self) -> Mapping[str, int]: ...

    def role(self) -> Mapping[str, Any]: ...

    def security(self) -> Mapping[str, int]: ...


class MasterCollector:
    """Reads the master's state at each scrape: nothing to keep in step."""

    def __init__(self, service: ServiceReadings, guard: GuardReadings) -> None:
        self.service = service
        self.guard = guard

    def collect(self) -> Iterator[Metric]:
        service = self.service
        table = service.table
        used = GaugeMetricFamily("kvstore_tier_bytes_used", "Bytes in use per node and tier.", labels=["node", "tier"])
        cap = GaugeMetricFamily("kvstore_tier_bytes_capacity", "Capacity per node and tier.", labels=["node", "tier"])
        blocks = GaugeMetricFamily("kvstore_tier_blocks", "Readable blocks per node and tier.", labels=["node", "tier"])
        leases = GaugeMetricFamily("kvstore_active_leases", "Blocks under a read lease, per node and tier.",
                                   labels=["node", "tier"])  # fmt: skip
        up = GaugeMetricFamily("kvstore_node_up", "1 while the node heartbeats.", labels=["node"])
        degraded = GaugeMetricFamily("kvstore_tier_degraded", "1 while a tier holds less than configured (its disk "
                                     "is full or failing).", labels=["node", "tier"])  # fmt: skip
        views = service.nodes.views()
        for view in views:
            for tier, u in view.tiers.items():
                used.add_metric([view.node_id, tier], u["used"])
                cap.add_metric([view.node_id, tier], u["capacity"])
                degraded.add_metric([view.node_id, tier], 1 if u["capacity"] < u["configured"] else 0)
                blocks.add_metric([view.node_id, tier], u["blocks"])
                leases.add_metric([view.node_id, tier], u["leased"])
            up.add_metric([view.node_id], 1 if view.info.up else 0)
        yield from (used, cap, blocks, leases, up, degraded)
        yield GaugeMetricFamily("kvstore_objects", "Stored keys.", value=table.inspection.num_objects())
        c = table.counters
        for name, help_text in (("hits", "Lookups that found the block."), ("misses", "Lookups that did not."),
                                ("evictions", "Blocks evicted."), ("demotions", "Blocks moved DRAM to SSD."),
                                ("demotions_failed", "Demotions the SSD tier could not take: dropped instead."),
                                ("promotions", "Blocks moved SSD to DRAM."), ("puts", "Blocks put."),
                                ("gets", "Blocks looked up."), ("expired", "Reservations expired."),
                                ("bytes_read", "Bytes of blocks handed to readers."),
                                ("bytes_written", "Bytes of blocks committed."),
                                ("orphans", "Blocks daemons held that no put placed there."),
                                ("room_refused_leased", "Puts and grants that found no room yet: what could be "
                                 "evicted is leased by readers or being written."),
                                ("room_refused_pinned", "Puts and grants refused: all DRAM is pinned."),
                                ("room_refused_tenants", "Tenants' puts and grants refused: the nodes are full "
                                 "of pinned and other tenants' blocks, which no tenant's put evicts."),
                                ("room_refused_suspects", "Puts and grants told to retry: the nodes that answer "
                                 "have no room now, and a suspected or unreachable node is not waited for."),
                                ("fences", "Nodes fenced: silent past their TTL, or their daemon gone."),
                                ("fences_refused", "Of the fences, those of a daemon whose port refused the "
                                 "master (its process gone): fenced at once, not after the TTL."),
                                ("suspicions", "Times a node missed two heartbeats, or a client or a command could "
                                 "not reach it and it did not answer the master's probe: new blocks went to other "
                                 "nodes first until its next heartbeat.")):  # fmt: skip
            yield CounterMetricFamily(f"kvstore_{name}", help_text, value=c[name])
        tenants = service.quotas()
        held = GaugeMetricFamily("kvstore_tenant_held_bytes", "Bytes a tenant holds or reserves (keys, puts in "
                                 "flight, grants), as its quota counts them.", labels=["tenant"])  # fmt: skip
        quota = GaugeMetricFamily("kvstore_tenant_quota_bytes", "A tenant's quota (tenants with one).",
                                  labels=["tenant"])  # fmt: skip
        for name, limit in tenants.items():
            held.add_metric([name], table.accounts.tenant_held(name))
            quota.add_metric([name], limit)
        yield from (held, quota)
        reasons = CounterMetricFamily("kvstore_evicted_by_reason", "Evictions this master logged (GET "
                                      "/api/v1/evictions), by reason.", labels=["reason"])  # fmt: skip
        for reason in get_args(EvictionReason):
            reasons.add_metric([reason], service.evictions.by_reason.get(reason, 0))
        yield reasons
        requests = CounterMetricFamily("kvstore_tenant_requests", "Requests a tenant's sessions sent this master.",
                                       labels=["tenant"])  # fmt: skip
        for name, count in sorted(service.rpc.tenant_requests.items()):
            requests.add_metric([name], count)
        yield requests
        role = service.role()
        yield GaugeMetricFamily("kvstore_master_leading", "1 while this master leads (and may serve).",
                                value=1 if role["role"] == "leader" else 0)  # fmt: skip
        yield GaugeMetricFamily("kvstore_master_ready", "1 while this master answers reads and puts.",
                                value=1 if role["ready"] else 0)  # fmt: skip
        yield GaugeMetricFamily("kvstore_master_epoch", "Leadership epoch (etcd revision of the leader key).",
                                value=role["epoch"])  # fmt: skip
        yield GaugeMetricFamily("kvstore_master_etcd_reachable", "1 while etcd answers this master (HA only).",
                                value=1 if role["etcd_reachable"] else 0)  # fmt: skip
        for name, help_text in (("failovers", "Times this master took over as leader."),
                                ("elections_won", "Elections this master won in etcd."),
                                ("leadership_lost", "Times this master lost its lease or resigned while leading."),
                                ("etcd_errors", "etcd requests of the election that failed.")):  # fmt: skip
            yield CounterMetricFamily(f"kvstore_master_{name}", help_text, value=role[name])
        yield CounterMetricFamily("kvstore_refused_connections", "Connections closed at accept (over the limit).",
                                  value=service.refused_connections)  # fmt: skip
        yield CounterMetricFamily("kvstore_rpc_errors", "RPC requests answered with an error.",
                                  value=service.rpc_errors)  # fmt: skip
        yield CounterMetricFamily("kvstore_master_requests_held", "Requests held until a master taking over was "
                                  "ready (instead of answered NotReady).", value=service.requests_held)  # fmt: skip
        security = service.security()
        guard = self.guard
        yield CounterMetricFamily("kvstore_admin_refused_connections", "Admin API connections answered 503 and "
                                  "closed: the cap was reached.", value=guard.refused)  # fmt: skip
        yield CounterMetricFamily("kvstore_admin_header_timeouts", "Admin API connections closed: no request head "
                                  "in time.", value=guard.header_timeouts)  # fmt: skip
        yield CounterMetricFamily("kvstore_admin_body_timeouts", "Admin API requests failed 408: no body in time.",
                                  value=guard.body_timeouts)  # fmt: skip
        yield GaugeMetricFamily("kvstore_admin_connections", "Open admin API connections.", value=guard.open)
        yield CounterMetricFamily("kvstore_auth_failures", "Handshakes refused (wrong or unknown credentials).",
                                  value=security["auth_failures"])  # fmt: skip
        yield CounterMetricFamily("kvstore_revoked_sessions", "Tenants' open sessions ended because the tenant was "
                                  "removed or its token replaced.", value=security["revoked_sessions"])  # fmt: skip
        yield CounterMetricFamily("kvstore_stalled_frames", "Connections closed because a frame they began did not "
                                  "arrive whole within frame_timeout_s (its buffer freed).",
                                  value=security["stalled_frames"])  # fmt: skip
        yield CounterMetricFamily("kvstore_refused_inflight", "Tenants' connections closed because their frames in "
                                  "flight took the tenant past its cap (max_inflight_bytes).",
                                  value=security["refused_inflight"])  # fmt: skip
        yield CounterMetricFamily("kvstore_refused_sessions", "Tenants' logins refused because the tenant had as "
                                  "many sessions open as it may (max_sessions).",
                                  value=security["refused_sessions"])  # fmt: skip
        yield CounterMetricFamily("kvstore_tenants_file_errors", "Reloads of the tenants file that failed (the last"
                                  " good one serves meanwhile).", value=security["tenants_file_errors"])  # fmt: skip
        yield GaugeMetricFamily("kvstore_tenants_file_bad", "1 while the tenants file on disk does not load.",
                                value=security["tenants_file_bad"])  # fmt: skip
        yield GaugeMetricFamily("kvstore_tenants_legacy_verifiers", "Tenants whose token the file keeps as a sha256 "
                                "(rotate them: a stolen file plus a recorded login gives those away).",
                                value=security["legacy_verifiers"])  # fmt: skip
        yield GaugeMetricFamily("kvstore_master_answers_kept", "Replies kept for clients' retries (at most "
                                "KVSTORE_MASTER_ANSWER_CACHE).", value=len(service.answers))  # fmt: skip
        yield GaugeMetricFamily("kvstore_master_answers_bytes", "Encoded bytes of the replies kept for retries.",
                                value=service.answers.bytes)  # fmt: skip
        yield CounterMetricFamily("kvstore_master_answers_dropped_early", "Replies dropped for the bound before "
                                  "their time: a retry of one runs again.",
                                  value=service.answers.dropped_early)  # fmt: skip
        yield CounterMetricFamily("kvstore_master_answers_dropped_young", "Replies dropped for the bound while "
                                  "their clients may still retry (younger than 10 s): such a retry runs again.",
                                  value=service.answers.dropped_young)  # fmt: skip
        refused = CounterMetricFamily("kvstore_daemon_refusals", "What daemons refused, by kind: connections over a "
                                      "limit, failed or late logins, tenants' sessions cut, replayed reservations.",
                                      labels=["node", "kind"])  # fmt: skip
        for view in views:
            for kind, value in sorted(view.refusals.items()):
                refused.add_metric([view.node_id, kind], value)
        yield refused
        transfer = CounterMetricFamily("kvstore_transfer_bytes", "Bytes moved by daemons, by transport and rail.",
                                       labels=["node", "transport", "rail", "direction"])  # fmt: skip
        for view in views:
            for name, value in sorted(view.transfer_bytes.items()):
                transport, rail, direction = name.split("|", 2)
                transfer.add_metric([view.node_id, transport, rail, direction], value)
        yield transfer
        for op, hist in sorted(service.latency.items()):
            family = HistogramMetricFamily(f"kvstore_{op}_latency_seconds", f"Master time per {op} request.",
                                           labels=[])  # fmt: skip
            family.add_metric([], hist.buckets(), hist.total)
            yield family
        stalls = service.stalls
        lag = HistogramMetricFamily("kvstore_master_loop_lag_seconds", "How late the event loop woke a probe "
                                    "that asks to wake every 10 ms: what one request's work made every other wait.",
                                    labels=[])  # fmt: skip
        lag.add_metric([], stalls.histogram.buckets(), stalls.histogram.total)
        yield lag
        yield GaugeMetricFamily("kvstore_master_loop_stall_max_seconds", "The longest the event loop went without "
                                "turning since the master started.", value=stalls.max_s)  # fmt: skip
