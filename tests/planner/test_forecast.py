"""The load forecaster: the count by the predictor, the shapes by their recent request-weighted mean."""

from __future__ import annotations

import pytest

from copse.planner.forecast import LoadForecaster
from copse.planner.observations import Observation

MINUTE = 60.0


def minute(step: int, requests: float, **shapes: float | None) -> Observation:
    lengths: dict[str, float | None] = {"isl": 1000.0, "osl": 100.0}
    return Observation(
        timestamp=step * MINUTE, duration_s=MINUTE, num_requests=requests, **(lengths | shapes)
    )


def test_shapes_are_the_request_weighted_mean_of_the_window_and_the_count_is_the_predictors() -> None:
    forecaster = LoadForecaster("constant", shape_window=3)
    forecaster.observe(minute(0, 100, isl=9000.0, kv_hit_rate=0.9))  # pushed out of the window below
    forecaster.observe(minute(1, 300, isl=1000.0, kv_hit_rate=0.2))
    forecaster.observe(minute(2, 100, isl=5000.0, kv_hit_rate=0.6))
    forecaster.observe(minute(3, 0, isl=None, osl=None))  # no requests: no shapes, the window keeps its three
    forecaster.observe(minute(4, 600, isl=3000.0, kv_hit_rate=0.4))
    [next_minute, later] = forecaster.forecast(2)
    assert next_minute.num_requests == later.num_requests == 600.0, "constant: the last count"
    assert next_minute.isl == pytest.approx((300 * 1000 + 100 * 5000 + 600 * 3000) / 1000)
    assert next_minute.kv_hit_rate == pytest.approx((300 * 0.2 + 100 * 0.6 + 600 * 0.4) / 1000)
    assert later.isl == next_minute.isl, "the shapes are the same at every horizon"


def test_one_odd_minute_moves_the_shapes_by_its_share_of_the_window() -> None:
    forecaster = LoadForecaster("constant", shape_window=5)
    for step in range(5):
        forecaster.observe(minute(step, 400, isl=8000.0, isl_p90=20000.0))
    forecaster.observe(minute(5, 400, isl=12000.0, isl_p90=30000.0))
    [forecast] = forecaster.forecast(1)
    assert forecast.isl == pytest.approx(8800.0)
    assert forecast.isl_p90 == pytest.approx(22000.0)
    alone = LoadForecaster("constant", shape_window=1)
    alone.observe(minute(0, 400, isl=12000.0))
    assert alone.forecast(1)[0].isl == 12000.0, "a window of one is the last interval's shapes"


def test_optional_shapes_absent_from_the_window_are_none_and_lengths_fall_back_to_defaults() -> None:
    forecaster = LoadForecaster("constant", shape_window=2, default_isl=3000.0, default_osl=150.0)
    forecaster.observe(minute(0, 0, isl=None, osl=None))
    [quiet] = forecaster.forecast(1)
    assert (quiet.num_requests, quiet.isl, quiet.osl, quiet.isl_p90) == (0.0, 3000.0, 150.0, None)
    forecaster.observe(minute(1, 50, osl_p10=20.0))
    forecaster.observe(minute(2, 50))
    forecaster.observe(minute(3, 50))
    [forecast] = forecaster.forecast(1)
    assert forecast.osl_p10 is None, "the interval that gave it left the window"
    assert (forecast.isl, forecast.osl) == (1000.0, 100.0)


def test_a_quantile_raises_the_counts_and_leaves_the_shapes() -> None:
    forecaster = LoadForecaster("constant", shape_window=5)
    for step, requests in enumerate([100, 110, 90, 120, 80, 100, 105, 95, 115, 85, 100, 100]):
        forecaster.observe(minute(step, requests, isl=1000.0 + 100 * (step % 2)))
    points = forecaster.forecast(4)
    uppers = forecaster.forecast(4, quantile=0.9)
    assert all(upper.num_requests > point.num_requests for upper, point in zip(uppers, points, strict=True))
    assert [upper.isl for upper in uppers] == [point.isl for point in points]


def test_the_window_must_hold_an_interval() -> None:
    with pytest.raises(ValueError, match="shape_window=0 must be at least 1"):
        LoadForecaster("constant", shape_window=0)
