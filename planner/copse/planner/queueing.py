"""Queueing formulas the capacity model uses (pure math, no perf model).

* Erlang C -- the probability that an arrival waits, in an M/M/c queue.
* The M/M/c wait tail ``P(W > t) = C * exp(-(c*mu - lambda) * t)``, scaled by the Allen-Cunneen
  factor ``(1 + cs^2) / 2`` for general service times (M/G/c); ``cs^2`` is the squared coefficient
  of variation of the service time (0 for fixed-size prompts, 1 for exponential).
* A lognormal fit of the prompt-length distribution from its mean and 90th percentile, which
  gives ``cs^2`` when the metrics carry a p90; and equally likely prompt lengths of a gamma
  distribution with that mean and p90 (what the share of requests meeting a TTFT target is summed
  over), or, when the metrics carry quantiles of the uncached tokens, equally likely values read
  off them (:func:`quantile_points`).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
from numpy.typing import NDArray
from scipy.special import gammaincinv

#: Gamma shape with the largest p90 / mean (about 3.03); smaller shapes pile mass at zero instead.
_HEAVIEST_GAMMA_SHAPE = 0.2
#: z of the 90th percentile of a standard normal distribution.
_Z90 = NormalDist().inv_cdf(0.9)


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival has to wait with ``servers`` servers and ``offered`` Erlangs
    (arrival rate times mean service time); 1.0 when the queue is unstable."""
    if servers < 1:
        raise ValueError(f"servers={servers} must be at least 1")
    if offered < 0:
        raise ValueError(f"offered={offered} must not be negative")
    if offered == 0:
        return 0.0
    if offered >= servers:
        return 1.0
    # Erlang B by its stable recursion, then C from B.
    blocking = 1.0
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
        if blocking == 0.0:  # underflow: stays 0 for every larger k
            break
    return servers * blocking / (servers - offered * (1.0 - blocking))


def wait_quantile_s(
    *, servers: int, arrival_rate: float, service_s: float, quantile: float, service_scv: float = 1.0
) -> float:
    """The ``quantile`` of the waiting time (seconds, before service starts) in an M/G/c queue,
    approximated by the M/M/c tail scaled by ``(1 + service_scv) / 2``; ``inf`` when unstable."""
    if not 0 < quantile < 1:
        raise ValueError(f"quantile={quantile} must lie in (0, 1)")
    if arrival_rate <= 0:
        return 0.0
    capacity = servers / service_s
    if arrival_rate >= capacity:
        return math.inf
    waiting = erlang_c(servers, arrival_rate * service_s)
    if waiting <= 1.0 - quantile:
        return 0.0
    tail = math.log(waiting / (1.0 - quantile)) / (capacity - arrival_rate)
    return tail * (1.0 + service_scv) / 2.0


def lognormal_scv(*, mean: float, p90: float) -> float:
    """Squared coefficient of variation of a lognormal distribution with this mean and p90.

    A p90 at or below the mean means a light tail (0 is returned). Above about 2.28x the mean no
    lognormal fits; the heaviest lognormal that comes closest (sigma = z90) is used.
    """
    if mean <= 0 or p90 <= mean:
        return 0.0
    # ln(p90 / mean) = z*sigma - sigma^2 / 2; take the smaller root.
    gap = math.log(p90 / mean)
    discriminant = _Z90 * _Z90 - 2.0 * gap
    sigma = _Z90 - math.sqrt(discriminant) if discriminant > 0 else _Z90
    return math.expm1(sigma * sigma)


def normal_quantile(quantile: float) -> float:
    """z such that a standard normal variable stays below it with probability ``quantile``."""
    return NormalDist().inv_cdf(quantile)


def wait_exceeds(
    waits_s: NDArray[np.float64],
    *,
    servers: int,
    arrival_rate: float,
    service_s: float,
    service_scv: float = 1.0,
) -> NDArray[np.float64]:
    """``P(W > t)`` for each ``t`` in ``waits_s`` (seconds; negative ``t``: 1) in an M/G/c queue:
    Erlang C times the M/M/c exponential tail, its decay slowed by ``(1 + service_scv) / 2``
    (the Allen-Cunneen scaling :func:`wait_quantile_s` uses); 1 everywhere when unstable."""
    if arrival_rate <= 0:
        return np.where(waits_s < 0, 1.0, 0.0)
    capacity = servers / service_s
    if arrival_rate >= capacity:
        return np.ones_like(waits_s)
    waiting = erlang_c(servers, arrival_rate * service_s)
    decay = (capacity - arrival_rate) * 2.0 / (1.0 + service_scv)
    return np.where(waits_s < 0, 1.0, waiting * np.exp(-decay * np.maximum(waits_s, 0.0)))


def mean_wait_s(*, servers: int, arrival_rate: float, service_s: float, service_scv: float = 1.0) -> float:
    """Mean wait before service in an M/G/c queue (Erlang C over the spare capacity, Allen-Cunneen
    scaled); ``inf`` when unstable."""
    if arrival_rate <= 0:
        return 0.0
    capacity = servers / service_s
    if arrival_rate >= capacity:
        return math.inf
    waiting = erlang_c(servers, arrival_rate * service_s)
    return waiting / (capacity - arrival_rate) * (1.0 + service_scv) / 2.0


def gamma_points(
    *, mean: float, count: int, p90: float | None = None, p10: float | None = None, scv: float = 1.0
) -> NDArray[np.float64]:
    """``count`` equally likely values (its quantiles at ``(i + 1/2) / count``) of the gamma
    distribution with this ``mean`` and this 90th percentile, or this 10th percentile (the end
    that matters: long prompts for TTFT, short answers for ITL), or, without either, this squared CV.

    Gamma rather than lognormal: a lognormal matches a mean and a p90 only while p90 < 2.28 x mean,
    and prompt lengths cut off at the context limit often lie beyond (Mooncake's conversation trace
    below 32k tokens: 2.35), where the heaviest lognormal left puts 4 % of prompts past the limit;
    the gamma family covers every ratio (exponential at 2.30) with a light tail."""
    if count < 1:
        raise ValueError(f"count={count} must be at least 1")
    if mean <= 0:
        raise ValueError(f"mean={mean} must be positive")
    if p90 is not None and p10 is not None:
        raise ValueError("give p90 or p10, not both")
    if p90 is not None:
        if p90 <= mean:
            return np.full(count, float(mean))
        shape = _gamma_shape(p90 / mean, level=0.9)
    elif p10 is not None:
        if p10 >= mean:
            return np.full(count, float(mean))
        shape = _gamma_shape(max(p10, 0.0) / mean, level=0.1)
    elif scv <= 0:
        return np.full(count, float(mean))
    else:
        shape = 1.0 / scv
    levels = (np.arange(count, dtype=np.float64) + 0.5) / count
    return np.asarray(gammaincinv(shape, levels), dtype=np.float64) * (mean / shape)


def quantile_points(
    *, levels: tuple[float, ...], values: tuple[float, ...], mean: float, count: int
) -> NDArray[np.float64]:
    """``count`` equally likely values (at levels ``(i + 1/2) / count``) with this ``mean`` of the
    distribution whose quantile function runs linearly through ``values`` at ``levels`` (increasing,
    the last 1: the largest value), as a histogram's quantiles interpolate within its buckets. Below
    the first level nothing is known: the line starts at the value that gives the mean (between 0
    and the first value); a mean out of that reach scales every value instead."""
    if count < 1:
        raise ValueError(f"count={count} must be at least 1")
    if mean <= 0:
        raise ValueError(f"mean={mean} must be positive")
    if len(levels) != len(values) or not levels or levels[-1] != 1.0:
        raise ValueError(f"levels {levels} must end at 1 and match the values {values} one to one")
    if any(b <= a for a, b in zip((0.0, *levels), levels, strict=False)):
        raise ValueError(f"levels {levels} must increase from above 0")
    if any(b < a for a, b in zip((0.0, *values), values, strict=False)) or values[-1] <= 0:
        raise ValueError(f"values {values} must be non-negative, non-decreasing and not all 0")
    first_level, first = levels[0], values[0]
    # the exact mean of the piecewise-linear quantile function above the first level
    above = sum(
        (b - a) * (u + v) / 2 for a, b, u, v in zip(levels, levels[1:], values, values[1:], strict=False)
    )
    start = 2.0 * (mean - above) / first_level - first
    knots = np.asarray((min(max(start, 0.0), first), *values), dtype=np.float64)
    points = np.interp((np.arange(count, dtype=np.float64) + 0.5) / count, (0.0, *levels), knots)
    return points * (mean / float(points.mean()))


def _gamma_shape(ratio: float, *, level: float) -> float:
    """Shape ``k`` of the gamma distribution whose ``level`` quantile is ``ratio`` x its mean. A p90
    ratio falls with ``k`` from its largest, about 3.03 at ``k = 0.2``, a p10 ratio rises with it
    from 0; a ratio beyond gets that heaviest shape."""
    low, high = math.log(_HEAVIEST_GAMMA_SHAPE), math.log(1e4)
    falls = level > 0.5
    for _ in range(60):
        middle = (low + high) / 2
        k = math.exp(middle)
        if (float(gammaincinv(k, level)) / k > ratio) == falls:
            low = middle
        else:
            high = middle
    return math.exp((low + high) / 2)
