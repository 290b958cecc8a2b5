"""Request streams for the closed-loop twin: arrivals following a recorded rate curve, request
shapes (prompt length, output length, shared prefixes) taken from a real trace.

A recording (the planner's metrics format: requests per interval, e.g. ServeGen's per-model rate
curves) says how many requests arrive when, but not what they are. :func:`synthesize` draws
arrival times from a Poisson process whose rate runs linearly between the intervals' midpoints
(a step between two intervals becomes a ramp across them; the total count is kept),
and gives the arrivals the requests of a shape trace in the trace's own order, over and over:
conversations keep their turns, so shared prefixes stay as common as in the trace. Each pass
through the shape trace gets its own hash ids (a new pass is new users, not the same ones again).
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from copse.planner.observations import Observation
from copse.sim.trace import TraceFormat, TraceRequest, load_trace

#: Step of the grid the cumulative rate is tabulated on, seconds.
_GRID_S = 1.0


def arrival_times_s(
    observations: Sequence[Observation], *, seed: int, scale: float = 1.0
) -> npt.NDArray[np.float64]:
    """Arrival times (seconds from the first interval's start) of a Poisson process at ``scale``
    times the recorded rate, linear between interval midpoints and flat before the first and
    after the last; the same ``seed`` gives the same times."""
    if not observations:
        raise ValueError("no intervals to draw arrivals from")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    origin = observations[0].timestamp
    end = observations[-1].end - origin
    mids = np.array([obs.timestamp - origin + obs.duration_s / 2 for obs in observations])
    rates = np.array([obs.rate for obs in observations]) * scale
    grid = np.arange(0.0, end + _GRID_S, _GRID_S)
    grid[-1] = end
    rate = np.interp(grid, mids, rates)
    cumulative = np.concatenate(([0.0], np.cumsum((rate[1:] + rate[:-1]) / 2 * np.diff(grid))))
    rng = np.random.default_rng(seed)
    total = float(cumulative[-1])
    points: list[float] = []
    at = 0.0
    while True:  # unit-rate Poisson points on [0, total), in blocks
        gaps = rng.exponential(1.0, max(16, int(total - at) + 16))
        steps = at + np.cumsum(gaps)
        inside = steps[steps < total]
        points.extend(inside.tolist())
        if len(inside) < len(steps):
            break
        at = float(steps[-1])
    times: npt.NDArray[np.float64] = np.interp(np.array(points), cumulative, grid)
    return times


def shapes_in_order(
    shapes: Sequence[TraceRequest], count: int, *, max_input_length: int | None = None
) -> list[TraceRequest]:
    """``count`` requests from ``shapes`` in order, starting over as often as needed, each pass
    with hash ids of its own; requests longer than ``max_input_length`` are left out."""
    usable = [r for r in shapes if max_input_length is None or r.input_length <= max_input_length]
    if not usable:
        raise ValueError(f"no request of the shape trace has at most {max_input_length} prompt tokens")
    ids = [h for r in usable for h in r.hash_ids]
    span = 1 + max(ids, default=0) - min(ids, default=0)
    out = []
    for index in range(count):
        passes, position = divmod(index, len(usable))
        request = usable[position]
        offset = passes * span  # uint64 ids: 2**64 / span passes before they wrap (far more than a run needs)
        out.append(dataclasses.replace(request, hash_ids=tuple(h + offset for h in request.hash_ids)))
    return out


def synthesize(
    observations: Sequence[Observation],
    shapes: Sequence[TraceRequest],
    *,
    seed: int,
    scale: float = 1.0,
    max_input_length: int | None = None,
) -> list[TraceRequest]:
    """Requests arriving at the recorded rate (times ``scale``) with the shapes of ``shapes``;
    timestamps in ms from the first interval's start."""
    times = arrival_times_s(observations, seed=seed, scale=scale)
    picked = shapes_in_order(shapes, len(times), max_input_length=max_input_length)
    return [
        dataclasses.replace(request, timestamp_ms=float(t) * 1000.0)
        for t, request in zip(times, picked, strict=True)
    ]


#: ServeGen's aggregate rate curves come in 600-s windows.
SERVEGEN_WINDOW_S = 600.0


class LoadError(ValueError):
    """A named load that cannot be built; the message names the missing file or the bad value."""


@dataclasses.dataclass(frozen=True, slots=True)
class LoadSpec:
    """A named load of the closed-loop twin: a ServeGen rate curve and a trace's request shapes."""

    description: str
    rates: str
    """ServeGen aggregate rate CSV (``window_start_s,total_rate_req_per_s,...``) under the traces folder."""
    windows: tuple[int, int]
    """600-s windows ``[first, last)`` of the curve."""
    shapes: str
    """Trace whose requests the arrivals get, in order, under the traces folder."""
    shapes_format: TraceFormat
    peak_rate: float
    """Busiest window after scaling, req/s (sets how many replicas the peak needs)."""
    warmup_s: float
    """Load before results count (the planner learns it first)."""
    max_input_length: int | None = 32768
    """Longer prompts are left out (they would go to a long-context pool)."""

    @property
    def duration_s(self) -> float:
        return (self.windows[1] - self.windows[0]) * SERVEGEN_WINDOW_S


#: The loads ``copse bench planner --load`` knows. Rates: ServeGen ``language/m-large`` (Alibaba
#: Bailian, 14 days of 600-s windows; days 11-13 are a weekend and the Monday after it, days 9-10 of
#: the data hold its sharpest burst). Shapes: Mooncake conversation (Kimi, shared prefixes, 12k-token
#: mean prompts) or the Azure 2023 conversation and code traces (no prefix sharing, 1-2k-token prompts).
LOADS: dict[str, LoadSpec] = {
    "servegen-3d": LoadSpec(
        description="3 days of ServeGen m-large (a weekend and the Monday after: diurnal and weekly swing, "
        "peak/trough 7.6x), Mooncake conversation shapes",
        rates="servegen_language_m-large_aggregate_rate.csv",
        windows=(1584, 2016),
        shapes="mooncake_fast25_conversation_trace.jsonl.gz",
        shapes_format="mooncake",
        peak_rate=24.0,
        warmup_s=7200.0,
    ),
    "burst-4h": LoadSpec(
        description="4 hours of ServeGen m-large around its sharpest burst (156 -> 504 req/s), Mooncake "
        "conversation shapes (RESULTS' planner-twin load)",
        rates="servegen_language_m-large_aggregate_rate.csv",
        windows=(1392, 1416),
        shapes="mooncake_fast25_conversation_trace.jsonl.gz",
        shapes_format="mooncake",
        peak_rate=18.0,
        warmup_s=3600.0,
    ),
    "azure-conv": LoadSpec(
        description="the 4-hour burst's rate curve, Azure 2023 conversation shapes",
        rates="servegen_language_m-large_aggregate_rate.csv",
        windows=(1392, 1416),
        shapes="azure_llm_2023_conv.csv.gz",
        shapes_format="azure",
        peak_rate=40.0,
        warmup_s=3600.0,
    ),
    "azure-code": LoadSpec(
        description="the 4-hour burst's rate curve, Azure 2023 code shapes",
        rates="servegen_language_m-large_aggregate_rate.csv",
        windows=(1392, 1416),
        shapes="azure_llm_2023_code.csv.gz",
        shapes_format="azure",
        peak_rate=40.0,
        warmup_s=3600.0,
    ),
}


@dataclasses.dataclass(frozen=True, slots=True)
class Load:
    """A load ready to serve."""

    requests: list[TraceRequest]
    end_s: float
    warmup_s: float
    recording: list[Observation]
    """The rate curve as the planner's metrics (unscaled), e.g. for ``copse planner dry-run``."""


def _need(folder: Path, name: str, load: str) -> Path:
    path = folder / name
    if not path.is_file():
        raise LoadError(
            f"load {load!r} reads {path}, which does not exist: multi-day inputs are not copied into the "
            f"repository; put the public traces in {folder} (docs/guides/benchmarks.md, 'Inputs', says where "
            "each comes from)"
        )
    return path


def servegen_recording(
    path: Path, *, windows: tuple[int, int], shapes: Sequence[TraceRequest]
) -> list[Observation]:
    """ServeGen 600-s windows ``[first, last)`` as the planner's metrics, with the shapes' mean lengths."""
    with path.open() as handle:
        rows = list(csv.DictReader(handle))[windows[0] : windows[1]]
    if len(rows) != windows[1] - windows[0]:
        raise LoadError(
            f"{path}: windows {windows[0]}-{windows[1] - 1} asked for, the file has {len(rows)} of them"
        )
    isl = np.array([r.input_length for r in shapes], dtype=float)
    osl = np.array([r.output_length for r in shapes], dtype=float)
    return [
        Observation(
            timestamp=float(row["window_start_s"]),
            duration_s=SERVEGEN_WINDOW_S,
            num_requests=float(row["total_rate_req_per_s"]) * SERVEGEN_WINDOW_S,
            isl=float(isl.mean()),
            osl=float(osl.mean()),
            isl_p90=float(np.percentile(isl, 90)),
            osl_p10=float(np.percentile(osl, 10)),
        )
        for row in rows
    ]


def build_load(
    name: str,
    *,
    seed: int,
    peak_rate: float | None = None,
    traces: Path,
    hours: float | None = None,
) -> Load:
    """The named load (:data:`LOADS`), arrivals drawn with ``seed``; ``peak_rate`` replaces the
    spec's; ``hours`` keeps only that much of it from the start (a slice). Raises :class:`LoadError`."""
    spec = LOADS.get(name)
    if spec is None:
        raise LoadError(f"unknown load {name!r}; known: {', '.join(sorted(LOADS))}")
    shapes = load_trace(_need(traces, spec.shapes, name), fmt=spec.shapes_format)
    usable = [r for r in shapes if spec.max_input_length is None or r.input_length <= spec.max_input_length]
    windows = spec.windows
    if hours is not None:
        count = max(1, round(hours * 3600.0 / SERVEGEN_WINDOW_S))
        windows = (windows[0], min(windows[1], windows[0] + count))
    recording = servegen_recording(_need(traces, spec.rates, name), windows=windows, shapes=usable)
    peak = peak_rate if peak_rate is not None else spec.peak_rate
    if not (peak > 0 and math.isfinite(peak)):
        raise LoadError(f"peak rate must be a positive number of req/s, got {peak}")
    full = servegen_recording(_need(traces, spec.rates, name), windows=spec.windows, shapes=usable)
    scale = peak / max(obs.rate for obs in full)  # a slice keeps the full load's scale
    requests = synthesize(recording, usable, seed=seed, scale=scale)
    end_s = recording[-1].end - recording[0].timestamp
    warmup = min(spec.warmup_s, end_s / 4) if hours is not None else spec.warmup_s
    return Load(requests=requests, end_s=end_s, warmup_s=warmup, recording=recording)
