"""Forecasting the load of the coming intervals: one predictor per series."""

from __future__ import annotations

import dataclasses

import numpy as np

from copse.planner.observations import UNCACHED_QUANTILES, Observation
from copse.planner.predictors import PredictorSettings, make_predictor

#: Series forecast from each observation; the optional ones only once the source has given them.
SERIES: tuple[str, ...] = (
    "num_requests",
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
    """Keeps one predictor (the same kind) per series and forecasts them together.

    ISL and OSL are undefined in an interval without requests; those intervals update only the
    request count. Until the first ISL/OSL are seen, ``default_isl``/``default_osl`` stand in.
    """

    def __init__(
        self,
        predictor: str,
        *,
        settings: PredictorSettings | None = None,
        default_isl: float = 3000.0,
        default_osl: float = 150.0,
    ) -> None:
        settings = settings or PredictorSettings()
        self.predictor = predictor
        self._predictors = {name: make_predictor(predictor, settings) for name in SERIES}
        self._seen: set[str] = set()
        self._defaults = {"isl": default_isl, "osl": default_osl}
        self.duration_s: float | None = None

    def observe(self, obs: Observation) -> None:
        self.duration_s = obs.duration_s
        self._update("num_requests", obs.num_requests)
        if obs.num_requests > 0:
            for name in SERIES[1:]:
                self._update(name, getattr(obs, name))

    def _update(self, name: str, value: float | None) -> None:
        if value is None:
            return
        self._seen.add(name)
        self._predictors[name].observe(value)

    def forecast(self, steps: int, *, quantile: float | None = None) -> list[LoadForecast]:
        """The next ``steps`` intervals (``steps`` >= 1); requires at least one observation. With a
        ``quantile``, the request counts are that quantile of the predictor's forecast distribution
        at each horizon (the request shapes stay point forecasts)."""
        if self.duration_s is None:
            raise ValueError("no observation yet: nothing to forecast the interval length from")
        values = {
            name: self._predictors[name].forecast(steps) if name in self._seen else None for name in SERIES
        }
        if quantile is not None and "num_requests" in self._seen:
            values["num_requests"] = self._predictors["num_requests"].upper(steps, quantile)
        out = []
        for k in range(steps):
            at = {name: None if series is None else float(series[k]) for name, series in values.items()}
            isl = at["isl"] if at["isl"] is not None else self._defaults["isl"]
            uncached = [at[name] for name in UNCACHED_QUANTILES]
            ordered = None
            if all(value is not None for value in uncached):
                # forecast one by one, the quantiles may cross: keep them ordered
                ordered = tuple(
                    np.maximum.accumulate(np.maximum(np.asarray(uncached, dtype=float), 1.0)).tolist()
                )
            osl = at["osl"] if at["osl"] is not None else self._defaults["osl"]
            out.append(
                LoadForecast(
                    num_requests=at["num_requests"] or 0.0,
                    duration_s=self.duration_s,
                    isl=max(isl, 1.0),
                    osl=max(osl, 1.0),
                    isl_p90=None if at["isl_p90"] is None else max(at["isl_p90"], isl),
                    osl_p10=None if at["osl_p10"] is None else min(max(at["osl_p10"], 1.0), osl),
                    uncached_quantiles=ordered,
                    kv_hit_rate=min(max(at["kv_hit_rate"] or 0.0, 0.0), 1.0),
                    onboard_ms=max(at["onboard_ms"] or 0.0, 0.0),
                )
            )
        return out
