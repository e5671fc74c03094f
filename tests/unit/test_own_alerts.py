"""A master's own view of the alerting rules (server.master.alerts): the same rules as
docker/prometheus/alerts.yml, with the same thresholds, windows and ``for`` durations."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from server.master.alerts import EVERY_S, NOT_JUDGED, RULES, OwnAlerts, Samples

ALERTS = Path(__file__).resolve().parents[2] / "docker" / "prometheus" / "alerts.yml"
CALM = {"ha": True, "leader_known": True}


def rules_file() -> dict[str, dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {r["alert"]: r for g in groups for r in g["rules"]}


def seconds(text: str | None) -> float:
    if not text:
        return 0.0
    m = re.fullmatch(r"(\d+)([smh])", text)
    assert m, text
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def test_every_rule_of_the_file_is_judged_here_or_said_why_not() -> None:
    wanted = rules_file()
    judged = {r.name: r for r in RULES}
    assert set(judged) | set(NOT_JUDGED) == set(wanted)
    assert not set(judged) & set(NOT_JUDGED)
    for name, rule in judged.items():
        assert rule.severity == wanted[name]["labels"]["severity"], name
        assert rule.for_s == seconds(wanted[name].get("for")), name


def test_the_metrics_each_rule_reads_are_the_ones_its_expression_names() -> None:
    wanted = rules_file()
    for rule in RULES:
        mine = set(re.findall(r"kvstore_[a-z_]+", _line_of(rule.name)))
        theirs = set(re.findall(r"kvstore_[a-z_]+", wanted[rule.name]["expr"]))
        assert mine == theirs, (rule.name, mine, theirs)


def _line_of(name: str) -> str:
    """The source of rule ``name`` in server/master/alerts.py, with the helpers it calls."""
    text = (Path(__file__).resolve().parents[2] / "server" / "master" / "alerts.py").read_text()
    block = text[text.index(f'Rule("{name}"') :]
    block = block[: block.index("\n    Rule(") if "\n    Rule(" in block else block.index("\n)")]
    for helper in re.findall(r"(_quota_used)\(", block):
        body = text[text.index(f"def {helper}(") :]
        block += body[: body.index("\n\n")]
    return block


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


CALM_GAUGES: Samples = {
    "kvstore_master_leading": {(): 1.0}, "kvstore_master_ready": {(): 1.0}, "kvstore_master_etcd_reachable": {(): 1.0}
}  # fmt: skip
"""A master that leads, is ready and reaches etcd."""


def run(alerts: OwnAlerts, clock: Clock, samples: Samples, facts: dict[str, Any] | None = None) -> set[str]:
    """One sample (``samples`` over a calm leader's gauges) ``EVERY_S`` after the last; the alerts firing."""
    clock.t += EVERY_S
    alerts.sample({**CALM_GAUGES, **samples}, facts or CALM)
    return {a.name for a in alerts.firing()}


def test_a_node_down_fires_at_once_with_its_label() -> None:
    clock = Clock()
    alerts = OwnAlerts(clock)
    up = {"kvstore_node_up": {(("node", "n0"),): 1.0, (("node", "n1"),): 1.0}}
    assert run(alerts, clock, up) == set()
    down = {"kvstore_node_up": {(("node", "n0"),): 1.0, (("node", "n1"),): 0.0}}
    assert run(alerts, clock, down) == {"KvstoreNodeDown"}
    (alert,) = alerts.firing()
    assert alert.labels == {"node": "n1"} and alert.severity == "warning" and "n1" in alert.summary
    assert run(alerts, clock, up) == set()


def test_a_for_clause_waits_and_a_break_starts_it_again() -> None:
    clock = Clock()
    alerts = OwnAlerts(clock)
    tenant = (("tenant", "a"),)
    full = {"kvstore_tenant_held_bytes": {tenant: 95.0}, "kvstore_tenant_quota_bytes": {tenant: 100.0}}
    calm = {"kvstore_tenant_held_bytes": {tenant: 50.0}, "kvstore_tenant_quota_bytes": {tenant: 100.0}}
    fired_after = None
    for i in range(80):
        if run(alerts, clock, full) == {"KvstoreQuotaPressure"}:
            fired_after = i * EVERY_S
            break
    assert fired_after == 300  # for: 5m
    assert run(alerts, clock, calm) == set()
    assert run(alerts, clock, full) == set()  # holding again from now


def test_leader_changes_and_storms_count_takeovers_over_their_windows() -> None:
    clock = Clock()
    alerts = OwnAlerts(clock)
    count = 0.0

    def failovers() -> Samples:
        return {"kvstore_master_failovers_total": {(): count}}

    for _ in range(130):  # 650 s of a calm master: older than every window
        assert run(alerts, clock, failovers()) == set()
    count = 1
    assert run(alerts, clock, failovers()) == {"KvstoreLeaderChanged"}
    for _ in range(12):
        run(alerts, clock, failovers())
    assert run(alerts, clock, failovers()) == set()  # a minute later
    for _ in range(3):
        count += 1
        run(alerts, clock, failovers())
    assert run(alerts, clock, failovers()) == {"KvstoreLeaderChanged", "KvstoreFailoverStorm"}  # 4 in 10 minutes


def test_a_series_first_seen_within_a_window_counts_from_its_first_sample() -> None:
    """As Prometheus's increase(): a master's first takeover, counted before its first sample, is no
    leader change; a refusal after it is."""
    clock = Clock()
    alerts = OwnAlerts(clock)
    first = {"kvstore_master_failovers_total": {(): 1.0}, "kvstore_room_refused_pinned_total": {(): 2.0}}
    assert run(alerts, clock, first) == set()
    later = {"kvstore_master_failovers_total": {(): 1.0}, "kvstore_room_refused_pinned_total": {(): 3.0}}
    assert run(alerts, clock, later) == {"KvstoreRoomRefusedPinned"}


def test_facts_of_the_role_drive_the_leadership_rules() -> None:
    clock = Clock()
    alerts = OwnAlerts(clock)
    lost = {**CALM, "leader_known": False}
    gauges = {"kvstore_master_leading": {(): 0.0}, "kvstore_master_ready": {(): 0.0},
              "kvstore_master_etcd_reachable": {(): 0.0}}  # fmt: skip
    seen = set()
    for _ in range(8):
        seen |= run(alerts, clock, gauges, lost)
    assert seen == {"KvstoreNoLeader", "KvstoreEtcdUnreachable"}
    alerts = OwnAlerts(clock)
    assert all(run(alerts, clock, gauges, {**CALM, "ha": False}) == set() for _ in range(8))  # no etcd to reach
    not_ready = {**gauges, "kvstore_master_leading": {(): 1.0}, "kvstore_master_etcd_reachable": {(): 1.0}}
    alerts = OwnAlerts(clock)
    assert all(run(alerts, clock, not_ready) == set() for _ in range(5))
    for _ in range(2):
        run(alerts, clock, not_ready)
    assert run(alerts, clock, not_ready) == {"KvstoreLeaderNotReady"}


@pytest.mark.parametrize(
    ("kind", "fires"), [("auth_failed", True), ("orphans_dropped", False), ("cached_refused", False)]
)
def test_daemon_refusals_of_routine_kinds_are_no_auth_spike(kind: str, fires: bool) -> None:
    clock = Clock()
    alerts = OwnAlerts(clock)
    n = 0.0
    fired = set()
    for _ in range(30):
        n += 10 * EVERY_S  # 10 a second
        fired |= run(alerts, clock, {"kvstore_daemon_refusals_total": {(("kind", kind), ("node", "n0")): n}})
    assert ("KvstoreAuthFailuresSpiking" in fired) is fires
