"""Error-budget pacing: the attainment goal holds over the run, not in every interval.

An SLO of 99 % leaves 1 % of the requests as an error budget. Sizing every interval for 99 %
over-delivers: quiet hours meet it on the fewest replicas anyway, and the peaks, where each point
of attainment costs the most replicas, are held to the same share. The pacer tracks the misses
the router counts against the budget and sets the share of it the next intervals are sized to
miss (the *spend*, in multiples of the budget): intervals that leave budget unspent let later
ones spend more (a peak sized for 97 %), intervals that overspend make later ones spend less.

An integral controller on the log of the spend: each interval moves it by its relative error
(misses over the budget share, minus one), weighted by its load against the mean load over a
load cycle (the budget is per request: a quiet interval's surplus is worth little), at a rate set
by a half-life. Pure: counts in, a goal out.
"""

from __future__ import annotations

import math

#: Most one interval's load counts against the mean: before a cycle has been seen, the mean is of
#: the few intervals observed (a start at a trough would weigh the morning many times over).
_MAX_WEIGHT = 3.0


class ErrorBudget:
    """The goal the next interval is sized for, paced by the misses observed so far."""

    def __init__(
        self, *, goal: float, bounds: tuple[float, float], halflife_s: float, cycle_s: float, max_error: float
    ) -> None:
        if not 0 < goal < 1:
            raise ValueError(f"goal={goal} must lie in (0, 1)")
        low, high = bounds
        if not 0 < low <= high:
            raise ValueError(f"bounds {bounds} must satisfy 0 < low <= high")
        self._budget = 1.0 - goal
        self._log_bounds = (math.log(low), math.log(high))
        self._rate = math.log(2.0) / halflife_s
        self._cycle_s = cycle_s
        self._max_error = max_error
        self._log_spend = min(max(0.0, self._log_bounds[0]), self._log_bounds[1])
        self._mean_rate = 0.0
        self._seen_s = 0.0

    @property
    def spend(self) -> float:
        """Multiple of the error budget the next interval is sized to miss."""
        return math.exp(self._log_spend)

    @property
    def goal(self) -> float:
        """Share of the next interval's requests it is sized to serve within the SLO."""
        return 1.0 - self._budget * self.spend

    def observe(self, *, judged: float, missed: float, duration_s: float) -> None:
        """Account one interval: ``judged`` requests, of which ``missed`` missed the SLO."""
        if not (math.isfinite(judged) and math.isfinite(missed)) or judged <= 0 or duration_s <= 0:
            return
        rate = judged / duration_s
        # The mean load over the last cycle; over the time seen until a whole cycle has been.
        self._seen_s += duration_s
        self._mean_rate += (rate - self._mean_rate) * duration_s / min(self._seen_s, self._cycle_s)
        # An interval missing more than max_error times its share is an incident the fast loop
        # answers; pacing counts it as that much overspent, so one burst does not undo a day.
        error = min(max(missed, 0.0) / (self._budget * judged) - 1.0, self._max_error)
        weight = min(rate / self._mean_rate, _MAX_WEIGHT)
        self._log_spend -= self._rate * duration_s * weight * error
        self._log_spend = min(max(self._log_spend, self._log_bounds[0]), self._log_bounds[1])
