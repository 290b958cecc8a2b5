"""Prometheus export of one mocked engine (names in :mod:`copse.workers.metrics`)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from copse.workers import metrics as names
from copse.workers.mocker.engine import Engine, Request


class _EngineState(Collector):
    """Gauges and counters read from the engine at scrape time (no bookkeeping per step)."""

    def __init__(self, engine: Engine, labels: list[str]) -> None:
        self._engine = engine
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        admitted = engine.admitted_prompt_tokens_total
        gauges = {
            names.KV_CACHE_UTILIZATION: engine.kv_utilization,
            names.KV_CACHE_HIT_RATE: engine.cached_tokens_total / admitted if admitted else 0.0,
            names.NUM_REQUESTS_RUNNING: float(len(engine.running)),
            names.NUM_REQUESTS_WAITING: float(engine.num_waiting),
        }
        for name, value in gauges.items():
            gauge = GaugeMetricFamily(
                name, name.removeprefix("trtllm_").replace("_", " "), labels=names.LABELS
            )
            gauge.add_metric(self._labels, value)
            yield gauge
        counters = {
            names.PROMPT_TOKENS: engine.prompt_tokens_total,
            names.GENERATION_TOKENS: engine.generation_tokens_total,
        }
        for name, total in counters.items():
            counter = CounterMetricFamily(
                name, name.removeprefix("trtllm_").replace("_", " "), labels=names.LABELS
            )
            counter.add_metric(self._labels, float(total))
            yield counter
        success = CounterMetricFamily(
            names.REQUEST_SUCCESS, "completed requests", labels=[*names.LABELS, "finished_reason"]
        )
        success.add_metric([*self._labels, "length"], float(engine.requests_finished_total))
        yield success


class EngineMetrics:
    """The metrics of one mocked engine, in a registry of its own (one ``/metrics`` per engine)."""

    def __init__(self, engine: Engine, *, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = [model_name, engine.config.role]

        def histogram(name: str, doc: str) -> Histogram:
            family = Histogram(name, doc, names.LABELS, registry=self.registry, buckets=names.LATENCY_BUCKETS)
            return family.labels(*labels)

        self.ttft = histogram(names.TTFT_SECONDS, "Time to first token")
        self.itl = histogram(names.ITL_SECONDS, "Time per output token")
        self.e2e = histogram(names.E2E_SECONDS, "End-to-end request latency")
        self.queue = histogram(names.QUEUE_SECONDS, "Time queued before the first step")
        self.registry.register(_EngineState(engine, labels))

    def first_token(self, request: Request) -> None:
        """Record a request's first token (TTFT and queueing time)."""
        self.ttft.observe((request.first_token_ms - request.arrival_ms) / 1000.0)
        self.queue.observe((request.first_scheduled_ms - request.arrival_ms) / 1000.0)

    def next_token(self, gap_ms: float) -> None:
        """Record the gap before a later token."""
        self.itl.observe(gap_ms / 1000.0)

    def finished(self, request: Request) -> None:
        """Record a completed request."""
        self.e2e.observe((request.finish_ms - request.arrival_ms) / 1000.0)
