"""Drain before removal, against the in-memory cluster: a serving group that scale-down or a roll
removes is marked draining, kept while its routers still have requests on it, then deleted."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from copse.api import Role
from copse.operator import children, names
from copse.operator.controller import Controller
from copse.operator.inflight import tally, unused
from copse.operator.reconcile import ReconcileSettings

from .conftest import make_deployment
from .test_reconcile import KEY, NAMESPACE, Harness

ROUTER_URL = "http://10.0.9.9:8080"


class FakeInFlight:
    """The routers' answers: requests in flight per rank-0 pod (missing: 0)."""

    def __init__(self) -> None:
        self.counts: dict[str, int | None] = {}
        self.asked: list[tuple[list[str], list[str]]] = []
        self.unused: set[str] = set()
        """Rank-0 pods some router does not use yet."""

    async def count(self, *, routers: Sequence[str], workers: Sequence[str]) -> dict[str, int | None]:
        self.asked.append((list(routers), list(workers)))
        return {worker: self.counts.get(worker, 0) for worker in workers}

    async def unlisted(self, *, routers: Sequence[str], workers: Sequence[str]) -> set[str]:
        return {worker for worker in workers if worker in self.unused}


def draining_harness(**spec: Any) -> tuple[Harness, FakeInFlight]:
    harness = Harness(racks=2, **spec)
    in_flight = FakeInFlight()
    harness.controller = Controller(
        kube=harness.kube, settings=ReconcileSettings(restart_backoff_base_s=0), in_flight=in_flight
    )
    # The deployment's router pod, as its Deployment would run it.
    harness.kube.objects[("Pod", NAMESPACE, "llama-router-abc")] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "llama-router-abc",
            "namespace": NAMESPACE,
            "labels": {names.LABEL_DEPLOYMENT: "llama", names.LABEL_COMPONENT: names.COMPONENT_ROUTER},
        },
        "spec": {"nodeName": "cpu-0", "containers": [{"name": "router", "image": "copse"}]},
        "status": {
            "phase": "Running",
            "podIP": "10.0.9.9",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    return harness, in_flight


def group_pods(harness: Harness, group: str) -> list[dict[str, Any]]:
    return [p for p in harness.pods() if p["metadata"]["labels"].get(names.LABEL_GROUP) == group]


def workers(harness: Harness) -> list[dict[str, Any]]:
    return [p for p in harness.pods() if names.LABEL_GROUP in p["metadata"]["labels"]]


def reasons(harness: Harness) -> Counter[str]:
    return Counter(reason for _, reason, _ in harness.kube.events)


async def scaled_down_and_draining(harness: Harness, in_flight: FakeInFlight, *, requests: int | None) -> str:
    """Two groups running, scaled to one with ``requests`` in flight on the one that goes."""
    await harness.settle()
    harness.update_spec(replicas=1)
    harness.kube.sync(harness.controller)
    await harness.controller.reconcile_once(KEY)
    [victim] = {
        p["metadata"]["labels"][names.LABEL_GROUP]
        for p in harness.pods()
        if p["metadata"]["labels"].get(names.LABEL_DRAINING) == "true"
    }
    in_flight.counts[names.pod_name(victim, 0)] = requests
    return str(victim)


async def test_scale_down_drains_the_group_until_its_requests_end_then_removes_it() -> None:
    harness, in_flight = draining_harness(replicas=2)
    victim = await scaled_down_and_draining(harness, in_flight, requests=2)
    assert len(group_pods(harness, victim)) == 2, "marked, not deleted"
    assert all(p["metadata"]["labels"][names.LABEL_DRAINING] == "true" for p in group_pods(harness, victim))
    service = harness.kube.objects[("Service", NAMESPACE, victim)]
    assert service["metadata"]["annotations"][names.ANNOTATION_DRAINING_REASON] == "scale-down"
    assert reasons(harness)["Draining"] == 1

    await harness.settle()  # nothing changes while the router still has requests on it
    assert len(group_pods(harness, victim)) == 2
    assert in_flight.asked[-1] == ([ROUTER_URL], [names.pod_name(victim, 0)])
    status = harness.status
    assert status["ready"] == "worker 1/1"
    assert status["replicas"] == 1, "a draining group is no replica any more"
    [leaving] = [g for g in status["groups"] if g["name"] == victim]
    assert leaving["disruption"].startswith(
        "draining before removal (scale-down): no new requests, 2 requests"
    )
    harness.kube.sync(harness.controller)
    requeue = await harness.controller.reconcile_once(KEY)
    assert requeue == pytest.approx(1.0), "polls its routers again in a second"
    assert reasons(harness)["Draining"] == 1, "marked once"

    in_flight.counts[names.pod_name(victim, 0)] = 0
    await harness.settle()
    assert group_pods(harness, victim) == []
    assert ("Service", NAMESPACE, victim) not in harness.kube.objects
    deleted = {
        grace for kind, name, grace in harness.kube.deletions if kind == "Pod" and name.startswith(victim)
    }
    assert deleted == {None}, "deleted with the pods' own termination grace"
    [drained] = [m for _, reason, m in harness.kube.events if reason == "Drained"]
    assert drained.startswith(f"group {victim}: drained after ")
    assert harness.status["phase"] == "Running"
    assert [g["name"] for g in harness.status["groups"]] != [victim]


async def test_an_unknown_count_waits_for_the_drain_timeout() -> None:
    harness, in_flight = draining_harness(replicas=2, disruption={"drainTimeout": "60s"})
    victim = await scaled_down_and_draining(harness, in_flight, requests=None)
    await harness.settle()
    assert len(group_pods(harness, victim)) == 2
    [leaving] = [g for g in harness.status["groups"] if g["name"] == victim]
    assert "requests in flight unknown yet" in leaving["disruption"]
    # Time passes: the drain started longer ago than the timeout.
    service = harness.kube.objects[("Service", NAMESPACE, victim)]
    started = datetime.now(UTC) - timedelta(seconds=61)
    service["metadata"]["annotations"][names.ANNOTATION_DRAINING_SINCE] = started.isoformat()
    await harness.settle()
    assert group_pods(harness, victim) == []
    [(kind, message)] = [(t, m) for t, reason, m in harness.kube.events if reason == "Drained"]
    assert kind == "Warning"
    assert "drain timeout (60s) with an unknown number of requests still in flight" in message


async def test_a_restarted_operator_keeps_the_drain_deadline() -> None:
    harness, in_flight = draining_harness(replicas=2, disruption={"drainTimeout": "60s"})
    victim = await scaled_down_and_draining(harness, in_flight, requests=3)
    since = harness.kube.objects[("Service", NAMESPACE, victim)]["metadata"]["annotations"][
        names.ANNOTATION_DRAINING_SINCE
    ]
    harness.controller = Controller(kube=harness.kube, in_flight=in_flight)
    await harness.controller.prime()
    await harness.settle()
    annotations = harness.kube.objects[("Service", NAMESPACE, victim)]["metadata"]["annotations"]
    assert annotations[names.ANNOTATION_DRAINING_SINCE] == since
    assert len(group_pods(harness, victim)) == 2


async def test_idle_groups_and_drain_timeout_zero_are_removed_at_once() -> None:
    harness, in_flight = draining_harness(replicas=2, disruption={"drainTimeout": "0s"})
    await harness.settle()
    harness.update_spec(replicas=1)
    harness.kube.sync(harness.controller)
    await harness.controller.reconcile_once(KEY)
    assert len(harness.pods()) == 1 + 2, "the router pod and the remaining group"
    assert "Draining" not in reasons(harness)
    assert in_flight.asked == [([ROUTER_URL], [])] * len(in_flight.asked), "no group to ask about"


async def test_a_roll_drains_each_old_group_and_surges_the_next_once_it_is_gone() -> None:
    harness, in_flight = draining_harness(replicas=2)
    await harness.settle()
    harness.update_spec(engine={"image": "trtllm:next"})
    in_flight.counts = {"llama-worker-0-0": 1, "llama-worker-1-0": 1}
    await harness.settle()
    groups = {
        p["metadata"]["labels"][names.LABEL_GROUP]
        for p in harness.pods()
        if "router" not in p["metadata"]["name"]
    }
    assert len(groups) == 3, "one old group drains, one old still serves, one new serves"
    assert reasons(harness)["Draining"] == 1
    surges = [m for _, reason, m in harness.kube.events if reason == "RollingUpdate" and "1 new" in m]
    assert len(surges) == 1, "no second surge while the first old group drains"
    in_flight.counts = {}
    await harness.settle()
    images = Counter(
        p["spec"]["containers"][0]["image"] for p in harness.pods() if "router" not in p["metadata"]["name"]
    )
    assert images == {"trtllm:next": 4}
    assert reasons(harness)["Drained"] == 2


def test_worker_pods_stop_gracefully_within_the_drain_timeout() -> None:
    deployment = make_deployment(replicas=1, disruption={"drainTimeout": "90s"})
    layout = children.GroupLayout(
        role=Role.WORKER, replica=0, pods=(("gpu-a", 8),), domain="d", rack="r", cost=0.0
    )
    [pod] = children.worker_pods(deployment, layout, cold_start_source=None)
    assert pod["spec"]["terminationGracePeriodSeconds"] == children.PRE_STOP_SLEEP_S + 90
    lifecycle = pod["spec"]["containers"][0]["lifecycle"]
    assert lifecycle == {"preStop": {"sleep": {"seconds": children.PRE_STOP_SLEEP_S}}}


def test_router_reports_are_summed_and_only_final_once_every_router_drains_the_worker() -> None:
    workers = ["a-0", "b-0", "c-0"]
    one = [{"key": "a-0", "draining": True, "in_flight": 2}, {"key": "b-0", "draining": True, "in_flight": 0}]
    two = [
        {"key": "a-0", "draining": True, "in_flight": 1},
        {"key": "b-0", "draining": False, "in_flight": 0},
    ]
    assert tally([one, two], workers) == {"a-0": 3, "b-0": None, "c-0": 0}
    assert tally([one, None], workers) == {"a-0": None, "b-0": None, "c-0": None}, "a silent router"
    assert tally([], workers) == {"a-0": 0, "b-0": 0, "c-0": 0}, "no router: nothing routes"


async def test_an_endpoint_picker_is_asked_on_its_metrics_port() -> None:
    harness, in_flight = draining_harness(replicas=2, router={"mode": "epp"})
    await scaled_down_and_draining(harness, in_flight, requests=1)
    await harness.settle()
    assert in_flight.asked[-1][0] == [f"http://10.0.9.9:{children.EPP_METRICS_PORT}"]


async def test_a_scale_up_during_a_drain_takes_the_draining_group_back() -> None:
    harness, in_flight = draining_harness(replicas=2)
    victim = await scaled_down_and_draining(harness, in_flight, requests=2)
    pods_before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in group_pods(harness, victim)}
    harness.update_spec(replicas=2)
    await harness.settle()
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in group_pods(harness, victim)} == pods_before
    assert all(names.LABEL_DRAINING not in p["metadata"]["labels"] for p in group_pods(harness, victim))
    annotations = harness.kube.objects[("Service", NAMESPACE, victim)]["metadata"]["annotations"]
    assert names.ANNOTATION_DRAINING_SINCE not in annotations
    assert names.ANNOTATION_DRAINING_REASON not in annotations
    assert reasons(harness)["DrainCancelled"] == 1
    assert reasons(harness)["Placed"] == 2, "no new group was placed for the scale-up"
    assert harness.status["ready"] == "worker 2/2"
    assert all("disruption" not in g for g in harness.status["groups"])


async def test_a_draining_group_of_an_old_template_is_not_taken_back() -> None:
    harness, in_flight = draining_harness(replicas=2)
    victim = await scaled_down_and_draining(harness, in_flight, requests=2)
    harness.update_spec(replicas=2, engine={"image": "trtllm:next"})
    harness.kube.sync(harness.controller)
    await harness.controller.reconcile_once(KEY)
    assert "DrainCancelled" not in reasons(harness)
    assert all(
        p["metadata"]["labels"].get(names.LABEL_DRAINING) == "true" for p in group_pods(harness, victim)
    )


def test_a_worker_is_unused_until_every_answering_router_lists_it_serving() -> None:
    workers = ["a-0", "b-0", "c-0"]
    one = [{"key": "a-0", "draining": False}, {"key": "b-0", "draining": False}]
    two = [{"key": "a-0", "draining": False}, {"key": "b-0", "draining": True}]
    assert unused([one, two], workers) == {"b-0", "c-0"}
    assert unused([one, None], workers) == {"c-0"}, "a silent router says nothing"
    assert unused([], workers) == set()


async def test_a_roll_retires_no_old_group_before_the_routers_use_the_new_one() -> None:
    """kubelet readiness is not routability: a router registers a worker after its own probe.
    The old group stays until every router lists the new one, so what they route never shrinks."""
    harness, in_flight = draining_harness(replicas=1)
    await harness.settle()
    [old] = {p["metadata"]["labels"][names.LABEL_GROUP] for p in workers(harness)}
    in_flight.unused = {"llama-worker-1-0"}
    harness.update_spec(engine={"image": "trtllm:next"})
    await harness.settle()
    groups = {p["metadata"]["labels"][names.LABEL_GROUP]: p for p in workers(harness)}
    assert set(groups) == {old, "llama-worker-1"}, "the new group is up, the old one stays"
    assert names.LABEL_DRAINING not in groups[old]["metadata"]["labels"]
    assert harness.status["roles"]["worker"]["updatedReady"] == 1

    in_flight.unused = set()
    await harness.settle()
    assert {p["metadata"]["labels"][names.LABEL_GROUP] for p in workers(harness)} == {"llama-worker-1"}
