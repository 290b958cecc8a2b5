"""The chart's PrometheusRule alerts on series the components really export, and its SLO targets
are bounds of the router's histogram buckets (an ``le`` that is no bucket matches no series)."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client.utils import floatToGoString

from copse.router.metrics import ITL_BUCKETS, LATENCY_BUCKETS

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


def test_the_slo_targets_are_bucket_bounds_of_the_router() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    slo = schema["properties"]["metrics"]["properties"]["prometheusRule"]["properties"]["slo"]["properties"]
    assert slo["ttftSeconds"]["enum"] == [floatToGoString(bound) for bound in LATENCY_BUCKETS]
    assert slo["itlSeconds"]["enum"] == [floatToGoString(bound) for bound in ITL_BUCKETS]
