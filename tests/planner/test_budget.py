"""Error-budget pacing: the goal each interval is sized for moves with the misses counted so far."""

from __future__ import annotations

import pytest

from copse.planner.budget import ErrorBudget

HOUR = 3600.0


def budget(**overrides: float | tuple[float, float]) -> ErrorBudget:
    values: dict[str, object] = {
        "goal": 0.99,
        "bounds": (0.5, 3.0),
        "halflife_s": HOUR,
        "cycle_s": 86400.0,
        "max_error": 5.0,
    }
    values.update(overrides)
    return ErrorBudget(**values)  # type: ignore[arg-type]


def run(pacer: ErrorBudget, *, minutes: int, rate: float, miss_share: float) -> None:
    for _ in range(minutes):
        judged = rate * 60.0
        pacer.observe(judged=judged, missed=miss_share * judged, duration_s=60.0)


def test_it_starts_at_the_goal() -> None:
    assert budget().goal == pytest.approx(0.99)
    assert budget().spend == 1.0


def test_an_hour_without_misses_doubles_the_spend() -> None:
    pacer = budget()
    run(pacer, minutes=60, rate=10.0, miss_share=0.0)
    assert pacer.spend == pytest.approx(2.0)
    assert pacer.goal == pytest.approx(0.98)


def test_an_hour_at_twice_the_budget_halves_the_spend() -> None:
    pacer = budget()
    run(pacer, minutes=60, rate=10.0, miss_share=0.02)
    assert pacer.spend == pytest.approx(0.5)
    assert pacer.goal == pytest.approx(0.995)


def test_misses_at_the_budget_hold_the_spend() -> None:
    pacer = budget()
    run(pacer, minutes=30, rate=10.0, miss_share=0.0)
    held = pacer.spend
    run(pacer, minutes=120, rate=10.0, miss_share=0.01)
    assert pacer.spend == pytest.approx(held)


def test_the_spend_stays_within_its_bounds() -> None:
    pacer = budget()
    run(pacer, minutes=600, rate=10.0, miss_share=0.0)
    assert pacer.spend == pytest.approx(3.0)
    run(pacer, minutes=600, rate=10.0, miss_share=0.03)
    assert pacer.spend == pytest.approx(0.5)


def test_a_quiet_interval_moves_it_less_than_a_busy_one() -> None:
    """The budget is per request: a quiet hour's surplus is worth less than a busy hour's."""
    quiet, busy = budget(), budget()
    run(quiet, minutes=60, rate=10.0, miss_share=0.01)
    run(busy, minutes=60, rate=10.0, miss_share=0.01)  # both learn the mean load, spend held at 1
    run(quiet, minutes=10, rate=2.0, miss_share=0.0)
    run(busy, minutes=10, rate=20.0, miss_share=0.0)
    assert 1.0 < quiet.spend < busy.spend


def test_one_burst_counts_at_most_max_error_times_over() -> None:
    capped, wide = budget(), budget(max_error=1000.0)
    for pacer in (capped, wide):
        run(pacer, minutes=60, rate=10.0, miss_share=0.0)
        run(pacer, minutes=1, rate=10.0, miss_share=0.6)  # 60x the budget in one interval
    # uncapped, the one minute takes back most of the hour's doubling; capped, a twelfth of it
    assert capped.spend == pytest.approx(2.0 * 2.0 ** (-5.0 / 60.0))
    assert wide.spend < 1.05


def test_intervals_without_requests_change_nothing() -> None:
    pacer = budget()
    pacer.observe(judged=0.0, missed=0.0, duration_s=60.0)
    assert pacer.spend == 1.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"goal": 1.0}, "goal=1.0"), ({"bounds": (2.0, 1.0)}, "bounds (2.0, 1.0)")],
)
def test_bad_settings_are_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        budget(**overrides)  # type: ignore[arg-type]


def test_a_start_at_a_trough_does_not_weigh_the_morning_many_times_over() -> None:
    """The mean load is of the intervals seen until a cycle has been; an interval counts at most 3x
    it, so one quiet minute before a busy hour does not move the spend as a day would."""
    pacer = budget()
    run(pacer, minutes=30, rate=0.1, miss_share=0.0)  # each at the mean so far: half an hour's worth
    pacer.observe(judged=1200.0, missed=0.0, duration_s=60.0)  # 20 req/s against a mean of 0.7
    assert pacer.spend == pytest.approx(2.0 ** ((30.0 + 3.0) / 60.0))


def test_counts_that_are_not_numbers_are_ignored() -> None:
    pacer = budget()
    pacer.observe(judged=float("nan"), missed=0.0, duration_s=60.0)
    pacer.observe(judged=600.0, missed=float("inf"), duration_s=60.0)
    assert pacer.spend == 1.0
