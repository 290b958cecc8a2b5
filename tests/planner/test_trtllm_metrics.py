"""The planner's default engine queries against TensorRT-LLM's ``/prometheus/metrics`` format
(``tests/fixtures/trtllm_prometheus_metrics.txt``, built from ``tensorrt_llm/metrics/collector.py``;
its header says how)."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from copse.planner.config import PrometheusConfig
from copse.planner.prometheus import DEFAULT_QUERIES, Queries

from .promql_subset import Sample, evaluate

FIXTURE = (Path(__file__).parents[1] / "fixtures" / "trtllm_prometheus_metrics.txt").read_text()
ENGINE_FIELDS = ("queue_depth", "decode_queue_depth", "inflight")


def scrape(text: str, *, role: str, namespace: str = "serving", deployment: str = "llama") -> list[Sample]:
    """Samples as Prometheus stores them after the chart's PodMonitor: target labels added."""
    target = {"namespace": namespace, "deployment": deployment, "role": role, "component": "worker"}
    return [
        (sample.name, {**sample.labels, **target}, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def queries() -> dict[str, str]:
    config = PrometheusConfig()
    return Queries(config, namespace="serving", name="llama", interval_s=60.0, quantile=0.99).text


def test_the_engine_queries_name_what_the_collector_exports() -> None:
    exported = {family.name for family in text_string_to_metric_families(FIXTURE)}
    for field in ENGINE_FIELDS:
        names = re.findall(r'__name__=~"\(trtllm_\)\?(\w+)"', DEFAULT_QUERIES[field])
        assert names, field
        assert all(f"trtllm_{name}" in exported for name in names), (field, names)


def test_aggregated_workers_queue_and_inflight_are_read() -> None:
    samples = scrape(FIXTURE, role="worker") + scrape(FIXTURE, role="worker", namespace="other")
    text = queries()
    assert evaluate(text["queue_depth"], samples) == 3.0  # no router series: its part is 0
    assert evaluate(text["inflight"], samples) == 5.0  # the other namespace's engine is not counted
    assert evaluate(text["decode_queue_depth"], samples) is None  # no decode pool


def test_disaggregated_pools_are_read_per_role() -> None:
    prefill = scrape(FIXTURE, role="prefill")
    decode = [
        (name, labels, value * 2 if name.endswith("num_requests_waiting") else value)
        for name, labels, value in scrape(FIXTURE, role="decode")
    ]
    router: list[Sample] = [
        ("copse_router_queue_depth", {"namespace": "serving", "deployment": "llama"}, 4.0)
    ]
    samples = [*prefill, *decode, *router]
    text = queries()
    assert evaluate(text["queue_depth"], samples) == 4.0 + 3.0
    assert evaluate(text["decode_queue_depth"], samples) == 6.0
    assert evaluate(text["inflight"], samples) == 5.0


def test_unprefixed_names_read_the_same() -> None:
    """The same gauges without the trtllm_ prefix (TensorRT-LLM before 1.3 named its metrics so;
    dropping the prefix again was proposed upstream)."""
    bare = [
        (name.removeprefix("trtllm_"), labels, value)
        for name, labels, value in scrape(FIXTURE, role="worker")
    ]
    text = queries()
    assert all(not name.startswith("trtllm_") for name, _, _ in bare)
    assert evaluate(text["queue_depth"], bare) == 3.0
    assert evaluate(text["inflight"], bare) == 5.0
