"""The SLA planner in closed loop against the static frontier (``copse bench planner``'s twin): every
predictor, load, start-up delay and seed asked for, each planner run placed among the static fleet
sizes simulated on the same arrivals.

Per (load, seed) the arrivals are drawn once; every planner run (predictor x start-up delay) and
every static size needed to bracket them (:func:`copse.sim.frontier.run_frontier`: from a size
below both the goal and the lowest planner attainment to one reaching both the goal and the highest)
run on them, ``--jobs`` processes at a time. Loads: ``copse.sim.load.LOADS`` (ServeGen rates with
Mooncake or Azure shapes, read from ../shared/traces). Engines: mocked, polynomial perf model,
1 GPU each, 5 % step noise; router ``kv`` with its measured profile and 50 ms KV event lag.
Targets TTFT 2,000 ms, ITL 50 ms (mean gap per request).

Reported per planner run: per-request attainment, GPU-hours, the ratio at equal attainment (its
GPU-hours over the static GPU-hours interpolated at its attainment), the ratio against the
fewest static replicas reaching the goal, the static attainment at its cost, mean and peak
replicas, scaling events per hour, flaps (up-down-up within the scale-down delay) and scale-ups by
trigger ("ups f/q/b": set by the forecast, by the fast loop's backlog signal, by its SLO burn).

Usage: ``.venv/bin/python benchmarks/planner_twin.py --loads burst-4h --predictors constant,arima
--delays 120,420,944 --seeds 0,1,2 [--hours H] [--disaggregated] [--jobs 2] [--json FILE]``; on a
load too long to walk the frontier (servegen-3d), ``--statics 9,10,11 --jobs 4`` runs the planners and
those static sizes all at once (``--disaggregated --statics 3+1,4+1,3+2,4+2``: prefill+decode splits,
the frontier the efficient ones).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import inputs
from copse.api import Role
from copse.planner.config import PlannerConfig
from copse.planner.policy import AGGREGATED, DISAGGREGATED, Limits
from copse.planner.predictors import PREDICTORS
from copse.sim.frontier import Frontier, TwinPool, run_frontier, static_point
from copse.sim.load import LOADS, build_load
from copse.sim.replay import ReplaySettings
from copse.sim.twin import TwinReport, TwinSettings

TTFT_MS, ITL_MS = 2000.0, 50.0


def limits(*, disaggregated: bool, max_replicas: int) -> Limits:
    roles = DISAGGREGATED if disaggregated else AGGREGATED
    return Limits(
        roles=roles,
        gpus_per_replica=dict.fromkeys(roles, 1),
        ttft_ms=TTFT_MS,
        itl_ms=ITL_MS,
        max_replicas=max_replicas,
    )


def static_fleets(text: str, *, disaggregated: bool) -> list[dict[Role, int]]:
    """The static fleets ``--statics`` names: sizes of an aggregated fleet, or prefill+decode splits;
    raises ``ValueError`` naming the item it cannot read."""
    fleets = []
    for item in text.split(","):
        counts = item.split("+")
        valid = all(c.strip().isdigit() and int(c) > 0 for c in counts)
        if len(counts) != (2 if disaggregated else 1) or not valid:
            shape = "prefill+decode replicas, e.g. 4+1" if disaggregated else "a number of replicas, e.g. 9"
            raise ValueError(f"{item!r} is not {shape}")
        roles = (Role.PREFILL, Role.DECODE) if disaggregated else (Role.WORKER,)
        fleets.append(dict(zip(roles, (int(c) for c in counts), strict=True)))
    return fleets


def row(name: str, report: TwinReport, frontier: dict[str, Any]) -> str:
    def number(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    return (
        f"{name:<28} {report.slo_attainment:>8.2%} {report.gpu_hours:>9.1f} "
        f"{number(frontier['ratio_at_equal_attainment'], '.2f'):>7} "
        f"{number(frontier['ratio_vs_first_meeting_goal'], '.2f'):>7} "
        f"{number(frontier['static_attainment_at_equal_cost'], '.2%'):>9} "
        f"{report.mean_replicas:>6.2f} {report.peak_replicas:>5} "
        f"{report.scaling_events / report.window_h:>6.1f} {report.flaps:>5} "
        f"{'/'.join(str(n) for n in report.scale_ups.values()):>10} {report.wall_s:>6.0f}"
    )


HEADER = (
    f"{'run':<28} {'req ok':>8} {'GPU-h':>9} {'=att':>7} {'vsgoal':>7} {'st@cost':>9} "
    f"{'mean':>6} {'peak':>5} {'ev/h':>6} {'flaps':>5} {'ups f/q/b':>10} {'wall s':>6}"
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--loads", default="burst-4h", help=f"Comma-separated: {', '.join(sorted(LOADS))}.")
    parser.add_argument("--predictors", default="constant", help=f"Known: {', '.join(sorted(PREDICTORS))}.")
    parser.add_argument("--delays", default="420", help="Start-up delays, s.")
    parser.add_argument(
        "--runs", default=None, help="PREDICTOR:DELAY,... instead of every predictor at every delay."
    )
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--hours", type=float, default=None, help="Only the first hours of each load.")
    parser.add_argument("--peak-rate", type=float, default=None, help="Replace the loads' peak req/s.")
    parser.add_argument("--disaggregated", action="store_true", help="Prefill and decode pools.")
    parser.add_argument("--max-replicas", type=int, default=32)
    parser.add_argument("--goal", type=float, default=0.99)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--statics",
        default=None,
        help="Static fleets run beside the planner runs, all at once, instead of walking from the "
        "planners' mean: for loads too long to walk (the planners' attainment must fall between them). "
        "Sizes (9,10,11), or with --disaggregated prefill+decode splits (4+1,3+2,4+2); the frontier is "
        "the efficient ones (each attaining more than every cheaper one).",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    given = None
    if args.statics is not None:
        try:
            given = static_fleets(args.statics, disaggregated=args.disaggregated)
        except ValueError as exc:
            parser.error(f"--statics: {exc}")
    bounds = limits(disaggregated=args.disaggregated, max_replicas=args.max_replicas)
    predictors = [p for p in args.predictors.split(",") if p]
    delays = [float(d) for d in args.delays.split(",")]
    document: list[dict[str, Any]] = []
    started = time.perf_counter()
    for load_name in args.loads.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            load = build_load(
                load_name, seed=seed, peak_rate=args.peak_rate, hours=args.hours, traces=inputs.WHOLE
            )
            print(
                f"\n== {load_name}, seed {seed}: {len(load.requests):,} requests "
                f"over {load.end_s / 3600:g} h "
                f"(first {load.warmup_s / 3600:g} h warm-up), {LOADS[load_name].description}",
                flush=True,
            )
            base = TwinSettings(
                fleet=ReplaySettings(workers=1, seed=seed),
                limits=bounds,
                planner=None,
                warmup_s=load.warmup_s,
            )
            runs = [(p, d) for d in delays for p in predictors]
            if args.runs is not None:
                runs = [(p, float(d)) for p, d in (item.split(":") for item in args.runs.split(","))]

            def progress(run: str, report: TwinReport) -> None:
                print(
                    f"  {run}: {report.slo_attainment:.2%}, {report.gpu_hours:.1f} GPU-h "
                    f"({time.perf_counter() - started:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )

            planned: list[dict[str, Any]] = [
                {"planner": PlannerConfig(predictor=p, startup_delay_s=d)} for p, d in runs
            ]
            fixed: list[dict[str, Any]] = [{"planner": None, "initial": fleet} for fleet in given or ()]
            with TwinPool(load.requests, base, end_s=load.end_s, jobs=args.jobs) as pool:
                done = pool.map(planned + fixed)
                planners = done[: len(planned)]
                for (p, d), report in zip(runs, planners, strict=True):
                    progress(f"{p}, {d:g} s", report)
                statics: dict[str, TwinReport] = {}
                if given is None:
                    frontier, walked = run_frontier(
                        pool, planners, goal=args.goal, on_static=lambda n, r: progress(f"static {n}", r)
                    )
                    statics = {str(n): report for n, report in walked.items()}
                else:
                    points = []
                    for fleet, report in zip(given, done[len(planned) :], strict=True):
                        name = "+".join(str(count) for count in fleet.values())
                        statics[name] = report
                        progress(f"static {name}", report)
                        points.append(static_point(sum(fleet.values()), pools=fleet, report=report))
                    frontier = Frontier.efficient(points, goal=args.goal)
            print(f"Static fleets (goal {args.goal:.0%} of requests):")
            for point in frontier.static:
                pools = ", ".join(f"{role} {count}" for role, count in point.pools.items())
                mark = "  <- first meeting the goal" if point is frontier.first_meeting_goal else ""
                print(f"  {pools:<22} {point.slo_attainment:>8.2%} {point.gpu_hours:>9.1f} GPU-h{mark}")
            print(HEADER)
            entries = []
            for (p, d), report in zip(runs, planners, strict=True):
                placed = frontier.as_json(attainment=report.slo_attainment, gpu_hours=report.gpu_hours)
                pools = ""
                if len(report.pools) > 1:
                    pools = (
                        " ("
                        + ", ".join(
                            f"{role.value} {pool.mean_replicas:.1f}" for role, pool in report.pools.items()
                        )
                        + ")"
                    )
                print(row(f"{p}, {d:g} s", report, placed) + pools)
                entries.append({"predictor": p, "startup_delay_s": d, **report.as_json(), "frontier": placed})
            document.append(
                {
                    "load": load_name,
                    "seed": seed,
                    "hours": args.hours,
                    "disaggregated": args.disaggregated,
                    "requests": len(load.requests),
                    "static": {name: r.as_json() for name, r in statics.items()},
                    "planner": entries,
                    "roles": [role.value for role in bounds.roles],
                }
            )
            if args.json is not None:  # after every (load, seed): a long matrix keeps what it measured
                args.json.write_text(json.dumps(document))
    print(f"\n{time.perf_counter() - started:.0f} s wall")


if __name__ == "__main__":
    main()
