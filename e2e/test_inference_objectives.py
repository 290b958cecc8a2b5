"""InferenceObjective objects on the real API server (the CRD the chart can install): a router
with ``inference_objectives`` lists those naming its pool, a request's
``x-gateway-inference-objective`` resolves to their ``spec.priority``, and an edit in Kubernetes
reaches the router; the HTTP router serves a request naming one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from e2e.local_router import until
from e2e.operator_harness import REPO

from copse.cluster import Kubectl
from copse.router.config import parse_config
from copse.router.discovery import KubeAioPodApi
from copse.router.objectives import OBJECTIVE_HEADER
from copse.router.server import start_router
from copse.workers.testing import mock_fleet

pytestmark = pytest.mark.e2e

OBJECTIVE_CRD = REPO / "charts" / "copse" / "files" / "inferenceobjective-crd.yaml"
API = "inference.networking.x-k8s.io/v1alpha2"


def _objective(name: str, *, pool: str, priority: int | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"poolRef": {"name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {"apiVersion": API, "kind": "InferenceObjective", "metadata": {"name": name}, "spec": spec}


async def test_the_router_follows_the_pools_inference_objectives(
    kubectl: Kubectl, kubeconfig: Path, namespace: str
) -> None:
    kubectl.apply(OBJECTIVE_CRD, server_side=True)
    kubectl.wait_established("-f", str(OBJECTIVE_CRD), timeout=60)
    objects = (("premium", "llama", 100), ("batch", "llama", None), ("theirs", "other", 50))
    for name, pool, priority in objects:
        kubectl.apply(_objective(name, pool=pool, priority=priority), namespace=namespace)
    api = await KubeAioPodApi.from_environment(kubeconfig)
    async with mock_fleet(engines=1) as fleet:
        raw = {
            "model": "mock-model",
            "engine": "mock",
            "port": 0,
            "namespace": namespace,
            "discovery": {"kind": "static", "workers": [{"url": fleet.urls[0]}]},
            "objectives": {"premium": {"ttft_ms": 2000}},
            "inference_objectives": {"pool": "llama", "interval_s": 0.2},
        }
        running = await start_router(parse_config(raw, source="e2e"), objective_api=api)
        classes = running.service.classes
        try:
            await until(lambda: classes.objective("premium").priority == 100, timeout_s=30)
            assert classes.objective("batch").priority == 0  # unset: 0, as the endpoint picker reads it
            assert classes.objective("premium").ttft_ms == 2000  # the config's target, Kubernetes' priority
            assert classes.objective("theirs") is classes.default  # another pool's objective
            kubectl.run(
                "patch",
                "inferenceobjective",
                "premium",
                f"--namespace={namespace}",
                "--type=merge",
                "-p",
                json.dumps({"spec": {"priority": 7}}),
            )
            await until(lambda: classes.objective("premium").priority == 7, timeout_s=30)
            kubectl.run("delete", "inferenceobjective", "batch", f"--namespace={namespace}")
            await until(lambda: classes.objective("batch") is classes.default, timeout_s=30)
            body = {"model": "mock-model", "prompt": "hello", "max_tokens": 4}
            async with (
                aiohttp.ClientSession() as http,
                http.post(
                    f"{running.url}/v1/completions", json=body, headers={OBJECTIVE_HEADER: "premium"}
                ) as response,
            ):
                assert response.status == 200, await response.text()
            admitted = running.service.metrics.class_admitted.labels("premium", "default")
            assert admitted._value.get() == 1
        finally:
            await running.close()
            await api.close()
