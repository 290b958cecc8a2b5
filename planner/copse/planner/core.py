"""The planner: observations in, replica decisions (with the numbers behind them) out. Pure.

One decision, at the start of each interval:

1. Forecast the load at two horizons, each at ``forecast_quantile`` of the predictor's own forecast
   distribution there: the next interval (what the replicas in place serve) and
   ``1 + ceil(startup_delay / interval)`` intervals ahead, when a replica added now would serve
   (lead time).
2. Size each pool for both (see :mod:`copse.planner.capacity`): the fewest replicas that serve
   the interval's goal of the requests within the targets (``headroom`` x them), with the
   correction factors learned so far; take the larger. The interval's goal is
   ``attainment_goal`` paced by the error budget (:mod:`copse.planner.budget`): lower while the
   router's counts show budget unspent, higher while overspent.
3. Fast path (also between decisions, every ``fast_path_poll_s``, on a :class:`Pulse`): when the
   front pool's backlog (queued prefill work per serving replica beyond ``backlog_ttft_share`` of the
   TTFT target, or ``queue_depth`` requests per replica) says requests are about to miss, size that
   pool for the forecast plus draining its backlog within ``queue_drain_s``; when the router's SLO
   counters burn the error budget ``burn_rate`` times over in the burn window, grow the pool that
   misses to what the window's load needs, and at least by the share missing. The fast path only
   adds; removing is for the forecast, at the interval.
4. Floors: never below what in-flight work needs -- the decoding sequences' KV, and the queued
   prompts within the TTFT target.
5. Hysteresis: a pool shrinks only to a count that would still meet the targets at
   ``1 + hysteresis`` times the forecast; then the scale-down delay (:class:`ScaleDownGate`: no
   capacity added within it leaves, so the fast loop's additions cannot flap).
6. Bounds: ``min_replicas``/``max_replicas`` per pool, then the GPU budget in whole groups.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Mapping

from copse.api import Role
from copse.planner.budget import ErrorBudget
from copse.planner.capacity import CapacityModel, Corrections, Means, Sizing, Workload
from copse.planner.config import PlannerConfig
from copse.planner.forecast import LoadForecast, LoadForecaster
from copse.planner.observations import Observation, Pulse
from copse.planner.policy import Limits, ScaleDownGate, clamp, fit_budget

#: Bisection steps when solving for a correction factor (2^-30 of the clamp range).
_CORRECTION_STEPS = 30
#: An interval whose estimated mean TTFT is more than this share waiting does not update the prefill
#: correction (the queue model's error would be learned as engine speed).
_QUEUE_SHARE = 0.5
#: Largest share of a pool one SLO burn adds (the share of requests missing, up to this).
_BURN_STEP = 0.5
#: Correction phases, in the order they are reported.
PHASES: tuple[str, ...] = ("prefill", "decode", "itl_tail")
#: What sets a target: the forecast, or one of the fast loop's signals (work queued for a pool, or
#: requests missing the SLO faster than the error budget allows).
FORECAST, BACKLOG, BURN = "forecast", "backlog", "burn"
SIGNALS: tuple[str, ...] = (BACKLOG, BURN)


@dataclasses.dataclass(frozen=True, slots=True)
class Reaction:
    """What one fast-loop signal asks of a pool."""

    replicas: int
    signal: str
    """:data:`BACKLOG` or :data:`BURN`."""
    why: str


def queues_of(obs: Observation, limits: Limits) -> dict[Role, float]:
    """Requests waiting per pool in an observation (absent gauges count as empty queues)."""
    queues = {limits.front: obs.queue_depth or 0.0}
    if limits.disaggregated:
        queues[Role.DECODE] = obs.decode_queue_depth or 0.0
    return queues


def workload_of(load: LoadForecast | Observation, *, scale: float = 1.0) -> Workload:
    """The workload of a forecast or an observed interval, its rate multiplied by ``scale``."""
    return Workload(
        rate=load.num_requests / load.duration_s * scale,
        isl=load.isl or 1.0,
        osl=load.osl or 1.0,
        isl_p90=load.isl_p90,
        osl_p10=load.osl_p10,
        uncached_quantiles=load.uncached_quantiles,
        kv_hit_rate=load.kv_hit_rate or 0.0,
        onboard_ms=load.onboard_ms or 0.0,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Decision:
    """What the planner wants applied, and why."""

    time: float
    """When it was decided (start of the interval it is for), seconds."""
    current: dict[Role, int]
    """Replicas in place when deciding."""
    target: dict[Role, int]
    """Replicas to apply (within bounds and budget)."""
    sized: dict[Role, Sizing]
    """What the forecast load needs per pool, before floors, stability and bounds."""
    forecast: LoadForecast | None
    """The load sized for (the larger of the next interval's and the lead time's, at the forecast
    quantile); ``None`` before any data."""
    next_forecast: LoadForecast | None
    """The point forecast for the very next interval."""
    corrections: Corrections
    """Correction factors in use."""
    reasons: tuple[str, ...]
    """Why the target differs from the sized need (bounds, budget, delay, fast path, ...)."""
    margin: float
    """The load sized for over the point forecast at the same horizon (the forecast quantile's
    allowance for forecast error; 1.0 = the point forecast)."""
    goal: float
    """Share of requests within the SLO the pools were sized for: ``attainment_goal`` paced by the
    error budget."""
    clamped: tuple[str, ...] = ()
    """Correction phases whose newest solved factor hit a bound of ``correction_bounds``."""
    raised_by: dict[Role, str] = dataclasses.field(default_factory=dict)
    """Pools whose need a fast-loop signal raised above the forecast's sizing, with the signal
    (:data:`SIGNALS`): tells a scale-up the forecast saw from one it missed."""

    def trigger(self, role: Role) -> str:
        """What set ``role``'s target: a fast-loop signal, else ``forecast`` (sizing, floors,
        stability rules and bounds)."""
        return self.raised_by.get(role, FORECAST)

    @property
    def changed(self) -> bool:
        return self.target != self.current

    def describe(self) -> str:
        """One log line with the numbers behind the decision."""
        parts = []
        if self.forecast is not None:
            f = self.forecast
            parts.append(
                f"forecast {f.rate:.2f} req/s isl {f.isl:.0f}"
                + (f" (p90 {f.isl_p90:.0f})" if f.isl_p90 is not None else "")
                + f" osl {f.osl:.0f} hit {f.kv_hit_rate:.2f} x{self.margin:.2f} for forecast error"
            )
        for role, sizing in self.sized.items():
            parts.append(
                f"{role.value}: throughput {sizing.throughput_replicas} -> sized {sizing.replicas}"
                + ("" if sizing.feasible else " (target unreachable)")
                + f" -> {self.current.get(role, 0)}→{self.target[role]}"
            )
        parts.append(f"sized for {self.goal:.2%} within SLO")
        parts.append(
            f"corrections prefill {self.corrections.prefill:.2f} decode {self.corrections.decode:.2f}"
            + (f" (clamped: {', '.join(self.clamped)})" if self.clamped else "")
        )
        if self.reasons:
            parts.append("because " + "; ".join(self.reasons))
        return ", ".join(parts)


class Planner:
    """Forecasts load and turns it into replica targets for the pools of one deployment."""

    def __init__(
        self,
        *,
        config: PlannerConfig,
        limits: Limits,
        capacity: CapacityModel,
        interval_s: float,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s} must be positive")
        self.config = config
        self.limits = limits
        self.capacity = capacity
        self.interval_s = interval_s
        self.forecaster = LoadForecaster(
            config.predictor,
            settings=config.settings_for(interval_s),
            shape_window=config.shape_window,
            default_isl=config.default_isl,
            default_osl=config.default_osl,
        )
        self.corrections = Corrections()
        self.clamp_hits = dict.fromkeys(PHASES, 0)
        """Times each phase's solved correction factor hit a bound (the metric's counter)."""
        self._clamped: tuple[str, ...] = ()
        self._itl_misses: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=config.itl_tail_window
        )
        """(observed, modelled) ITL misses of recent intervals, the tail correction's ratio."""
        self._backlog: dict[Role, float] = {}
        self.budget = self._fresh_budget()
        """Paces the error budget: the goal each interval is sized for."""
        self._gate = ScaleDownGate()
        self._observed = False

    def _fresh_budget(self) -> ErrorBudget:
        config = self.config
        return ErrorBudget(
            goal=config.attainment_goal,
            bounds=config.budget_spend_bounds,
            halflife_s=config.budget_halflife_s,
            cycle_s=config.season_s,
            max_error=config.burn_rate,
        )

    def follow(self, limits: Limits, *, capacity: CapacityModel) -> None:
        """Take the deployment's edited ``limits`` (same pools). New latency targets restart the
        error budget at a spend of 1: what the old targets left unspent says nothing of the new."""
        if (limits.ttft_ms, limits.itl_ms) != (self.limits.ttft_ms, self.limits.itl_ms):
            self.budget = self._fresh_budget()
        self.limits = limits
        self.capacity = capacity

    @property
    def startup_delay_s(self) -> float:
        """From adding a replica to it serving: the config's, else the deployment's (``spec.coldStart``)."""
        configured = self.config.startup_delay_s
        return self.limits.startup_delay_s if configured is None else configured

    @property
    def horizon(self) -> int:
        """Intervals forecast ahead: the next one, and those a replica added now takes to start."""
        return 1 + math.ceil(self.startup_delay_s / self.interval_s)

    # --- learning ---------------------------------------------------------------------------

    def observe(self, obs: Observation, *, replicas: Mapping[Role, int]) -> None:
        """Learn from an interval that ended, held at ``replicas`` (the serving ones, when the
        observation says, are what the corrections are solved against)."""
        self.forecaster.observe(obs)
        self._observed = True
        if obs.slo_met is not None and obs.missed is not None:
            self.budget.observe(judged=obs.slo_met + obs.missed, missed=obs.missed, duration_s=obs.duration_s)
        self._clamped = ()
        if self.config.correction and obs.num_requests > 0 and obs.isl and obs.osl:
            serving = self._serving(obs, replicas)
            self.corrections = self._corrected(obs, serving)
            tail = self._tail_corrected(obs, serving=serving, held=replicas)
            if tail is not None:
                if not self.config.itl_tail_bounds[0] < tail < self.config.itl_tail_bounds[1]:
                    self._clamped += ("itl_tail",)
                    self.clamp_hits["itl_tail"] += 1
                self.corrections = dataclasses.replace(self.corrections, itl_tail=tail)
        self._backlog = queues_of(obs, self.limits)

    def _serving(self, obs: Observation, held: Mapping[Role, int]) -> dict[Role, int]:
        """Replicas that served the interval: the observation's engine counts, else those held."""
        serving = {role: held.get(role, 0) for role in self.limits.roles}
        for role, count in ((self.limits.front, obs.serving), (Role.DECODE, obs.decode_serving)):
            if count is not None and role in serving:
                serving[role] = max(0, round(count))
        return serving

    def _corrected(self, obs: Observation, serving: Mapping[Role, int]) -> Corrections:
        """Correction factors moved toward the ones that make the capacity model's *mean* TTFT and
        mean TPOT of the observed load, on the serving replicas with the backlog the interval
        started with, match the observed means. Engine speed is learned from means, not tails: the
        TTFT tail is the prompts' own lengths (sized for in :meth:`CapacityModel.attainment`), not
        slow engines. An interval whose estimated mean TTFT is mostly waiting teaches nothing of the
        prefill speed (the queue model would be fitted instead), so it leaves that factor alone."""
        low, high = self.config.correction_bounds
        alpha = self.config.correction_smoothing
        corrections = self.corrections
        if any(serving.get(role, 0) == 0 for role in self.limits.roles):
            return corrections
        backlog = self._backlog.get(self.limits.front, 0.0)
        means = _MeansOf(
            capacity=self.capacity,
            obs=obs,
            replicas=serving,
            backlog=backlog,
            corrections=corrections,
            field="prefill",
        )
        current = means.at(corrections)
        clamped = []
        for field, observed in (("prefill", obs.ttft_mean_ms), ("decode", obs.itl_mean_ms)):
            if observed is None or observed <= 0:
                continue
            if field == "prefill" and current.queue_ms > _QUEUE_SHARE * current.ttft_ms:
                continue
            solved = _solve_increasing(
                dataclasses.replace(means, corrections=corrections, field=field), observed, low=low, high=high
            )
            if solved <= low or solved >= high:
                clamped.append(field)
                self.clamp_hits[field] += 1
            smoothed = (1 - alpha) * getattr(corrections, field) + alpha * solved
            corrections = dataclasses.replace(corrections, **{field: min(max(smoothed, low), high)})
        self._clamped = tuple(clamped)
        return corrections

    def _tail_corrected(
        self, obs: Observation, *, serving: Mapping[Role, int], held: Mapping[Role, int]
    ) -> float | None:
        """The ITL tail factor: requests the router counted missing the ITL target over those the
        capacity model expects to miss on the serving replicas, summed over the last
        ``itl_tail_window`` intervals (a ratio of sums: one interval holds a handful of misses).
        ``None`` without the router's SLO counts. Only steady intervals count: every held replica
        serving (a replica that just started takes a flood of prompts at once), at most one request
        waiting per replica at either end, and TTFT misses within the error budget; the misses of a
        burst are the backlog's, which the model sizes separately, not the tail's."""
        if obs.itl_missed is None or obs.slo_met is None or obs.ttft_missed is None:
            return None
        judged = obs.slo_met + obs.ttft_missed + obs.itl_missed
        front = self.limits.front
        waiting = max(queues_of(obs, self.limits)[front], self._backlog.get(front, 0.0))
        steady = (
            judged > 0
            and all(serving.get(role, 0) >= held.get(role, 0) for role in self.limits.roles)
            and waiting <= serving.get(front, 0)
            and obs.ttft_missed <= (1.0 - min(self.budget.goal, self.config.attainment_goal)) * judged
        )
        if not steady:
            return None
        expected = self.capacity.attainment(
            replicas=serving,
            load=workload_of(obs),
            ttft_ms=self.limits.ttft_ms,
            itl_ms=self.limits.itl_ms,
            corrections=dataclasses.replace(self.corrections, itl_tail=1.0),
        )
        self._itl_misses.append((obs.itl_missed, (1.0 - expected.itl) * judged))
        observed = sum(o for o, _ in self._itl_misses)
        modelled = sum(m for _, m in self._itl_misses)
        low, high = self.config.itl_tail_bounds
        # one miss added to each side: no misses either way reads as 1, not 0/0
        return min(max((observed + 1.0) / (modelled + 1.0), low), high)

    # --- the live loop's two moves ------------------------------------------------------------

    def step(self, obs: Observation, *, current: Mapping[Role, int]) -> Decision:
        """At an interval boundary: learn from the interval ``obs`` that just ended (served by the
        ``current`` replicas, starting ones included) and decide for the next one."""
        self.observe(obs, replicas=current)
        return self.decide(now=obs.end, current=current, pulse=Pulse.of(obs), inflight=obs.inflight)

    def fast_path(
        self,
        *,
        now: float,
        current: Mapping[Role, int],
        pulse: Pulse | None = None,
        queues: Mapping[Role, float] | None = None,
    ) -> Decision | None:
        """Between intervals: ``None`` unless the ``pulse`` (or, without one, the ``queues`` alone)
        shows a backlog or an SLO burn (:meth:`reactive`); then a decision that only adds capacity
        (removing is for the forecast, at the interval)."""
        if pulse is None:
            pulse = self._pulse_of(now, queues or {})
        current = {role: current.get(role, 0) for role in self.limits.roles}
        if not self._observed or not self.reactive(pulse, current=current):
            return None
        decision = self.decide(now=now, current=current, pulse=pulse)
        grown = {role: max(count, current[role]) for role, count in decision.target.items()}
        return dataclasses.replace(decision, target=grown)

    def _pulse_of(self, now: float, queues: Mapping[Role, float]) -> Pulse:
        return Pulse(
            time=now,
            window_s=self.config.burn_window_s,
            queue_depth=queues.get(self.limits.front, 0.0),
            decode_queue_depth=queues.get(Role.DECODE, 0.0),
        )

    def reactive(
        self, pulse: Pulse, *, current: Mapping[Role, int], load: LoadForecast | None = None
    ) -> dict[Role, Reaction]:
        """What the fast loop's signals ask of each pool now, with why (pools they leave alone are
        absent): the backlog of the front pool (and of decode), and the SLO burn of the pool whose
        requests miss. ``load``: the forecast the backlog drains on top of (default: the next
        interval's at the forecast quantile)."""
        config, limits = self.config, self.limits
        if load is None:
            load = self._horizon_forecasts()[0][0]
        work = workload_of(load)
        live = {limits.front: pulse.serving, Role.DECODE: pulse.decode_serving}

        def serving(role: Role) -> int:
            count = live.get(role)
            return max(1, current.get(role, 0) if count is None else round(count))

        needs: dict[Role, Reaction] = {}
        # An incident is answered at the goal itself, not at what pacing allows a steady interval.
        goal = max(self.budget.goal, config.attainment_goal)

        def need(role: Role, count: int, signal: str, why: str) -> None:
            if count > current.get(role, 0) and (role not in needs or count > needs[role].replicas):
                needs[role] = Reaction(count, signal, f"{role.value}: {why}: fast path to {count}")

        def drained(role: Role, backlog: float) -> int:
            extra = backlog * load.duration_s / config.queue_drain_s
            grown = workload_of(dataclasses.replace(load, num_requests=load.num_requests + extra))
            return self.size(grown, goal=goal)[role].replicas

        # Backlog: the work queued for the front pool, in requests' worth of uncached prompt.
        front = limits.front
        uncached = max(work.isl * (1 - work.kv_hit_rate), 1.0)
        if pulse.prefill_tokens is not None:
            backlog = (pulse.prefill_tokens + pulse.router_queue * uncached) / uncached
        else:
            backlog = pulse.queue_depth
        service_ms = self.capacity.prefill_service_ms(
            work.isl, hit_rate=work.kv_hit_rate, scale=self.corrections.prefill, onboard_ms=work.onboard_ms
        )
        wait_ms = backlog * service_ms / serving(front)
        trigger = limits.queue_depth
        if pulse.queue_depth >= trigger * max(current.get(front, 0), 1) or (
            backlog > 0 and wait_ms >= config.backlog_ttft_share * limits.ttft_ms
        ):
            need(
                front,
                drained(front, backlog),
                BACKLOG,
                f"backlog of {backlog:.0f} ({wait_ms / 1000:.1f} s of prefill a replica)",
            )
        if limits.disaggregated and pulse.decode_queue_depth >= trigger * max(current.get(Role.DECODE, 0), 1):
            queued = pulse.decode_queue_depth
            need(
                Role.DECODE,
                drained(Role.DECODE, queued),
                BACKLOG,
                f"queue of {queued:.0f} >= {trigger}/replica",
            )
        # Burn: the share of requests missing the SLO, against the error budget.
        judged = pulse.judged
        if judged >= config.burn_min_requests:
            if limits.disaggregated:
                misses = {front: pulse.ttft_missed + pulse.refused, Role.DECODE: pulse.itl_missed}
            else:
                misses = {front: pulse.ttft_missed + pulse.refused + pulse.itl_missed}
            # the window's arrivals when known: during a backlog's drain the requests ending in it
            # count the backlog on top of the load, and sizing for them overshoots
            arrived = judged if pulse.arrived is None else pulse.arrived
            window_load = dataclasses.replace(load, num_requests=arrived / pulse.window_s * load.duration_s)
            for role, missed in misses.items():
                share = missed / judged
                burn = share / (1 - config.attainment_goal)
                if burn < config.burn_rate:
                    continue
                by_rate = self.size(workload_of(window_load), goal=goal)[role].replicas
                by_share = math.ceil(serving(role) * (1 + min(share, _BURN_STEP)))
                need(
                    role, max(by_rate, by_share), BURN, f"{share:.0%} of requests missing (burn {burn:.0f}x)"
                )
        return needs

    # --- deciding ---------------------------------------------------------------------------

    def size(self, load: Workload, *, goal: float | None = None) -> dict[Role, Sizing]:
        """Replicas each pool needs to serve ``goal`` (default: the interval's, ``attainment_goal``
        paced by the error budget) of ``load``'s requests within ``headroom`` x the targets, with
        the current corrections. Disaggregated pools are sized together
        (:meth:`CapacityModel.disaggregated_replicas`): a request meets the SLO only if the prefill
        pool gives it its first token in time and the decode pool its other tokens."""
        ttft = self.limits.ttft_ms * self.config.headroom
        itl = self.limits.itl_ms * self.config.headroom
        goal = self.budget.goal if goal is None else goal
        if not self.limits.disaggregated:
            sizing = self.capacity.aggregated_replicas(
                load, ttft_ms=ttft, itl_ms=itl, corrections=self.corrections, goal=goal
            )
            return {Role.WORKER: sizing}
        return self.capacity.disaggregated_replicas(
            load,
            ttft_ms=ttft,
            itl_ms=itl,
            gpus_per_replica=self.limits.gpus_per_replica,
            corrections=self.corrections,
            goal=goal,
        )

    def _size_horizon(self, forecasts: list[LoadForecast], *, scale: float = 1.0) -> dict[Role, Sizing]:
        best: dict[Role, Sizing] = {}
        for forecast in forecasts:
            for role, sizing in self.size(workload_of(forecast, scale=scale)).items():
                if role not in best or sizing.replicas > best[role].replicas:
                    best[role] = sizing
        return best

    def _horizon_forecasts(self) -> tuple[list[LoadForecast], float, LoadForecast]:
        """The forecasts sized for -- the next interval, and the one a replica added now serves
        first -- at the forecast quantile; the margin this quantile adds at the lead time; the next
        interval's point forecast."""
        quantile = self.config.forecast_quantile
        points = self.forecaster.forecast(self.horizon)
        uppers = points if quantile is None else self.forecaster.forecast(self.horizon, quantile=quantile)
        picked = [uppers[0]] if self.horizon == 1 else [uppers[0], uppers[-1]]
        point = points[-1].num_requests
        margin = uppers[-1].num_requests / point if point > 0 else 1.0
        return picked, margin, points[0]

    def decide(
        self,
        *,
        now: float,
        current: Mapping[Role, int],
        queues: Mapping[Role, float] | None = None,
        inflight: float | None = None,
        pulse: Pulse | None = None,
    ) -> Decision:
        """Replica targets for the interval starting at ``now``.

        ``queues`` holds, per pool, the requests waiting for it (prompts for prefill or aggregated
        workers, prefilled requests for a decode slot); ``pulse``, the fast loop's signals (queues
        and SLO counts; it replaces ``queues``); ``inflight`` is the number of sequences decoding.
        All are as of now.
        """
        if pulse is None:
            pulse = self._pulse_of(now, queues or {})
        current = {role: current.get(role, 0) for role in self.limits.roles}
        reasons: list[str] = []
        if not self._observed:
            target = fit_budget(clamp(current, self.limits), self.limits)
            return Decision(
                time=now,
                current=current,
                target=target,
                sized={},
                forecast=None,
                next_forecast=None,
                corrections=self.corrections,
                reasons=("no load observed yet: holding", *_bound_reasons(current, target)),
                margin=1.0,
                goal=self.budget.goal,
            )
        forecasts, margin, expected = self._horizon_forecasts()
        sized = self._size_horizon(forecasts)
        peak = max(forecasts, key=lambda f: f.num_requests)
        if peak is not forecasts[0] and any(
            sized[role].replicas > current[role] for role in self.limits.roles
        ):
            reasons.append(f"lead time: sized for the load {self.horizon - 1} interval(s) ahead")
        desired = {role: sizing.replicas for role, sizing in sized.items()}
        # Fast path: a backlog or an SLO burn the forecast did not see.
        raised_by: dict[Role, str] = {}
        for role, reaction in self.reactive(pulse, current=current, load=forecasts[0]).items():
            if reaction.replicas > desired[role]:
                desired[role] = reaction.replicas
                raised_by[role] = reaction.signal
                reasons.append(reaction.why)
        # Floors: in-flight work keeps its capacity.
        floors = self._floors(forecasts[0], queued=pulse.queue_depth, inflight=inflight)
        for role, floor in floors.items():
            if desired[role] < floor and current[role] > desired[role]:
                desired[role] = min(floor, current[role])
                reasons.append(f"{role.value}: in-flight work needs {floor}")
        # Hysteresis: shrink only to what would still hold with more load.
        shrinking = [role for role in self.limits.roles if desired[role] < current[role]]
        if shrinking and self.config.hysteresis > 0:
            padded = self._size_horizon(forecasts, scale=1 + self.config.hysteresis)
            for role in shrinking:
                held = min(current[role], max(desired[role], padded[role].replicas))
                if held > desired[role]:
                    reasons.append(f"{role.value}: hysteresis keeps {held}")
                    desired[role] = held
        settled = self._gate.settle(
            now=now, current=current, desired=desired, delay_s=self.limits.scale_down_delay_s
        )
        for role in self.limits.roles:
            if settled[role] > desired[role]:
                reasons.append(f"{role.value}: scale-down delay keeps {settled[role]}")
        bounded = clamp(settled, self.limits)
        target = fit_budget(bounded, self.limits)
        reasons.extend(_bound_reasons(settled, bounded))
        for role in self.limits.roles:
            if target[role] < bounded[role]:
                reasons.append(f"{role.value}: GPU budget {self.limits.gpu_budget} caps it at {target[role]}")
        return Decision(
            time=now,
            current=current,
            target=target,
            sized=sized,
            forecast=peak,
            next_forecast=expected,
            corrections=self.corrections,
            reasons=tuple(reasons),
            margin=margin,
            goal=self.budget.goal,
            clamped=self._clamped,
            raised_by=raised_by,
        )

    def _floors(self, forecast: LoadForecast, *, queued: float, inflight: float | None) -> dict[Role, int]:
        """Replicas in-flight work needs: KV for the sequences decoding, and the prompts queued
        for the front pool prefilled within the TTFT target."""
        floors: dict[Role, int] = {}
        load = workload_of(forecast)
        if inflight:
            floors[self.limits.back] = math.ceil(inflight / self.capacity.max_batch(load.context_length))
        if queued:
            service_ms = self.capacity.prefill_service_ms(
                load.isl,
                hit_rate=load.kv_hit_rate,
                scale=self.corrections.prefill,
                onboard_ms=load.onboard_ms,
            )
            floor = math.ceil(queued * service_ms / self.limits.ttft_ms)
            floors[self.limits.front] = max(floors.get(self.limits.front, 0), floor)
        return floors


@dataclasses.dataclass(frozen=True, kw_only=True)
class _MeansOf:
    """The capacity model's mean TTFT (field ``prefill``) or mean TPOT (``decode``) of an observed
    interval as a function of that field's correction factor."""

    capacity: CapacityModel
    obs: Observation
    replicas: Mapping[Role, int]
    backlog: float
    corrections: Corrections
    field: str

    def at(self, corrections: Corrections) -> Means:
        return self.capacity.means(
            replicas=self.replicas,
            load=workload_of(self.obs),
            duration_s=self.obs.duration_s,
            backlog=self.backlog,
            corrections=corrections,
        )

    def __call__(self, scale: float) -> float:
        result = self.at(dataclasses.replace(self.corrections, **{self.field: scale}))
        return result.ttft_ms if self.field == "prefill" else result.itl_ms


def _bound_reasons(before: Mapping[Role, int], after: Mapping[Role, int]) -> tuple[str, ...]:
    reasons = []
    for role, count in after.items():
        if count > before.get(role, 0):
            reasons.append(f"{role.value}: min_replicas raises it to {count}")
        elif count < before.get(role, 0):
            reasons.append(f"{role.value}: max_replicas caps it at {count}")
    return tuple(reasons)


def _solve_increasing(function: Callable[[float], float], target: float, *, low: float, high: float) -> float:
    """``x`` in ``[low, high]`` with ``function(x) == target`` for an increasing function (clamped)."""
    if function(low) >= target:
        return low
    if function(high) <= target:
        return high
    for _ in range(_CORRECTION_STEPS):
        middle = (low + high) / 2
        if function(middle) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2
