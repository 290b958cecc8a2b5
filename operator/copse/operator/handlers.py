"""kopf wiring: watches feed the controller's cache; the controller does the rest.

Only ``on.event`` handlers are used, so kopf adds no finalizers and stores no handler progress
on our objects: deleting an InferenceDeployment is plain garbage collection of its children.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
from kubernetes.aio import client, config

from copse.api import GROUP, PLURAL, VERSION
from copse.operator import names
from copse.operator.controller import Controller, Stalled, holds_gpus
from copse.operator.kube import Kube


async def _api_client() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        await config.load_kube_config()
    return client.ApiClient()


@kopf.on.startup()
async def start(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> None:
    # We post our own Events with the decisions; kopf's per-handler ones would be noise.
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    namespaces = memo.get("namespaces", [])
    if namespaces:
        # Watched namespaces are exact names: no need to list Namespaces (RBAC the chart does not grant).
        settings.scanning.disabled = True
    api_client = await _api_client()
    controller = Controller(kube=Kube(api_client), namespaces=namespaces, settings=memo.get("settings"))
    await controller.prime()
    memo["api_client"] = api_client
    memo["controller"] = controller
    memo["worker"] = asyncio.create_task(controller.run(), name="copse-reconciler")


@kopf.on.probe(id="reconciler")
def reconciler_health(memo: kopf.Memo, **_: Any) -> dict[str, float]:
    """The liveness endpoint's figures. A permanent error (kopf retries any other) makes the
    endpoint answer 500 at once, and Kubernetes restarts the operator."""
    worker: asyncio.Task[None] = memo["worker"]
    if worker.done():
        ended = "cancelled" if worker.cancelled() else repr(worker.exception())
        raise kopf.PermanentError(f"the reconcile loop ended: {ended}")
    try:
        health: dict[str, float] = memo["controller"].health()
    except Stalled as exc:
        raise kopf.PermanentError(str(exc)) from exc
    return health


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    worker: asyncio.Task[None] = memo["worker"]
    worker.cancel()
    await asyncio.gather(worker, return_exceptions=True)
    await memo["api_client"].close()


def _deleted(event: kopf.RawEvent) -> bool:
    return event["type"] == "DELETED"


@kopf.on.event(GROUP, VERSION, PLURAL)
def deployment_changed(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo["controller"].on_deployment(dict(body), deleted=_deleted(event))


def _relevant_pod(body: kopf.Body, **_: Any) -> bool:
    return names.LABEL_DEPLOYMENT in body.get("metadata", {}).get("labels", {}) or holds_gpus(body)


@kopf.on.event("", "v1", "pods", when=_relevant_pod)
def pod_changed(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo["controller"].on_pod(dict(body), deleted=_deleted(event))


@kopf.on.event("", "v1", "services", labels={names.LABEL_GROUP: kopf.PRESENT})
def service_changed(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo["controller"].on_service(dict(body), deleted=_deleted(event))


@kopf.on.event("", "v1", "nodes")
def node_changed(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    memo["controller"].on_node(dict(body), deleted=_deleted(event))


@kopf.on.event("apiextensions.k8s.io", "v1", "customresourcedefinitions")
def crd_changed(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """NVIDIA's ComputeDomain CRD arriving or leaving turns multi-node NVLink on or off."""
    memo["controller"].on_crd(dict(body), deleted=_deleted(event))


def quiet_kopf() -> None:
    """kopf logs every watch event at DEBUG and each handler run at INFO; keep our lines readable."""
    logging.getLogger("kopf").setLevel(logging.WARNING)
