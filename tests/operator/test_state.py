"""Reading a group's state back from its Service and pods."""

from __future__ import annotations

from typing import Any

from copse.api import Role
from copse.operator import children, names
from copse.operator.children import GroupLayout
from copse.operator.state import GroupState, observe_groups

from .conftest import make_deployment

LAYOUT = GroupLayout(role=Role.WORKER, replica=0, pods=(("n1", 4), ("n2", 4)), domain="d", rack="r", cost=0.1)


def pods(*, gated: bool, phase: str = "Pending", ready: bool = False) -> list[dict[str, Any]]:
    built = children.worker_pods(make_deployment(replicas=1), LAYOUT, cold_start_source=None)
    for pod in built:
        if not gated:
            pod["spec"].pop("schedulingGates")
        pod["status"] = {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]}
    return built


def observe(services: list[dict[str, Any]], pod_list: list[dict[str, Any]]) -> Any:
    [group] = observe_groups(deployment="llama", services=services, pods=pod_list)
    return group


SERVICE = children.group_service(make_deployment(replicas=1), LAYOUT)


def test_a_recorded_placement_without_pods_is_planned() -> None:
    group = observe([SERVICE], [])
    assert (group.state, group.layout) == (GroupState.PLANNED, LAYOUT)


def test_half_created_gang_is_still_planned() -> None:
    assert observe([SERVICE], pods(gated=True)[:1]).state is GroupState.PLANNED


def test_whole_gated_gang_waits_for_its_gates_to_lift() -> None:
    assert observe([SERVICE], pods(gated=True)).state is GroupState.GATED


def test_running_and_ready() -> None:
    assert observe([SERVICE], pods(gated=False, phase="Running")).state is GroupState.STARTING
    assert observe([SERVICE], pods(gated=False, phase="Running", ready=True)).state is GroupState.READY


def test_a_lost_rank_breaks_the_gang() -> None:
    group = observe([SERVICE], pods(gated=False, phase="Running", ready=True)[:1])
    assert (group.state, group.reason) == (GroupState.BROKEN, "rank 1 was deleted")


def test_a_failed_rank_breaks_the_gang() -> None:
    built = pods(gated=False, phase="Running", ready=True)
    built[1]["status"]["phase"] = "Failed"
    group = observe([SERVICE], built)
    assert group.state is GroupState.BROKEN
    assert "llama-worker-0-1 (rank 1) failed" in group.reason


def test_cleared_placement_means_place_again_and_counts_restarts() -> None:
    service = {**SERVICE, "metadata": {**SERVICE["metadata"]}}
    service["metadata"]["annotations"] = {
        names.ANNOTATION_PLACEMENT: "",
        names.ANNOTATION_RESTARTS: "2",
        names.ANNOTATION_LAST_RESTART: "2026-01-01T00:00:00+00:00",
    }
    group = observe([service], [])
    assert (group.state, group.restarts, group.layout) == (GroupState.UNPLACED, 2, None)


def test_terminating_pods_are_waited_for() -> None:
    built = pods(gated=False, phase="Running", ready=True)
    built[0]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert observe([SERVICE], built).state is GroupState.TERMINATING


def test_other_deployments_are_ignored() -> None:
    assert observe_groups(deployment="other", services=[SERVICE], pods=pods(gated=True)) == []
