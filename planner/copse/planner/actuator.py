"""Applying decisions: a merge patch of the InferenceDeployment's replica fields, and Events.

Only ``spec.prefill.replicas`` / ``spec.decode.replicas`` (disaggregated) or ``spec.replicas``
(aggregated) are ever written, only for pools whose count changes, and never outside the bounds
the deployment sets at the moment of patching (they are re-read every interval). In observe-only
mode nothing is patched: the decision goes to the log and to an Event on the deployment.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from copse.api import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    InferenceDeployment,
    ManifestError,
    Role,
    parse_deployment,
)
from copse.planner.core import Decision
from copse.planner.policy import Limits, clamp, fit_budget

logger = logging.getLogger(__name__)

COMPONENT = "copse-planner"
#: Event reasons.
REASON_SCALED = "PlannerScaled"
REASON_RECOMMENDED = "PlannerRecommendation"
#: API servers cap an Event message at 1 KiB-ish; keep ours inside.
_MESSAGE_LIMIT = 1024


class ActuatorError(RuntimeError):
    """The deployment cannot be read or patched; the message names it and why."""


class DeploymentApi(Protocol):
    """The API calls the planner makes (the real one wraps ``kubernetes.aio``)."""

    async def names(self, *, namespace: str | None) -> list[tuple[str, str]]:
        """(namespace, name) of every InferenceDeployment in ``namespace`` (``None``: all)."""

    async def get(self, *, namespace: str, name: str) -> dict[str, Any]:
        """The InferenceDeployment as the API server has it; :class:`LookupError` if absent,
        :class:`ActuatorError` for other failures."""

    async def patch(self, *, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the InferenceDeployment; returns the patched object
        (:class:`ActuatorError` on failure)."""

    async def post_event(self, *, namespace: str, body: dict[str, Any]) -> None:
        """Create a core/v1 Event (:class:`ActuatorError` on failure)."""


class KubernetesApi:
    """:class:`DeploymentApi` over the official client's ``kubernetes.aio``."""

    def __init__(self, api_client: Any) -> None:
        from kubernetes.aio import client  # noqa: PLC0415  (only a live planner pays for it)

        self._api_client = api_client
        self._custom = client.CustomObjectsApi(api_client)
        self._core = client.CoreV1Api(api_client)

    @classmethod
    async def connect(cls, *, kubeconfig: Path | None = None, context: str | None = None) -> KubernetesApi:
        """In a pod: its ServiceAccount; elsewhere ``kubeconfig`` (or ``$KUBECONFIG``/~/.kube/config)."""
        from kubernetes.aio import client, config  # noqa: PLC0415

        configuration = client.Configuration()
        if kubeconfig is None and context is None:
            try:
                config.load_incluster_config(client_configuration=configuration)
                return cls(client.ApiClient(configuration))
            except config.ConfigException:
                logger.debug("not in a cluster: using a kubeconfig")
        await config.load_kube_config(
            config_file=str(kubeconfig) if kubeconfig else None,
            context=context,
            client_configuration=configuration,
        )
        return cls(client.ApiClient(configuration))

    async def close(self) -> None:
        await self._api_client.close()

    async def names(self, *, namespace: str | None) -> list[tuple[str, str]]:
        from kubernetes.aio.client.exceptions import ApiException  # noqa: PLC0415

        try:
            if namespace is None:
                listed = await self._custom.list_cluster_custom_object(
                    group=GROUP, version=VERSION, plural=PLURAL
                )
            else:
                listed = await self._custom.list_namespaced_custom_object(
                    group=GROUP, version=VERSION, namespace=namespace, plural=PLURAL
                )
        except ApiException as exc:
            where = namespace or "all namespaces"
            raise ActuatorError(f"listing {PLURAL} in {where}: {exc.status} {exc.reason}") from exc
        return [(item["metadata"]["namespace"], item["metadata"]["name"]) for item in listed["items"]]

    async def get(self, *, namespace: str, name: str) -> dict[str, Any]:
        from kubernetes.aio.client.exceptions import ApiException  # noqa: PLC0415

        try:
            found: dict[str, Any] = await self._custom.get_namespaced_custom_object(
                group=GROUP, version=VERSION, namespace=namespace, plural=PLURAL, name=name
            )
        except ApiException as exc:
            if exc.status == 404:
                raise LookupError(f"{KIND} {namespace}/{name} not found") from exc
            raise ActuatorError(f"reading {KIND} {namespace}/{name}: {exc.status} {exc.reason}") from exc
        return found

    async def patch(self, *, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        from kubernetes.aio.client.exceptions import ApiException  # noqa: PLC0415

        try:
            patched: dict[str, Any] = await self._custom.patch_namespaced_custom_object(
                group=GROUP,
                version=VERSION,
                namespace=namespace,
                plural=PLURAL,
                name=name,
                body=body,
                _content_type="application/merge-patch+json",
            )
        except ApiException as exc:
            raise ActuatorError(
                f"patching {KIND} {namespace}/{name} with {body}: {exc.status} {exc.reason}: {exc.body}"
            ) from exc
        return patched

    async def post_event(self, *, namespace: str, body: dict[str, Any]) -> None:
        from kubernetes.aio.client.exceptions import ApiException  # noqa: PLC0415

        try:
            await self._core.create_namespaced_event(namespace=namespace, body=body)
        except ApiException as exc:
            raise ActuatorError(f"posting an Event in {namespace}: {exc.status} {exc.reason}") from exc


def replicas_of(deployment: InferenceDeployment) -> dict[Role, int]:
    """Replicas per pool in the deployment's spec (aggregated without spec.replicas: minReplicas)."""
    return {pool.role: pool.replicas for pool in deployment.spec.pools()}


def patch_for(
    *, target: Mapping[Role, int], current: Mapping[Role, int], limits: Limits
) -> dict[str, Any] | None:
    """The merge patch that moves ``current`` to ``target`` (re-bounded), or ``None`` when nothing
    changes."""
    bounded = fit_budget(clamp(target, limits), limits)
    changed = {role: count for role, count in bounded.items() if count != current.get(role)}
    if not changed:
        return None
    if Role.WORKER in changed:
        return {"spec": {"replicas": changed[Role.WORKER]}}
    return {"spec": {role.value: {"replicas": count} for role, count in changed.items()}}


def _summary(current: Mapping[Role, int], target: Mapping[Role, int]) -> str:
    return ", ".join(f"{role.value} {current.get(role, 0)}→{count}" for role, count in target.items())


class Actuator:
    """Reads one InferenceDeployment and applies the planner's decisions to it."""

    def __init__(self, *, api: DeploymentApi, namespace: str, name: str, observe_only: bool) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.observe_only = observe_only
        self._instance = socket.gethostname()

    async def fetch(self) -> InferenceDeployment:
        """The deployment as it is now (bounds and targets may have been edited)."""
        try:
            raw = await self.api.get(namespace=self.namespace, name=self.name)
        except LookupError as exc:
            raise ActuatorError(str(exc)) from exc
        try:
            return parse_deployment(raw, source=f"{KIND} {self.namespace}/{self.name}")
        except ManifestError as exc:
            raise ActuatorError(str(exc)) from exc

    async def apply(self, decision: Decision, deployment: InferenceDeployment) -> str:
        """Patch (or, observe-only, recommend) the decision; returns ``applied``, ``observe_only``
        or ``unchanged``."""
        limits = Limits.from_spec(deployment.spec)
        current = replicas_of(deployment)
        body = patch_for(target=decision.target, current=current, limits=limits)
        if body is None:
            return "unchanged"
        extra = {"namespace": self.namespace, "deployment": self.name}
        message = f"{_summary(current, decision.target)}: {decision.describe()}"
        if self.observe_only:
            logger.info("observe-only, not patching: %s", message, extra=extra)
            await self._event(deployment, reason=REASON_RECOMMENDED, message=f"recommend {message}")
            return "observe_only"
        await self.api.patch(namespace=self.namespace, name=self.name, body=body)
        logger.info("patched %s: %s", body, message, extra=extra)
        await self._event(deployment, reason=REASON_SCALED, message=f"scaled {message}")
        return "applied"

    async def _event(self, deployment: InferenceDeployment, *, reason: str, message: str) -> None:
        now = datetime.now(UTC).isoformat()
        meta = deployment.metadata
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{self.name}.planner-", "namespace": self.namespace},
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": KIND,
                "name": self.name,
                "namespace": self.namespace,
                "uid": meta.uid,
            },
            "type": "Normal",
            "reason": reason,
            "message": message[:_MESSAGE_LIMIT],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": self._instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.api.post_event(namespace=self.namespace, body=body)
        except ActuatorError as exc:
            # An Event is feedback, not state: losing one must not undo the decision.
            logger.warning("%s", exc, extra={"namespace": self.namespace, "deployment": self.name})
