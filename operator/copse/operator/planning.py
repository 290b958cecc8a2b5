"""The operator's view of the placement engine for one reconcile pass.

Built once per pass: the topology is the live nodes minus every GPU held by pods that are not
this deployment's staying groups, so the engine sees exactly the room it may use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from copse.api import AffinityPolicy, AntiAffinityPolicy, InferenceDeployment, Role
from copse.operator import names
from copse.operator.children import GroupLayout
from copse.placement import (
    GroupPlacement,
    GroupRequest,
    PlacementRequest,
    Plan,
    Pod,
    choose_victims,
    evaluate,
    plan,
)
from copse.topology import Topology, build_topology
from copse.topology.kube import Toleration

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
        self.topology: Topology = build_topology(list(nodes), pods=foreign)
        spec = deployment.spec
        self._shapes = {pool.role: pool for pool in spec.pools()}
        self._tolerations = tuple(
            Toleration.from_dict(t.model_dump(mode="json", exclude_none=True)) for t in spec.pod.tolerations
        )
        self._node_selector = tuple(sorted(spec.pod.node_selector.items()))

    def _request(self, keys: Iterable[GroupKey]) -> PlacementRequest:
        spec = self.deployment.spec
        groups = []
        for role, replica in sorted(set(keys), key=lambda key: (key[0].value, key[1])):
            shape = self._shapes[role]
            groups.append(
                GroupRequest(
                    role=role.value,
                    replica=replica,
                    tensor_parallelism=shape.tensor_parallelism,
                    pipeline_parallelism=shape.pipeline_parallelism,
                    tolerations=self._tolerations,
                    node_selector=self._node_selector,
                )
            )
        return PlacementRequest(
            groups=tuple(groups),
            same_domain=spec.placement.affinity_policy is AffinityPolicy.SAME_NVSWITCH_DOMAIN,
            spread_racks=spec.placement.anti_affinity_policy is AntiAffinityPolicy.SPREAD_ACROSS_RACKS,
        )

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

    def evaluate(self, layouts: Sequence[GroupLayout], *, unplaced: Sequence[GroupKey] = ()) -> Plan:
        """Score and per-group cost of ``layouts``; ``unplaced`` groups count as placed nowhere."""
        keys = [*unplaced, *((layout.role, layout.replica) for layout in layouts)]
        return evaluate(self.topology, self._request(keys), [_placement(layout) for layout in layouts])
