"""Expert placement over EP ranks: which expert each slot holds, and how tokens spread over them.

TensorRT-LLM gives every EP rank ``num_slots / ep_size`` slots. Without a load balancer rank r
holds experts ``[r E / EP, (r + 1) E / EP)`` in order. With one, the slots hold every expert plus
replicas of hot ones; a token for a replicated expert goes to one of its replicas, so each
replica takes an equal share of that expert's tokens.

:func:`eplb` is the DeepSeek EPLB heuristic (what TensorRT-LLM's offline ``generate_eplb_config.py``
and online balancer aim at): give each extra slot to the expert with the most load per replica
(at most one replica per rank), then pack replicas, heaviest first, onto the least-loaded rank
that has a free slot and does not hold that expert yet.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclasses.dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """Experts per slot, rank by rank (``slots[r]`` holds rank r's experts)."""

    slots: tuple[tuple[int, ...], ...]
    experts: int

    def __post_init__(self) -> None:
        sizes = {len(rank) for rank in self.slots}
        if len(sizes) != 1:
            raise ValueError(f"every EP rank must hold as many slots, got {sorted(sizes)}")
        held = {expert for rank in self.slots for expert in rank}
        if held != set(range(self.experts)):
            missing = sorted(set(range(self.experts)) - held)[:5]
            raise ValueError(f"every expert needs a slot; missing {missing}...")

    @property
    def ranks(self) -> int:
        return len(self.slots)

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots[0])

    def shares(self) -> FloatArray:
        """``(experts, ranks)``: the share of each expert's tokens each rank computes."""
        counts = np.zeros((self.experts, self.ranks))
        for rank, experts in enumerate(self.slots):
            for expert in experts:
                counts[expert, rank] += 1.0
        result: FloatArray = counts / counts.sum(axis=1, keepdims=True)
        return result

    def replicas(self) -> IntArray:
        """Slots each expert holds."""
        counts = np.zeros(self.experts, dtype=np.int64)
        for experts in self.slots:
            for expert in experts:
                counts[expert] += 1
        return counts

    def global_assignments(self) -> list[int]:
        """Expert id per global slot, rank after rank (TensorRT-LLM's ``initial_global_assignments``
        row for one layer)."""
        return [expert for rank in self.slots for expert in rank]


def _check(experts: int, ranks: int, slots: int) -> None:
    if experts < 1 or ranks < 1:
        raise ValueError(f"experts and ranks must be >= 1, got {experts} and {ranks}")
    if slots < experts:
        raise ValueError(f"{slots} slots cannot hold {experts} experts")
    if slots % ranks:
        raise ValueError(f"{slots} slots do not divide over {ranks} EP ranks")


def static_placement(*, experts: int, ranks: int) -> ExpertPlacement:
    """No load balancer: rank r holds experts ``[r E / EP, (r + 1) E / EP)``."""
    _check(experts, ranks, experts)
    per_rank = experts // ranks
    return ExpertPlacement(
        slots=tuple(tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(ranks)), experts=experts
    )


def eplb(load: FloatArray, *, ranks: int, slots: int) -> ExpertPlacement:
    """Replicate and pack ``load`` (per expert, any scale) over ``ranks`` ranks of ``slots / ranks``
    slots, so that the most loaded rank carries as little as it can (a greedy, as DeepSeek's)."""
    experts = len(load)
    _check(experts, ranks, slots)
    load = np.maximum(np.asarray(load, dtype=np.float64), 0.0) + 1e-12  # ties broken by expert id
    replicas = np.ones(experts, dtype=np.int64)
    heap = [(-float(load[e]), e) for e in range(experts)]
    heapq.heapify(heap)
    for spare in range(slots - experts):
        if not heap:  # every expert on every rank: the rest replicate round-robin
            replicas[spare % experts] += 1
            continue
        _, expert = heapq.heappop(heap)
        replicas[expert] += 1
        if replicas[expert] < ranks:  # a second copy on one rank would balance nothing
            heapq.heappush(heap, (-float(load[expert] / replicas[expert]), expert))
    items = sorted(
        ((float(load[e] / replicas[e]), e) for e in range(experts) for _ in range(int(replicas[e]))),
        key=lambda item: (-item[0], item[1]),
    )
    per_rank = slots // ranks
    rank_load = [0.0] * ranks
    held: list[list[int]] = [[] for _ in range(ranks)]
    open_ranks = [(0.0, r) for r in range(ranks)]
    for share, expert in items:
        # The least-loaded rank with room that does not hold this expert yet (else any with room).
        skipped = []
        while True:
            current, rank = heapq.heappop(open_ranks)
            if expert not in held[rank] or not open_ranks:
                break
            skipped.append((current, rank))
        for entry in skipped:
            heapq.heappush(open_ranks, entry)
        held[rank].append(expert)
        rank_load[rank] += share
        if len(held[rank]) < per_rank:
            heapq.heappush(open_ranks, (rank_load[rank], rank))
    return ExpertPlacement(slots=tuple(tuple(sorted(rank)) for rank in held), experts=experts)
