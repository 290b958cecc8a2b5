"""The planner's decisions: lead time, fast path, floors, hysteresis, delay, bounds, corrections."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from copse.api import Role, parse_deployment
from copse.api.v1alpha1 import STARTUP_DELAYS_S
from copse.planner.capacity import CapacityModel, Corrections, Workload
from copse.planner.config import PlannerConfig
from copse.planner.core import Planner, workload_of
from copse.planner.observations import Observation, Pulse
from copse.planner.policy import Limits
from copse.workers.perf import PolynomialPerfModel

P, D, W = Role.PREFILL, Role.DECODE, Role.WORKER
INTERVAL = 60.0


def config(**overrides: object) -> PlannerConfig:
    values: dict[str, object] = {
        "predictor": "constant",
        "headroom": 1.0,
        "forecast_quantile": None,
        "startup_delay_s": 0.0,
        "hysteresis": 0.0,
        "correction": False,
    }
    values.update(overrides)
    return PlannerConfig.model_validate(values)


def limits(**overrides: object) -> Limits:
    values: dict[str, object] = {
        "roles": (P, D),
        "gpus_per_replica": {P: 1, D: 1},
        "ttft_ms": 200.0,
        "itl_ms": 20.0,
        "min_replicas": 1,
        "max_replicas": 50,
        "scale_down_delay_s": 0.0,
        "max_num_seqs": 64,
    }
    values.update(overrides)
    return Limits(**values)  # type: ignore[arg-type]


def interval(step: int, rate: float, **extra: object) -> Observation:
    return Observation(
        timestamp=step * INTERVAL,
        duration_s=INTERVAL,
        num_requests=rate * INTERVAL,
        isl=1000.0,
        osl=100.0,
        **extra,  # type: ignore[arg-type]
    )


def planner(
    capacity: CapacityModel, *, cfg: PlannerConfig | None = None, lim: Limits | None = None
) -> Planner:
    return Planner(config=cfg or config(), limits=lim or limits(), capacity=capacity, interval_s=INTERVAL)


def need(capacity: CapacityModel, rate: float, lim: Limits | None = None) -> dict[Role, int]:
    """What the capacity model says a steady ``rate`` needs, for comparison."""
    lim = lim or limits()
    load = Workload(rate=rate, isl=1000.0, osl=100.0)
    return {
        P: capacity.prefill_replicas(load, ttft_ms=lim.ttft_ms).replicas,
        D: capacity.decode_replicas(load, itl_ms=lim.itl_ms).replicas,
    }


def run(plan: Planner, rates: list[float], start: dict[Role, int] | None = None) -> list[dict[Role, int]]:
    """Decide, apply, observe, for each rate in turn; the targets applied."""
    current = start or {P: 1, D: 1}
    applied = []
    for step, rate in enumerate(rates):
        decision = plan.decide(now=step * INTERVAL, current=current)
        current = decision.target
        applied.append(current)
        plan.observe(interval(step, rate), replicas=current)
    return applied


def test_without_data_it_holds_within_bounds(linear: CapacityModel) -> None:
    decision = planner(linear, lim=limits(min_replicas=2)).decide(now=0.0, current={P: 1, D: 9})
    assert decision.target == {P: 2, D: 9}
    assert decision.forecast is None
    assert "no load observed yet" in decision.reasons[0]


def test_it_sizes_the_forecast_load(linear: CapacityModel) -> None:
    plan = planner(linear)
    plan.observe(interval(0, 300.0), replicas={P: 1, D: 1})
    decision = plan.decide(now=INTERVAL, current={P: 1, D: 1})
    assert decision.target == need(linear, 300.0)
    assert decision.target[P] > 1
    assert decision.changed


def test_the_lead_time_comes_from_the_deployments_cold_start_unless_configured(linear: CapacityModel) -> None:
    def spec(cache: dict[str, str] | None = None, **cold_start: object) -> Limits:
        model = {"name": "m"} if cache is None else {"name": "m", "cache": cache}
        body = {
            "apiVersion": "copse.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": "x"},
            "spec": {"model": model, "coldStart": cold_start},
        }
        return Limits.from_spec(parse_deployment(body, source="x").spec)

    shared = {"persistentVolumeClaim": "weights"}
    assert spec().startup_delay_s == STARTUP_DELAYS_S["hub"] == 944.0
    assert spec(shared).startup_delay_s == STARTUP_DELAYS_S["model-cache"] == 481.0
    # A node-local cache is filled per node: a group on a node without the copy pulls from the hub.
    assert spec({"hostPath": "/var/lib/weights"}).startup_delay_s == STARTUP_DELAYS_S["hub"]
    assert spec(strategy="modelexpress").startup_delay_s == STARTUP_DELAYS_S["modelexpress"] == 420.0
    assert spec(shared, strategy="modelexpress").startup_delay_s == STARTUP_DELAYS_S["modelexpress"]
    assert spec(strategy="modelexpress", startupDelay="90s").startup_delay_s == 90.0
    assert spec(shared, startupDelay="90s").startup_delay_s == 90.0
    from_manifest = planner(linear, cfg=config(startup_delay_s=None), lim=spec(startupDelay="150s"))
    assert (from_manifest.startup_delay_s, from_manifest.horizon) == (150.0, 4)
    configured = planner(linear, cfg=config(startup_delay_s=30.0), lim=spec(startupDelay="150s"))
    assert (configured.startup_delay_s, configured.horizon) == (30.0, 2)  # the planner's own setting wins


def test_lead_time_covers_the_startup_delay(linear: CapacityModel) -> None:
    # A 10-interval cycle with a step up at positions 8-9; 150 s of start-up = 3 intervals ahead.
    cycle = [50.0] * 8 + [400.0] * 2
    cfg = config(predictor="seasonal", season_s=10 * INTERVAL, startup_delay_s=150.0)
    plan = planner(linear, cfg=cfg)
    assert plan.horizon == 4
    for step, rate in enumerate(cycle * 2):
        plan.observe(interval(step, rate), replicas={P: 1, D: 1})
    # Deciding for position 5 of the third cycle, it already provisions for position 8.
    for step in range(20, 26):
        decision = plan.decide(now=step * INTERVAL, current={P: 1, D: 1})
        plan.observe(interval(step, cycle[step % 10]), replicas=decision.target)
    assert decision.next_forecast is not None
    assert decision.next_forecast.num_requests == pytest.approx(50.0 * INTERVAL)
    assert decision.target == need(linear, 400.0)
    assert any("lead time" in reason for reason in decision.reasons)


def test_scale_down_waits_for_the_delay(linear: CapacityModel) -> None:
    plan = planner(linear, lim=limits(scale_down_delay_s=180.0))
    applied = run(plan, [300.0] * 4 + [20.0] * 6)
    high, low = need(linear, 300.0), need(linear, 20.0)
    prefill = [targets[P] for targets in applied]
    # Decisions use the previous interval; low load is first seen at step 5 and must stand 180 s.
    assert prefill[1:5] == [high[P]] * 4
    assert prefill[5:8] == [high[P]] * 3
    assert prefill[8] == low[P]


def changes(applied: list[dict[Role, int]]) -> int:
    return sum(a[P] != b[P] for a, b in itertools.pairwise(applied))


def test_hysteresis_stops_flapping(linear: CapacityModel) -> None:
    # Load hovering around the point where the prefill pool needs one replica more.
    base = 100.0
    while need(linear, base)[P] == need(linear, base * 1.04)[P]:
        base *= 1.01
    rates = [base * (1.04 if step % 2 else 0.98) for step in range(30)]
    flapping = run(planner(linear), rates)
    steady = run(planner(linear, cfg=config(hysteresis=0.15)), rates)
    assert changes(flapping) >= 20
    assert changes(steady) <= 2


def test_queue_depth_fast_path_scales_up_ahead_of_the_forecast(linear: CapacityModel) -> None:
    plan = planner(linear, lim=limits(queue_depth=10))
    plan.observe(interval(0, 100.0), replicas={P: 2, D: 1})
    calm = plan.decide(now=INTERVAL, current={P: 2, D: 1})
    assert not any("fast path" in reason for reason in calm.reasons)
    assert calm.trigger(P) == "forecast"
    queued = plan.decide(now=INTERVAL, current={P: 2, D: 1}, queues={P: 9000.0})
    assert queued.target[P] > calm.target[P]
    assert any("fast path" in reason for reason in queued.reasons)
    assert (queued.trigger(P), queued.trigger(D)) == ("backlog", "forecast")
    below = plan.decide(now=INTERVAL, current={P: 2, D: 1}, queues={P: 15.0})  # < 10 per replica
    assert not any("fast path" in reason for reason in below.reasons)


def test_what_the_fast_path_adds_stays_for_the_scale_down_delay(linear: CapacityModel) -> None:
    """A queue scales up between intervals; the next interval's forecast, which never saw the
    queue, must not take the replicas back before the scale-down delay has passed."""
    plan = planner(linear, lim=limits(queue_depth=10, scale_down_delay_s=300.0))
    current = {P: 1, D: 1}
    for step in range(8):  # longer than the delay at a steady load: the gate may remove capacity
        plan.observe(interval(step, 100.0), replicas=current)
        current = plan.decide(now=(step + 1) * INTERVAL, current=current).target
    fast = plan.fast_path(now=8.5 * INTERVAL, current=current, queues={P: 9000.0})
    assert fast is not None
    assert fast.target[P] > current[P]
    plan.observe(interval(8, 100.0), replicas=fast.target)
    later = plan.decide(now=9 * INTERVAL, current=fast.target)
    assert later.target[P] == fast.target[P]
    assert any("scale-down delay keeps" in reason for reason in later.reasons)


def burning(
    *, met: float, ttft: float = 0.0, itl: float = 0.0, refused: float = 0.0, **extra: float
) -> Pulse:
    return Pulse(
        time=0.0, window_s=30.0, slo_met=met, ttft_missed=ttft, itl_missed=itl, refused=refused, **extra
    )


def test_an_slo_burn_grows_the_pool_whose_requests_miss(linear: CapacityModel) -> None:
    """TTFT misses and refusals are the prefill pool's, slow tokens the decode pool's; the pool
    grows by at least the share missing, and only past the burn rate and the fewest requests."""
    plan = planner(linear, cfg=config(burn_rate=5.0, burn_min_requests=20))
    plan.observe(interval(0, 10.0), replicas={P: 4, D: 4})
    current = {P: 4, D: 4}
    assert plan.fast_path(now=70.0, current=current, pulse=burning(met=97, ttft=3)) is None  # 3 % < 5 %
    assert plan.fast_path(now=70.0, current=current, pulse=burning(met=9, ttft=9)) is None  # 18 judged
    prefill = plan.fast_path(now=70.0, current=current, pulse=burning(met=60, ttft=20, refused=20))
    assert prefill is not None
    assert prefill.target[P] >= 6  # 40 % missing: 4 x 1.4, rounded up
    assert prefill.target[D] == 4
    assert any("40% of requests missing" in reason for reason in prefill.reasons)
    assert (prefill.trigger(P), prefill.trigger(D)) == ("burn", "forecast")
    decode = plan.fast_path(now=70.0, current=current, pulse=burning(met=80, itl=20))
    assert decode is not None
    assert (decode.target[P], decode.target[D]) == (4, 5)
    assert decode.trigger(D) == "burn"


def test_a_burn_counts_the_replicas_serving_so_starting_ones_are_not_added_twice(
    linear: CapacityModel,
) -> None:
    plan = planner(linear)
    plan.observe(interval(0, 10.0), replicas={P: 4, D: 4})
    misses = {"met": 70.0, "ttft": 30.0}
    first = plan.fast_path(now=70.0, current={P: 4, D: 4}, pulse=burning(**misses, serving=4.0))
    assert first is not None
    grown = first.target
    # Five seconds on, the new replicas are still starting and the misses go on: nothing more.
    assert plan.fast_path(now=75.0, current=grown, pulse=burning(**misses, serving=4.0)) is None


def test_a_burn_sizes_for_the_requests_arriving_not_for_a_backlog_draining(linear: CapacityModel) -> None:
    """The SLO counts are of requests that ended: while a backlog drains they run far above what
    arrives, and a pool sized for them arrives after the backlog is gone."""
    plan = planner(linear, cfg=config(burn_rate=5.0, burn_min_requests=20))
    plan.observe(interval(0, 10.0), replicas={P: 4, D: 4})
    draining = burning(met=6000.0, ttft=4000.0, serving=4.0)  # 10,000 ended in 30 s
    by_ended = plan.fast_path(now=70.0, current={P: 4, D: 4}, pulse=draining)
    by_arrivals = plan.fast_path(
        now=70.0, current={P: 4, D: 4}, pulse=dataclasses.replace(draining, arrived=30.0)
    )
    assert by_ended is not None
    assert by_arrivals is not None
    assert by_arrivals.target[P] < by_ended.target[P]
    assert by_arrivals.target[P] >= 6  # still grown by the share missing (40 %)


def test_queued_prefill_tokens_trigger_the_fast_path_before_the_queue_count_does(
    linear: CapacityModel,
) -> None:
    """Three queued requests are under the per-replica count, but three million prompt tokens
    routed and not prefilled is a minute of prefill against a 200 ms TTFT target."""
    plan = planner(linear, lim=limits(queue_depth=10))
    plan.observe(interval(0, 10.0), replicas={P: 1, D: 1})
    light = Pulse(time=70.0, window_s=30.0, queue_depth=3.0, router_queue=0.0, prefill_tokens=500.0)
    assert plan.fast_path(now=70.0, current={P: 1, D: 1}, pulse=light) is None
    heavy = dataclasses.replace(light, prefill_tokens=3_000_000.0)
    fast = plan.fast_path(now=70.0, current={P: 1, D: 1}, pulse=heavy)
    assert fast is not None
    assert fast.target[P] > 1
    assert any("backlog of 3000" in reason for reason in fast.reasons)


def test_in_flight_sequences_keep_their_decode_replicas(linear: CapacityModel) -> None:
    plan = planner(linear)
    plan.observe(interval(0, 1.0), replicas={P: 4, D: 10})
    # 1050-token contexts: 64 sequences per engine; 500 in flight need 8 engines.
    decision = plan.decide(now=INTERVAL, current={P: 4, D: 10}, inflight=500.0)
    assert decision.target[D] == 8
    assert any("in-flight work needs 8" in reason for reason in decision.reasons)
    # The floor never forces a scale-up by itself.
    assert plan.decide(now=INTERVAL, current={P: 4, D: 5}, inflight=500.0).target[D] == 5


def test_queued_prompts_keep_their_prefill_replicas(linear: CapacityModel) -> None:
    plan = planner(linear, lim=limits(queue_depth=1000))
    plan.observe(interval(0, 1.0), replicas={P: 6, D: 1})
    # 100 queued prompts of 20 ms within the 200 ms TTFT need 10 engines; 6 are there.
    decision = plan.decide(now=INTERVAL, current={P: 6, D: 1}, queues={P: 100.0})
    assert decision.target[P] == 6


def test_targets_respect_bounds_and_budget(linear: CapacityModel) -> None:
    lim = limits(max_replicas=6, gpu_budget=8, gpus_per_replica={P: 2, D: 1})
    plan = planner(linear, lim=lim)
    plan.observe(interval(0, 5000.0), replicas={P: 1, D: 1})
    decision = plan.decide(now=INTERVAL, current={P: 1, D: 1})
    assert decision.sized[P].replicas > 6
    assert lim.gpus(decision.target) <= 8
    assert all(1 <= count <= 6 for count in decision.target.values())
    assert any("max_replicas caps" in reason for reason in decision.reasons)
    assert any("GPU budget 8" in reason for reason in decision.reasons)


def test_aggregated_deployments_size_one_pool(linear: CapacityModel) -> None:
    lim = limits(roles=(W,), gpus_per_replica={W: 2})
    plan = planner(linear, lim=lim)
    plan.observe(interval(0, 50.0), replicas={W: 1})
    decision = plan.decide(now=INTERVAL, current={W: 1})
    assert set(decision.target) == {W}
    expected = linear.aggregated_replicas(Workload(rate=50.0, isl=1000, osl=100), ttft_ms=200.0, itl_ms=20.0)
    assert decision.target[W] == expected.replicas


def test_corrections_learn_slower_engines_from_means(linear: CapacityModel) -> None:
    cfg = config(correction=True, correction_smoothing=1.0)
    plan = planner(linear, cfg=cfg)
    replicas = {P: 4, D: 2}
    obs = interval(0, 100.0)
    means = linear.means(replicas=replicas, load=workload_of(obs), duration_s=INTERVAL)
    plan.observe(
        dataclasses.replace(obs, ttft_mean_ms=means.ttft_ms, itl_mean_ms=means.itl_ms), replicas=replicas
    )
    assert (plan.corrections.prefill, plan.corrections.decode) == pytest.approx((1.0, 1.0), abs=1e-6)
    # Observed 50 % slower prefill: the solved factor makes the mean estimate match the observation.
    slower = dataclasses.replace(obs, ttft_mean_ms=means.ttft_ms * 1.5)
    plan.observe(slower, replicas=replicas)
    assert plan.corrections.prefill > 1.0
    matched = linear.means(
        replicas=replicas,
        load=workload_of(obs),
        duration_s=INTERVAL,
        corrections=Corrections(prefill=plan.corrections.prefill, decode=plan.corrections.decode),
    )
    assert matched.ttft_ms == pytest.approx(means.ttft_ms * 1.5, rel=1e-4)
    # A wild measurement is clamped, and the clamp hit is counted and reported.
    plan.observe(dataclasses.replace(obs, itl_mean_ms=means.itl_ms * 100), replicas=replicas)
    assert plan.corrections.decode == 2.0
    assert plan.clamp_hits == {"prefill": 0, "decode": 1, "itl_tail": 0}
    assert plan.decide(now=2 * INTERVAL, current=replicas).clamped == ("decode",)


def test_corrections_are_solved_against_serving_replicas(linear: CapacityModel) -> None:
    """Replicas still starting hold GPUs but serve nothing: the engines that did serve were not
    slow, so the observation's serving count, not the held one, is what the factor is solved on."""
    cfg = config(correction=True, correction_smoothing=1.0)
    lim = limits(roles=(W,), gpus_per_replica={W: 1}, ttft_ms=2000.0, itl_ms=50.0)
    obs = interval(0, 60.0)
    means = linear.means(replicas={W: 4}, load=workload_of(obs), duration_s=INTERVAL)
    seen = dataclasses.replace(obs, ttft_mean_ms=means.ttft_ms, itl_mean_ms=means.itl_ms, serving=4.0)
    plan = planner(linear, cfg=cfg, lim=lim)
    plan.observe(seen, replicas={W: 8})  # 8 held, 4 of them serving
    assert (plan.corrections.prefill, plan.corrections.decode) == pytest.approx((1.0, 1.0), rel=1e-4)
    blind = planner(linear, cfg=cfg, lim=lim)
    blind.observe(dataclasses.replace(seen, serving=None), replicas={W: 8})
    assert blind.corrections.decode > 1.05  # read against 8 engines, 4 look slow


def test_an_interval_mostly_spent_waiting_leaves_the_prefill_factor_alone(linear: CapacityModel) -> None:
    cfg = config(correction=True, correction_smoothing=1.0)
    lim = limits(roles=(W,), gpus_per_replica={W: 1}, ttft_ms=2000.0, itl_ms=50.0)
    plan = planner(linear, cfg=cfg, lim=lim)
    # four engines at 80 % busy (Erlang C): most of the mean TTFT is queueing
    obs = interval(0, 200.0)
    means = linear.means(replicas={W: 4}, load=workload_of(obs), duration_s=INTERVAL)
    assert means.queue_ms > 0.5 * means.ttft_ms
    plan.observe(dataclasses.replace(obs, ttft_mean_ms=means.ttft_ms * 3, serving=4.0), replicas={W: 4})
    assert plan.corrections.prefill == 1.0


def test_corrections_are_smoothed(linear: CapacityModel) -> None:
    plan = planner(linear, cfg=config(correction=True, correction_smoothing=0.3))
    replicas = {P: 4, D: 2}
    obs = interval(0, 100.0)
    means = linear.means(replicas=replicas, load=workload_of(obs), duration_s=INTERVAL)
    plan.observe(dataclasses.replace(obs, itl_mean_ms=means.itl_ms * 100), replicas=replicas)
    assert plan.corrections.decode == pytest.approx(0.7 + 0.3 * 2.0)


def test_decision_log_line_has_the_numbers(linear: CapacityModel) -> None:
    plan = planner(linear)
    plan.observe(interval(0, 300.0), replicas={P: 1, D: 1})
    line = plan.decide(now=INTERVAL, current={P: 1, D: 1}).describe()
    assert "forecast 300.00 req/s isl 1000 osl 100" in line
    assert "prefill: throughput" in line
    assert "corrections prefill 1.00 decode 1.00" in line


def test_sizing_uses_a_quantile_of_the_forecast_distribution(linear: CapacityModel) -> None:
    # A load alternating between 160 and 240 req/s: the constant predictor's one-step errors are
    # +50 % and -33 %; their p90 (+50 %) grows as sqrt(k) to the lead-time horizon.
    rates = [160.0 if k % 2 else 240.0 for k in range(30)] + [160.0]
    point = planner(linear, cfg=config(startup_delay_s=180.0))
    spread = planner(linear, cfg=config(startup_delay_s=180.0, forecast_quantile=0.9))
    for step, rate in enumerate(rates):
        point.observe(interval(step, rate), replicas={P: 1, D: 1})
        spread.observe(interval(step, rate), replicas={P: 1, D: 1})
    a = point.decide(now=31 * INTERVAL, current={P: 1, D: 1})
    b = spread.decide(now=31 * INTERVAL, current={P: 1, D: 1})
    assert a.margin == 1.0
    # four intervals ahead (180 s of start-up, then the interval it serves): 1 + 0.5 x sqrt(4)
    assert b.margin == pytest.approx(2.0)
    assert b.forecast is not None
    assert b.forecast.num_requests == pytest.approx(160.0 * INTERVAL * 2.0)
    assert b.target[P] > a.target[P]
    assert b.next_forecast is not None
    assert b.next_forecast.num_requests == pytest.approx(160.0 * INTERVAL)


def test_the_itl_tail_factor_reads_the_routers_misses_against_the_model() -> None:
    """The router counts twice the ITL misses the capacity model expects on the serving engines:
    the tail factor goes to 2 (a ratio of sums over the window), the fleet sized for the same load
    grows; intervals with a backlog, with replicas still starting, with TTFT misses beyond the error
    budget, or without the router's counts teach nothing."""
    capacity = CapacityModel(PolynomialPerfModel())
    cfg = config(correction=True, correction_smoothing=1.0)
    lim = limits(roles=(W,), gpus_per_replica={W: 1}, ttft_ms=2000.0, itl_ms=50.0, max_num_seqs=256)
    shape = {"isl_p90": 20000.0, "osl_p10": 20.0, "kv_hit_rate": 0.3, "serving": 8.0}
    base = dataclasses.replace(interval(0, 12.0), isl=8000.0, osl=300.0, **shape)
    means = capacity.means(replicas={W: 8}, load=workload_of(base), duration_s=INTERVAL)
    expected = capacity.attainment(replicas={W: 8}, load=workload_of(base), ttft_ms=2000.0, itl_ms=50.0)
    judged = base.num_requests
    modelled = (1.0 - expected.itl) * judged
    assert modelled > 1.0  # the load is one whose short answers miss

    def seen(step: int, missed: float, **extra: object) -> Observation:
        values: dict[str, object] = {"ttft_missed": 0.0, **extra}
        return dataclasses.replace(
            base,
            timestamp=step * INTERVAL,
            ttft_mean_ms=means.ttft_ms,
            itl_mean_ms=means.itl_ms,
            slo_met=judged - missed,
            itl_missed=missed,
            **values,  # type: ignore[arg-type]
        )

    plan = planner(capacity, cfg=cfg, lim=lim)
    fresh = planner(capacity, cfg=cfg, lim=lim)
    for step in range(10):
        plan.observe(seen(step, 2 * modelled), replicas={W: 8})
        fresh.observe(dataclasses.replace(seen(step, 0.0), slo_met=None), replicas={W: 8})
    assert plan.corrections.itl_tail == pytest.approx((20 * modelled + 1) / (10 * modelled + 1), rel=1e-3)
    assert fresh.corrections.itl_tail == 1.0
    assert plan.size(workload_of(base))[W].replicas > fresh.size(workload_of(base))[W].replicas
    factor = plan.corrections.itl_tail
    plan.observe(seen(10, 50 * modelled), replicas={W: 10})  # 8 serving: 2 of 10 starting
    plan.observe(seen(11, 50 * modelled, ttft_missed=0.05 * judged), replicas={W: 8})  # a burst
    plan.observe(seen(12, 50 * modelled, queue_depth=20.0), replicas={W: 8})  # 20 waiting on 8 engines
    assert plan.corrections.itl_tail == factor


def test_the_error_budget_paces_the_goal_each_interval_is_sized_for() -> None:
    """Two hours (at a half-life of one) in which the router counts no misses leave the budget
    unspent: the same load is sized for 97 % (the spend's top, 3x the 1 % budget) on fewer
    replicas; two hours at three times the budget size it for 99.5 % on more. Without the router's
    counts, or with pacing off, the goal stays 99 %."""
    capacity = CapacityModel(PolynomialPerfModel())
    lim = limits(roles=(W,), gpus_per_replica={W: 1}, ttft_ms=2000.0, itl_ms=50.0, max_num_seqs=256)
    shape = {"isl": 8000.0, "osl": 300.0, "isl_p90": 20000.0, "osl_p10": 20.0, "kv_hit_rate": 0.3}

    def seen(step: int, missed_share: float | None) -> Observation:
        judged = 12.0 * INTERVAL
        counts = (
            {}
            if missed_share is None
            else {"slo_met": judged * (1 - missed_share), "ttft_missed": judged * missed_share}
        )
        return dataclasses.replace(interval(step, 12.0), **shape, **counts)

    hourly = config(budget_halflife_s=3600.0)
    unspent, overspent, uncounted = (planner(capacity, cfg=hourly, lim=lim) for _ in range(3))
    fixed = planner(capacity, cfg=config(budget_halflife_s=3600.0, budget_spend_bounds=(1.0, 1.0)), lim=lim)
    for step in range(120):
        unspent.observe(seen(step, 0.0), replicas={W: 6})
        fixed.observe(seen(step, 0.0), replicas={W: 6})
        overspent.observe(seen(step, 0.03), replicas={W: 6})
        uncounted.observe(seen(step, None), replicas={W: 6})
    now = 120 * INTERVAL
    low, high, plain, off = (
        p.decide(now=now, current={W: 6}) for p in (unspent, overspent, uncounted, fixed)
    )
    assert low.goal == pytest.approx(0.97)
    assert high.goal == pytest.approx(0.995)
    assert plain.goal == off.goal == pytest.approx(0.99)
    assert low.target[W] < plain.target[W] < high.target[W]
    assert off.target == plain.target
    assert "sized for 97.00% within SLO" in low.describe()


def test_prompts_no_fleet_serves_in_time_spend_the_budget_like_any_miss() -> None:
    """The SLO counts every request: prompts whose own prefill exceeds the TTFT target spend the
    budget like any other miss (leaving out the share the model calls unreachable made the goal
    hold over the rest only, and the model's share runs high). A goal they make infeasible pins
    the spend at its floor; sizing still leaves them out (``goal x reachable``), so the pool stays
    bounded and the decision says the target is unreachable."""
    capacity = CapacityModel(PolynomialPerfModel())
    lim = limits(roles=(W,), gpus_per_replica={W: 1}, ttft_ms=1000.0, itl_ms=50.0, max_num_seqs=256)
    shape = {"isl": 8000.0, "osl": 300.0, "isl_p90": 20000.0, "osl_p10": 20.0, "kv_hit_rate": 0.3}
    load = dataclasses.replace(interval(0, 12.0), **shape)
    unreachable = 1.0 - capacity.reachable(workload_of(load), ttft_ms=1000.0, corrections=Corrections())
    assert unreachable > 0.01  # more than the whole budget
    plan = planner(capacity, cfg=config(budget_halflife_s=3600.0), lim=lim)
    judged = load.num_requests
    for step in range(180):  # three half-lives
        lost = dataclasses.replace(
            load,
            timestamp=step * INTERVAL,
            slo_met=judged * (1 - unreachable),
            ttft_missed=judged * unreachable,
        )
        plan.observe(lost, replicas={W: 6})
    assert plan.budget.spend == pytest.approx(0.5)  # the floor
    decision = plan.decide(now=180 * INTERVAL, current={W: 6})
    assert decision.goal == pytest.approx(0.995)
    assert not decision.sized[W].feasible
    assert decision.target[W] < lim.max_replicas
    assert "(target unreachable)" in decision.describe()


def test_disaggregated_pools_are_sized_together_against_one_goal(linear: CapacityModel) -> None:
    plan = planner(linear)
    load = Workload(rate=300.0, isl=1000.0, osl=100.0)
    sized = plan.size(load, goal=0.98)
    assert sized == linear.disaggregated_replicas(
        load, ttft_ms=200.0, itl_ms=20.0, gpus_per_replica=plan.limits.gpus_per_replica, goal=0.98
    )


def test_the_fast_loop_answers_an_incident_at_the_goal_not_at_the_paced_one() -> None:
    """Pacing sized a quiet afternoon for 97 %; a burn then grows the pool to what the goal (99 %)
    needs at the window's rate, as it would without pacing."""
    capacity = CapacityModel(PolynomialPerfModel())
    lim = limits(roles=(W,), gpus_per_replica={W: 1}, ttft_ms=2000.0, itl_ms=50.0, max_num_seqs=256)
    shape = {"isl": 8000.0, "osl": 300.0, "isl_p90": 20000.0, "osl_p10": 20.0, "kv_hit_rate": 0.3}
    paced, plain = (
        planner(capacity, cfg=config(budget_halflife_s=3600.0), lim=lim),
        planner(capacity, lim=lim),
    )
    for step in range(120):
        quiet = dataclasses.replace(interval(step, 12.0), **shape)
        paced.observe(
            dataclasses.replace(quiet, slo_met=quiet.num_requests, ttft_missed=0.0), replicas={W: 6}
        )
        plain.observe(quiet, replicas={W: 6})
    assert paced.budget.goal == pytest.approx(0.97)
    burning = Pulse(time=120 * INTERVAL, window_s=30.0, slo_met=480.0, ttft_missed=120.0)
    a = paced.decide(now=120 * INTERVAL, current={W: 4}, pulse=burning)
    b = plain.decide(now=120 * INTERVAL, current={W: 4}, pulse=burning)
    assert a.raised_by == b.raised_by == {W: "burn"}
    assert a.target == b.target


def test_budget_spend_bounds_must_stay_below_the_burn_rate() -> None:
    with pytest.raises(
        ValueError, match=r"budget_spend_bounds \(0.5, 6.0\) must satisfy .* burn_rate \(5.0\)"
    ):
        config(budget_spend_bounds=(0.5, 6.0))
    with pytest.raises(ValueError, match="would size an interval for no request"):
        config(attainment_goal=0.7, budget_spend_bounds=(0.5, 4.0))
