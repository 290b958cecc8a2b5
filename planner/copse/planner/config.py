"""The planner's configuration: one pydantic model, loaded from YAML or built from CLI flags.

What the InferenceDeployment already says (latency targets, replica bounds, GPU budget,
scale-down delay, queue-depth trigger, group shapes) is *not* here: it is read from the
deployment on every decision (see :class:`copse.planner.policy.Limits`), so that editing the
deployment retunes a running planner.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pydantic
from pydantic import ConfigDict, Field, field_validator, model_validator

from copse.planner.predictors import PREDICTORS, PredictorSettings
from copse.workers.files import read_yaml_mapping

#: Quantile the planner's latency estimates are taken at: the InferenceDeployment's targets are p99.
DEFAULT_QUANTILE = 0.99


class PrometheusConfig(pydantic.BaseModel):
    """Where and what to ask Prometheus for each interval (the README lists the default queries)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    url: str = "http://127.0.0.1:9090"
    """Base URL of the Prometheus HTTP API (in-cluster: the Prometheus Service)."""
    selector: str = 'namespace="{namespace}",deployment="{name}"'
    """Label matchers selecting one deployment's series; {namespace} and {name} are filled in."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Per-query timeout: a slow Prometheus must not stall the planner loop."""
    queries: dict[str, str] = Field(default_factory=dict)
    """PromQL per field, overriding the defaults ({selector} and {window} are filled in)."""


class PlannerConfig(pydantic.BaseModel):
    """How the planner forecasts, sizes and paces its changes."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    predictor: str = "constant"
    """Load predictor by registry name. ``constant`` (the last interval's value) by evidence
    (benchmarks/RESULTS.md, "Planner, wave 4"): in the closed loop on the 4-hour burst ``arima``
    spends 3 % fewer GPU-hours at 120 s start-up (0.83x the static fleet against 0.86x) but holds
    fewer requests (0.13 points fewer on seed 0, 1.1 on seed 1, 2.2 at 420 s); on 14 days of
    ServeGen ``arima`` has the lower forecast error (14.4 % against 14.8 % 20 minutes ahead) with a
    calibrated interval. On three days in closed loop (wave 9) ``arima`` spends 1 % less at equal
    attainment (0.72x against 0.73x) and ends 0.03 points under the goal; on the burst at 420 s
    (wave 8) it holds 4.8 points fewer requests. Not yet a gain that pays for its refits."""
    predictor_settings: PredictorSettings = Field(default_factory=PredictorSettings)
    """Knobs of the predictors (window sizes, ARIMA refits, Kalman noise); ``period`` is set from season_s."""
    season_s: float = Field(default=86400.0, gt=0)
    """Length of the load cycle the seasonal predictor repeats: a day."""
    interval_s: float = Field(default=60.0, gt=0)
    """Seconds between decisions in ``copse planner run``; the dry run takes it from the recording."""
    attainment_goal: float = Field(default=0.99, gt=0, lt=1)
    """Share of requests that must meet the SLO (TTFT and mean inter-token gap, TPOT, both within
    target), over the run: the planner sizes each interval for it, paced by the error budget (see
    ``budget_spend_bounds``). Every request counts, those whose own prefill exceeds the TTFT target
    too: sizing leaves them out (no fleet serves them in time), and pacing answers for the misses."""
    budget_spend_bounds: tuple[float, float] = (0.5, 3.0)
    """Range of the share of the error budget (``1 - attainment_goal``) one interval is sized to
    miss, in multiples of it. The goal holds over the run, not every minute: when the router's
    counts show budget left unspent, later intervals may spend up to 3x their share (a 99 % goal
    sizes a peak for 97 %, where each point costs most replicas); when overspent, down to 0.5x.
    (1, 1) sizes every interval for the goal. The top stays below ``burn_rate``, or the fast loop
    would add back what pacing removes."""
    budget_halflife_s: float = Field(default=21600.0, gt=0)
    """How fast pacing moves: intervals at the mean load missing twice their share of the budget
    for this long halve the spend (and meeting every request for this long doubles it). A quarter
    of a day: the quiet hours' surplus is spent over the next ones, and an hour or two of calm is
    not taken as license to thin the fleet (on the 4-hour burst an hour's half-life did that, and
    the burst hit a fleet sized for 97 %)."""
    quantile: float = Field(default=DEFAULT_QUANTILE, gt=0, lt=1)
    """Quantile of TTFT/ITL the per-interval latency estimates (the dry run's table, alerts) are
    taken at; sizing uses ``attainment_goal``."""
    headroom: float = Field(default=1.0, gt=0, le=1)
    """Size pools for this fraction of each target. 1.0: the correction factors learn the engines'
    speed, so no blanket margin is needed; lower it for engines whose speed drifts within an interval."""
    forecast_quantile: float | None = Field(default=0.9, gt=0, lt=1)
    """Size for this quantile of the predictor's forecast distribution at the lead-time horizon (ARIMA:
    its prediction interval; others: their recent errors grown with the horizon); None: the point
    forecast. A quantile of load, not of latency: a load a little above the sized one costs a few
    slow requests, not the SLO, so 0.9 rather than 0.99."""
    shape_window: int = Field(default=5, ge=1)
    """Intervals the requests' shapes (lengths, their quantiles, hit rate) are averaged over,
    weighted by requests; the count keeps the predictor. A minute's shapes are a sample of a few
    hundred requests: sized on each draw, the fleet holds the largest of every scale-down delay
    (measured on ServeGen m-large, benchmarks/RESULTS.md "Planner, wave 11"). Five one-minute
    intervals lag a change of mix by about two and a half minutes, well inside a start-up."""
    error_window: int = Field(default=144, ge=1)
    """Recent one-step forecast errors the residual-based forecast distribution is taken over."""
    startup_delay_s: float | None = Field(default=None, ge=0)
    """Time from adding a replica to it serving (pod start, weight load); scale-ups start this early.
    ``None``: the deployment's (``spec.coldStart``: its ``startupDelay``, else its strategy's typical
    start-up), 120 s without a deployment."""
    hysteresis: float = Field(default=0.1, ge=0)
    """Remove a replica only if the rest would still meet the targets at this much more load."""
    correction: bool = True
    """Learn how much slower (or faster) the engines are than the profile from the observed mean TTFT
    and mean TPOT against the capacity model's means for the same load on the serving replicas."""
    correction_bounds: tuple[float, float] = (0.5, 2.0)
    """Clamp of a correction factor: a wild measurement must not double or halve the fleet at once
    (a factor at its clamp is counted in copse_planner_correction_clamped_total)."""
    itl_tail_window: int = Field(default=60, ge=1)
    """Intervals the ITL tail correction sums misses over: at a 1 % goal an interval of a few hundred
    requests holds a handful of misses, too few to read a ratio from alone."""
    itl_tail_bounds: tuple[float, float] = (0.5, 2.0)
    """Clamp of the ITL tail correction: the modelled misses fall slowly with replicas (about as one
    over the fleet), so a factor of 2 already moves the fleet a lot (a factor at its clamp is
    counted as phase ``itl_tail``)."""
    correction_smoothing: float = Field(default=0.3, gt=0, le=1)
    """Weight of the newest measurement in the exponentially smoothed correction factor."""
    isl_scv: float = Field(default=1.0, ge=0)
    """Prompt-length variability (squared CV) assumed when the metrics carry no p90 ISL."""
    osl_scv: float = Field(default=1.0, ge=0)
    """Output-length variability (squared CV) assumed when the metrics carry no p10 OSL (1: as
    many short answers as an exponential spread has)."""
    router_busy_kv_fraction: float = Field(default=0.95, gt=0)
    """The router's ``busy_kv_fraction`` (keep the two equal; the twin sets it from its router): a
    decode worker whose charged KV (each request's prompt and whole output, from routing to its last
    token) passes this share of its cache takes no new request, and a request that finds every one
    so waits. The capacity model counts those waits against TTFT, which is what sizes a second
    decode engine in time. Above 1 (the router's check switched off) nothing waits."""
    default_isl: float = Field(default=3000.0, gt=0)
    """Input length assumed until the first requests are seen."""
    default_osl: float = Field(default=150.0, gt=0)
    """Output length assumed until the first requests are seen."""
    queue_drain_s: float = Field(default=60.0, gt=0)
    """The fast path sizes a pool to serve its forecast plus its queue within this many seconds."""
    fast_path_poll_s: float = Field(default=5.0, gt=0)
    """How often the fast loop reads the queues and the SLO counters between decisions (Dynamo runs
    its load-based scaling every 5 s): a burst the forecast missed is answered within seconds."""
    burn_window_s: float = Field(default=30.0, gt=0)
    """Window the fast loop reads the router's SLO counters over: long enough to hold tens of
    requests at a few req/s, short enough to see a burst within a poll or two."""
    burn_rate: float = Field(default=5.0, gt=0)
    """The fast loop scales up when the share of requests missing the SLO in the burn window is this
    many times the error budget (``1 - attainment_goal``): 5 x 1 % = 5 % missing. Below it, misses
    are the forecast's business (a few slow requests do not buy a replica)."""
    burn_min_requests: int = Field(default=20, ge=1)
    """Fewest requests judged in the burn window for its share to count (two misses of three are noise)."""
    backlog_ttft_share: float = Field(default=0.5, gt=0)
    """The fast loop scales up when the prefill work queued per serving front replica (uncached
    prompt tokens routed but not prefilled, and the router's queue) exceeds this share of the TTFT
    target: the requests queued now are about to miss it."""
    metrics_port: int = Field(default=9464, ge=0, le=65535)
    """Port of the planner's own /metrics (0: do not serve); bound to 127.0.0.1 unless metrics_host says."""
    metrics_host: str = "127.0.0.1"
    """Address the planner's /metrics listens on (0.0.0.0 in a pod so Prometheus can scrape it)."""
    prometheus: PrometheusConfig = Field(default_factory=PrometheusConfig)
    """The metrics source of ``copse planner run`` when no recording is given."""

    @field_validator("predictor")
    @classmethod
    def _known_predictor(cls, value: str) -> str:
        if value not in PREDICTORS:
            raise ValueError(f"unknown predictor {value!r}; known: {', '.join(sorted(PREDICTORS))}")
        return value

    @model_validator(mode="after")
    def _check_bounds(self) -> PlannerConfig:
        low, high = self.correction_bounds
        if not 0 < low <= 1 <= high:
            raise ValueError(f"correction_bounds {self.correction_bounds} must satisfy 0 < low <= 1 <= high")
        low, high = self.budget_spend_bounds
        if not 0 < low <= 1 <= high < self.burn_rate:
            raise ValueError(
                f"budget_spend_bounds {self.budget_spend_bounds} must satisfy 0 < low <= 1 <= high < "
                f"burn_rate ({self.burn_rate}); a lower burn_rate needs a lower budget_spend_bounds top"
            )
        if high * (1.0 - self.attainment_goal) >= 1.0:
            raise ValueError(
                f"budget_spend_bounds top {high} times the error budget {1.0 - self.attainment_goal:.3g} "
                "would size an interval for no request at all"
            )
        return self

    def settings_for(self, interval_s: float) -> PredictorSettings:
        """Predictor settings with the seasonal period expressed in intervals of ``interval_s``."""
        return dataclasses.replace(
            self.predictor_settings,
            period=max(1, round(self.season_s / interval_s)),
            error_window=self.error_window,
        )


class ConfigError(ValueError):
    """A planner config file that cannot be used; the message names the file and field."""


def load_config(path: Path | None) -> PlannerConfig:
    """The config in a YAML file, or the defaults when ``path`` is ``None``."""
    if path is None:
        return PlannerConfig()
    raw = read_yaml_mapping(path, what="planner settings", error=ConfigError)
    try:
        return PlannerConfig.model_validate(raw)
    except pydantic.ValidationError as exc:
        details = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or '(top level)'}: {error['msg']}"
            for error in exc.errors()
        )
        raise ConfigError(f"{path}: invalid planner config: {details}") from exc
