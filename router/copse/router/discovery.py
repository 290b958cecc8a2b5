"""Where the workers are: a static list, or the ready worker pods of a deployment in Kubernetes.

A discovery source calls ``on_change`` with the complete current set of endpoints whenever it
changes. Whether an endpoint is alive right now is the frontend's health prober's business;
discovery only says which endpoints exist (for Kubernetes: which pods are Ready, so a pod the
kubelet finds unready disappears here too).

Pod labels read (the operator sets them): ``copse.dev/role`` (worker|prefill|decode, default
worker) and, for locality, ``copse.dev/domain`` (the NVLink domain of the pod's node) or else the
node name.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

from kubernetes.aio import client, config, watch
from kubernetes.aio.client.exceptions import ApiException

from copse.router.config import StaticWorker
from copse.router.core import Role

log = logging.getLogger(__name__)

ROLE_LABEL = "copse.dev/role"
DOMAIN_LABEL = "copse.dev/domain"


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """One worker as discovery sees it."""

    key: str
    """Stable identity within the source (pod name, or the URL of a static entry)."""
    url: str
    """Base URL of the engine's HTTP server."""
    role: Role
    worker_id: str | None
    """Id its KV events carry, when discovery knows it (the pod name); asked from the worker otherwise."""
    locality: str | None = None


OnChange = Callable[[Mapping[str, Endpoint]], None]


class Source(Protocol):
    """A discovery source."""

    async def run(self, on_change: OnChange) -> None:
        """Report the endpoints now and after every change; runs until cancelled."""
        ...


class StaticSource:
    """A fixed list of workers."""

    def __init__(self, workers: list[StaticWorker]) -> None:
        self._endpoints = {
            worker.url: Endpoint(
                key=worker.url,
                url=worker.url,
                role=worker.role,
                worker_id=worker.id,
                locality=worker.locality,
            )
            for worker in workers
        }

    async def run(self, on_change: OnChange) -> None:
        on_change(dict(self._endpoints))
        await asyncio.Event().wait()


def _get(obj: Mapping[str, Any] | None, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def endpoint_from_pod(pod: Mapping[str, Any], *, port: int) -> Endpoint | None:
    """The endpoint of a pod (Kubernetes JSON, camelCase keys) if it is Ready and has an IP."""
    name = _get(pod, "metadata", "name")
    ip = _get(pod, "status", "podIP")
    if not name or not ip or _get(pod, "metadata", "deletionTimestamp"):
        return None
    conditions = _get(pod, "status", "conditions") or []
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conditions if isinstance(c, dict)
    )
    if not ready:
        return None
    labels = _get(pod, "metadata", "labels") or {}
    try:
        role = Role(labels.get(ROLE_LABEL, Role.WORKER.value))
    except ValueError:
        log.warning("pod %s has unknown %s=%r; ignoring it", name, ROLE_LABEL, labels.get(ROLE_LABEL))
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return Endpoint(
        key=name,
        url=f"http://{host}:{port}",
        role=role,
        worker_id=name,
        locality=labels.get(DOMAIN_LABEL) or _get(pod, "spec", "nodeName"),
    )


class PodApi(Protocol):
    """The two Kubernetes calls discovery makes (a fake in tests, ``kubernetes.aio`` in pods)."""

    async def list_pods(self, *, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        """Pods matching ``selector`` and the list's resourceVersion."""
        ...

    def watch_pods(
        self, *, namespace: str, selector: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(event type, pod) from ``resource_version`` on; ends when the server closes the watch."""
        ...


class KubeApiError(RuntimeError):
    """The API server refused a list or watch (``status`` as HTTP; 410 = resourceVersion too old)."""

    def __init__(self, message: str, *, status: int | None) -> None:
        super().__init__(message)
        self.status = status


class KubernetesSource:
    """Ready pods matching a label selector: list, then watch; relist when the watch ends or fails."""

    def __init__(
        self, api: PodApi, *, namespace: str, selector: str, port: int, retry_s: float = 1.0
    ) -> None:
        self._api = api
        self.namespace = namespace
        self.selector = selector
        self.port = port
        self._retry_s = retry_s

    def _endpoints(self, pods: Mapping[str, dict[str, Any]]) -> dict[str, Endpoint]:
        found = (endpoint_from_pod(pod, port=self.port) for pod in pods.values())
        return {endpoint.key: endpoint for endpoint in found if endpoint is not None}

    async def run(self, on_change: OnChange) -> None:
        last: dict[str, Endpoint] | None = None

        def publish(pods: Mapping[str, dict[str, Any]]) -> None:
            nonlocal last
            endpoints = self._endpoints(pods)
            if endpoints != last:
                last = endpoints
                on_change(dict(endpoints))

        while True:
            try:
                items, version = await self._api.list_pods(namespace=self.namespace, selector=self.selector)
                pods = {str(_get(pod, "metadata", "name")): pod for pod in items}
                publish(pods)
                async for kind, pod in self._api.watch_pods(
                    namespace=self.namespace, selector=self.selector, resource_version=version
                ):
                    name = str(_get(pod, "metadata", "name"))
                    if kind == "DELETED":
                        pods.pop(name, None)
                    elif kind in ("ADDED", "MODIFIED"):
                        pods[name] = pod
                    else:
                        continue
                    publish(pods)
            except KubeApiError as exc:
                if exc.status != 410:
                    log.warning("pod discovery in %s failed (%s); retrying", self.namespace, exc)
                    await asyncio.sleep(self._retry_s)
            except (TimeoutError, OSError) as exc:
                log.warning("pod discovery in %s lost the API server (%s); retrying", self.namespace, exc)
                await asyncio.sleep(self._retry_s)


class KubeAioPodApi:
    """:class:`PodApi` over the official client's ``kubernetes.aio``."""

    def __init__(self, api_client: Any) -> None:
        self._client = api_client
        self._core = client.CoreV1Api(api_client)

    @classmethod
    async def from_environment(cls, kubeconfig: str | os.PathLike[str] | None = None) -> KubeAioPodApi:
        """In a pod: the service account; elsewhere: ``kubeconfig``, else ``$KUBECONFIG``, else
        ``~/.kube/config``."""
        if kubeconfig is None:
            try:
                config.load_incluster_config()
                return cls(client.ApiClient())
            except config.ConfigException:
                kubeconfig = os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
        configuration = client.Configuration()
        await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        return cls(client.ApiClient(configuration))

    async def list_pods(self, *, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        try:
            result = await self._core.list_namespaced_pod(namespace, label_selector=selector)
        except ApiException as exc:
            raise KubeApiError(str(exc.reason), status=exc.status) from exc
        items = [self._client.sanitize_for_serialization(pod) for pod in result.items]
        return items, str(result.metadata.resource_version)

    async def watch_pods(
        self, *, namespace: str, selector: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        stream = watch.Watch().stream(
            self._core.list_namespaced_pod,
            namespace,
            label_selector=selector,
            resource_version=resource_version,
            timeout_seconds=300,
        )
        try:
            async with stream:
                async for event in stream:
                    yield str(event["type"]), event["raw_object"]
        except ApiException as exc:
            raise KubeApiError(str(exc.reason), status=exc.status) from exc

    async def close(self) -> None:
        await self._client.close()
