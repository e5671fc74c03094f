"""The alerting rules of docker/prometheus/alerts.yml load in Prometheus's own checker, and fire (and
stay quiet) as their unit tests say: promtool, from Debian's prometheus package."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstore_cli.cluster import LocalCluster
from tests.conftest import admin_call

RULES = Path(__file__).resolve().parents[2] / "docker" / "prometheus"
pytestmark = pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool (Debian: apt install prometheus)")


def _promtool(*args: str) -> str:
    done = subprocess.run(["promtool", *args], cwd=RULES, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_rules_load() -> None:
    assert "SUCCESS: 18 rules found" in _promtool("check", "rules", "alerts.yml")


def test_the_rules_fire_as_their_unit_tests_say() -> None:
    assert "SUCCESS" in _promtool("test", "rules", "alerts_test.yml")


def test_every_metric_a_rule_names_is_one_a_master_or_a_daemon_serves() -> None:
    """A rule over a metric nobody exports never fires: each name in alerts.yml is in a live master's
    or daemon's /metrics (a family with no samples yet still has its TYPE line)."""
    rules = (RULES / "alerts.yml").read_text()
    names = set(re.findall(r"\bkvstore_[a-z_]+", rules))
    with LocalCluster(1, dram="16MiB", ssd="16MiB", admin=True, daemon_metrics=True) as cluster:
        status, text = admin_call(cluster.admin_address, "GET", "/metrics")
        assert status == 200
        status, own = admin_call(cluster.daemon_metrics[0], "GET", "/metrics")
        assert status == 200
    typed = {line.split()[2] for line in (text + own).splitlines() if line.startswith("# TYPE ")}
    missing = [n for n in sorted(names) if n not in typed and n.removesuffix("_total") not in typed]
    assert not missing, missing
