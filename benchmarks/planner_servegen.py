"""SLA planner on 14 days of real arrival rates: SLO attainment and GPU-hours per predictor,
against the static deployment sized for the peak, plus the dry-run wall time with ARIMA.

Load: ServeGen's per-model aggregate arrival rate in 600-s windows (``servegen_language_*``,
14 days, Alibaba Bailian), scaled so that the busiest window is ``--peak`` req/s. Windows below
1 % of the mean are collection gaps (see the traces README) and are filled by linear
interpolation. ServeGen gives no request lengths; every interval gets the Azure 2023
conversation trace's mean and p90 input length and mean output length.

Engines: the mocked engine's perf model (``copse planner profile --engine mock``), one GPU per
replica, disaggregated prefill/decode, targets TTFT p99 500 ms and ITL p99 50 ms, 120 s start-up.

Run: ``.venv/bin/python benchmarks/planner_servegen.py`` (add ``--models m-large`` for one model).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import inputs
from copse.api import Role
from copse.planner.capacity import capacity_for
from copse.planner.config import PlannerConfig
from copse.planner.core import Planner
from copse.planner.dryrun import DryRunResult, dry_run
from copse.planner.observations import Observation
from copse.planner.policy import DISAGGREGATED, Limits
from copse.planner.predictors import PREDICTORS
from copse.planner.recording import write_metrics_jsonl
from copse.workers.perf import PolynomialPerfModel, save_profile

REPO = Path(__file__).resolve().parents[1]
INTERVAL_S = 600.0
TTFT_MS, ITL_MS = 500.0, 50.0


def request_shape() -> tuple[float, float, float]:
    """(mean ISL, p90 ISL, mean OSL) of the Azure 2023 conversation trace."""
    with gzip.open(inputs.require(inputs.AZURE_CONVERSATION), "rt") as handle:
        rows = list(csv.DictReader(handle))
    isl = np.array([float(row["ContextTokens"]) for row in rows])
    osl = np.array([float(row["GeneratedTokens"]) for row in rows])
    return float(isl.mean()), float(np.percentile(isl, 90)), float(osl.mean())


def servegen(model: str, *, peak: float) -> list[Observation]:
    """The model's 14-day rate curve as observations, gaps filled, scaled to ``peak`` req/s."""
    name = f"servegen_language_{model}_aggregate_rate.csv"
    shipped = inputs.SHIPPED / name  # m-large ships; the others are derived by ../shared/traces/stats.py
    with inputs.require(shipped if shipped.is_file() else inputs.WHOLE / name).open() as handle:
        rows = list(csv.DictReader(handle))
    starts = np.array([float(row["window_start_s"]) for row in rows])
    rates = np.array([float(row["total_rate_req_per_s"]) for row in rows])
    gaps = rates < 0.01 * rates.mean()
    rates[gaps] = np.interp(starts[gaps], starts[~gaps], rates[~gaps])
    rates *= peak / rates.max()
    isl, isl_p90, osl = request_shape()
    return [
        Observation(
            timestamp=float(start),
            duration_s=INTERVAL_S,
            num_requests=float(rate) * INTERVAL_S,
            isl=isl,
            osl=osl,
            isl_p90=isl_p90,
        )
        for start, rate in zip(starts, rates, strict=True)
    ]


def limits() -> Limits:
    return Limits(
        roles=DISAGGREGATED,
        gpus_per_replica=dict.fromkeys(DISAGGREGATED, 1),
        ttft_ms=TTFT_MS,
        itl_ms=ITL_MS,
        min_replicas=1,
        max_replicas=128,
        scale_down_delay_s=300.0,
    )


def replay(
    observations: list[Observation], predictor: str, *, forecast_quantile: float
) -> tuple[DryRunResult, float]:
    config = PlannerConfig(predictor=predictor, forecast_quantile=forecast_quantile)
    bounds = limits()
    capacity = capacity_for(PolynomialPerfModel(), config=config, limits=bounds)
    planner = Planner(config=config, limits=bounds, capacity=capacity, interval_s=INTERVAL_S)
    started = time.perf_counter()
    result = dry_run(observations, planner=planner, startup_delay_s=planner.startup_delay_s)
    return result, time.perf_counter() - started


def forecast_error(result: DryRunResult) -> float:
    """Mean absolute percentage error of the one-step request forecasts (after the first day)."""
    rows = result.intervals[144:]
    return statistics.fmean(abs(row.predicted_num_requests / row.num_requests - 1) for row in rows)


def cli_wall_time(observations: list[Observation]) -> float:
    """Wall time of ``copse planner dry-run --predictor arima -o json`` on the same 14 days."""
    with tempfile.TemporaryDirectory() as scratch:
        metrics, profile = Path(scratch) / "metrics.jsonl", Path(scratch) / "mock.npz"
        with metrics.open("w") as handle:
            write_metrics_jsonl(observations, handle)
        save_profile(PolynomialPerfModel(), profile)
        command = [
            sys.executable, "-m", "copse.cli", "planner", "dry-run", "--metrics", str(metrics),
            "--perf-profile", str(profile), "--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS),
            "--max-replicas", "128", "--predictor", "arima", "-o", "json",
        ]  # fmt: skip
        started = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["m-large", "m-mid", "m-small"])
    parser.add_argument("--peak", type=float, default=100.0, help="Busiest window after scaling, req/s.")
    parser.add_argument(
        "--forecast-quantile",
        type=float,
        default=PlannerConfig().forecast_quantile,
        help="Quantile of recent forecast errors the planner sizes for.",
    )
    args = parser.parse_args()
    isl, isl_p90, osl = request_shape()
    print(
        f"14 days x 600-s intervals, peak scaled to {args.peak:g} req/s; "
        f"ISL mean {isl:.0f} (p90 {isl_p90:.0f}), OSL mean {osl:.0f}; "
        f"targets TTFT p99 {TTFT_MS:g} ms, ITL p99 {ITL_MS:g} ms; 1-GPU mocked engines; "
        f"sizing for the p{args.forecast_quantile * 100:g} of recent forecast errors\n"
    )
    for model in args.models:
        observations = servegen(model, peak=args.peak)
        header = (
            f"{'predictor':<15} {'SLO attained':>12} {'GPU-hours':>10} {'vs static':>9} "
            f"{'events':>6} {'MAPE':>6} {'wall s':>7}"
        )
        print(f"servegen language/{model} ({len(observations)} intervals)")
        print(header)
        static_line = ""
        for predictor in sorted(PREDICTORS):
            result, seconds = replay(observations, predictor, forecast_quantile=args.forecast_quantile)
            summary = result.summary
            if not static_line:
                replicas = "+".join(
                    str(summary.static_peak_replicas[role]) for role in (Role.PREFILL, Role.DECODE)
                )
                static_line = (
                    f"{'static peak':<15} {summary.static_slo_attainment:>12.2%} "
                    f"{summary.static_peak_gpu_hours:>10,.0f} {1.0:>9.2f} {0:>6} {'':>6} {'':>7}"
                    f"  ({replicas} replicas)"
                )
            print(
                f"{predictor:<15} {summary.slo_attainment:>12.2%} {summary.gpu_hours:>10,.0f} "
                f"{summary.gpu_hours / summary.static_peak_gpu_hours:>9.2f} {summary.scaling_events:>6} "
                f"{forecast_error(result):>6.1%} {seconds:>7.1f}"
            )
        print(static_line)
        print()
    print(
        f"CLI dry-run wall time, 14 days of 10-min intervals, ARIMA (m-large): "
        f"{cli_wall_time(servegen('m-large', peak=args.peak)):.1f} s (target < 60 s)"
    )


if __name__ == "__main__":
    main()
