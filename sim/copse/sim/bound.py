"""The clairvoyant bound on a planner: the cheapest schedule of fleet sizes that knows every
interval's arrivals in advance and what share of them each size serves within the SLO.

A planner judged against static fleets (:mod:`copse.sim.frontier`) also needs to know how much any
planner could save on the load, or a target can ask for more than the load allows. The bound takes
the twin's own attainment of ``n`` engines at a steady arrival rate (a :class:`SteadyTable`, measured
once per size and rate) and, over the load's intervals, chooses the size of each by a dynamic
programme on ``replica-intervals + price x misses``, paying each added replica's start-up (it holds
a GPU before it serves); :func:`cheapest` raises the price until the schedule reaches the goal.

It is an estimate of what clairvoyance reaches, not a planner: it knows the future, changes size
every interval and carries no queue from one interval into the next. The table is one seed's
steady runs, so it holds noise and reads short peaks pessimistically (a peak shorter than the
steady queue's build-up serves better than the table says). Read linearly between measured rates
it is the best estimate; read ``optimistic`` (the attainment at the measured rate just below) it
leans the other way. A planner that forecasts stays above the estimate; a target close to it asks
a planner to be as good as clairvoyance.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import NDArray


@dataclasses.dataclass(frozen=True, slots=True)
class SteadyTable:
    """Share of requests within the SLO of ``n`` engines at a steady arrival rate, as measured."""

    points: Mapping[int, Sequence[tuple[float, float]]]
    """Per fleet size, ``(rate in req/s, attainment)`` pairs sorted by rate."""

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a steady table needs at least one fleet size")
        for size, pairs in self.points.items():
            rates = [rate for rate, _ in pairs]
            valid = all(rate >= 0 and 0 <= share <= 1 for rate, share in pairs)
            if size < 1 or not pairs or rates != sorted(rates) or not valid:
                raise ValueError(
                    f"fleet size {size}: needs a positive size and (rate >= 0, attainment in [0, 1]) "
                    f"points sorted by rate, got {pairs}"
                )

    def attainment(self, size: int, rate: float, *, optimistic: bool = False) -> float:
        """Attainment of ``size`` engines at ``rate``: linear between measured rates
        (``optimistic``: the attainment at the measured rate just below, as attainment falls while
        the rate rises), the nearest measured one beyond them, and never below a smaller fleet's (an
        engine added does not make the others slower), so the sizes a walk skipped read as the
        best measured below them; 0 below the smallest size measured."""
        best = 0.0
        for measured in sorted(self.points):
            if measured > size:
                break
            pairs = self.points[measured]
            rates = [r for r, _ in pairs]
            shares = [a for _, a in pairs]
            if optimistic:
                share = shares[max(bisect.bisect_right(rates, rate) - 1, 0)]
            else:
                share = float(np.interp(rate, rates, shares))
            best = max(best, share)
        return best

    def as_json(self) -> dict[str, list[list[float]]]:
        return {str(size): [list(pair) for pair in pairs] for size, pairs in sorted(self.points.items())}

    @classmethod
    def from_json(cls, data: Mapping[str, Sequence[Sequence[float]]]) -> SteadyTable:
        return cls(
            points={int(size): [(float(r), float(a)) for r, a in pairs] for size, pairs in data.items()}
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    """Fleet sizes chosen for a load's intervals."""

    sizes: NDArray[np.int64]
    """Replicas serving in each interval."""
    attainment: float
    """Share of the load's requests within the SLO."""
    replica_intervals: float
    """Replicas held per interval summed, each added replica's start-up included."""
    added: int
    """Replicas started over the schedule."""


def misses(
    table: SteadyTable,
    *,
    arrivals: NDArray[np.float64],
    interval_s: float,
    sizes: Sequence[int],
    optimistic: bool = False,
) -> NDArray[np.float64]:
    """Requests missing the SLO in each interval (rows) at each size (columns), the table read as
    :meth:`SteadyTable.attainment` does."""
    rates = arrivals / interval_s
    shares = np.array(
        [[table.attainment(size, rate, optimistic=optimistic) for size in sizes] for rate in rates],
        dtype=float,
    )
    out: NDArray[np.float64] = arrivals[:, None] * (1.0 - shares)
    return out


def schedule(
    missed: NDArray[np.float64],
    *,
    arrivals: NDArray[np.float64],
    sizes: Sequence[int],
    startup_intervals: float,
    price: float,
) -> Schedule:
    """The sizes minimising replica-intervals (a replica added costs ``startup_intervals`` more)
    plus ``price`` x missed requests, by a dynamic programme over the intervals."""
    if missed.shape != (len(arrivals), len(sizes)) or not len(arrivals) or not len(sizes):
        raise ValueError(
            f"missed has shape {missed.shape}; expected ({len(arrivals)}, {len(sizes)}), non-empty"
        )
    if arrivals.sum() <= 0:
        raise ValueError("no arrivals to schedule for")
    counts = np.asarray(sizes, dtype=float)
    # switch[i, j]: going from sizes[i] to sizes[j] starts the replicas added; removing is free
    switch = startup_intervals * np.maximum(counts[None, :] - counts[:, None], 0.0)
    cost = counts + price * missed[0]
    came_from = np.zeros(missed.shape, dtype=np.int64)
    columns = np.arange(len(sizes))
    for t in range(1, len(arrivals)):
        total = cost[:, None] + switch
        came_from[t] = np.argmin(total, axis=0)
        cost = total[came_from[t], columns] + counts + price * missed[t]
    path = np.empty(len(arrivals), dtype=np.int64)
    path[-1] = int(np.argmin(cost))
    for t in range(len(arrivals) - 1, 0, -1):
        path[t - 1] = came_from[t][path[t]]
    chosen = np.asarray(sizes, dtype=np.int64)[path]
    added = int(np.maximum(np.diff(chosen), 0).sum())
    return Schedule(
        sizes=chosen,
        attainment=1.0 - float(missed[np.arange(len(arrivals)), path].sum()) / float(arrivals.sum()),
        replica_intervals=float(chosen.sum()) + startup_intervals * added,
        added=added,
    )


def cheapest(
    missed: NDArray[np.float64],
    *,
    arrivals: NDArray[np.float64],
    sizes: Sequence[int],
    startup_intervals: float,
    goal: float,
) -> Schedule | None:
    """The :func:`schedule` at the lowest price that reaches ``goal`` (bisection on its logarithm),
    ``None`` when even the highest price misses it. Only schedules some price makes optimal are
    found (those on the lower convex hull of cost against misses), so it may overshoot the goal a
    little: compare it at its own attainment."""

    def at(price: float) -> Schedule:
        return schedule(
            missed, arrivals=arrivals, sizes=sizes, startup_intervals=startup_intervals, price=price
        )

    low, high = math.log(1e-6), math.log(1e6)
    best = at(math.exp(high))
    if best.attainment < goal:
        return None
    for _ in range(40):
        middle = (low + high) / 2.0
        trial = at(math.exp(middle))
        if trial.attainment >= goal:
            high, best = middle, trial
        else:
            low = middle
    return best


def static_attainment(missed: NDArray[np.float64], *, arrivals: NDArray[np.float64], column: int) -> float:
    """Attainment of one size (``column`` of ``missed``) held through every interval."""
    return 1.0 - float(missed[:, column].sum()) / float(arrivals.sum())


def rate_grid(rates: NDArray[np.float64], *, points: int) -> list[float]:
    """``points`` rates evenly spaced from the load's least to its most, rounded to 0.1 req/s."""
    if points < 2 or not len(rates):
        raise ValueError(
            f"a rate grid needs rates and at least 2 points, got {len(rates)} rates, {points} points"
        )
    low, high = float(rates.min()), float(rates.max())
    return sorted({round(low + (high - low) * k / (points - 1), 1) for k in range(points)})


def rates_to_measure(
    measured: Mapping[int, Sequence[tuple[float, float]]],
    *,
    size: int,
    grid: Sequence[float],
    floor: float = 0.5,
    converged: float = 0.001,
) -> list[float]:
    """The grid's rates worth measuring for ``size`` engines, given the smaller sizes ``measured``
    (as :attr:`SteadyTable.points`): not those past one step beyond where ``size - 1`` engines fall
    below ``floor``, scaled by ``size / (size - 1)`` (``size`` saturates there too), nor those where
    the last engine added gained less than ``converged`` or ``size - 1`` was not measured for that
    reason (one more gains no more: the table reads the smaller size's there)."""
    one, two = measured.get(size - 1), measured.get(size - 2)
    rates = list(grid)
    if one is None:
        return rates
    saturated = [rate for rate, share in one if share < floor]
    if saturated:
        cut = bisect.bisect_right(rates, saturated[0] * size / (size - 1))
        rates = rates[: cut + 1]
    if two is not None:
        below = dict(two)
        done = {rate for rate, share in one if rate in below and share - below[rate] < converged}
        # converged rates lie at the low end: those size - 1 skipped stay skipped
        lowest = min(rate for rate, _ in one)
        rates = [rate for rate in rates if rate not in done and rate >= lowest]
    return rates


def refinements(
    measured: Sequence[tuple[float, float]], *, step: float = 0.005, floor: float = 0.8
) -> list[float]:
    """Rates halfway between neighbouring measured ones (``(rate, attainment)`` sorted by rate)
    whose attainments differ by more than ``step`` where both are at least ``floor``: the knee, where
    a schedule aiming high chooses its sizes and a linear reading errs most."""
    known = {rate for rate, _ in measured}
    halves = (
        round((r0 + r1) / 2.0, 3)
        for (r0, a0), (r1, a1) in itertools.pairwise(measured)
        if min(a0, a1) >= floor and abs(a1 - a0) > step
    )
    return [rate for rate in halves if rate not in known]
