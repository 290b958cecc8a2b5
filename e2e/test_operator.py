"""The operator against a real control plane: placement, gangs, failures, scaling, restarts."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from e2e.operator_harness import (
    REPO,
    Operator,
    seed,
    status,
    unresponsive,
    wait_running,
    wait_until,
    worker_pods,
)
from prometheus_client.parser import text_string_to_metric_families

from copse.api import API_VERSION, KIND
from copse.cluster import Kubectl
from copse.operator import names
from copse.operator.testing import LocalKubelet, loopback_cidrs
from copse.topology.fake import gpu_nodes

pytestmark = pytest.mark.e2e

INVALID = sorted((REPO / "tests" / "api" / "invalid").glob("*.yaml"))


def test_seed_becomes_two_tp8_groups_on_two_racks(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    kubectl.apply(seed("llama"), namespace=namespace)
    wait_running(kubectl, "llama", namespace, operator)
    current = status(kubectl, "llama", namespace)
    assert current["ready"] == "worker 2/2"
    groups = current["groups"]
    assert len(groups) == 2
    assert all(group["domain"] for group in groups), "each TP=8 group inside one NVLink domain"
    assert len({group["rack"] for group in groups}) == 2, "spread across racks"
    assert current["observedGeneration"] == 2, "the operator wrote spec.replicas (generation 2)"
    pods = worker_pods(kubectl, "llama", namespace)
    assert len(pods) == 4
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        assert not pod["spec"].get("schedulingGates")
        planned = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert pod["spec"]["nodeName"] == planned["nodeSelectorTerms"][0]["matchFields"][0]["values"][0]
    table = kubectl.run("get", "idep", "llama", f"--namespace={namespace}").stdout
    assert table.split()[:5] == ["NAME", "PHASE", "READY", "SCORE", "AGE"]
    assert "Running" in table
    assert "worker 2/2" in table
    events = kubectl.items("events", "--field-selector", "involvedObject.name=llama", namespace=namespace)
    assert Counter(event["reason"] for event in events)["Placed"] == 2
    for kind in (
        "service/llama-worker-0",
        "configmap/llama-engine",
        "deployment/llama-router",
        "service/llama-router",
    ):
        kubectl.get(kind, namespace=namespace)


def test_real_engine_settings_survive_the_api_server_and_are_reported(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    """Nested extraConfig and a tokenizer volume source reach the operator intact (a free-form field
    the API server pruned would lose them), are merged into the engine YAML and mounted in the
    router, and a setting that defeats KV routing is reported, not refused."""
    claim = {"persistentVolumeClaim": {"claimName": "model-cache", "readOnly": True}}
    manifest = seed(
        "tuned",
        engine={
            "extraConfig": {
                "kv_cache_config": {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": False}
            }
        },
        router={"tokenizer": {"volume": claim, "path": "hub/llama"}, "kvCapacityTokens": 1_000_000},
    )
    kubectl.apply(manifest, namespace=namespace)

    def routing() -> dict[str, Any]:
        conditions = status(kubectl, "tuned", namespace).get("conditions", [])
        return next((c for c in conditions if c["type"] == "KVRouting"), {})

    wait_until("the KVRouting condition", lambda: bool(routing()), operator=operator)
    assert (routing()["status"], routing()["reason"]) == ("False", "BlockReuseDisabled")
    stored = kubectl.get("idep/tuned", namespace=namespace)
    assert stored["spec"]["engine"]["extraConfig"]["kv_cache_config"]["free_gpu_memory_fraction"] == 0.85
    assert stored["spec"]["router"]["tokenizer"]["volume"] == claim
    engine = yaml.safe_load(kubectl.get("configmap/tuned-engine", namespace=namespace)["data"]["worker.yaml"])
    assert engine["kv_cache_config"]["free_gpu_memory_fraction"] == 0.85
    assert engine["kv_cache_config"]["event_buffer_max_size"] > 0  # merged, not replaced
    assert engine["return_perf_metrics"] is True
    router = kubectl.get("deployment/tuned-router", namespace=namespace)
    volumes = router["spec"]["template"]["spec"]["volumes"]
    assert {"name": "tokenizer", **claim} in volumes
    events = kubectl.items("events", "--field-selector", "involvedObject.name=tuned", namespace=namespace)
    assert "KVRoutingDegraded" in {event["reason"] for event in events}


def test_the_kv_relay_is_a_native_sidecar_the_kubelet_runs(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    """With a NATS bus, each group's rank-0 pod carries the KV relay as an init container with
    ``restartPolicy: Always`` (the pod's own is Never): the API server accepts it and the kubelet
    (kwok here) runs it next to the engine; the other ranks have none."""
    kubectl.apply(seed("relayed", router={"natsUrl": "nats://nats:4222"}), namespace=namespace)
    wait_running(kubectl, "relayed", namespace, operator)
    pods = worker_pods(kubectl, "relayed", namespace)
    leaders = [pod for pod in pods if pod["metadata"]["labels"][names.LABEL_LEADER] == "true"]
    assert len(leaders) == 2
    for pod in pods:
        assert pod["spec"]["restartPolicy"] == "Never"
        assert [c["name"] for c in pod["spec"]["containers"]] == ["engine"]
        if pod not in leaders:
            assert not pod["spec"].get("initContainers")
            continue
        [relay] = pod["spec"]["initContainers"]
        assert (relay["name"], relay["restartPolicy"]) == ("kv-relay", "Always")
        assert relay["command"][:3] == ["copse", "worker", "kv-relay"]
        [running] = pod["status"]["initContainerStatuses"]
        assert running["started"] is True
        assert "running" in running["state"]


def test_modelexpress_runs_its_server_and_points_the_next_group_at_a_ready_one(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    """``coldStart.strategy: modelexpress`` with one-pod groups: the operator's ModelExpress server
    (a Deployment whose Redis is a native sidecar) and its Service are accepted and scheduled, the
    first ready group becomes the source, and a group added then is pointed at it through the
    ``<name>-mx-source`` Service (the worker pods' downward-API env and IPC_LOCK pass the API server)."""
    manifest = seed("express", replicas=1)
    manifest["spec"]["model"]["tensorParallelism"] = 4  # one pod per group on 4-GPU trays
    kubectl.apply(manifest, namespace=namespace)
    wait_running(kubectl, "express", namespace, operator)
    server = kubectl.get("deployment", "express-modelexpress", namespace=namespace)
    [redis] = server["spec"]["template"]["spec"]["initContainers"]
    assert redis["restartPolicy"] == "Always"
    wait_until(
        "the ModelExpress server's pod",
        lambda: bool(
            kubectl.items("pods", "-l", "app.kubernetes.io/component=modelexpress", namespace=namespace)
        ),
        operator=operator,
    )
    wait_until(
        "the source Service",
        lambda: bool(
            kubectl.items("services", "--field-selector=metadata.name=express-mx-source", namespace=namespace)
        ),
        operator=operator,
    )
    pointer = kubectl.get("service", "express-mx-source", namespace=namespace)
    assert pointer["spec"]["selector"] == {names.LABEL_GROUP: "express-worker-0", names.LABEL_LEADER: "true"}
    assert [port["port"] for port in pointer["spec"]["ports"]] == [6555, 6556, 6557, 6558]
    kubectl.run(
        "patch",
        "idep",
        "express",
        "--type=merge",
        "-p",
        '{"spec":{"replicas":2}}',
        f"--namespace={namespace}",
    )
    wait_until(
        "the second group's pod",
        lambda: any(
            pod["metadata"]["labels"][names.LABEL_GROUP] == "express-worker-1"
            for pod in worker_pods(kubectl, "express", namespace)
        ),
        operator=operator,
    )
    [second] = [
        pod
        for pod in worker_pods(kubectl, "express", namespace)
        if pod["metadata"]["labels"][names.LABEL_GROUP] == "express-worker-1"
    ]
    [engine] = second["spec"]["containers"]
    env = {item["name"]: item.get("value") for item in engine["env"]}
    assert (env["MX_METADATA_BACKEND"], env["MX_K8S_SERVICE_PATTERN"]) == ("k8s-service", "express-mx-source")
    assert env["MODEL_EXPRESS_URL"] == f"express-modelexpress.{namespace}.svc:8001"
    assert engine["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_disaggregated_pools_land_close(kubectl: Kubectl, namespace: str, operator: Operator) -> None:
    manifest = seed("disagg", prefill={"replicas": 1, "tensorParallelism": 4}, decode={"replicas": 1})
    kubectl.apply(manifest, namespace=namespace)
    wait_running(kubectl, "disagg", namespace, operator)
    current = status(kubectl, "disagg", namespace)
    assert current["ready"] == "prefill 1/1, decode 1/1"
    racks = {group["role"]: group["rack"] for group in current["groups"]}
    assert racks["prefill"] == racks["decode"]
    # /scale is the aggregated pool's; each disaggregated pool is scaled by its own field.
    refused = kubectl.run("scale", "idep/disagg", "--replicas=2", f"--namespace={namespace}", check=False)
    assert refused.returncode != 0
    assert "spec.replicas is for aggregated serving" in refused.stderr
    kubectl.run(
        "patch",
        "idep/disagg",
        "--type=merge",
        "--patch",
        '{"spec": {"decode": {"replicas": 2}}}',
        f"--namespace={namespace}",
    )
    wait_until(
        "the decode pool to grow to 2 while prefill stays at 1",
        lambda: status(kubectl, "disagg", namespace).get("ready") == "prefill 1/1, decode 2/2",
        operator=operator,
    )


def test_scale_subresource_and_pool_patches(kubectl: Kubectl, namespace: str, operator: Operator) -> None:
    # kwok's router pods have fake IPs, with no router to ask what is in flight: remove at once
    # (test_a_scale_down_during_streams_drains_the_group_before_deleting_it runs real routers).
    kubectl.apply(seed("scaled", replicas=1, disruption={"drainTimeout": "0s"}), namespace=namespace)
    wait_running(kubectl, "scaled", namespace, operator)
    kubectl.run("scale", "idep/scaled", "--replicas=3", f"--namespace={namespace}")
    wait_until(
        "3 ready groups",
        lambda: status(kubectl, "scaled", namespace).get("ready") == "worker 3/3",
        operator=operator,
    )
    assert len(worker_pods(kubectl, "scaled", namespace)) == 6
    kubectl.run("scale", "idep/scaled", "--replicas=1", f"--namespace={namespace}")
    wait_until(
        "scale-down to 1 group and its pods gone",
        lambda: (
            status(kubectl, "scaled", namespace).get("ready") == "worker 1/1"
            and len(worker_pods(kubectl, "scaled", namespace)) == 2
        ),
        operator=operator,
    )
    scale = kubectl.get("idep", "scaled", "--subresource=scale", namespace=namespace)
    assert scale["status"]["replicas"] == 1


def test_the_scale_subresource_reads_the_real_count_and_an_hpa_drives_it(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    kubectl.apply(seed("autoscaled"), namespace=namespace)  # no spec.replicas: minReplicas (2)
    wait_running(kubectl, "autoscaled", namespace, operator)
    scale = kubectl.get("idep", "autoscaled", "--subresource=scale", namespace=namespace)
    assert scale["spec"]["replicas"] == 2
    assert scale["status"]["replicas"] == 2
    selected = kubectl.items("pods", "-l", scale["status"]["selector"], namespace=namespace)
    assert sorted(pod["metadata"]["name"] for pod in selected) == [
        "autoscaled-worker-0-0",
        "autoscaled-worker-1-0",
    ], "one rank-0 pod per replica"
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "autoscaled"},
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": "autoscaled"},
            "minReplicas": 3,
            "maxReplicas": 4,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 80}},
                }
            ],
        },
    }
    kubectl.apply(hpa, namespace=namespace)

    def hpa_conditions() -> dict[str, dict[str, Any]]:
        current = kubectl.get("hpa", "autoscaled", namespace=namespace).get("status", {})
        return {c["type"]: c for c in current.get("conditions", [])}

    # No metrics server here: the controller still reads /scale and enforces minReplicas.
    wait_until(
        "the HPA controller to scale the deployment up to its minReplicas through /scale",
        lambda: (
            hpa_conditions().get("AbleToScale", {}).get("status") == "True"
            and status(kubectl, "autoscaled", namespace).get("ready") == "worker 3/3"
        ),
        operator=operator,
        timeout=120,
    )
    able = hpa_conditions()["AbleToScale"]
    assert able["reason"] in {"SucceededGetScale", "SucceededRescale", "ReadyForNewScale"}, able
    assert kubectl.get("idep", "autoscaled", namespace=namespace)["spec"]["replicas"] == 3
    wait_until(
        "the HPA to report the 3 replicas it reads back",
        lambda: (
            kubectl.get("hpa", "autoscaled", namespace=namespace).get("status", {}).get("currentReplicas")
            == 3
        ),
        operator=operator,
        timeout=60,
    )


def test_node_loss_moves_only_its_group(kubectl: Kubectl, namespace: str, operator: Operator) -> None:
    kubectl.apply(seed("moving"), namespace=namespace)
    wait_running(kubectl, "moving", namespace, operator)
    before = {
        pod["metadata"]["name"]: (pod["metadata"]["labels"][names.LABEL_GROUP], pod["spec"]["nodeName"])
        for pod in worker_pods(kubectl, "moving", namespace)
    }
    lost_group, lost_node = before["moving-worker-0-0"]
    node = kubectl.get("node", lost_node)
    kubectl.run("delete", "node", lost_node)
    try:
        wait_until(
            "the group to move off the deleted node and be Running again",
            lambda: (
                status(kubectl, "moving", namespace).get("phase") == "Running"
                and all(
                    pod["spec"].get("nodeName") not in (None, lost_node)
                    and pod["status"].get("phase") == "Running"
                    for pod in worker_pods(kubectl, "moving", namespace)
                )
                and len(worker_pods(kubectl, "moving", namespace)) == 4
            ),
            operator=operator,
        )
        after = {
            pod["metadata"]["name"]: (pod["metadata"]["labels"][names.LABEL_GROUP], pod["spec"]["nodeName"])
            for pod in worker_pods(kubectl, "moving", namespace)
        }
        untouched = {pod: where for pod, where in before.items() if where[0] != lost_group}
        assert {pod: after[pod] for pod in untouched} == untouched, "the other group kept its pods"
        events = kubectl.items("events", "--field-selector", "reason=GangRestart", namespace=namespace)
        assert any(lost_node in event["message"] for event in events)
    finally:
        for field in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
            node["metadata"].pop(field, None)
        kubectl.apply(node)


def _pods_by_name(kubectl: Kubectl, name: str, namespace: str) -> dict[str, tuple[str, str]]:
    """Worker pod name -> (uid, node): what a gang restart changes."""
    return {
        pod["metadata"]["name"]: (pod["metadata"]["uid"], pod["spec"].get("nodeName", ""))
        for pod in worker_pods(kubectl, name, namespace)
    }


def _disruption(kubectl: Kubectl, name: str, namespace: str, group: str) -> str:
    groups = status(kubectl, name, namespace).get("groups", [])
    return str(next((g.get("disruption") or "" for g in groups if g["name"] == group), ""))


def _restarts(kubectl: Kubectl, namespace: str) -> list[str]:
    events = kubectl.items("events", "--field-selector", "reason=GangRestart", namespace=namespace)
    return [event["message"] for event in events]


def test_a_cordon_keeps_the_group_and_a_not_ready_node_is_waited_out_for_the_grace(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    disruption = {"notReadyGrace": "30s", "onCordon": "Keep"}
    kubectl.apply(seed("upkeep", replicas=2, disruption=disruption), namespace=namespace)
    wait_running(kubectl, "upkeep", namespace, operator)
    before = _pods_by_name(kubectl, "upkeep", namespace)
    node = before["upkeep-worker-0-0"][1]

    # A cordon: the group keeps running there; only placement avoids the node.
    kubectl.run("cordon", node)
    try:
        wait_until(
            "the operator to see the cordon under upkeep-worker-0",
            lambda: "is cordoned" in _disruption(kubectl, "upkeep", namespace, "upkeep-worker-0"),
            operator=operator,
        )
        assert _pods_by_name(kubectl, "upkeep", namespace) == before
        assert status(kubectl, "upkeep", namespace)["phase"] == "Running"
        kubectl.run("scale", "idep/upkeep", "--replicas=3", f"--namespace={namespace}")
        wait_running(kubectl, "upkeep", namespace, operator)
        grown = _pods_by_name(kubectl, "upkeep", namespace)
        assert {pod: grown[pod] for pod in before} == before
        assert node not in {where for pod, (_, where) in grown.items() if pod not in before}
    finally:
        kubectl.run("uncordon", node)
    before = _pods_by_name(kubectl, "upkeep", namespace)

    # NotReady for less than the grace: nothing moves.
    with unresponsive(kubectl, node):
        wait_until(
            "the group to wait out its NotReady node",
            lambda: "NotReady since" in _disruption(kubectl, "upkeep", namespace, "upkeep-worker-0"),
            operator=operator,
        )
    wait_until(
        "the node back, the group Running and its disruption gone",
        lambda: (
            status(kubectl, "upkeep", namespace).get("phase") == "Running"
            and not _disruption(kubectl, "upkeep", namespace, "upkeep-worker-0")
        ),
        operator=operator,
    )
    assert _pods_by_name(kubectl, "upkeep", namespace) == before, "a short NotReady moves nothing"
    assert _restarts(kubectl, namespace) == []

    # NotReady for longer than the grace: that gang, and only it, moves.
    with unresponsive(kubectl, node):
        wait_until(
            "the gang on the NotReady node to restart elsewhere after the grace",
            lambda: (
                any("has been NotReady" in message for message in _restarts(kubectl, namespace))
                and status(kubectl, "upkeep", namespace).get("phase") == "Running"
                and node not in {where for _, where in _pods_by_name(kubectl, "upkeep", namespace).values()}
            ),
            operator=operator,
            timeout=120,
        )
        after = _pods_by_name(kubectl, "upkeep", namespace)
    others = {pod: where for pod, where in before.items() if not pod.startswith("upkeep-worker-0-")}
    assert {pod: after[pod] for pod in others} == others, "the other gangs keep their pods"
    [restart] = _restarts(kubectl, namespace)
    assert restart.startswith(f"restarting group upkeep-worker-0: node {node} has been NotReady for ")


def test_infeasible_reports_why_and_heals_when_nodes_arrive(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    pool = f"pool-{namespace[-6:]}"
    manifest = seed("waiting", replicas=1, pod={"nodeSelector": {"copse.dev/test-pool": pool}})
    kubectl.apply(manifest, namespace=namespace)
    wait_until(
        "PlacementInfeasible",
        lambda: any(
            c["type"] == "PlacementInfeasible" and c["status"] == "True"
            for c in status(kubectl, "waiting", namespace).get("conditions", [])
        ),
        operator=operator,
    )
    current = status(kubectl, "waiting", namespace)
    assert current["unplaced"][0]["role"] == "worker"
    assert current["unplaced"][0]["reason"]
    assert current["phase"] == "Failed"
    nodes = gpu_nodes(racks=1, trays_per_rack=2, prefix=pool)
    for node in nodes:
        node["metadata"]["labels"]["copse.dev/test-pool"] = pool
    try:
        kubectl.apply(nodes)
        wait_running(kubectl, "waiting", namespace, operator)
        assert status(kubectl, "waiting", namespace)["unplaced"] == []
    finally:
        kubectl.run("delete", "nodes", *(node["metadata"]["name"] for node in nodes), "--wait=false")


@pytest.mark.parametrize("path", INVALID, ids=lambda path: path.stem)
def test_api_server_rejects_invalid_manifests(kubectl: Kubectl, namespace: str, path: Path) -> None:
    expected = next(
        line.removeprefix("# apiserver: ")
        for line in path.read_text().splitlines()
        if line.startswith("# apiserver:")
    )
    result = kubectl.run("apply", "-f", str(path), f"--namespace={namespace}", check=False)
    assert result.returncode != 0
    assert expected in result.stderr


def test_deleting_the_deployment_removes_everything(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    kubectl.apply(seed("doomed", replicas=1), namespace=namespace)
    wait_running(kubectl, "doomed", namespace, operator)
    kubectl.run("delete", "idep", "doomed", f"--namespace={namespace}")
    selector = f"{names.LABEL_DEPLOYMENT}=doomed"
    wait_until(
        "garbage collection of every child",
        lambda: (
            not any(
                kubectl.items(kind, "-l", selector, namespace=namespace)
                for kind in ("pods", "services", "configmaps", "deployments")
            )
        ),
        operator=operator,
    )


def test_operator_restart_mid_reconcile_converges_without_duplicates(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    operator.kill()
    try:
        kubectl.apply(seed("restarted", replicas=4), namespace=namespace)
        operator.start()
        wait_until(
            "the first pods to exist",
            lambda: len(worker_pods(kubectl, "restarted", namespace)) > 0,
            operator=operator,
            timeout=60,
        )
        operator.kill()
    finally:
        operator.start()
    wait_running(kubectl, "restarted", namespace, operator)
    pods = worker_pods(kubectl, "restarted", namespace)
    assert sorted(pod["metadata"]["name"] for pod in pods) == sorted(
        f"restarted-worker-{replica}-{rank}" for replica in range(4) for rank in range(2)
    )
    services = kubectl.items("services", "-l", names.LABEL_GROUP, namespace=namespace)
    assert len(services) == 4


def test_a_changed_template_rolls_one_group_at_a_time(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    # No real router to ask about in-flight requests here: old groups go at once.
    kubectl.apply(seed("rolling", disruption={"drainTimeout": "0s"}), namespace=namespace)
    wait_running(kubectl, "rolling", namespace, operator)
    selector = f"{names.LABEL_GROUP},{names.selector_string(names.worker_selector('rolling'))}"

    def group_hashes() -> list[str]:
        services = kubectl.items("services", "-l", selector, namespace=namespace)
        return [service["metadata"]["annotations"][names.ANNOTATION_TEMPLATE_HASH] for service in services]

    [old] = set(group_hashes())
    seen: list[tuple[int, int]] = []  # (groups, running worker pods) at every poll

    def rolled() -> bool:
        hashes = group_hashes()
        running = sum(
            pod["status"].get("phase") == "Running" for pod in worker_pods(kubectl, "rolling", namespace)
        )
        seen.append((len(hashes), running))
        return (
            len(hashes) == 2
            and old not in hashes
            and running == 4
            and status(kubectl, "rolling", namespace).get("ready") == "worker 2/2"
        )

    kubectl.run(
        "patch",
        "idep/rolling",
        "--type=merge",
        "--patch",
        '{"spec": {"engine": {"args": ["--log_level=debug"]}}}',
        f"--namespace={namespace}",
    )
    wait_until("every group rolled to the new template", rolled, operator=operator, timeout=180)
    assert len(set(group_hashes())) == 1
    assert max(groups for groups, _ in seen) <= 3, f"more than one surge group: {seen}"
    assert min(running for _, running in seen) >= 4, f"serving capacity dropped during the roll: {seen}"
    events = kubectl.items("events", "--field-selector", "involvedObject.name=rolling", namespace=namespace)
    assert Counter(event["reason"] for event in events)["Placed"] == 4, "two groups, then two successors"


def test_the_liveness_endpoint_reports_the_reconcile_loop(operator: Operator) -> None:
    answers: list[dict[str, Any]] = []

    def answered() -> bool:
        try:
            with urllib.request.urlopen(operator.health_url, timeout=5) as response:
                answers.append(json.load(response))
        except OSError:
            return False  # not listening yet (the operator may have just been restarted)
        return True

    wait_until("the liveness endpoint to answer 200", answered, operator=operator)
    assert set(answers[-1]["reconciler"]) == {"queued", "oldest_due_s", "pass_running_s", "leader"}


class _Stream:
    """A streamed completion through the router, read on its own thread."""

    def __init__(self, url: str, *, prompt: list[int], max_tokens: int) -> None:
        self.body = {"model": "mock-model", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
        self.url = url
        self.started = threading.Event()
        self.events: list[str] = []
        self.ended_at: float | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=120) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        self.events.append(line[5:].strip())
                        self.started.set()
        except BaseException as error:  # reported by the test, not lost on the thread
            self.error = error
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    @property
    def tokens(self) -> int:
        return sum(1 for event in self.events[:-1] if json.loads(event)["choices"][0]["text"])


def _metric(text: str, name: str) -> float:
    """The sum of a metric's samples in Prometheus text (0 when absent)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def test_a_scale_down_during_streams_drains_the_group_before_deleting_it(
    kubectl: Kubectl, kubeconfig: Path, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    """Real mock engines and the real router serve the deployment's kwok pods: the pods live on
    nodes whose podCIDR is a loopback range, and a local kubelet runs their containers there
    (killing each at once when its pod is deleted). Two streams run, one per group; a scale-down
    marks one group draining, the router sends it nothing new, and the operator deletes it only
    once the router reports its stream over."""
    pool = f"drain-{namespace[-6:]}"
    nodes = gpu_nodes(racks=1, trays_per_rack=2, prefix=pool)
    for node, cidr in zip(nodes, loopback_cidrs(2), strict=True):
        node["metadata"]["labels"]["copse.dev/test-pool"] = pool
        node["spec"]["podCIDR"] = cidr
    kubectl.apply(nodes)
    kubelet = LocalKubelet(kubectl, namespace, logs=tmp_path)
    try:
        selector = {"copse.dev/test-pool": pool}
        manifest = seed(
            "drained",
            replicas=2,
            model={"name": "mock-model", "tensorParallelism": 4},
            placement={"affinityPolicy": "same-nvswitch-domain", "antiAffinityPolicy": "none"},
            engine={"backend": "mock", "args": ["--decode-speedup", "0.1"]},
            router={"policy": "round_robin", "nodeSelector": selector, "replicas": 1},
            pod={"nodeSelector": selector},
            disruption={"drainTimeout": "120s"},
        )
        kubectl.apply(manifest, namespace=namespace)
        wait_running(kubectl, "drained", namespace, operator)

        def router_pods() -> list[dict[str, Any]]:
            pods = kubectl.items("pods", "-l", "app.kubernetes.io/component=router", namespace=namespace)
            return [pod for pod in pods if pod.get("status", {}).get("podIP")]

        wait_until("the router pod to run", lambda: len(router_pods()) == 1, operator=operator)
        [router_pod] = router_pods()
        leaders = {pod["metadata"]["name"]: pod for pod in worker_pods(kubectl, "drained", namespace)}
        assert len(leaders) == 2, "TP=4 on 4-GPU trays: one pod per group"
        for name, pod in leaders.items():
            ip = pod["status"]["podIP"]
            assert ip.startswith("127."), f"{name} got {ip}: kwok should use its node's podCIDR"
            argv = list(pod["spec"]["containers"][0]["command"])
            argv[argv.index("--host") + 1] = ip
            kubelet.run(name, argv, url=f"http://{ip}:8000")
        config = yaml.safe_load(
            kubectl.get("configmap", "drained-router", namespace=namespace)["data"]["router.yaml"]
        )
        router_ip = router_pod["status"]["podIP"]
        config["host"] = router_ip
        (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
        router = f"http://{router_ip}:8080"
        kubelet.run(
            router_pod["metadata"]["name"],
            ["copse", "router", "run", "--config", str(tmp_path / "router.yaml")],
            url=router,
            env={"KUBECONFIG": str(kubeconfig)},
        )

        def report() -> dict[str, dict[str, Any]]:
            try:
                answer = httpx.get(f"{router}/workers", timeout=2).json()["workers"]
            except httpx.HTTPError:
                return {}
            return {entry["key"]: entry for entry in answer}

        wait_until("the router to use both engines", lambda: set(report()) == set(leaders), operator=operator)

        streams = [
            _Stream(router, prompt=list(range(1000 * i, 1000 * i + 300)), max_tokens=150) for i in (1, 2)
        ]
        for stream in streams:
            assert stream.started.wait(30)
            assert stream.error is None, stream.error
        assert {entry["in_flight"] for entry in report().values()} == {1}, "one stream on each group"
        kubectl.run("scale", "idep/drained", "--replicas=1", f"--namespace={namespace}")

        def draining() -> list[str]:
            pods = kubectl.items("pods", "-l", "copse.dev/draining=true", namespace=namespace)
            return [pod["metadata"]["name"] for pod in pods]

        wait_until("a group to be marked draining", lambda: bool(draining()), operator=operator)
        [victim] = draining()
        wait_until(
            "the router to stop sending the draining group requests",
            lambda: report().get(victim, {}).get("draining") is True,
            operator=operator,
        )
        assert report()[victim]["in_flight"] == 1
        assert all(stream.ended_at is None for stream in streams), (
            "the streams outlast the start of the drain"
        )
        assert victim not in kubelet.killed
        extra = httpx.post(
            f"{router}/v1/completions",
            json={"model": "mock-model", "prompt": [1, 2, 3], "max_tokens": 2},
            timeout=30,
        )
        assert extra.status_code == 200, "the other group takes new requests"

        for stream in streams:
            stream.thread.join(timeout=60)
            assert stream.error is None, stream.error
            assert stream.events[-1] == "[DONE]"
            assert stream.tokens == 150, "every stream ran to its end"
        wait_until(
            "the drained group's pod to be deleted", lambda: victim in kubelet.killed, operator=operator
        )
        engine = kubelet.killed[victim]
        assert _metric(engine, "trtllm_num_requests_running") == 0, "nothing ran on it when it was deleted"
        assert _metric(engine, "trtllm_request_success_total") == 1, (
            "it finished its stream and got nothing new"
        )
        router_metrics = httpx.get(f"{router}/metrics", timeout=5).text
        assert _metric(router_metrics, "copse_router_migrations_total") == 0, (
            "no stream moved to another worker"
        )
        events = kubectl.items(
            "events", "--field-selector", "involvedObject.name=drained", namespace=namespace
        )
        drains = [event["message"] for event in events if event["reason"] in {"Draining", "Drained"}]
        group = victim.rsplit("-", 1)[0]
        assert (
            f"group {group} drains before removal (scale-down): the router sends it no new requests; it "
            "goes once those in flight end"
        ) in drains
        assert any(message.startswith(f"group {group}: drained after ") for message in drains), drains
        wait_until(
            "one group left, serving",
            lambda: (
                status(kubectl, "drained", namespace).get("ready") == "worker 1/1"
                and len(worker_pods(kubectl, "drained", namespace)) == 1
            ),
            operator=operator,
        )
    finally:
        kubelet.stop()
        kubectl.run("delete", "nodes", *(node["metadata"]["name"] for node in nodes), "--wait=false")
