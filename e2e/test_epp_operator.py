"""``spec.router.mode: epp`` on the real control plane: the operator (with only the chart's RBAC)
writes the deployment's InferencePool with the router as its endpoint picker, and the router's
InferencePool discovery follows that pool's ready pods through the real API server."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
from e2e.local_router import until
from e2e.operator_harness import REPO, Operator, seed, wait_running, wait_until

from copse.cluster import Kubectl
from copse.router.discovery import Endpoint, InferencePoolSource, KubeAioPodApi

pytestmark = pytest.mark.e2e

POOL_CRD = REPO / "charts" / "copse" / "files" / "inferencepool-crd.yaml"


async def test_epp_mode_gets_an_inference_pool_the_picker_follows(
    kubectl: Kubectl, kubeconfig: Path, namespace: str, operator: Operator
) -> None:
    kubectl.apply(POOL_CRD, server_side=True)
    kubectl.wait_established("-f", str(POOL_CRD), timeout=60)
    kubectl.apply(seed("pooled", router={"mode": "epp"}), namespace=namespace)
    wait_running(kubectl, "pooled", namespace, operator)
    wait_until(
        "the InferencePool",
        lambda: bool(kubectl.items("inferencepools", namespace=namespace)),
        operator=operator,
    )
    pool = kubectl.get("inferencepool", "pooled", namespace=namespace)
    assert pool["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/component": "worker",
        "copse.dev/deployment": "pooled",
        "copse.dev/leader": "true",
    }
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    ref = pool["spec"]["endpointPickerRef"]
    service = kubectl.get("service", ref["name"], namespace=namespace)
    assert ref["port"]["number"] in [port["port"] for port in service["spec"]["ports"]]
    assert pool["metadata"]["ownerReferences"][0]["kind"] == "InferenceDeployment"
    router = kubectl.get("deployment", ref["name"], namespace=namespace)
    probe = router["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert probe["grpc"]["service"] == "readiness"

    leaders = {
        pod["metadata"]["name"]
        for pod in kubectl.items(
            "pods", "-l", "copse.dev/deployment=pooled,copse.dev/leader=true", namespace=namespace
        )
    }
    assert len(leaders) == 2
    # The picker's discovery through the real API server, on a pool this test owns (the operator
    # would put its own pool back): the pool's ready pods on its port, following its changes.
    manual = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "manual"},
        "spec": {**pool["spec"], "targetPorts": [{"number": 8001}]},
    }
    kubectl.apply(manual, namespace=namespace)
    api = await KubeAioPodApi.from_environment(kubeconfig)
    seen: list[dict[str, Endpoint]] = []
    source = InferencePoolSource(api, namespace=namespace, name="manual")
    task = asyncio.create_task(source.run(lambda endpoints: seen.append(dict(endpoints))))
    try:
        await until(lambda: bool(seen) and set(seen[-1]) == leaders, timeout_s=60)
        assert all(endpoint.url.endswith(":8001") for endpoint in seen[-1].values())
        kubectl.run(
            "patch",
            "inferencepool",
            "manual",
            f"--namespace={namespace}",
            "--type=merge",
            "-p",
            '{"spec": {"targetPorts": [{"number": 8002}]}}',
        )
        await until(
            lambda: set(seen[-1]) == leaders and all(e.url.endswith(":8002") for e in seen[-1].values()),
            timeout_s=60,
        )
        kubectl.run("delete", "inferencepool", "manual", f"--namespace={namespace}")
        await until(lambda: seen[-1] == {}, timeout_s=60)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await api.close()
