"""The controller against an in-memory cluster: placement, gangs, failures, scaling, rolling."""

from __future__ import annotations

import copy
import json
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from copse.api import Role, parse_deployment
from copse.operator import names
from copse.operator.children import legacy_template_hash
from copse.operator.controller import Controller
from copse.operator.reconcile import ReconcileSettings, reconcile
from copse.operator.state import GroupState, observe_groups
from copse.topology.fake import gpu_nodes

from .fake_cluster import FakeKube

NAMESPACE = "serving"
KEY = (NAMESPACE, "llama")


def manifest(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "copse.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "llama", "namespace": NAMESPACE, "uid": "uid-llama", "generation": 1},
        "spec": {
            "model": {"name": "meta-llama/Llama-3-70B", "tensorParallelism": 8},
            "placement": {
                "affinityPolicy": "same-nvswitch-domain",
                "antiAffinityPolicy": "spread-across-racks",
            },
            **spec,
        },
    }


class Harness:
    def __init__(self, *, racks: int = 2, **spec: Any) -> None:
        self.kube = FakeKube()
        for node in gpu_nodes(racks=racks):
            self.kube.nodes[node["metadata"]["name"]] = node
        self.kube.objects[("InferenceDeployment", NAMESPACE, "llama")] = manifest(**spec)
        self.controller = Controller(kube=self.kube, settings=ReconcileSettings(restart_backoff_base_s=0))

    def snapshot(self) -> str:
        return json.dumps({"/".join(key): obj for key, obj in self.kube.objects.items()}, sort_keys=True)

    async def settle(self, *, max_passes: int = 12) -> int:
        """Reconcile until a pass changes nothing; returns the passes it took."""
        for passes in range(1, max_passes + 1):
            before = self.snapshot()
            self.kube.sync(self.controller)
            await self.controller.reconcile_once(KEY)
            self.kube.kubelet()
            if self.snapshot() == before:
                return passes
        raise AssertionError(f"no steady state after {max_passes} passes")

    @property
    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = self.kube.objects[("InferenceDeployment", NAMESPACE, "llama")]["status"]
        return status

    def update_spec(self, **spec: Any) -> None:
        body = self.kube.objects[("InferenceDeployment", NAMESPACE, "llama")]
        body["spec"].update(copy.deepcopy(spec))
        body["metadata"]["generation"] += 1

    def pods(self) -> list[dict[str, Any]]:
        return self.kube.of_kind("Pod")


def node_of(pod: dict[str, Any]) -> str:
    node: str = pod["spec"]["nodeName"]
    return node


async def test_seed_deployment_lands_one_group_per_rack() -> None:
    harness = Harness(scaling={"minReplicas": 2, "maxReplicas": 16})
    await harness.settle()
    status = harness.status
    assert status["phase"] == "Running"
    assert status["ready"] == "worker 2/2"
    groups = status["groups"]
    assert [g["name"] for g in groups] == ["llama-worker-0", "llama-worker-1"]
    assert all(g["domain"] is not None and g["ready"] for g in groups)
    assert len({g["rack"] for g in groups}) == 2, "spread-across-racks puts replicas on different racks"
    assert status["score"] == pytest.approx(1.0, abs=0.05)
    pods = harness.pods()
    assert len(pods) == 4  # TP=8 on 4-GPU trays: two pods per group
    assert all(not p["spec"].get("schedulingGates") and p["status"]["phase"] == "Running" for p in pods)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert {kind: c["status"] for kind, c in conditions.items()} == {
        "Placed": "True",
        "Ready": "True",
        "PlacementInfeasible": "False",
        # The seed manifest names no tokenizer or KV capacity for its TensorRT-LLM router.
        "KVRouting": "False",
        "MultiNodeNVLink": "False",  # the in-memory cluster has no ComputeDomain CRD
    }
    assert conditions["KVRouting"]["reason"] == "TokenizerMissing"
    assert "spec.router.tokenizer" in conditions["KVRouting"]["message"]
    body = harness.kube.objects[("InferenceDeployment", NAMESPACE, "llama")]
    assert body["spec"]["replicas"] == 2, "spec.replicas written once, so /scale reads the real count"
    assert status["observedGeneration"] == 2, "that write is generation 2"
    assert status["replicas"] == 2
    assert status["selector"] == (
        "app.kubernetes.io/component=worker,copse.dev/deployment=llama,copse.dev/leader=true,"
        "copse.dev/role=worker,!copse.dev/draining"
    )
    reasons = Counter(reason for _, reason, _ in harness.kube.events)
    assert reasons["Placed"] == 2
    assert reasons["ReplicasDefaulted"] == 1
    assert reasons["KVRoutingDegraded"] == 1  # once, not on every pass
    harness.update_spec(router={"tokenizer": {"configMap": "llama-tokenizer"}, "kvCapacityTokens": 500_000})
    await harness.settle()
    [routing] = [c for c in harness.status["conditions"] if c["type"] == "KVRouting"]
    assert (routing["status"], routing["reason"]) == ("True", "Supported")
    assert ("ConfigMap", NAMESPACE, "llama-engine") in harness.kube.objects
    assert ("Deployment", NAMESPACE, "llama-router") in harness.kube.objects


async def test_gates_lift_only_after_the_whole_gang_exists() -> None:
    harness = Harness(replicas=1)
    harness.kube.sync(harness.controller)
    await harness.controller.reconcile_once(KEY)
    calls = [(verb, name) for verb, name in harness.kube.calls if verb in {"create Pod", "patch Pod"}]
    assert calls == [
        ("create Pod", "llama-worker-0-0"),
        ("create Pod", "llama-worker-0-1"),
        ("patch Pod", "llama-worker-0-0"),
        ("patch Pod", "llama-worker-0-1"),
    ]
    assert all(
        body["spec"]["schedulingGates"] == [{"name": names.GANG_GATE}] for body in harness.kube.created_pods
    )
    assert all("schedulingGates" not in p["spec"] for p in harness.pods())


async def test_a_gang_whose_pods_exist_unseen_waits_for_the_watch() -> None:
    harness = Harness(replicas=1)
    harness.kube.sync(harness.controller)
    await harness.controller.reconcile_once(KEY)
    service = harness.kube.objects[("Service", NAMESPACE, "llama-worker-0")]
    # A restarted operator whose watch has the Service but not yet the (gated) pods.
    harness.controller = Controller(kube=harness.kube)
    for pod in harness.pods():
        pod["spec"]["schedulingGates"] = [{"name": names.GANG_GATE}]
    harness.kube.sync(harness.controller)
    harness.controller.cache.pods.clear()
    harness.kube.calls.clear()
    await harness.controller.reconcile_once(KEY)
    assert [verb for verb, _ in harness.kube.calls if verb.endswith("Pod")] == ["create Pod", "create Pod"]
    assert all(p["spec"]["schedulingGates"] for p in harness.pods()), "409s prove nothing about gates"
    assert harness.kube.objects[("Service", NAMESPACE, "llama-worker-0")] == service
    await harness.settle()
    assert all("schedulingGates" not in p["spec"] for p in harness.pods())


async def test_a_second_pass_on_a_settled_deployment_changes_nothing() -> None:
    harness = Harness(replicas=2)
    await harness.settle()
    assert await harness.settle() == 1


async def test_restarted_operator_finishes_a_half_created_gang_without_duplicates() -> None:
    harness = Harness(replicas=1)
    harness.kube.sync(harness.controller)
    await harness.controller.reconcile_once(KEY)
    [first, _] = sorted(p["metadata"]["name"] for p in harness.pods())
    # The operator died after creating the Service and one (still gated) pod.
    del harness.kube.objects[("Pod", NAMESPACE, "llama-worker-0-1")]
    harness.kube.objects[("Pod", NAMESPACE, first)]["spec"]["schedulingGates"] = [{"name": names.GANG_GATE}]
    planned = copy.deepcopy(harness.kube.objects[("Service", NAMESPACE, "llama-worker-0")])
    harness.controller = Controller(kube=harness.kube, settings=ReconcileSettings(restart_backoff_base_s=0))
    await harness.controller.prime()
    assert set(harness.controller.cache.pods) == {(NAMESPACE, first)}
    await harness.settle()
    assert "GangRestart" not in [reason for _, reason, _ in harness.kube.events]
    pods = harness.pods()
    assert sorted(p["metadata"]["name"] for p in pods) == [first, "llama-worker-0-1"]
    recorded = json.loads(planned["metadata"]["annotations"][names.ANNOTATION_PLACEMENT])
    assert sorted(node_of(p) for p in pods) == sorted(pod["node"] for pod in recorded)
    assert harness.status["phase"] == "Running"


async def test_node_loss_restarts_the_whole_gang_elsewhere() -> None:
    harness = Harness(replicas=2)
    await harness.settle()
    by_group: dict[str, list[str]] = {}
    for pod in harness.pods():
        by_group.setdefault(pod["metadata"]["labels"][names.LABEL_GROUP], []).append(node_of(pod))
    lost = by_group["llama-worker-0"][0]
    del harness.kube.nodes[lost]
    await harness.settle()
    after: dict[str, list[str]] = {}
    for pod in harness.pods():
        after.setdefault(pod["metadata"]["labels"][names.LABEL_GROUP], []).append(node_of(pod))
    assert lost not in after["llama-worker-0"]
    assert sorted(after["llama-worker-1"]) == sorted(by_group["llama-worker-1"]), (
        "the other gang keeps serving"
    )
    assert harness.status["phase"] == "Running"
    restarts = [message for _, reason, message in harness.kube.events if reason == "GangRestart"]
    assert restarts == [f"restarting group llama-worker-0: node {lost} is gone"]
    # The broken gang's pods went at once (grace 0): a TP group missing a rank cannot serve.
    assert {grace for kind, _, grace in harness.kube.deletions if kind == "Pod"} == {0}


def placement_of(harness: Harness) -> dict[str, tuple[str, str]]:
    """Pod name -> (uid, node) of every worker pod: what a restart would change."""
    return {p["metadata"]["name"]: (p["metadata"]["uid"], node_of(p)) for p in harness.pods()}


async def test_a_cordon_moves_the_gang_whole_new_one_first() -> None:
    harness = Harness(racks=1, replicas=1)
    await harness.settle()
    node = node_of(harness.kube.objects[("Pod", NAMESPACE, "llama-worker-0-0")])
    harness.kube.nodes[node]["spec"]["unschedulable"] = True
    seen = []
    for _ in range(12):
        before = harness.snapshot()
        harness.kube.sync(harness.controller)
        await harness.controller.reconcile_once(KEY)
        harness.kube.kubelet()
        seen.append(
            {
                p["metadata"]["labels"][names.LABEL_GROUP]
                for p in harness.pods()
                if p["status"]["phase"] == "Running"
            }
        )
        if harness.snapshot() == before:
            break
    assert all(seen), "a group serves at every pass"
    assert seen[-1] == {"llama-worker-1"}, "the successor took over; the cordoned group is gone"
    assert node not in {node_of(p) for p in harness.pods()}
    assert "GangRestart" not in [reason for _, reason, _ in harness.kube.events]
    [moved] = [m for _, reason, m in harness.kube.events if reason == "Moved"]
    assert moved == "group llama-worker-0 leaves its cordoned node: its successor serves"
    [retired] = [m for _, reason, m in harness.kube.events if reason == "Draining"]
    assert retired.startswith("group llama-worker-0 drains before removal (moved off a cordoned node)")


async def test_a_cordon_with_on_cordon_keep_keeps_its_gang_and_takes_no_new_one() -> None:
    harness = Harness(racks=1, replicas=1, disruption={"onCordon": "Keep"})
    await harness.settle()
    before = placement_of(harness)
    node = node_of(harness.kube.objects[("Pod", NAMESPACE, "llama-worker-0-0")])
    harness.kube.nodes[node]["spec"]["unschedulable"] = True
    harness.kube.nodes[node]["spec"]["taints"] = [
        {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
    ]
    await harness.settle()
    assert placement_of(harness) == before, "a cordon means no new pods, not broken ones"
    [group] = harness.status["groups"]
    assert group["disruption"] == (
        f"node {node} is cordoned: the group keeps running there, no new pods land on it"
    )
    assert harness.status["phase"] == "Running"
    assert "GangRestart" not in [reason for _, reason, _ in harness.kube.events]
    harness.update_spec(replicas=2)
    await harness.settle()
    assert harness.status["ready"] == "worker 2/2"
    new = [p for p in harness.pods() if p["metadata"]["labels"][names.LABEL_GROUP] == "llama-worker-1"]
    assert node not in {node_of(p) for p in new}, "placement avoids the cordoned node"


def set_ready(node: dict[str, Any], status: str, *, since: datetime) -> None:
    [ready] = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    ready.update(status=status, lastTransitionTime=since.isoformat())


async def test_not_ready_node_is_waited_out_for_the_grace_then_only_its_gang_moves() -> None:
    harness = Harness(replicas=2, disruption={"notReadyGrace": "120s"})
    await harness.settle()
    before = placement_of(harness)
    node = node_of(harness.kube.objects[("Pod", NAMESPACE, "llama-worker-0-0")])
    now = datetime.now(UTC)
    set_ready(harness.kube.nodes[node], "False", since=now - timedelta(seconds=30))
    await harness.settle()
    assert placement_of(harness) == before, "a NotReady node gets its grace before the gang moves"
    [waiting] = [g for g in harness.status["groups"] if g.get("disruption")]
    assert waiting["name"] == "llama-worker-0"
    assert f"node {node} NotReady since" in waiting["disruption"]
    assert [m for _, reason, m in harness.kube.events if reason == "NodeNotReady"] == [
        f"group llama-worker-0: {waiting['disruption']}"
    ], "one Event, however many passes"
    # Level-triggered: the pass asks to come back when the grace ends, with no event needed.
    harness.kube.sync(harness.controller)
    requeue = await harness.controller.reconcile_once(KEY)
    assert requeue == pytest.approx(90, abs=2)

    set_ready(harness.kube.nodes[node], "True", since=datetime.now(UTC))
    await harness.settle()
    assert placement_of(harness) == before
    assert not any(g.get("disruption") for g in harness.status["groups"])

    set_ready(harness.kube.nodes[node], "False", since=datetime.now(UTC) - timedelta(seconds=121))
    await harness.settle()
    after = placement_of(harness)
    assert node not in {where for _, where in after.values()}
    moved = {pod for pod in before if pod.startswith("llama-worker-0-")}
    assert {pod: after[pod] for pod in before if pod not in moved} == {
        pod: before[pod] for pod in before if pod not in moved
    }, "the other gang keeps its pods"
    assert harness.status["phase"] == "Running"
    [restart] = [m for _, reason, m in harness.kube.events if reason == "GangRestart"]
    assert f"node {node} has been NotReady for 121s (grace 120s)" in restart


async def test_not_ready_node_with_failed_pods_restarts_at_once() -> None:
    harness = Harness(replicas=1)
    await harness.settle()
    pod = harness.kube.objects[("Pod", NAMESPACE, "llama-worker-0-1")]
    set_ready(harness.kube.nodes[node_of(pod)], "False", since=datetime.now(UTC))
    pod["status"]["phase"] = "Failed"
    await harness.settle()
    [restart] = [m for _, reason, m in harness.kube.events if reason == "GangRestart"]
    assert "llama-worker-0-1 (rank 1) failed" in restart
    assert harness.status["phase"] == "Running"


async def test_failed_pod_restarts_its_gang() -> None:
    harness = Harness(replicas=1)
    await harness.settle()
    victim = harness.kube.objects[("Pod", NAMESPACE, "llama-worker-0-1")]
    victim["status"]["phase"] = "Failed"
    await harness.settle()
    assert harness.status["phase"] == "Running"
    service = harness.kube.objects[("Service", NAMESPACE, "llama-worker-0")]
    assert service["metadata"]["annotations"][names.ANNOTATION_RESTARTS] == "1"


async def test_scale_up_then_down_frees_whole_domains() -> None:
    harness = Harness(racks=3, replicas=2)
    await harness.settle()
    harness.update_spec(replicas=6)
    await harness.settle()
    assert harness.status["ready"] == "worker 6/6"
    assert harness.status["replicas"] == 6
    harness.update_spec(replicas=3)
    await harness.settle()
    assert harness.status["ready"] == "worker 3/3"
    assert len(harness.pods()) == 6
    racks = [g["rack"] for g in harness.status["groups"]]
    assert len(set(racks)) == 3, "scale-down keeps one group per rack rather than emptying one"
    assert Counter(reason for _, reason, _ in harness.kube.events)["Placed"] == 6


def selected(harness: Harness) -> list[dict[str, Any]]:
    """Pods the scale subresource's selector selects (its ``k=v`` and ``!k`` terms)."""
    terms = harness.status["selector"].split(",")
    equal = dict(term.split("=") for term in terms if not term.startswith("!"))
    absent = [term[1:] for term in terms if term.startswith("!")]
    return [
        p
        for p in harness.pods()
        if all(p["metadata"]["labels"].get(k) == v for k, v in equal.items())
        and not any(k in p["metadata"]["labels"] for k in absent)
        and not p["metadata"].get("deletionTimestamp")
    ]


async def test_scale_replicas_and_selector_agree_on_what_a_replica_is() -> None:
    """One replica is one TP group (two pods here), selected by its rank-0 pod: an autoscaler
    averaging per-pod metrics over the selector sees one pod per replica."""
    harness = Harness(racks=3, replicas=1)
    await harness.settle()
    for replicas in (4, 2):
        harness.update_spec(replicas=replicas)
        await harness.settle()
        assert harness.status["replicas"] == replicas == len(selected(harness))
        assert len(harness.pods()) == 2 * replicas
        assert {p["metadata"]["labels"][names.LABEL_RANK] for p in selected(harness)} == {"0"}


async def test_disaggregated_deployments_get_no_spec_replicas_and_scale_per_pool() -> None:
    harness = Harness(racks=2, prefill={"replicas": 1, "tensorParallelism": 4}, decode={"replicas": 1})
    await harness.settle()
    body = harness.kube.objects[("InferenceDeployment", NAMESPACE, "llama")]
    assert "replicas" not in body["spec"]
    assert harness.status["replicas"] == 0
    assert selected(harness) == []
    # What `kubectl patch idep/llama --type=merge -p '{"spec":{"decode":{"replicas":2}}}'` does.
    harness.update_spec(decode={"replicas": 2})
    await harness.settle()
    roll = {"old": 0}
    assert harness.status["roles"]["decode"] == {
        "desired": 2, "placed": 2, "ready": 2, "updated": 2, "updatedReady": 2, **roll
    }  # fmt: skip
    assert harness.status["roles"]["prefill"] == {
        "desired": 1, "placed": 1, "ready": 1, "updated": 1, "updatedReady": 1, **roll
    }  # fmt: skip


async def test_replicas_are_defaulted_only_over_the_version_read() -> None:
    harness = Harness(scaling={"minReplicas": 2})
    body = harness.kube.objects[("InferenceDeployment", NAMESPACE, "llama")]
    body["metadata"]["resourceVersion"] = "7"
    harness.kube.sync(harness.controller)
    body["metadata"]["resourceVersion"] = "8"  # someone wrote it after our watch saw version 7
    await harness.controller.reconcile_once(KEY)
    assert "replicas" not in body["spec"]
    assert "ReplicasDefaulted" not in [reason for _, reason, _ in harness.kube.events]
    await harness.settle()
    assert body["spec"]["replicas"] == 2


async def test_infeasible_groups_are_reported_and_heal_when_nodes_arrive() -> None:
    harness = Harness(racks=1, replicas=12, scaling={"maxReplicas": 16})
    await harness.settle()
    status = harness.status
    assert status["phase"] == "Degraded"
    assert status["roles"]["worker"] == {
        "desired": 12, "placed": 9, "ready": 9, "updated": 9, "updatedReady": 9, "old": 0
    }  # fmt: skip
    assert len(status["unplaced"]) == 3
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["PlacementInfeasible"]["status"] == "True"
    assert "worker" in conditions["PlacementInfeasible"]["message"]
    assert [reason for _, reason, _ in harness.kube.events].count("PlacementInfeasible") == 1
    for node in gpu_nodes(racks=2, prefix="extra")[72 // 4 :]:
        harness.kube.nodes[node["metadata"]["name"]] = node
    await harness.settle()
    assert harness.status["phase"] == "Running"
    assert harness.status["unplaced"] == []


async def test_disaggregated_pools_sit_close() -> None:
    harness = Harness(racks=2, prefill={"replicas": 1, "tensorParallelism": 4}, decode={"replicas": 1})
    await harness.settle()
    status = harness.status
    assert status["ready"] == "prefill 1/1, decode 1/1"
    [decode, prefill] = sorted(status["groups"], key=lambda g: g["role"])
    assert prefill["rack"] == decode["rack"], "KV transfer stays inside the rack"
    roles = Counter(p["metadata"]["labels"][names.LABEL_ROLE] for p in harness.pods())
    assert roles == {"prefill": 1, "decode": 2}


async def test_engine_change_rolls_one_group_at_a_time_keeping_capacity() -> None:
    harness = Harness(racks=3, replicas=2)
    await harness.settle()
    harness.update_spec(engine={"image": "trtllm:next"})
    images_seen: list[Counter[str]] = []
    for _ in range(30):
        before = harness.snapshot()
        harness.kube.sync(harness.controller)
        await harness.controller.reconcile_once(KEY)
        harness.kube.kubelet()
        ready = [
            p
            for p in harness.pods()
            if p.get("status", {}).get("phase") == "Running"
            and p["metadata"]["labels"][names.LABEL_RANK] == "0"
        ]
        images_seen.append(Counter(p["spec"]["containers"][0]["image"] for p in ready))
        assert len(ready) >= 2, "never fewer ready groups than desired during the roll"
        if harness.snapshot() == before:
            break
    final = images_seen[-1]
    assert final == {"trtllm:next": 2}
    assert harness.status["phase"] == "Running"
    assert max(sum(seen.values()) for seen in images_seen) == 3, "one group of surge"


def test_restarted_gang_waits_out_its_backoff() -> None:
    deployment = parse_deployment(manifest(replicas=1), source="test")
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "llama-worker-0",
            "namespace": NAMESPACE,
            "labels": {
                names.LABEL_DEPLOYMENT: "llama",
                names.LABEL_GROUP: "llama-worker-0",
                names.LABEL_ROLE: "worker",
                names.LABEL_REPLICA: "0",
            },
            "annotations": {
                names.ANNOTATION_PLACEMENT: "",
                names.ANNOTATION_RESTARTS: "3",
                names.ANNOTATION_LAST_RESTART: "2026-01-01T00:00:00+00:00",
            },
        },
    }
    nodes = gpu_nodes(racks=1)
    groups = observe_groups(deployment="llama", services=[service], pods=[])
    assert groups[0].state is GroupState.UNPLACED
    restart = datetime(2026, 1, 1, tzinfo=UTC)
    settings = ReconcileSettings(restart_backoff_base_s=2, restart_backoff_max_s=120)
    early = reconcile(
        deployment=deployment,
        groups=groups,
        nodes=nodes,
        pods=[],
        now=restart + timedelta(seconds=7),
        settings=settings,
    )
    assert early.place == []
    assert early.requeue_after_s == pytest.approx(1.0)  # 2 * 2**(3-1) = 8 s after the restart
    late = reconcile(
        deployment=deployment,
        groups=groups,
        nodes=nodes,
        pods=[],
        now=restart + timedelta(seconds=9),
        settings=settings,
    )
    assert [layout.replica for layout in late.place] == [0]


async def test_modelexpress_runs_its_server_and_points_new_groups_at_a_ready_one() -> None:
    harness = Harness(scaling={"minReplicas": 1, "maxReplicas": 4}, coldStart={"strategy": "modelexpress"})
    body = harness.kube.objects[("InferenceDeployment", NAMESPACE, "llama")]
    body["spec"]["model"]["tensorParallelism"] = 4  # one pod per group on 4-GPU trays
    await harness.settle()
    assert harness.status["coldStart"] == {"strategy": "modelexpress", "source": "llama-worker-0"}
    kinds = {(kind, name) for kind, _, name in harness.kube.objects}
    assert {("Deployment", "llama-modelexpress"), ("Service", "llama-modelexpress")} <= kinds
    pointer = harness.kube.objects[("Service", NAMESPACE, "llama-mx-source")]
    assert pointer["spec"]["selector"] == {names.LABEL_GROUP: "llama-worker-0", names.LABEL_LEADER: "true"}
    assert [port["port"] for port in pointer["spec"]["ports"]] == [6555, 6556, 6557, 6558]
    [first] = harness.pods()
    first_env = {item["name"]: item.get("value") for item in first["spec"]["containers"][0]["env"]}
    assert "MX_METADATA_BACKEND" not in first_env  # loaded from storage, published to the server
    harness.update_spec(replicas=2)
    await harness.settle()
    second = next(
        pod for pod in harness.pods() if pod["metadata"]["labels"][names.LABEL_GROUP] == "llama-worker-1"
    )
    env = {item["name"]: item.get("value") for item in second["spec"]["containers"][0]["env"]}
    assert env["MX_METADATA_BACKEND"] == "k8s-service"
    assert env["MX_K8S_SERVICE_PATTERN"] == "llama-mx-source"
    assert env["COPSE_COLD_START_SOURCE"] == "llama-worker-0"


async def test_pods_stuck_terminating_on_a_dead_node_are_force_deleted_after_the_grace() -> None:
    harness = Harness(replicas=1, disruption={"notReadyGrace": "120s"})
    await harness.settle()
    pod = harness.kube.objects[("Pod", NAMESPACE, "llama-worker-0-1")]
    node = node_of(pod)
    # The node controller evicted the pod; its kubelet is gone, so nobody confirms the deletion.
    pod["metadata"]["deletionTimestamp"] = datetime.now(UTC).isoformat()
    set_ready(harness.kube.nodes[node], "False", since=datetime.now(UTC) - timedelta(seconds=30))
    harness.kube.sync(harness.controller)
    requeue = await harness.controller.reconcile_once(KEY)
    assert ("Pod", NAMESPACE, "llama-worker-0-1") in harness.kube.objects, "within the grace: waits"
    assert requeue == pytest.approx(90, abs=2)

    set_ready(harness.kube.nodes[node], "False", since=datetime.now(UTC) - timedelta(seconds=121))
    await harness.settle()
    assert ("Pod", "llama-worker-0-1", 0) in harness.kube.deletions, "deleted with no grace"
    [forced] = [m for _, reason, m in harness.kube.events if reason == "ForceDeleted"]
    assert forced.startswith(f"pod llama-worker-0-1: stuck Terminating on node {node}, NotReady for 121s")
    assert node not in {node_of(p) for p in harness.pods()}, "the gang restarted elsewhere"
    assert harness.status["phase"] == "Running"


async def test_a_replica_patch_or_a_new_default_rolls_nothing() -> None:
    harness = Harness(replicas=2)
    await harness.settle()
    services = [s for s in harness.kube.of_kind("Service") if names.LABEL_GROUP in s["metadata"]["labels"]]
    hashes = {s["metadata"]["annotations"][names.ANNOTATION_TEMPLATE_HASH] for s in services}
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in harness.pods()}
    harness.update_spec(replicas=3)
    await harness.settle()
    harness.update_spec(replicas=2)
    await harness.settle()
    # The user writes out a value that is the default anyway (as an upgraded CRD's defaulting would).
    harness.update_spec(engine={"backend": "trtllm"})
    await harness.settle()
    assert "RollingUpdate" not in {reason for _, reason, _ in harness.kube.events}
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in harness.pods()}
    assert {name: after.get(name) for name in uids} == uids
    assert len(hashes) == 1


async def test_groups_recorded_with_the_old_hash_format_are_current() -> None:
    harness = Harness(replicas=1)
    await harness.settle()
    body = harness.kube.objects[("InferenceDeployment", NAMESPACE, "llama")]
    deployment = parse_deployment(body, source="test")
    service = harness.kube.objects[("Service", NAMESPACE, "llama-worker-0")]
    annotations = service["metadata"]["annotations"]
    annotations[names.ANNOTATION_TEMPLATE_HASH] = legacy_template_hash(deployment, Role.WORKER)
    del annotations[names.ANNOTATION_TEMPLATE]
    await harness.settle()
    assert "RollingUpdate" not in {reason for _, reason, _ in harness.kube.events}
    harness.update_spec(engine={"image": "trtllm:next"})
    harness.kube.sync(harness.controller)
    await harness.controller.reconcile_once(KEY)
    [rolling] = [m for _, reason, m in harness.kube.events if reason == "RollingUpdate"]
    assert rolling.endswith("(changed: a template made by an older operator)")


async def test_a_roll_names_the_fields_that_changed() -> None:
    harness = Harness(replicas=1)
    await harness.settle()
    harness.update_spec(engine={"image": "trtllm:next"}, pod={"labels": {"team": "a"}})
    harness.kube.sync(harness.controller)
    await harness.controller.reconcile_once(KEY)
    [rolling] = [m for _, reason, m in harness.kube.events if reason == "RollingUpdate"]
    assert rolling == (
        "worker: 1 new group(s) surging, 0 group(s) retiring, 1 of an old template "
        "(changed: engine.image, pod.labels)"
    )
