"""What one mocked engine reports about itself, in ``trtllm-serve``'s two formats: the Prometheus
export of ``/prometheus/metrics`` (names, types, labels and buckets of TensorRT-LLM's
``metrics/collector.py``; names in :mod:`copse.workers.metrics`) and the JSON iteration stats of
``GET /metrics`` (TensorRT-LLM's ``IterationStats`` serialization: camelCase keys, ``kvCacheStats``
and ``inflightBatchingStats`` nested)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from copse.workers import metrics as names
from copse.workers.mocker.engine import Engine, Request, StepOutput


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
        loaded = GaugeMetricFamily(
            names.MOCK_LORA_LOADED, "LoRA adapters held", labels=[*names.LABELS, "lora_name"]
        )
        for adapter in engine.adapters.held():
            loaded.add_metric([*self._labels, adapter], 1.0)
        yield loaded
        loads = CounterMetricFamily(names.MOCK_LORA_LOADS, "LoRA adapters loaded", labels=names.LABELS)
        loads.add_metric(self._labels, float(engine.adapters.loads_total))
        yield loads


class _WithoutCreated(Collector):
    """A registry's families without the ``_created`` series single-process prometheus_client
    adds: ``trtllm-serve`` exports from a multiprocess registry, which has none."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            family.samples = [sample for sample in family.samples if not sample.name.endswith("_created")]
            yield family


class EngineMetrics:
    """The metrics of one mocked engine, in a registry of its own (one ``/metrics`` per engine)."""

    def __init__(self, engine: Engine, *, model_name: str) -> None:
        own = CollectorRegistry()
        labels = [model_name, engine.config.role]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, doc, names.LABELS, registry=own, buckets=buckets)
            return family.labels(*labels)

        self.ttft = histogram(names.TTFT_SECONDS, "Time to first token", names.TTFT_BUCKETS)
        self.itl = histogram(names.ITL_SECONDS, "Time per output token", names.ITL_BUCKETS)
        self.e2e = histogram(names.E2E_SECONDS, "End-to-end request latency", names.REQUEST_BUCKETS)
        self.queue = histogram(
            names.QUEUE_SECONDS, "Time queued before the first step", names.REQUEST_BUCKETS
        )
        self.step_lag = histogram(
            names.MOCK_STEP_LAG_SECONDS, "Delivery of a step's output after its end", names.TTFT_BUCKETS
        )
        own.register(_EngineState(engine, labels))
        self.registry = CollectorRegistry()
        """What ``/prometheus/metrics`` serves."""
        self.registry.register(_WithoutCreated(own))

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


def iteration_stats(engine: Engine, output: StepOutput, *, iteration: int) -> dict[str, Any]:
    """One step as ``trtllm-serve``'s ``GET /metrics`` lists it (the fields TensorRT-LLM's
    ``IterationStats`` JSON and ``collector.log_iteration_stats`` use; memory is not simulated, and
    a fused run of decode steps is one entry)."""
    blocks = engine.blocks
    config = engine.config
    admitted = engine.admitted_prompt_tokens_total
    prefilling = [request for request in engine.running if request.num_computed < request.prompt_len]
    return {
        "timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
        "iter": iteration,
        "iterLatencyMS": output.end_ms - output.start_ms,
        "numActiveRequests": len(engine.running),
        "numQueuedRequests": engine.num_waiting,
        "numCompletedRequests": len(output.finished),
        "maxNumActiveRequests": config.max_num_seqs,
        "maxBatchSizeStatic": config.max_num_seqs,
        "maxBatchSizeRuntime": config.max_num_seqs,
        "maxNumTokensRuntime": config.max_num_batched_tokens,
        "gpuMemUsage": 0,
        "cpuMemUsage": 0,
        "pinnedMemUsage": 0,
        "kvCacheStats": {
            "maxNumBlocks": blocks.num_blocks,
            # Cached blocks no sequence holds count as free, as in TensorRT-LLM's eviction list.
            "freeNumBlocks": blocks.num_blocks - blocks.used_blocks,
            "usedNumBlocks": blocks.used_blocks,
            "tokensPerBlock": blocks.block_size,
            "cacheHitRate": engine.cached_tokens_total / admitted if admitted else 0.0,
        },
        "staticBatchingStats": None,
        "inflightBatchingStats": {
            "numScheduledRequests": len(output.advanced),
            "numContextRequests": len(prefilling),
            "numGenRequests": len(engine.running) - len(prefilling),
            "numPausedRequests": len(output.preempted),
            "microBatchId": 0,
            "avgNumDecodedTokensPerIter": 1.0,  # no speculative decoding
        },
    }
