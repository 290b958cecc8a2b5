"""The planner's default queries name series the router really exports (the planner may not import
the router, so the names are spelt twice; this test ties them): every ``copse_router_*`` series in
every default query is in a real router's scrape, as the sample name Prometheus stores."""

from __future__ import annotations

import re

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from copse.planner.prometheus import DEFAULT_QUERIES
from copse.router.core import Router
from copse.router.metrics import RouterMetrics
from copse.router.policies import SelectionSettings
from copse.workers.perf import PolynomialPerfModel


def scraped_names() -> set[str]:
    """Sample names of a router's ``/metrics`` after one request of each kind is counted."""
    router = Router(perf=PolynomialPerfModel(), settings=SelectionSettings(block_size=32))
    metrics = RouterMetrics(lambda: router)
    metrics.requests.labels(status="200").inc()
    text = generate_latest(metrics.registry).decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


SCRAPED = scraped_names()


@pytest.mark.parametrize("field", sorted(DEFAULT_QUERIES))
def test_every_router_series_a_default_query_reads_is_exported(field: str) -> None:
    named = set(re.findall(r"\bcopse_router_\w+", DEFAULT_QUERIES[field]))
    assert named <= SCRAPED, f"{field}: not exported by the router: {sorted(named - SCRAPED)}"


def test_the_planner_reads_the_routers_request_series() -> None:
    """Not vacuous: the request-level fields read router series at all."""
    for field in ("num_requests", "isl", "osl", "isl_p90", "kv_hit_rate", "onboard_ms", "ttft_ms", "itl_ms"):
        assert re.search(r"\bcopse_router_\w+", DEFAULT_QUERIES[field]), field
