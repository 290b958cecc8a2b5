"""The operator's view of the placement engine for one reconcile pass.

Built once per pass: the topology is the live nodes minus every GPU held by pods that are not
this deployment's staying groups, so the engine sees exactly the room it may use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from copse.api import InferenceDeployment, Role
from copse.operator import names
from copse.operator.children import GroupLayout
from copse.placement import (
    GroupPlacement,
    PlacementRequest,
    Plan,
    Pod,
    choose_victims,
    evaluate,
    invalid_groups,
    plan,
    unready_groups,
)
from copse.placement.spec import request_from_spec
from copse.topology import Topology, build_topology

GroupKey = tuple[Role, int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outcome:
    placed: list[GroupLayout]
    unplaced: list[tuple[Role, int, str]]


def _placement(layout: GroupLayout) -> GroupPlacement:
    return GroupPlacement(
        role=layout.role.value,
        replica=layout.replica,
        pods=tuple(Pod(node=node, gpus=gpus) for node, gpus in layout.pods),
    )


def _pinned(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """``pod`` as bound to its planned node when it is a copse group's pod not yet bound.

    The operator pins each group pod to one node (required affinity on the node's name), so it
    holds that node's GPUs from its creation: without this, deployments reconciled one after
    another before the scheduler binds count the same GPUs free, over-commit the node and then
    restart each other's gangs (seen with 100 deployments placed at once)."""
    spec = pod.get("spec", {})
    if spec.get("nodeName") or names.LABEL_GROUP not in pod.get("metadata", {}).get("labels", {}):
        return pod
    affinity = spec.get("affinity", {}).get("nodeAffinity", {})
    terms = affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])
    planned = {
        value
        for term in terms
        for field in term.get("matchFields", [])
        if field.get("key") == "metadata.name" and field.get("operator") == "In"
        for value in field.get("values", [])
    }
    if len(planned) != 1:
        return pod
    return {**pod, "spec": {**spec, "nodeName": planned.pop()}}


class Placer:
    def __init__(
        self,
        *,
        deployment: InferenceDeployment,
        nodes: Iterable[Mapping[str, Any]],
        pods: Iterable[Mapping[str, Any]],
        staying: Iterable[str],
    ) -> None:
        """``staying``: names of this deployment's groups that keep their placement this pass."""
        self.deployment = deployment
        keep = set(staying)
        namespace = deployment.metadata.namespace
        foreign = [
            pod
            for pod in pods
            if not (
                pod.get("metadata", {}).get("namespace") == namespace
                and pod.get("metadata", {}).get("labels", {}).get(names.LABEL_GROUP) in keep
            )
        ]
        self.topology: Topology = build_topology(list(nodes), pods=[_pinned(pod) for pod in foreign])

    def _request(self, keys: Iterable[GroupKey]) -> PlacementRequest:
        replicas: dict[Role, set[int]] = {}
        for role, replica in keys:
            replicas.setdefault(role, set()).add(replica)
        return request_from_spec(self.deployment.spec, replicas=replicas)

    def place(self, *, requests: Sequence[GroupKey], existing: Sequence[GroupLayout]) -> Outcome:
        """Place ``requests`` next to the ``existing`` groups, which stay where they are."""
        if not requests:
            return Outcome(placed=[], unplaced=[])
        keys = [*requests, *((layout.role, layout.replica) for layout in existing)]
        result = plan(
            self.topology, self._request(keys), existing=[_placement(layout) for layout in existing]
        )
        wanted = set(requests)
        placed = [
            GroupLayout(
                role=Role(group.role),
                replica=group.replica,
                pods=tuple((pod.node, pod.gpus) for pod in group.pods),
                domain=group.domain,
                rack=group.rack,
                cost=group.cost.total,
            )
            for group in result.groups
            if (Role(group.role), group.replica) in wanted
        ]
        unplaced = [(Role(item.role), item.replica, item.reason) for item in result.unplaced]
        return Outcome(placed=placed, unplaced=unplaced)

    def victims(self, *, role: Role, layouts: Sequence[GroupLayout], count: int) -> list[int]:
        """Replica indices of the ``count`` groups of ``role`` whose removal frees the most."""
        if count <= 0:
            return []
        keys = [(layout.role, layout.replica) for layout in layouts]
        chosen = choose_victims(
            self.topology,
            self._request(keys),
            [_placement(layout) for layout in layouts],
            role=role.value,
            count=count,
        )
        return [replica for _, replica in chosen]

    def invalid(self, layouts: Sequence[GroupLayout]) -> dict[GroupKey, str]:
        """Groups that can no longer run where they are (node gone, evicting taint, GPUs taken),
        with the reason: their gangs restart whole. Cordoned nodes keep their groups."""
        keys = [(layout.role, layout.replica) for layout in layouts]
        broken = invalid_groups(
            self.topology, self._request(keys), [_placement(layout) for layout in layouts]
        )
        return {(Role(role), replica): reason for (role, replica), reason in broken.items()}

    def unready(self, layouts: Sequence[GroupLayout]) -> dict[GroupKey, tuple[str, float]]:
        """Groups with a pod on a NotReady or unreachable node: that node and since when (s since
        the epoch); they restart only once the deployment's grace has passed."""
        found = unready_groups(self.topology, [_placement(layout) for layout in layouts])
        return {(Role(role), replica): where for (role, replica), where in found.items()}

    def not_ready_since(self, node: str) -> float | None:
        """Since when (s since the epoch) ``node`` has been NotReady or unreachable; None when it
        is Ready or unknown."""
        info = self.topology.nodes.get(node)
        return None if info is None else info.not_ready_since

    def cordoned(self, layouts: Sequence[GroupLayout]) -> dict[GroupKey, str]:
        """Groups with a pod on a cordoned node, and that node: they keep running there."""
        found: dict[GroupKey, str] = {}
        for layout in layouts:
            for node, _ in layout.pods:
                info = self.topology.nodes.get(node)
                if info is not None and info.cordoned:
                    found[(layout.role, layout.replica)] = node
                    break
        return found

    def evaluate(self, layouts: Sequence[GroupLayout], *, unplaced: Sequence[GroupKey] = ()) -> Plan:
        """Score and per-group cost of ``layouts``; ``unplaced`` groups count as placed nowhere."""
        keys = [*unplaced, *((layout.role, layout.replica) for layout in layouts)]
        return evaluate(self.topology, self._request(keys), [_placement(layout) for layout in layouts])
