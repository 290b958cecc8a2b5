"""The step-time terms of an expert-parallel engine, and the per-engine state that produces them.

The engine's perf model times a step as if its experts were perfectly balanced and free to reach.
An EP group of ``EP`` ranks adds two things, every MoE layer:

* **imbalance**: each rank computes the tokens routed to the experts in its slots; the slowest
  rank sets the step. With ``l_r`` token-expert activations on rank r, the routed-expert part of
  the step (``expert_share`` of it) stretches by ``max(l) / mean(l)``;
* **all-to-all**: dispatch and combine move every activation routed to another rank (``(EP - 1) /
  EP`` of them, sources spread evenly over the ranks): the hottest rank receives
  ``max(l) (EP - 1) / EP`` token copies of ``hidden x 2 (dispatch and combine) x bytes`` over its
  link, plus the link latency for each phase.

So ``step = base x (1 + expert_share (max(l) / mean(l) - 1)) + layers x all-to-all``. Loads are
expected values (each request's tokens spread over experts by its expert shares); the sampling
noise of a real batch is not modelled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from copse.workers.moe.placement import eplb, static_placement
from copse.workers.moe.popularity import ExpertPopularity

FloatArray = npt.NDArray[np.float64]


@dataclasses.dataclass(frozen=True, slots=True)
class MoeConfig:
    """An expert-parallel engine's MoE model and EP group (defaults: DeepSeek-V3 as DEP8 on NVL72)."""

    experts: int = 256
    """Routed experts per MoE layer."""
    experts_per_token: int = 8
    """Experts each token activates (top-K)."""
    hidden_size: int = 7168
    """Elements of one token's activation, dispatched to each of its experts."""
    layers: int = 58
    """MoE layers: one dispatch and one combine each per step."""
    activation_bytes: int = 2
    """Bytes per dispatched element (2: BF16)."""
    expert_parallelism: int = 8
    """EP ranks of the engine's group."""
    redundant_experts: int = 0
    """Extra slots for replicas of hot experts; placed from the model-wide popularity at start
    (as an offline EPLB run would) and, with ``rebalance_steps``, from the engine's own load."""
    rebalance_steps: int = 0
    """Online load balancer: re-place the experts every this many steps from the load the engine
    saw (TensorRT-LLM updates ``layer_updates_per_iter`` layers per iteration, so every layer once
    in ``layers / layer_updates_per_iter`` steps); 0 keeps the placement."""
    stats_half_life_steps: float = 2000.0
    """Half-life, in steps, of the expert load statistics the online balancer uses."""
    link_bandwidth_gbps: float = 900.0
    """Per-GPU bandwidth of the slowest link between the EP ranks, GB/s each way (NVLink 5 inside an
    NVL72 domain: 900; a 400 Gb/s NIC beyond it: 50)."""
    link_latency_us: float = 1.0
    """Latency of that link, us (paid by dispatch and by combine)."""
    expert_share: float = 0.4
    """Share of a balanced step spent in routed-expert compute (DeepSeek-V3: its routed experts are
    ~20B of 37B active parameters, and attention reads the KV cache on top): what the slowest rank
    stretches."""
    popularity_seed: int = 0
    """Seeds the mocked model's expert routing (which experts are popular, overall and per prompt)."""
    prompt_weight: float = 0.5
    """How much a prompt's own expert preference outweighs the model-wide popularity."""
    skew: float = 2.0
    """Exponent of the model's popularity curve (2: the top 32 of 256 experts take 39 %)."""

    def __post_init__(self) -> None:
        for name in (
            "experts",
            "experts_per_token",
            "hidden_size",
            "layers",
            "activation_bytes",
            "expert_parallelism",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"moe.{name}={getattr(self, name)} must be at least 1")
        if self.experts_per_token > self.experts:
            raise ValueError(
                f"moe.experts_per_token={self.experts_per_token} exceeds moe.experts={self.experts}"
            )
        if self.redundant_experts < 0 or self.rebalance_steps < 0:
            raise ValueError("moe.redundant_experts and moe.rebalance_steps must not be negative")
        if self.slots % self.expert_parallelism:
            raise ValueError(
                f"moe: experts + redundant_experts ({self.slots}) must be a multiple of "
                f"expert_parallelism ({self.expert_parallelism})"
            )
        for name in ("link_bandwidth_gbps", "stats_half_life_steps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"moe.{name}={getattr(self, name)} must be positive")
        if self.link_latency_us < 0:
            raise ValueError(f"moe.link_latency_us={self.link_latency_us} must not be negative")
        if not 0.0 <= self.expert_share <= 1.0:
            raise ValueError(f"moe.expert_share={self.expert_share} must lie in [0, 1]")

    @property
    def slots(self) -> int:
        return self.experts + self.redundant_experts

    @property
    def bytes_per_copy(self) -> int:
        """Bytes one remote token copy moves in one layer (dispatch and combine)."""
        return self.hidden_size * 2 * self.activation_bytes


class StepTerms(NamedTuple):
    """What one step's expert loads add to its time."""

    factor: float
    """Multiplies the balanced step time (the slowest rank's routed-expert work)."""
    all_to_all_ms: float
    """Added to it: every layer's dispatch and combine."""
    hot: float
    """Token-expert activations on the most loaded rank."""
    mean: float
    """Mean activations per rank."""


def moe_terms(config: MoeConfig, rank_loads: FloatArray) -> tuple[FloatArray, FloatArray]:
    """The stretch factor and the all-to-all time (ms) of steps whose ranks carry ``rank_loads``
    token-expert activations (last axis: the EP ranks; any leading axes, e.g. one per worker)."""
    mean = rank_loads.mean(axis=-1)
    hot = rank_loads.max(axis=-1)
    active = mean > 0.0
    factor = np.where(active, 1.0 + config.expert_share * (hot / np.where(active, mean, 1.0) - 1.0), 1.0)
    ep = config.expert_parallelism
    if ep == 1:
        return factor, np.zeros_like(factor)
    copies = hot * (ep - 1) / ep
    per_layer_us = 2 * config.link_latency_us + copies * config.bytes_per_copy / (
        config.link_bandwidth_gbps * 1e3
    )
    all_to_all_ms = np.where(active, config.layers * per_layer_us / 1000.0, 0.0)
    return factor, all_to_all_ms


def step_terms(config: MoeConfig, rank_loads: FloatArray) -> StepTerms:
    """:class:`StepTerms` of a step whose ranks carry ``rank_loads`` token-expert activations."""
    if not len(rank_loads):
        return StepTerms(1.0, 0.0, 0.0, 0.0)
    factor, all_to_all_ms = moe_terms(config, rank_loads)
    return StepTerms(float(factor), float(all_to_all_ms), float(rank_loads.max()), float(rank_loads.mean()))


class MoeStep:
    """One engine's experts: the placement, the expert shares of the prompts it has seen, the load
    statistics its balancer uses, and totals for reports."""

    def __init__(self, config: MoeConfig, *, seed: int = 0) -> None:
        self.config = config
        self.popularity = ExpertPopularity(
            experts=config.experts,
            seed=config.popularity_seed,
            prompt_weight=config.prompt_weight,
            skew=config.skew,
        )
        if config.redundant_experts:
            placement = eplb(self.popularity.model_wide, ranks=config.expert_parallelism, slots=config.slots)
        else:
            placement = static_placement(experts=config.experts, ranks=config.expert_parallelism)
        self._rows: list[FloatArray] = []
        self._row_of: dict[int | None, int] = {}
        self._rank_rows = np.zeros((0, config.expert_parallelism))
        self.placement = placement
        self._shares = placement.shares()
        self.version = 0
        """Incremented whenever the placement changes."""
        self.load = np.zeros(config.experts)
        """Decayed token-expert activations per expert (what the balancer places by)."""
        self._decay = 0.5 ** (1.0 / config.stats_half_life_steps)
        self._since_rebalance = 0
        self._last: tuple[FloatArray, StepTerms] | None = None
        self._rng = np.random.default_rng(seed)
        # totals over the engine's life
        self.steps = 0
        self.token_passes = 0.0
        """Tokens through the MoE layers (a prefill token or a decode step of one sequence)."""
        self.all_to_all_bytes = 0.0
        """Bytes every EP rank sent to others, all layers, dispatch and combine."""
        self.hot_total = 0.0
        self.mean_total = 0.0
        self.moe_ms = 0.0
        """Time the MoE terms added to steps (imbalance stretch plus all-to-all)."""
        self.step_ms = 0.0
        """Time of every step, MoE terms included."""

    # -- requests -----------------------------------------------------------------------------

    def row(self, key: int | None) -> int:
        """The row of the expert shares of a prompt whose first block hashes to ``key``."""
        row = self._row_of.get(key)
        if row is None:
            row = len(self._rows)
            self._row_of[key] = row
            self._rows.append(self.popularity.of(key))
            self._rank_rows = np.vstack(
                (self._rank_rows, self.config.experts_per_token * (self._rows[-1] @ self._shares))
            )
        return row

    def shares_of(self, row: int) -> FloatArray:
        return self._rows[row]

    def activations(self, row: int, tokens: int) -> npt.NDArray[np.int64]:
        """A sample of the per-expert activation counts of ``tokens`` tokens of a prompt's row (what
        an engine counting routed expert ids would report for the request)."""
        draws = self._rng.multinomial(tokens * self.config.experts_per_token, self._rows[row])
        counts: npt.NDArray[np.int64] = draws.astype(np.int64)
        return counts

    # -- steps --------------------------------------------------------------------------------

    def terms(self, rows: Sequence[int], tokens: Sequence[int]) -> StepTerms:
        """The terms of a step computing ``tokens[i]`` tokens of requests of ``rows[i]``; remembered
        for :meth:`record`."""
        counts: FloatArray = np.bincount(
            np.asarray(rows, dtype=np.int64),
            weights=np.asarray(tokens, dtype=np.float64),
            minlength=len(self._rows),
        ).astype(np.float64)
        terms = step_terms(self.config, counts @ self._rank_rows)
        self._last = (counts, terms)
        return terms

    def record(self, *, steps: int, base_ms: float, step_ms: float) -> None:
        """Account ``steps`` identical steps with the last :meth:`terms`, ``base_ms`` of balanced time
        and ``step_ms`` in all; re-place the experts when the online balancer is due."""
        if self._last is None:
            return
        counts, terms = self._last
        config = self.config
        passes = float(counts.sum())
        self.steps += steps
        self.token_passes += steps * passes
        remote = (config.expert_parallelism - 1) / config.expert_parallelism
        self.all_to_all_bytes += (
            steps * passes * config.experts_per_token * remote * config.bytes_per_copy * config.layers
        )
        self.hot_total += steps * terms.hot
        self.mean_total += steps * terms.mean
        self.moe_ms += step_ms - base_ms
        self.step_ms += step_ms
        nonzero = np.flatnonzero(counts)
        expert_load = counts[nonzero] @ np.asarray([self._rows[i] for i in nonzero]) if len(nonzero) else 0.0
        decay = self._decay**steps
        self.load = (
            decay * self.load + (1.0 - decay) / (1.0 - self._decay) * config.experts_per_token * expert_load
        )
        self._last = None
        if config.rebalance_steps:
            self._since_rebalance += steps
            if self._since_rebalance >= config.rebalance_steps:
                self._since_rebalance = 0
                self.rebalance()

    def rebalance(self) -> None:
        """Re-place the experts by the load seen so far (the online load balancer)."""
        if not self.load.any():
            return
        placement = eplb(self.load, ranks=self.config.expert_parallelism, slots=self.config.slots)
        if placement == self.placement:
            return
        self.placement = placement
        self._shares = placement.shares()
        k = self.config.experts_per_token
        self._rank_rows = k * (np.asarray(self._rows) @ self._shares) if self._rows else self._rank_rows
        self.version += 1

    @property
    def imbalance(self) -> float:
        """Activations on the most loaded rank over the mean, over every step so far (1 = balanced)."""
        return self.hot_total / self.mean_total if self.mean_total > 0 else math.nan
