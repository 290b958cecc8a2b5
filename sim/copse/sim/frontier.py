"""The static frontier a planner run is judged against: every static fleet size on the same
arrivals, and where the planner sits among them.

A static fleet of ``n`` replicas reaches some per-request attainment at ``n`` x hours GPU-hours;
the sizes in order trace a frontier of attainment against cost. The planner's run is one point.
Two readings compare it with the frontier:

* **ratio at equal attainment**: the planner's GPU-hours over the static GPU-hours interpolated
  (linearly, between the two neighbouring sizes) at the planner's attainment. Below 1 the planner
  buys that attainment cheaper than any fixed fleet; ``None`` when no static size up to the
  largest simulated reaches it (the planner beats every fixed fleet of that range).
* **static attainment at equal cost**: the attainment a static fleet interpolated at the planner's
  GPU-hours reaches, next to the planner's own.

:func:`search` chooses the sizes: from the largest that misses both the goal and the planner's
attainment (the fewest that serves the comparison) up to the first that reaches both, simulated
two at a time when a pool of processes runs them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import math
import multiprocessing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from copse.api import Role
from copse.sim.trace import TraceRequest
from copse.sim.twin import TwinReport, TwinSettings, run_twin


@dataclasses.dataclass(frozen=True, slots=True)
class StaticPoint:
    """One static fleet size as simulated."""

    replicas: int
    """The size walked over: aggregated workers, or replicas of the larger pool of a disaggregated
    fleet (the other pool in the planner's proportion)."""
    slo_attainment: float
    gpu_hours: float
    pools: dict[str, int] = dataclasses.field(default_factory=dict)
    """Replicas per pool."""

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _interpolate(x: float, points: Sequence[tuple[float, float]]) -> float | None:
    """``y`` at ``x`` on the polyline through ``points`` (sorted by size, so ``x`` rises along it
    but for noise): between the first neighbours ``x0 <= x <= x1``; ``None`` beyond its ends."""
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if points and points[0][0] == x:
        return points[0][1]
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Frontier:
    """The static sizes simulated and the planner's place among them."""

    static: tuple[StaticPoint, ...]
    """Sorted by replicas (a walk) or GPU-hours (:meth:`efficient`)."""
    goal: float
    """Per-request attainment the static search went up to."""

    @classmethod
    def efficient(cls, points: Iterable[StaticPoint], *, goal: float) -> Frontier:
        """The frontier of static fleets given rather than walked (several prefill/decode splits,
        say): by GPU-hours, each fleet that attains more than every cheaper one; a fleet another
        attains as much as for no more GPU-hours is not one hindsight would pick."""
        kept: list[StaticPoint] = []
        for point in sorted(points, key=lambda p: (p.gpu_hours, -p.slo_attainment)):
            if not kept or point.slo_attainment > kept[-1].slo_attainment:
                kept.append(point)
        return cls(static=tuple(kept), goal=goal)

    @property
    def first_meeting_goal(self) -> StaticPoint | None:
        """The fewest static replicas reaching the goal (hindsight's best static fleet)."""
        return next((p for p in self.static if p.slo_attainment >= self.goal), None)

    def static_gpu_hours_at(self, attainment: float) -> float | None:
        """Static GPU-hours interpolated at ``attainment``."""
        return _interpolate(attainment, [(p.slo_attainment, p.gpu_hours) for p in self.static])

    def static_attainment_at(self, gpu_hours: float) -> float | None:
        """Static attainment interpolated at ``gpu_hours``."""
        return _interpolate(gpu_hours, [(p.gpu_hours, p.slo_attainment) for p in self.static])

    def ratio_at_equal_attainment(self, *, attainment: float, gpu_hours: float) -> float | None:
        static = self.static_gpu_hours_at(attainment)
        return None if static is None or static <= 0 else gpu_hours / static

    def as_json(self, *, attainment: float, gpu_hours: float) -> dict[str, Any]:
        best = self.first_meeting_goal
        return {
            "goal": self.goal,
            "static": [p.as_json() for p in self.static],
            "first_meeting_goal": None if best is None else best.replicas,
            "static_gpu_hours_at_equal_attainment": self.static_gpu_hours_at(attainment),
            "ratio_at_equal_attainment": self.ratio_at_equal_attainment(
                attainment=attainment, gpu_hours=gpu_hours
            ),
            "static_attainment_at_equal_cost": self.static_attainment_at(gpu_hours),
            "ratio_vs_first_meeting_goal": None if best is None else gpu_hours / best.gpu_hours,
        }


def search(
    simulate: Callable[[Sequence[int]], Sequence[StaticPoint]],
    *,
    start: int,
    low_bar: float,
    high_bar: float,
    max_replicas: int,
    width: int = 2,
) -> Frontier:
    """Static sizes around ``start`` (e.g. the planner's mean replicas), ``width`` at a time
    (``simulate`` runs a batch of sizes, in parallel if it can): down until a size misses
    ``low_bar`` (or 1 replica), up until one reaches ``high_bar`` (or ``max_replicas``). The bars
    are the lower and the higher of the goal and the planners' attainments. Attainment is taken to
    grow with the size; the walk stops at the first size past each end, and stops going up when
    the sizes it adds all fall below the best attainment seen (larger fleets no longer help)."""
    if not 1 <= start <= max_replicas:
        raise ValueError(f"start {start} must lie in [1, {max_replicas}]")
    points: dict[int, StaticPoint] = {}

    def run(sizes: list[int]) -> None:
        for point in simulate(sizes):
            points[point.replicas] = point

    run(list(range(start, min(start + width, max_replicas + 1))))
    growing = True
    while True:
        lowest, highest = min(points), max(points)
        need_down = lowest > 1 and points[lowest].slo_attainment >= low_bar
        need_up = growing and highest < max_replicas and points[highest].slo_attainment < high_bar
        if not (need_down or need_up):
            break
        if need_up and need_down:
            batch = [highest + 1, lowest - 1] if width > 1 else [highest + 1]
        elif need_up:
            batch = list(range(highest + 1, min(highest + width, max_replicas) + 1))
        else:
            batch = list(range(max(1, lowest - width), lowest))
        before = max(p.slo_attainment for p in points.values())
        run(batch)
        if need_up and max(points[n].slo_attainment for n in batch if n > highest) < before:
            growing = False  # larger fleets stopped helping: no size ahead is taken to reach the bar
    return Frontier(static=tuple(points[n] for n in sorted(points)), goal=high_bar)


def static_pools(size: int, *, roles: Sequence[Role], split: Mapping[Role, float]) -> dict[Role, int]:
    """The pools of static size ``size``: that many aggregated workers; for a disaggregated fleet,
    ``size`` replicas of the pool ``split`` holds more of (the planner's mean replicas per pool)
    and the other in proportion (rounded, at least 1), so the walk moves in single replicas of
    the larger pool."""
    if Role.PREFILL not in roles:
        return {Role.WORKER: size}
    larger = max((Role.PREFILL, Role.DECODE), key=lambda role: split.get(role, 0.0))
    other = Role.DECODE if larger is Role.PREFILL else Role.PREFILL
    ratio = split.get(other, 0.0) / split[larger] if split.get(larger, 0.0) > 0 else 1.0
    return {larger: size, other: max(1, round(size * ratio))}


_JOB: dict[str, Any] = {}
"""The load and settings of this worker process's runs (set once per process)."""


def _init(trace: Sequence[TraceRequest], settings: TwinSettings, end_s: float | None) -> None:
    _JOB.update(trace=trace, settings=settings, end_s=end_s)


def _run(changes: Mapping[str, Any]) -> TwinReport:
    settings = dataclasses.replace(_JOB["settings"], **changes)
    report: TwinReport = run_twin(_JOB["trace"], settings, end_s=_JOB["end_s"])
    return report


class TwinPool:
    """Runs of one load in ``jobs`` processes: each is ``settings`` with some fields replaced (a
    planner config, a static fleet). The processes are forked, so they inherit the requests instead
    of unpickling them. Use as a context manager."""

    def __init__(
        self, trace: Sequence[TraceRequest], settings: TwinSettings, *, end_s: float | None, jobs: int
    ) -> None:
        self.settings = settings
        self.jobs = max(1, jobs)
        self._pool = concurrent.futures.ProcessPoolExecutor(
            self.jobs,
            mp_context=multiprocessing.get_context("fork"),
            initializer=_init,
            initargs=(trace, settings, end_s),
        )

    def __enter__(self) -> TwinPool:
        return self

    def __exit__(self, *_: object) -> None:
        self._pool.shutdown()

    def map(self, changes: Sequence[Mapping[str, Any]]) -> list[TwinReport]:
        return list(self._pool.map(_run, changes))


def run_frontier(
    pool: TwinPool,
    planners: Sequence[TwinReport],
    *,
    goal: float,
    on_static: Callable[[int, TwinReport], object] | None = None,
) -> tuple[Frontier, dict[int, TwinReport]]:
    """Every static size :func:`search` needs to place the ``planners`` (runs of the pool's settings)
    on the frontier, simulated on the same arrivals. A disaggregated fleet's static sizes keep the
    planners' mean prefill-to-decode ratio, walking the larger pool (:func:`static_pools`).
    ``on_static`` sees each static run as it completes."""
    limits = pool.settings.limits
    split = {role: sum(p.pools[role].mean_replicas for p in planners) for role in limits.roles}
    walked = max(limits.roles, key=lambda role: split[role])
    reports: dict[int, TwinReport] = {}

    def simulate(sizes: Sequence[int]) -> list[StaticPoint]:
        batch = [static_pools(n, roles=limits.roles, split=split) for n in sizes]
        points = []
        runs = pool.map([{"planner": None, "initial": pools} for pools in batch])
        for n, pools, report in zip(sizes, batch, runs, strict=True):
            reports[n] = report
            if on_static is not None:
                on_static(n, report)
            points.append(static_point(n, pools=pools, report=report))
        return points

    mean = sorted(p.pools[walked].mean_replicas for p in planners)[len(planners) // 2]
    attainments = [p.slo_attainment for p in planners]
    frontier = search(
        simulate,
        start=start_size(mean, max_replicas=limits.max_replicas),
        low_bar=min(goal, *attainments),
        high_bar=max(goal, *attainments),
        max_replicas=limits.max_replicas,
        width=pool.jobs,
    )
    return dataclasses.replace(frontier, goal=goal), reports


def static_point(size: int, *, pools: Mapping[Role, int], report: TwinReport) -> StaticPoint:
    """The frontier's point of a static run of ``pools`` (walked as ``size``)."""
    return StaticPoint(
        replicas=size,
        slo_attainment=report.slo_attainment,
        gpu_hours=report.gpu_hours,
        pools={role.value: count for role, count in pools.items()},
    )


def start_size(mean_replicas: float, *, max_replicas: int) -> int:
    """Where the static walk starts: the planners' mean fleet, rounded, within bounds."""
    return min(max_replicas, max(1, math.floor(mean_replicas + 0.5)))
