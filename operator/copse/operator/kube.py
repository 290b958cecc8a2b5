"""The operator's writes to the API server, through the official client's ``kubernetes.aio``.

Bodies are plain dicts. Owned configuration (ConfigMaps, the router's objects) goes through
server-side apply, so re-applying the same object is a no-op; pods and group Services are
created once and treated as immutable records, so a 409 means "already there".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from kubernetes.aio import client
from kubernetes.aio.client.exceptions import ApiException

from copse.api import GROUP, PLURAL, VERSION

logger = logging.getLogger(__name__)

FIELD_MANAGER = "copse-operator"

#: kind -> (API class, the snake_case resource name in its method names)
_KINDS: dict[str, tuple[str, str]] = {
    "Pod": ("CoreV1Api", "pod"),
    "Service": ("CoreV1Api", "service"),
    "ConfigMap": ("CoreV1Api", "config_map"),
    "Secret": ("CoreV1Api", "secret"),
    "Job": ("BatchV1Api", "job"),
    "ServiceAccount": ("CoreV1Api", "service_account"),
    "Deployment": ("AppsV1Api", "deployment"),
    "Role": ("RbacAuthorizationV1Api", "role"),
    "RoleBinding": ("RbacAuthorizationV1Api", "role_binding"),
    "PodDisruptionBudget": ("PolicyV1Api", "pod_disruption_budget"),
}
#: kind -> (group, version, plural) of the custom resources the operator applies or creates
_CUSTOM_KINDS: dict[str, tuple[str, str, str]] = {
    "InferencePool": ("inference.networking.k8s.io", "v1", "inferencepools"),
    "ComputeDomain": ("resource.nvidia.com", "v1beta1", "computedomains"),
    "HTTPRoute": ("gateway.networking.k8s.io", "v1", "httproutes"),
}
#: kind -> what to do when the cluster does not serve it
_INSTALL_HINTS: dict[str, str] = {
    "InferencePool": "install its CRD (the chart's inferencePool.installCRD) or set spec.router.mode: http",
    "HTTPRoute": "install the Gateway API CRDs or unset spec.router.gateway",
}


class Refused(RuntimeError):
    """The API server refused to apply an object of another project's kind: its CRD is not served
    (404), the operator may not write it (403), or it is invalid under that CRD (422)."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status
        """The API server's HTTP status."""


def _refused(exc: ApiException, *, kind: str, namespace: str, name: str) -> Refused | None:
    """What ``exc`` on an object of the custom ``kind`` means for the user (``None``: not a
    refusal, a failure worth retrying). A refusal names the API server's own message, not its whole
    JSON answer (it goes into a condition and an Event)."""
    group, version, plural = _CUSTOM_KINDS[kind]
    where = f"{kind} {namespace}/{name}"
    if exc.status == 404:
        return Refused(
            f"{where}: the cluster does not serve {plural}.{group}/{version}; "
            f"{_INSTALL_HINTS.get(kind, 'install its CRD')}",
            status=404,
        )
    if exc.status in (403, 422):
        return Refused(
            f"{where}: the API server refused it ({exc.status} {exc.reason}): {_message(exc.body)}",
            status=exc.status,
        )
    return None


def _message(body: Any) -> str:
    """The ``message`` of a Kubernetes Status answer (the body itself when it is none)."""
    try:
        status = json.loads(body)
    except (TypeError, ValueError):
        return str(body)
    message = status.get("message") if isinstance(status, dict) else None
    return str(message) if message else str(body)


class KubeApi(Protocol):
    """The calls the controller makes; :class:`Kube` is the real one (tests use a fake)."""

    async def apply(self, obj: Mapping[str, Any]) -> None: ...
    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any] | None: ...
    async def read(self, kind: str, *, namespace: str, name: str) -> dict[str, Any] | None: ...
    async def delete(
        self, kind: str, *, namespace: str, name: str, grace_period_s: int | None = None
    ) -> None: ...
    async def patch_pod(
        self, *, namespace: str, name: str, json_patch: list[dict[str, Any]]
    ) -> dict[str, Any]: ...
    async def patch_service(
        self, *, namespace: str, name: str, json_patch: list[dict[str, Any]]
    ) -> dict[str, Any]: ...
    async def patch_status(self, *, namespace: str, name: str, status: Mapping[str, Any]) -> None: ...
    async def patch_spec(
        self, *, namespace: str, name: str, spec: Mapping[str, Any], resource_version: str | None
    ) -> bool: ...
    async def post_event(self, *, owner: Mapping[str, Any], type: str, reason: str, message: str) -> None: ...
    async def list_all(
        self, resource: str, *, label_selector: str | None = None, namespace: str | None = None
    ) -> list[dict[str, Any]]: ...
    async def served(self, *, group: str, version: str, plural: str) -> bool: ...


class Kube:
    """Typed-enough access to the handful of calls the operator makes."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    def to_dict(self, model: Any) -> dict[str, Any]:
        """A client model as the plain dict the API server sent."""
        result: dict[str, Any] = self._api_client.sanitize_for_serialization(model)
        return result

    def _method(self, kind: str, verb: str) -> Any:
        api_name, resource = _KINDS[kind]
        api = getattr(client, api_name)(self._api_client)
        return getattr(api, f"{verb}_namespaced_{resource}")

    async def apply(self, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        if obj["kind"] in _CUSTOM_KINDS:
            group, version, plural = _CUSTOM_KINDS[obj["kind"]]
            try:
                await self.custom.patch_namespaced_custom_object(
                    group,
                    version,
                    meta["namespace"],
                    plural,
                    meta["name"],
                    dict(obj),
                    field_manager=FIELD_MANAGER,
                    force=True,
                    _content_type="application/apply-patch+yaml",
                )
            except ApiException as exc:
                refused = _refused(exc, kind=obj["kind"], namespace=meta["namespace"], name=meta["name"])
                if refused is not None:
                    raise refused from exc
                raise
            return
        await self._method(obj["kind"], "patch")(
            name=meta["name"],
            namespace=meta["namespace"],
            body=dict(obj),
            field_manager=FIELD_MANAGER,
            force=True,
            _content_type="application/apply-patch+yaml",
        )

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create ``obj``; None when it already exists."""
        namespace = obj["metadata"]["namespace"]
        try:
            if obj["kind"] in _CUSTOM_KINDS:
                group, version, plural = _CUSTOM_KINDS[obj["kind"]]
                created: dict[str, Any] = await self.custom.create_namespaced_custom_object(
                    group=group, version=version, namespace=namespace, plural=plural, body=dict(obj)
                )
                return created
            model = await self._method(obj["kind"], "create")(namespace=namespace, body=dict(obj))
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise
        return self.to_dict(model)

    async def read(self, kind: str, *, namespace: str, name: str) -> dict[str, Any] | None:
        """The object of the custom ``kind`` (``None``: there is none, or its CRD is not served).
        A 403 raises :class:`Refused`."""
        group, version, plural = _CUSTOM_KINDS[kind]
        try:
            found: dict[str, Any] = await self.custom.get_namespaced_custom_object(
                group=group, version=version, namespace=namespace, plural=plural, name=name
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            refused = _refused(exc, kind=kind, namespace=namespace, name=name)
            if refused is not None:
                raise refused from exc
            raise
        return found

    async def delete(
        self, kind: str, *, namespace: str, name: str, grace_period_s: int | None = None
    ) -> None:
        try:
            if kind in _CUSTOM_KINDS:
                group, version, plural = _CUSTOM_KINDS[kind]
                await self.custom.delete_namespaced_custom_object(
                    group=group, version=version, namespace=namespace, plural=plural, name=name
                )
            else:
                await self._method(kind, "delete")(
                    name=name, namespace=namespace, grace_period_seconds=grace_period_s
                )
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def served(self, *, group: str, version: str, plural: str) -> bool:
        """Whether the API server serves ``plural`` in ``group/version`` (discovery: every
        authenticated client may ask)."""
        try:
            resources = await self.custom.get_api_resources(group=group, version=version)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return any(resource.name == plural for resource in resources.resources)

    async def patch_pod(
        self, *, namespace: str, name: str, json_patch: list[dict[str, Any]]
    ) -> dict[str, Any]:
        patched = await self.core.patch_namespaced_pod(
            name=name, namespace=namespace, body=json_patch, _content_type="application/json-patch+json"
        )
        return self.to_dict(patched)

    async def patch_service(
        self, *, namespace: str, name: str, json_patch: list[dict[str, Any]]
    ) -> dict[str, Any]:
        patched = await self.core.patch_namespaced_service(
            name=name, namespace=namespace, body=json_patch, _content_type="application/json-patch+json"
        )
        return self.to_dict(patched)

    async def patch_status(self, *, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        try:
            await self.custom.patch_namespaced_custom_object_status(
                group=GROUP,
                version=VERSION,
                namespace=namespace,
                plural=PLURAL,
                name=name,
                body={"status": dict(status)},
                _content_type="application/merge-patch+json",
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            # Deleted while we reconciled it: its children go with it, nothing to report.

    async def patch_spec(
        self, *, namespace: str, name: str, spec: Mapping[str, Any], resource_version: str | None
    ) -> bool:
        """Merge ``spec`` into an InferenceDeployment's spec, only over ``resource_version``
        (None: whatever is there); False when it changed meanwhile or is gone (the watch brings
        the new version, and the next pass decides again)."""
        metadata = {} if resource_version is None else {"resourceVersion": resource_version}
        try:
            await self.custom.patch_namespaced_custom_object(
                group=GROUP,
                version=VERSION,
                namespace=namespace,
                plural=PLURAL,
                name=name,
                body={"metadata": metadata, "spec": dict(spec)},
                _content_type="application/merge-patch+json",
            )
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True

    async def post_event(self, *, owner: Mapping[str, Any], type: str, reason: str, message: str) -> None:
        meta = owner["metadata"]
        now = datetime.now(UTC).isoformat()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": owner["apiVersion"],
                "kind": owner["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": type,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.core.create_namespaced_event(namespace=meta["namespace"], body=body)
        except ApiException as exc:
            # An Event is feedback, not state: losing one must not fail the reconcile.
            logger.warning("could not post event %s for %s: %s", reason, meta["name"], exc.reason)

    async def list_all(
        self, resource: str, *, label_selector: str | None = None, namespace: str | None = None
    ) -> list[dict[str, Any]]:
        """Every ``resource`` (nodes, pods, services or InferenceDeployments), in ``namespace`` or
        in all namespaces."""
        if resource == "nodes":
            return [self.to_dict(item) for item in (await self.core.list_node()).items]
        if resource == PLURAL:
            if namespace is None:
                found = await self.custom.list_cluster_custom_object(
                    group=GROUP, version=VERSION, plural=PLURAL
                )
            else:
                found = await self.custom.list_namespaced_custom_object(
                    group=GROUP, version=VERSION, namespace=namespace, plural=PLURAL
                )
            return list(found["items"])
        kind = {"pods": "pod", "services": "service"}[resource]
        if namespace is None:
            listed = await getattr(self.core, f"list_{kind}_for_all_namespaces")(
                label_selector=label_selector
            )
        else:
            listed = await getattr(self.core, f"list_namespaced_{kind}")(
                namespace, label_selector=label_selector
            )
        return [self.to_dict(item) for item in listed.items]


class KubeLease:
    """:class:`copse.operator.leader.LeaseApi` on the API server: optimistic writes (a stale
    ``resourceVersion`` is a 409, meaning another replica wrote first)."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._api_client = api_client
        self.coordination = client.CoordinationV1Api(api_client)

    async def read(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            lease = await self.coordination.read_namespaced_lease(name=name, namespace=namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        found: dict[str, Any] = self._api_client.sanitize_for_serialization(lease)
        return found

    async def create(self, *, namespace: str, name: str, spec: Mapping[str, Any]) -> bool:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace},
            "spec": dict(spec),
        }
        try:
            await self.coordination.create_namespaced_lease(namespace=namespace, body=body)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def replace(
        self, *, namespace: str, name: str, spec: Mapping[str, Any], resource_version: str | None
    ) -> bool:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": resource_version},
            "spec": dict(spec),
        }
        try:
            await self.coordination.replace_namespaced_lease(name=name, namespace=namespace, body=body)
        except ApiException as exc:
            if exc.status in (404, 409):
                return False
            raise
        return True
