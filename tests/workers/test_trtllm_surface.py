"""The mocked engines' metric surface is TensorRT-LLM's: the Prometheus families of
``tests/fixtures/trtllm_prometheus_metrics.txt`` (built from ``tensorrt_llm/metrics/collector.py``)
and the JSON iteration stats of ``GET /metrics``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from copse.planner.prometheus import DEFAULT_QUERIES
from copse.workers.mocker import EngineConfig
from copse.workers.mocker.engine import Engine
from copse.workers.mocker.telemetry import EngineMetrics
from copse.workers.perf import PolynomialPerfModel

FIXTURE = (Path(__file__).parents[1] / "fixtures" / "trtllm_prometheus_metrics.txt").read_text()


def _families(text: str) -> dict[str, tuple[str, set[str]]]:
    """Family name -> (type, label names of its samples, le excluded)."""
    out: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        labels = {label for sample in family.samples for label in sample.labels} - {"le", "pid"}
        out[family.name] = (family.type, labels)
    return out


def _buckets(text: str, family_name: str) -> list[str]:
    [family] = [f for f in text_string_to_metric_families(text) if f.name == family_name]
    return [sample.labels["le"] for sample in family.samples if sample.name.endswith("_bucket")]


@pytest.fixture(scope="module")
def mocked() -> str:
    engine = Engine(worker_id="w0", config=EngineConfig(), perf=PolynomialPerfModel())
    return generate_latest(EngineMetrics(engine, model_name="m").registry).decode()


def test_the_mocked_engines_export_the_collectors_families(mocked: str) -> None:
    """Every trtllm_ family a mocked engine exports exists in TensorRT-LLM's export with the same
    type, labels and histogram buckets, so what reads one reads the other."""
    real, mock = _families(FIXTURE), _families(mocked)
    ours = {name: kind for name, kind in mock.items() if name.startswith("trtllm_")}
    assert len(ours) >= 10
    for name, (kind, labels) in ours.items():
        assert name in real, f"{name} is not a TensorRT-LLM metric"
        assert kind == real[name][0], name
        assert labels == real[name][1], name
        if kind == "histogram":
            assert _buckets(mocked, name) == _buckets(FIXTURE, name), name
    for field in ("queue_depth", "decode_queue_depth", "inflight"):
        for gauge in re.findall(r'__name__=~"\(trtllm_\)\?(\w+)"', DEFAULT_QUERIES[field]):
            assert f"trtllm_{gauge}" in ours, gauge
