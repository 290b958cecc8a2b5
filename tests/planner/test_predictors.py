"""Load predictors on synthetic series: constant, linear trend, sinusoid, spike."""

from __future__ import annotations

import math

import numpy as np
import pmdarima
import pytest

from copse.planner.predictors import (
    PREDICTORS,
    ArimaPredictor,
    KalmanPredictor,
    Predictor,
    PredictorSettings,
    StateSpaceFilter,
    make_predictor,
)
from copse.planner.predictors import _filter_from as filter_from

ALL = sorted(PREDICTORS)
SETTINGS = PredictorSettings(period=24, arima_min_points=12, arima_refit_every=48)


def feed(predictor: Predictor, values: list[float] | np.ndarray) -> list[float]:
    """One-step forecasts made before each value is observed."""
    forecasts = []
    for value in values:
        forecasts.append(float(predictor.forecast(1)[0]))
        predictor.observe(float(value))
    return forecasts


def test_registry_has_the_documented_names() -> None:
    assert set(PREDICTORS) == {"constant", "moving_average", "arima", "kalman", "seasonal"}


def test_unknown_predictor_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown predictor 'prophet'; known: arima, constant"):
        make_predictor("prophet")


def test_settings_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="window=0"):
        PredictorSettings(window=0)
    with pytest.raises(ValueError, match="arima_fit_window=5 must be at least arima_min_points=12"):
        PredictorSettings(arima_fit_window=5)


@pytest.mark.parametrize("name", ALL)
def test_no_data_forecasts_zero(name: str) -> None:
    assert make_predictor(name, SETTINGS).forecast(3).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("name", ALL)
def test_constant_series_forecasts_the_constant(name: str) -> None:
    predictor = make_predictor(name, SETTINGS)
    feed(predictor, [42.0] * 60)
    assert predictor.forecast(4) == pytest.approx([42.0] * 4, rel=1e-6)


@pytest.mark.parametrize("name", ALL)
def test_leading_zeros_and_nan_are_skipped(name: str) -> None:
    predictor = make_predictor(name, SETTINGS)
    feed(predictor, [0.0] * 10 + [math.nan] + [7.0] * 30)
    assert predictor.forecast(1)[0] == pytest.approx(7.0, rel=1e-6)


def test_constant_predictor_repeats_the_last_value() -> None:
    predictor = make_predictor("constant")
    forecasts = feed(predictor, [1.0, 5.0, 3.0])
    assert forecasts == [0.0, 1.0, 5.0]
    assert predictor.forecast(2).tolist() == [3.0, 3.0]


def test_moving_average_is_the_mean_of_the_window() -> None:
    predictor = make_predictor("moving_average", PredictorSettings(window=3))
    feed(predictor, [1.0, 2.0, 3.0, 10.0])
    assert predictor.forecast(1)[0] == pytest.approx(5.0)  # (2 + 3 + 10) / 3


@pytest.mark.parametrize("name", ["kalman", "arima"])
def test_trend_followers_track_a_linear_trend(name: str) -> None:
    series = 100.0 + 5.0 * np.arange(80)
    predictor = make_predictor(name, SETTINGS)
    feed(predictor, series)
    ahead = predictor.forecast(3)
    expected = 100.0 + 5.0 * np.arange(80, 83)
    assert ahead == pytest.approx(expected, rel=0.03)
    # Lagging predictors fall a whole step behind on the same series.
    constant = make_predictor("constant")
    feed(constant, series)
    assert abs(constant.forecast(1)[0] - expected[0]) == pytest.approx(5.0)


def sinusoid(n: int, period: int = 24) -> np.ndarray:
    return 100.0 + 50.0 * np.sin(2 * np.pi * np.arange(n) / period)


def test_seasonal_repeats_a_daily_cycle() -> None:
    series = sinusoid(24 * 4)
    predictor = make_predictor("seasonal", SETTINGS)
    forecasts = np.array(feed(predictor, series))
    # After one whole period it knows the cycle exactly.
    assert forecasts[30:] == pytest.approx(series[30:], rel=1e-9)
    assert predictor.forecast(24) == pytest.approx(sinusoid(24 * 5)[24 * 4 :], rel=1e-9)


def test_seasonal_scales_the_cycle_with_the_recent_level() -> None:
    series = sinusoid(48)
    series[36:] *= 1.5  # the level rose half a day ago
    predictor = make_predictor("seasonal", SETTINGS)
    feed(predictor, series)
    assert predictor.forecast(1)[0] == pytest.approx(sinusoid(49)[48] * 1.5, rel=1e-9)


def test_seasonal_beats_the_others_on_a_sinusoid() -> None:
    series = sinusoid(24 * 5)
    errors = {}
    for name in ALL:
        forecasts = np.array(feed(make_predictor(name, SETTINGS), series))
        errors[name] = float(np.mean(np.abs(forecasts[48:] - series[48:])))
    assert min(errors, key=lambda name: errors[name]) == "seasonal"
    assert errors["arima"] < errors["moving_average"]


@pytest.mark.parametrize("name", ALL)
def test_a_single_spike_is_not_taken_as_the_new_level(name: str) -> None:
    base = [100.0] * 40 + [100.0 + (i % 2) for i in range(20)]
    predictor = make_predictor(name, SETTINGS)
    feed(predictor, [*base, 1000.0])
    right_after = predictor.forecast(1)[0]
    # ARIMA finds no structure in this series and falls back to the local level, whose MA term
    # the fit takes from the data: a flat start gives it none, so it follows the last value.
    if name in {"moving_average", "kalman"}:
        assert right_after < 700.0  # smoothed, not adopted
    forecasts = feed(predictor, [100.0] * 20)
    assert min(forecasts) >= 0.0
    if name == "seasonal":
        # It expects the spike again a period after it, and nothing else changes.
        assert predictor.forecast(1)[0] == pytest.approx(100.5, rel=0.02)
        return
    # Twenty intervals after the spike the forecast is back at the base level.
    assert predictor.forecast(1)[0] == pytest.approx(100.0, rel=0.05)


def test_arima_without_structure_follows_the_level_between_refits() -> None:
    """Noise around a level, then the level triples: within a few intervals, long before the next
    refit, the forecast has moved to the new level (a fitted mean would hold the old one)."""
    rng = np.random.default_rng(3)
    settings = PredictorSettings(
        period=10_000, arima_min_points=12, arima_refit_every=200, arima_fit_window=200
    )
    predictor = make_predictor("arima", settings)
    feed(predictor, 100.0 + rng.normal(0.0, 5.0, 120))
    before = predictor.forecast(1)[0]
    assert before == pytest.approx(100.0, rel=0.1)
    feed(predictor, 300.0 + rng.normal(0.0, 5.0, 8))
    assert predictor.forecast(1)[0] > 200.0


def test_arima_interval_is_calibrated_on_its_own_errors() -> None:
    """Heavy-tailed bursts on a random walk: the model's Gaussian interval under-covers; scored on
    its recent errors, the p90 bound holds close to 90 % of the outcomes one step ahead."""
    rng = np.random.default_rng(7)
    level = 100.0 * np.exp(np.cumsum(rng.normal(0.0, 0.03, 600)))
    series = level * np.exp(rng.standard_t(2, 600) * 0.08)
    settings = PredictorSettings(period=10_000, arima_refit_every=100, arima_fit_window=200)
    predictor = make_predictor("arima", settings)
    covered = []
    for k, value in enumerate(series):
        if k >= 150:
            covered.append(value <= predictor.upper(1, 0.9)[0])
        predictor.observe(float(value))
    assert 0.85 <= float(np.mean(covered)) <= 0.95


def test_arima_takes_a_daily_profile_out_once_it_has_two_days() -> None:
    """Three days of a noisy daily cycle: the seasonal profile is found and the forecast a quarter
    of a day ahead follows the cycle, which a model without it cannot."""
    rng = np.random.default_rng(5)
    series = sinusoid(24 * 3) * np.exp(rng.normal(0.0, 0.02, 24 * 3))
    predictor = make_predictor("arima", SETTINGS)
    feed(predictor, series)
    assert predictor.seasonal == (24,)  # type: ignore[attr-defined]
    ahead = predictor.forecast(12)
    expected = sinusoid(24 * 3 + 12)[24 * 3 :]
    assert float(np.mean(np.abs(ahead - expected) / expected)) < 0.1


@pytest.mark.parametrize("name", ALL)
def test_forecasts_are_never_negative(name: str) -> None:
    series = [50.0, 40.0, 30.0, 20.0, 10.0, 5.0, 1.0] * 3
    predictor = make_predictor(name, SETTINGS)
    feed(predictor, series)
    assert (predictor.forecast(10) >= 0).all()


def test_kalman_is_scale_free() -> None:
    small, large = KalmanPredictor(SETTINGS), KalmanPredictor(SETTINGS)
    series = 10.0 + np.sin(np.arange(30))
    feed(small, series)
    feed(large, series * 1000)
    assert large.forecast(3) == pytest.approx(small.forecast(3) * 1000, rel=1e-9)


def test_state_space_filter_matches_statsmodels() -> None:
    rng = np.random.default_rng(7)
    series = np.empty(120)
    series[0] = 50.0
    for t in range(1, 120):
        series[t] = 10.0 + 0.8 * series[t - 1] + rng.normal(0, 2)
    model = pmdarima.ARIMA(order=(1, 0, 1), suppress_warnings=True).fit(series[:100])
    ours: StateSpaceFilter = filter_from(model.arima_res_)
    for value in series[100:]:
        ours.update(float(value))
    theirs = model.arima_res_.extend(series[100:])
    assert ours.forecast(5) == pytest.approx(np.asarray(theirs.forecast(5)), rel=1e-8)


def test_state_space_forecast_variance_is_pmdarimas_prediction_interval() -> None:
    """``upper`` of ARIMA is the one-sided bound of pmdarima's ``conf_int``: same variance."""
    rng = np.random.default_rng(5)
    series = np.empty(120)
    series[0] = 50.0
    for t in range(1, 120):
        series[t] = 10.0 + 0.8 * series[t - 1] + rng.normal(0, 2)
    model = pmdarima.ARIMA(order=(1, 0, 1), suppress_warnings=True).fit(series)
    ours: StateSpaceFilter = filter_from(model.arima_res_)
    _point, bounds = model.predict(n_periods=6, return_conf_int=True, alpha=0.2)  # 80 % two-sided
    upper = ours.forecast(6) + 1.2815515655446004 * np.sqrt(ours.variance(6))  # its p90
    assert upper == pytest.approx(np.asarray(bounds)[:, 1], rel=1e-6)


def test_arima_upper_uses_its_own_interval() -> None:
    rng = np.random.default_rng(11)
    series = np.empty(80)
    series[0] = 200.0
    for t in range(1, 80):
        series[t] = 40.0 + 0.8 * series[t - 1] + rng.normal(0, 3)
    predictor = ArimaPredictor(SETTINGS)
    feed(predictor, series)
    point, upper = predictor.forecast(5), predictor.upper(5, 0.9)
    assert np.all(upper > point)
    assert np.all(np.diff(upper - point) >= 0)  # the interval widens with the horizon


def test_residual_spread_grows_with_the_horizon() -> None:
    """Predictors without an error model: the quantile of their own one-step errors, x sqrt(k)."""
    predictor = make_predictor("constant", SETTINGS)
    for k in range(40):
        predictor.observe(160.0 if k % 2 else 240.0)  # last: 160; errors +50 % and -33 %
    assert predictor.upper(4, 0.5) == pytest.approx([160.0] * 4)
    assert predictor.upper(4, 0.9) == pytest.approx(160.0 * (1 + 0.5 * np.sqrt([1, 2, 3, 4])))
    fresh = make_predictor("constant", SETTINGS)
    fresh.observe(100.0)
    fresh.observe(300.0)
    assert fresh.upper(2, 0.9) == pytest.approx([300.0, 300.0])  # too few errors to say


def test_arima_refits_on_log1p_when_the_raw_fit_is_white_noise() -> None:
    rng = np.random.default_rng(3)
    predictor = ArimaPredictor(SETTINGS)
    feed(predictor, 1000.0 + rng.normal(0, 5, size=20))
    assert predictor.log_transformed
    assert predictor.forecast(1)[0] == pytest.approx(1000.0, rel=0.02)


def test_arima_keeps_the_order_between_refits_and_updates_in_between() -> None:
    rng = np.random.default_rng(11)
    series = np.empty(100)
    series[0] = 200.0
    for t in range(1, 100):
        series[t] = 40.0 + 0.8 * series[t - 1] + rng.normal(0, 3)
    predictor = ArimaPredictor(SETTINGS)
    feed(predictor, series[:60])
    order = predictor.order
    assert order is not None
    before = predictor.forecast(1)[0]
    predictor.observe(float(series[60]) + 30.0)  # one step, no refit: the state moves
    assert predictor.order == order
    assert predictor.forecast(1)[0] != pytest.approx(before)


def test_arima_handles_a_constant_series_turning_variable() -> None:
    predictor = ArimaPredictor(SETTINGS)
    feed(predictor, [5.0] * 20)
    assert predictor.order is None
    assert predictor.forecast(1)[0] == 5.0
    feed(predictor, 5.0 + 2.0 * np.arange(1, 30))
    assert predictor.order is not None
    assert predictor.forecast(1)[0] == pytest.approx(5.0 + 2.0 * 30, rel=0.05)
