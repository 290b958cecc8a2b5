"""A DeepSeek-V3 wide-EP deployment on the local GB200 NVL72 cluster: the manifest validates, its
expert-parallel groups land inside NVLink domains, and each role gets its TensorRT-LLM wide-EP
settings."""

from __future__ import annotations

from collections import Counter

import pytest
import yaml
from e2e.operator_harness import (
    REPO,
    Operator,
    model_cache,
    status,
    wait_gpus_released,
    wait_running,
    worker_pods,
)

from copse.api import Role
from copse.cluster import Kubectl
from copse.operator import names

pytestmark = pytest.mark.e2e

DEEPSEEK = REPO / "examples" / "deployment-deepseek-v3-wide-ep.yaml"


@pytest.mark.fills_cluster
def test_deepseek_wide_ep_groups_stay_inside_nvlink_domains(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    wait_gpus_released(kubectl, operator=operator)
    with model_cache(kubectl, namespace):  # the example mounts the model cache's PVC
        kubectl.run("apply", "-f", str(DEEPSEEK), f"--namespace={namespace}")
        wait_running(kubectl, "deepseek-v3", namespace, operator, timeout=180)
    current = status(kubectl, "deepseek-v3", namespace)
    assert current["ready"] == "prefill 2/2, decode 2/2"
    groups = current["groups"]
    for group in groups:
        assert group["domain"], f"{group['name']} spans NVLink domains"
    decode = [group for group in groups if group["role"] == "decode"]
    # DEP32: 8 trays of 4 GPUs in one NVL72 domain, the two groups on different racks.
    for group in decode:
        assert sorted(pod["gpus"] for pod in group["pods"]) == [4] * 8
    assert len({group["rack"] for group in decode}) == 2
    pods = worker_pods(kubectl, "deepseek-v3", namespace)
    assert len(pods) == 2 * 2 + 2 * 8
    domains = {
        node["metadata"]["name"]: node["metadata"]["labels"]["nvidia.com/gpu.clique"]
        for node in kubectl.items("nodes")
        if "nvidia.com/gpu.clique" in node["metadata"]["labels"]
    }
    per_group: dict[str, set[str]] = {}
    for pod in pods:
        assert pod["status"]["phase"] == "Running"
        group = pod["metadata"]["labels"][names.LABEL_GROUP]
        per_group.setdefault(group, set()).add(domains[pod["spec"]["nodeName"]])
    assert all(len(cliques) == 1 for cliques in per_group.values()), per_group
    assert Counter(pod["metadata"]["labels"][names.LABEL_ROLE] for pod in pods) == {
        "prefill": 4,
        "decode": 16,
    }

    engine = kubectl.get("configmap", names.engine_config_name("deepseek-v3"), namespace=namespace)
    prefill = yaml.safe_load(engine["data"]["prefill.yaml"])
    decode_yaml = yaml.safe_load(engine["data"]["decode.yaml"])
    assert (prefill["moe_expert_parallel_size"], prefill["enable_attention_dp"]) == (8, True)
    assert "load_balancer" not in prefill["moe_config"]
    assert (decode_yaml["moe_expert_parallel_size"], decode_yaml["enable_attention_dp"]) == (32, True)
    assert decode_yaml["moe_config"] == {
        "backend": "WIDEEP",
        "load_balancer": {"num_slots": 288, "layer_updates_per_iter": 1},
    }
    leader_name = names.pod_name(names.group_name("deepseek-v3", Role.DECODE, 0), 0)
    leader = next(pod for pod in pods if pod["metadata"]["name"] == leader_name)
    engine = leader["spec"]["containers"][0]
    command = engine["command"]
    # A DEP32 group is one MPI world over its 8 pods: rank 0's script launches it (test_multinode.py).
    assert command[4] == "trtllm-llmapi-launch"
    hosts = next(item["value"] for item in engine["env"] if item["name"] == "COPSE_MPI_HOSTS")
    assert len(hosts.split(",")) == 8
    assert command[command.index("--tp_size") + 1] == "32"
