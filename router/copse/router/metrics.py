"""Every Prometheus metric the router exports (names live here and nowhere else).

Per-worker load gauges are read from the routing core at scrape time, so they never drift from
what the router decides with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from copse.router.core import Router

PREFIX = "copse_router"

#: Latency buckets (seconds) spanning a fast decode step to a long queued prefill.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: Inter-token latency buckets (seconds).
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
#: Prompt-length buckets (tokens), powers of two from a chat turn to a 256k context.
PROMPT_LENGTH_BUCKETS = tuple(float(2**k) for k in range(6, 19))


class RouterMetrics:
    """The router's metrics in their own registry (one per router instance)."""

    def __init__(self, router: Callable[[], Router]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests", "Requests answered, by HTTP status.", ["status"], registry=r
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from request arrival to its first streamed token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Mean gap between streamed tokens of a request.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "Time from request arrival to its last byte.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of routed requests.", registry=r
        )
        self.prompt_length = Histogram(
            f"{PREFIX}_prompt_length_tokens",
            "Prompt length of routed requests (the planner sizes prefill for its p90).",
            buckets=PROMPT_LENGTH_BUCKETS,
            registry=r,
        )
        self.output_tokens = Counter(
            f"{PREFIX}_output_tokens",
            "Output tokens returned to clients: the worker's usage count when it reports one, else "
            "the tokens streamed.",
            registry=r,
        )
        self.cached_tokens = Counter(
            f"{PREFIX}_predicted_cached_tokens",
            "Prompt tokens the chosen worker was predicted to hold (hit rate = this / prompt tokens).",
            registry=r,
        )
        self.onboard_seconds = Counter(
            f"{PREFIX}_predicted_onboard_seconds",
            "Time the chosen workers were predicted to spend bringing cached prompt blocks back from "
            "host memory or disk (the planner adds it per request to its prefill service time).",
            registry=r,
        )
        self.retries = Counter(
            f"{PREFIX}_retries", "Requests sent again to another worker before their first token.", registry=r
        )
        self.migrations = Counter(
            f"{PREFIX}_migrations",
            "Streams continued on another worker after their worker failed mid-stream, by what failed:"
            " disconnected, ended_early, worker_error, worker_lost (dropped by health probes), timeout.",
            ["reason"],
            registry=r,
        )
        self.failed_streams = Counter(
            f"{PREFIX}_failed_streams",
            "Streams ended with an error event after their first token, by why they could not go on:"
            " limit (migration_limit reached), unavailable (no worker), untracked (no token ids streamed),"
            " refused (a worker answered the continuation with a 4xx).",
            ["reason"],
            registry=r,
        )
        self.kv_resyncs = Counter(
            f"{PREFIX}_kv_resyncs",
            "Worker cache dumps requested after a gap in KV events.",
            ["reason"],
            registry=r,
        )
        self.kv_events = Counter(f"{PREFIX}_kv_event_batches", "KV event batches received.", registry=r)
        self.queue_depth = Gauge(f"{PREFIX}_queue_depth", "Requests waiting for a worker.", registry=r)
        self.workers = Gauge(
            f"{PREFIX}_workers", "Workers the router may use, by role.", ["role"], registry=r
        )
        self.peers = Gauge(f"{PREFIX}_peers", "Other router replicas heard from recently.", registry=r)
        self.peer_snapshots = Counter(
            f"{PREFIX}_peer_snapshots",
            "Load snapshots asked of peer replicas (a new or restarted peer, or lost messages), by result.",
            ["result"],
            registry=r,
        )
        self.nats_connected = Gauge(
            f"{PREFIX}_nats_connected",
            "1 while connected to NATS (exact mode: KV events, shared load); 0 in approximate mode.",
            registry=r,
        )
        self.ready = Gauge(
            f"{PREFIX}_ready",
            "1 once the router has a picture of the workers' caches and its peers' load (or gave up"
            " waiting after recovery_timeout_s), 0 before and while draining.",
            registry=r,
        )
        r.register(_WorkerLoad(router))


class _WorkerLoad(Collector):
    def __init__(self, router: Callable[[], Router]) -> None:
        self._router = router

    def collect(self) -> Iterable[Metric]:
        router = self._router()
        seq = router.sequences
        kv = seq.kv_tokens()
        families = {
            "inflight": GaugeMetricFamily(
                f"{PREFIX}_worker_inflight_requests", "Requests in flight per worker.", labels=["worker"]
            ),
            "prefill": GaugeMetricFamily(
                f"{PREFIX}_worker_prefill_tokens",
                "Uncached prompt tokens still to prefill per worker.",
                labels=["worker"],
            ),
            "kv": GaugeMetricFamily(
                f"{PREFIX}_worker_kv_tokens",
                "KV tokens in use per worker (router's estimate).",
                labels=["worker"],
            ),
            "cached": GaugeMetricFamily(
                f"{PREFIX}_worker_cached_blocks",
                "KV blocks the indexer believes each worker holds.",
                labels=["worker"],
            ),
            "approximate": GaugeMetricFamily(
                f"{PREFIX}_worker_kv_approximate",
                "1 while a worker's KV events lost track: its cache is partly guessed from routing.",
                labels=["worker"],
            ),
        }
        for worker_id in router.workers:
            slot = router.slots.get(worker_id)
            if slot is None or slot >= seq.size:
                continue
            families["inflight"].add_metric([worker_id], float(seq.requests[slot]))
            families["prefill"].add_metric([worker_id], float(seq.prefill_tokens[slot]))
            families["kv"].add_metric([worker_id], float(kv[slot]))
            families["cached"].add_metric([worker_id], float(router.indexer.blocks_held(slot)))
            if router.radix is not None:
                families["approximate"].add_metric([worker_id], float(router.radix.approximate(slot)))
        yield from families.values()
