"""A daemon's own Prometheus metrics (``kvstore daemon --metrics-port``): what only the daemon sees.

The masters' ``/metrics`` carry what daemons tell them in heartbeats (tiers, transfers, refusals);
a daemon cut from the masters tells them nothing, and they only see it go silent. Its own endpoint
says, from its side: whether a master answers it and since when it has not, how often it had to
register again, and its tiers' health (as its last heartbeat measured them). Plain HTTP, without
authentication, whatever the data plane's settings: it tells names and sizes, nothing stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from server.daemon.commits import Committer
from server.daemon.master_link import MasterLink
from server.daemon.storage import DaemonStorage


class DaemonCollector:
    """The metrics of one daemon, from its master link and its storage."""

    def __init__(
        self, node: str, link: MasterLink, storage: DaemonStorage, started: float | None = None,
        committer: Committer | None = None,
    ) -> None:  # fmt: skip
        self.node = node
        self.link = link
        self.storage = storage
        self.committer = committer
        self.started = time.monotonic() if started is None else started

    def collect(self) -> Iterator[Metric]:
        node, link = [self.node], self.link
        now = time.monotonic()
        answered = link.last_answer
        silent = now - (answered if answered is not None else self.started)

        def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"kvstore_daemon_{name}", text, labels=["node"])
            family.add_metric(node, value)
            return family

        def counter(name: str, text: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"kvstore_daemon_{name}", text, labels=["node"])
            family.add_metric(node, value)
            return family

        yield gauge("master_silence_seconds", "Seconds since a master last answered this daemon (registration or "
                    "heartbeat; since start while none has).", silent)  # fmt: skip
        yield gauge("registered", "1 once a master has answered this daemon's registration.",
                    1.0 if link.registered.is_set() else 0.0)  # fmt: skip
        yield counter("registrations", "Registrations a master answered (again after each lost contact with the "
                      "masters, or a master that forgot the node).", link.registrations)  # fmt: skip
        yield counter("master_failures", "Registrations and heartbeats no master answered.", link.failures)
        loops = CounterMetricFamily(
            "kvstore_daemon_loop_failures",
            "Exceptions that a background loop of this daemon raised (each logged, and the loop restarted), by loop.",
            labels=["node", "loop"],
        )
        for loop, failures in sorted(link.supervisor.counts().items()):
            loops.add_metric([self.node, loop], failures)
        yield loops
        if self.committer is not None:
            c = self.committer
            yield gauge("cached_pending", "Cached puts acknowledged whose commit the master has not answered yet.",
                        c.pending())  # fmt: skip
            yield counter("cached_committed", "Cached puts the master committed after this daemon acknowledged them.",
                          c.committed)  # fmt: skip
            yield counter("cached_refused", "Cached puts the master refused after this daemon acknowledged them "
                          "(another writer's block under the key): dropped here.", c.refused)  # fmt: skip
            yield counter("cached_adopted", "Cached puts whose commit a registration's inventory carried instead.",
                          c.adopted)  # fmt: skip
        arena = self.storage.arena
        yield gauge("dram_capacity_bytes", "The DRAM tier's data capacity.", arena.capacity)
        yield gauge("dram_blocks", "Blocks held in the DRAM tier.", len(arena))
        yield gauge("dram_index_bytes", "Bytes of the DRAM tier's index in its arena file, beyond its data capacity"
                    " (it grows as blocks need it).", arena.index_bytes)  # fmt: skip
        ssd = self.storage.ssd
        if ssd is None:
            return
        # As the last heartbeat measured it: a scrape measures nothing (a hung disk must not hold it).
        capacity, configured, fault = ssd.capacity, ssd.config.capacity, ssd.fault
        yield gauge("ssd_capacity_bytes", "What the SSD tier can hold now (less than configured when its disk is "
                    "full or failing).", capacity)  # fmt: skip
        yield gauge("ssd_configured_bytes", "The SSD tier's configured capacity.", configured)
        yield gauge("ssd_fault", "1 while the SSD tier reports a fault.", 1.0 if fault else 0.0)


def serve_metrics(host: str, port: int, collector: DaemonCollector) -> tuple[str, Callable[[], None]]:
    """Serve ``collector`` at http://host:port/metrics (a thread of its own); (host:port, stop)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server: Any
    server, thread = start_http_server(port, addr=host, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return f"{host}:{server.server_port}", stop
