#!/usr/bin/env python3
"""Write docker/grafana/kvstore.json, the Grafana dashboard of a kvstore cluster, from Python.

Built with grafana-foundation-sdk (its 11.6 line: the models of Grafana 11.6's dashboard schema,
the Grafana docker/compose.yaml pins), over the metrics the masters' admin APIs and the daemons'
--metrics-port serve, scraped as docker/prometheus/prometheus.yml and deploy/kubernetes/monitoring
scrape them (jobs kvstore-masters and kvstore-daemons). tests/integration/test_grafana.py checks
that the file is what this script writes, that it loads in those models unchanged, and that every
metric a query names is one a live master or daemon serves.

    python docker/grafana/dashboard.py        # after changing a panel, or a metric's name
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders.common import ReduceDataOptions, VizLegendOptions, VizTooltipOptions
from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.stat import Panel as Stat
from grafana_foundation_sdk.builders.table import Panel as Table
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BigValueGraphMode,
    LegendDisplayMode,
    LegendPlacement,
    SortOrder,
    TooltipDisplayMode,
)
from grafana_foundation_sdk.models.dashboard import DataSourceRef

OUT = Path(__file__).resolve().parent / "kvstore.json"
SOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
MASTERS = 'job="kvstore-masters"'
DAEMONS = 'job="kvstore-daemons"'


def query(expr: str, legend: str = "", ref: str = "A", instant: bool = False) -> Dataquery:
    q = Dataquery().expr(expr).ref_id(ref).datasource(SOURCE)
    if legend:
        q = q.legend_format(legend)
    return q.instant() if instant else q.range()


def series(title: str, unit: str, *queries: Dataquery, desc: str = "", w: int = 12, h: int = 8) -> Timeseries:
    panel = (
        Timeseries().title(title).unit(unit).datasource(SOURCE).height(h).span(w).description(desc)
        .legend(VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST)
                .placement(LegendPlacement.BOTTOM).calcs([]))
        .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING))
    )  # fmt: skip
    for q in queries:
        panel = panel.with_target(q)
    return panel


def stat(title: str, unit: str, expr: str) -> Stat:
    """A single figure: the last value of an instant query."""
    return (
        Stat().title(title).unit(unit).datasource(SOURCE).height(4).span(6).graph_mode(BigValueGraphMode.NONE)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .with_target(query(expr, instant=True))
    )  # fmt: skip


def rate(name: str, by: str = "", window: str = "1m") -> str:
    """The masters' rate of counter ``name``: summed over masters (a standby's are 0)."""
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({name}{{{MASTERS}}}[{window}]))"


def panels() -> list[Row | Stat | Timeseries | Table]:
    """The rows and panels, in order (the builder lays them out left to right, 24 columns a line)."""
    hits, misses = rate("kvstore_hits_total"), rate("kvstore_misses_total")
    hits5, misses5 = rate("kvstore_hits_total", window="5m"), rate("kvstore_misses_total", window="5m")
    firing = 'ALERTS{alertstate="firing", alertname=~"Kvstore.*"}'
    latency = [
        query(
            f"histogram_quantile({q}, sum by (le) (rate(kvstore_{op}_latency_seconds_bucket{{{MASTERS}}}[1m])))",
            f"{op} p{int(q * 100)}",
            ref,
        )
        for ref, (op, q) in zip(
            "ABCD",
            [("get_replicas", 0.5), ("get_replicas", 0.99), ("put_start", 0.5), ("put_start", 0.99)],
            strict=True,
        )
    ]
    by_node_tier = "{{node}} {{tier}}"
    return [
        Row("Cache"),
        stat("hit rate (5 min)", "percentunit", f"{hits5} / ({hits5} + {misses5})"),
        stat("objects", "short", f"max (kvstore_objects{{{MASTERS}}})"),
        stat("nodes up", "short", f"sum (max by (node) (kvstore_node_up{{{MASTERS}}}))"),
        stat("alerts firing", "short", f"count ({firing}) or vector(0)"),
        series(
            "hit rate", "percentunit", query(f"{hits} / ({hits} + {misses})", "hit rate"),
            desc="Lookups that found their block, of all lookups.",
        ),
        series(
            "operations per second", "ops",
            query(rate("kvstore_gets_total"), "blocks looked up", "A"),
            query(rate("kvstore_puts_total"), "blocks put", "B"),
            query(rate("kvstore_hits_total"), "hits", "C"),
        ),
        series(
            "bytes per second", "Bps",
            query(rate("kvstore_bytes_read_total"), "read", "A"),
            query(rate("kvstore_bytes_written_total"), "written", "B"),
            query(
                f"sum by (transport, direction) (rate(kvstore_transfer_bytes_total{{{MASTERS}}}[1m]))",
                "daemons {{transport}} {{direction}}", "C",
            ),
        ),
        series(
            "master latency", "s", *latency,
            desc="Master time per request: get_replicas (a get's lookup), put_start (a put's placement).",
        ),
        Row("Tiers"),
        series(
            "used per node and tier", "bytes",
            query(f"max by (node, tier) (kvstore_tier_bytes_used{{{MASTERS}}})", by_node_tier),
        ),
        series(
            "capacity per node and tier", "bytes",
            query(f"max by (node, tier) (kvstore_tier_bytes_capacity{{{MASTERS}}})", by_node_tier),
            desc="Below what is configured while a disk is full or failing.",
        ),
        series(
            "evictions by reason", "ops",
            query(rate("kvstore_evicted_by_reason_total", "reason", "5m"), "{{reason}}", "A"),
            query(rate("kvstore_demotions_total", window="5m"), "demoted to SSD", "B"),
            query(rate("kvstore_promotions_total", window="5m"), "promoted to DRAM", "C"),
        ),
        series(
            "daemons: silence from the masters", "s",
            query(f"max by (node) (kvstore_daemon_master_silence_seconds{{{DAEMONS}}})", "{{node}}"),
            desc="Each daemon's own view: past 3 s, KvstoreDaemonCutFromMaster.",
        ),
        Row("Tenants"),
        series(
            "held of quota", "percentunit",
            query(
                f"max by (tenant) (kvstore_tenant_held_bytes{{{MASTERS}}}) / max by (tenant) "
                f"(kvstore_tenant_quota_bytes{{{MASTERS}}})",
                "{{tenant}}",
            ),
            desc="Past 90% for 5 minutes: KvstoreQuotaPressure.",
        ),
        series(
            "master requests per second", "reqps",
            query(rate("kvstore_tenant_requests_total", "tenant"), "{{tenant}}"),
        ),
        Row("Leadership and alerts"),
        series(
            "leader", "short",
            query(f"max by (instance) (kvstore_master_leading{{{MASTERS}}})", "{{instance}}", "A"),
            query(f"max (kvstore_master_epoch{{{MASTERS}}})", "epoch", "B"),
            desc="1 for the master that leads; the epoch grows at each new leader.",
        ),
        series(
            "leader changes", "short",
            query(f"sum (increase(kvstore_master_failovers_total{{{MASTERS}}}[5m]))", "takeovers (5 min)"),
            desc="More than 3 in 10 minutes: KvstoreFailoverStorm.",
        ),
        Table().title("alerts firing").datasource(SOURCE).height(8).span(24).show_header(True)
        .with_target(query(firing, instant=True)),
    ]  # fmt: skip


def build() -> Dashboard:
    board = (
        Dashboard("kvstore")
        .uid("kvstore")
        .description(
            "A kvstore cluster: cache hits, traffic, master latency, tiers per node, evictions, tenants, leadership"
            " and alerts (docker/grafana/dashboard.py writes it)."
        )
        .tags(["kvstore", "kvcache"])
        .refresh("10s")
        .time("now-1h", "now")
        .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    for item in panels():
        board = board.with_row(item) if isinstance(item, Row) else board.with_panel(item)
    return board


def rendered() -> str:
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main() -> int:
    OUT.write_text(rendered())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
