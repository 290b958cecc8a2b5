"""An in-memory stand-in for the API server, scheduler and kubelet, for fast controller tests.

It implements the operator's ``Kube`` calls on dicts and a ``kubelet()`` step that binds
ungated pods to their required node and makes them Running and Ready, so a test can drive
the real Controller pass by pass. The e2e suite runs the same scenarios on a real cluster.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from typing import Any

from kubernetes.aio.client.exceptions import ApiException

from copse.operator.controller import Controller
from copse.operator.kube import Refused

Key = tuple[str, str, str]  # kind, namespace, name
_versions = itertools.count(1)


def _pointer(path: str) -> list[str]:
    return [part.replace("~1", "/").replace("~0", "~") for part in path.lstrip("/").split("/")]


def json_patch(obj: dict[str, Any], operations: list[dict[str, Any]]) -> None:
    for operation in operations:
        *parents, last = _pointer(operation["path"])
        target: Any = obj
        for part in parents:
            target = target[part]
        if operation["op"] == "test":
            assert target[last] == operation["value"], f"test failed at {operation['path']}"
        elif operation["op"] == "add":
            target[last] = copy.deepcopy(operation["value"])
        elif operation["op"] == "remove":
            del target[last]
        else:
            raise AssertionError(f"unsupported op {operation['op']}")


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.nodes: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[str, str, str]] = []
        self.deletions: list[tuple[str, str, int | None]] = []
        self.calls: list[tuple[str, str]] = []
        """(verb and kind, name) of every create and patch, in order."""
        self.created_pods: list[dict[str, Any]] = []
        """Pod bodies as the operator sent them to create."""
        self.served_apis: set[tuple[str, str, str]] = set()
        """(group, version, plural) that discovery reports beyond the built-in ones."""
        self.refused: dict[str, tuple[int, str]] = {}
        """Kind -> (HTTP status, why) the API server refuses to apply objects of it (403: a missing
        RBAC grant; 404: its CRD is not served yet)."""
        self.failing: dict[str, int] = {}
        """Kind -> the HTTP status every read, apply and delete of it fails with (a 5xx, a 409)."""
        self.failing_status = 0
        """How many of the next status patches fail (the API server is briefly unreachable)."""

    def _fail(self, kind: str) -> None:
        if kind in self.failing:
            raise ApiException(status=self.failing[kind], reason="injected")

    def _store(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        stored = copy.deepcopy(dict(obj))
        meta = stored["metadata"]
        meta["resourceVersion"] = str(next(_versions))
        meta.setdefault("uid", f"uid-{meta['name']}")
        self.objects[(stored["kind"], meta["namespace"], meta["name"])] = stored
        return copy.deepcopy(stored)

    def to_dict(self, model: Any) -> dict[str, Any]:
        return dict(model)

    async def apply(self, obj: Mapping[str, Any]) -> None:
        meta = obj["metadata"]
        self._fail(obj["kind"])
        if obj["kind"] in self.refused:
            status, why = self.refused[obj["kind"]]
            raise Refused(f"{obj['kind']} {meta['namespace']}/{meta['name']}: {why}", status=status)
        current = self.objects.get((obj["kind"], meta["namespace"], meta["name"]))
        if current is not None:
            unchanged = {**current, "metadata": {**current["metadata"]}}
            unchanged["metadata"].pop("resourceVersion")
            unchanged["metadata"].pop("uid")
            if unchanged == obj:
                return  # server-side apply of an identical object is a no-op
        self._store(obj)

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        meta = obj["metadata"]
        self.calls.append((f"create {obj['kind']}", meta["name"]))
        if obj["kind"] == "Pod":
            self.created_pods.append(copy.deepcopy(dict(obj)))
        if (obj["kind"], meta["namespace"], meta["name"]) in self.objects:
            return None
        return self._store(obj)

    async def read(self, kind: str, *, namespace: str, name: str) -> dict[str, Any] | None:
        self._fail(kind)
        found = self.objects.get((kind, namespace, name))
        return None if found is None else copy.deepcopy(found)

    async def delete(
        self, kind: str, *, namespace: str, name: str, grace_period_s: int | None = None
    ) -> None:
        self._fail(kind)
        if self.objects.pop((kind, namespace, name), None) is not None:
            self.deletions.append((kind, name, grace_period_s))

    async def _patch(self, kind: str, namespace: str, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        self.calls.append((f"patch {kind}", name))
        obj = copy.deepcopy(self.objects[(kind, namespace, name)])
        json_patch(obj, ops)
        return self._store(obj)

    async def patch_pod(
        self, *, namespace: str, name: str, json_patch: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return await self._patch("Pod", namespace, name, json_patch)

    async def patch_service(
        self, *, namespace: str, name: str, json_patch: list[dict[str, Any]]
    ) -> dict[str, Any]:
        return await self._patch("Service", namespace, name, json_patch)

    async def patch_status(self, *, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        if self.failing_status:
            self.failing_status -= 1
            raise RuntimeError("status patch failed")
        body = self.objects[("InferenceDeployment", namespace, name)]
        body["status"] = {**body.get("status", {}), **copy.deepcopy(dict(status))}

    async def patch_spec(
        self, *, namespace: str, name: str, spec: Mapping[str, Any], resource_version: str | None
    ) -> bool:
        self.calls.append(("patch InferenceDeployment", name))
        body = self.objects.get(("InferenceDeployment", namespace, name))
        if body is None or resource_version not in (None, body["metadata"].get("resourceVersion")):
            return False
        body["spec"] = {**body["spec"], **copy.deepcopy(dict(spec))}
        body["metadata"]["generation"] = body["metadata"].get("generation", 0) + 1
        body["metadata"]["resourceVersion"] = str(next(_versions))
        return True

    async def post_event(self, *, owner: Mapping[str, Any], type: str, reason: str, message: str) -> None:
        self.events.append((type, reason, message))

    async def served(self, *, group: str, version: str, plural: str) -> bool:
        return (group, version, plural) in self.served_apis

    async def list_all(
        self, resource: str, *, label_selector: str | None = None, namespace: str | None = None
    ) -> list[dict[str, Any]]:
        kinds = {
            "nodes": "Node",
            "pods": "Pod",
            "services": "Service",
            "inferencedeployments": "InferenceDeployment",
        }
        if resource == "nodes":
            return [copy.deepcopy(node) for node in self.nodes.values()]
        return [
            copy.deepcopy(obj)
            for obj in self.of_kind(kinds[resource])
            if namespace is None or obj["metadata"]["namespace"] == namespace
        ]

    # -- what the rest of Kubernetes would do --------------------------------------------------

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [obj for (k, _, _), obj in self.objects.items() if k == kind]

    def kubelet(self) -> None:
        """Bind every ungated, unbound pod to its required node and run it."""
        for pod in self.of_kind("Pod"):
            spec = pod["spec"]
            if spec.get("schedulingGates") or spec.get("nodeName"):
                continue
            terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            [node] = terms["nodeSelectorTerms"][0]["matchFields"][0]["values"]
            if node not in self.nodes:
                continue
            spec["nodeName"] = node
            pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}

    def sync(self, controller: Controller) -> None:
        """Feed the controller's cache as its watches would."""
        cache = controller.cache
        cache.nodes = copy.deepcopy(self.nodes)
        cache.pods = {
            (p["metadata"]["namespace"], p["metadata"]["name"]): copy.deepcopy(p) for p in self.of_kind("Pod")
        }
        cache.services = {
            (s["metadata"]["namespace"], s["metadata"]["name"]): copy.deepcopy(s)
            for s in self.of_kind("Service")
            if "copse.dev/group" in s["metadata"].get("labels", {})
        }
        cache.deployments = {
            (d["metadata"]["namespace"], d["metadata"]["name"]): copy.deepcopy(d)
            for d in self.of_kind("InferenceDeployment")
        }
