"""The dry run: honest estimates (decided before seeing the interval, start-up delay respected,
actual load through the queueing model), GPU-hours, the static-peak baseline and the JSON shape."""

from __future__ import annotations

import pytest

from copse.api import Role
from copse.planner.capacity import CapacityModel, Workload
from copse.planner.config import PlannerConfig
from copse.planner.core import Planner
from copse.planner.dryrun import DryRunResult, dry_run
from copse.planner.observations import Observation
from copse.planner.policy import Limits

P, D, W = Role.PREFILL, Role.DECODE, Role.WORKER
INTERVAL = 600.0


def observations(rates: list[float]) -> list[Observation]:
    return [
        Observation(
            timestamp=1000.0 + i * INTERVAL,
            duration_s=INTERVAL,
            num_requests=rate * INTERVAL,
            isl=1000.0 if rate else None,
            osl=100.0 if rate else None,
        )
        for i, rate in enumerate(rates)
    ]


def replay(
    capacity: CapacityModel,
    rates: list[float],
    *,
    startup_delay_s: float = 0.0,
    predictor: str = "constant",
    **limit_overrides: object,
) -> DryRunResult:
    config = PlannerConfig(
        predictor=predictor,
        headroom=1.0,
        forecast_quantile=None,
        hysteresis=0.0,
        startup_delay_s=startup_delay_s,
    )
    values: dict[str, object] = {
        "roles": (P, D),
        "gpus_per_replica": {P: 1, D: 1},
        "ttft_ms": 200.0,
        "itl_ms": 20.0,
        "min_replicas": 1,
        "max_replicas": 100,
        "scale_down_delay_s": 0.0,
        "max_num_seqs": 64,
    }
    values.update(limit_overrides)
    limits = Limits(**values)  # type: ignore[arg-type]
    planner = Planner(config=config, limits=limits, capacity=capacity, interval_s=INTERVAL)
    return dry_run(observations(rates), planner=planner, startup_delay_s=startup_delay_s)


def test_json_has_exactly_the_documented_shape(linear: CapacityModel) -> None:
    document = replay(linear, [50.0, 60.0, 0.0]).as_json()
    assert set(document) == {"intervals", "summary"}
    assert document["summary"]["method"] == "analytic estimate"
    assert set(document["summary"]) == {
        "method",
        "gpu_hours",
        "static_peak_gpu_hours",
        "slo_attainment",
        "interval_attainment",
        "scaling_events",
    }
    for row in document["intervals"]:
        assert set(row) == {
            "timestamp",
            "num_requests",
            "predicted_num_requests",
            "prefill_replicas",
            "decode_replicas",
            "est_ttft_ms",
            "est_itl_ms",
            "slo_ok",
            "est_attainment",
        }
    assert [row["timestamp"] for row in document["intervals"]] == [1000.0, 1600.0, 2200.0]


def test_the_dry_run_judges_the_slo_per_request(linear: CapacityModel) -> None:
    """Requests, not intervals: a busy interval the planner could not see coming weighs by its
    requests, and the estimate never says more than the steady state on the replicas serving."""
    result = replay(linear, [20.0] * 5 + [300.0] + [20.0] * 5)
    rows = result.intervals
    burst = rows[5]
    assert burst.est_attainment < 0.5  # too few replicas, and a backlog behind them
    assert all(0.0 <= row.est_attainment <= 1.0 for row in rows)
    requests = sum(row.num_requests for row in rows)
    expected = sum(row.est_attainment * row.num_requests for row in rows) / requests
    assert result.summary.slo_attainment == pytest.approx(expected)
    # the 300 req/s interval holds most requests: the per-request share is far below the share of
    # intervals within target
    assert result.summary.slo_attainment < result.summary.interval_attainment


def test_replicas_are_decided_before_the_interval_is_seen(linear: CapacityModel) -> None:
    result = replay(linear, [50.0, 50.0, 50.0, 400.0, 400.0, 400.0])
    rows = result.intervals
    # The first interval runs on the minimum, the burst's first interval on what 50 req/s needs.
    assert rows[0].replicas == {P: 1, D: 1}
    assert rows[3].replicas == rows[2].replicas
    assert rows[3].predicted_num_requests == pytest.approx(50.0 * INTERVAL)
    assert not rows[3].slo_ok  # the burst finds too few replicas: a miss, not a hidden success
    assert rows[3].est_ttft_ms > 200.0
    # The constant predictor and the queue fast path catch up one interval later; the backlog
    # left by the burst is worked off after that.
    assert rows[4].replicas[P] > rows[3].replicas[P]
    assert rows[5].est_ttft_ms <= 200.0


def test_a_backlog_carries_into_the_next_interval(linear: CapacityModel) -> None:
    burst = replay(linear, [50.0, 50.0, 400.0, 50.0, 50.0])
    calm = replay(linear, [50.0, 50.0, 50.0, 50.0, 50.0])
    # Interval 3 is calm in both, but in the first it still works off the burst's queue.
    assert burst.intervals[3].est_ttft_ms > calm.intervals[3].est_ttft_ms * 10


def test_startup_delay_costs_attainment(linear: CapacityModel) -> None:
    rates = [50.0] * 3 + [300.0] * 6
    instant = replay(linear, rates, startup_delay_s=0.0)
    slow = replay(linear, rates, startup_delay_s=2 * INTERVAL)
    assert slow.summary.slo_attainment < instant.summary.slo_attainment
    # With a start-up of two intervals the scale-up decided after the burst's first interval
    # serves only from the burst's fourth.
    assert slow.intervals[4].replicas[P] == slow.intervals[3].replicas[P]
    assert slow.intervals[6].replicas[P] > slow.intervals[3].replicas[P]


def test_lead_time_scales_up_early_when_the_rise_is_predictable(linear: CapacityModel) -> None:
    # A cycle of 4 intervals (season_s) that the seasonal predictor learns; replicas take a whole
    # interval to start.
    cycle = [50.0, 50.0, 300.0, 300.0]
    limits = Limits(
        roles=(P, D),
        gpus_per_replica={P: 1, D: 1},
        ttft_ms=200.0,
        itl_ms=20.0,
        max_replicas=100,
        scale_down_delay_s=0.0,
        max_num_seqs=64,
    )

    def attainment(planned_delay_s: float) -> list[bool]:
        config = PlannerConfig(
            predictor="seasonal",
            season_s=4 * INTERVAL,
            headroom=1.0,
            forecast_quantile=None,
            hysteresis=0.0,
            startup_delay_s=planned_delay_s,
        )
        planner = Planner(config=config, limits=limits, capacity=linear, interval_s=INTERVAL)
        result = dry_run(observations(cycle * 5), planner=planner, startup_delay_s=INTERVAL)
        return [row.slo_ok for row in result.intervals[12:]]

    # Knowing the start-up delay, it starts replicas an interval early and meets every rise.
    assert all(attainment(INTERVAL))
    # Planning as if replicas started at once, every rise finds too few replicas.
    assert attainment(0.0).count(False) >= 2


def test_gpu_hours_count_replicas_that_are_still_starting(linear: CapacityModel) -> None:
    fixed = replay(linear, [50.0] * 4, min_replicas=3, max_replicas=3)
    assert fixed.summary.gpu_hours == pytest.approx(6 * 4 * INTERVAL / 3600)
    assert fixed.summary.static_peak_gpu_hours == pytest.approx(fixed.summary.gpu_hours)
    assert fixed.summary.scaling_events == 0
    # Scaling up with a start-up of half an interval: the new replicas hold GPUs while starting.
    rates = [1.0, 300.0, 300.0]
    growing = replay(linear, rates, startup_delay_s=INTERVAL / 2)
    second = growing.intervals[2]
    assert second.gpus > sum(growing.intervals[1].replicas.values())
    held = sum(row.gpus for row in growing.intervals)
    assert growing.summary.gpu_hours == pytest.approx(held * INTERVAL / 3600)


def test_static_peak_is_sized_for_the_busiest_interval(linear: CapacityModel) -> None:
    result = replay(linear, [20.0, 300.0] + [20.0] * 10)
    load = Workload(rate=300.0, isl=1000.0, osl=100.0)
    expected = {
        P: linear.prefill_replicas(load, ttft_ms=200.0).replicas,
        D: linear.decode_replicas(load, itl_ms=20.0).replicas,
    }
    assert result.summary.static_peak_replicas == expected
    hours = 12 * INTERVAL / 3600
    assert result.summary.static_peak_gpu_hours == pytest.approx(sum(expected.values()) * hours)
    assert result.summary.static_slo_attainment >= 0.99  # per request, the goal it is sized for
    assert result.summary.interval_attainment < 1.0
    assert result.summary.gpu_hours < result.summary.static_peak_gpu_hours


def test_scaling_events_count_changed_decisions(linear: CapacityModel) -> None:
    result = replay(linear, [50.0, 50.0, 300.0, 300.0, 50.0, 50.0])
    changed = sum(row.decision.changed for row in result.intervals)
    assert result.summary.scaling_events == changed
    assert changed >= 2


def test_aggregated_rows_report_the_worker_count_in_both_columns(linear: CapacityModel) -> None:
    result = replay(linear, [50.0, 50.0], roles=(W,), gpus_per_replica={W: 2})
    row = result.as_json()["intervals"][1]
    assert row["prefill_replicas"] == row["decode_replicas"] == result.intervals[1].replicas[W]


def test_idle_intervals_meet_the_slo(linear: CapacityModel) -> None:
    result = replay(linear, [0.0, 0.0, 30.0])
    assert [row.slo_ok for row in result.intervals[:2]] == [True, True]
    assert result.intervals[0].est_ttft_ms == 0.0
