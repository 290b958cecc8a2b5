"""An InferenceDeployment spec as a placement request (the one place placement meets the CRD)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from copse.api.v1alpha1 import AffinityPolicy, AntiAffinityPolicy, InferenceDeploymentSpec, Role
from copse.placement.model import ExpertParallel, GroupRequest, PlacementRequest
from copse.topology.kube import Toleration


def request_from_spec(
    spec: InferenceDeploymentSpec, *, replicas: Mapping[Role, Iterable[int]] | None = None
) -> PlacementRequest:
    """The groups of every pool, with the pods' tolerations and node selector, and the
    placement policies.

    ``replicas`` names the replica indices per role (a running deployment's groups need not be
    numbered ``0 .. n-1``: a rolling update adds one at a free index); by default every pool's
    groups are ``<role>-0 .. <role>-(replicas-1)``.
    """
    tolerations = tuple(
        Toleration(
            key=toleration.key or "",
            operator=toleration.operator,
            value=toleration.value or "",
            effect=toleration.effect or "",
        )
        for toleration in spec.pod.tolerations
    )
    node_selector = tuple(sorted(spec.pod.node_selector.items()))
    groups: list[GroupRequest] = []
    for group_pool in spec.pools():
        indices = range(group_pool.replicas) if replicas is None else replicas.get(group_pool.role, ())
        moe = group_pool.moe
        expert_parallel = (
            None
            if moe is None
            else ExpertParallel(
                ranks=moe.expert_parallelism,
                experts_per_token=moe.experts_per_token,
                hidden_size=moe.hidden_size,
                activation_bytes=moe.activation_bytes,
                attention_data_parallel=moe.attention_data_parallel,
            )
        )
        groups += [
            GroupRequest(
                role=group_pool.role.value,
                replica=index,
                tensor_parallelism=group_pool.tensor_parallelism,
                pipeline_parallelism=group_pool.pipeline_parallelism,
                tolerations=tolerations,
                node_selector=node_selector,
                moe=expert_parallel,
            )
            for index in sorted(indices)
        ]
    return PlacementRequest(
        groups=tuple(groups),
        same_domain=spec.placement.affinity_policy == AffinityPolicy.SAME_NVSWITCH_DOMAIN,
        spread_racks=spec.placement.anti_affinity_policy == AntiAffinityPolicy.SPREAD_ACROSS_RACKS,
    )
