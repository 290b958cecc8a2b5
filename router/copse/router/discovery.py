"""Where the workers are: a static list, the ready worker pods of a deployment in Kubernetes, or
the ready pods of a Gateway API Inference Extension ``InferencePool``.

A discovery source calls ``on_change`` with the complete current set of endpoints whenever it
changes. Whether an endpoint is alive right now is the frontend's health prober's business;
discovery only says which endpoints exist (for Kubernetes: which pods are Ready, so a pod the
kubelet finds unready disappears here too).

Pod labels read (the operator sets them): ``copse.dev/role`` (worker|prefill|decode, default
worker), for locality ``copse.dev/domain`` (the NVLink domain of the pod's node) or else the
node name, and ``copse.dev/draining=true`` on a group the operator is removing (it gets no new
requests; those in flight finish).

An ``InferencePool`` (``inference.networking.k8s.io/v1``) names its pods by
``spec.selector.matchLabels`` and their port by ``spec.targetPorts``; the source follows the pool
(a changed selector or port rediscovers the pods; a deleted pool has no endpoints) and uses its
first target port (the engine's HTTP server).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

import aiohttp
from kubernetes.aio import client, config, watch
from kubernetes.aio.client.exceptions import ApiException

from copse.router.config import StaticWorker
from copse.router.core import Role
from copse.router.objective_source import PLURAL as OBJECTIVE_PLURAL
from copse.router.objective_source import ObjectiveListError

log = logging.getLogger(__name__)

INFERENCE_POOL_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_VERSION = "v1"
INFERENCE_POOL_PLURAL = "inferencepools"

ROLE_LABEL = "copse.dev/role"
DOMAIN_LABEL = "copse.dev/domain"
DRAINING_LABEL = "copse.dev/draining"
REVISION_LABEL = "copse.dev/revision"


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
    draining: bool = False
    """Marked for removal: no new requests, in-flight ones finish."""
    revision: str | None = None
    """The deployment revision the engine runs: prefill and decode pair only within one."""
    model: str | None = None
    """The base model it serves, when the router fronts several (``None``: the router's own)."""


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


class ModelSources:
    """Several models' sources as one: each model's endpoints, tagged with the model and keyed
    ``<model>/<key>`` (two deployments' pods may share names only across namespaces, static URLs
    not at all, but keys must not collide)."""

    def __init__(self, sources: Mapping[str, Source]) -> None:
        self._sources = dict(sources)
        self._seen: dict[str, dict[str, Endpoint]] = {model: {} for model in self._sources}

    async def run(self, on_change: OnChange) -> None:
        def changed(model: str) -> OnChange:
            def report(endpoints: Mapping[str, Endpoint]) -> None:
                self._seen[model] = {
                    f"{model}/{key}": dataclasses.replace(endpoint, key=f"{model}/{key}", model=model)
                    for key, endpoint in endpoints.items()
                }
                on_change({key: e for seen in self._seen.values() for key, e in seen.items()})

            return report

        async with asyncio.TaskGroup() as group:
            for model, source in self._sources.items():
                group.create_task(source.run(changed(model)), name=f"discovery-{model}")


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
        draining=labels.get(DRAINING_LABEL) == "true",
        revision=labels.get(REVISION_LABEL),
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


class PoolApi(PodApi, Protocol):
    """:class:`PodApi` plus reading one InferencePool."""

    async def list_pools(self, *, namespace: str, name: str) -> tuple[list[dict[str, Any]], str]:
        """The InferencePool ``name`` (an empty list when it does not exist) and the list's
        resourceVersion."""
        ...

    def watch_pools(
        self, *, namespace: str, name: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(event type, pool) of the InferencePool ``name`` from ``resource_version`` on."""
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


def pool_target(pool: Mapping[str, Any]) -> tuple[str, int] | None:
    """(label selector, port) of an InferencePool's pods, ``None`` when the pool names neither."""
    labels = _get(pool, "spec", "selector", "matchLabels")
    ports = _get(pool, "spec", "targetPorts")
    if not isinstance(labels, Mapping) or not labels or not isinstance(ports, list) or not ports:
        return None
    port = ports[0].get("number") if isinstance(ports[0], Mapping) else None
    if not isinstance(port, int):
        return None
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items())), port


class InferencePoolSource:
    """The ready pods of an InferencePool: watches the pool, and its pods through a
    :class:`KubernetesSource` rebuilt whenever the pool's selector or port changes."""

    def __init__(self, api: PoolApi, *, namespace: str, name: str, retry_s: float = 1.0) -> None:
        self._api = api
        self.namespace = namespace
        self.name = name
        self._retry_s = retry_s
        self.target: tuple[str, int] | None = None
        """The (selector, port) followed now."""
        self._pods: asyncio.Task[None] | None = None

    async def run(self, on_change: OnChange) -> None:
        try:
            while True:
                try:
                    items, version = await self._api.list_pools(namespace=self.namespace, name=self.name)
                    self._follow(items[0] if items else None, on_change)
                    async for kind, pool in self._api.watch_pools(
                        namespace=self.namespace, name=self.name, resource_version=version
                    ):
                        if kind in ("ADDED", "MODIFIED"):
                            self._follow(pool, on_change)
                        elif kind == "DELETED":
                            self._follow(None, on_change)
                except KubeApiError as exc:
                    if exc.status != 410:
                        log.warning("InferencePool %s/%s: %s; retrying", self.namespace, self.name, exc)
                        await asyncio.sleep(self._retry_s)
                except (TimeoutError, OSError) as exc:
                    log.warning(
                        "InferencePool %s/%s: lost the API server (%s); retrying",
                        self.namespace,
                        self.name,
                        exc,
                    )
                    await asyncio.sleep(self._retry_s)
        finally:
            await self._stop_pods()

    def _follow(self, pool: Mapping[str, Any] | None, on_change: OnChange) -> None:
        target = None if pool is None else pool_target(pool)
        if pool is not None and target is None:
            log.warning(
                "InferencePool %s/%s has no spec.selector.matchLabels or spec.targetPorts[0].number;"
                " no endpoints",
                self.namespace,
                self.name,
            )
        if target == self.target and (self._pods is not None or target is None):
            return
        self.target = target
        if self._pods is not None:
            self._pods.cancel()
            self._pods = None
        if target is None:
            on_change({})
            return
        selector, port = target
        log.info("InferencePool %s/%s: pods %s, port %d", self.namespace, self.name, selector, port)
        pods = KubernetesSource(
            self._api, namespace=self.namespace, selector=selector, port=port, retry_s=self._retry_s
        )
        self._pods = asyncio.create_task(pods.run(on_change), name=f"pool-pods-{self.name}")

    async def _stop_pods(self) -> None:
        if self._pods is not None:
            self._pods.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pods
            self._pods = None


class KubeAioPodApi:
    """:class:`PodApi` over the official client's ``kubernetes.aio``."""

    def __init__(self, api_client: Any) -> None:
        self._client = api_client
        self._core = client.CoreV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)

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

    async def list_pools(self, *, namespace: str, name: str) -> tuple[list[dict[str, Any]], str]:
        try:
            result = await self._custom.list_namespaced_custom_object(
                INFERENCE_POOL_GROUP,
                INFERENCE_POOL_VERSION,
                namespace,
                INFERENCE_POOL_PLURAL,
                field_selector=f"metadata.name={name}",
            )
        except ApiException as exc:
            raise KubeApiError(str(exc.reason), status=exc.status) from exc
        return list(result.get("items") or []), str(_get(result, "metadata", "resourceVersion"))

    async def watch_pools(
        self, *, namespace: str, name: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        stream = watch.Watch().stream(
            self._custom.list_namespaced_custom_object,
            INFERENCE_POOL_GROUP,
            INFERENCE_POOL_VERSION,
            namespace,
            INFERENCE_POOL_PLURAL,
            field_selector=f"metadata.name={name}",
            resource_version=resource_version,
            timeout_seconds=300,
        )
        try:
            async with stream:
                async for event in stream:
                    yield str(event["type"]), event["raw_object"]
        except ApiException as exc:
            raise KubeApiError(str(exc.reason), status=exc.status) from exc

    async def list_objectives(self, *, namespace: str, api_version: str) -> list[dict[str, Any]]:
        """:meth:`copse.router.objective_source.ObjectiveApi.list_objectives`."""
        group, _, version = api_version.partition("/")
        try:
            result = await self._custom.list_namespaced_custom_object(
                group, version, namespace, OBJECTIVE_PLURAL
            )
        except ApiException as exc:
            raise ObjectiveListError(f"{exc.status} {exc.reason}") from exc
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise ObjectiveListError(f"{type(exc).__name__}: {exc}") from exc
        return list(result.get("items") or [])

    async def close(self) -> None:
        await self._client.close()
