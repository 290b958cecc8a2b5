"""InferenceObjective objects from Kubernetes: which objects count, how their priorities merge with
the config's objectives, the follower's polling, and a running router (HTTP and endpoint picker)
resolving a request's objective from them. The Kubernetes API is a fake here; e2e/test_shared_fleet.py
reads real objects from the API server."""

from __future__ import annotations

from typing import Any

import pytest

from copse.router.config import parse_config
from copse.router.objective_source import ObjectiveFollower, ObjectiveListError, priorities_of
from copse.router.objectives import OBJECTIVE_HEADER, Classes, Objective
from copse.router.server import start_router
from copse.workers.testing import mock_fleet

from .conftest import eventually

API = "inference.networking.x-k8s.io/v1alpha2"


def objective(name: str, *, pool: str = "llama", priority: Any = None, **metadata: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"poolRef": {"name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {
        "apiVersion": API,
        "kind": "InferenceObjective",
        "metadata": {"name": name, **metadata},
        "spec": spec,
    }


class FakeObjectiveApi:
    """Serves ``items`` per namespace; ``error`` makes the next lists fail."""

    def __init__(self, items: list[dict[str, Any]] | None = None) -> None:
        self.items = list(items or [])
        self.error: str | None = None
        self.calls: list[tuple[str, str]] = []

    async def list_objectives(self, *, namespace: str, api_version: str) -> list[dict[str, Any]]:
        self.calls.append((namespace, api_version))
        if self.error is not None:
            raise ObjectiveListError(self.error)
        return [dict(item) for item in self.items]


def test_only_the_pools_objects_count_and_an_unset_priority_is_zero() -> None:
    items = [
        objective("premium", priority=100),
        objective("batch"),  # unset: 0, as the endpoint picker reads it
        objective("sheddable", priority=-10),
        objective("elsewhere", pool="other", priority=50),
        objective("going", priority=7, deletionTimestamp="2026-01-01T00:00:00Z"),
        objective("odd", priority=True),
        {"metadata": {}, "spec": {"poolRef": {"name": "llama"}, "priority": 1}},
    ]
    assert priorities_of(items, pool="llama") == {"premium": 100, "batch": 0, "sheddable": -10}
    assert priorities_of(items, pool=None)["elsewhere"] == 50


def test_kubernetes_priorities_win_and_keep_the_configured_ttft_target() -> None:
    classes = Classes(
        objectives={"premium": Objective(name="premium", priority=1, ttft_ms=500.0)},
        default=Objective(name="", ttft_ms=30_000.0),
    )
    classes.set_priorities({"premium": 100, "batch": 0})
    assert classes.objective("premium") == Objective(name="premium", priority=100, ttft_ms=500.0)
    # An objective only Kubernetes knows takes the default objective's target.
    assert classes.objective("batch") == Objective(name="batch", priority=0, ttft_ms=30_000.0)
    # Deleted from Kubernetes: the configured entry is back, the other one is unknown (default).
    classes.set_priorities({})
    assert classes.objective("premium").priority == 1
    assert classes.objective("batch") is classes.default
    objective_of, tenant = classes.of({OBJECTIVE_HEADER: " premium ", "x-gateway-inference-fairness-id": "t"})
    assert (objective_of.name, tenant) == ("premium", "t")


async def test_the_follower_reports_changes_and_keeps_the_last_objectives_on_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = FakeObjectiveApi([objective("premium", priority=100)])
    reports: list[dict[str, int]] = []
    follower = ObjectiveFollower(
        api, namespace="ns", pool="llama", api_version=API, interval_s=60, on_change=reports.append
    )
    await follower.poll()
    await follower.poll()  # unchanged: not reported again
    assert reports == [{"premium": 100}]
    assert api.calls == [("ns", API), ("ns", API)]
    api.error = "404 Not Found"
    await follower.poll()
    await follower.poll()
    assert follower.current == {"premium": 100}
    assert reports == [{"premium": 100}]
    assert sum("404 Not Found" in record.getMessage() for record in caplog.records) == 1, "logged once"
    api.error = None
    api.items.append(objective("batch", priority=0))
    await follower.poll()
    assert reports[-1] == {"premium": 100, "batch": 0}


@pytest.mark.parametrize("mode", ["http", "epp"])
async def test_a_running_router_resolves_objectives_from_kubernetes(mode: str) -> None:
    api = FakeObjectiveApi([objective("premium", priority=100), objective("batch", priority=0)])
    async with mock_fleet(engines=1) as fleet:
        raw: dict[str, Any] = {
            "model": "mock-model",
            "engine": "mock",
            "port": 0,
            "namespace": "team",
            "discovery": {"kind": "static", "workers": [{"url": fleet.urls[0]}]},
            "health_interval_s": 0.05,
            "objectives": {"premium": {"ttft_ms": 2000}},
            "inference_objectives": {"pool": "llama", "interval_s": 0.05},
        }
        if mode == "epp":
            raw["epp"] = {"grpc_port": 0, "health_port": None, "metrics_port": None}
        running = await start_router(parse_config(raw, source="test"), objective_api=api)
        service = running.service
        try:
            await eventually(lambda: service.readiness()[0])
            assert api.calls[0] == ("team", API)

            def priority(name: str) -> int:
                return service.route_request(
                    "r", [1, 2, 3], max_tokens=1, headers={OBJECTIVE_HEADER: name}
                ).priority

            assert (priority("premium"), priority("batch"), priority("unknown")) == (100, 0, 0)
            assert service.classes.objective("premium").ttft_ms == 2000
            api.items[0] = objective("premium", priority=200)  # edited in Kubernetes: followed
            await eventually(lambda: priority("premium") == 200)
        finally:
            await running.close()
