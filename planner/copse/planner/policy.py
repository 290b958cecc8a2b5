"""Bounds and stability rules between what the load needs and what gets applied (pure).

* :class:`Limits` -- what the InferenceDeployment allows: replica bounds per pool, a GPU budget
  shared by the pools, latency targets, the scale-down delay and the queue-depth trigger.
* :func:`clamp` and :func:`fit_budget` -- never outside the bounds; whole TP groups only.
* :class:`ScaleDownGate` -- capacity is removed only after the need has stayed lower for the
  whole scale-down delay (the largest need seen in that window wins, as Kubernetes' HPA does).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping

from copse.api import InferenceDeploymentSpec, Role

#: Pools of a disaggregated deployment, in the order they are reported.
DISAGGREGATED: tuple[Role, ...] = (Role.PREFILL, Role.DECODE)
AGGREGATED: tuple[Role, ...] = (Role.WORKER,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """What the deployment allows the planner to do, and the targets it must hold."""

    roles: tuple[Role, ...]
    """``(WORKER,)`` for aggregated serving, ``(PREFILL, DECODE)`` for disaggregated."""
    gpus_per_replica: Mapping[Role, int]
    """GPUs of one TP group of each pool (TP x PP)."""
    ttft_ms: float
    """p99 TTFT target."""
    itl_ms: float
    """p99 ITL (time between tokens) target."""
    min_replicas: int = 1
    """Fewest groups per pool."""
    max_replicas: int = 16
    """Most groups per pool."""
    gpu_budget: int | None = None
    """Most GPUs all pools together may use; ``None`` for no budget."""
    scale_down_delay_s: float = 300.0
    """How long the need must stay lower before capacity is removed."""
    queue_depth: int = 10
    """Waiting requests per front-pool replica that trigger a scale-up ahead of the forecast."""
    max_num_seqs: int = 256
    """Most sequences an engine batches (bounds the decode batch)."""
    max_batch_tokens: int = 8192
    """Token budget of one engine step (``spec.engine.maxBatchTokens``): a prompt longer than it
    prefills in chunks of this size, each sharing a step with the decoding sequences."""
    startup_delay_s: float = 120.0
    """Time from adding a replica to it serving (``spec.coldStart``), when the planner's config
    does not set one."""

    def __post_init__(self) -> None:
        if set(self.roles) not in ({Role.WORKER}, {Role.PREFILL, Role.DECODE}):
            raise ValueError(f"roles must be (worker,) or (prefill, decode), got {self.roles}")
        if any(self.gpus_per_replica.get(role, 0) < 1 for role in self.roles):
            raise ValueError(f"every pool needs gpus_per_replica >= 1, got {dict(self.gpus_per_replica)}")
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ValueError(
                f"latency targets must be positive, got ttft {self.ttft_ms} ms, itl {self.itl_ms} ms"
            )
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must lie in [0, max_replicas ({self.max_replicas})]"
            )
        if self.gpu_budget is not None and self.minimum_gpus > self.gpu_budget:
            raise ValueError(
                f"the GPU budget ({self.gpu_budget}) cannot hold min_replicas ({self.min_replicas}) of every "
                f"pool ({self.minimum_gpus} GPUs)"
            )

    @property
    def disaggregated(self) -> bool:
        return Role.PREFILL in self.roles

    @property
    def front(self) -> Role:
        """The pool requests queue in front of (prefill, or the aggregated workers)."""
        return Role.PREFILL if self.disaggregated else Role.WORKER

    @property
    def back(self) -> Role:
        """The pool that holds decoding sequences (decode, or the aggregated workers)."""
        return Role.DECODE if self.disaggregated else Role.WORKER

    @property
    def minimum_gpus(self) -> int:
        return sum(self.min_replicas * self.gpus_per_replica[role] for role in self.roles)

    def gpus(self, replicas: Mapping[Role, int]) -> int:
        return sum(replicas.get(role, 0) * self.gpus_per_replica[role] for role in self.roles)

    @classmethod
    def from_spec(cls, spec: InferenceDeploymentSpec) -> Limits:
        """The limits an InferenceDeployment's spec sets."""
        scaling = spec.scaling
        pools = spec.pools()
        return cls(
            roles=tuple(pool.role for pool in pools),
            gpus_per_replica={pool.role: pool.gpus_per_group for pool in pools},
            ttft_ms=scaling.target_latency.ttft_p99_ms,
            itl_ms=scaling.target_latency.tbt_p99_ms,
            min_replicas=scaling.min_replicas,
            max_replicas=scaling.max_replicas,
            gpu_budget=scaling.max_gpus,
            scale_down_delay_s=scaling.scale_down_delay_s,
            queue_depth=scaling.scale_up_trigger.queue_depth,
            max_num_seqs=spec.engine.max_num_sequences,
            max_batch_tokens=spec.engine.max_batch_tokens,
            startup_delay_s=spec.cold_start.startup_delay_s(model_cache=spec.model.cache),
        )


def clamp(replicas: Mapping[Role, int], limits: Limits) -> dict[Role, int]:
    """Each pool within ``[min_replicas, max_replicas]``."""
    return {
        role: min(max(replicas.get(role, 0), limits.min_replicas), limits.max_replicas)
        for role in limits.roles
    }


def fit_budget(replicas: Mapping[Role, int], limits: Limits) -> dict[Role, int]:
    """Replicas that fit the GPU budget, in whole groups.

    Within budget, nothing changes. Over it, every pool keeps ``min_replicas`` and the rest of the
    budget goes one group at a time to the pool furthest (relatively) from what it asked for, so
    both pools fall short in proportion rather than one starving.
    """
    wanted = {role: replicas[role] for role in limits.roles}
    if limits.gpu_budget is None or limits.gpus(wanted) <= limits.gpu_budget:
        return wanted
    granted = {role: min(limits.min_replicas, wanted[role]) for role in limits.roles}
    left = limits.gpu_budget - limits.gpus(granted)
    while True:
        candidates = [
            role
            for role in limits.roles
            if granted[role] < wanted[role] and limits.gpus_per_replica[role] <= left
        ]
        if not candidates:
            return granted
        role = max(candidates, key=lambda r: ((wanted[r] - granted[r]) / wanted[r], -limits.roles.index(r)))
        granted[role] += 1
        left -= limits.gpus_per_replica[role]


class ScaleDownGate:
    """Holds capacity until the need has stayed below it for ``delay_s``.

    Each call records the newly desired count, which stands until the next call. The count
    allowed is the largest one that stood at any time in the last ``delay_s`` (so a short dip
    removes nothing), capped by the current count; scale-ups pass at once. Until the planner
    has ``delay_s`` of history it removes nothing.
    """

    def __init__(self) -> None:
        self._history: dict[Role, deque[tuple[float, int]]] = {}
        self._since: float | None = None

    def settle(
        self, *, now: float, current: Mapping[Role, int], desired: Mapping[Role, int], delay_s: float
    ) -> dict[Role, int]:
        if self._since is None:
            self._since = now
        settled = {}
        for role, want in desired.items():
            history = self._history.setdefault(role, deque())
            history.append((now, want))
            # Drop entries superseded before the window opened; the one standing then stays.
            while len(history) > 1 and history[1][0] <= now - delay_s:
                history.popleft()
            have = current.get(role, 0)
            if want >= have:
                settled[role] = want
            elif now - self._since < delay_s:
                settled[role] = have
            else:
                settled[role] = min(have, max(count for _, count in history))
        return settled
