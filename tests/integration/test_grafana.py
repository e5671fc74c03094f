"""docker/grafana/kvstore.json: what docker/grafana/dashboard.py writes, loads in Grafana's dashboard
schema of the version docker/compose.yaml pins (grafana-foundation-sdk's models of that version)
unchanged, and every metric its queries name is one a live master or daemon serves."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from kvstore_cli.cluster import LocalCluster
from kvstore_client.store import Store
from tests.conftest import admin_call

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "docker" / "grafana"
pytest.importorskip("grafana_foundation_sdk", reason="grafana-foundation-sdk (the test extra) is not installed")

PROMETHEUS_OWN = {"ALERTS"}
"""Series Prometheus itself makes (from the alerting rules), not a master or daemon."""


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grafana_dashboard", GRAFANA / "dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((GRAFANA / "kvstore.json").read_text())
    return data


def expressions(data: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in data["panels"] for t in p.get("targets", [])]


def test_the_file_is_what_the_generator_writes() -> None:
    assert (GRAFANA / "kvstore.json").read_text() == generator().rendered(), "run docker/grafana/dashboard.py"


def test_it_loads_unchanged_in_the_dashboard_schema_of_the_pinned_grafana() -> None:
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    sdk = importlib.metadata.version("grafana-foundation-sdk").split("!")[-1]
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    image = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", compose["services"]["grafana"]["image"])
    assert image.startswith("grafana/grafana:")
    pinned = image.split(":", 1)[1]
    assert pinned.split(".")[:2] == sdk.split(".")[:2], f"compose pins Grafana {pinned}, the schema is {sdk}'s"
    data = dashboard()
    back = json.loads(json.dumps(Dashboard.from_json(data), cls=JSONEncoder))
    assert back == data  # a field the schema does not know is dropped on the way
    stray = json.loads(json.dumps(data))
    stray["panels"][1]["fieldConfigg"] = {}
    assert json.loads(json.dumps(Dashboard.from_json(stray), cls=JSONEncoder)) != stray
    titles = {p["title"] for p in data["panels"]}
    for wanted in ("hit rate", "operations per second", "bytes per second", "master latency", "used per node and "
                   "tier", "evictions by reason", "held of quota", "leader changes", "alerts firing"):  # fmt: skip
        assert wanted in titles


def test_every_metric_a_query_names_is_one_a_master_or_a_daemon_serves() -> None:
    names: set[str] = set()
    for expr in expressions(dashboard()):
        names |= set(re.findall(r"\bkvstore_[a-z_]+", expr))
        others = set(re.findall(r"\b([A-Za-z_:][A-Za-z0-9_:]*)\{", expr)) - names
        assert others <= PROMETHEUS_OWN, others
    assert "kvstore_tenant_requests_total" in names and "kvstore_evicted_by_reason_total" in names
    token = "grafana-test"
    with LocalCluster(1, dram="16MiB", ssd="16MiB", admin=True, daemon_metrics=True, authenticate=True,
                      env={"KVSTORE_ADMIN_TOKEN": token}) as cluster:  # fmt: skip
        cluster.add_tenant("grafana", quota=1 << 20)  # tenants' series
        with Store.connect(cluster.master_address, config=cluster.client_config()) as store:
            store.put("g", b"g")  # the latency histograms' series: one of each request
            assert store.get("g") == b"g"
        status, text = admin_call(cluster.admin_address, "GET", "/metrics", token=token)
        assert status == 200
        status, own = admin_call(cluster.daemon_metrics[0], "GET", "/metrics")
        assert status == 200
    typed = {line.split()[2] for line in (text + own).splitlines() if line.startswith("# TYPE ")}
    missing = sorted(
        n for n in names if n not in typed and n.removesuffix("_total") not in typed and n.removesuffix("_bucket")
        not in typed
    )  # fmt: skip
    assert not missing, missing
