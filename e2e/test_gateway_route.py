"""``spec.router.gateway`` on the real control plane: the operator (with only the chart's RBAC)
runs an ``epp``-mode deployment without the Gateway API's HTTPRoute CRD and says so, writes the
HTTPRoute once the CRD is installed (the pinned v1.4.1 CRD: the API server checks the route against
its schema and CEL rules), follows the deployment's adapters, deletes it when the gateway is
unset, and the garbage collector deletes the route with the deployment.

The test deletes the cluster-wide HTTPRoute CRD (a cluster without it is the first case). No other
e2e file uses HTTPRoutes, and every session starts its own control plane; on a cluster shared with
other work (an existing kubeconfig) run it alone."""

from __future__ import annotations

import json
from typing import Any

import pytest
from e2e.operator_harness import REPO, Operator, seed, status, wait_running, wait_until

from copse.cluster import Kubectl, KubectlError

pytestmark = pytest.mark.e2e

POOL_CRD = REPO / "charts" / "copse" / "files" / "inferencepool-crd.yaml"
ROUTE_CRD = REPO / "e2e" / "fixtures" / "httproute-crd.yaml"
LORAS = [
    {"name": "sql", "source": "hf://acme/sql-lora", "rank": 16},
    {"name": "legal", "source": "hf://acme/legal-lora", "rank": 8},
]


def route_condition(kubectl: Kubectl, name: str, namespace: str) -> dict[str, Any]:
    found = [c for c in status(kubectl, name, namespace).get("conditions", []) if c["type"] == "GatewayRoute"]
    return found[0] if found else {}


def routed_models(kubectl: Kubectl, name: str, namespace: str) -> list[str]:
    route = kubectl.get("httproute", name, namespace=namespace)
    return [
        header["value"]
        for rule in route["spec"]["rules"]
        for match in rule["matches"]
        for header in match["headers"]
    ]


def routes(kubectl: Kubectl, namespace: str) -> list[dict[str, Any]]:
    try:
        return kubectl.items("httproutes", namespace=namespace)
    except KubectlError:
        return []  # the CRD is not served


def test_the_operator_writes_the_route_once_the_crd_is_there_and_it_follows_the_deployment(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    kubectl.apply(POOL_CRD, server_side=True)
    kubectl.wait_established("-f", str(POOL_CRD), timeout=60)
    kubectl.run("delete", "crd", "httproutes.gateway.networking.k8s.io", "--ignore-not-found")
    spec = {
        "model": {"name": "meta-llama/Llama-3-70B", "tensorParallelism": 8, "loras": LORAS},
        "engine": {"backend": "mock"},
        "router": {"mode": "epp", "gateway": {"name": "inference", "namespace": "edge"}},
    }
    try:
        # No HTTPRoute CRD: the deployment runs, and its condition and one Warning say why.
        kubectl.apply(seed("routed", **spec), namespace=namespace)
        wait_running(kubectl, "routed", namespace, operator)
        wait_until(
            "the GatewayRoute condition",
            lambda: route_condition(kubectl, "routed", namespace).get("reason") == "HTTPRouteCRDMissing",
            operator=operator,
        )
        assert route_condition(kubectl, "routed", namespace)["status"] == "False"
        assert kubectl.get("inferencepool", "routed", namespace=namespace)["metadata"]["name"] == "routed"
        events = kubectl.items(
            "events",
            "--field-selector",
            "involvedObject.name=routed,reason=HTTPRouteCRDMissing",
            namespace=namespace,
        )
        assert [event["type"] for event in events] == ["Warning"]

        # The CRD arrives: the operator's CRD watch notices, and the route is written.
        kubectl.apply(ROUTE_CRD, server_side=True)
        kubectl.wait_established("-f", str(ROUTE_CRD), timeout=60)
        wait_until("the HTTPRoute", lambda: bool(routes(kubectl, namespace)), operator=operator)
        route = kubectl.get("httproute", "routed", namespace=namespace)
        assert route["spec"]["parentRefs"] == [
            {
                "group": "gateway.networking.k8s.io",
                "kind": "Gateway",
                "name": "inference",
                "namespace": "edge",
            }
        ]
        assert routed_models(kubectl, "routed", namespace) == ["meta-llama/Llama-3-70B", "sql", "legal"]
        [rule] = route["spec"]["rules"]
        assert rule["backendRefs"][0]["kind"] == "InferencePool"
        assert rule["backendRefs"][0]["group"] == "inference.networking.k8s.io"
        assert rule["backendRefs"][0]["name"] == "routed"
        assert rule["matches"][0]["headers"][0]["name"] == "X-Gateway-Model-Name"
        owner = route["metadata"]["ownerReferences"][0]
        deployment = kubectl.get("idep", "routed", namespace=namespace)
        assert (owner["kind"], owner["uid"]) == ("InferenceDeployment", deployment["metadata"]["uid"])
        wait_until(
            "the GatewayRoute condition to turn True",
            lambda: route_condition(kubectl, "routed", namespace).get("status") == "True",
            operator=operator,
        )

        # The adapters change: so does the route.
        kubectl.run(
            "patch",
            "idep",
            "routed",
            f"--namespace={namespace}",
            "--type=merge",
            "-p",
            '{"spec": {"model": {"loras": [{"name": "legal", "source": "hf://acme/legal-lora", "rank": 8},'
            ' {"name": "chat", "source": "hf://acme/chat-lora", "rank": 4}]}}}',
        )
        wait_until(
            "the HTTPRoute to follow the adapters",
            lambda: (
                routed_models(kubectl, "routed", namespace) == ["meta-llama/Llama-3-70B", "legal", "chat"]
            ),
            operator=operator,
        )

        # The gateway is unset: the operator deletes its route; set again, it writes it again.
        def set_gateway(gateway: dict[str, str] | None) -> None:
            patch = json.dumps({"spec": {"router": {"gateway": gateway}}})
            kubectl.run("patch", "idep", "routed", f"--namespace={namespace}", "--type=merge", "-p", patch)

        set_gateway(None)
        wait_until("the HTTPRoute to be removed", lambda: not routes(kubectl, namespace), operator=operator)
        wait_until(
            "the GatewayRoute condition to go",
            lambda: not route_condition(kubectl, "routed", namespace),
            operator=operator,
        )
        set_gateway({"name": "inference", "namespace": "edge"})
        wait_until("the HTTPRoute again", lambda: bool(routes(kubectl, namespace)), operator=operator)

        # The deployment goes: the garbage collector takes the route with it.
        kubectl.run("delete", "idep", "routed", f"--namespace={namespace}")
        wait_until("the HTTPRoute to be deleted", lambda: not routes(kubectl, namespace), operator=operator)
    finally:
        kubectl.run("delete", "crd", "httproutes.gateway.networking.k8s.io", "--ignore-not-found")
