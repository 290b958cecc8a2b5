"""What exists in the cluster for one InferenceDeployment, read back from its objects (pure).

The operator keeps no state of its own: a group is its headless Service (which records the
planned placement and the restart history) plus its pods. Reading them back is what makes a
restarted operator carry on where the last one stopped.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from copse.api import Role
from copse.operator import names
from copse.operator.children import GroupLayout


class GroupState(enum.Enum):
    PLANNED = "planned"  # placement recorded, pods missing: create them
    GATED = "gated"  # every pod exists, some still gated: lift the gates
    STARTING = "starting"  # ungated, not every pod Ready yet
    READY = "ready"
    BROKEN = "broken"  # a rank failed or vanished, or its node can no longer hold it: restart the gang
    UNPLACED = "unplaced"  # the gang was torn down (or never placed): place it again
    DRAINING = "draining"  # being removed: the router sends it nothing new; wait for in-flight ones
    TERMINATING = "terminating"  # its pods are going away; wait


@dataclasses.dataclass(frozen=True, kw_only=True)
class ObservedGroup:
    name: str
    role: Role
    replica: int
    service: Mapping[str, Any] | None
    pods: Mapping[int, Mapping[str, Any]]
    """Pods by rank."""
    layout: GroupLayout | None
    """The recorded placement, if the group currently has one."""
    template_hash: str | None
    template: Mapping[str, Any] | None
    """The template inputs the group was made from (None for groups made before they were recorded)."""
    restarts: int
    last_restart: datetime | None
    state: GroupState
    reason: str = ""
    """Why the group is BROKEN (for the Event and the log), or why it drains."""
    draining_since: datetime | None = None
    """When it started to drain (DRAINING)."""

    @property
    def nodes(self) -> list[str]:
        return [node for node, _ in self.layout.pods] if self.layout else []


def pod_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status", {})
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))


def _terminating(obj: Mapping[str, Any]) -> bool:
    return bool(obj.get("metadata", {}).get("deletionTimestamp"))


def _layout(service: Mapping[str, Any], *, role: Role, replica: int) -> GroupLayout | None:
    annotations = service.get("metadata", {}).get("annotations", {})
    recorded = annotations.get(names.ANNOTATION_PLACEMENT)
    if not recorded:
        return None
    pods = json.loads(recorded)
    return GroupLayout(
        role=role,
        replica=replica,
        pods=tuple((pod["node"], int(pod["gpus"])) for pod in pods),
        domain=annotations.get(names.ANNOTATION_DOMAIN),
        rack=annotations.get(names.ANNOTATION_RACK),
        cost=float(annotations.get(names.ANNOTATION_COST, 0.0)),
    )


def _classify(
    *,
    layout: GroupLayout | None,
    service: Mapping[str, Any] | None,
    pods: Mapping[int, Mapping[str, Any]],
) -> tuple[GroupState, str]:
    if (service is not None and _terminating(service)) or any(_terminating(pod) for pod in pods.values()):
        return GroupState.TERMINATING, ""
    annotations = (service or {}).get("metadata", {}).get("annotations", {})
    if annotations.get(names.ANNOTATION_DRAINING_SINCE):
        return GroupState.DRAINING, annotations.get(names.ANNOTATION_DRAINING_REASON, "")
    if layout is None:
        return (GroupState.BROKEN, "its placement record is gone") if pods else (GroupState.UNPLACED, "")
    for rank, pod in sorted(pods.items()):
        phase = pod.get("status", {}).get("phase")
        if phase in {"Failed", "Succeeded"}:
            return GroupState.BROKEN, f"pod {pod['metadata']['name']} (rank {rank}) {phase.lower()}"
    missing = [rank for rank in range(len(layout.pods)) if rank not in pods]
    gated = [rank for rank, pod in pods.items() if pod.get("spec", {}).get("schedulingGates")]
    if missing:
        # Once any rank was released, the gang was whole: a missing rank now is a lost rank.
        if len(gated) < len(pods):
            return GroupState.BROKEN, f"rank {missing[0]} was deleted"
        return GroupState.PLANNED, ""
    if gated:
        return GroupState.GATED, ""
    if all(pod_ready(pod) for pod in pods.values()):
        return GroupState.READY, ""
    return GroupState.STARTING, ""


def observe_groups(
    *,
    deployment: str,
    services: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
) -> list[ObservedGroup]:
    """The TP groups of ``deployment`` as they stand, from its group Services and worker pods.

    Whether their nodes still hold them is the placement engine's call (``Placer.invalid``)."""
    services_by_group: dict[str, Mapping[str, Any]] = {}
    pods_by_group: dict[str, dict[int, Mapping[str, Any]]] = {}
    identity: dict[str, tuple[Role, int]] = {}
    for obj, is_service in [(s, True) for s in services] + [(p, False) for p in pods]:
        labels = obj.get("metadata", {}).get("labels", {})
        if labels.get(names.LABEL_DEPLOYMENT) != deployment or names.LABEL_GROUP not in labels:
            continue
        group = labels[names.LABEL_GROUP]
        identity[group] = (Role(labels[names.LABEL_ROLE]), int(labels[names.LABEL_REPLICA]))
        if is_service:
            services_by_group[group] = obj
        else:
            pods_by_group.setdefault(group, {})[int(labels[names.LABEL_RANK])] = obj
    observed = []
    for group, (role, replica) in sorted(identity.items(), key=lambda item: (item[1][0].value, item[1][1])):
        service = services_by_group.get(group)
        group_pods = pods_by_group.get(group, {})
        layout = _layout(service, role=role, replica=replica) if service else None
        annotations = (service or {}).get("metadata", {}).get("annotations", {})
        last_restart = annotations.get(names.ANNOTATION_LAST_RESTART)
        draining_since = annotations.get(names.ANNOTATION_DRAINING_SINCE)
        state, reason = _classify(layout=layout, service=service, pods=group_pods)
        observed.append(
            ObservedGroup(
                name=group,
                role=role,
                replica=replica,
                service=service,
                pods=group_pods,
                layout=layout,
                template_hash=annotations.get(names.ANNOTATION_TEMPLATE_HASH),
                template=json.loads(annotations[names.ANNOTATION_TEMPLATE])
                if names.ANNOTATION_TEMPLATE in annotations
                else None,
                restarts=int(annotations.get(names.ANNOTATION_RESTARTS, 0)),
                last_restart=datetime.fromisoformat(last_restart) if last_restart else None,
                state=state,
                reason=reason,
                draining_since=datetime.fromisoformat(draining_since) if draining_since else None,
            )
        )
    return observed
