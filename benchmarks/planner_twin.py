"""The SLA planner in closed loop with a simulated fleet (``copse bench planner``'s twin): per-request
SLO attainment and GPU-hours of every predictor, against the best static deployment found by
search in the same simulator, and how both move with the replicas' start-up delay.

Load: four hours of ServeGen's ``language/m-large`` aggregate arrival rate (600-s windows
1392-1415 of the 14 days, the window holding the curve's sharpest burst, 156 -> 504 req/s),
scaled so the busiest window is ``--peak`` req/s; arrivals drawn from a Poisson process at that
rate (``copse.sim.load``); every arrival gets the next request of the Mooncake conversation trace
with a prompt of at most 32k tokens (prompts beyond would go to a long-context pool: 6.9 % of the
trace), in trace order, so conversations keep their shared prefixes. Engines: mocked, polynomial
perf model, 1 GPU each, block size 512, 5 % step noise; router ``kv`` with its measured profile and
50 ms KV event lag. Targets: TTFT 2,000 ms and ITL 50 ms for 99 % of requests. The first hour is
warm-up (the planner learns the load; nothing counts); results cover the three hours after it.

The best static deployment: the fewest fixed replicas whose per-request attainment (or, with
``--goal-on intervals``, per-interval attainment: the share of intervals whose p99s meet the
targets, what the planner sizes for) reaches ``--goal`` (0.99: the targets are p99s), found by
bisection over sizes (attainment grows with the size), every size simulated on the same arrivals.

Usage: ``.venv/bin/python benchmarks/planner_twin.py [--delays 0,60,120,300] [--predictors ...]
[--static-range LOW,HIGH] [--jobs 2] [--json FILE] [--write-recording FILE]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

import inputs
from copse.api import Role
from copse.planner.config import PlannerConfig
from copse.planner.observations import Observation
from copse.planner.policy import AGGREGATED, Limits
from copse.planner.predictors import PREDICTORS
from copse.planner.recording import write_metrics_jsonl
from copse.sim.load import synthesize
from copse.sim.replay import ReplaySettings
from copse.sim.trace import TraceRequest, load_trace
from copse.sim.twin import TwinReport, TwinSettings, run_twin

RATES = inputs.M_LARGE_RATES
SHAPES = inputs.CONVERSATION
WINDOWS = (1392, 1416)
MAX_ISL = 32768
TTFT_MS, ITL_MS = 2000.0, 50.0
WARMUP_S = 3600.0
LIMITS = Limits(
    roles=AGGREGATED, gpus_per_replica={Role.WORKER: 1}, ttft_ms=TTFT_MS, itl_ms=ITL_MS, max_replicas=32
)


def recording(shapes: list[TraceRequest]) -> list[Observation]:
    """The ServeGen windows as recorded, with the shape trace's lengths."""
    with RATES.open() as handle:
        rows = list(csv.DictReader(handle))[WINDOWS[0] : WINDOWS[1]]
    isl = np.array([r.input_length for r in shapes if r.input_length <= MAX_ISL], dtype=float)
    osl = np.array([r.output_length for r in shapes if r.input_length <= MAX_ISL], dtype=float)
    return [
        Observation(
            timestamp=float(row["window_start_s"]),
            duration_s=600.0,
            num_requests=float(row["total_rate_req_per_s"]) * 600.0,
            isl=float(isl.mean()),
            osl=float(osl.mean()),
            isl_p90=float(np.percentile(isl, 90)),
        )
        for row in rows
    ]


@dataclasses.dataclass(frozen=True)
class Job:
    """One simulation: a predictor at a start-up delay, or a static size."""

    predictor: str | None
    delay_s: float = 0.0
    static: int | None = None
    correction: bool = True

    @property
    def name(self) -> str:
        if self.static is not None:
            return f"static {self.static}"
        suffix = "" if self.correction else ", no correction"
        return f"{self.predictor}, delay {self.delay_s:g} s{suffix}"


_LOAD: dict[str, object] = {}
"""The load of this process's simulations (set once per worker process)."""


def _init(trace: list[TraceRequest], end_s: float) -> None:
    _LOAD.update(trace=trace, end_s=end_s)


def simulate(job: Job) -> TwinReport:
    planner = (
        None
        if job.static is not None
        else PlannerConfig(
            predictor=job.predictor or "arima", startup_delay_s=job.delay_s, correction=job.correction
        )
    )
    settings = TwinSettings(
        fleet=ReplaySettings(workers=job.static or 1),
        limits=LIMITS,
        planner=planner,
        interval_s=60.0,
        warmup_s=WARMUP_S,
    )
    trace, end_s = _LOAD["trace"], _LOAD["end_s"]
    assert isinstance(trace, list)
    assert isinstance(end_s, float)
    return run_twin(trace, settings, end_s=end_s)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peak", type=float, default=18.0, help="Busiest window after scaling, req/s.")
    parser.add_argument("--delays", default="0,60,120,300", help="Start-up delays to sweep, s.")
    parser.add_argument("--predictors", default=",".join(sorted(PREDICTORS)))
    parser.add_argument("--default-delay", type=float, default=120.0, help="Delay of the predictor table.")
    parser.add_argument(
        "--goal", type=float, default=0.99, help="Attainment the static fleet needs (see --goal-on)."
    )
    parser.add_argument(
        "--goal-on",
        choices=("requests", "intervals"),
        default="requests",
        help="What --goal counts: requests within the targets, or intervals whose p99s are.",
    )
    parser.add_argument(
        "--no-correction",
        default="",
        metavar="PREDICTORS",
        help="Also run these predictors (comma-separated) without correction factors, at --default-delay.",
    )
    parser.add_argument(
        "--static-range",
        default=None,
        help="LOW,HIGH: start the static search from this bracket (LOW replicas known to miss the "
        "goal, HIGH to reach it, e.g. from an earlier run); both ends are simulated and checked.",
    )
    parser.add_argument("--jobs", type=int, default=1, help="Simulations in parallel (processes).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--write-recording", type=Path, default=None, help="Write the unscaled load here.")
    args = parser.parse_args()
    shapes = load_trace(inputs.require(SHAPES))
    observations = recording(shapes)
    if args.write_recording is not None:
        with args.write_recording.open("w") as handle:
            write_metrics_jsonl(observations, handle)
    scale = args.peak / max(obs.rate for obs in observations)
    trace = synthesize(observations, shapes, seed=args.seed, scale=scale, max_input_length=MAX_ISL)
    end_s = observations[-1].end - observations[0].timestamp
    delays = [float(d) for d in args.delays.split(",")]
    predictors = [p for p in args.predictors.split(",") if p]
    print(
        f"{len(trace):,} requests over {end_s / 3600:g} h (first {WARMUP_S / 3600:g} h warm-up), "
        f"ServeGen m-large windows {WINDOWS[0]}-{WINDOWS[1] - 1} scaled to a {args.peak:g} req/s peak; "
        f"targets TTFT {TTFT_MS:g} ms, ITL {ITL_MS:g} ms; static goal {args.goal:.0%} of {args.goal_on}",
        flush=True,
    )
    jobs = [Job(predictor=p, delay_s=d) for d in delays for p in predictors]
    uncorrected = [p for p in args.no_correction.split(",") if p]
    jobs += [Job(predictor=p, delay_s=args.default_delay, correction=False) for p in uncorrected]
    results: dict[Job, TwinReport] = {}

    def reaches(report: TwinReport) -> bool:
        attained: float = report.slo_attainment if args.goal_on == "requests" else report.interval_attainment
        return attained >= float(args.goal)

    started = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(
        args.jobs, initializer=_init, initargs=(trace, end_s)
    ) as pool:

        def run(batch: list[Job]) -> None:
            for job, report in zip(batch, pool.map(simulate, batch), strict=True):
                results[job] = report
                print(
                    f"  {job.name}: {report.slo_attainment:.2%} of requests, "
                    f"{report.interval_attainment:.2%} of intervals, "
                    f"{report.gpu_hours:.1f} GPU-hours ({time.perf_counter() - started:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )

        # Static sizes: the fewest replicas reaching the goal; ``low`` fails (0 replicas do), ``high``
        # passes (checked below when never simulated). Bisection, or trisection with two processes.
        low, high = 0, LIMITS.max_replicas
        if args.static_range is not None:
            low, high = (int(n) for n in args.static_range.split(","))
            if not 0 <= low < high <= LIMITS.max_replicas:
                raise SystemExit(
                    f"--static-range {args.static_range}: need 0 <= LOW < HIGH <= {LIMITS.max_replicas}"
                )
        statics: dict[int, TwinReport] = {}
        if low > 0:
            run([Job(predictor=None, static=n) for n in (low, high)])
            for n in (low, high):
                statics[n] = results[Job(predictor=None, static=n)]
            if reaches(statics[low]):
                raise SystemExit(f"--static-range: {low} replicas already reach {args.goal:.0%}; lower LOW")
        while high - low > 1:
            step = (high - low) // 3 if args.jobs > 1 and high - low > 2 else (high - low) // 2
            probes = sorted({low + step, high - step} if args.jobs > 1 and high - low > 2 else {low + step})
            run([Job(predictor=None, static=n) for n in probes])
            for n in probes:
                statics[n] = results[Job(predictor=None, static=n)]
                if reaches(statics[n]):
                    high = min(high, n)
                else:
                    low = max(low, n)
        if high not in statics:
            run([Job(predictor=None, static=high)])
            statics[high] = results[Job(predictor=None, static=high)]
        run(jobs)
    best = high
    base = statics[best]
    print("\nStatic deployments (bisection):")
    print(
        f"{'replicas':>8} {'requests ok':>11} {'intervals ok':>12} {'GPU-hours':>9} "
        f"{'TTFT p99':>9} {'ITL p99':>8}"
    )
    for n, report in sorted(statics.items()):
        mark = "  <- best static" if n == best and reaches(report) else ""
        print(
            f"{n:>8} {report.slo_attainment:>11.2%} {report.interval_attainment:>12.2%} "
            f"{report.gpu_hours:>9.1f} {report.ttft_ms.p99:>9,.0f} {report.itl_ms.p99:>8.1f}{mark}"
        )
    if not reaches(base):
        raise SystemExit(f"no static size up to {best} reaches {args.goal:.0%} of {args.goal_on}")

    def row(job: Job, report: TwinReport) -> str:
        return (
            f"{job.name:<34} {report.slo_attainment:>11.2%} {report.interval_attainment:>12.2%} "
            f"{report.gpu_hours:>9.1f} {report.gpu_hours / base.gpu_hours:>9.2f} "
            f"{report.mean_replicas:>6.2f} {report.peak_replicas:>5} {report.scaling_events:>6} "
            f"{report.ttft_ms.p99:>9,.0f} {report.itl_ms.p99:>8.1f}"
        )

    header = (
        f"{'run':<34} {'requests ok':>11} {'intervals ok':>12} {'GPU-hours':>9} {'vs static':>9} {'mean':>6} "
        f"{'peak':>5} {'events':>6} {'TTFT p99':>9} {'ITL p99':>8}"
    )
    for delay in delays:
        print(
            f"\nPlanner, start-up delay {delay:g} s "
            f"(best static: {best} replicas, {base.gpu_hours:.1f} GPU-hours):"
        )
        print(header)
        for job, report in results.items():
            if job.static is None and job.delay_s == delay and job.correction:
                print(row(job, report))
    if uncorrected:
        print(f"\nPlanner without correction factors, start-up delay {args.default_delay:g} s:")
        print(header)
        for job, report in results.items():
            if not job.correction:
                print(row(job, report))
    print("\nStart-up delay sweep, per-request SLO attainment / GPU-hours vs best static:")
    print(f"{'predictor':<16}" + "".join(f"{f'{d:g} s':>18}" for d in delays))
    for predictor in predictors:
        cells = []
        for delay in delays:
            report = results[Job(predictor=predictor, delay_s=delay)]
            cells.append(f"{report.slo_attainment:>9.2%} / {report.gpu_hours / base.gpu_hours:.2f}")
        print(f"{predictor:<16}" + "".join(f"{cell:>18}" for cell in cells))
    print(f"\n{len(results)} simulations in {time.perf_counter() - started:.0f} s wall")
    if args.json is not None:
        document = {
            "static": {str(n): r.as_json() for n, r in statics.items()},
            "best_static": best,
            "planner": [
                {
                    "predictor": job.predictor,
                    "delay_s": job.delay_s,
                    "correction": job.correction,
                    **r.as_json(),
                }
                for job, r in results.items()
                if job.static is None
            ],
        }
        args.json.write_text(json.dumps(document))


if __name__ == "__main__":
    main()
