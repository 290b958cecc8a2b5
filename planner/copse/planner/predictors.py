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
    * Every observation is one Kalman step over the fitted matrices; every ``arima_refit_every``
      observations the parameters are re-estimated on the last ``arima_fit_window`` points with
      the order kept (only the first fit searches orders, it is the slow part).
    """

    def __init__(self, settings: PredictorSettings) -> None:
        super().__init__(settings)
        self._history: deque[float] = deque(maxlen=settings.arima_fit_window)
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

    def _observe(self, value: float) -> None:
        self._history.append(value)
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
        self._filter.update(math.log1p(value) if self._log else value)

    def _fit(self, window: FloatArray) -> None:
        import pmdarima  # noqa: PLC0415  (heavy: only paid by users of this predictor)

        self._since_fit, self._fitted_on = 0, len(window)
        self._constant = None
        # BLAS threads only contend over these tiny matrices: one thread is 10-20x faster on a
        # busy machine (statsmodels solves a Lyapunov equation per likelihood evaluation).
        with threadpool_limits(limits=1, user_api="blas"), warnings.catch_warnings():
            # statsmodels warns about convergence on short windows; the fit is still usable.
            warnings.simplefilter("ignore")
            if self._order is None or _white_noise(self._order):
                # Search orders until one with structure is found; keep it afterwards.
                model, self._log = self._search(pmdarima, window)
                self._order, self._with_intercept = model.order, model.with_intercept
            else:
                series = np.log1p(window) if self._log else window
                model = pmdarima.ARIMA(
                    order=self._order, with_intercept=self._with_intercept, suppress_warnings=True
                ).fit(series)
        self._filter = _filter_from(model.arima_res_)

    @staticmethod
    def _search(pmdarima: Any, window: FloatArray) -> tuple[Any, bool]:
        model = pmdarima.auto_arima(window, seasonal=False, suppress_warnings=True, error_action="ignore")
        if _white_noise(model.order):
            return (
                pmdarima.auto_arima(
                    np.log1p(window), seasonal=False, suppress_warnings=True, error_action="ignore"
                ),
                True,
            )
        return model, False

    def _forecast(self, steps: int) -> FloatArray:
        if self._constant is not None:
            return np.full(steps, self._constant)
        if self._filter is None:
            return np.full(steps, self._history[-1])
        values = self._filter.forecast(steps)
        return np.expm1(values) if self._log else values

    def _upper(self, point: FloatArray, quantile: float) -> FloatArray:
        """The fitted model's prediction interval (pmdarima's ``conf_int``), one-sided."""
        if self._filter is None or self._constant is not None:
            return super()._upper(point, quantile)
        steps = len(point)
        spread = NormalDist().inv_cdf(quantile) * np.sqrt(np.maximum(self._filter.variance(steps), 0.0))
        values = self._filter.forecast(steps) + spread
        return np.expm1(values) if self._log else values


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
