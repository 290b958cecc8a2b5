"""The HTTPRoute of an ``epp``-mode deployment naming a gateway: the rendered object, the spec
checks, and the controller writing, updating and removing it (or reporting a missing CRD)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
from kubernetes.aio.client.exceptions import ApiException

from copse.api import ManifestError, parse_deployment
from copse.operator import gateway, kube

from .test_reconcile import NAMESPACE, Harness, manifest

ROUTES = (gateway.GROUP, gateway.VERSION, gateway.PLURAL)
CRD = {
    "metadata": {"name": gateway.CRD},
    "spec": {"versions": [{"name": "v1", "served": True}, {"name": "v1beta1", "served": True}]},
}
LORAS = [
    {"name": "sql", "source": "hf://acme/sql-lora", "rank": 16},
    {"name": "legal", "source": "hf://acme/legal-lora", "rank": 8},
]


def epp_spec(*, loras: list[dict[str, Any]] | None = None, **gateway_ref: Any) -> dict[str, Any]:
    return {
        "model": {"name": "meta-llama/Llama-3-70B", "tensorParallelism": 8, "loras": loras or []},
        "engine": {"backend": "mock"},
        "router": {"mode": "epp", "gateway": {"name": "inference", **gateway_ref}},
    }


def deployment(**spec: Any) -> Any:
    return parse_deployment(manifest(**spec), source="test")


def header_values(route: dict[str, Any]) -> list[str]:
    return [
        header["value"]
        for rule in route["spec"]["rules"]
        for match in rule["matches"]
        for header in match["headers"]
    ]


def test_the_route_matches_the_model_and_every_adapter_and_sends_them_to_the_pool() -> None:
    route = gateway.http_route(deployment(**epp_spec(loras=LORAS)))
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["kind"] == "HTTPRoute"
    meta = route["metadata"]
    assert (meta["name"], meta["namespace"]) == ("llama", NAMESPACE)
    assert meta["ownerReferences"][0]["kind"] == "InferenceDeployment"
    assert meta["ownerReferences"][0]["uid"] == "uid-llama"
    assert route["spec"]["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference"}
    ]
    [rule] = route["spec"]["rules"]
    assert rule["matches"] == [
        {"headers": [{"type": "Exact", "name": "X-Gateway-Model-Name", "value": name}]}
        for name in ("meta-llama/Llama-3-70B", "sql", "legal")
    ]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama"}
    ]


def test_a_gateway_elsewhere_and_its_listener_are_named_in_the_parent_ref() -> None:
    route = gateway.http_route(deployment(**epp_spec(namespace="edge", sectionName="https")))
    assert route["spec"]["parentRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
            "name": "inference",
            "namespace": "edge",
            "sectionName": "https",
        }
    ]


def test_sixty_five_names_split_into_rules_of_at_most_sixty_four_matches() -> None:
    loras = [{"name": f"adapter-{k}", "source": f"hf://acme/a{k}", "rank": 8} for k in range(64)]
    route = gateway.http_route(deployment(**epp_spec(loras=loras)))
    assert [len(rule["matches"]) for rule in route["spec"]["rules"]] == [64, 1]
    assert header_values(route) == ["meta-llama/Llama-3-70B", *(f"adapter-{k}" for k in range(64))]
    backends = {str(rule["backendRefs"]) for rule in route["spec"]["rules"]}
    assert len(backends) == 1


def test_a_gateway_needs_epp_mode() -> None:
    spec = epp_spec()
    spec["router"]["mode"] = "http"
    with pytest.raises(ManifestError, match=r"router\.gateway needs router\.mode: epp"):
        deployment(**spec)
    assert not gateway.wants_route(deployment(**{**spec, "router": {"mode": "epp"}}))


def route_condition(harness: Harness) -> dict[str, Any] | None:
    found = [c for c in harness.status["conditions"] if c["type"] == gateway.CONDITION]
    return found[0] if found else None


async def test_without_the_httproute_crd_the_deployment_runs_and_says_so_once() -> None:
    harness = Harness(replicas=1, **epp_spec(loras=LORAS))
    await harness.settle()
    assert harness.status["phase"] == "Running"
    assert harness.kube.of_kind("HTTPRoute") == []
    assert [pool["metadata"]["name"] for pool in harness.kube.of_kind("InferencePool")] == ["llama"]
    condition = route_condition(harness)
    assert condition is not None
    assert (condition["status"], condition["reason"]) == ("False", "HTTPRouteCRDMissing")
    assert "install the Gateway API CRDs" in condition["message"]
    await harness.controller.reconcile_once(("serving", "llama"))
    warnings = [e for e in harness.kube.events if e[1] == "HTTPRouteCRDMissing"]
    assert [event[0] for event in warnings] == ["Warning"]
    # The CRD arrives: the next pass writes the route.
    harness.controller.on_crd(CRD, deleted=False)
    assert harness.controller.http_routes_served
    await harness.settle()
    assert header_values(harness.kube.of_kind("HTTPRoute")[0]) == ["meta-llama/Llama-3-70B", "sql", "legal"]
    condition = route_condition(harness)
    assert condition is not None
    assert (condition["status"], condition["reason"]) == ("True", "RouteWritten")
    harness.controller.on_crd(CRD, deleted=True)
    assert not harness.controller.http_routes_served


async def test_the_route_follows_the_adapters_and_goes_when_the_gateway_is_unset() -> None:
    harness = Harness(replicas=1, **epp_spec(loras=LORAS))
    harness.kube.served_apis.add(ROUTES)
    await harness.controller.prime()
    await harness.settle()
    [route] = harness.kube.of_kind("HTTPRoute")
    assert header_values(route) == ["meta-llama/Llama-3-70B", "sql", "legal"]
    condition = route_condition(harness)
    assert condition is not None
    assert condition["status"] == "True"
    assert "sql, legal" in condition["message"]
    model = harness.kube.objects[("InferenceDeployment", NAMESPACE, "llama")]["spec"]["model"]
    harness.update_spec(
        model={**model, "loras": [*LORAS[1:], {"name": "chat", "source": "hf://acme/chat", "rank": 4}]}
    )
    await harness.settle()
    [route] = harness.kube.of_kind("HTTPRoute")
    assert header_values(route) == ["meta-llama/Llama-3-70B", "legal", "chat"]
    reasons = Counter(reason for _, reason, _ in harness.kube.events)
    assert reasons["RouteWritten"] == 1  # reported once, not at every update
    harness.update_spec(router={"mode": "epp"})
    await harness.settle()
    assert harness.kube.of_kind("HTTPRoute") == []
    assert ("HTTPRoute", "llama", None) in harness.kube.deletions
    assert route_condition(harness) is None
    assert ("Normal", "RouteRemoved") in {event[:2] for event in harness.kube.events}


async def test_a_route_the_api_server_refuses_is_reported_and_the_deployment_runs() -> None:
    harness = Harness(replicas=1, **epp_spec())
    harness.kube.served_apis.add(ROUTES)
    harness.kube.refused["HTTPRoute"] = (
        403,
        "the API server refused it (403 Forbidden): httproutes is forbidden",
    )
    await harness.controller.prime()
    await harness.settle()
    assert harness.status["phase"] == "Running"
    condition = route_condition(harness)
    assert condition is not None
    assert (condition["status"], condition["reason"]) == ("False", "RouteRefused")
    assert "403 Forbidden" in condition["message"]
    assert ("Warning", "RouteRefused") in {event[:2] for event in harness.kube.events}
    # Granted: the next pass writes it.
    del harness.kube.refused["HTTPRoute"]
    harness.controller.mark(("serving", "llama"))
    await harness.settle()
    assert len(harness.kube.of_kind("HTTPRoute")) == 1
    condition = route_condition(harness)
    assert condition is not None
    assert condition["reason"] == "RouteWritten"


async def test_a_route_written_then_refused_goes_when_the_gateway_is_unset() -> None:
    """The route was written, a later apply was refused (condition False): unsetting the gateway
    still deletes it."""
    harness = Harness(replicas=1, **epp_spec(loras=LORAS))
    harness.kube.served_apis.add(ROUTES)
    await harness.controller.prime()
    await harness.settle()
    assert len(harness.kube.of_kind("HTTPRoute")) == 1
    harness.kube.refused["HTTPRoute"] = (422, "the API server refused it (422 Unprocessable Entity)")
    harness.update_spec(model={**epp_spec()["model"], "loras": LORAS[:1]})
    await harness.settle()
    condition = route_condition(harness)
    assert condition is not None
    assert (condition["status"], condition["reason"]) == ("False", "RouteRefused")
    harness.update_spec(router={"mode": "epp"})
    await harness.settle()
    assert harness.kube.of_kind("HTTPRoute") == []
    assert ("Normal", "RouteRemoved") in {event[:2] for event in harness.kube.events}


async def test_a_route_whose_status_never_landed_goes_when_the_gateway_is_unset() -> None:
    harness = Harness(replicas=1, **epp_spec())
    harness.kube.served_apis.add(ROUTES)
    await harness.controller.prime()
    await harness.settle()
    # A new operator (no memory) meets a deployment whose status says nothing of the route.
    harness.status["conditions"] = [c for c in harness.status["conditions"] if c["type"] != gateway.CONDITION]
    harness.controller = type(harness.controller)(kube=harness.kube, settings=harness.controller.settings)
    harness.kube.served_apis.add(ROUTES)
    await harness.controller.prime()
    harness.update_spec(router={"mode": "epp"})
    await harness.settle()
    assert harness.kube.of_kind("HTTPRoute") == []


async def test_a_route_someone_else_wrote_is_neither_taken_over_nor_deleted() -> None:
    harness = Harness(replicas=1, **epp_spec())
    harness.kube.served_apis.add(ROUTES)
    theirs = {
        "apiVersion": gateway.API,
        "kind": "HTTPRoute",
        "metadata": {"name": "llama", "namespace": NAMESPACE},
        "spec": {"parentRefs": [{"name": "theirs"}]},
    }
    harness.kube._store(theirs)
    await harness.controller.prime()
    await harness.settle()
    [route] = harness.kube.of_kind("HTTPRoute")
    assert route["spec"] == theirs["spec"]
    condition = route_condition(harness)
    assert condition is not None
    assert (condition["status"], condition["reason"]) == ("False", "RouteConflict")
    assert harness.status["phase"] == "Running"
    harness.update_spec(router={"mode": "epp"})
    await harness.settle()
    [route] = harness.kube.of_kind("HTTPRoute")
    assert route["spec"] == theirs["spec"]


async def test_gateway_off_then_on_reports_the_route_again() -> None:
    harness = Harness(replicas=1, **epp_spec())
    harness.kube.served_apis.add(ROUTES)
    await harness.controller.prime()
    await harness.settle()
    harness.update_spec(router={"mode": "epp"})
    await harness.settle()
    assert harness.kube.of_kind("HTTPRoute") == []
    harness.update_spec(router=epp_spec()["router"])
    await harness.settle()
    assert len(harness.kube.of_kind("HTTPRoute")) == 1
    reasons = Counter(reason for _, reason, _ in harness.kube.events)
    assert reasons["RouteWritten"] == 2


async def test_a_pass_whose_status_patch_failed_does_not_report_the_route_twice() -> None:
    harness = Harness(replicas=1, **epp_spec())
    harness.kube.served_apis.add(ROUTES)
    await harness.controller.prime()
    harness.kube.failing_status = 1
    with pytest.raises(RuntimeError, match="status patch failed"):
        await harness.controller.reconcile_once(("serving", "llama"))
    assert "conditions" not in harness.kube.objects[("InferenceDeployment", NAMESPACE, "llama")].get(
        "status", {}
    )
    await harness.settle()
    condition = route_condition(harness)
    assert condition is not None
    assert condition["reason"] == "RouteWritten"
    reasons = Counter(reason for _, reason, _ in harness.kube.events)
    assert reasons["RouteWritten"] == 1


async def test_an_api_error_on_the_route_does_not_stop_the_pass_and_is_tried_again() -> None:
    harness = Harness(replicas=1, **epp_spec())
    harness.kube.served_apis.add(ROUTES)
    harness.kube.failing["HTTPRoute"] = 503
    await harness.controller.prime()
    await harness.settle()
    assert harness.status["phase"] == "Running"
    assert [pool["metadata"]["name"] for pool in harness.kube.of_kind("InferencePool")] == ["llama"]
    condition = route_condition(harness)
    assert condition is not None
    assert (condition["status"], condition["reason"]) == ("False", "RouteError")
    assert "503" in condition["message"]
    requeue = await harness.controller.reconcile_once(("serving", "llama"))
    assert requeue is not None
    assert requeue <= 5.0
    del harness.kube.failing["HTTPRoute"]
    await harness.settle()
    assert len(harness.kube.of_kind("HTTPRoute")) == 1
    # An error while removing it: the pass goes on, and the next one removes it.
    harness.kube.failing["HTTPRoute"] = 500
    harness.update_spec(router={"mode": "epp"})
    await harness.settle()
    assert len(harness.kube.of_kind("HTTPRoute")) == 1
    del harness.kube.failing["HTTPRoute"]
    await harness.settle()
    assert harness.kube.of_kind("HTTPRoute") == []


def test_a_refusal_names_the_api_servers_message_not_its_json() -> None:
    exc = ApiException(status=403, reason="Forbidden")
    exc.body = json.dumps(
        {"kind": "Status", "status": "Failure", "message": "httproutes is forbidden", "code": 403}
    )
    refused = kube._refused(exc, kind="HTTPRoute", namespace=NAMESPACE, name="llama")
    assert str(refused) == (
        "HTTPRoute serving/llama: the API server refused it (403 Forbidden): httproutes is forbidden"
    )
    assert (
        kube._refused(ApiException(status=503, reason="x"), kind="HTTPRoute", namespace="n", name="r") is None
    )


@pytest.mark.parametrize(
    ("ref", "field"),
    [
        ({"namespace": "Edge_1"}, "namespace"),
        ({"sectionName": "HTTPS listener"}, "sectionName"),
        ({"name": "my gateway"}, "name"),
    ],
)
def test_a_gateway_ref_outside_the_gateway_apis_names_is_refused(ref: dict[str, str], field: str) -> None:
    spec = epp_spec()
    spec["router"]["gateway"].update(ref)
    with pytest.raises(ManifestError, match=rf"gateway\.{field}"):
        deployment(**spec)


async def test_a_crd_not_yet_served_after_its_watch_said_so_is_tried_again_soon() -> None:
    """The CRD watch says the HTTPRoute CRD is served a moment before the API server serves it (a
    404): the pass comes back soon instead of waiting for an unrelated change."""
    harness = Harness(replicas=1, **epp_spec())
    harness.controller.on_crd(CRD, deleted=False)
    harness.kube.refused["HTTPRoute"] = (404, "the cluster does not serve httproutes")
    await harness.settle()
    condition = route_condition(harness)
    assert condition is not None
    assert condition["reason"] == "RouteRefused"
    requeue = await harness.controller.reconcile_once(("serving", "llama"))
    assert requeue is not None
    assert requeue <= 5.0
    # An RBAC refusal waits for the next pass (retrying it every 5 s would only repeat it).
    harness.kube.refused["HTTPRoute"] = (403, "forbidden")
    await harness.settle()
    assert await harness.controller.reconcile_once(("serving", "llama")) is None
