"""The planner's default queries read series the router really exports (the planner may not import
the router, so the names are spelt twice; these tests tie them): every ``copse_router_*`` series in
every default query is in a real router's scrape, and every query computes its field from two
such scrapes."""

from __future__ import annotations

import re

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from copse.planner.config import PrometheusConfig
from copse.planner.prometheus import DEFAULT_QUERIES, PULSE_QUERIES, Queries
from copse.router.core import Role, Router, WorkerInfo
from copse.router.metrics import SLO_REFUSED, RouterMetrics, SloTargets
from copse.router.policies import RouteRequest, SelectionSettings
from copse.workers.perf import PolynomialPerfModel

from .promql_subset import Sample, evaluate


def scraped_names() -> set[str]:
    """Sample names of a router's ``/metrics`` after one request of each kind is counted."""
    router = Router(perf=PolynomialPerfModel(), settings=SelectionSettings(block_size=32))
    router.add_worker(WorkerInfo(worker_id="w0", role=Role.WORKER), now=0.0)  # per-worker gauges
    metrics = RouterMetrics(lambda: router)
    metrics.requests.labels(status="200").inc()
    metrics.admitted(_request(), queued=False)
    metrics.shed(_request(), reason="SloShed")
    text = generate_latest(metrics.registry).decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def _request() -> RouteRequest:
    return RouteRequest(request_id="r", hashes=(), prompt_tokens=1000, max_tokens=200)


SCRAPED = scraped_names()


@pytest.mark.parametrize("field", sorted({**DEFAULT_QUERIES, **PULSE_QUERIES}))
def test_every_router_series_a_default_query_reads_is_exported(field: str) -> None:
    named = set(re.findall(r"\bcopse_router_\w+", {**DEFAULT_QUERIES, **PULSE_QUERIES}[field]))
    assert named <= SCRAPED, f"{field}: not exported by the router: {sorted(named - SCRAPED)}"


def test_the_planner_reads_the_routers_request_series() -> None:
    """Not vacuous: the request-level fields read router series at all."""
    for field in (
        "num_requests",
        "isl",
        "osl",
        "isl_p90",
        "osl_p10",
        "uncached_p50",
        "uncached_p99",
        "uncached_max",
        "kv_hit_rate",
        "onboard_ms",
        "ttft_ms",
        "itl_ms",
    ):
        assert re.search(r"\bcopse_router_\w+", DEFAULT_QUERIES[field]), field


def _scrape(metrics: RouterMetrics) -> list[Sample]:
    """Samples as Prometheus stores them: the router pod's target labels added."""
    target = {"namespace": "serving", "deployment": "llama", "role": "router"}
    text = generate_latest(metrics.registry).decode()
    return [
        (sample.name, {**sample.labels, **target}, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def test_every_default_query_computes_its_field_from_a_real_router_scrape() -> None:
    """Two scrapes of a real router's registry 60 s apart, 10 requests between them: each default
    query (evaluated with tests/planner/promql_subset.py) gives the figure those requests make."""
    router = Router(perf=PolynomialPerfModel(), settings=SelectionSettings(block_size=32))
    metrics = RouterMetrics(lambda: router, slo=SloTargets(ttft_s=0.5, itl_s=0.02))
    metrics.requests.labels(status="200").inc(5)  # before the window: not counted
    metrics.judged(ttft_s=0.1, itl_s=0.01)
    earlier = _scrape(metrics)
    for _ in range(10):
        metrics.admitted(_request(), queued=False)
        metrics.requests.labels(status="200").inc()
        metrics.prompt_tokens.inc(1000)
        metrics.prompt_length.observe(1000)
        metrics.uncached_prompt.observe(750)  # 250 of the 1,000 predicted cached
        metrics.output_tokens.inc(200)
        metrics.output_length.observe(200)
        metrics.cached_tokens.inc(250)
        metrics.onboard_seconds.inc(0.002)
        metrics.ttft.observe(0.3)  # in the (0.25, 0.5] bucket
        metrics.itl.observe(0.015)  # in (0.01, 0.02]
        metrics.judged(ttft_s=0.3, itl_s=0.015)
    metrics.judged(ttft_s=0.6, itl_s=0.01)  # late first token
    metrics.judged(ttft_s=0.3, itl_s=0.03)  # slow tokens
    metrics.judged(ttft_s=0.7, itl_s=0.03)  # both: counted once, as late
    metrics.judged(ttft_s=0.2, itl_s=None)  # one token: its TTFT decides
    metrics.missed(SLO_REFUSED)
    # arrivals that were not routed: one admitted that timed out in the queue (counted once), two
    # shed at the door (the load all the same), one over its tenant's limit (not load to size for)
    metrics.admitted(_request(), queued=True)
    metrics.shed(_request(), reason="QueueTimeout")
    metrics.shed(_request(), reason="SloShed")
    metrics.shed(_request(), reason="QueueFull")
    metrics.shed(_request(), reason="RateLimited")
    metrics.queue_depth.set(4)
    now = _scrape(metrics)
    queries = Queries(PrometheusConfig(), namespace="serving", name="llama", interval_s=60.0, quantile=0.99)
    values = {field: evaluate(query, now, earlier=earlier) for field, query in queries.text.items()}
    # the fast loop's arrivals over the same minute, as the interval counts them
    assert evaluate(queries.over(60.0)["arrived"], now, earlier=earlier) == 13
    assert values["num_requests"] == 13
    assert values["isl"] == 1000  # of the 10 routed
    assert values["osl"] == 200
    assert values["kv_hit_rate"] == 0.25
    assert values["onboard_ms"] == pytest.approx(2.0)
    assert values["isl_p90"] == pytest.approx(512 + (1024 - 512) * 0.9)  # (512, 1024], linear
    assert values["osl_p10"] == pytest.approx(128 + (256 - 128) * 0.1)  # (128, 256]
    # (724, 1024]: linear within the bucket, the largest at its bound
    assert values["uncached_p50"] == pytest.approx(724 + (1024 - 724) * 0.5)
    assert values["uncached_p99"] == pytest.approx(724 + (1024 - 724) * 0.99)
    assert values["uncached_max"] == 1024
    assert values["ttft_ms"] == pytest.approx(1000 * (0.25 + 0.25 * 0.99))
    assert values["itl_ms"] == pytest.approx(1000 * (0.01 + 0.01 * 0.99))
    assert values["queue_depth"] == 4  # no engine series: the router's queue alone
    assert values["decode_queue_depth"] is None  # engine gauges: tests/planner/test_trtllm_metrics.py
    assert values["inflight"] is None
    assert (values["slo_met"], values["ttft_missed"], values["itl_missed"], values["refused"]) == (
        11,
        2,
        1,
        1,
    )


def test_a_router_without_targets_judges_nothing() -> None:
    router = Router(perf=PolynomialPerfModel(), settings=SelectionSettings(block_size=32))
    metrics = RouterMetrics(lambda: router)
    metrics.judged(ttft_s=9.0, itl_s=1.0)
    metrics.missed(SLO_REFUSED)
    counts = [value for name, _, value in _scrape(metrics) if name == "copse_router_slo_requests_total"]
    assert counts == [0.0] * 5  # every outcome's series, at zero
