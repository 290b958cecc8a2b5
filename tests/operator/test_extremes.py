"""The operator at the extremes its API allows: the longest names, thousands of replicas, TP at
the CRD's maximum, a thousand deployments in one namespace."""

from __future__ import annotations

import re
import tracemalloc
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import pytest

from copse.api import ManifestError, Role, parse_deployment
from copse.api.crd import crd_objects
from copse.api.v1alpha1 import NAME_MAX_LENGTH
from copse.operator import names
from copse.operator.controller import Controller
from copse.operator.reconcile import ReconcileSettings, reconcile
from copse.topology.fake import gpu_nodes

from .fake_cluster import FakeKube

NAMESPACE = "serving"
LONGEST = "l" + "x" * (NAME_MAX_LENGTH - 2) + "a"
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "copse.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}", "generation": 1},
        "spec": {"model": {"name": "meta-llama/Llama-3-70B", "tensorParallelism": 8}, **spec},
    }


class WatchedKube(FakeKube):
    """Feeds the controller's cache every pod and Service it stores or deletes, as the watches do
    between passes: deployments reconciled one after another see each other's pods."""

    controller: Controller | None = None

    def _store(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        stored = super()._store(obj)
        self._watch(stored, deleted=False)
        return stored

    async def delete(
        self, kind: str, *, namespace: str, name: str, grace_period_s: int | None = None
    ) -> None:
        gone = self.objects.get((kind, namespace, name))
        await super().delete(kind, namespace=namespace, name=name, grace_period_s=grace_period_s)
        if gone is not None:
            self._watch(gone, deleted=True)

    def _watch(self, obj: Mapping[str, Any], *, deleted: bool) -> None:
        if self.controller is None:
            return
        if obj["kind"] == "Pod":
            self.controller.on_pod(obj, deleted=deleted)
        elif obj["kind"] == "Service" and names.LABEL_GROUP in obj["metadata"].get("labels", {}):
            self.controller.on_service(obj, deleted=deleted)


def cluster(*, racks: int, deployments: list[dict[str, Any]]) -> tuple[FakeKube, Controller]:
    kube = WatchedKube()
    for node in gpu_nodes(racks=racks):
        kube.nodes[node["metadata"]["name"]] = node
    for body in deployments:
        kube.objects[("InferenceDeployment", NAMESPACE, body["metadata"]["name"])] = body
    kube.controller = Controller(kube=kube, settings=ReconcileSettings(restart_backoff_base_s=0))
    return kube, kube.controller


async def run_passes(kube: FakeKube, controller: Controller, *, passes: int) -> None:
    """``passes`` rounds of: the watches feed the cache, every deployment gets one pass, pods run."""
    for _ in range(passes):
        kube.sync(controller)
        for key in sorted(controller.cache.deployments):
            await controller.reconcile_once(key)
        kube.kubelet()


def status_of(kube: FakeKube, name: str) -> dict[str, Any]:
    status: dict[str, Any] = kube.objects[("InferenceDeployment", NAMESPACE, name)]["status"]
    return status


def conditions_of(kube: FakeKube, name: str) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status_of(kube, name)["conditions"]}


async def test_a_63_character_name_gives_valid_names_and_labels_to_every_child() -> None:
    kube, controller = cluster(racks=2, deployments=[manifest(LONGEST, replicas=2)])
    await run_passes(kube, controller, passes=4)
    assert status_of(kube, LONGEST)["phase"] == "Running"
    children = [obj for (kind, _, _), obj in kube.objects.items() if kind != "InferenceDeployment"]
    kinds = {obj["kind"] for obj in children}
    assert {"Pod", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    for obj in children:
        name = obj["metadata"]["name"]
        pattern = DNS_1035 if obj["kind"] == "Service" else DNS_1123_SUBDOMAIN
        assert len(name) <= 63, (obj["kind"], name)
        assert pattern.match(name), (obj["kind"], name)
        for key, value in obj["metadata"].get("labels", {}).items():
            assert len(value) <= 63, (obj["kind"], name, key, value)
            assert LABEL_VALUE.match(value), (obj["kind"], name, key, value)
    # Cut names stay distinct and stable: the same inputs always give the same name.
    groups = {names.group_name(LONGEST, role, replica) for role in Role for replica in range(100)}
    assert len(groups) == 100 * len(Role)
    assert names.group_name(LONGEST, Role.WORKER, 7) == names.group_name(LONGEST, Role.WORKER, 7)


@pytest.mark.parametrize(
    "name",
    [LONGEST + "b", "llama.v2", "1llama", "Llama"],
    ids=["64-characters", "dot", "leading-digit", "upper-case"],
)
async def test_a_name_that_cannot_name_services_and_labels_is_refused_with_a_condition(name: str) -> None:
    with pytest.raises(ManifestError, match=r"metadata\.name must be a DNS-1035 label of at most 63"):
        parse_deployment(manifest(name, replicas=1), source="test")
    kube, controller = cluster(racks=1, deployments=[manifest(name, replicas=1)])
    await run_passes(kube, controller, passes=1)
    status = status_of(kube, name)
    assert status["phase"] == "Failed"
    [invalid] = status["conditions"]
    assert invalid["type"] == "InvalidSpec"
    assert invalid["status"] == "True"
    assert invalid["reason"] == "ValidationFailed"
    assert repr(name) in invalid["message"]
    assert [reason for _, reason, _ in kube.events] == ["InvalidSpec"]
    assert {kind for kind, _, _ in kube.objects} == {"InferenceDeployment"}


def test_the_crd_refuses_the_same_names() -> None:
    [crd] = crd_objects()
    [rule] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    assert "self.metadata.name.size() <= 63" in rule["rule"]
    assert "DNS-1035" in rule["message"]


def _peak_reconcile_bytes(*, max_replicas: int, nodes: list[dict[str, Any]]) -> int:
    deployment = parse_deployment(
        manifest("llama", replicas=2, scaling={"maxReplicas": max_replicas}), source="test"
    )
    tracemalloc.start()
    try:
        reconcile(
            deployment=deployment,
            groups=[],
            nodes=nodes,
            pods=[],
            now=datetime.now(UTC),
            generation=1,
            previous_status=None,
            in_flight={},
            settings=ReconcileSettings(),
        )
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_max_replicas_in_the_millions_allocates_nothing_more_than_the_groups_that_exist() -> None:
    nodes = gpu_nodes(racks=2)
    small = _peak_reconcile_bytes(max_replicas=16, nodes=nodes)
    huge = _peak_reconcile_bytes(max_replicas=5_000_000, nodes=nodes)
    assert huge < small * 1.5


async def test_thousands_of_replicas_beyond_capacity_place_what_fits_and_say_why_the_rest_does_not() -> None:
    # Two racks hold 18 groups of TP 8; 2,000 are asked for.
    body = manifest("llama", replicas=2000, scaling={"maxReplicas": 5000})
    kube, controller = cluster(racks=2, deployments=[body])
    await run_passes(kube, controller, passes=2)
    status = status_of(kube, "llama")
    infeasible = conditions_of(kube, "llama")["PlacementInfeasible"]
    assert infeasible["status"] == "True"
    assert infeasible["reason"] == "NotEnoughCapacity"
    assert len(status["groups"]) == 18
    assert len(kube.of_kind("Pod")) == 18 * 2  # TP 8 on 4-GPU trays: two pods a group
    assert conditions_of(kube, "llama")["Placed"]["message"] == "18/2000 groups placed"
    # The status and the Event name a few unplaced groups and count the rest: they stay small.
    assert infeasible["message"].startswith("worker 18: needs 8 GPUs")
    assert infeasible["message"].endswith("; and 1977 more group(s) unplaced")
    assert len(infeasible["message"]) < 2000
    assert len(status["unplaced"]) == 5
    assert status["unplacedTotal"] == 1982
    [event] = [message for _, reason, message in kube.events if reason == "PlacementInfeasible"]
    assert event == infeasible["message"]


async def test_tp_at_the_crd_maximum_larger_than_the_cluster_is_infeasible_with_a_reason() -> None:
    body = manifest("llama", replicas=1)
    body["spec"]["model"]["tensorParallelism"] = 1024
    kube, controller = cluster(racks=2, deployments=[body])
    await run_passes(kube, controller, passes=2)
    infeasible = conditions_of(kube, "llama")["PlacementInfeasible"]
    assert infeasible["status"] == "True"
    assert "1024" in infeasible["message"]
    assert kube.of_kind("Pod") == []


async def test_a_thousand_deployments_in_one_namespace_all_reach_their_decision() -> None:
    # 1,000 TP-1 deployments on 14 racks (1,008 GPUs); every tenth asks for more than exists.
    bodies = []
    for index in range(1000):
        body = manifest(f"m{index:04d}", replicas=1)
        body["spec"]["model"]["tensorParallelism"] = 1024 if index % 10 == 9 else 1
        bodies.append(body)
    kube, controller = cluster(racks=14, deployments=bodies)
    await run_passes(kube, controller, passes=2)
    for index in range(1000):
        name = f"m{index:04d}"
        conditions = conditions_of(kube, name)
        if index % 10 == 9:
            assert conditions["PlacementInfeasible"]["status"] == "True", name
        else:
            assert status_of(kube, name)["phase"] == "Running", name
            assert conditions["Ready"]["status"] == "True", name
    # The cache holds what the cluster holds, one entry per object.
    assert len(controller.cache.deployments) == 1000
    assert len(controller.cache.pods) == len(kube.of_kind("Pod")) == 900
    # Deleting them all leaves nothing behind in the controller.
    for body in bodies:
        controller.on_deployment(body, deleted=True)
    assert controller.cache.deployments == {}
    assert controller._created == set()
