"""The clairvoyant bound: the steady table's reading, the schedule's start-up cost, the price search."""

from __future__ import annotations

import numpy as np
import pytest

from copse.sim.bound import SteadyTable, cheapest, misses, rate_grid, rates_to_measure, refinements, schedule

# 1 engine serves 1 req/s at 99 %, 2 req/s at 90 %; 2 engines twice that; 3 engines no better than 2
TABLE = SteadyTable(
    points={
        1: [(1.0, 0.99), (2.0, 0.90), (3.0, 0.40)],
        2: [(2.0, 0.99), (4.0, 0.90), (6.0, 0.40)],
        3: [(2.0, 0.98), (6.0, 0.95)],
    }
)


def test_the_table_interpolates_in_rate_and_never_reads_a_larger_fleet_as_worse() -> None:
    assert TABLE.attainment(1, 1.5) == pytest.approx(0.945)
    assert TABLE.attainment(1, 0.5) == pytest.approx(0.99)  # below the rates measured: the nearest
    assert TABLE.attainment(3, 2.0) == pytest.approx(0.99)  # 2 engines measured better there
    assert TABLE.attainment(3, 6.0) == pytest.approx(0.95)
    assert TABLE.attainment(5, 6.0) == pytest.approx(0.95)  # beyond the sizes: the largest's
    # optimistic: the measured rate just below (attainment only falls as the rate rises)
    assert TABLE.attainment(1, 1.5, optimistic=True) == pytest.approx(0.99)
    assert TABLE.attainment(1, 2.0, optimistic=True) == pytest.approx(0.90)
    assert TABLE.attainment(3, 5.0, optimistic=True) == pytest.approx(0.98)  # linear: 0.9575
    assert SteadyTable.from_json(TABLE.as_json()) == TABLE


def test_a_table_rejects_unsorted_rates_shares_outside_0_1_and_no_sizes() -> None:
    with pytest.raises(ValueError, match="fleet size 2"):
        SteadyTable(points={2: [(3.0, 0.9), (1.0, 0.99)]})
    with pytest.raises(ValueError, match="fleet size 1"):
        SteadyTable(points={1: [(1.0, 1.5)]})
    with pytest.raises(ValueError, match="at least one"):
        SteadyTable(points={})


def test_without_start_up_cost_each_interval_takes_its_own_cheapest_size() -> None:
    arrivals = np.array([60.0, 240.0, 60.0])  # 1, 4, 1 req/s
    missed = misses(TABLE, arrivals=arrivals, interval_s=60.0, sizes=[1, 2])
    plan = schedule(missed, arrivals=arrivals, sizes=[1, 2], startup_intervals=0.0, price=10.0)
    # at 4 req/s one engine misses most requests; two miss 10 % of 240 = 24, worth the engine at 10/miss
    assert plan.sizes.tolist() == [1, 2, 1]
    assert plan.added == 1
    assert plan.replica_intervals == pytest.approx(4.0)
    assert plan.attainment == pytest.approx(1.0 - (0.6 + 24.0 + 0.6) / 360.0)


def test_a_start_up_dearer_than_a_dip_saves_keeps_the_replica() -> None:
    arrivals = np.array([120.0, 60.0, 120.0])  # 2, 1, 2 req/s
    missed = misses(TABLE, arrivals=arrivals, interval_s=60.0, sizes=[1, 2])
    free = schedule(missed, arrivals=arrivals, sizes=[1, 2], startup_intervals=0.0, price=10.0)
    assert free.sizes.tolist() == [2, 1, 2]
    # restarting the second engine costs 3 intervals, more than the one interval the dip saves
    held = schedule(missed, arrivals=arrivals, sizes=[1, 2], startup_intervals=3.0, price=10.0)
    assert held.sizes.tolist() == [2, 2, 2]
    assert held.added == 0
    assert held.replica_intervals == pytest.approx(6.0)


def test_only_added_replicas_pay_a_start_up() -> None:
    arrivals = np.array([60.0, 120.0, 60.0])  # 1, 2, 1 req/s
    missed = misses(TABLE, arrivals=arrivals, interval_s=60.0, sizes=[1, 2])
    # the second engine is worth its start-up at a high price: started once, dropped for free
    plan = schedule(missed, arrivals=arrivals, sizes=[1, 2], startup_intervals=1.0, price=1.0)
    assert plan.sizes.tolist() == [1, 2, 1]
    assert plan.added == 1
    assert plan.replica_intervals == pytest.approx(4.0 + 1.0)
    # a fleet that starts large pays nothing for its first interval and nothing to shrink
    start_high = schedule(missed[1:], arrivals=arrivals[1:], sizes=[1, 2], startup_intervals=5.0, price=1.0)
    assert start_high.sizes.tolist() == [2, 1]
    assert start_high.replica_intervals == pytest.approx(3.0)


def test_a_schedule_refuses_mismatched_or_empty_input() -> None:
    arrivals = np.array([60.0, 60.0])
    missed = misses(TABLE, arrivals=arrivals, interval_s=60.0, sizes=[1, 2])
    with pytest.raises(ValueError, match="shape"):
        schedule(missed, arrivals=arrivals, sizes=[1], startup_intervals=0.0, price=1.0)
    with pytest.raises(ValueError, match="no arrivals"):
        schedule(missed * 0, arrivals=arrivals * 0, sizes=[1, 2], startup_intervals=0.0, price=1.0)
    with pytest.raises(ValueError, match="at least 2 points"):
        rate_grid(np.array([1.0]), points=1)


def test_the_cheapest_schedule_reaching_the_goal_and_none_beyond_the_largest_fleet() -> None:
    arrivals = np.array([60.0, 240.0, 60.0, 60.0])
    sizes = [1, 2, 3]
    missed = misses(TABLE, arrivals=arrivals, interval_s=60.0, sizes=sizes)
    loose = cheapest(missed, arrivals=arrivals, sizes=sizes, startup_intervals=0.0, goal=0.5)
    assert loose is not None
    assert loose.sizes.tolist() == [1, 1, 1, 1]
    tight = cheapest(missed, arrivals=arrivals, sizes=sizes, startup_intervals=0.0, goal=0.95)
    assert tight is not None
    assert tight.attainment >= 0.95
    assert tight.sizes.tolist() == [1, 3, 1, 1]
    assert cheapest(missed, arrivals=arrivals, sizes=sizes, startup_intervals=0.0, goal=0.999) is None


def test_the_walk_skips_saturated_rates_and_those_where_an_engine_no_longer_helps() -> None:
    grid = rate_grid(np.array([1.04, 2.0, 9.0]), points=9)
    assert grid == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    assert rates_to_measure({}, size=1, grid=grid) == grid
    # 1 engine falls below 50 % at 3 req/s: 2 engines measured up to one step past 6 req/s
    assert rates_to_measure({1: [(1.0, 0.99), (3.0, 0.4)]}, size=2, grid=grid) == grid[:7]
    # at 1 req/s the second engine gained nothing over the first: the third is not measured there
    measured = {1: [(1.0, 0.99), (2.0, 0.9)], 2: [(1.0, 0.9905), (2.0, 0.99)]}
    assert rates_to_measure(measured, size=3, grid=grid) == grid[1:]
    # rates the smaller size reached and the one below it did not are measured (the knee), and
    # rates the smaller size skipped as converged stay skipped
    measured = {
        2: [(2.0, 0.99), (3.0, 0.9), (4.0, 0.4)],
        3: [(2.0, 0.9905), (3.0, 0.97), (5.0, 0.8), (6.0, 0.3)],
    }
    assert rates_to_measure(measured, size=4, grid=grid) == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]


def test_the_knee_is_measured_finer_and_noise_on_the_floor_or_past_saturation_is_not() -> None:
    measured = [(1.0, 0.997), (2.0, 0.995), (3.0, 0.98), (4.0, 0.85), (5.0, 0.3)]
    # 1-2 differ by noise, 4-5 lie past the floor: only 2-3 and 3-4 are halved
    assert refinements(measured) == [2.5, 3.5]
    assert refinements(sorted([*measured, (2.5, 0.991), (3.5, 0.95)])) == [2.75, 3.25, 3.75]
