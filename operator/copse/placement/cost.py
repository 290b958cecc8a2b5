"""The cost model: every term in microseconds, so the terms add up and can be compared.

total = sum over groups of the ring all-reduce estimate (for MoE groups: plus one MoE layer's
        all-to-all, and no all-reduce in the DEP layout)
      + sum over prefill/decode groups of the KV transfer to the nearest counterpart group
      + spread_us x (pairs of same-role groups per shared rack)
      + domain_fragmentation_us x change of sum over domains of W(free, capacity)
      + node_fragmentation_us x change of sum over nodes of W(free, GPUs per node)

with W(f, c) = f (c - f) / c, in GPUs: zero for an empty or a full domain (node), c/4 when
half used. Placing g GPUs where f are free changes W by g (2 (f - g) + g - c) / c, which grows
with the leftover f - g: the cheapest domain is the best fit, breaking a whole domain costs
the most, and a small domain is broken before a large one (it strands fewer GPUs). All terms
depend only on the final assignment, never on the order groups were placed in, so an exact
optimum is well defined.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from copse.placement.model import ExpertParallel
from copse.topology.links import LinkTable, LinkTier

MIB = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Weights and message sizes; defaults rank the terms: split TP > KV distance > spread > packing."""

    allreduce_bytes: float = 4 * MIB
    """One tensor-parallel all-reduce: a decode batch of 256 tokens x hidden 8192 in bf16."""
    kv_bytes: float = 4 * MIB
    """KV shipped per rank per decode step, amortised (a prompt's KV moves once per request)."""
    spread_us: float = 60.0
    """Per pair of same-role groups sharing a rack: one rack failure takes both down."""
    domain_fragmentation_us: float = 1.5
    """Per GPU of W over NVLink domains: breaking a whole NVL72 for 8 GPUs costs ~11 us."""
    node_fragmentation_us: float = 5.0
    """Per GPU of W over nodes: a half-used 4-GPU tray costs 5 us until something fills it."""
    score_scale_us: float = 50.0
    """Excess cost over a group's ideal that halves its score."""
    moe_tokens_per_rank: float = 128.0
    """Tokens one EP rank feeds an MoE layer in a decode step (a DEP rank's batch; DeepEP's
    low-latency benchmark uses 128): sets the all-to-all size of MoE groups."""

    def __post_init__(self) -> None:
        for name in (
            "allreduce_bytes",
            "kv_bytes",
            "spread_us",
            "domain_fragmentation_us",
            "node_fragmentation_us",
            "moe_tokens_per_rank",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"cost model: {name} must be >= 0, got {getattr(self, name)}")
        if self.score_scale_us <= 0:
            raise ValueError(f"cost model: score_scale_us must be > 0, got {self.score_scale_us}")


def waste(free: float, capacity: float) -> float:
    """W(f, c): GPUs of a domain (node) left in awkward pieces, in [0, c/4]."""
    if capacity <= 0:
        return 0.0
    return free * (capacity - free) / capacity


def pod_size(gpus: int, gpus_per_node: int) -> int:
    """GPUs per pod: the largest divisor of ``gpus`` that fits on a node (uniform ranks per pod)."""
    for size in range(min(gpus, gpus_per_node), 0, -1):
        if gpus % size == 0:
            return size
    return 1


def _set_tier(pods: Sequence[int], tier: Sequence[Sequence[LinkTier]]) -> LinkTier:
    """Tier spanning a set of pods: in a tree, the widest tier between the first and any other."""
    first = pods[0]
    return max((tier[first][other] for other in pods[1:]), default=LinkTier.NODE)


def all_to_all_us(
    *,
    links: LinkTable,
    model: CostModel,
    moe: ExpertParallel,
    ranks: Sequence[int],
    tier: Sequence[Sequence[LinkTier]],
) -> float:
    """One MoE layer's dispatch and combine among ``ranks`` (the pod of each rank), as its slowest
    rank sees it, us.

    Each rank moves ``tokens x experts_per_token x hidden x 2 (dispatch and combine) x bytes``;
    with experts spread evenly a share ``(EP - 1) / EP`` goes to other ranks, split evenly among
    the others. The bytes to each link tier go over that tier's per-GPU bandwidth one after the
    other, plus the widest tier's latency for each of the two phases.
    """
    n = len(ranks)
    if n <= 1 or moe.ranks <= 1:
        return 0.0
    total = model.moe_tokens_per_rank * moe.experts_per_token * moe.hidden_size * 2 * moe.activation_bytes
    per_peer = total * (moe.ranks - 1) / moe.ranks / (n - 1)
    per_pod: dict[int, int] = {}
    for pod in ranks:
        per_pod[pod] = per_pod.get(pod, 0) + 1
    worst = 0.0
    for pod, count in per_pod.items():
        peers = {LinkTier.NODE: count - 1} if count > 1 else {}
        for other, other_count in per_pod.items():
            if other != pod:
                between = tier[pod][other]
                peers[between] = peers.get(between, 0) + other_count
        seconds_us = sum(
            per_peer * peers_at / (links[t].bandwidth_gbps * 1e3) for t, peers_at in peers.items()
        )
        worst = max(worst, seconds_us + 2 * links[max(peers)].latency_us)
    return worst


def comm_us(
    *,
    links: LinkTable,
    model: CostModel,
    tensor_parallelism: int,
    pipeline_parallelism: int,
    pod_gpus: Sequence[int],
    tier: Sequence[Sequence[LinkTier]],
    moe: ExpertParallel | None = None,
) -> float:
    """All-reduce estimate of a group whose pods (in rank order) hold ``pod_gpus`` GPUs.

    ``tier[i][j]`` is the link tier between pods i and j. Each pipeline stage runs a ring
    over its ``tensor_parallelism`` ranks, bounded by the slowest link among the pods it
    touches; stages run concurrently, so the slowest stage counts, plus one point-to-point
    activation hand-off per stage boundary. An MoE stage adds one layer's all-to-all among
    its ranks (:func:`all_to_all_us`) and, with attention data parallelism over pure EP (the
    DEP layout: EP = TP), no tensor-parallel all-reduce.
    """
    owner = [pod for pod, gpus in enumerate(pod_gpus) for _ in range(gpus)]
    tp = tensor_parallelism
    stage_costs = []
    handoff = 0.0
    for stage in range(pipeline_parallelism):
        ranks = owner[stage * tp : (stage + 1) * tp]
        pods = sorted(set(ranks))
        cost = 0.0
        if moe is None or not (moe.attention_data_parallel and moe.ranks == tp):
            cost = links[_set_tier(pods, tier)].ring_allreduce_us(tp, model.allreduce_bytes)
        if moe is not None:
            cost += all_to_all_us(links=links, model=model, moe=moe, ranks=ranks, tier=tier)
        stage_costs.append(cost)
        if stage + 1 < pipeline_parallelism:
            boundary = tier[ranks[-1]][owner[(stage + 1) * tp]]
            handoff += links[boundary].transfer_us(model.allreduce_bytes)
    return max(stage_costs, default=0.0) + handoff


def uniform_comm_us(
    *,
    links: LinkTable,
    model: CostModel,
    tensor_parallelism: int,
    pipeline_parallelism: int,
    pods: int,
    pod_gpus: int,
    between: LinkTier,
    moe: ExpertParallel | None = None,
) -> float:
    """:func:`comm_us` for ``pods`` equal pods whose pairwise tier is ``between``."""
    tier = [[LinkTier.NODE if i == j else between for j in range(pods)] for i in range(pods)]
    return comm_us(
        links=links,
        model=model,
        tensor_parallelism=tensor_parallelism,
        pipeline_parallelism=pipeline_parallelism,
        pod_gpus=[pod_gpus] * pods,
        tier=tier,
        moe=moe,
    )


def kv_us(*, links: LinkTable, model: CostModel, tier: LinkTier) -> float:
    """KV transfer between two groups whose nearest GPUs are ``tier`` apart (NVLink at best)."""
    return links[max(tier, LinkTier.DOMAIN)].transfer_us(model.kv_bytes)
