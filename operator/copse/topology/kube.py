"""Reading the few fields of Node and Pod objects (plain dicts, as the API returns them) that
topology needs, with Kubernetes' own semantics for taints, tolerations and resource requests.
Odd values never raise: they degrade (a GPU count that is not a number counts as zero)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
"""Taint effects that keep a pod off a node; PreferNoSchedule is only a preference."""
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
"""Pods in these phases hold no resources."""

_INTEGER = re.compile(r"^\s*(\d+)\s*$")


@dataclass(frozen=True, kw_only=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"

    def __str__(self) -> str:
        value = f"={self.value}" if self.value else ""
        return f"{self.key}{value}:{self.effect}"


@dataclass(frozen=True, kw_only=True)
class Toleration:
    """A pod toleration; matching follows the Kubernetes API reference."""

    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.operator == "Exists":
            return not self.key or self.key == taint.key
        return self.key == taint.key and self.value == taint.value

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Toleration:
        return cls(
            key=str(data.get("key") or ""),
            operator=str(data.get("operator") or "Equal"),
            value=str(data.get("value") or ""),
            effect=str(data.get("effect") or ""),
        )


def tolerated(taint: Taint, tolerations: Iterable[Toleration]) -> bool:
    return any(toleration.tolerates(taint) for toleration in tolerations)


def _mapping(value: Any) -> Mapping[str, Any]:
    # dict, not the Mapping ABC: API objects are dicts and the ABC check is slow at 10k nodes.
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def metadata(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return _mapping(obj.get("metadata"))


def labels(obj: Mapping[str, Any]) -> dict[str, str]:
    """String-valued labels (anything else is dropped: labels are strings in the API)."""
    return {str(k): v for k, v in _mapping(metadata(obj).get("labels")).items() if isinstance(v, str)}


def whole_quantity(value: Any) -> int:
    """An integer resource quantity such as ``4`` or ``"4"``; anything else counts as 0.

    Extended resources like ``nvidia.com/gpu`` are whole numbers in Kubernetes.
    """
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return max(value, 0)
    if isinstance(value, float) and value.is_integer():
        return max(int(value), 0)
    if isinstance(value, str):
        match = _INTEGER.match(value)
        if match:
            return int(match.group(1))
    return 0


def node_taints(node: Mapping[str, Any]) -> tuple[Taint, ...]:
    taints = []
    for item in _list(_mapping(node.get("spec")).get("taints")):
        if isinstance(item, dict) and item.get("key"):
            taints.append(
                Taint(
                    key=str(item["key"]),
                    value=str(item.get("value") or ""),
                    effect=str(item.get("effect") or "NoSchedule"),
                )
            )
    return tuple(taints)


def node_cordoned(node: Mapping[str, Any]) -> bool:
    return _mapping(node.get("spec")).get("unschedulable") is True


def node_ready(node: Mapping[str, Any]) -> bool:
    """False only when a Ready condition says so: a hand-written node with no status is usable."""
    for condition in _list(_mapping(node.get("status")).get("conditions")):
        if isinstance(condition, dict) and condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return True


NODE_CONDITION_TAINTS = frozenset({"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"})
"""Taints the node controller adds to a NotReady or unreachable node."""


def _timestamp(value: Any) -> float:
    """Seconds since the epoch of an RFC 3339 time; 0 (long ago) when missing or unreadable."""
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    return 0.0


def node_not_ready_since(node: Mapping[str, Any]) -> float | None:
    """When the node stopped being usable (s since the epoch), or None while it is Ready.

    The earliest of its Ready condition's last transition (when not True) and the ``timeAdded``
    of the node controller's NotReady/unreachable ``NoExecute`` taints; a time that is missing
    counts as long ago (a hand-written NotReady node has been so for as long as anyone knows)."""
    since: list[float] = []
    for condition in _list(_mapping(node.get("status")).get("conditions")):
        if not isinstance(condition, dict) or condition.get("type") != "Ready":
            continue
        if condition.get("status") != "True":
            since.append(_timestamp(condition.get("lastTransitionTime")))
    for taint in _list(_mapping(node.get("spec")).get("taints")):
        if (
            isinstance(taint, dict)
            and taint.get("key") in NODE_CONDITION_TAINTS
            and taint.get("effect") == "NoExecute"
        ):
            since.append(_timestamp(taint.get("timeAdded")))
    return min(since, default=None)


def allocatable(node: Mapping[str, Any], resource: str) -> int:
    return whole_quantity(_mapping(_mapping(node.get("status")).get("allocatable")).get(resource))


def _container_request(container: Any, resource: str) -> int:
    resources = _mapping(_mapping(container).get("resources"))
    requests = _mapping(resources.get("requests"))
    if resource in requests:
        return whole_quantity(requests[resource])
    # Extended resources: a limit without a request means request = limit.
    return whole_quantity(_mapping(resources.get("limits")).get(resource))


def pod_request(pod: Mapping[str, Any], resource: str) -> int:
    """What the scheduler charges a pod: max(sum over containers, largest init container)."""
    spec = _mapping(pod.get("spec"))
    containers = sum(_container_request(c, resource) for c in _list(spec.get("containers")))
    init = max((_container_request(c, resource) for c in _list(spec.get("initContainers"))), default=0)
    return max(containers, init)


def pod_node(pod: Mapping[str, Any]) -> str | None:
    """The node a non-terminated pod is bound to, or None (pending or finished pods hold nothing)."""
    if _mapping(pod.get("status")).get("phase") in TERMINAL_PHASES:
        return None
    node = _mapping(pod.get("spec")).get("nodeName")
    return node if isinstance(node, str) and node else None
