"""``copse planner run``: the live loop around the pure planner.

Every interval: read the deployment (its bounds and targets may have been edited), read the
interval's metrics, learn from them, decide, log the decision with its numbers, export it as
metrics, and patch (or, observe-only, recommend) it. Between intervals the queue gauges are
polled; a queue beyond ``scaleUpTrigger.queueDepth`` per replica triggers an immediate scale-up
(the fast path), which never removes capacity.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable

from copse.api import InferenceDeployment
from copse.planner.actuator import Actuator, ActuatorError, replicas_of
from copse.planner.capacity import capacity_for
from copse.planner.config import PlannerConfig
from copse.planner.core import Decision, Planner
from copse.planner.metrics import PlannerMetrics
from copse.planner.observations import Observation, Pulse
from copse.planner.policy import Limits
from copse.planner.prometheus import PrometheusError, PrometheusSource
from copse.workers.perf import PerfModel

logger = logging.getLogger(__name__)


class Runner:
    """One deployment's planner with its actuator and metrics."""

    def __init__(
        self,
        *,
        config: PlannerConfig,
        actuator: Actuator,
        perf: PerfModel,
        metrics: PlannerMetrics,
        interval_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.actuator = actuator
        self.perf = perf
        self.metrics = metrics
        self.interval_s = interval_s
        self.clock = clock
        self.planner: Planner | None = None
        self._lock = asyncio.Lock()
        self.log_context = {"namespace": actuator.namespace, "deployment": actuator.name}

    @property
    def limits(self) -> Limits:
        if self.planner is None:
            raise RuntimeError("the runner has not read its deployment yet (call prime())")
        return self.planner.limits

    def _sync(self, limits: Limits) -> Planner:
        """The planner for ``limits``: limits follow the deployment; a changed pool layout starts over."""
        capacity = capacity_for(self.perf, config=self.config, limits=limits)
        if self.planner is None or self.planner.limits.roles != limits.roles:
            if self.planner is not None:
                logger.warning(
                    "pool layout changed to %s: forecasts start over", limits.roles, extra=self.log_context
                )
            for role, gpus in limits.gpus_per_replica.items():
                if gpus != self.perf.gpus_per_engine:
                    logger.warning(
                        "%s groups have %d GPUs but the profile describes engines of %d: its per-engine "
                        "figures are used as they are",
                        role.value,
                        gpus,
                        self.perf.gpus_per_engine,
                        extra=self.log_context,
                    )
            self.planner = Planner(
                config=self.config, limits=limits, capacity=capacity, interval_s=self.interval_s
            )
        elif self.planner.limits != limits:
            self.planner.follow(limits, capacity=capacity)
        return self.planner

    async def prime(self) -> None:
        """Read the deployment once, so that limits are known before the first interval ends."""
        deployment = await self.actuator.fetch()
        self._sync(Limits.from_spec(deployment.spec))

    async def step(self, obs: Observation) -> Decision:
        """Learn from the interval that just ended and apply the decision for the next one."""
        async with self._lock:
            deployment = await self.actuator.fetch()
            planner = self._sync(Limits.from_spec(deployment.spec))
            decision = planner.step(obs, current=replicas_of(deployment))
            await self._apply(decision, deployment)
            return decision

    async def fast_path(self, pulse: Pulse, *, now: float) -> Decision | None:
        """Scale up now if the fast loop's signals (backlog, SLO burn) call for it; ``None`` when
        they do not."""
        async with self._lock:
            deployment = await self.actuator.fetch()
            planner = self._sync(Limits.from_spec(deployment.spec))
            decision = planner.fast_path(now=now, current=replicas_of(deployment), pulse=pulse)
            if decision is not None:
                await self._apply(decision, deployment)
            return decision

    async def _apply(self, decision: Decision, deployment: InferenceDeployment) -> None:
        logger.info("decision: %s", decision.describe(), extra=self.log_context)
        self.metrics.record(
            decision, namespace=self.actuator.namespace, deployment=self.actuator.name, now=self.clock()
        )
        try:
            result = await self.actuator.apply(decision, deployment)
        except ActuatorError as exc:
            self.metrics.patches.labels(self.actuator.namespace, self.actuator.name, "failed").inc()
            logger.error("%s", exc, extra=self.log_context)
            return
        if result != "unchanged":
            self.metrics.patches.labels(self.actuator.namespace, self.actuator.name, result).inc()


async def run_recording(
    runner: Runner, observations: Iterable[Observation], *, max_intervals: int | None
) -> int:
    """Feed a recording, one observation per decision, as fast as the API server answers."""
    await runner.prime()
    steps = 0
    for obs in observations:
        if max_intervals is not None and steps >= max_intervals:
            break
        await runner.step(obs)
        steps += 1
    return steps


@dataclasses.dataclass(frozen=True)
class Planned:
    """One deployment under a live planner: its runner and its metrics source."""

    runner: Runner
    source: PrometheusSource


class Fleet:
    """The deployments a live planner manages, found again at every interval: new ones get a
    planner, deleted ones are dropped (their forecasts with them)."""

    def __init__(
        self,
        *,
        discover: Callable[[], Awaitable[list[tuple[str, str]]]],
        build: Callable[[str, str], Planned],
    ) -> None:
        self._discover = discover
        self._build = build
        self.members: dict[tuple[str, str], Planned] = {}

    async def refresh(self) -> None:
        found = set(await self._discover())
        for key in sorted(set(self.members) - found):
            logger.info("no longer planning %s/%s: deployment gone", *key)
            del self.members[key]
        for key in sorted(found - set(self.members)):
            planned = self._build(*key)
            try:
                await planned.runner.prime()
            except ActuatorError as exc:
                logger.error("cannot plan %s/%s: %s", *key, exc)
                continue
            logger.info("planning %s/%s", *key)
            self.members[key] = planned


async def run_prometheus(
    fleet: Fleet,
    *,
    interval_s: float,
    poll_s: float,
    max_intervals: int | None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> int:
    """Decide for every deployment at each interval boundary (wall clock, aligned to multiples of
    the interval) and poll their queues in between."""
    await fleet.refresh()
    boundary = math.floor(clock() / interval_s) * interval_s + interval_s
    steps = 0
    while max_intervals is None or steps < max_intervals:
        while (now := clock()) < boundary:
            await sleep(min(poll_s, boundary - now))
            if clock() >= boundary:
                break
            for planned in list(fleet.members.values()):
                await _poll(planned, now=clock())
        try:
            await fleet.refresh()
        except ActuatorError as exc:
            logger.error("keeping the deployments known so far: %s", exc)
        for planned in list(fleet.members.values()):
            await _decide(planned, boundary=boundary)
        steps += 1
        boundary += interval_s
    return steps


async def _poll(planned: Planned, *, now: float) -> None:
    runner = planned.runner
    try:
        window_s = runner.config.burn_window_s
        pulse = await planned.source.pulse(at=now, window_s=window_s, limits=runner.limits)
        await runner.fast_path(pulse, now=now)
    except (PrometheusError, ActuatorError) as exc:
        logger.warning("fast path skipped: %s", exc, extra=runner.log_context)


async def _decide(planned: Planned, *, boundary: float) -> None:
    runner = planned.runner
    try:
        obs = await planned.source.observe(end=boundary)
        await runner.step(obs)
    except (PrometheusError, ActuatorError) as exc:
        runner.metrics.skipped.labels(runner.actuator.namespace, runner.actuator.name).inc()
        logger.error("interval ending %.0f skipped: %s", boundary, exc, extra=runner.log_context)
