"""Groups spanning trays on a real control plane: the ssh Secret, the IMEX ComputeDomain per group
(with and without its CRD), the weights download Job and /dev/shm, as the API server accepts them.

kwok runs no containers and no DRA driver: with the CRD installed, the test plays the driver's
controller (it creates the ResourceClaimTemplate each ComputeDomain names, a DeviceClass and one
channel device per tray), so kube-controller-manager makes each rank's ResourceClaim and
kube-scheduler allocates it before binding.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e.operator_harness import Operator, seed, status, wait_running, wait_until, worker_pods

from copse.cluster import Kubectl
from copse.operator import multinode

pytestmark = pytest.mark.e2e

CRD = Path(__file__).parent / "fixtures" / "computedomain-crd.yaml"
DRIVER = "compute-domain.nvidia.com"
DEVICE_CLASS = "copse-e2e-imex-channel"


def nvlink(kubectl: Kubectl, name: str, namespace: str) -> dict[str, Any]:
    conditions = status(kubectl, name, namespace).get("conditions", [])
    return next((c for c in conditions if c["type"] == multinode.CONDITION), {})


def crd_installed(kubectl: Kubectl) -> bool:
    found = kubectl.run("get", "crd", multinode.COMPUTE_DOMAIN_CRD, "--ignore-not-found", "-o", "name")
    return bool(found.stdout.strip())


@pytest.fixture
def compute_domain_crd(kubectl: Kubectl) -> Iterator[None]:
    """The ComputeDomain CRD (a copy of the driver's schema), a DeviceClass and one IMEX channel
    device per GPU node, as NVIDIA's DRA driver would publish them; removed afterwards."""
    if crd_installed(kubectl):
        pytest.skip("the cluster has NVIDIA's DRA driver CRD already; this test installs its own")
    try:
        kubectl.apply(CRD)
        kubectl.wait_established(f"crd/{multinode.COMPUTE_DOMAIN_CRD}", timeout=60)
        gpu_nodes = [
            node["metadata"]["name"]
            for node in kubectl.items("nodes")
            if int(node["status"].get("allocatable", {}).get("nvidia.com/gpu", 0)) > 0
        ]
        kubectl.apply(
            [
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "DeviceClass",
                    "metadata": {"name": DEVICE_CLASS, "labels": {"copse.dev/e2e": "dra-stand-in"}},
                    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
                },
                *(
                    {
                        "apiVersion": "resource.k8s.io/v1",
                        "kind": "ResourceSlice",
                        "metadata": {"name": f"imex-{node}", "labels": {"copse.dev/e2e": "dra-stand-in"}},
                        "spec": {
                            "driver": DRIVER,
                            "nodeName": node,
                            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                            "devices": [{"name": "channel-0"}],
                        },
                    }
                    for node in gpu_nodes
                ),
            ]
        )
        yield
    finally:
        kubectl.run("delete", "resourceslices,deviceclasses", "-l", "copse.dev/e2e=dra-stand-in")
        kubectl.run("delete", "-f", str(CRD), "--ignore-not-found")


def play_the_driver(kubectl: Kubectl, namespace: str) -> list[dict[str, Any]]:
    """What the DRA driver's controller does for each ComputeDomain: its ResourceClaimTemplate."""
    domains = kubectl.items("computedomains", namespace=namespace)
    kubectl.apply(
        [
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": domain["spec"]["channel"]["resourceClaimTemplate"]["name"]},
                "spec": {
                    "spec": {
                        "devices": {
                            "requests": [{"name": "channel", "exactly": {"deviceClassName": DEVICE_CLASS}}]
                        }
                    }
                },
            }
            for domain in domains
        ],
        namespace=namespace,
    )
    return domains


def test_without_the_crd_groups_run_and_say_multi_node_nvlink_is_unavailable(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    if crd_installed(kubectl):
        pytest.skip("the cluster has NVIDIA's ComputeDomain CRD")
    kubectl.apply(seed("plain"), namespace=namespace)
    wait_running(kubectl, "plain", namespace, operator)
    wait_until(
        "the MultiNodeNVLink condition",
        lambda: nvlink(kubectl, "plain", namespace).get("reason") == "ComputeDomainUnavailable",
        operator=operator,
    )
    assert nvlink(kubectl, "plain", namespace)["status"] == "False"
    pods = worker_pods(kubectl, "plain", namespace)
    assert len(pods) == 4
    assert not any(pod["spec"].get("resourceClaims") for pod in pods)
    # The MPI wiring the API server accepted: the deployment's ssh Secret, mounted by every rank,
    # followers ready on their sshd port, a memory-backed /dev/shm.
    secret = kubectl.get("secret", "plain-mpi-ssh", namespace=namespace)
    owner = secret["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["blockOwnerDeletion"]) == (
        "InferenceDeployment",
        "plain",
        True,
    )
    assert set(secret["data"]) == {
        "id_ed25519",
        "id_ed25519.pub",
        "ssh_host_ed25519_key",
        "ssh_host_ed25519_key.pub",
    }
    for pod in pods:
        volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
        assert volumes["mpi-ssh-keys"]["secret"]["secretName"] == "plain-mpi-ssh"
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
        if pod["metadata"]["labels"]["copse.dev/rank"] != "0":
            probe = pod["spec"]["containers"][0]["readinessProbe"]
            assert probe["tcpSocket"]["port"] == multinode.SSH_PORT


def test_each_group_spanning_trays_gets_a_compute_domain_and_each_rank_its_channel(
    kubectl: Kubectl, namespace: str, operator: Operator, compute_domain_crd: None
) -> None:
    # No routers run on kwok nodes to report in-flight requests: removed groups go without draining.
    kubectl.apply(seed("mnnvl", disruption={"drainTimeout": "0s"}), namespace=namespace)
    wait_until(
        "a ComputeDomain per group",
        lambda: len(kubectl.items("computedomains", namespace=namespace)) == 2,
        operator=operator,
    )
    domains = play_the_driver(kubectl, namespace)
    for domain in domains:
        group = domain["metadata"]["labels"]["copse.dev/group"]
        assert domain["metadata"]["name"] == f"{group}-imex-0"
        assert domain["spec"]["numNodes"] == 2
        assert domain["spec"]["channel"]["allocationMode"] == "Single"
        [owner] = domain["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"]) == ("Service", group)
    # kube-controller-manager makes each rank's claim from the template; kube-scheduler allocates
    # a channel on the rank's tray, then binds the pod: the group runs.
    wait_running(kubectl, "mnnvl", namespace, operator, timeout=180)
    pods = worker_pods(kubectl, "mnnvl", namespace)
    claims = {
        claim["metadata"]["name"]: claim for claim in kubectl.items("resourceclaims", namespace=namespace)
    }
    for pod in pods:
        group = pod["metadata"]["labels"]["copse.dev/group"]
        assert multinode.pod_channel_template(pod) == f"{group}-imex-0-channel"
        [claim_status] = pod["status"]["resourceClaimStatuses"]
        claim = claims[claim_status["resourceClaimName"]]
        [result] = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"], result["device"]) == (
            DRIVER,
            pod["spec"]["nodeName"],
            "channel-0",
        )
    wait_until(
        "MultiNodeNVLink True",
        lambda: nvlink(kubectl, "mnnvl", namespace).get("status") == "True",
        operator=operator,
    )
    # Cleaned up with the group: scaling to zero removes the group Services, and the garbage
    # collector their ComputeDomains.
    kubectl.run(
        "patch", "idep", "mnnvl", f"--namespace={namespace}", "--type=merge", "-p", '{"spec":{"replicas":0}}'
    )
    wait_until(
        "the ComputeDomains to go with their groups",
        lambda: kubectl.items("computedomains", namespace=namespace) == [],
        operator=operator,
        timeout=120,
    )


def test_the_weights_cache_is_filled_by_one_job_before_the_engines_start(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    cache = {"persistentVolumeClaim": "weights", "hfTokenSecret": {"name": "hf"}}
    manifest = seed(
        "cached", model={"name": "meta-llama/Llama-3-70B", "tensorParallelism": 8, "cache": cache}
    )
    kubectl.apply(manifest, namespace=namespace)
    wait_until("the weights Job", lambda: bool(kubectl.items("jobs", namespace=namespace)), operator=operator)
    [job] = kubectl.items("jobs", namespace=namespace)
    assert job["metadata"]["ownerReferences"][0]["name"] == "cached"
    template = job["spec"]["template"]["spec"]
    assert template["volumes"] == [{"name": "model-cache", "persistentVolumeClaim": {"claimName": "weights"}}]
    env = {item["name"]: item for item in template["containers"][0]["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}
    wait_until(
        "the worker pods", lambda: len(worker_pods(kubectl, "cached", namespace)) == 4, operator=operator
    )
    for pod in worker_pods(kubectl, "cached", namespace):
        [init] = pod["spec"]["initContainers"]
        assert init["name"] == "weights"
        engine = pod["spec"]["containers"][0]
        assert {"name": "HF_HUB_OFFLINE", "value": "1"} in engine["env"]
