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
from collections.abc import Awaitable, Callable, Iterable, Mapping

from copse.api import InferenceDeployment, Role
from copse.planner.actuator import Actuator, ActuatorError, replicas_of
from copse.planner.capacity import CapacityModel
from copse.planner.config import PlannerConfig
from copse.planner.core import Decision, Planner
from copse.planner.metrics import PlannerMetrics
from copse.planner.observations import Observation
from copse.planner.policy import Limits
from copse.planner.prometheus import PrometheusError, PrometheusSource, queues_of
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
        capacity = CapacityModel(
            self.perf,
            quantile=self.config.quantile,
            max_num_seqs=limits.max_num_seqs,
            isl_scv=self.config.isl_scv,
        )
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
            self.planner.limits = limits
            self.planner.capacity = capacity
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
            current = replicas_of(deployment)
            planner.observe(obs, replicas=current)
            decision = planner.decide(
                now=obs.end, current=current, queues=queues_of(obs, planner.limits), inflight=obs.inflight
            )
            await self._apply(decision, deployment)
            return decision

    async def fast_path(self, queues: Mapping[Role, float], *, now: float) -> Decision | None:
        """Scale up now if a queue exceeds the trigger; ``None`` when no queue does."""
        async with self._lock:
            deployment = await self.actuator.fetch()
            planner = self._sync(Limits.from_spec(deployment.spec))
            current = replicas_of(deployment)
            trigger = planner.limits.queue_depth
            if all(queues.get(role, 0.0) < trigger * max(count, 1) for role, count in current.items()):
                return None
            decision = planner.decide(now=now, current=current, queues=queues)
            # Between intervals only add: removing is for the forecast, at the interval.
            grown = {role: max(count, current[role]) for role, count in decision.target.items()}
            decision = dataclasses.replace(decision, target=grown)
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


async def run_prometheus(
    runner: Runner,
    source: PrometheusSource,
    *,
    poll_s: float,
    max_intervals: int | None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> int:
    """Decide at every interval boundary (wall clock, aligned to multiples of the interval) and
    poll the queues in between."""
    await runner.prime()
    clock, interval = runner.clock, runner.interval_s
    boundary = math.floor(clock() / interval) * interval + interval
    steps = 0
    while max_intervals is None or steps < max_intervals:
        while (now := clock()) < boundary:
            await sleep(min(poll_s, boundary - now))
            if clock() >= boundary:
                break
            try:
                queues = await source.queues(at=clock(), limits=runner.limits)
                await runner.fast_path(queues, now=clock())
            except (PrometheusError, ActuatorError) as exc:
                logger.warning("fast path skipped: %s", exc, extra=runner.log_context)
        try:
            obs = await source.observe(end=boundary)
            await runner.step(obs)
        except (PrometheusError, ActuatorError) as exc:
            runner.metrics.skipped.labels(runner.actuator.namespace, runner.actuator.name).inc()
            logger.error("interval ending %.0f skipped: %s", boundary, exc, extra=runner.log_context)
        steps += 1
        boundary += interval
    return steps
