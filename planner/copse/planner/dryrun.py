"""Replaying recorded load through the planner, with honest latency estimates.

For each interval ``t`` of the recording:

1. The planner decides at the start of ``t`` having seen only intervals before ``t``.
2. Scale-ups take effect ``startup_delay_s`` after the decision (the new replicas hold their GPUs,
   and count in GPU-hours, while they start); scale-downs take effect at once, never below what
   in-flight work needs (the planner's floors), and cancel replicas still starting first.
3. The interval's *actual* load is served by the replicas serving in each part of it (split where
   a start-up completes), through the capacity model with queueing; a backlog left by an
   overloaded part carries over. The interval's p99 estimate is the worst of its parts, so a burst
   that finds too few replicas is a miss (an alert signal, as in a cluster).
4. The SLO is judged per request, as ``copse bench planner`` and the router judge it (TTFT and the
   mean inter-token gap both within target), estimated: each part's share of requests meeting both
   (:meth:`~copse.planner.capacity.CapacityModel.attainment`), none of them while a part leaves a
   backlog (they queue behind it), weighted by the part's requests. The summary's
   ``slo_attainment`` is that share of all requests.
5. The planner then observes the interval (with the simulated queue and in-flight sequences).

Observed TTFT/ITL in the recording are not fed back: they were measured on the recorded
deployment's replicas, not on the simulated ones, so correction factors stay at 1 here. Nor are
its SLO counts: the error budget is paced on the estimated share of each interval's requests
within the SLO on the simulated replicas.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any

from tqdm import tqdm

from copse.api import Role
from copse.planner.capacity import Backlog, CapacityModel, Estimate, Workload
from copse.planner.core import Decision, Planner, workload_of
from copse.planner.observations import Observation
from copse.planner.policy import Limits, clamp, fit_budget

#: What the dry run's figures are: the capacity model's estimates, no request simulated (``copse bench
#: planner`` simulates every request).
METHOD = "analytic estimate"


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntervalResult:
    """One row of the dry run."""

    timestamp: float
    num_requests: float
    predicted_num_requests: float
    replicas: dict[Role, int]
    """Replicas serving at the start of the interval, per pool."""
    gpus: int
    """GPUs held at the start of the interval (including replicas still starting)."""
    est_ttft_ms: float
    est_itl_ms: float
    slo_ok: bool
    """The interval's p99 estimates within the targets (an alert signal)."""
    est_attainment: float
    """Estimated share of the interval's requests meeting the per-request SLO."""
    decision: Decision
    """The decision made at the start of this interval."""

    def as_json(self) -> dict[str, Any]:
        worker = self.replicas.get(Role.WORKER)
        return {
            "timestamp": self.timestamp,
            "num_requests": self.num_requests,
            "predicted_num_requests": round(self.predicted_num_requests, 3),
            # Aggregated workers do both phases: both columns show the same count.
            "prefill_replicas": worker if worker is not None else self.replicas[Role.PREFILL],
            "decode_replicas": worker if worker is not None else self.replicas[Role.DECODE],
            "est_ttft_ms": round(self.est_ttft_ms, 3),
            "est_itl_ms": round(self.est_itl_ms, 3),
            "slo_ok": self.slo_ok,
            "est_attainment": round(self.est_attainment, 6),
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Summary:
    gpu_hours: float
    """GPU-hours the planned deployment held, starting replicas included."""
    static_peak_gpu_hours: float
    """GPU-hours of a fixed deployment sized (same model, same bounds) for the busiest interval."""
    slo_attainment: float
    """Estimated share of requests meeting the per-request SLO (TTFT and mean inter-token gap)."""
    interval_attainment: float
    """Fraction of intervals whose estimated p99 TTFT and ITL both meet the targets."""
    scaling_events: int
    """Decisions that changed at least one pool."""
    static_peak_replicas: dict[Role, int]
    """The fixed deployment behind static_peak_gpu_hours."""
    static_slo_attainment: float
    """slo_attainment (per request, estimated) of that fixed deployment on the same load."""

    def as_json(self) -> dict[str, Any]:
        return {
            "method": METHOD,
            "gpu_hours": round(self.gpu_hours, 4),
            "static_peak_gpu_hours": round(self.static_peak_gpu_hours, 4),
            "slo_attainment": round(self.slo_attainment, 6),
            "interval_attainment": round(self.interval_attainment, 6),
            "scaling_events": self.scaling_events,
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class DryRunResult:
    intervals: list[IntervalResult]
    summary: Summary
    limits: Limits

    def as_json(self) -> dict[str, Any]:
        return {
            "intervals": [row.as_json() for row in self.intervals],
            "summary": self.summary.as_json(),
        }


class _Pool:
    """One pool's replicas over time: serving, and starting (ready at a given time)."""

    def __init__(self, replicas: int) -> None:
        self.serving = replicas
        self.starting: list[tuple[float, int]] = []

    @property
    def held(self) -> int:
        return self.serving + sum(count for _, count in self.starting)

    def apply(self, target: int, *, now: float, startup_delay_s: float) -> None:
        if target > self.held:
            if startup_delay_s > 0:
                self.starting.append((now + startup_delay_s, target - self.held))
            else:
                self.serving += target - self.held
            return
        excess = self.held - target
        while excess and self.starting:  # cancel the newest start-ups first
            ready, count = self.starting.pop()
            if count > excess:
                self.starting.append((ready, count - excess))
                excess = 0
            else:
                excess -= count
        self.serving -= excess

    def promote(self, now: float) -> None:
        ready = [entry for entry in self.starting if entry[0] <= now]
        self.serving += sum(count for _, count in ready)
        self.starting = [entry for entry in self.starting if entry[0] > now]


def _load(obs: Observation, *, backlog: Backlog, previous: Workload | None) -> Workload | None:
    """The interval's workload; an interval without arrivals still drains a backlog of the last
    requests' shape, and needs no estimate without one."""
    if obs.num_requests > 0:
        return workload_of(obs)
    if previous is None or (backlog.prefill <= 0 and backlog.decode <= 0):
        return None
    return dataclasses.replace(previous, rate=0.0)


def _share(
    capacity: CapacityModel, *, replicas: dict[Role, int], load: Workload, estimate: Estimate, limits: Limits
) -> float:
    """Estimated share of ``load``'s requests meeting the per-request SLO on ``replicas``: the
    steady state's, and none while the part leaves a backlog (they wait behind it)."""
    if estimate.backlog.prefill > 0 or estimate.backlog.decode > 0:
        return 0.0
    return capacity.attainment(
        replicas=replicas, load=load, ttft_ms=limits.ttft_ms, itl_ms=limits.itl_ms
    ).both


def _serve(
    *,
    capacity: CapacityModel,
    pools: dict[Role, _Pool],
    load: Workload | None,
    obs: Observation,
    backlog: Backlog,
    limits: Limits,
) -> tuple[Estimate, Backlog, float, float]:
    """(worst estimate over the interval's parts, backlog at its end, GPU-seconds held, estimated
    share of its requests meeting the SLO)."""
    start, end = obs.timestamp, obs.timestamp + obs.duration_s
    cuts = sorted({ready for pool in pools.values() for ready, _ in pool.starting if start < ready < end})
    edges = [start, *cuts, end]
    worst_ttft = worst_itl = 0.0
    gpu_seconds = met = 0.0
    last: Estimate | None = None
    for left, right in itertools.pairwise(edges):
        for pool in pools.values():
            pool.promote(left)
        duration = right - left
        gpu_seconds += duration * sum(
            pool.held * limits.gpus_per_replica[role] for role, pool in pools.items()
        )
        replicas = {role: pool.serving for role, pool in pools.items()}
        if load is None:
            continue
        last = capacity.estimate(replicas=replicas, load=load, duration_s=duration, backlog=backlog)
        backlog = last.backlog
        worst_ttft, worst_itl = max(worst_ttft, last.ttft_ms), max(worst_itl, last.itl_ms)
        met += duration * _share(capacity, replicas=replicas, load=load, estimate=last, limits=limits)
    for pool in pools.values():
        pool.promote(end)
    estimate = Estimate(
        ttft_ms=worst_ttft, itl_ms=worst_itl, backlog=backlog, decoding=last.decoding if last else 0.0
    )
    return estimate, backlog, gpu_seconds, met / (end - start) if last is not None else 1.0


def dry_run(
    observations: Sequence[Observation],
    *,
    planner: Planner,
    startup_delay_s: float,
    progress: bool = False,
    on_interval: Callable[[IntervalResult], None] | None = None,
) -> DryRunResult:
    """Replay ``observations`` through ``planner`` (see the module docstring)."""
    if not observations:
        raise ValueError("nothing to replay: no intervals")
    limits, capacity = planner.limits, planner.capacity
    initial = fit_budget(clamp({}, limits), limits)
    pools = {role: _Pool(initial[role]) for role in limits.roles}
    backlog = Backlog()
    shape: Workload | None = None
    queues: dict[Role, float] = {}
    inflight: float | None = None
    rows: list[IntervalResult] = []
    gpu_seconds = 0.0
    events = 0
    for obs in tqdm(observations, disable=not progress, file=sys.stderr, unit="interval", leave=False):
        now = obs.timestamp
        for pool in pools.values():
            pool.promote(now)
        current = {role: pool.held for role, pool in pools.items()}
        decision = planner.decide(now=now, current=current, queues=queues, inflight=inflight)
        if decision.changed:
            events += 1
        for role, pool in pools.items():
            pool.apply(decision.target[role], now=now, startup_delay_s=startup_delay_s)
        serving = {role: pool.serving for role, pool in pools.items()}
        held = limits.gpus({role: pool.held for role, pool in pools.items()})
        load = _load(obs, backlog=backlog, previous=shape)
        shape = load or shape
        estimate, backlog, seconds, share = _serve(
            capacity=capacity, pools=pools, load=load, obs=obs, backlog=backlog, limits=limits
        )
        gpu_seconds += seconds
        row = IntervalResult(
            timestamp=obs.timestamp,
            num_requests=obs.num_requests,
            predicted_num_requests=decision.next_forecast.num_requests if decision.next_forecast else 0.0,
            replicas=serving,
            gpus=held,
            est_ttft_ms=estimate.ttft_ms,
            est_itl_ms=estimate.itl_ms,
            slo_ok=estimate.ttft_ms <= limits.ttft_ms and estimate.itl_ms <= limits.itl_ms,
            est_attainment=share,
            decision=decision,
        )
        rows.append(row)
        if on_interval is not None:
            on_interval(row)
        queues = {limits.front: backlog.prefill}
        if limits.disaggregated:
            queues[Role.DECODE] = backlog.decode
        inflight = estimate.decoding
        # The SLO counts are the dry run's own estimate, not the recorded fleet's: they pace the
        # error budget as the router's would count the simulated replicas.
        planner.observe(
            dataclasses.replace(
                obs,
                ttft_ms=None,
                itl_ms=None,
                queue_depth=backlog.prefill,
                inflight=inflight,
                slo_met=row.est_attainment * obs.num_requests,
                ttft_missed=(1.0 - row.est_attainment) * obs.num_requests,
                itl_missed=None,
                refused=None,
            ),
            replicas=serving,
        )
    static, static_ok = _static_peak(observations, planner=planner)
    total_s = sum(obs.duration_s for obs in observations)
    summary = Summary(
        gpu_hours=gpu_seconds / 3600.0,
        static_peak_gpu_hours=limits.gpus(static) * total_s / 3600.0,
        slo_attainment=_weighted([(row.est_attainment, row.num_requests) for row in rows]),
        interval_attainment=sum(row.slo_ok for row in rows) / len(rows),
        scaling_events=events,
        static_peak_replicas=static,
        static_slo_attainment=static_ok,
    )
    return DryRunResult(intervals=rows, summary=summary, limits=limits)


def _static_peak(observations: Sequence[Observation], *, planner: Planner) -> tuple[dict[Role, int], float]:
    """The fixed deployment sized for the busiest interval's actual load (at the goal itself, unpaced),
    and its SLO attainment."""
    limits, capacity = planner.limits, planner.capacity
    peak = dict.fromkeys(limits.roles, 0)
    for obs in observations:
        if obs.num_requests <= 0:
            continue
        for role, sizing in planner.size(workload_of(obs), goal=planner.config.attainment_goal).items():
            peak[role] = max(peak[role], sizing.replicas)
    fixed = fit_budget(clamp(peak, limits), limits)
    backlog, shape = Backlog(), None
    shares: list[tuple[float, float]] = []
    for obs in observations:
        load = _load(obs, backlog=backlog, previous=shape)
        shape = load or shape
        if load is None:
            continue
        estimate = capacity.estimate(replicas=fixed, load=load, duration_s=obs.duration_s, backlog=backlog)
        backlog = estimate.backlog
        share = _share(capacity, replicas=fixed, load=load, estimate=estimate, limits=limits)
        shares.append((share, obs.num_requests))
    return fixed, _weighted(shares)


def _weighted(shares: Sequence[tuple[float, float]]) -> float:
    """The mean of shares weighted by requests (1.0 without requests: nothing missed)."""
    total = sum(weight for _, weight in shares)
    return sum(share * weight for share, weight in shares) / total if total > 0 else 1.0


def write_json(result: DryRunResult, handle: IO[str]) -> None:
    json.dump(result.as_json(), handle, indent=1)
    handle.write("\n")
