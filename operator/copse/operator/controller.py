"""The operator's runtime: kopf watches, a write-through cache and one reconcile queue.

kopf streams the watched objects (InferenceDeployments, pods that hold GPUs or belong to a
deployment, the group Services, Nodes) into an in-memory cache and marks the affected
deployments dirty; a single worker reconciles dirty deployments one at a time from that cache
(so two passes never race), executes the decision, and requeues itself while something is in
flight. Nothing is kept that the cluster does not also hold: a restart lists everything again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import pydantic
from kubernetes.aio.client.exceptions import ApiException

from copse.api import KIND, PLURAL, InferenceDeployment, ManifestError, Role, RouterMode, parse_deployment
from copse.operator import children, gateway, metrics, multinode, names, weights
from copse.operator.children import GroupLayout
from copse.operator.inflight import InFlight, RouterInFlight
from copse.operator.kube import KubeApi, Refused
from copse.operator.reconcile import Decision, ReconcileSettings, condition, reconcile
from copse.operator.state import GroupState, ObservedGroup, observe_groups, pod_ready

logger = logging.getLogger("copse.operator")

Key = tuple[str, str]  # (namespace, name)
RETRY_S = 5.0
"""Seconds before a failed pass (or a failed HTTPRoute call) is tried again."""
_T = TypeVar("_T")
_R = TypeVar("_R")


def _key(obj: Mapping[str, Any]) -> Key:
    meta = obj["metadata"]
    return meta.get("namespace", ""), meta["name"]


def _context(
    namespace: str, deployment: str, *, role: str | None = None, group: str | None = None
) -> dict[str, Any]:
    """Log-record fields: every line says which deployment (and group) it is about."""
    return {"namespace": namespace, "deployment": deployment, "role": role, "group": group}


def holds_gpus(pod: Mapping[str, Any]) -> bool:
    for container in pod.get("spec", {}).get("containers", []):
        resources = container.get("resources") or {}
        for section in ("limits", "requests"):
            if int((resources.get(section) or {}).get(children.GPU_RESOURCE, 0) or 0) > 0:
                return True
    return False


def _node_fingerprint(node: Mapping[str, Any]) -> str:
    """What about a node matters to placement; heartbeats alone must not trigger reconciles."""
    ready = next(
        (c.get("status") for c in node.get("status", {}).get("conditions", []) if c.get("type") == "Ready"),
        None,
    )
    spec = node.get("spec", {})
    return json.dumps(
        [
            ready,
            spec.get("unschedulable", False),
            spec.get("taints", []),
            node.get("metadata", {}).get("labels", {}),
            node.get("status", {}).get("allocatable", {}),
        ],
        sort_keys=True,
    )


@dataclasses.dataclass
class Cache:
    deployments: dict[Key, dict[str, Any]] = dataclasses.field(default_factory=dict)
    pods: dict[Key, dict[str, Any]] = dataclasses.field(default_factory=dict)
    services: dict[Key, dict[str, Any]] = dataclasses.field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def put(
        self, store: dict[Any, dict[str, Any]], key: Any, obj: Mapping[str, Any], *, deleted: bool
    ) -> None:
        if deleted:
            store.pop(key, None)
        else:
            store[key] = dict(obj)


class Stalled(RuntimeError):
    """The reconcile loop has not taken work that is long due (the liveness probe fails on it)."""


class Controller:
    def __init__(
        self,
        *,
        kube: KubeApi,
        settings: ReconcileSettings | None = None,
        in_flight: InFlight | None = None,
        api_concurrency: int = 16,
        stalled_after_s: float = 300.0,
        namespaces: Sequence[str] = (),
    ) -> None:
        self.kube = kube
        self.in_flight = in_flight or RouterInFlight()
        """Where the requests still in flight on a draining group are counted (its routers)."""
        self.namespaces = tuple(namespaces)
        """The watched namespaces (all when empty): the start-up listing stays inside them."""
        self.api_concurrency = api_concurrency
        self.settings = settings or ReconcileSettings()
        self.stalled_after_s = stalled_after_s
        """A deployment due for a pass this long means the loop is stuck (a hung API call, a
        deadlock): :meth:`health` raises and Kubernetes restarts the operator, whose pass is
        idempotent. Far above the longest pass of a large deployment (seconds)."""
        self.cache = Cache()
        self._dirty: dict[Key, float] = {}
        self._wakeup = asyncio.Event()
        self._pass_started: float | None = None
        self.compute_domains_served = False
        """Whether the cluster has NVIDIA's ComputeDomain CRD (listed at start, then watched)."""
        self.http_routes_served = False
        """Whether the cluster has the Gateway API's HTTPRoute CRD (listed at start, then watched)."""
        self.leading = True
        """Whether this replica reconciles (holds the leader Lease); a standby only keeps its
        cache, so its queue waiting is no sign of a stuck loop."""
        self._created: set[tuple[str, str, str, str]] = set()
        """(kind, namespace, name, owner uid) of create-once children this process knows exist,
        so a pass does not ask again (a restarted operator asks once and gets 409)."""
        self._route_reported: dict[str, str] = {}
        """Owner uid -> the GatewayRoute reason last posted as an Event (a pass may run before the
        watch brings back the status the previous pass wrote)."""
        self._route_absent: set[str] = set()
        """Owner uids of deployments wanting no HTTPRoute whose route this process saw gone, so a
        pass does not ask the API server again (another leader may have written one: cleared when
        this replica takes over)."""

    def health(self) -> dict[str, float]:
        """Figures for the liveness probe: deployments queued for a pass, how long the oldest due
        one has waited and how long the pass in progress has run (s). Raises :class:`Stalled` when
        either exceeds :attr:`stalled_after_s`."""
        now = time.monotonic()
        due_since = self._dirty.values() if self.leading else ()
        waited = max((now - due for due in due_since if due <= now), default=0.0)
        running = 0.0 if self._pass_started is None else now - self._pass_started
        if waited > self.stalled_after_s:
            raise Stalled(
                f"a deployment has waited {waited:.0f} s for its reconcile pass "
                f"(more than {self.stalled_after_s:g} s): the reconcile loop is stuck"
            )
        if running > self.stalled_after_s:
            raise Stalled(
                f"a reconcile pass has run for {running:.0f} s (more than {self.stalled_after_s:g} s)"
            )
        return {
            "queued": float(len(self._dirty)),
            "oldest_due_s": round(waited, 3),
            "pass_running_s": round(running, 3),
        }

    # -- feeding the cache (called from kopf event handlers) ---------------------------------

    def mark(self, key: Key, *, after_s: float = 0.0) -> None:
        due = time.monotonic() + after_s
        self._dirty[key] = min(self._dirty.get(key, due), due)
        self._wakeup.set()

    def take_over(self) -> None:
        """This replica starts reconciling (it won the Lease): every deployment gets a pass, and
        nothing another leader may have changed meanwhile is assumed (the cache was kept warm by
        the watches while it stood by)."""
        self.leading = True
        self._created.clear()
        self._route_absent.clear()
        self.mark_all()

    def mark_all(self) -> None:
        for key in self.cache.deployments:
            self.mark(key)

    def on_deployment(self, body: Mapping[str, Any], *, deleted: bool) -> None:
        self.cache.put(self.cache.deployments, _key(body), body, deleted=deleted)
        if not deleted:
            self.mark(_key(body))
            return
        # What this process remembers creating for it goes too: churning deployments must not
        # grow the operator's memory.
        uid = body.get("metadata", {}).get("uid")
        self._created = {key for key in self._created if key[3] != uid}
        self._route_reported.pop(uid, None)
        self._route_absent.discard(uid)
        # A deleted deployment's series go too (an alert on them would outlive it).
        for gauge in (metrics.PLACEMENT_SCORE, metrics.UNPLACED_GROUPS):
            with contextlib.suppress(KeyError):
                gauge.remove(*_key(body))

    def on_pod(self, pod: Mapping[str, Any], *, deleted: bool) -> None:
        self.cache.put(self.cache.pods, _key(pod), pod, deleted=deleted)
        owner = pod.get("metadata", {}).get("labels", {}).get(names.LABEL_DEPLOYMENT)
        if owner:
            self.mark((pod["metadata"]["namespace"], owner))
        elif deleted:
            self._mark_unplaced()  # a foreign GPU pod went away: capacity may now fit

    def on_service(self, service: Mapping[str, Any], *, deleted: bool) -> None:
        self.cache.put(self.cache.services, _key(service), service, deleted=deleted)
        owner = service.get("metadata", {}).get("labels", {}).get(names.LABEL_DEPLOYMENT)
        if owner:
            self.mark((service["metadata"]["namespace"], owner))

    def on_node(self, node: Mapping[str, Any], *, deleted: bool) -> None:
        name = node["metadata"]["name"]
        before = self.cache.nodes.get(name)
        self.cache.put(self.cache.nodes, name, node, deleted=deleted)
        if deleted or before is None or _node_fingerprint(before) != _node_fingerprint(node):
            self.mark_all()

    def on_crd(self, crd: Mapping[str, Any], *, deleted: bool) -> None:
        """A CustomResourceDefinition changed: notice NVIDIA's ComputeDomain or the Gateway API's
        HTTPRoute arriving or leaving."""
        name = crd.get("metadata", {}).get("name")
        versions = crd.get("spec", {}).get("versions", [])
        if name == multinode.COMPUTE_DOMAIN_CRD:
            attribute, version = "compute_domains_served", multinode.COMPUTE_DOMAIN_VERSION
        elif name == gateway.CRD:
            attribute, version = "http_routes_served", gateway.VERSION
        else:
            return
        served = not deleted and any(v.get("name") == version and v.get("served") for v in versions)
        if served != getattr(self, attribute):
            logger.info("%s CRD %s", name, "served" if served else "gone")
            setattr(self, attribute, served)
            self.mark_all()

    def _mark_unplaced(self) -> None:
        for key, body in self.cache.deployments.items():
            if body.get("status", {}).get("unplaced"):
                self.mark(key)

    async def prime(self) -> None:
        """Fill the cache with a full listing so the first pass sees every existing child."""
        for node in await self.kube.list_all("nodes"):
            self.cache.nodes[node["metadata"]["name"]] = node
        # GPUs held anywhere count, whatever namespaces are watched (reading pods is cluster-wide).
        for pod in await self.kube.list_all("pods"):
            if holds_gpus(pod) or names.LABEL_DEPLOYMENT in pod["metadata"].get("labels", {}):
                self.cache.pods[_key(pod)] = pod
        for namespace in self.namespaces or (None,):
            for service in await self.kube.list_all(
                "services", label_selector=names.LABEL_GROUP, namespace=namespace
            ):
                self.cache.services[_key(service)] = service
            for body in await self.kube.list_all(PLURAL, namespace=namespace):
                self.on_deployment(body, deleted=False)
        self.compute_domains_served = await self.kube.served(
            group=multinode.COMPUTE_DOMAIN_GROUP,
            version=multinode.COMPUTE_DOMAIN_VERSION,
            plural=multinode.COMPUTE_DOMAIN_PLURAL,
        )
        self.http_routes_served = await self.kube.served(
            group=gateway.GROUP, version=gateway.VERSION, plural=gateway.PLURAL
        )

    # -- the worker ----------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            due = sorted((when, key) for key, when in self._dirty.items() if when <= now)
            if not due:
                self._wakeup.clear()
                upcoming = min(self._dirty.values(), default=None)
                timeout = None if upcoming is None else max(0.0, upcoming - now)
                # (asyncio.timeout, not wait_for: in Python 3.11 wait_for returns when a wake-up
                # and the cancellation at a lost lease arrive together, and the loop never ends)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await self._wakeup.wait()
                continue
            for _, key in due:
                self._dirty.pop(key, None)
                await self._reconcile_safely(key)

    async def _reconcile_safely(self, key: Key) -> None:
        started = self._pass_started = time.monotonic()
        try:
            requeue = await self.reconcile_once(key)
        except Exception:
            # Any failure (API hiccup, conflict) is retried with a delay; the pass is idempotent.
            logger.exception("reconcile failed; retrying in %gs", RETRY_S, extra=_context(*key))
            metrics.RECONCILE_ERRORS.inc()
            self.mark(key, after_s=RETRY_S)
            return
        finally:
            self._pass_started = None
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
            metrics.RECONCILES.inc()
        if requeue is not None:
            self.mark(key, after_s=requeue)

    async def reconcile_once(self, key: Key) -> float | None:
        body = self.cache.deployments.get(key)
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            return None  # children go with their owner through ownerReferences
        namespace, name = key
        try:
            deployment = parse_deployment(body, source=f"{KIND} {namespace}/{name}")
        except (ManifestError, pydantic.ValidationError) as exc:
            logger.error("%s", exc, extra=_context(namespace, name))
            invalid = condition(
                "InvalidSpec",
                True,
                reason="ValidationFailed",
                message=str(exc),
                generation=body.get("metadata", {}).get("generation"),
                now=datetime.now(UTC),
                previous=body.get("status", {}).get("conditions", []),
            )
            await self.kube.patch_status(
                namespace=namespace, name=name, status={"phase": "Failed", "conditions": [invalid]}
            )
            await self.kube.post_event(owner=body, type="Warning", reason="InvalidSpec", message=str(exc))
            return None
        await self._default_replicas(body, deployment)
        services = [s for (ns, _), s in self.cache.services.items() if ns == namespace]
        own_pods = [p for (ns, _), p in self.cache.pods.items() if ns == namespace]
        groups = observe_groups(deployment=name, services=services, pods=own_pods)
        # An HTTP router answers on its serving port, an endpoint picker on its metrics port.
        port = (
            children.EPP_METRICS_PORT
            if deployment.spec.router.mode is RouterMode.EPP
            else children.ROUTER_PORT
        )
        routers = self._routers(namespace, name, port=port)
        in_flight = await self.in_flight.count(
            routers=routers,
            workers=[names.pod_name(group.name, 0) for group in groups if group.state is GroupState.DRAINING],
        )
        # While a pool holds more groups than its replicas (a roll's or a move's surge), an old
        # group may go for a new ready one: only once every router uses the new one.
        surging = any(
            sum(1 for g in groups if g.role is pool.role and g.state is not GroupState.DRAINING)
            > pool.replicas
            for pool in deployment.spec.pools()
        )
        ready = {names.pod_name(g.name, 0): g.name for g in groups if g.state is GroupState.READY}
        unlisted = await self.in_flight.unlisted(routers=routers, workers=list(ready)) if surging else set()
        decision = reconcile(
            deployment=deployment,
            groups=groups,
            nodes=list(self.cache.nodes.values()),
            pods=list(self.cache.pods.values()),
            now=datetime.now(UTC),
            generation=body["metadata"].get("generation"),
            previous_status=body.get("status"),
            in_flight={
                group.name: in_flight.get(names.pod_name(group.name, 0))
                for group in groups
                if group.state is GroupState.DRAINING
            },
            unroutable={ready[pod] for pod in unlisted},
            settings=self.settings,
        )
        ok, reason, message = multinode.nvlink_check(
            deployment, groups=decision.status["groups"], pods=own_pods, served=self.compute_domains_served
        )
        _add_condition(decision, body, multinode.CONDITION, ok, reason=reason, message=message)
        route_retry = await self._gateway_route(body, deployment, decision, namespace=namespace)
        await self._execute(body=body, deployment=deployment, decision=decision, namespace=namespace)
        if route_retry:
            return min(RETRY_S, decision.requeue_after_s or RETRY_S)
        return decision.requeue_after_s

    async def _gateway_route(
        self, body: Mapping[str, Any], deployment: InferenceDeployment, decision: Decision, *, namespace: str
    ) -> bool:
        """Write (or remove) the deployment's HTTPRoute and report it in its GatewayRoute condition.
        It never fails the pass (the pods and the InferencePool come first): a missing CRD, a refusal
        (403/422), a route of the same name that is someone else's, or an API error (5xx, 409, a
        timeout) goes into the condition. Returns whether to come back soon (an API error: no
        change may bring the next pass)."""
        previous = body.get("status", {}).get("conditions", [])
        before = next((c for c in previous if c.get("type") == gateway.CONDITION), None)
        name = deployment.metadata.name
        uid = str(deployment.metadata.uid)
        if not gateway.wants_route(deployment):
            # Wanted again later, it is reported again (a restart or a new leader may post that
            # Event twice: acceptable).
            self._route_reported.pop(uid, None)
            if not self.http_routes_served or uid in self._route_absent:
                return False
            # Whatever the condition says (a refused apply, a status patch that never landed):
            # a route of ours goes.
            try:
                await self._remove_route(body, deployment, namespace=namespace)
            except (ApiException, Refused) as exc:
                logger.warning(
                    "HTTPRoute %s not removed (%s); tried again", name, exc, extra=_context(namespace, name)
                )
                return True
            self._route_absent.add(uid)
            return False
        self._route_absent.discard(uid)
        ok, reason, message = gateway.route_status(deployment, served=self.http_routes_served)
        retry = False
        if ok:
            try:
                current = await self.kube.read("HTTPRoute", namespace=namespace, name=name)
                if current is not None and not gateway.owned(current, deployment):
                    ok, reason, message = False, "RouteConflict", gateway.conflict_message(deployment)
                else:
                    await self.kube.apply(gateway.http_route(deployment))
            except Refused as exc:
                # The deployment is served all the same: the route waits for RBAC or the CRD. A
                # CRD the watch says is served may 404 a moment longer: that is tried again soon.
                logger.warning("%s", exc, extra=_context(namespace, name))
                ok, reason, message = False, "RouteRefused", str(exc)
                retry = exc.status == 404
            except ApiException as exc:
                logger.warning("HTTPRoute %s: %s", name, exc, extra=_context(namespace, name))
                ok, reason, retry = False, "RouteError", True
                message = (
                    f"HTTPRoute {namespace}/{name}: the API server answered {exc.status} {exc.reason}; "
                    f"tried again in {RETRY_S:g} s"
                )
        if (before is None or before.get("reason") != reason) and self._route_reported.get(uid) != reason:
            # The memo: a pass may run before the watch brings back the status the previous pass
            # wrote (or its status patch failed), and the Event is posted once.
            self._route_reported[uid] = reason
            await self.kube.post_event(
                owner=body, type="Normal" if ok else "Warning", reason=reason, message=message
            )
        _add_condition(decision, body, gateway.CONDITION, ok, reason=reason, message=message)
        return retry

    async def _remove_route(
        self, body: Mapping[str, Any], deployment: InferenceDeployment, *, namespace: str
    ) -> None:
        """Delete the deployment's HTTPRoute if there is one and it is its own."""
        name = deployment.metadata.name
        current = await self.kube.read("HTTPRoute", namespace=namespace, name=name)
        if current is None or not gateway.owned(current, deployment):
            return
        await self.kube.delete("HTTPRoute", namespace=namespace, name=name)
        await self.kube.post_event(
            owner=body,
            type="Normal",
            reason="RouteRemoved",
            message=f"HTTPRoute {name} deleted: spec.router.gateway is unset or the mode is not epp",
        )

    def _routers(self, namespace: str, name: str, *, port: int) -> list[str]:
        """Base URLs of the deployment's ready router pods (none ready: nothing routes)."""
        routers = []
        for (pod_namespace, _), pod in self.cache.pods.items():
            labels = pod.get("metadata", {}).get("labels", {})
            ip = pod.get("status", {}).get("podIP")
            if (
                pod_namespace == namespace
                and labels.get(names.LABEL_DEPLOYMENT) == name
                and labels.get(names.LABEL_COMPONENT) == names.COMPONENT_ROUTER
                and ip
                and pod_ready(pod)
                and not pod["metadata"].get("deletionTimestamp")
            ):
                host = f"[{ip}]" if ":" in ip else ip
                routers.append(f"http://{host}:{port}")
        return sorted(routers)

    async def _default_replicas(self, body: Mapping[str, Any], deployment: InferenceDeployment) -> None:
        """Write ``spec.replicas`` of an aggregated deployment that has none (it means
        ``scaling.minReplicas``): the scale subresource reads that path, and an absent value reads
        as 0, so ``kubectl scale`` and a HorizontalPodAutoscaler would act on a count of 0."""
        spec = deployment.spec
        if spec.disaggregated or spec.replicas is not None:
            return
        namespace, name = str(deployment.metadata.namespace), deployment.metadata.name
        replicas = spec.scaling.min_replicas
        written = await self.kube.patch_spec(
            namespace=namespace,
            name=name,
            spec={"replicas": replicas},
            resource_version=body["metadata"].get("resourceVersion"),
        )
        if written:
            logger.info("spec.replicas defaulted to %d", replicas, extra=_context(namespace, name))
            await self.kube.post_event(
                owner=body,
                type="Normal",
                reason="ReplicasDefaulted",
                message=f"spec.replicas set to scaling.minReplicas ({replicas}): the scale subresource "
                "and autoscalers read it from now on",
            )

    async def _execute(
        self, *, body: Mapping[str, Any], deployment: InferenceDeployment, decision: Decision, namespace: str
    ) -> None:
        name = deployment.metadata.name
        model_express = children.modelexpress_objects(
            deployment, source=decision.cold_start_source, source_ranks=decision.cold_start_ranks
        )
        for obj in [
            children.engine_configmap(deployment),
            *children.router_objects(deployment, images=self.settings.images),
            *model_express,
        ]:
            await self.kube.apply(obj)
        job = weights.download_job(
            deployment,
            image=children.worker_image(deployment, images=self.settings.images),
            owner=children.owner_reference(deployment),
        )
        if job is not None:
            await self._create_once(
                job, deployment=name, owner=str(deployment.metadata.uid), make=lambda: job
            )
        await self._each(decision.restart, lambda item: self._restart(namespace, name, *item))
        await self._each(decision.drain, lambda item: self._drain(body, namespace, *item))
        await self._each(decision.undrain, lambda item: self._undrain(namespace, name, *item))
        await self._each(
            decision.force_delete,
            lambda item: self.kube.delete("Pod", namespace=namespace, name=item[0], grace_period_s=0),
        )
        await self._each(decision.remove, lambda item: self._remove(namespace, name, *item))
        recorded = await self._each(decision.place, lambda layout: self._record(deployment, layout))
        lost = {
            (layout.role, layout.replica)
            for layout, ok in zip(decision.place, recorded, strict=True)
            if not ok
        }
        image = children.revision_image(deployment, self.cache.pods.values(), images=self.settings.images)
        default = children.worker_image(deployment, images=self.settings.images)
        if image != default and any(recorded):
            await self.kube.post_event(
                owner=body,
                type="Normal",
                reason="RevisionImage",
                message=f"{sum(recorded)} new group(s) run {image}, the image of revision "
                f"{children.revision(deployment)}'s other groups, not the operator's default {default}: "
                "the default reaches this deployment with its next spec change (or set spec.engine.image)",
            )
        await self._each(
            [layout for layout in decision.create_pods if (layout.role, layout.replica) not in lost],
            lambda layout: self._create_pods(
                deployment, layout, decision.cold_start_source, decision.cold_start_ranks, image=image
            ),
        )
        await self._each(
            decision.lift_gates,
            lambda group: self._lift_gates(namespace, name, group.role, group.name, group.pods.values()),
        )
        await self._each(
            decision.events,
            lambda event: self.kube.post_event(
                owner=body, type=event.type, reason=event.reason, message=event.message
            ),
        )
        status = decision.status
        if status.get("score") is not None:
            metrics.PLACEMENT_SCORE.labels(namespace=namespace, deployment=name).set(status["score"])
        metrics.UNPLACED_GROUPS.labels(namespace=namespace, deployment=name).set(
            status.get("unplacedTotal", 0)
        )
        if _changed(body.get("status", {}), status):
            logger.info(
                "%s, ready %s, score %s",
                status["phase"],
                status["ready"],
                status["score"],
                extra=_context(namespace, name),
            )
            await self.kube.patch_status(namespace=namespace, name=name, status=status)

    async def _each(self, items: Iterable[_T], action: Callable[[_T], Awaitable[_R]]) -> list[_R]:
        """Run ``action`` on every item concurrently, at most ``api_concurrency`` calls in flight:
        a 64-group deployment is hundreds of independent API calls."""
        limit = asyncio.Semaphore(self.api_concurrency)

        async def bounded(item: _T) -> _R:
            async with limit:
                return await action(item)

        return list(await asyncio.gather(*(bounded(item) for item in items)))

    async def _restart(self, namespace: str, name: str, group: ObservedGroup, reason: str) -> None:
        context = _context(namespace, name, role=group.role.value, group=group.name)
        logger.info("gang restart of %s (%s)", group.name, reason, extra=context)
        await self._delete_pods(namespace, group.pods.values(), grace_period_s=0)
        if group.layout is not None and len(group.layout.pods) > 1:
            # Its next placement gets a fresh ComputeDomain (the Service owns any that is left).
            domain = names.compute_domain_name(group.name, group.restarts)
            await self.kube.delete("ComputeDomain", namespace=namespace, name=domain)
        if group.service is not None:
            patched = await self.kube.patch_service(
                namespace=namespace,
                name=group.name,
                json_patch=_annotate(
                    group.service,
                    {
                        names.ANNOTATION_PLACEMENT: "",
                        names.ANNOTATION_RESTARTS: str(group.restarts + 1),
                        names.ANNOTATION_LAST_RESTART: datetime.now(UTC).isoformat(),
                    },
                ),
            )
            self.cache.services[(namespace, group.name)] = patched
        metrics.GANG_RESTARTS.inc()

    async def _drain(
        self, body: Mapping[str, Any], namespace: str, group: ObservedGroup, reason: str
    ) -> None:
        """Mark a serving group for removal: its pods get the draining label (the routers send it
        nothing new), its Service records since when (the deadline survives a restart)."""
        name = body["metadata"]["name"]
        context = _context(namespace, name, role=group.role.value, group=group.name)
        label = "/metadata/labels/" + _pointer(names.LABEL_DRAINING)
        for pod in group.pods.values():
            patched = await self.kube.patch_pod(
                namespace=namespace,
                name=pod["metadata"]["name"],
                json_patch=[{"op": "add", "path": label, "value": "true"}],
            )
            self.cache.pods[_key(patched)] = patched
        if group.service is not None:
            since = datetime.now(UTC).isoformat()
            patched = await self.kube.patch_service(
                namespace=namespace,
                name=group.name,
                json_patch=_annotate(
                    group.service,
                    {names.ANNOTATION_DRAINING_SINCE: since, names.ANNOTATION_DRAINING_REASON: reason},
                ),
            )
            self.cache.services[(namespace, group.name)] = patched
        logger.info("draining group %s (%s)", group.name, reason, extra=context)
        await self.kube.post_event(
            owner=body,
            type="Normal",
            reason="Draining",
            message=f"group {group.name} drains before removal ({reason}): the router sends it no new "
            "requests; it goes once those in flight end",
        )

    async def _undrain(self, namespace: str, name: str, group: ObservedGroup, reason: str) -> None:
        """Take a draining group back: the label goes (the routers send it requests again), then
        the drain record on its Service."""
        label = "/metadata/labels/" + _pointer(names.LABEL_DRAINING)
        for pod in group.pods.values():
            if names.LABEL_DRAINING not in pod.get("metadata", {}).get("labels", {}):
                continue
            patched = await self.kube.patch_pod(
                namespace=namespace,
                name=pod["metadata"]["name"],
                json_patch=[{"op": "remove", "path": label}],
            )
            self.cache.pods[_key(patched)] = patched
        if group.service is not None:
            present = group.service.get("metadata", {}).get("annotations", {})
            patched = await self.kube.patch_service(
                namespace=namespace,
                name=group.name,
                json_patch=[
                    {"op": "remove", "path": "/metadata/annotations/" + _pointer(key)}
                    for key in (names.ANNOTATION_DRAINING_SINCE, names.ANNOTATION_DRAINING_REASON)
                    if key in present
                ],
            )
            self.cache.services[(namespace, group.name)] = patched
        logger.info(
            "took back draining group %s (%s)",
            group.name,
            reason,
            extra=_context(namespace, name, role=group.role.value, group=group.name),
        )

    async def _remove(self, namespace: str, name: str, group: ObservedGroup, reason: str) -> None:
        context = _context(namespace, name, role=group.role.value, group=group.name)
        logger.info("removing group %s (%s)", group.name, reason, extra=context)
        await self._delete_pods(namespace, group.pods.values(), grace_period_s=None)
        await self.kube.delete("Service", namespace=namespace, name=group.name)
        self.cache.services.pop((namespace, group.name), None)

    async def _record(self, deployment: InferenceDeployment, layout: GroupLayout) -> bool:
        """Write a new placement on the group's Service; False when another placement is there."""
        service = children.group_service(deployment, layout)
        key = _key(service)
        existing = self.cache.services.get(key)
        if existing is None:
            created = await self.kube.create(service)
            if created is None:
                return False  # an earlier run recorded a placement already: the next pass uses it
            self.cache.services[key] = created
        else:
            # Record the new placement only over the cleared one this operator left.
            patched = await self.kube.patch_service(
                namespace=key[0],
                name=key[1],
                json_patch=[
                    {"op": "test", "path": "/metadata/resourceVersion",
                     "value": existing["metadata"]["resourceVersion"]},
                    *_annotate(existing, service["metadata"]["annotations"]),
                ],
            )  # fmt: skip
            self.cache.services[key] = patched
        logger.info(
            "placed %s on %s (%s), cost %.3f",
            key[1],
            layout.domain or "several domains",
            ", ".join(f"{node}×{gpus}" for node, gpus in layout.pods),
            layout.cost,
            extra=_context(key[0], deployment.metadata.name, role=layout.role.value, group=key[1]),
        )
        return True

    async def _create_pods(
        self,
        deployment: InferenceDeployment,
        layout: GroupLayout,
        cold_start_source: str | None,
        cold_start_ranks: int | None,
        *,
        image: str,
    ) -> None:
        """Create the gang's missing pods (engine ``image``), gated; once every one of them is known
        to exist (created now, or already in the cache), release the gates in the same pass."""
        namespace, name = str(deployment.metadata.namespace), deployment.metadata.name
        uid = str(deployment.metadata.uid)
        group = names.group_name(name, layout.role, layout.replica)
        if children.mpi_world(deployment, layout):
            # Generated only when this process has not seen it exist; never logged.
            await self._create_once(
                {"kind": "Secret", "metadata": {"namespace": namespace, "name": names.ssh_secret_name(name)}},
                deployment=name,
                owner=uid,
                make=lambda: multinode.ssh_secret(deployment, owner=children.owner_reference(deployment)),
            )
        channel = None
        service = self.cache.services.get((namespace, group))
        if service is not None:
            # Applied with the pods: a restarted gang may have another pod count.
            await self.kube.apply(children.group_disruption_budget(deployment, layout, service=service))
        wanted = multinode.wants_compute_domain(deployment, pods=layout.pods, domain=layout.domain)
        if wanted and self.compute_domains_served and service is not None:
            restarts = int(service["metadata"].get("annotations", {}).get(names.ANNOTATION_RESTARTS, 0))
            domain = multinode.compute_domain(
                name=names.compute_domain_name(group, restarts),
                namespace=namespace,
                labels=children.group_labels(deployment, layout),
                owner=children.service_owner_reference(service),
                num_nodes=len(layout.pods),
            )
            await self._create_once(
                domain, deployment=name, owner=service["metadata"]["uid"], make=lambda: domain
            )
            channel = names.channel_template_name(domain["metadata"]["name"])
        pods = children.worker_pods(
            deployment,
            layout,
            cold_start_source=cold_start_source,
            cold_start_ranks=cold_start_ranks,
            channel_template=channel,
            images=self.settings.images,
            image=image,
        )
        members: list[Mapping[str, Any]] = []
        for pod in pods:
            known = self.cache.pods.get(_key(pod))
            if known is None:
                known = await self.kube.create(pod)
                if known is None:
                    continue  # it exists but we have not seen it yet: the next pass releases the gang
                self.cache.pods[_key(known)] = known
            members.append(known)
        context = _context(namespace, name, role=layout.role.value, group=group)
        logger.info("created gated pods of %s", group, extra=context)
        if len(members) == len(pods):
            await self._lift_gates(namespace, name, layout.role, group, members)

    async def _create_once(
        self, ref: Mapping[str, Any], *, deployment: str, owner: str, make: Callable[[], Mapping[str, Any]]
    ) -> None:
        """Create the object ``ref`` names (kind, namespace, name) from ``make()`` unless this process
        already knows it exists for this ``owner`` (uid); an existing one is left as it is."""
        meta = ref["metadata"]
        key = (ref["kind"], meta["namespace"], meta["name"], owner)
        if key in self._created:
            return
        created = await self.kube.create(make())
        if created is not None:
            logger.info(
                "created %s %s", ref["kind"], meta["name"], extra=_context(meta["namespace"], deployment)
            )
        self._created.add(key)

    async def _lift_gates(
        self, namespace: str, name: str, role: Role, group: str, members: Iterable[Mapping[str, Any]]
    ) -> None:
        for member in members:
            if member.get("spec", {}).get("schedulingGates"):
                lifted = await self.kube.patch_pod(
                    namespace=namespace,
                    name=member["metadata"]["name"],
                    json_patch=[{"op": "remove", "path": "/spec/schedulingGates"}],
                )
                self.cache.pods[_key(lifted)] = lifted
        context = _context(namespace, name, role=role.value, group=group)
        logger.info("gang %s complete; released its scheduling gates", group, extra=context)

    async def _delete_pods(
        self, namespace: str, pods: Iterable[Mapping[str, Any]], *, grace_period_s: int | None
    ) -> None:
        for pod in pods:
            await self.kube.delete(
                "Pod", namespace=namespace, name=pod["metadata"]["name"], grace_period_s=grace_period_s
            )
            # Write-through: the next pass must not see this pod as alive and restart it again.
            self.cache.pods.pop(_key(pod), None)


def _pointer(key: str) -> str:
    """``key`` as one JSON-pointer segment (label and annotation keys hold slashes)."""
    return key.replace("~", "~0").replace("/", "~1")


def _annotate(obj: Mapping[str, Any], annotations: Mapping[str, str]) -> list[dict[str, Any]]:
    existing = obj.get("metadata", {}).get("annotations")
    operations: list[dict[str, Any]] = []
    if existing is None:
        operations.append({"op": "add", "path": "/metadata/annotations", "value": {}})
    for key, value in annotations.items():
        path = "/metadata/annotations/" + _pointer(key)
        operations.append({"op": "add", "path": path, "value": value})
    return operations


def _changed(before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    return any(before.get(key) != value for key, value in after.items())


def _add_condition(
    decision: Decision, body: Mapping[str, Any], kind: str, ok: bool, *, reason: str, message: str
) -> None:
    """Add condition ``kind`` to the status this pass writes (its transition time carried over from
    the ``body``'s conditions while its status stays)."""
    decision.status["conditions"].append(
        condition(
            kind,
            ok,
            reason=reason,
            message=message,
            generation=body["metadata"].get("generation"),
            now=datetime.now(UTC),
            previous=body.get("status", {}).get("conditions", []),
        )
    )
