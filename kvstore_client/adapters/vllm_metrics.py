"""The vLLM connector's statistics, in vLLM's own KV connector metrics: what the workers and the scheduler
counted since their last report, logged by vLLM and exported as Prometheus counters, and the key scheme
a router reads from the server's ``/metrics`` (see :class:`KVStoreConnectorStats`)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Counters since the last report, summed across the workers and the scheduler: vLLM logs them
    ("KV Transfer metrics") and exports each as the Prometheus counter ``vllm:kvstore_<name>``.

    The scheduler's reports also carry, now and then, the key scheme (:data:`SCHEME`: the namespace
    of the first rank and stage, tokens and bytes per block), which becomes the info gauge
    ``vllm:kvstore_layout_info``: what a router needs to ask the store for a prompt's prefix
    (``kvstore conductor --openai`` reads it from the server's ``/metrics``)."""

    FIELDS = (
        "lookups", "lookup_failures", "loaded_blocks", "loaded_bytes", "load_failed_blocks", "repaired_blocks",
        "saved_blocks", "saved_bytes", "save_failed_blocks", "save_dropped_blocks", "skipped_ops",
    )  # fmt: skip
    """``skipped_ops``: lookups and loads not tried while the breaker was open."""
    SCHEME = ("namespace", "block_tokens", "block_bytes")
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.FIELDS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(self.FIELDS, 0)

    def add(self, name: str, value: int = 1) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name in self.SCHEME:
                self.data[name] = value
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: self.data.get(name, 0) for name in self.FIELDS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in self.FIELDS) and "namespace" not in self.data


class StatsCounter:
    """One connector's counts since its last report. Thread-safe: a worker's loader and saver threads
    count too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = KVStoreConnectorStats()

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._stats.add(name, value)

    def take(self, scheme: Mapping[str, Any] | None = None) -> KVStoreConnectorStats | None:
        """The counts since the last report, with ``scheme`` (the key scheme: :attr:`~KVStoreConnectorStats.SCHEME`)
        when given, and a fresh count from zero; None when there is nothing to report."""
        with self._lock:
            if scheme is not None:
                self._stats.data.update(scheme)
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KVStoreConnectorStats()
        return stats


class KVStorePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per :attr:`KVStoreConnectorStats.FIELDS`, ``vllm:kvstore_<name>``, and the
    key scheme as ``vllm:kvstore_layout_info{namespace=..., block_tokens=..., block_bytes=...} 1``."""

    def __init__(
        self, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine: dict[int, list[object]]
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine)
        counter = self._counter_cls
        self._counters = {
            name: counter(name=f"vllm:kvstore_{name}", documentation=f"kvstore: {name}", labelnames=labelnames)
            for name in KVStoreConnectorStats.FIELDS
        }
        self._layout = self._gauge_cls(
            name="vllm:kvstore_layout_info", documentation="kvstore: the key scheme of the stored blocks",
            labelnames=[*labelnames, *KVStoreConnectorStats.SCHEME], multiprocess_mode="mostrecent",
        )  # fmt: skip

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            counter = self._counters.get(name)
            if counter is not None and value:
                counter.labels(*labels).inc(value)
        if "namespace" in transfer_stats_data:
            scheme = [str(transfer_stats_data.get(name, "")) for name in KVStoreConnectorStats.SCHEME]
            self._layout.labels(*labels, *scheme).set(1)
