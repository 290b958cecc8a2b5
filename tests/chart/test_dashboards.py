"""The Grafana dashboards query metrics the components really export, and cover what the issue asks."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import Metric
from prometheus_client.metrics import MetricWrapperBase

from copse.operator import metrics as operator_metrics
from copse.planner.metrics import PlannerMetrics
from copse.router.core import Router
from copse.router.metrics import RouterMetrics
from copse.router.policies import SelectionSettings
from copse.workers import metrics as worker_metrics
from copse.workers.mocker import Engine, EngineConfig
from copse.workers.mocker.telemetry import EngineMetrics
from copse.workers.perf import PolynomialPerfModel

DASHBOARDS = sorted((Path(__file__).resolve().parents[2] / "charts" / "copse" / "dashboards").glob("*.json"))
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count", ""),
    "gauge": ("",),
    "info": ("_info",),
}


def sample_names(families: Iterable[Metric]) -> set[str]:
    """Names of the series a scrape shows for these metric families."""
    return {family.name + suffix for family in families for suffix in SUFFIXES[family.type]}


def exported() -> set[str]:
    """Every series name the operator, router, workers and planner export, read from their registries."""
    names: set[str] = set()
    for value in vars(operator_metrics).values():
        if isinstance(value, MetricWrapperBase):
            names |= sample_names(value.describe())
    perf = PolynomialPerfModel()
    router = Router(perf=perf, settings=SelectionSettings(block_size=32))
    names |= sample_names(RouterMetrics(lambda: router).registry.collect())
    engine = Engine(worker_id="w0", config=EngineConfig(), perf=perf)
    names |= sample_names(EngineMetrics(engine, model_name="m").registry.collect())
    names |= sample_names(PlannerMetrics().registry.collect())
    return names


EXPORTED = exported()
METRIC = re.compile(r"\b(?:copse|trtllm)_[a-z0-9_]+\b")


def load(path: Path) -> dict[str, Any]:
    loaded = json.loads(path.read_text())
    assert isinstance(loaded, dict)
    return loaded


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in panels(dashboard) for target in panel.get("targets", [])]


def test_there_is_a_dashboard() -> None:
    assert DASHBOARDS


def test_registries_hold_the_names_the_modules_declare() -> None:
    """The name collection itself works: the workers' declared names all show up in a scrape."""
    declared = {
        value
        for name, value in vars(worker_metrics).items()
        if name.isupper() and isinstance(value, str) and value.startswith("trtllm_")
    }
    assert declared
    assert all(any(series.startswith(name) for series in EXPORTED) for name in declared)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_uses_only_exported_metrics(path: Path) -> None:
    queries = exprs(load(path))
    assert queries
    for expr in queries:
        used = set(METRIC.findall(expr))
        assert used, f"{path.name}: query reads no copse or trtllm metric: {expr}"
        assert used <= EXPORTED, f"{path.name}: not exported by any component: {sorted(used - EXPORTED)}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_structure(path: Path) -> None:
    dashboard = load(path)
    all_panels = list(panels(dashboard))
    ids = [panel["id"] for panel in all_panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {variable["name"] for variable in dashboard["templating"]["list"]}
    assert "datasource" in variables
    for panel in all_panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= variables, f"{panel['title']}: undefined variables {used - variables}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_do_not_overlap(path: Path) -> None:
    boxes = [(panel["title"], panel["gridPos"]) for panel in load(path)["panels"]]
    for index, (title, a) in enumerate(boxes):
        assert a["x"] + a["w"] <= 24, f"{title} is wider than the grid"
        for other, b in boxes[index + 1 :]:
            apart = (
                a["x"] + a["w"] <= b["x"]
                or b["x"] + b["w"] <= a["x"]
                or a["y"] + a["h"] <= b["y"]
                or b["y"] + b["h"] <= a["y"]
            )
            assert apart, f"{title!r} overlaps {other!r}"


def test_the_overview_covers_the_issue() -> None:
    """TTFT/ITL percentiles, request rate, KV hit rate, per-worker load, replicas per pool and
    placement score (the panels issue 8 lists)."""
    queries = [expr for path in DASHBOARDS for expr in exprs(load(path))]

    def has(pattern: str) -> bool:
        return any(re.search(pattern, expr) for expr in queries)

    for histogram in (
        worker_metrics.TTFT_SECONDS,
        worker_metrics.ITL_SECONDS,
        "copse_router_time_to_first_token_seconds",
        "copse_router_inter_token_latency_seconds",
    ):
        for quantile in ("0.5", "0.99"):
            assert has(rf"histogram_quantile\({quantile}, .*{histogram}_bucket"), (histogram, quantile)
    assert has(r"rate\(copse_router_requests_total")
    assert has(worker_metrics.KV_CACHE_HIT_RATE)
    assert has(r"copse_router_predicted_cached_tokens_total.*/.*copse_router_prompt_tokens_total")
    assert has(rf"by \(pod\) \({worker_metrics.NUM_REQUESTS_RUNNING}")
    assert has(rf"count by \(deployment, role\) \({worker_metrics.NUM_REQUESTS_RUNNING}")
    assert has(r"copse_operator_placement_score")
    assert has(r"copse_planner_target_replicas")
    assert has(r"copse_planner_predicted_requests_per_second")
