"""An InferenceDeployment spec as a placement request (the one place placement meets the CRD)."""

from __future__ import annotations

from copse.api.v1alpha1 import AffinityPolicy, AntiAffinityPolicy, InferenceDeploymentSpec
from copse.placement.model import GroupRequest, PlacementRequest, pool
from copse.topology.kube import Toleration


def request_from_spec(spec: InferenceDeploymentSpec) -> PlacementRequest:
    """Groups ``<role>-0 .. <role>-(replicas-1)`` of every pool, with the pods' tolerations and
    node selector, and the placement policies."""
    tolerations = [
        Toleration(
            key=toleration.key or "",
            operator=toleration.operator,
            value=toleration.value or "",
            effect=toleration.effect or "",
        )
        for toleration in spec.pod.tolerations
    ]
    groups: tuple[GroupRequest, ...] = ()
    for group_pool in spec.pools():
        groups += pool(
            role=group_pool.role.value,
            replicas=group_pool.replicas,
            tensor_parallelism=group_pool.tensor_parallelism,
            pipeline_parallelism=group_pool.pipeline_parallelism,
            tolerations=tolerations,
            node_selector=spec.pod.node_selector,
        )
    return PlacementRequest(
        groups=groups,
        same_domain=spec.placement.affinity_policy == AffinityPolicy.SAME_NVSWITCH_DOMAIN,
        spread_racks=spec.placement.anti_affinity_policy == AntiAffinityPolicy.SPREAD_ACROSS_RACKS,
    )
