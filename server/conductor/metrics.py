"""The conductor's Prometheus metrics (served at its ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ConductorMetrics:
    """Every metric of one conductor, in a registry of its own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "kvstore_conductor_"
        self.requests = Counter(p + "requests", "Completion requests by outcome", ["outcome"], registry=r)
        self.rejections = Counter(p + "rejections", "Requests rejected at arrival, by reason", ["reason"], registry=r)
        self.routed = Counter(p + "routed", "Requests sent to each worker", ["instance", "role"], registry=r)
        self.retries = Counter(p + "retries", "Calls retried on another worker", ["role"], registry=r)
        self.fallback = Counter(p + "load_only_routing", "Requests routed without locality (master unreachable)",
                                  registry=r)  # fmt: skip
        self.up = Gauge(p + "instance_up", "Whether a worker is up", ["instance", "role"], registry=r)
        self.queue = Gauge(p + "instance_queue_seconds", "Predicted seconds queued on a worker", ["instance"],
                             registry=r)  # fmt: skip
        self.engine_blocks = Gauge(p + "engine_cached_blocks", "Store blocks an OpenAI server's own cache holds, "
                                   "as the conductor knows it (from its KV events, or guessed)", ["instance"],
                                   registry=r)  # fmt: skip
        self.engine_events = Gauge(p + "engine_events_seq", "Sequence number of the last KV event batch the "
                                   "conductor applied of each OpenAI server it follows (-1: none yet)", ["instance"],
                                   registry=r)  # fmt: skip
        self.master = Gauge(p + "master_reachable", "Whether the last prefix lookup reached the master",
                              registry=r)  # fmt: skip
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram(p + "ttft_seconds", "Time to first token", ["kind"], buckets=buckets, registry=r)
        self.error = Histogram(p + "ttft_prediction_error_ratio", "|predicted - measured| / measured TTFT",
                                 buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5), registry=r)  # fmt: skip
        self.prompt = Counter(p + "prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.hit = Counter(p + "prefix_hit_tokens", "Prompt tokens the store held when scheduled", registry=r)
        self.loaded = Counter(p + "loaded_tokens", "Prompt tokens prefill workers loaded from the store", registry=r)
        self.replicated = Counter(p + "replicated_blocks", "Fetched blocks copied to a prefill node", registry=r)
