"""The cluster is real: CRD schema validation, controllers, scheduler, kwok and garbage collection."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from copse.cluster import Kubectl, KubectlError

pytestmark = pytest.mark.e2e

GPU = "nvidia.com/gpu"
SEED = Path(__file__).resolve().parents[1] / "examples" / "seed-inferencedeployment.yaml"
TOLERATE_FAKE = [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]


def pod(name: str, *, gpus: int = 0, node: str | None = None) -> dict[str, Any]:
    resources = {"limits": {GPU: str(gpus)}} if gpus else {}
    spec: dict[str, Any] = {
        "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10", "resources": resources}],
        "tolerations": TOLERATE_FAKE,
    }
    if node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def deployment(name: str, *, replicas: int) -> dict[str, Any]:
    template = pod(name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": template["spec"]},
        },
    }


def owned_by(obj: dict[str, Any], owner: dict[str, Any]) -> bool:
    return any(ref["uid"] == owner["metadata"]["uid"] for ref in obj["metadata"].get("ownerReferences", []))


def gpu_nodes_with_free_gpus(kubectl: Kubectl) -> dict[str, int]:
    """Schedulable nodes offering nvidia.com/gpu, with GPUs not requested by live pods."""
    free: dict[str, int] = {}
    for node in kubectl.items("nodes"):
        gpus = int(node["status"].get("allocatable", {}).get(GPU, "0"))
        taints = [t for t in node["spec"].get("taints", []) if t["key"] != "kwok.x-k8s.io/node"]
        if gpus and not node["spec"].get("unschedulable") and not taints:
            free[node["metadata"]["name"]] = gpus
    for other in kubectl.items("pods", "--all-namespaces"):
        node_name = other["spec"].get("nodeName")
        if node_name in free and other["status"].get("phase") not in ("Succeeded", "Failed"):
            for container in other["spec"]["containers"]:
                free[node_name] -= int(container.get("resources", {}).get("requests", {}).get(GPU, "0"))
    return free


def test_api_server_validates_inferencedeployments_through_the_crd_schema(
    kubectl: Kubectl, namespace: str
) -> None:
    seed = yaml.safe_load(SEED.read_text())
    kubectl.create(seed, namespace=namespace)
    stored = kubectl.get("inferencedeployment", seed["metadata"]["name"], namespace=namespace)
    # Structural-schema defaulting ran on the server.
    assert stored["spec"]["model"]["tensorParallelism"] == 8

    wrong_type = yaml.safe_load(SEED.read_text())
    wrong_type["metadata"]["name"] = "tp-is-a-word"
    wrong_type["spec"]["model"]["tensorParallelism"] = "eight"
    rejected = kubectl.create(wrong_type, namespace=namespace, check=False)
    assert rejected.returncode != 0
    assert "spec.model.tensorParallelism" in rejected.stderr
    assert 'Invalid value: "string"' in rejected.stderr

    no_model = yaml.safe_load(SEED.read_text())
    no_model["metadata"]["name"] = "no-model"
    del no_model["spec"]["model"]
    rejected = kubectl.create(no_model, namespace=namespace, check=False)
    assert rejected.returncode != 0
    assert "spec.model: Required value" in rejected.stderr
    with pytest.raises(KubectlError, match="NotFound"):
        kubectl.get("inferencedeployment", "no-model", namespace=namespace)


def test_deployment_gets_a_replicaset_and_running_pods(kubectl: Kubectl, namespace: str) -> None:
    kubectl.apply(deployment("web", replicas=3), namespace=namespace)
    kubectl.wait("--for=condition=Available", "deployment/web", namespace=namespace, timeout=90)
    owner = kubectl.get("deployment", "web", namespace=namespace)
    replica_sets = [rs for rs in kubectl.items("replicasets", namespace=namespace) if owned_by(rs, owner)]
    assert len(replica_sets) == 1
    pods = [
        p for p in kubectl.items("pods", "-l", "app=web", namespace=namespace) if owned_by(p, replica_sets[0])
    ]
    assert len(pods) == 3
    for item in pods:
        assert item["status"]["phase"] == "Running"
        assert item["spec"]["nodeName"]
        assert item["status"].get("podIP")


def test_gpu_pods_land_only_on_gpu_nodes_with_room(kubectl: Kubectl, namespace: str) -> None:
    free = gpu_nodes_with_free_gpus(kubectl)
    assert free, "the cluster has no schedulable node with allocatable nvidia.com/gpu"
    per_node = max(free.values())

    kubectl.create(pod("anywhere", gpus=1), namespace=namespace)
    kubectl.wait("--for=condition=Ready", "pod/anywhere", namespace=namespace, timeout=60)
    landed = kubectl.get("pod", "anywhere", namespace=namespace)["spec"]["nodeName"]
    assert landed in free

    empty = next(name for name, gpus in sorted(free.items()) if gpus == per_node and name != landed)
    kubectl.create(pod("fills-node", gpus=per_node, node=empty), namespace=namespace)
    kubectl.wait("--for=condition=Ready", "pod/fills-node", namespace=namespace, timeout=60)

    kubectl.create(pod("no-room", gpus=1, node=empty), namespace=namespace)
    kubectl.create(pod("too-big", gpus=per_node + 1), namespace=namespace)
    for name in ("no-room", "too-big"):
        kubectl.wait("--for=condition=PodScheduled=False", f"pod/{name}", namespace=namespace, timeout=60)
        scheduled = next(
            c
            for c in kubectl.get("pod", name, namespace=namespace)["status"]["conditions"]
            if c["type"] == "PodScheduled"
        )
        assert scheduled["reason"] == "Unschedulable"
        assert f"Insufficient {GPU}" in scheduled["message"]

    kubectl.run("delete", "pod", "fills-node", f"--namespace={namespace}", "--wait=true")
    kubectl.wait("--for=condition=Ready", "pod/no-room", namespace=namespace, timeout=60)
    assert kubectl.get("pod", "no-room", namespace=namespace)["spec"]["nodeName"] == empty


def test_deleting_an_owner_garbage_collects_its_children(kubectl: Kubectl, namespace: str) -> None:
    kubectl.apply(deployment("doomed", replicas=2), namespace=namespace)
    kubectl.wait("--for=condition=Available", "deployment/doomed", namespace=namespace, timeout=90)
    kubectl.create(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}}, namespace=namespace
    )
    owner = kubectl.get("configmap", "owner", namespace=namespace)
    reference = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    child = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "child", "ownerReferences": [reference]},
    }
    kubectl.create(child, namespace=namespace)

    kubectl.run("delete", "configmap", "owner", f"--namespace={namespace}", "--cascade=background")
    kubectl.run("delete", "deployment", "doomed", f"--namespace={namespace}", "--cascade=background")
    kubectl.wait("--for=delete", "replicasets", "-l", "app=doomed", namespace=namespace, timeout=90)
    kubectl.wait("--for=delete", "pods", "-l", "app=doomed", namespace=namespace, timeout=90)
    kubectl.wait("--for=delete", "configmap/child", namespace=namespace, timeout=90)
