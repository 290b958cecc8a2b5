"""Every Prometheus metric the planner exports (names live here and nowhere else).

Each series carries ``namespace`` and ``deployment`` (the InferenceDeployment's own; the chart's
ServiceMonitor keeps them with ``honorLabels``), and ``role`` where a pool is meant.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from copse.planner.core import PHASES, Decision

PREFIX = "copse_planner"

PREDICTED_REQUESTS_PER_SECOND = f"{PREFIX}_predicted_requests_per_second"
"""Gauge: forecast arrival rate of the next interval."""
PREDICTED_ISL = f"{PREFIX}_predicted_isl_tokens"
"""Gauge: forecast mean input length of the next interval."""
PREDICTED_OSL = f"{PREFIX}_predicted_osl_tokens"
"""Gauge: forecast mean output length of the next interval."""
PREDICTED_KV_HIT_RATE = f"{PREFIX}_predicted_kv_hit_rate"
"""Gauge: forecast prefix-cache hit rate of the next interval."""
FORECAST_MARGIN = f"{PREFIX}_forecast_margin"
"""Gauge: the load sized for over the point forecast at the lead-time horizon (the forecast
quantile's allowance for the predictor's error)."""
SIZED_GOAL = f"{PREFIX}_sized_goal_ratio"
"""Gauge: share of requests within the SLO the pools were sized for, the attainment goal paced by
the error budget (below the goal: budget left unspent is being spent; above: overspent)."""
SIZED_REPLICAS = f"{PREFIX}_sized_replicas"
"""Gauge by role: replicas the forecast load needs, before floors, stability rules and bounds."""
TARGET_REPLICAS = f"{PREFIX}_target_replicas"
"""Gauge by role: replicas decided (applied, or recommended in observe-only mode)."""
CURRENT_REPLICAS = f"{PREFIX}_current_replicas"
"""Gauge by role: replicas in the deployment's spec when deciding."""
CORRECTION_FACTOR = f"{PREFIX}_correction_factor"
"""Gauge by phase (prefill, decode): how much slower the engines are than the profile, solved from
observed mean TTFT / mean TPOT, smoothed and clamped."""
CORRECTION_CLAMPED = f"{PREFIX}_correction_clamped"
"""Counter (``_total``) by phase: intervals whose solved correction factor hit a bound of
``correction_bounds`` (alert when it keeps rising: the factor is pinned, not measured)."""
DECISIONS = f"{PREFIX}_decisions"
"""Counter (``_total``) by action (scale_up, scale_down, rebalance, hold)."""
SCALE_UPS = f"{PREFIX}_scale_ups"
"""Counter (``_total``) by role and trigger (forecast, backlog, burn): decisions that grew a pool,
by what grew it (many backlog or burn scale-ups: the forecast is late, e.g. a lead time too short)."""
PATCHES = f"{PREFIX}_patches"
"""Counter (``_total``) by result (applied, observe_only, failed)."""
SKIPPED_INTERVALS = f"{PREFIX}_skipped_intervals"
"""Counter (``_total``): intervals without a decision (Prometheus or the API server failed)."""
LAST_DECISION = f"{PREFIX}_last_decision_timestamp_seconds"
"""Gauge: unix time of the latest decision (alert when it stops moving)."""

_DEPLOYMENT = ["namespace", "deployment"]


class PlannerMetrics:
    """The planner's metrics in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.predicted_rate = Gauge(
            PREDICTED_REQUESTS_PER_SECOND, "Forecast arrival rate.", _DEPLOYMENT, registry=r
        )
        self.predicted_isl = Gauge(PREDICTED_ISL, "Forecast mean input length.", _DEPLOYMENT, registry=r)
        self.predicted_osl = Gauge(PREDICTED_OSL, "Forecast mean output length.", _DEPLOYMENT, registry=r)
        self.predicted_hit = Gauge(
            PREDICTED_KV_HIT_RATE, "Forecast prefix-cache hit rate.", _DEPLOYMENT, registry=r
        )
        self.margin = Gauge(
            FORECAST_MARGIN, "Factor covering recent forecast errors.", _DEPLOYMENT, registry=r
        )
        self.sized_goal = Gauge(SIZED_GOAL, "Attainment the pools were sized for.", _DEPLOYMENT, registry=r)
        self.sized = Gauge(SIZED_REPLICAS, "Replicas the forecast needs.", [*_DEPLOYMENT, "role"], registry=r)
        self.target = Gauge(TARGET_REPLICAS, "Replicas decided.", [*_DEPLOYMENT, "role"], registry=r)
        self.current = Gauge(CURRENT_REPLICAS, "Replicas in the spec.", [*_DEPLOYMENT, "role"], registry=r)
        self.correction = Gauge(CORRECTION_FACTOR, "Correction factors.", [*_DEPLOYMENT, "phase"], registry=r)
        self.clamped = Counter(
            CORRECTION_CLAMPED, "Correction factors solved at a bound.", [*_DEPLOYMENT, "phase"], registry=r
        )
        self.decisions = Counter(DECISIONS, "Decisions by action.", [*_DEPLOYMENT, "action"], registry=r)
        self.scale_ups = Counter(
            SCALE_UPS, "Scale-ups by role and trigger.", [*_DEPLOYMENT, "role", "trigger"], registry=r
        )
        self.patches = Counter(PATCHES, "Patches by result.", [*_DEPLOYMENT, "result"], registry=r)
        self.skipped = Counter(SKIPPED_INTERVALS, "Intervals without a decision.", _DEPLOYMENT, registry=r)
        self.last_decision = Gauge(LAST_DECISION, "Time of the latest decision.", _DEPLOYMENT, registry=r)

    def record(self, decision: Decision, *, namespace: str, deployment: str, now: float) -> None:
        """Export one decision's numbers."""
        labels = (namespace, deployment)
        forecast = decision.next_forecast
        if forecast is not None:
            self.predicted_rate.labels(*labels).set(forecast.rate)
            self.predicted_isl.labels(*labels).set(forecast.isl)
            self.predicted_osl.labels(*labels).set(forecast.osl)
            self.predicted_hit.labels(*labels).set(forecast.kv_hit_rate)
        self.margin.labels(*labels).set(decision.margin)
        self.sized_goal.labels(*labels).set(decision.goal)
        for role, sizing in decision.sized.items():
            self.sized.labels(*labels, role.value).set(sizing.replicas)
        for role, count in decision.target.items():
            self.target.labels(*labels, role.value).set(count)
            self.current.labels(*labels, role.value).set(decision.current.get(role, 0))
        self.correction.labels(*labels, "prefill").set(decision.corrections.prefill)
        self.correction.labels(*labels, "decode").set(decision.corrections.decode)
        self.correction.labels(*labels, "itl_tail").set(decision.corrections.itl_tail)
        for phase in PHASES:
            counter = self.clamped.labels(*labels, phase)  # every phase exported, from 0
            if phase in decision.clamped:
                counter.inc()
        self.decisions.labels(*labels, action_of(decision)).inc()
        for role, count in decision.target.items():
            if count > decision.current.get(role, 0):
                self.scale_ups.labels(*labels, role.value, decision.trigger(role)).inc()
        self.last_decision.labels(*labels).set(now)


def action_of(decision: Decision) -> str:
    """scale_up, scale_down, rebalance (one pool up, one down) or hold."""
    ups = any(decision.target[role] > decision.current.get(role, 0) for role in decision.target)
    downs = any(decision.target[role] < decision.current.get(role, 0) for role in decision.target)
    if ups and downs:
        return "rebalance"
    if ups:
        return "scale_up"
    return "scale_down" if downs else "hold"
