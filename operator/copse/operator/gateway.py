"""The Gateway API HTTPRoute of an ``epp``-mode deployment that names a gateway
(``spec.router.gateway``): one gateway in front of several deployments routes each request by its
model.

The gateway cannot read a request body, so the Gateway API Inference Extension's body-based router
(an ext_proc server ahead of the route match) copies the body's ``model`` into the header
``X-Gateway-Model-Name``; the route matches that header exactly, once for the base model and once
per LoRA adapter of ``spec.model.loras``, and sends the requests to the deployment's InferencePool,
whose endpoint picker is the deployment's router. The route is named like the deployment and owned
by it (garbage-collected with it).

The HTTPRoute CRD comes with the Gateway API, not with copse: without it the operator writes no
route, and the deployment runs all the same (its ``GatewayRoute`` condition says why).

Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

from copse.api import InferenceDeployment, RouterMode
from copse.operator import names
from copse.operator.children import INFERENCE_POOL_API, owner_reference

GROUP = "gateway.networking.k8s.io"
VERSION = "v1"
PLURAL = "httproutes"
CRD = f"{PLURAL}.{GROUP}"
API = f"{GROUP}/{VERSION}"
MODEL_HEADER = "X-Gateway-Model-Name"
"""The header the Inference Extension's body-based router sets from the body's ``model``."""
CONDITION = "GatewayRoute"
MATCHES_PER_RULE = 64
"""The HTTPRoute CRD's ``maxItems`` of one rule's ``matches`` (and 128 over all rules: 65 names
at most, the model and 64 adapters, fit)."""


def wants_route(deployment: InferenceDeployment) -> bool:
    """Whether the deployment asks for an HTTPRoute (``spec.router.gateway`` in ``epp`` mode)."""
    router = deployment.spec.router
    return router.mode is RouterMode.EPP and router.gateway is not None


def served_models(deployment: InferenceDeployment) -> list[str]:
    """What requests may name as ``model``: the base model, then its adapters."""
    return [deployment.spec.model.name, *(lora.name for lora in deployment.spec.model.loras)]


def http_route(deployment: InferenceDeployment) -> dict[str, Any]:
    """The HTTPRoute sending the gateway's requests for the deployment's model and adapters to its
    InferencePool. Only for a deployment that :func:`wants_route`."""
    gateway = deployment.spec.router.gateway
    if gateway is None or deployment.spec.router.mode is not RouterMode.EPP:
        raise ValueError(
            f"{deployment.metadata.name}: an HTTPRoute needs router.mode: epp and router.gateway"
        )
    name = deployment.metadata.name
    parent: dict[str, Any] = {"group": GROUP, "kind": "Gateway", "name": gateway.name}
    if gateway.namespace is not None:
        parent["namespace"] = gateway.namespace
    if gateway.section_name is not None:
        parent["sectionName"] = gateway.section_name
    backend = {"group": INFERENCE_POOL_API.split("/", maxsplit=1)[0], "kind": "InferencePool", "name": name}
    matches = [
        {"headers": [{"type": "Exact", "name": MODEL_HEADER, "value": model}]}
        for model in served_models(deployment)
    ]
    rules = [
        {"matches": matches[start : start + MATCHES_PER_RULE], "backendRefs": [backend]}
        for start in range(0, len(matches), MATCHES_PER_RULE)
    ]
    return {
        "apiVersion": API,
        "kind": "HTTPRoute",
        "metadata": {
            "name": name,
            "namespace": deployment.metadata.namespace,
            "labels": {
                names.LABEL_MANAGED_BY: names.MANAGED_BY,
                names.LABEL_DEPLOYMENT: name,
                names.LABEL_COMPONENT: names.COMPONENT_ROUTER,
            },
            "ownerReferences": [owner_reference(deployment)],
        },
        "spec": {"parentRefs": [parent], "rules": rules},
    }


def owned(route: dict[str, Any], deployment: InferenceDeployment) -> bool:
    """Whether the HTTPRoute ``route`` is the deployment's: owned by it, or labelled as copse's
    route for a deployment of its name (one deleted and re-created: the garbage collector has not
    taken its route yet). Anything else is someone else's, which the operator neither overwrites
    nor deletes."""
    meta = route.get("metadata", {})
    uid = str(deployment.metadata.uid)
    if any(ref.get("uid") == uid for ref in meta.get("ownerReferences", [])):
        return True
    labels: dict[str, str] = meta.get("labels", {})
    return (
        labels.get(names.LABEL_MANAGED_BY) == names.MANAGED_BY
        and labels.get(names.LABEL_DEPLOYMENT) == deployment.metadata.name
    )


def conflict_message(deployment: InferenceDeployment) -> str:
    """The :data:`CONDITION` message when an HTTPRoute of the deployment's name is not its own."""
    name = deployment.metadata.name
    return (
        f"HTTPRoute {deployment.metadata.namespace}/{name} exists and is not this deployment's (no owner "
        f"reference to it, no {names.LABEL_MANAGED_BY} label): it is left as it is; delete it, or rename "
        "it, for the operator to write its own"
    )


def route_status(deployment: InferenceDeployment, *, served: bool) -> tuple[bool, str, str]:
    """``(ok, reason, message)`` of the deployment's :data:`CONDITION`, given whether the cluster
    serves the HTTPRoute CRD. Only for a deployment that :func:`wants_route`."""
    gateway = deployment.spec.router.gateway
    assert gateway is not None
    where = f"{gateway.namespace or deployment.metadata.namespace}/{gateway.name}"
    if gateway.section_name is not None:
        where += f" (listener {gateway.section_name})"
    if not served:
        return (
            False,
            "HTTPRouteCRDMissing",
            f"the cluster serves no {API} HTTPRoute (install the Gateway API CRDs): no route from "
            f"gateway {where}; the InferencePool {deployment.metadata.name} and its endpoint picker "
            "run all the same",
        )
    models = served_models(deployment)
    return (
        True,
        "RouteWritten",
        f"HTTPRoute {deployment.metadata.name} sends gateway {where}'s requests whose {MODEL_HEADER} is "
        f"{', '.join(models)} to InferencePool {deployment.metadata.name}",
    )
