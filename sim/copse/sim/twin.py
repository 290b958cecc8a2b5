"""The closed-loop twin: the SLA planner sizing a fleet of mocked engines behind the real router,
every request simulated on the virtual clock.

What runs is what runs in a cluster, minus the cluster:

* Every ``interval_s`` the planner (:class:`copse.planner.core.Planner`, the live loop's
  :meth:`~copse.planner.core.Planner.step`) learns from the interval that ended and decides the
  replicas. It sees what it would see in a cluster, the router's Prometheus series over the
  interval (:func:`observe`): requests arriving, prompt and output tokens, the router's
  *predicted* hit rate, the p90 prompt length and p99 TTFT and ITL read from the router's
  histogram buckets with Prometheus' ``histogram_quantile`` (alert signals), the mean TTFT and
  mean TPOT from the histograms' sums and counts; queue and batch gauges and the engines serving
  at the end of the interval, and the router's per-request SLO counts (:func:`slo_counts`). Between
  intervals the fast loop reads a :class:`~copse.planner.observations.Pulse` every
  ``fast_path_poll_s`` (:func:`pulse`: queues, outstanding prefill tokens, SLO counts over the burn
  window); it adds capacity only.
* A replica added starts serving ``startup_delay_s`` after the decision (it holds its GPUs from
  the decision on). A replica removed first cancels one still starting (newest first), else
  drains the newest serving engine: the router stops sending it requests at once, it finishes
  the ones it has, and its GPUs are released when it is empty.
* The router routes every request with its own measured perf model, KV events arrive late, the
  engines' steps are noisy (:class:`~copse.sim.replay.ReplaySettings`); the planner sizes with
  the same measured profile the router uses.

Results count from ``warmup_s`` (the planner learns the load first) to the end of the load:
per request, TTFT and mean ITL against the targets (a refused request misses); per interval,
the p99 of the requests that arrived in it; GPU-hours of every replica held, starting and
draining ones included. Without a planner (``planner=None``) the fleet stays at its initial size:
the static deployments the planner is compared with.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from copse.api import Role
from copse.planner.capacity import capacity_for
from copse.planner.config import PlannerConfig
from copse.planner.core import FORECAST, SIGNALS, Decision, Planner
from copse.planner.observations import UNCACHED_QUANTILES, Observation, Pulse
from copse.planner.policy import Limits
from copse.router.core import Role as EngineRole
from copse.router.metrics import (
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    OUTPUT_LENGTH_BUCKETS,
    PROMPT_LENGTH_BUCKETS,
    UNCACHED_PROMPT_BUCKETS,
)
from copse.sim.replay import Distribution, Fleet, ReplaySettings
from copse.sim.trace import TraceRequest

FloatArray = npt.NDArray[np.float64]


def histogram_quantile(q: float, values: FloatArray, *, buckets: Sequence[float]) -> float | None:
    """Prometheus' ``histogram_quantile(q, ...)`` over a histogram with upper bounds ``buckets``
    (plus +Inf) that observed ``values``: linear within the bucket holding rank ``q x count``
    (from 0 for the first bucket), the highest finite bound when that bucket is +Inf; ``None``
    without observations. ``q = 0`` is the lower bound of the first bucket holding anything
    (Prometheus divides 0 by 0 there when the first bucket is empty)."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} is not in [0, 1]")
    if not len(values):
        return None
    bounds = np.asarray(buckets, dtype=np.float64)
    counts = np.searchsorted(bounds, values, side="left")  # bucket index: first bound >= value
    cumulative = np.cumsum(np.bincount(counts, minlength=len(bounds) + 1))
    rank = q * len(values)
    bucket = int(np.searchsorted(cumulative, rank, side="left") if rank > 0 else np.argmax(cumulative > 0))
    if bucket >= len(bounds):
        return float(bounds[-1])
    lower = float(bounds[bucket - 1]) if bucket > 0 else 0.0
    below = float(cumulative[bucket - 1]) if bucket > 0 else 0.0
    inside = float(cumulative[bucket]) - below
    return lower + (float(bounds[bucket]) - lower) * (rank - below) / inside


def _in(times: FloatArray, start: float, end: float) -> npt.NDArray[np.bool_]:
    return (times >= start) & (times < end)


def _arrived(fleet: Fleet, start_ms: float, end_ms: float) -> float:
    """Requests arriving in ``[start_ms, end_ms)`` (arrivals are in time order)."""
    lo, hi = np.searchsorted(fleet.arrival_ms, [start_ms, end_ms], side="left")
    return float(hi - lo)


def _queues(fleet: Fleet) -> dict[Role, float]:
    """The planner's queue gauges per pool: the front pool's (aggregated workers, or prefill) is the
    router's queue plus its engines' waiting requests; decode's, its engines' waiting requests
    (KV transfers in flight included)."""
    queues = {Role(fleet.front.value): float(fleet.router.queued)}
    for role, engine in zip(fleet.roles, fleet.engines, strict=True):
        pool = Role(role.value)
        queues[pool] = queues.get(pool, 0.0) + engine.num_waiting
    return queues


#: Longest a request may take from arrival to its end (the router's ``request_timeout_s``): the SLO
#: counts of a window look only at requests that arrived this long before it ended.
_LONGEST_MS = 600_000.0


@dataclasses.dataclass(frozen=True, slots=True)
class SloCounts:
    """The router's ``copse_router_slo_requests_total`` increases over a window, by outcome."""

    met: float
    ttft_missed: float
    itl_missed: float
    refused: float


def slo_counts(fleet: Fleet, *, start_ms: float, end_ms: float, limits: Limits) -> SloCounts:
    """How the router judged the requests that ended in ``[start_ms, end_ms)`` (a request ends at
    its last token, or when it is refused) against ``limits``' targets, as it counts them."""
    lo, hi = np.searchsorted(fleet.arrival_ms, [start_ms - _LONGEST_MS, end_ms], side="left")
    window = slice(int(lo), int(hi))
    finish = fleet.finish_ms[window]
    ended = (finish >= start_ms) & (finish < end_ms)
    first = fleet.first_ms[window][ended]
    ttft = first - fleet.arrival_ms[window][ended]
    outputs = fleet.outputs[window][ended]
    with np.errstate(invalid="ignore", divide="ignore"):
        itl = np.where(outputs > 1, (finish[ended] - first) / (outputs - 1), 0.0)
    late = ttft > limits.ttft_ms
    slow = ~late & (itl > limits.itl_ms)
    failed = fleet.failed_ms[window]
    return SloCounts(
        met=float(np.count_nonzero(~late & ~slow)),
        ttft_missed=float(np.count_nonzero(late)),
        itl_missed=float(np.count_nonzero(slow)),
        refused=float(np.count_nonzero((failed >= start_ms) & (failed < end_ms))),
    )


def pulse(fleet: Fleet, *, now_ms: float, window_s: float, limits: Limits) -> Pulse:
    """What the planner's fast loop reads at ``now_ms``: the queue gauges, the router's outstanding
    prefill tokens (``copse_router_worker_prefill_tokens``) and its SLO counters over the last
    ``window_s``."""
    queues = _queues(fleet)
    start_ms = now_ms - window_s * 1000.0
    counts = slo_counts(fleet, start_ms=start_ms, end_ms=now_ms, limits=limits)
    serving = _serving(fleet)
    sequences = fleet.router.sequences
    return Pulse(
        time=now_ms / 1000.0,
        window_s=window_s,
        queue_depth=queues[Role(fleet.front.value)],
        decode_queue_depth=queues.get(Role.DECODE, 0.0),
        router_queue=float(fleet.router.queued),
        prefill_tokens=float(np.sum(sequences.prefill_tokens[: sequences.size])),
        slo_met=counts.met,
        ttft_missed=counts.ttft_missed,
        itl_missed=counts.itl_missed,
        refused=counts.refused,
        arrived=_arrived(fleet, start_ms, now_ms),
        serving=serving.get(Role(fleet.front.value), 0.0),
        decode_serving=serving.get(Role.DECODE),
    )


def _serving(fleet: Fleet) -> dict[Role, float]:
    """Engines scraped per pool: not retired, not draining."""
    serving: dict[Role, float] = {}
    for index, role in enumerate(fleet.roles):
        if index not in fleet.retired_ms and index not in fleet.draining:
            serving[Role(role.value)] = serving.get(Role(role.value), 0.0) + 1.0
    return serving


def observe(
    fleet: Fleet, *, start_ms: float, end_ms: float, quantile: float, limits: Limits | None = None
) -> Observation:
    """What the planner's Prometheus queries return for ``[start_ms, end_ms)``: the router's counters
    and histograms over the window (the SLO counts when ``limits`` give the targets), the queue and
    batch gauges at its end."""
    answered = _in(fleet.finish_ms, start_ms, end_ms) | _in(fleet.failed_ms, start_ms, end_ms)
    finished = _in(fleet.finish_ms, start_ms, end_ms)
    routed = _in(fleet.routed_ms, start_ms, end_ms)
    first = _in(fleet.first_ms, start_ms, end_ms)
    ended = float(answered.sum())
    # the load is what arrived: requests ending in the window lag it by their service, and while a
    # backlog drains they count it on top of the load
    arrived = _arrived(fleet, start_ms, end_ms)
    prompt_tokens = float(fleet.prompts[routed].sum())
    uncached = fleet.prompts[routed] - fleet.predicted_cached[routed]
    outputs = fleet.outputs[finished]
    with np.errstate(invalid="ignore", divide="ignore"):
        itl = (fleet.finish_ms[finished] - fleet.first_ms[finished]) / (outputs - 1)
    itl = itl[outputs > 1]
    ttft = fleet.first_ms[first] - fleet.arrival_ms[first]
    ttft_s = histogram_quantile(quantile, ttft / 1000.0, buckets=LATENCY_BUCKETS)
    queues = _queues(fleet)
    itl_s = histogram_quantile(quantile, itl / 1000.0, buckets=ITL_BUCKETS)
    serving = _serving(fleet)
    counts = None if limits is None else slo_counts(fleet, start_ms=start_ms, end_ms=end_ms, limits=limits)
    return Observation(
        timestamp=start_ms / 1000.0,
        duration_s=(end_ms - start_ms) / 1000.0,
        num_requests=arrived,
        # ratios of increases: no request routed (or ended), no mean (PromQL's 0/0 or x/0)
        isl=prompt_tokens / float(routed.sum()) if routed.any() else None,
        osl=float(outputs.sum()) / ended if ended else None,
        isl_p90=histogram_quantile(0.9, fleet.prompts[routed], buckets=PROMPT_LENGTH_BUCKETS),
        osl_p10=histogram_quantile(0.1, outputs[outputs > 0], buckets=OUTPUT_LENGTH_BUCKETS),
        **{
            field: histogram_quantile(level, uncached, buckets=UNCACHED_PROMPT_BUCKETS)
            for field, level in UNCACHED_QUANTILES.items()
        },
        kv_hit_rate=float(fleet.predicted_cached[routed].sum()) / prompt_tokens if prompt_tokens else None,
        onboard_ms=float(fleet.predicted_onboard_ms[routed].mean()) if routed.any() else None,
        ttft_ms=None if ttft_s is None else ttft_s * 1000.0,
        itl_ms=None if itl_s is None else itl_s * 1000.0,
        # the histograms' _sum / _count: exact means
        ttft_mean_ms=float(ttft.mean()) if len(ttft) else None,
        itl_mean_ms=float(itl.mean()) if len(itl) else None,
        serving=serving.get(Role(fleet.front.value), 0.0),
        decode_serving=serving.get(Role.DECODE),
        queue_depth=queues[Role(fleet.front.value)],
        decode_queue_depth=queues.get(Role.DECODE),
        inflight=float(sum(len(engine.running) for engine in fleet.engines)),
        slo_met=None if counts is None else counts.met,
        ttft_missed=None if counts is None else counts.ttft_missed,
        itl_missed=None if counts is None else counts.itl_missed,
        refused=None if counts is None else counts.refused,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ScalingChange:
    """One decision that changed a pool's replica count."""

    time_s: float
    role: str
    before: int
    after: int
    trigger: str
    """What set the new count (:meth:`copse.planner.core.Decision.trigger`): ``forecast`` or a
    fast-loop signal."""


def flaps(changes: Sequence[ScalingChange], *, window_s: float) -> int:
    """Up-down-up sequences of one pool within ``window_s`` (the scale-down delay): an increase, a
    decrease after it, and an increase again no later than ``window_s`` after the first one. Each
    first increase is counted once."""
    count = 0
    by_role: dict[str, list[ScalingChange]] = {}
    for change in sorted(changes, key=lambda c: c.time_s):
        by_role.setdefault(change.role, []).append(change)
    for series in by_role.values():
        for i, first in enumerate(series):
            if first.after <= first.before:
                continue
            went_down = False
            for later in series[i + 1 :]:
                if later.time_s - first.time_s > window_s:
                    break
                if later.after < later.before:
                    went_down = True
                elif went_down and later.after > later.before:
                    count += 1
                    break
    return count


@dataclasses.dataclass(frozen=True, slots=True)
class TwinSettings:
    """One closed-loop run."""

    fleet: ReplaySettings
    """Routing and engines; ``workers`` replicas of every pool serve at the start (unless
    ``initial`` says otherwise)."""
    limits: Limits
    """Targets and bounds of the deployment: aggregated workers, or prefill and decode pools."""
    planner: PlannerConfig | None = dataclasses.field(default_factory=PlannerConfig)
    """The planner's configuration (predictor, start-up delay, ...); ``None``: a static fleet."""
    interval_s: float = 60.0
    """Seconds between the planner's decisions."""
    warmup_s: float = 0.0
    """Load simulated before results count (the planner learns it; the fleet settles)."""
    initial: Mapping[Role, int] | None = None
    """Replicas per pool at the start (a static disaggregated fleet's sizes); default:
    ``fleet.workers`` for every pool of ``limits``."""

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {self.interval_s}")
        if self.warmup_s < 0:
            raise ValueError(f"warmup_s must not be negative, got {self.warmup_s}")
        pools = self.pools
        if set(pools) != set(self.limits.roles):
            raise ValueError(f"initial replicas for {sorted(pools)}, the deployment has {self.limits.roles}")
        if any(count < 1 for count in pools.values()):
            raise ValueError(f"every pool starts with at least 1 replica, got {dict(pools)}")

    @property
    def pools(self) -> dict[Role, int]:
        """Replicas per pool at the start."""
        if self.initial is not None:
            return dict(self.initial)
        return dict.fromkeys(self.limits.roles, self.fleet.workers)

    @property
    def startup_delay_s(self) -> float:
        """From a scale-up decision to the new replica serving (the planner knows it too): the
        planner config's, else the deployment's (``limits``)."""
        if self.planner is None:
            return 0.0
        configured = self.planner.startup_delay_s
        return self.limits.startup_delay_s if configured is None else configured


@dataclasses.dataclass(frozen=True, slots=True)
class IntervalRow:
    """One planner interval of the measured part of a run."""

    start_s: float
    arrivals: int
    pools: dict[str, int]
    """Replicas serving at the interval's start in each pool (``worker``, or ``prefill`` and
    ``decode``): which pool a disaggregated interval's misses come from."""
    held: int
    """Replicas holding GPUs at the interval's start (starting and draining ones included)."""
    ttft_p99_ms: float
    """p99 TTFT of the requests arriving in the interval (refused ones count as infinite)."""
    itl_p99_ms: float
    """p99 of their mean ITL."""
    slo_ok: bool
    forecast: float | None
    """Requests the planner forecast for the interval (``None`` for a static fleet)."""

    @property
    def serving(self) -> int:
        """Replicas serving at the interval's start (every pool)."""
        return sum(self.pools.values())

    def as_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "serving": self.serving}


@dataclasses.dataclass(frozen=True, slots=True)
class PoolReport:
    """One pool's GPUs over the results window."""

    gpu_hours: float
    mean_replicas: float
    peak_replicas: int
    startup_delay_s: float

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class TwinReport:
    """What a closed-loop (or static) run measured over its results window."""

    predictor: str | None
    """``None`` for a static fleet."""
    startup_delay_s: float
    requests: int
    """Requests that arrived in the results window."""
    failed: int
    slo_attainment: float
    """Share of those requests whose TTFT and mean ITL both met the targets."""
    interval_attainment: float
    """Share of intervals (with arrivals) whose p99 TTFT and p99 ITL met the targets."""
    gpu_hours: float
    """Every pool's."""
    mean_replicas: float
    """Replicas holding GPUs (every pool), time-averaged."""
    peak_replicas: int
    """Most replicas (every pool together) holding GPUs at once."""
    scaling_events: int
    """Decisions in the results window that changed a replica count."""
    pools: dict[Role, PoolReport]
    changes: list[ScalingChange]
    """Every replica count change in the results window, per pool."""
    scale_down_delay_s: float
    window_h: float
    """Length of the results window, hours."""
    ttft_ms: Distribution
    itl_ms: Distribution
    intervals: list[IntervalRow]
    simulated_s: float
    wall_s: float

    @property
    def flaps(self) -> int:
        """Up-down-up sequences of a pool within the scale-down delay."""
        return flaps(self.changes, window_s=self.scale_down_delay_s)

    @property
    def scale_ups(self) -> dict[str, int]:
        """Increases of a pool by what set them (the forecast or a fast-loop signal), each trigger
        listed from 0 for a planner run."""
        counts = dict.fromkeys((FORECAST, *SIGNALS), 0) if self.predictor is not None else {}
        for change in self.changes:
            if change.after > change.before:
                counts[change.trigger] = counts.get(change.trigger, 0) + 1
        return counts

    def as_json(self) -> dict[str, Any]:
        return {
            "predictor": self.predictor,
            "startup_delay_s": self.startup_delay_s,
            "requests": self.requests,
            "failed": self.failed,
            "slo_attainment": self.slo_attainment,
            "interval_attainment": self.interval_attainment,
            "gpu_hours": self.gpu_hours,
            "mean_replicas": self.mean_replicas,
            "peak_replicas": self.peak_replicas,
            "scaling_events": self.scaling_events,
            "scaling_events_per_hour": self.scaling_events / self.window_h if self.window_h else math.nan,
            "flaps": self.flaps,
            "scale_ups": self.scale_ups,
            "pools": {role.value: pool.as_json() for role, pool in self.pools.items()},
            "ttft_ms": self.ttft_ms.as_dict(),
            "itl_ms": self.itl_ms.as_dict(),
            "intervals": [row.as_json() for row in self.intervals],
        }


@dataclasses.dataclass(slots=True)
class Replica:
    """One replica of the deployment."""

    launched_ms: float
    """When it was decided (GPUs held from then)."""
    ready_ms: float
    engine: int | None = None
    """Its engine in the fleet once serving."""
    ended_ms: float | None = None
    """When its GPUs were released (cancelled while starting, or drained)."""


class Replicas:
    """One pool's replicas over time: starting, serving, draining, gone."""

    def __init__(self, fleet: Fleet, *, initial: int, role: Role = Role.WORKER) -> None:
        """The fleet's engines of ``role`` at the start are the pool's ``initial`` replicas."""
        self.fleet = fleet
        self.role = role
        self._engine_role = EngineRole(role.value)
        engines = [i for i, r in enumerate(fleet.roles) if r == self._engine_role][:initial]
        self.all = [Replica(launched_ms=0.0, ready_ms=0.0, engine=i) for i in engines]
        self._starting: list[Replica] = []
        """Replicas not serving yet, in launch order (cancelled ones leave it too)."""

    def held(self) -> int:
        """Replicas the deployment asks for (the spec's count): starting or serving."""
        return sum(1 for r in self.all if r.ended_ms is None and not self._draining(r))

    def serving(self) -> int:
        return sum(
            1 for r in self.all if r.engine is not None and r.ended_ms is None and not self._draining(r)
        )

    def _draining(self, replica: Replica) -> bool:
        return replica.engine is not None and replica.engine in self.fleet.draining

    def settle(self) -> None:
        """Release the GPUs of drained engines."""
        retired = self.fleet.retired_ms
        for replica in self.all:
            if replica.ended_ms is None and replica.engine is not None:
                at = retired.get(replica.engine)
                if at is not None:
                    replica.ended_ms = at

    def next_ready_ms(self) -> float:
        return min((r.ready_ms for r in self._starting), default=math.inf)

    def start_ready(self, now_ms: float) -> None:
        for replica in [r for r in self._starting if r.ready_ms <= now_ms]:
            replica.engine = self.fleet.add_engine(self._engine_role)
            self._starting.remove(replica)

    def apply(self, target: int, *, now_ms: float, startup_delay_s: float) -> None:
        held = self.held()
        for _ in range(target - held):
            replica = Replica(launched_ms=now_ms, ready_ms=now_ms + startup_delay_s * 1000.0)
            self.all.append(replica)
            self._starting.append(replica)
        if startup_delay_s == 0:
            self.start_ready(now_ms)
        excess = held - target
        for replica in reversed(self.all):  # newest first: cancel start-ups, then drain
            if excess <= 0:
                break
            if replica.ended_ms is not None or self._draining(replica):
                continue
            if replica.engine is None:
                replica.ended_ms = now_ms
                self._starting.remove(replica)
            else:
                self.fleet.drain(replica.engine)
            excess -= 1
        self.settle()

    def spans(self, *, start_ms: float, end_ms: float) -> list[tuple[float, float]]:
        """(from, to) of every replica's GPUs held within ``[start_ms, end_ms)``."""
        self.settle()
        out = []
        for replica in self.all:
            ended = end_ms if replica.ended_ms is None else min(replica.ended_ms, end_ms)
            begun = max(replica.launched_ms, start_ms)
            if begun < ended:
                out.append((begun, ended))
        return out


def peak(spans: Sequence[tuple[float, float]]) -> int:
    """Most spans open at once (at equal times a close sorts before an open)."""
    changes = sorted([(begun, 1) for begun, _ in spans] + [(ended, -1) for _, ended in spans])
    held = most = 0
    for _, change in changes:
        held += change
        most = max(most, held)
    return most


def run_twin(
    trace: Sequence[TraceRequest],
    settings: TwinSettings,
    *,
    end_s: float | None = None,
    progress: Callable[[float], object] | None = None,
) -> TwinReport:
    """Serve ``trace`` (timestamps in ms from the load's start, divided by the fleet's speedup)
    under the planner, or statically; the load ends at ``end_s`` (default: the last arrival).
    ``progress`` gets the simulated seconds of each interval as it completes."""
    started = time.perf_counter()
    if not trace:
        raise ValueError("no requests to serve")
    initial = settings.pools
    fleet = Fleet(trace, settings.fleet, engines={EngineRole(r.value): n for r, n in initial.items()})
    arrival = fleet.arrival_ms
    end_ms = float(arrival[-1]) if end_s is None else end_s * 1000.0
    warmup_ms = settings.warmup_s * 1000.0
    if warmup_ms >= end_ms:
        raise ValueError(f"the warm-up ({settings.warmup_s:g} s) covers the whole load ({end_ms / 1000:g} s)")
    limits = settings.limits
    pools = {role: Replicas(fleet, initial=count, role=role) for role, count in initial.items()}
    planner: Planner | None = None
    if settings.planner is not None:
        # The planner knows the router it sizes for: its busy fraction is when requests wait.
        config = settings.planner.model_copy(
            update={"router_busy_kv_fraction": settings.fleet.thresholds.busy_kv_fraction}
        )
        capacity = capacity_for(fleet.router_perf, config=config, limits=limits)
        planner = Planner(config=config, limits=limits, capacity=capacity, interval_s=settings.interval_s)
    interval_ms = settings.interval_s * 1000.0
    poll_ms = math.inf if settings.planner is None else settings.planner.fast_path_poll_s * 1000.0
    boundary = interval_ms
    poll = poll_ms
    next_arrival = 0
    decisions: list[tuple[float, Decision]] = []
    changes: list[tuple[float, Role, int, int, str]] = []  # (time ms, pool, held before, target, trigger)
    starts: list[tuple[float, dict[str, int], int]] = [(0.0, *_counts(pools))]
    delay = settings.startup_delay_s

    def held() -> dict[Role, int]:
        return {role: pool.held() for role, pool in pools.items()}

    def decide(decision: Decision, now_ms: float) -> None:
        decisions.append((now_ms, decision))
        for role, pool in pools.items():
            before, target = pool.held(), decision.target[role]
            if target != before:
                changes.append((now_ms, role, before, target, decision.trigger(role)))
            pool.apply(target, now_ms=now_ms, startup_delay_s=delay)

    n_arrivals = len(arrival)
    arrival_list = arrival.tolist()
    while True:
        upcoming = arrival_list[next_arrival] if next_arrival < n_arrivals else math.inf
        ready = min(pool.next_ready_ms() for pool in pools.values())
        now = min(
            upcoming,
            ready if ready <= end_ms else math.inf,
            boundary if boundary <= end_ms else math.inf,
            poll if poll < boundary and poll <= end_ms else math.inf,
        )
        if now == math.inf:
            break
        fleet.run_until(now)
        if ready <= now:
            for pool in pools.values():
                pool.start_ready(now)
        if boundary <= now:
            if planner is not None:
                obs = observe(
                    fleet,
                    start_ms=boundary - interval_ms,
                    end_ms=boundary,
                    quantile=planner.config.quantile,
                    limits=limits,
                )
                decide(planner.step(obs, current=held()), now)
            starts.append((boundary, *_counts(pools)))
            if progress is not None:
                progress(settings.interval_s)
            poll = boundary + poll_ms
            boundary += interval_ms
        elif poll <= now:
            assert planner is not None
            signals = pulse(fleet, now_ms=now, window_s=planner.config.burn_window_s, limits=limits)
            fast = planner.fast_path(now=now / 1000.0, current=held(), pulse=signals)
            if fast is not None:
                decide(fast, now)
            poll += poll_ms
        if upcoming <= now:
            fleet.arrive(next_arrival)
            next_arrival += 1
    fleet.run()
    for pool in pools.values():
        pool.settle()
    return _report(
        fleet=fleet,
        settings=settings,
        pools=pools,
        decisions=decisions,
        changes=changes,
        starts=starts,
        warmup_ms=warmup_ms,
        end_ms=end_ms,
        started=started,
    )


def _counts(pools: Mapping[Role, Replicas]) -> tuple[dict[str, int], int]:
    """(replicas serving in each pool, replicas held over every pool)."""
    return {role.value: p.serving() for role, p in pools.items()}, sum(p.held() for p in pools.values())


def _report(
    *,
    fleet: Fleet,
    settings: TwinSettings,
    pools: Mapping[Role, Replicas],
    decisions: list[tuple[float, Decision]],
    changes: list[tuple[float, Role, int, int, str]],
    starts: list[tuple[float, dict[str, int], int]],
    warmup_ms: float,
    end_ms: float,
    started: float,
) -> TwinReport:
    limits = settings.limits
    arrival = fleet.arrival_ms
    window = (arrival >= warmup_ms) & (arrival < end_ms)
    ttft = fleet.first_ms - arrival
    outputs = fleet.outputs
    with np.errstate(invalid="ignore", divide="ignore"):
        itl = np.where(outputs > 1, (fleet.finish_ms - fleet.first_ms) / (outputs - 1), 0.0)
    done = ~np.isnan(fleet.finish_ms)
    ok = done & (ttft <= limits.ttft_ms) & (itl <= limits.itl_ms)
    rows: list[IntervalRow] = []
    forecasts = {round(t): d.next_forecast for t, d in decisions if d.next_forecast is not None}
    interval_ms = settings.interval_s * 1000.0
    # requests by interval of arrival: one sort instead of a mask per interval
    order = np.argsort(arrival, kind="stable")
    sorted_arrival = arrival[order]
    for start_ms, serving, held in starts:
        if start_ms < warmup_ms or start_ms >= end_ms:
            continue
        lo, hi = np.searchsorted(sorted_arrival, [start_ms, min(start_ms + interval_ms, end_ms)], side="left")
        members = order[lo:hi]
        count = len(members)
        if not count:
            continue
        # a refused or unfinished request counts as an infinite latency
        finished = done[members]
        ttft_p99 = float(np.percentile(np.where(finished, ttft[members], np.inf), 99, method="higher"))
        itl_p99 = float(np.percentile(np.where(finished, itl[members], np.inf), 99, method="higher"))
        forecast = forecasts.get(round(start_ms))
        rows.append(
            IntervalRow(
                start_s=start_ms / 1000.0,
                arrivals=count,
                pools=serving,
                held=held,
                ttft_p99_ms=ttft_p99,
                itl_p99_ms=itl_p99,
                slo_ok=ttft_p99 <= limits.ttft_ms and itl_p99 <= limits.itl_ms,
                forecast=None if forecast is None else forecast.num_requests,
            )
        )
    span_s = (end_ms - warmup_ms) / 1000.0
    delay = settings.startup_delay_s
    reports: dict[Role, PoolReport] = {}
    every: list[tuple[float, float]] = []
    seconds = 0.0
    for role, pool in pools.items():
        spans = pool.spans(start_ms=warmup_ms, end_ms=end_ms)
        every += spans
        held_s = sum(ended - begun for begun, ended in spans) / 1000.0
        gpus = limits.gpus_per_replica[role]
        seconds += held_s * gpus
        reports[role] = PoolReport(
            gpu_hours=held_s * gpus / 3600.0,
            mean_replicas=held_s / span_s,
            peak_replicas=peak(spans),
            startup_delay_s=delay,
        )
    measured = {t for t, *_ in changes if warmup_ms <= t < end_ms}
    requests = int(window.sum())
    return TwinReport(
        predictor=None if settings.planner is None else settings.planner.predictor,
        startup_delay_s=delay,
        requests=requests,
        failed=int((window & ~np.isnan(fleet.failed_ms)).sum()),
        slo_attainment=float((ok & window).sum()) / requests if requests else math.nan,
        interval_attainment=sum(row.slo_ok for row in rows) / len(rows) if rows else math.nan,
        gpu_hours=seconds / 3600.0,
        mean_replicas=sum(r.mean_replicas for r in reports.values()),
        peak_replicas=peak(every),
        scaling_events=len(measured),
        pools=reports,
        changes=[
            ScalingChange(time_s=t / 1000.0, role=role.value, before=before, after=after, trigger=trigger)
            for t, role, before, after, trigger in changes
            if warmup_ms <= t < end_ms
        ],
        scale_down_delay_s=limits.scale_down_delay_s,
        window_h=span_s / 3600.0,
        ttft_ms=Distribution.of(ttft[window & done]),
        itl_ms=Distribution.of(np.where(outputs > 1, itl, np.nan)[window & done]),
        intervals=rows,
        simulated_s=fleet.now_ms / 1000.0,
        wall_s=time.perf_counter() - started,
    )
