"""Forecasting the load of the coming intervals: the request count by a predictor, the requests'
shapes by their recent mean."""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from copse.planner.observations import UNCACHED_QUANTILES, Observation
from copse.planner.predictors import PredictorSettings, make_predictor

#: The requests' shapes read from each interval with requests (the optional ones when given).
SHAPES: tuple[str, ...] = (
    "isl",
    "osl",
    "isl_p90",
    "osl_p10",
    *UNCACHED_QUANTILES,
    "kv_hit_rate",
    "onboard_ms",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadForecast:
    """Predicted load of one future interval."""

    num_requests: float
    """Requests arriving in the interval."""
    duration_s: float
    """Interval length, seconds."""
    isl: float
    """Mean input length, tokens."""
    osl: float
    """Mean output length, tokens."""
    isl_p90: float | None
    """90th percentile input length, tokens, when the source gives it."""
    kv_hit_rate: float
    """Expected prefix-cache hit rate (0 when unknown)."""
    onboard_ms: float = 0.0
    """Expected onboarding time of a request's cached blocks kept below the GPU, ms (0 when unknown)."""
    osl_p10: float | None = None
    """10th percentile output length, tokens, when the source gives it."""
    uncached_quantiles: tuple[float, ...] | None = None
    """A prompt's uncached tokens at the levels of
    :data:`~copse.planner.observations.UNCACHED_QUANTILES` (non-decreasing), when the source gives
    them all."""

    @property
    def rate(self) -> float:
        return self.num_requests / self.duration_s


class LoadForecaster:
    """Forecasts the request count with one predictor, and the requests' shapes (lengths, their
    quantiles, hit rate, onboarding) as their mean over the last ``shape_window`` intervals with
    requests, weighted by those requests.

    An interval's shapes are sample statistics of its few hundred requests, noise around a mix that
    moves slowly: on ServeGen m-large a minute's mean prompt moves by 10 % from one minute to the
    next. Sized on each minute's draw, the fleet would hold the largest draw of every scale-down
    delay. The count is the load itself, so it keeps the predictor the planner is configured with.
    Until the first ISL/OSL are seen, ``default_isl``/``default_osl`` stand in.
    """

    def __init__(
        self,
        predictor: str,
        *,
        settings: PredictorSettings | None = None,
        shape_window: int = 5,
        default_isl: float = 3000.0,
        default_osl: float = 150.0,
    ) -> None:
        if shape_window < 1:
            raise ValueError(f"shape_window={shape_window} must be at least 1")
        self._count = make_predictor(predictor, settings or PredictorSettings())
        self._shapes: collections.deque[tuple[float, dict[str, float]]] = collections.deque(
            maxlen=shape_window
        )
        self._defaults = {"isl": default_isl, "osl": default_osl}
        self.duration_s: float | None = None

    def observe(self, obs: Observation) -> None:
        self.duration_s = obs.duration_s
        self._count.observe(obs.num_requests)
        if obs.num_requests > 0:
            shapes = {name: getattr(obs, name) for name in SHAPES}
            self._shapes.append(
                (
                    obs.num_requests,
                    {name: float(v) for name, v in shapes.items() if v is not None and math.isfinite(v)},
                )
            )

    def _shape(self, name: str) -> float | None:
        """The request-weighted mean of ``name`` over the window; ``None`` if no interval in it gave one."""
        weight = total = 0.0
        for requests, shapes in self._shapes:
            if name in shapes:
                weight += requests
                total += requests * shapes[name]
        return total / weight if weight > 0 else None

    def forecast(self, steps: int, *, quantile: float | None = None) -> list[LoadForecast]:
        """The next ``steps`` intervals (``steps`` >= 1); requires at least one observation. With a
        ``quantile``, the request counts are that quantile of the predictor's forecast distribution
        at each horizon (the shapes are the same at every horizon)."""
        if self.duration_s is None:
            raise ValueError("no observation yet: nothing to forecast the interval length from")
        counts = self._count.forecast(steps) if quantile is None else self._count.upper(steps, quantile)
        at = {name: self._shape(name) for name in SHAPES}
        isl = at["isl"] if at["isl"] is not None else self._defaults["isl"]
        uncached = [at[name] for name in UNCACHED_QUANTILES]
        ordered = None
        if all(value is not None for value in uncached):
            # averaged one by one, the quantiles may cross: keep them ordered
            floored = np.maximum(np.asarray(uncached, dtype=float), 1.0)
            ordered = tuple(np.maximum.accumulate(floored).tolist())
        osl = at["osl"] if at["osl"] is not None else self._defaults["osl"]
        shaped = LoadForecast(
            num_requests=0.0,
            duration_s=self.duration_s,
            isl=max(isl, 1.0),
            osl=max(osl, 1.0),
            isl_p90=None if at["isl_p90"] is None else max(at["isl_p90"], isl),
            osl_p10=None if at["osl_p10"] is None else min(max(at["osl_p10"], 1.0), osl),
            uncached_quantiles=ordered,
            kv_hit_rate=min(max(at["kv_hit_rate"] or 0.0, 0.0), 1.0),
            onboard_ms=max(at["onboard_ms"] or 0.0, 0.0),
        )
        return [dataclasses.replace(shaped, num_requests=float(count)) for count in counts]
