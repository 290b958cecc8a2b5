"""Load predictors: given one series observed interval by interval, forecast its next values.

Every predictor has the same three methods, ``observe(value)``, ``forecast(steps)`` (the point
forecast) and ``upper(steps, quantile)`` (a quantile of its forecast distribution at each horizon),
and is made by name from :data:`PREDICTORS` (``constant``, ``moving_average``, ``arima``,
``kalman``, ``seasonal``). They are pure (no I/O) and never forecast a negative value.

The forecast distribution: ARIMA's own prediction interval (the state-space forecast variance,
what pmdarima's ``conf_int`` reports), on the log scale when the model was fitted on ``log1p``.
The others have no calibrated model of their errors, so they use their own recent one-step errors
(relative to the forecast, the last ``error_window``): the empirical ``quantile`` of those, grown
with the horizon as ``sqrt(k)`` (independent steps add variances).

ARIMA and the Kalman filter share one linear-Gaussian state-space filter: pmdarima's
``auto_arima`` chooses the order and estimates the parameters, and each new observation is then
one Kalman step over the fitted model's matrices -- the same recursion statsmodels runs, but in
constant time per observation. pmdarima's own ``ARIMA.update`` refits over the whole history on
every call, so it slows down linearly with the series (about 0.1 s per update at 1,000 points),
which rules it out for a 2,016-interval replay.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from statistics import NormalDist
from typing import Any

import numpy as np
from numpy.typing import NDArray
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

FloatArray = NDArray[np.float64]
#: One-step errors needed before their quantile is used (fewer say little of the distribution).
_MIN_ERRORS = 10
#: Fourier harmonics per seasonal period: three follow a daily cycle's morning rise, evening peak
#: and night trough without fitting the window-to-window noise.
_HARMONICS = 3
#: Days in the weekly period.
_WEEK = 7
#: Weeks of history the seasonal profile is fitted on.
_SEASON_HISTORY_WEEKS = 2
#: One-step errors in a row, each beyond ``_BREAK_SCORE`` standard deviations the same way, that
#: make ARIMA refit at once (a Gaussian model sees three such in a row once in 10^6 steps).
_BREAK_RUN = 3
_BREAK_SCORE = 3.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PredictorSettings:
    """Knobs shared by the predictors; each predictor reads the ones it needs."""

    window: int = 6
    """moving_average: intervals averaged; six 10-minute intervals smooth noise without lagging an hour."""
    period: int = 144
    """seasonal: intervals per season (a day of 10-minute intervals), the cycle it repeats."""
    level_window: int = 6
    """seasonal: recent intervals compared with the same intervals a season earlier to scale the cycle."""
    arima_min_points: int = 12
    """arima: observations before the first fit; fewer gives auto_arima nothing to choose from."""
    arima_fit_window: int = 288
    """arima: most recent points a (re)fit sees; two days of 10-minute intervals keeps fits under a second."""
    arima_refit_every: int = 144
    """arima: observations between parameter refits (order kept); state updates happen every step."""
    kalman_q_level: float = 1.0
    """kalman: level noise variance (relative to r; Dynamo's default)."""
    kalman_q_trend: float = 0.1
    """kalman: trend noise variance; small so one spike does not become a trend."""
    kalman_r: float = 10.0
    """kalman: observation noise variance; large relative to q so the filter smooths."""
    error_window: int = 144
    """Recent one-step errors a residual-based forecast distribution is taken over (a day of
    10-minute intervals; 2.4 hours of 1-minute ones)."""

    def __post_init__(self) -> None:
        for name in (
            "window",
            "period",
            "level_window",
            "arima_min_points",
            "arima_refit_every",
            "error_window",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"predictor setting {name}={getattr(self, name)} must be at least 1")
        if self.arima_fit_window < self.arima_min_points:
            raise ValueError(
                f"arima_fit_window={self.arima_fit_window} must be at least "
                f"arima_min_points={self.arima_min_points}"
            )
        for name in ("kalman_q_level", "kalman_q_trend", "kalman_r"):
            if getattr(self, name) <= 0:
                raise ValueError(f"predictor setting {name}={getattr(self, name)} must be positive")


class Predictor(ABC):
    """Forecasts one non-negative series one interval at a time.

    Leading zeros are skipped (a deployment that has not received traffic yet says nothing about
    its load), and non-finite values are ignored (a ratio of two zero counters).
    """

    def __init__(self, settings: PredictorSettings) -> None:
        self.settings = settings
        self._started = False
        self._errors: deque[float] = deque(maxlen=settings.error_window)

    def observe(self, value: float) -> None:
        """Record the value of the interval that just ended."""
        if not math.isfinite(value):
            return
        value = max(0.0, float(value))
        if not self._started and value == 0.0:
            return
        if self._started:
            predicted = float(self.forecast(1)[0])
            if predicted > 0:
                self._errors.append(value / predicted - 1.0)
        self._started = True
        self._observe(value)

    def upper(self, steps: int, quantile: float) -> FloatArray:
        """The ``quantile`` of the forecast distribution of each of the next ``steps`` values (the
        point forecast for a quantile of 0.5 or below, and before any error has been seen)."""
        point = self.forecast(steps)
        if quantile <= 0.5 or not self._started:
            return point
        return np.maximum(self._upper(point, quantile), point)

    def _upper(self, point: FloatArray, quantile: float) -> FloatArray:
        """From the recent one-step errors, relative to the forecast, growing as ``sqrt(k)``."""
        if len(self._errors) < _MIN_ERRORS:
            return point
        one_step = max(0.0, float(np.quantile(np.asarray(self._errors), quantile)))
        horizon = np.sqrt(np.arange(1, len(point) + 1, dtype=np.float64))
        return point * (1.0 + one_step * horizon)

    def forecast(self, steps: int = 1) -> FloatArray:
        """The next ``steps`` values (``forecast(1)[0]`` is the next interval); 0 before any data."""
        if steps < 1:
            raise ValueError(f"steps={steps} must be at least 1")
        if not self._started:
            return np.zeros(steps)
        return np.maximum(np.asarray(self._forecast(steps), dtype=np.float64), 0.0)

    @abstractmethod
    def _observe(self, value: float) -> None: ...

    @abstractmethod
    def _forecast(self, steps: int) -> FloatArray: ...


class ConstantPredictor(Predictor):
    """The next value equals the last one (what a planner without a forecast does)."""

    def __init__(self, settings: PredictorSettings) -> None:
        super().__init__(settings)
        self._last = 0.0

    def _observe(self, value: float) -> None:
        self._last = value

    def _forecast(self, steps: int) -> FloatArray:
        return np.full(steps, self._last)


class MovingAveragePredictor(Predictor):
    """The mean of the last ``window`` values: smooth, but lags a trend by ``window/2`` intervals."""

    def __init__(self, settings: PredictorSettings) -> None:
        super().__init__(settings)
        self._values: deque[float] = deque(maxlen=settings.window)

    def _observe(self, value: float) -> None:
        self._values.append(value)

    def _forecast(self, steps: int) -> FloatArray:
        return np.full(steps, sum(self._values) / len(self._values))


class SeasonalPredictor(Predictor):
    """Seasonal naive with a level ratio, for daily cycles.

    The forecast for ``k`` steps ahead is the value one ``period`` before that interval, scaled
    by how the last ``level_window`` intervals compare with the same intervals a period earlier
    (clamped to [0.5, 2] so one odd interval cannot double the forecast). Until a whole period
    has been seen it forecasts the last value.
    """

    _RATIO_BOUNDS = (0.5, 2.0)

    def __init__(self, settings: PredictorSettings) -> None:
        super().__init__(settings)
        self._history: deque[float] = deque(maxlen=settings.period + settings.level_window)

    def _observe(self, value: float) -> None:
        self._history.append(value)

    def _forecast(self, steps: int) -> FloatArray:
        period, history = self.settings.period, list(self._history)
        n = len(history)
        if n < period:
            return np.full(steps, history[-1])
        window = min(self.settings.level_window, n - period)
        ratio = 1.0
        if window > 0:
            recent = sum(history[n - window :])
            before = sum(history[n - window - period : n - period])
            if before > 0:
                ratio = min(max(recent / before, self._RATIO_BOUNDS[0]), self._RATIO_BOUNDS[1])
        # Beyond one period ahead the cycle repeats its last season.
        base = [history[n - period + (k % period)] for k in range(steps)]
        return np.asarray(base, dtype=np.float64) * ratio


@dataclasses.dataclass(kw_only=True)
class StateSpaceFilter:
    """A time-invariant linear-Gaussian state-space model and its Kalman filter state.

    ``y[t] = design @ x[t] + obs_intercept + eps``, ``x[t+1] = transition @ x[t] + c[t] + eta``,
    with ``c[t] = state_intercept + t * intercept_step`` (affine, which covers ARIMA's constant
    and drift terms). ``state`` and ``cov`` are the prediction for the next observation.
    """

    transition: FloatArray
    design: FloatArray
    state_intercept: FloatArray
    intercept_step: FloatArray
    obs_intercept: float
    state_cov: FloatArray
    obs_cov: float
    state: FloatArray
    cov: FloatArray

    def update(self, value: float) -> None:
        """One Kalman step: condition on ``value``, then predict the next state."""
        z = self.design
        innovation = value - (float(z @ self.state) + self.obs_intercept)
        variance = float(z @ self.cov @ z) + self.obs_cov
        if variance > 0:
            gain = self.cov @ z / variance
            self.state = self.state + gain * innovation
            self.cov = self.cov - np.outer(gain, z @ self.cov)
        self.state_intercept = self.state_intercept + self.intercept_step
        self.state = self.transition @ self.state + self.state_intercept
        self.cov = self.transition @ self.cov @ self.transition.T + self.state_cov

    def variance(self, steps: int) -> FloatArray:
        """Variance of the forecast error of each of the next ``steps`` observations."""
        cov = self.cov
        out = np.empty(steps)
        for k in range(steps):
            out[k] = float(self.design @ cov @ self.design) + self.obs_cov
            cov = self.transition @ cov @ self.transition.T + self.state_cov
        return out

    def forecast(self, steps: int) -> FloatArray:
        state, intercept = self.state, self.state_intercept
        out = np.empty(steps)
        for k in range(steps):
            out[k] = float(self.design @ state) + self.obs_intercept
            intercept = intercept + self.intercept_step
            state = self.transition @ state + intercept
        return out


class KalmanPredictor(Predictor):
    """A local linear trend (level + slope) tracked by a Kalman filter.

    The noise variances are relative: scaled by the square of the first observation so that the
    filter behaves the same for 10 or 10,000 requests per interval.
    """

    def __init__(self, settings: PredictorSettings) -> None:
        super().__init__(settings)
        self._filter: StateSpaceFilter | None = None

    def _observe(self, value: float) -> None:
        if self._filter is None:
            scale = max(value, 1.0) ** 2
            s = self.settings
            self._filter = StateSpaceFilter(
                transition=np.array([[1.0, 1.0], [0.0, 1.0]]),
                design=np.array([1.0, 0.0]),
                state_intercept=np.zeros(2),
                intercept_step=np.zeros(2),
                obs_intercept=0.0,
                state_cov=np.diag([s.kalman_q_level, s.kalman_q_trend]) * scale,
                obs_cov=s.kalman_r * scale,
                # A vague prior on the level, a tight one on the slope: no trend until data show one.
                state=np.array([value, 0.0]),
                cov=np.diag([s.kalman_r, s.kalman_q_trend]) * scale,
            )
            return
        self._filter.update(value)

    def _forecast(self, steps: int) -> FloatArray:
        assert self._filter is not None
        return self._filter.forecast(steps)


def _matrix(ssm: Any, name: str, ndim: int) -> FloatArray:
    """A state-space matrix as a plain array (statsmodels keeps a trailing time axis of length 1)."""
    array = np.asarray(ssm[name], dtype=np.float64)
    if array.ndim == ndim + 1:
        if array.shape[-1] != 1:
            raise ValueError(f"ARIMA {name} varies over time (shape {array.shape})")
        array = array[..., 0]
    return array


class ArimaPredictor(Predictor):
    """ARIMA with the order chosen by pmdarima's ``auto_arima``, then updated step by step.

    * Fewer than ``arima_min_points`` observations: forecast the last value.
    * A constant window: forecast that constant (auto_arima cannot fit one).
    * A fit that degenerates to a white-noise order (p = q = 0) on the raw series is redone on
      ``log1p`` of the series; forecasts are then transformed back with ``expm1``.
    * A search that finds no structure on either (ARIMA(0, 0, 0): a constant mean) falls back to
      ARIMA(0, 1, 1) on ``log1p``, the local level (exponential smoothing): a stationary mean would
      forecast the window's mean, frozen until the next refit, whatever the load does meanwhile.
    * Every observation is one Kalman step over the fitted matrices; every ``arima_refit_every``
      observations the parameters are re-estimated on the last ``arima_fit_window`` points with
      the order kept (only the first fit searches orders, it is the slow part). Three one-step
      errors in a row beyond three of the model's standard deviations, the same way, are a break
      the fit never saw (a burst): the order is searched again at once.
    * Seasonality: once the history holds ``2 x period`` observations (two days), a daily profile
      (``_HARMONICS`` Fourier terms of the period, fitted by least squares on the log scale), and
      from two weeks a weekly one, is taken out before the ARIMA fit and put back in its forecasts.
    * The prediction interval is the model's forecast variance, calibrated: the quantile of the
      recent one-step errors in units of the model's own standard deviation replaces the normal
      quantile once ``_MIN_ERRORS`` have been seen (the fitted model's Gaussian interval
      under-covers a bursty load: 73 % for a 90 % bound on ServeGen).
    """

    def __init__(self, settings: PredictorSettings) -> None:
        super().__init__(settings)
        self._history: deque[float] = deque(maxlen=settings.arima_fit_window)
        self._long: deque[float] = deque(maxlen=_SEASON_HISTORY_WEEKS * _WEEK * settings.period)
        """What the seasonal profile is fitted on: up to ``_SEASON_HISTORY_WEEKS`` weeks."""
        self._season: _Season | None = None
        self._t = 0
        """Observations so far (the seasonal profile's clock)."""
        self._scores: deque[float] = deque(maxlen=settings.error_window)
        """Recent one-step errors in units of the model's forecast standard deviation."""
        self._filter: StateSpaceFilter | None = None
        self._log = False
        self._order: tuple[int, int, int] | None = None
        self._with_intercept = True
        self._since_fit = 0
        self._fitted_on = 0
        self._constant: float | None = None

    @property
    def order(self) -> tuple[int, int, int] | None:
        """The ARIMA order in use, ``None`` before the first fit or while the series is constant."""
        return self._order if self._filter is not None and self._constant is None else None

    @property
    def log_transformed(self) -> bool:
        """Whether the model was fitted on ``log1p`` of the series."""
        return self._log

    @property
    def seasonal(self) -> tuple[int, ...]:
        """The seasonal periods (in intervals) taken out of the series; empty while history is short."""
        return () if self._season is None else self._season.periods

    def _model_value(self, value: float, t: int) -> float:
        """``value`` observed at step ``t`` on the scale the ARIMA filter runs on."""
        y = math.log1p(value) if self._log else value
        return y - self._season.at(t) if self._season is not None else y

    def _observe(self, value: float) -> None:
        t = self._t
        self._t += 1
        self._history.append(value)
        self._long.append(value)
        self._since_fit += 1
        if len(self._history) < self.settings.arima_min_points:
            return
        window = np.asarray(self._history, dtype=np.float64)
        if np.ptp(window) == 0.0:
            self._constant, self._filter = value, None
            return
        # Refit after as many new points as the last fit saw (so early fits on few points are
        # soon redone on more), at most every arima_refit_every.
        due = self._since_fit >= min(self.settings.arima_refit_every, self._fitted_on)
        if self._filter is None or due:
            self._fit(window)
            return
        y = self._model_value(value, t)
        sd = math.sqrt(max(float(self._filter.variance(1)[0]), 0.0))
        if sd > 0:
            self._scores.append((y - float(self._filter.forecast(1)[0])) / sd)
        if self._broken():
            # The load left the fitted model: search again on the window that holds the break.
            self._order = None
            self._fit(window)
            return
        self._filter.update(y)

    def _broken(self) -> bool:
        """The last ``_BREAK_RUN`` one-step errors all beyond ``_BREAK_SCORE`` of the model's own
        standard deviations, the same way: a level shift the fit never saw, not noise."""
        recent = list(itertools.islice(reversed(self._scores), _BREAK_RUN))
        return len(recent) == _BREAK_RUN and (
            all(z > _BREAK_SCORE for z in recent) or all(z < -_BREAK_SCORE for z in recent)
        )

    def _fit(self, window: FloatArray) -> None:
        import pmdarima  # noqa: PLC0415  (heavy: only paid by users of this predictor)

        self._since_fit, self._fitted_on = 0, len(window)
        self._constant = None
        self._season = _Season.fit(
            np.log1p(np.asarray(self._long, dtype=np.float64)), end=self._t, period=self.settings.period
        )
        if self._season is not None:
            # The search and the filter run on log1p with the profile taken out.
            self._log = True
            times = np.arange(self._t - len(window), self._t, dtype=np.float64)
            window = np.expm1(np.log1p(window) - self._season.at_many(times))
        # BLAS threads only contend over these tiny matrices: one thread is 10-20x faster on a
        # busy machine (statsmodels solves a Lyapunov equation per likelihood evaluation).
        with threadpool_limits(limits=1, user_api="blas"), warnings.catch_warnings():
            # statsmodels warns about convergence on short windows; the fit is still usable.
            warnings.simplefilter("ignore")
            if self._order is None or _white_noise(self._order):
                # Search orders until one with structure is found; keep it afterwards.
                model, self._log = self._search(pmdarima, window, log=self._season is not None)
                self._order, self._with_intercept = model.order, model.with_intercept
            else:
                series = np.log1p(window) if self._log else window
                model = pmdarima.ARIMA(
                    order=self._order, with_intercept=self._with_intercept, suppress_warnings=True
                ).fit(series)
        self._filter = _filter_from(model.arima_res_)

    @staticmethod
    def _search(pmdarima: Any, window: FloatArray, *, log: bool) -> tuple[Any, bool]:
        """An order for ``window``: on the raw series, then (no AR or MA term found, or ``log``)
        on ``log1p``; returns the model and whether it is on ``log1p``."""
        if not log:
            model = pmdarima.auto_arima(window, seasonal=False, suppress_warnings=True, error_action="ignore")
            if not _white_noise(model.order):
                return model, False
        logged = np.log1p(window)
        model = pmdarima.auto_arima(logged, seasonal=False, suppress_warnings=True, error_action="ignore")
        if model.order == (0, 0, 0):  # no structure: the local level, not a frozen mean
            model = pmdarima.ARIMA(order=(0, 1, 1), with_intercept=False, suppress_warnings=True).fit(logged)
        return model, True

    def _back(self, values: FloatArray) -> FloatArray:
        """Model-scale values of the next ``len(values)`` steps back on the series' scale."""
        if self._season is not None:
            values = values + self._season.at_many(
                np.arange(self._t, self._t + len(values), dtype=np.float64)
            )
        return np.expm1(values) if self._log else values

    def _forecast(self, steps: int) -> FloatArray:
        if self._constant is not None:
            return np.full(steps, self._constant)
        if self._filter is None:
            return np.full(steps, self._history[-1])
        return self._back(self._filter.forecast(steps))

    def score(self, quantile: float) -> float:
        """The ``quantile`` of the forecast error in the model's standard deviations: the recent
        one-step errors' once ``_MIN_ERRORS`` are in, the normal distribution's before (what
        pmdarima's ``conf_int`` uses)."""
        if len(self._scores) < _MIN_ERRORS:
            return NormalDist().inv_cdf(quantile)
        return float(np.quantile(np.asarray(self._scores), quantile))

    def _upper(self, point: FloatArray, quantile: float) -> FloatArray:
        """The model's prediction interval, one-sided, at the calibrated score (:meth:`score`)."""
        if self._filter is None or self._constant is not None:
            return super()._upper(point, quantile)
        steps = len(point)
        spread = self.score(quantile) * np.sqrt(np.maximum(self._filter.variance(steps), 0.0))
        return self._back(self._filter.forecast(steps) + spread)


@dataclasses.dataclass(frozen=True)
class _Season:
    """A daily (and, with two weeks of history, weekly) profile of ``log1p`` of the series: a sum
    of Fourier terms of each period, fitted by least squares, zero-mean (the ARIMA keeps the level)."""

    periods: tuple[int, ...]
    coefficients: FloatArray

    @staticmethod
    def fit(logged: FloatArray, *, end: int, period: int) -> _Season | None:
        """The profile of ``logged`` (the last ``len(logged)`` observations, ending before step
        ``end``); ``None`` before two whole periods (one cannot tell a cycle from a trend)."""
        if period < 2 or len(logged) < 2 * period:
            return None
        periods = (period, _WEEK * period) if len(logged) >= 2 * _WEEK * period else (period,)
        times = np.arange(end - len(logged), end, dtype=np.float64)
        terms = _Season(periods, np.zeros(0))._terms(times)
        design = np.column_stack([np.ones(len(times)), terms])
        solution, *_ = np.linalg.lstsq(design, logged, rcond=None)
        return _Season(periods, np.asarray(solution[1:], dtype=np.float64))

    def _terms(self, times: FloatArray) -> FloatArray:
        columns = []
        for period in self.periods:
            for k in range(1, _HARMONICS + 1):
                angle = 2 * math.pi * k * times / period
                columns += [np.sin(angle), np.cos(angle)]
        return np.column_stack(columns)

    def at_many(self, times: FloatArray) -> FloatArray:
        return np.asarray(self._terms(np.asarray(times, dtype=np.float64)) @ self.coefficients)

    def at(self, t: int) -> float:
        return float(self.at_many(np.array([t], dtype=np.float64))[0])


def _white_noise(order: tuple[int, int, int]) -> bool:
    """An order with no AR or MA terms: the fit found no structure to forecast from."""
    return order[0] == 0 and order[2] == 0


def _filter_from(results: Any) -> StateSpaceFilter:
    """The filter state at the end of a statsmodels state-space fit, ready for the next observation."""
    ssm = results.model.ssm
    intercepts = np.asarray(ssm["state_intercept"], dtype=np.float64)
    if intercepts.ndim == 2 and intercepts.shape[1] > 1:
        # Trend terms make the intercept a (affine) function of time: continue it.
        last, step = intercepts[:, -1], intercepts[:, -1] - intercepts[:, -2]
    else:
        last, step = intercepts.reshape(-1), np.zeros(intercepts.size)
    selection = _matrix(ssm, "selection", 2)
    filtered = results.filter_results
    return StateSpaceFilter(
        transition=_matrix(ssm, "transition", 2),
        design=_matrix(ssm, "design", 2)[0],
        state_intercept=last,
        intercept_step=step,
        obs_intercept=float(_matrix(ssm, "obs_intercept", 1)[0]),
        state_cov=selection @ _matrix(ssm, "state_cov", 2) @ selection.T,
        obs_cov=float(_matrix(ssm, "obs_cov", 2)[0, 0]),
        state=np.array(filtered.predicted_state[:, -1], dtype=np.float64),
        cov=np.array(filtered.predicted_state_cov[:, :, -1], dtype=np.float64),
    )


#: Predictors by the name users pass (``--predictor``, ``PlannerConfig.predictor``).
PREDICTORS: dict[str, Callable[[PredictorSettings], Predictor]] = {
    "constant": ConstantPredictor,
    "moving_average": MovingAveragePredictor,
    "arima": ArimaPredictor,
    "kalman": KalmanPredictor,
    "seasonal": SeasonalPredictor,
}


def make_predictor(name: str, settings: PredictorSettings | None = None) -> Predictor:
    """A new predictor by registry name; ``ValueError`` listing the known names otherwise."""
    try:
        factory = PREDICTORS[name]
    except KeyError:
        raise ValueError(f"unknown predictor {name!r}; known: {', '.join(sorted(PREDICTORS))}") from None
    return factory(settings or PredictorSettings())
