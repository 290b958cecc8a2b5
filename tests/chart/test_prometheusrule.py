"""The chart's PrometheusRule alerts on series the components really export, and its SLO targets
are bounds of the router's histogram buckets (an ``le`` that is no bucket matches no series)."""

from __future__ import annotations

import json
from pathlib import Path

from copse.router.core import Router
from copse.router.metrics import RouterMetrics
from copse.router.policies import SelectionSettings
from copse.workers.perf import PolynomialPerfModel

from .test_dashboards import EXPORTED, METRIC

CHART = Path(__file__).resolve().parents[2] / "charts" / "copse"
TEMPLATE = CHART / "templates" / "prometheusrule.yaml"


def test_every_metric_the_rules_name_is_exported() -> None:
    named = set(METRIC.findall(TEMPLATE.read_text()))
    assert {
        "copse_router_time_to_first_token_seconds_bucket",
        "copse_router_inter_token_latency_seconds_bucket",
        "copse_router_requests_total",
        "copse_router_kv_resyncs_total",
        "copse_operator_gang_restarts_total",
        "copse_operator_unplaced_groups",
    } <= named
    assert named - EXPORTED == set()


def _bounds(histogram: str) -> list[str]:
    """The ``le`` labels a scrape of the router shows for ``histogram`` (+Inf left out)."""
    router = Router(perf=PolynomialPerfModel(), settings=SelectionSettings(block_size=32))
    [family] = [f for f in RouterMetrics(lambda: router).registry.collect() if f.name == histogram]
    return [s.labels["le"] for s in family.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]


def test_the_slo_targets_are_bucket_bounds_of_the_router() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    slo = schema["properties"]["metrics"]["properties"]["prometheusRule"]["properties"]["slo"]["properties"]
    assert slo["ttftSeconds"]["enum"] == _bounds("copse_router_time_to_first_token_seconds")
    assert slo["itlSeconds"]["enum"] == _bounds("copse_router_inter_token_latency_seconds")
