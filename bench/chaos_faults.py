"""The faults of :mod:`bench.chaos` that need more than a signal, and the alerts it judges: network
partitions on loopback (:class:`Partitions`), full disks (:class:`SsdDisks`), a real Prometheus
with the project's alerting rules (:class:`Prometheus`) and which alerts fired for which fault
(:func:`judge_alerts`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.chaos_check import fault_class
from kvstore_cli.cluster import free_port
from kvstore_client.children import terminate

GROUPS = 47000
"""Group ids of the run's processes (partitions tell their packets apart by them): masters from here,
daemons from + 8 (LocalCluster.gid), client workers from + 16 (:func:`bench.chaos.worker_gid`)."""


class Partitions:
    """Network partitions on loopback. Every process of the run has a group id of its own (the
    cluster's ``groups``, the workers' ``setgid``) and iptables' owner match drops the TCP packets a
    group sends to the other side's listening ports, in a chain of this run's own that healing
    empties. One direction is enough to cut a connection (neither its requests nor its
    acknowledgements get through); where both sides listen both are cut. Needs root, iptables and
    the owner match. (This machine's cgroups cannot mark packets, and a cluster in namespaces
    would lose the shared-memory transport between a client and its daemon.)"""

    PREFIX = "KVSCHAOS"

    def __init__(self) -> None:
        self._remove_stale()
        self.chain = f"{self.PREFIX}{os.getpid()}"
        _iptables("-N", self.chain)
        try:
            _iptables("-I", "OUTPUT", "-o", "lo", "-p", "tcp", "-j", self.chain)
        except RuntimeError:
            _iptables("-X", self.chain)
            raise

    @staticmethod
    def possible() -> bool:
        """Whether this process may add an owner-matching rule (root, iptables, xt_owner)."""
        if os.geteuid() != 0 or shutil.which("iptables") is None:
            return False
        chain = f"KVSPROBE{os.getpid() % 100000}"
        try:
            _iptables("-N", chain)
        except RuntimeError:
            return False
        try:
            _iptables("-A", chain, "-p", "tcp", "-m", "owner", "--gid-owner", str(GROUPS), "-j", "DROP")
            return True
        except RuntimeError:
            return False
        finally:
            subprocess.run(["iptables", "-F", chain], capture_output=True, timeout=30, check=False)
            subprocess.run(["iptables", "-X", chain], capture_output=True, timeout=30, check=False)

    def cut(self, gids: Sequence[int | None], ports: Sequence[int], back_gids: Sequence[int | None] = (),
            back_ports: Sequence[int] = ()) -> None:  # fmt: skip
        """Drop what ``gids`` send to ``ports`` (and what ``back_gids`` send to ``back_ports``)."""
        for who, where in ((gids, ports), (back_gids, back_ports)):
            for gid in who:
                if gid is None:
                    raise ValueError("a partition needs the processes in groups of their own (LocalCluster groups=)")
                _iptables("-A", self.chain, "-p", "tcp", "-m", "owner", "--gid-owner", str(gid), "-m", "multiport",
                          "--dports", ",".join(map(str, where)), "-j", "DROP")  # fmt: skip

    def heal(self) -> None:
        _iptables("-F", self.chain)

    def remove(self) -> None:
        self._remove_chain(self.chain)

    @staticmethod
    def _remove_chain(chain: str) -> None:
        for args in (("-D", "OUTPUT", "-o", "lo", "-p", "tcp", "-j", chain), ("-F", chain), ("-X", chain)):
            subprocess.run(["iptables", "-w", "5", *args], capture_output=True, timeout=30, check=False)

    @classmethod
    def _remove_stale(cls) -> None:
        """The chains of runs that were killed before they could remove theirs (their process is gone)."""
        listed = subprocess.run(["iptables", "-w", "5", "-S"], capture_output=True, text=True, timeout=30)
        for line in listed.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "-N" and parts[1].startswith(cls.PREFIX):
                pid = parts[1].removeprefix(cls.PREFIX)
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    cls._remove_chain(parts[1])


def _iptables(*args: str) -> None:
    done = subprocess.run(["iptables", "-w", "5", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"iptables {' '.join(args)}: {done.stderr.strip()}")


def fill(path: Path) -> None:
    """Write ``path`` until its filesystem has no room left (ENOSPC). Unbuffered: a buffered file's
    close would flush what the full disk refused, and raise it (it once ended a run's faults)."""
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass


class SsdDisks:
    """A small tmpfs under each daemon's SSD directory (root only), so that a disk fills for real
    (``disk_full``) and leaves the machine's disks alone."""

    def __init__(self, workdir: Path, daemons: int, size: int) -> None:
        self.mounts: list[Path] = []
        for i in range(daemons):
            mount = workdir / f"ssd-{i}"
            mount.mkdir(parents=True, exist_ok=True)
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                                  capture_output=True, text=True, timeout=30)  # fmt: skip
            if done.returncode != 0:
                self.remove()
                raise SystemExit(f"disk_full needs a tmpfs for each SSD tier (root): {done.stderr.strip()}")
            self.mounts.append(mount)

    @staticmethod
    def possible() -> bool:
        """Whether this process may mount a tmpfs."""
        if os.geteuid() != 0 or shutil.which("mount") is None:
            return False
        with tempfile.TemporaryDirectory() as where:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", where], capture_output=True,
                                  timeout=30, check=False)  # fmt: skip
            if done.returncode != 0:
                return False
            subprocess.run(["umount", where], capture_output=True, timeout=30, check=False)
        return True

    def remove(self) -> None:
        for mount in self.mounts:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30, check=False)
        self.mounts = []


class Prometheus:
    """A real Prometheus (Debian's ``prometheus``) scraping the masters and the daemons every second with
    the rules of docker/prometheus/alerts.yml; afterwards, when each alert fired and resolved."""

    RULES = Path(__file__).resolve().parents[1] / "docker" / "prometheus" / "alerts.yml"

    def __init__(self, workdir: Path, masters: list[str], daemons: list[str]) -> None:
        self.dir = workdir / "prometheus"
        self.dir.mkdir()
        self.address = f"127.0.0.1:{free_port()}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(self.RULES)],
            "scrape_configs": [
                {"job_name": "kvstore-masters", "static_configs": [{"targets": masters}]},
                {"job_name": "kvstore-daemons", "static_configs": [{"targets": daemons}]},
            ],
        }
        (self.dir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        with open(self.dir / "prometheus.log", "a") as log:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={self.dir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address={self.address}"],
                stdout=log, stderr=log, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"Prometheus did not start (see {self.dir / 'prometheus.log'})")
            time.sleep(0.2)

    def firing(self, start: float, end: float) -> list[dict[str, Any]]:
        """Each stretch an alert fired between ``start`` and ``end`` (wall clock): name, labels, from, to
        (``to`` is None while it still fired at ``end``)."""
        query = urllib.parse.urlencode(
            {"query": 'ALERTS{alertstate="firing"}', "start": start, "end": end, "step": "1s"}
        )
        with urllib.request.urlopen(f"http://{self.address}/api/v1/query_range?{query}", timeout=30) as resp:
            series = json.loads(resp.read())["data"]["result"]
        out: list[dict[str, Any]] = []
        for one in series:
            labels = {k: v for k, v in one["metric"].items() if k not in ("__name__", "alertstate")}
            name = labels.pop("alertname", "?")
            times = sorted(float(t) for t, _ in one["values"])
            runs, begin, prev = [], times[0], times[0]
            for t in times[1:]:
                if t - prev > 1.5:  # a gap: it resolved, and fired again
                    runs.append((begin, prev))
                    begin = t
                prev = t
            runs.append((begin, prev))
            out += [{"alert": name, "labels": labels, "from": a, "to": None if b >= end - 2 else b} for a, b in runs]
        return out

    def stop(self) -> None:
        terminate(self.proc, 10)


def judge_alerts(firing: list[dict[str, Any]], faults: list[dict[str, Any]], calm: tuple[float, float] | None,
                 settle_s: float = 20.0) -> dict[str, Any]:  # fmt: skip
    """Which alerts fired for which fault (while it was on, or within ``settle_s`` of its healing),
    which fired in the calm stretch before the first fault, and which never resolved. Partitions
    count by :func:`~bench.chaos_check.fault_class` (a ``partition_client``, a client cut from a
    daemon, is seen by no server: none is counted as a fault without an alert)."""
    by_kind: dict[str, dict[str, int]] = {}
    silent: dict[str, int] = {}
    for f in faults:
        kind = fault_class(f)
        names = sorted({a["alert"] for a in firing if a["from"] <= f["wall1"] + settle_s
                        and (a["to"] is None or a["to"] >= f["wall0"])})  # fmt: skip
        seen = by_kind.setdefault(kind, {})
        for name in names:
            seen[name] = seen.get(name, 0) + 1
        if not names and kind != "partition_client":
            silent[kind] = silent.get(kind, 0) + 1
    in_calm = sorted({a["alert"] for a in firing if calm is not None and a["from"] < calm[1]
                      and (a["to"] is None or a["to"] >= calm[0])})  # fmt: skip
    return {"by_fault": by_kind, "faults_without_alert": silent, "in_calm": in_calm,
            "unresolved": sorted({a["alert"] for a in firing if a["to"] is None})}  # fmt: skip
