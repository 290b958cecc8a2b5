"""What placement is asked (a request of TP groups) and what it answers (a plan).

Plain frozen dataclasses: placement is a pure function of a topology and a request and does
not know the CRD models; ``copse.placement.spec`` turns an InferenceDeployment into a request.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from copse.topology.kube import Toleration

WORKER = "worker"
PREFILL = "prefill"
DECODE = "decode"
KV_COUNTERPART = {PREFILL: DECODE, DECODE: PREFILL}
"""Roles that ship KV caches to each other (disaggregated serving)."""

GroupKey = tuple[str, int]
"""(role, replica): a group's identity."""


@dataclass(frozen=True, kw_only=True)
class ExpertParallel:
    """A Mixture-of-Experts group's expert parallelism: what its all-to-all moves per MoE layer."""

    ranks: int
    """EP size: ranks the experts are spread over (a token's experts lie on other ranks)."""
    experts_per_token: int
    """Experts each token activates (top-K): copies of its activation dispatched per layer."""
    hidden_size: int
    """Elements of one token's activation."""
    activation_bytes: int = 2
    """Bytes per element dispatched (2: BF16)."""
    attention_data_parallel: bool = False
    """Attention runs per rank on its own requests: with EP = TP (the DEP layout) no
    tensor-parallel all-reduce is left."""

    def __post_init__(self) -> None:
        for name in ("ranks", "experts_per_token", "hidden_size", "activation_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"expert parallelism: {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class GroupRequest:
    """One TP group to place: ``tensor_parallelism x pipeline_parallelism`` GPUs, all or none."""

    role: str
    replica: int
    tensor_parallelism: int = 1
    pipeline_parallelism: int = 1
    tolerations: tuple[Toleration, ...] = ()
    """Taints the group's pods tolerate (so may use tainted or cordoned nodes)."""
    node_selector: tuple[tuple[str, str], ...] = ()
    """Labels every node of the group must carry, as sorted (key, value) pairs."""
    moe: ExpertParallel | None = None
    """Set for a Mixture-of-Experts group: its all-to-all is part of its communication cost."""

    def __post_init__(self) -> None:
        if self.moe is not None and self.tensor_parallelism % self.moe.ranks:
            raise ValueError(
                f"group {self.role}-{self.replica}: EP size {self.moe.ranks} must divide "
                f"TP={self.tensor_parallelism}"
            )
        if self.tensor_parallelism < 1 or self.pipeline_parallelism < 1:
            raise ValueError(
                f"group {self.role}-{self.replica}: parallelism must be >= 1, got "
                f"TP={self.tensor_parallelism} PP={self.pipeline_parallelism}"
            )
        if self.replica < 0:
            raise ValueError(f"group {self.role}: replica must be >= 0, got {self.replica}")

    @property
    def gpus(self) -> int:
        return self.tensor_parallelism * self.pipeline_parallelism

    @property
    def key(self) -> GroupKey:
        return (self.role, self.replica)

    @property
    def eligibility(self) -> tuple[tuple[Toleration, ...], tuple[tuple[str, str], ...]]:
        """Groups with the same eligibility may use exactly the same nodes."""
        return (self.tolerations, self.node_selector)

    @property
    def parallel(self) -> tuple[int, int, ExpertParallel | None]:
        """What the communication cost depends on: groups with the same one cost the same where they go."""
        return (self.tensor_parallelism, self.pipeline_parallelism, self.moe)

    @property
    def shape(self) -> tuple[str, tuple[int, int, ExpertParallel | None], tuple[Any, ...]]:
        """Groups of the same shape are interchangeable: same cost wherever they swap."""
        return (self.role, self.parallel, self.eligibility)


@dataclass(frozen=True, kw_only=True)
class PlacementRequest:
    """All TP groups of one deployment and its placement policies."""

    groups: tuple[GroupRequest, ...]
    same_domain: bool = True
    """affinityPolicy same-nvswitch-domain: a group never spans NVLink domains."""
    spread_racks: bool = False
    """antiAffinityPolicy spread-across-racks: replicas of a role avoid sharing racks."""

    def __post_init__(self) -> None:
        seen: set[GroupKey] = set()
        for group in self.groups:
            if group.key in seen:
                raise ValueError(f"group {group.role}-{group.replica} is requested twice")
            seen.add(group.key)

    @functools.cached_property
    def roles(self) -> frozenset[str]:
        return frozenset(group.role for group in self.groups)


def pool(
    *,
    role: str,
    replicas: int,
    tensor_parallelism: int,
    pipeline_parallelism: int = 1,
    tolerations: Sequence[Toleration] = (),
    node_selector: Mapping[str, str] | None = None,
    moe: ExpertParallel | None = None,
) -> tuple[GroupRequest, ...]:
    """Groups ``role``-0 .. ``role``-(replicas-1) of one shape."""
    return tuple(
        GroupRequest(
            role=role,
            replica=replica,
            tensor_parallelism=tensor_parallelism,
            pipeline_parallelism=pipeline_parallelism,
            tolerations=tuple(tolerations),
            node_selector=tuple(sorted((node_selector or {}).items())),
            moe=moe,
        )
        for replica in range(replicas)
    )


@dataclass(frozen=True, kw_only=True)
class Pod:
    node: str
    gpus: int


@dataclass(frozen=True, kw_only=True)
class GroupPlacement:
    """Where one group's pods go (pods in rank order)."""

    role: str
    replica: int
    pods: tuple[Pod, ...]

    @property
    def key(self) -> GroupKey:
        return (self.role, self.replica)

    @property
    def gpus(self) -> int:
        return sum(pod.gpus for pod in self.pods)


@dataclass(frozen=True, kw_only=True)
class GroupCost:
    """A group's cost in microseconds, by term.

    ``ideal`` is the best comm + kv + spread it could get on its own; fragmentation is left out
    of the ideal and the score (it is about the cluster's future, not this group's speed) but
    is part of the cost the scheduler minimises.
    """

    comm: float
    """Ring all-reduce estimate per step (plus pipeline hand-offs), plus one MoE layer's
    all-to-all for MoE groups."""
    kv: float
    """KV transfer to the nearest group of the counterpart role (disaggregated only)."""
    spread: float
    """Its share of the penalty for same-role groups sharing a rack."""
    fragmentation: float
    """Its share of the change in stranded capacity (negative when it fills a broken domain)."""
    ideal: float

    @property
    def total(self) -> float:
        return self.comm + self.kv + self.spread + self.fragmentation


@dataclass(frozen=True, kw_only=True)
class PlacedGroup:
    role: str
    replica: int
    pods: tuple[Pod, ...]
    domain: str | None
    """The NVLink domain holding every pod, or None when the group spans several."""
    rack: str | None
    """The rack holding every pod, or None when it spans racks or racks are unknown."""
    cost: GroupCost
    score: float
    """1 when its comm + kv + spread is as low as it could be on its own; halves at
    ``CostModel.score_scale_us`` above that."""

    @property
    def key(self) -> GroupKey:
        return (self.role, self.replica)

    @property
    def placement(self) -> GroupPlacement:
        return GroupPlacement(role=self.role, replica=self.replica, pods=self.pods)


@dataclass(frozen=True, kw_only=True)
class Unplaced:
    role: str
    replica: int
    reason: str

    @property
    def key(self) -> GroupKey:
        return (self.role, self.replica)


@dataclass(frozen=True, kw_only=True)
class Plan:
    groups: tuple[PlacedGroup, ...]
    unplaced: tuple[Unplaced, ...]
    score: float
    """In [0, 1]: the share of groups placed, times how close their comm + kv + spread is to the
    sum of their ideals (1 when every group is as well placed as the cluster allows)."""
    warnings: tuple[str, ...] = field(default=())

    @property
    def feasible(self) -> bool:
        return not self.unplaced

    @property
    def total_cost(self) -> float:
        return sum(group.cost.total for group in self.groups)

    def placements(self) -> tuple[GroupPlacement, ...]:
        return tuple(group.placement for group in self.groups)

    def to_json(self) -> dict[str, Any]:
        """The ``copse placement plan --output json`` object."""
        return {
            "feasible": self.feasible,
            "score": round(self.score, 4),
            "groups": [
                {
                    "role": group.role,
                    "replica": group.replica,
                    "domain": group.domain,
                    "cost": round(group.cost.total, 3),
                    "pods": [{"node": pod.node, "gpus": pod.gpus} for pod in group.pods],
                }
                for group in self.groups
            ],
            "unplaced": [
                {"role": item.role, "replica": item.replica, "reason": item.reason} for item in self.unplaced
            ],
        }
