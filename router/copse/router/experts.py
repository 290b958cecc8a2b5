"""What the router knows of a Mixture-of-Experts deployment's experts, and the expert term of the
``kv_expert`` policy.

Per worker (an expert-parallel engine of ``EP`` ranks): where its experts sit, as its engine
reports its placement (until then TensorRT-LLM's default: contiguous blocks of experts per rank),
and the expected token-expert activations per rank of the requests the router has in flight on it.
Per request class: the expected expert shares, learned from the per-request activation counts
engines report when a request ends. A class is the request's first KV block (a system prompt or
conversation head), the way the design documents keep expert profiles per prefix; a class not
seen yet gets the activations of all requests so far, and before any report every expert alike.

Nothing here comes from outside what engines would tell any router: their expert placement and
the routed-expert counts of the requests they served (TensorRT-LLM counts routed expert ids per
iteration for its load balancer; the mocker reports them per request).

The ``kv_expert`` policy predicts the request's decode time on each worker with the MoE layers'
share of each step (:func:`copse.workers.moe.moe_terms`: the slowest rank's stretch of the
routed-expert compute, plus the all-to-all) for the expert load in flight there plus the request's
expected experts: a worker whose hot ranks this request's experts would make hotter costs more,
one whose cold ranks they would fill less.

What step it stretches. A perf profile measured on the MoE engines (what a deployment has: a
profiler times whole steps) already holds the all-to-all and the slowest-rank stretch of the expert
load its own batches had; both terms on top of it count them twice (measured on the DEP32 example:
the profiled step is 1.10-1.31x the balanced one, and ``kv_expert`` so fell behind its own
ablation). So the router takes the engines' balanced step (``Router(moe_perf=...)``: a profile of
the same measured steps less the MoE terms their engines' expert-load statistics give,
:func:`copse.sim.profiler.measure_profile` with ``balanced``; in the simulator's oracle, the
engines' exact model), stretches it for the load it expects and adds the all-to-all. The other
choices considered: treating the profile's step as an average-case MoE step and adding only the
request's deviation from an average load, which is what is left when no balanced step is known
(its average is the model-wide expert shares learned from engine reports, while the profiler's
batches had their own prompts' preferences, more imbalance at small batches: a part is still
counted twice, and measured, it recovered little: ITL 11.10 -> 10.79 ms against the ablation's
10.15); and profiling a dense engine, which a real MoE deployment cannot run.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from copse.workers.moe import ExpertPlacement, MoeConfig, eplb, moe_terms, static_placement

FloatArray = npt.NDArray[np.float64]


class ExpertTracker:
    """Expert placement and in-flight expert load per worker slot, and learned class profiles."""

    __slots__ = (
        "_class_counts",
        "_flights",
        "_global",
        "_loads",
        "_shares",
        "_static",
        "_worker_counts",
        "config",
    )

    def __init__(self, config: MoeConfig) -> None:
        self.config = config
        self._static = static_placement(experts=config.experts, ranks=config.expert_parallelism).shares()
        self._shares = np.zeros((0, config.experts, config.expert_parallelism))
        """Per slot, the share of each expert's tokens each of its ranks computes."""
        self._loads = np.zeros((0, config.expert_parallelism))
        """Per slot, expected token-expert activations per rank of one step of its in-flight requests."""
        self._flights: dict[str, tuple[int, int | None, FloatArray]] = {}
        """Request id -> (worker slot, class, the expert shares it was charged with)."""
        self._class_counts: dict[int | None, FloatArray] = {}
        self._global = np.zeros(config.experts)
        self._worker_counts = np.zeros((0, config.experts))

    @property
    def size(self) -> int:
        return len(self._loads)

    def ensure(self, size: int) -> None:
        """Room for worker slots ``0 .. size - 1`` (new slots start with the default placement)."""
        grow = size - self.size
        if grow <= 0:
            return
        experts, ranks = self.config.experts, self.config.expert_parallelism
        self._shares = np.concatenate((self._shares, np.broadcast_to(self._static, (grow, experts, ranks))))
        self._loads = np.concatenate((self._loads, np.zeros((grow, ranks))))
        self._worker_counts = np.concatenate((self._worker_counts, np.zeros((grow, experts))))

    def set_placement(self, slot: int, placement: ExpertPlacement) -> None:
        """The expert placement worker ``slot`` reports (its load balancer moved experts)."""
        if (placement.experts, placement.ranks) != (self.config.experts, self.config.expert_parallelism):
            raise ValueError(
                f"placement of {placement.experts} experts over {placement.ranks} ranks does not match "
                f"the model's {self.config.experts} over {self.config.expert_parallelism}"
            )
        self.ensure(slot + 1)
        self._shares[slot] = placement.shares()
        # In-flight requests now spread over the new placement.
        self._loads[slot] = 0.0
        for owner, _, shares in self._flights.values():
            if owner == slot:
                self._loads[slot] += self._rank_load(slot, shares)

    def reset_worker(self, slot: int) -> None:
        """Worker ``slot`` left or restarted: back to the default placement, nothing in flight."""
        if slot < self.size:
            self._shares[slot] = self._static
            self._loads[slot] = 0.0
            self._worker_counts[slot] = 0.0
        for request_id in [rid for rid, (owner, _, _) in self._flights.items() if owner == slot]:
            del self._flights[request_id]

    # -- classes ------------------------------------------------------------------------------

    def expected(self, key: int | None) -> FloatArray:
        """Expected expert shares of a request of class ``key`` (sums to 1)."""
        counts = self._class_counts.get(key)
        if counts is not None and counts.sum() > 0:
            shares: FloatArray = counts / counts.sum()
            return shares
        return self.average()

    def average(self) -> FloatArray:
        """The model-wide expert shares of all requests reported so far (before any report, every
        expert alike; sums to 1)."""
        total = self._global.sum()
        if total > 0:
            average: FloatArray = self._global / total
            return average
        return np.full(self.config.experts, 1.0 / self.config.experts)

    def report(self, request_id: str, counts: npt.ArrayLike) -> None:
        """An engine's routed-expert counts for the in-flight request ``request_id`` (before it is
        removed): they teach its class's expert shares, the model-wide ones and its worker's load."""
        values = np.asarray(counts, dtype=np.float64)
        if values.shape != (self.config.experts,):
            raise ValueError(
                f"expert counts must have {self.config.experts} entries, got shape {values.shape}"
            )
        self._global += values
        flight = self._flights.get(request_id)
        if flight is None:
            return
        slot, key, _ = flight
        if key not in self._class_counts:
            self._class_counts[key] = np.zeros(self.config.experts)
        self._class_counts[key] += values
        self._worker_counts[slot] += values

    # -- in-flight load -----------------------------------------------------------------------

    def _rank_load(self, slot: int, shares: FloatArray) -> FloatArray:
        load: FloatArray = self.config.experts_per_token * (shares @ self._shares[slot])
        return load

    def add(self, request_id: str, *, slot: int, key: int | None) -> None:
        """A request of class ``key`` decodes on worker ``slot``: one token a step until it ends."""
        self.ensure(slot + 1)
        self.remove(request_id)
        shares = self.expected(key)
        self._flights[request_id] = (slot, key, shares)
        self._loads[slot] += self._rank_load(slot, shares)

    def remove(self, request_id: str) -> None:
        flight = self._flights.pop(request_id, None)
        if flight is not None:
            slot, _, shares = flight
            self._loads[slot] = np.maximum(self._loads[slot] - self._rank_load(slot, shares), 0.0)

    def loads(self) -> FloatArray:
        """Expected activations per rank of one step, per worker slot (a copy)."""
        return self._loads.copy()

    # -- the routing term ---------------------------------------------------------------------

    def moe_ms(self, key: int | None, step_ms: FloatArray, *, balanced: bool) -> FloatArray:
        """Per worker slot, the time the MoE layers add to each of its steps with a request of class
        ``key`` joining the expert load in flight there, ms.

        ``step_ms`` is each worker's predicted step. ``balanced``: the step without MoE terms, and
        the whole stretch and all-to-all are added. Otherwise a profile of the MoE engines, taken to
        hold the terms of an average batch of as many requests (the model-wide expert shares, on
        the worker's placement): only the deviation from those is added (negative where the load
        would be less imbalanced than that average)."""
        size = len(step_ms)
        self.ensure(size)
        config = self.config
        placements = self._shares[:size]
        joined = self._loads[:size] + config.experts_per_token * np.einsum(
            "e,wer->wr", self.expected(key), placements
        )
        factor, all_to_all_ms = moe_terms(config, joined)
        if balanced:
            added: FloatArray = step_ms * (factor - 1.0) + all_to_all_ms
            return added
        # The same number of activations per step, spread as the average request spreads them.
        average = joined.sum(axis=-1, keepdims=True) * np.einsum("e,wer->wr", self.average(), placements)
        average_factor, average_all_to_all_ms = moe_terms(config, average)
        base = np.maximum(step_ms - average_all_to_all_ms, 0.0) / average_factor
        deviation: FloatArray = base * factor + all_to_all_ms - step_ms
        return deviation

    # -- the rebalancer -----------------------------------------------------------------------

    def proposal(self, slot: int, *, slots: int | None = None) -> ExpertPlacement:
        """An EPLB placement for worker ``slot`` (``slots`` expert slots, default the model's) from the
        routed-expert counts of the requests it served: what its offline load balancer should load
        (TensorRT-LLM's ``initial_global_assignments``) for the traffic the router sends it."""
        self.ensure(slot + 1)
        load = self._worker_counts[slot] if self._worker_counts[slot].any() else self._global
        return eplb(load, ranks=self.config.expert_parallelism, slots=slots or self.config.slots)
