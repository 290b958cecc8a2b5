"""The clairvoyant bound on a load (:mod:`copse.sim.bound`): the fewest GPU-hours a schedule of
aggregated fleet sizes reaching the goal spends when it knows every interval's arrivals and the
twin's attainment of each size at each rate, paying each added replica's start-up; next to the
static fleets read off the same table (linearly: within 0.3 points of their own runs on the three
days). Two readings of the table between its measured rates: *linear* (the best estimate) and
*optimistic* (the attainment at the measured rate just below; its ratio still compares against
the linear static fleets, so it leans low twice).

The table: the twin (planner_twin.py's engines, router and targets) serves ``n`` engines a steady
Poisson load of the load's own shapes, in order, for a warm-up then a measured window, at rates on
a grid spanning every seed's per-interval rates, each size's knee measured finer; sizes from 1 up
to 3 past the first static size meeting the goal. It is the costly part (about 20 minutes of two
cores for the three days' range); ``--table FILE`` keeps it (after each size) and reuses it for
loads of the same shapes whose rates it covers.

Usage: ``.venv/bin/python benchmarks/planner_bound.py --load servegen-3d --seeds 0,1,2
[--delay 420] [--goal 0.99] [--jobs 2] [--table FILE] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import inputs
import planner_twin
from copse.api import Role
from copse.planner.observations import Observation
from copse.sim import bound
from copse.sim.frontier import Frontier, StaticPoint
from copse.sim.load import LOADS, Load, build_load, synthesize
from copse.sim.replay import ReplaySettings
from copse.sim.trace import TraceRequest, load_trace
from copse.sim.twin import TwinSettings, run_twin

INTERVAL_S = 60.0
WARMUP_S, MEASURED_S = 600.0, 1800.0
GRID_POINTS = 25
#: Rounds of halving the rate step where a size's attainment changes fast (its knee).
REFINEMENTS = 2
#: How far past a read table's top rate a load may reach (other seeds' busiest minute than the
#: one the table was measured for): beyond it the table would be extrapolated, not read.
TABLE_SLACK = 1.05

_SHAPES: list[TraceRequest] = []


def _init(shapes: list[TraceRequest]) -> None:
    _SHAPES[:] = shapes


def _measure(size: int, rate: float, seed: int) -> tuple[int, float, float]:
    """Attainment of ``size`` engines serving ``rate`` req/s steadily."""
    end = WARMUP_S + MEASURED_S
    recording = [Observation(timestamp=0.0, duration_s=end, num_requests=rate * end, isl=1.0, osl=1.0)]
    settings = TwinSettings(
        fleet=ReplaySettings(workers=1, seed=seed),
        limits=planner_twin.limits(disaggregated=False, max_replicas=size),
        planner=None,
        warmup_s=WARMUP_S,
        initial={Role.WORKER: size},
    )
    report = run_twin(synthesize(recording, _SHAPES, seed=seed), settings, end_s=end)
    return size, rate, report.slo_attainment


def measure_table(
    *,
    seed: int,
    shapes: list[TraceRequest],
    grid: list[float],
    arrivals: np.ndarray,
    goal: float,
    max_size: int,
    jobs: int,
    save: Callable[[bound.SteadyTable], None],
) -> bound.SteadyTable:
    """Sizes from 1, each at the rates worth measuring, until 3 past the first static size that
    reaches ``goal`` on ``arrivals``, ``max_size``, or a size with no rate left to measure (each
    gained nothing over the last); ``save`` gets the table after each size (a long walk cut short
    keeps what it measured)."""
    points: dict[int, list[tuple[float, float]]] = {}
    meeting: int | None = None
    context = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=context, initializer=_init, initargs=(shapes,)
    ) as pool:
        for size in range(1, max_size + 1):
            rates = bound.rates_to_measure(points, size=size, grid=grid)
            if not rates:
                break
            started = time.perf_counter()
            measured: list[tuple[float, float]] = []
            for _ in range(1 + REFINEMENTS):
                done = pool.map(_measure, [size] * len(rates), rates, [seed] * len(rates))
                measured = sorted(measured + [(rate, share) for _, rate, share in done])
                rates = bound.refinements(measured)
                if not rates:
                    break
            points[size] = measured
            table = bound.SteadyTable(points=points)
            save(table)
            missed = bound.misses(table, arrivals=arrivals, interval_s=INTERVAL_S, sizes=[size])
            static = bound.static_attainment(missed, arrivals=arrivals, column=0)
            print(
                f"  {size:>2} engines: {len(measured)} rates in {time.perf_counter() - started:.0f} s; "
                f"static on the load {static:.2%}",
                file=sys.stderr,
                flush=True,
            )
            if meeting is None and static >= goal:
                meeting = size
            if meeting is not None and size >= meeting + 3:
                break
    return bound.SteadyTable(points=points)


def per_interval_arrivals(load: Load) -> np.ndarray:
    """Requests arriving in each interval after the load's warm-up."""
    stamps = np.array([r.timestamp_ms for r in load.requests]) / 1000.0
    edges = np.arange(load.warmup_s, load.end_s + 1e-9, INTERVAL_S)
    counts: np.ndarray = np.diff(np.searchsorted(stamps, edges)).astype(float)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", default="servegen-3d", choices=sorted(LOADS))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--delay", type=float, default=420.0, help="start-up delay, s")
    parser.add_argument("--goal", type=float, default=0.99)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--max-size", type=int, default=24)
    parser.add_argument("--table", type=Path, help="steady table JSON: read when it exists, else written")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not 0 < args.goal < 1:
        parser.error(f"--goal {args.goal} must lie in (0, 1)")
    seeds = [int(s) for s in args.seeds.split(",")]
    spec = LOADS[args.load]
    # only the counts are kept: a load's requests (millions on three days) would stay in memory,
    # and in every forked measuring process, for nothing
    arrivals = {
        seed: per_interval_arrivals(build_load(args.load, seed=seed, traces=inputs.WHOLE)) for seed in seeds
    }
    measured_on = {"shapes": spec.shapes, "max_input_length": spec.max_input_length}
    if args.table is not None and args.table.exists():
        try:
            document = json.loads(args.table.read_text())
            table = bound.SteadyTable.from_json(document["points"])
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            parser.error(f"--table {args.table} is not a steady table this script wrote: {error!r}")
        if {key: document.get(key) for key in measured_on} != measured_on:
            parser.error(
                f"--table {args.table} was measured on {document.get('shapes')} (prompts up to "
                f"{document.get('max_input_length')}); {args.load} has {spec.shapes} (up to "
                f"{spec.max_input_length}): give a new file to measure a table for this load"
            )
        print(f"steady table read from {args.table}", file=sys.stderr)
    else:
        every = np.concatenate(list(arrivals.values()))
        grid = bound.rate_grid(every[every > 0] / INTERVAL_S, points=GRID_POINTS)
        print(
            f"measuring the steady table: rates {grid[0]}-{grid[-1]} req/s, {len(grid)} points",
            file=sys.stderr,
        )

        def save(measured: bound.SteadyTable) -> None:
            if args.table is not None:
                document = {**measured_on, "seed": seeds[0], "points": measured.as_json()}
                args.table.write_text(json.dumps(document))

        shapes = [
            r
            for r in load_trace(inputs.WHOLE / spec.shapes, fmt=spec.shapes_format)
            if spec.max_input_length is None or r.input_length <= spec.max_input_length
        ]
        table = measure_table(
            seed=seeds[0],
            shapes=shapes,
            grid=grid,
            arrivals=arrivals[seeds[0]],
            goal=args.goal,
            max_size=args.max_size,
            jobs=args.jobs,
            save=save,
        )
    covered = max(rate for pairs in table.points.values() for rate, _ in pairs)
    busiest = max(float(counts.max()) for counts in arrivals.values()) / INTERVAL_S
    if busiest > TABLE_SLACK * covered:
        parser.error(
            f"the steady table covers rates up to {covered:g} req/s; {args.load} reaches {busiest:.1f}: "
            "give a new --table file to measure a table for this load"
        )
    sizes = sorted(table.points)
    startup = args.delay / INTERVAL_S
    results: list[dict[str, Any]] = []
    print(
        f"{args.load}, goal {args.goal:.2%}, start-up {args.delay:g} s; sizes {sizes[0]}-{sizes[-1]} engines"
    )
    for seed in seeds:
        counts = arrivals[seed]
        hours = len(counts) * INTERVAL_S / 3600.0
        missed = bound.misses(table, arrivals=counts, interval_s=INTERVAL_S, sizes=sizes)
        frontier = Frontier(
            static=tuple(
                StaticPoint(
                    replicas=size,
                    slo_attainment=bound.static_attainment(missed, arrivals=counts, column=k),
                    gpu_hours=size * hours,
                )
                for k, size in enumerate(sizes)
            ),
            goal=args.goal,
        )
        row: dict[str, Any] = {"seed": seed, "static": [p.as_json() for p in frontier.static]}
        parts = []
        optimistic = bound.misses(table, arrivals=counts, interval_s=INTERVAL_S, sizes=sizes, optimistic=True)
        for reading, read in (("optimistic", optimistic), ("linear", missed)):
            best = bound.cheapest(
                read, arrivals=counts, sizes=sizes, startup_intervals=startup, goal=args.goal
            )
            if best is None:
                parts.append(f"{reading}: no schedule of up to {sizes[-1]} engines reaches {args.goal:.2%}")
                continue
            gpu_hours = best.replica_intervals * INTERVAL_S / 3600.0
            ratio = frontier.ratio_at_equal_attainment(attainment=best.attainment, gpu_hours=gpu_hours)
            row[reading] = {
                "slo_attainment": best.attainment,
                "gpu_hours": gpu_hours,
                "ratio_at_equal_attainment": ratio,
                "peak_replicas": int(best.sizes.max()),
                "replicas_started": best.added,
            }
            parts.append(
                f"{reading}: {best.attainment:.2%} at {gpu_hours:.1f} GPU-hours, ratio "
                f"{'-' if ratio is None else format(ratio, '.3f')} "
                f"({best.added} started, peak {best.sizes.max()})"
            )
        results.append(row)
        around = ", ".join(
            f"{p.replicas}: {p.slo_attainment:.2%}" for p in frontier.static if p.slo_attainment > 0.9
        )
        print(f"seed {seed}: " + "; ".join(parts) + f"; static (table) {around}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"load": args.load, "goal": args.goal, "delay_s": args.delay, "seeds": results}, indent=1
            )
        )


if __name__ == "__main__":
    main()
