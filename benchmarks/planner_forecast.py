"""Forecasts of every load predictor on 14 days of real arrival rates: error at the lead time, and
whether each predictor's own ``upper(h, quantile)`` bound covers what it claims.

Load: ServeGen's ``language/m-large`` aggregate arrival rate in 600-s windows (14 days, Alibaba
Bailian; collection gaps filled by linear interpolation, as ``planner_servegen.py`` does). Every
predictor is fed the windows one by one with the planner's settings for 600-s intervals (a daily
season of 144 windows); from the second day on, each window is scored against the forecasts made
``h`` windows before it:

* error: mean absolute percentage error of the point forecast, ``mean(|forecast - actual| / actual)``;
* coverage: share of windows at or below the ``--quantile`` bound made for them.

Run: ``.venv/bin/python benchmarks/planner_forecast.py`` (``--days 3`` for the last three days only,
with the days before as history that is not scored).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from copse.planner.config import PlannerConfig
from copse.planner.predictors import PREDICTORS, make_predictor
from planner_servegen import INTERVAL_S, servegen

DAY = round(86_400 / INTERVAL_S)


def score(
    name: str, series: np.ndarray, *, horizons: list[int], quantile: float, scored_from: int
) -> dict[int, tuple[float, float]]:
    """Per horizon: (mean absolute percentage error, coverage of the quantile bound)."""
    predictor = make_predictor(name, PlannerConfig().settings_for(INTERVAL_S))
    longest = max(horizons)
    made: list[tuple[np.ndarray, np.ndarray]] = []
    for value in series:
        predictor.observe(float(value))
        made.append((predictor.forecast(longest), predictor.upper(longest, quantile)))
    out = {}
    for h in horizons:
        # the forecast for window t made h windows before: after observing window t - h
        t = np.arange(max(scored_from, h), len(series))
        point = np.array([made[i - h][0][h - 1] for i in t])
        upper = np.array([made[i - h][1][h - 1] for i in t])
        actual = series[t]
        out[h] = (
            float(np.mean(np.abs(point - actual) / actual)),
            float(np.mean(actual <= upper)),
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--predictors", nargs="+", default=sorted(PREDICTORS))
    parser.add_argument("--horizons", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--quantile", type=float, default=0.9)
    parser.add_argument(
        "--days", type=float, default=None, help="Score only the last days (default: all but the first)."
    )
    args = parser.parse_args()
    series = np.array([obs.num_requests for obs in servegen("m-large", peak=100.0)])
    scored_from = DAY if args.days is None else len(series) - round(args.days * DAY)
    span = (len(series) - scored_from) / DAY
    print(f"ServeGen m-large, {len(series)} windows of {INTERVAL_S:g} s; scored: the last {span:.1f} days")
    print(f"each cell: mean absolute error / share of windows at or below the p{args.quantile * 100:g} bound")
    header = "| predictor | " + " | ".join(f"h = {h} ({h * INTERVAL_S / 60:g} min)" for h in args.horizons)
    print(header + " | seconds |")
    print("|---" * (len(args.horizons) + 2) + "|")
    for name in args.predictors:
        started = time.perf_counter()
        result = score(name, series, horizons=args.horizons, quantile=args.quantile, scored_from=scored_from)
        cells = " | ".join(f"{err * 100:.1f} % / {cov * 100:.1f} %" for err, cov in result.values())
        print(f"| {name} | {cells} | {time.perf_counter() - started:.0f} |", flush=True)


if __name__ == "__main__":
    main()
