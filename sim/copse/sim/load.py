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

import dataclasses
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from copse.planner.observations import Observation
from copse.sim.trace import TraceRequest

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
