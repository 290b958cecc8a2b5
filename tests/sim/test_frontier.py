"""The static frontier: interpolation at equal attainment and equal cost, the size walk, flapping."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from copse.api import Role
from copse.sim.frontier import Frontier, StaticPoint, search, static_pools
from copse.sim.twin import ScalingChange, flaps

# attainment by static size: grows with the size, 3 replicas cost 3 GPU-hours
ATTAINMENT = {1: 0.40, 2: 0.80, 3: 0.95, 4: 0.99, 5: 0.995, 6: 0.999, 7: 0.9995}


def _point(n: int) -> StaticPoint:
    return StaticPoint(replicas=n, slo_attainment=ATTAINMENT[n], gpu_hours=float(n))


def test_ratio_at_equal_attainment_interpolates_between_neighbouring_sizes() -> None:
    frontier = Frontier(static=tuple(_point(n) for n in (2, 3, 4, 5)), goal=0.99)
    assert frontier.first_meeting_goal == _point(4)
    # 0.97 lies halfway between 3 (0.95) and 4 (0.99): 3.5 GPU-hours
    assert frontier.static_gpu_hours_at(0.97) == pytest.approx(3.5)
    assert frontier.ratio_at_equal_attainment(attainment=0.97, gpu_hours=2.1) == pytest.approx(0.6)
    # at 3.5 GPU-hours a static fleet reaches 0.97
    assert frontier.static_attainment_at(3.5) == pytest.approx(0.97)
    # beyond the sizes simulated: no comparison rather than an extrapolation
    assert frontier.ratio_at_equal_attainment(attainment=0.9999, gpu_hours=2.0) is None
    assert frontier.static_attainment_at(9.0) is None
    document = frontier.as_json(attainment=0.97, gpu_hours=2.1)
    assert document["first_meeting_goal"] == 4
    assert document["ratio_vs_first_meeting_goal"] == pytest.approx(2.1 / 4.0)


def test_given_static_fleets_keep_only_those_no_cheaper_fleet_attains_as_much_as() -> None:
    def split(prefill: int, decode: int, attainment: float) -> StaticPoint:
        return StaticPoint(
            replicas=prefill + decode,
            slo_attainment=attainment,
            gpu_hours=float(prefill + decode),
            pools={"prefill": prefill, "decode": decode},
        )

    # 3+2 costs what 4+1 costs and attains less; 5+1 costs more than 4+2 for the same attainment
    fleets = [split(4, 2, 0.999), split(3, 2, 0.97), split(3, 1, 0.5), split(4, 1, 0.99), split(5, 1, 0.999)]
    frontier = Frontier.efficient(fleets, goal=0.99)
    assert frontier.static == (split(3, 1, 0.5), split(4, 1, 0.99), split(4, 2, 0.999))
    assert frontier.first_meeting_goal == split(4, 1, 0.99)
    # halfway between 3+1 and 4+1 in attainment: halfway in GPU-hours (the dominated 3+2 plays no part)
    assert frontier.static_gpu_hours_at(0.745) == pytest.approx(4.5)


def test_the_walk_covers_the_sizes_from_below_both_bars_to_above_both() -> None:
    batches: list[list[int]] = []

    def simulate(sizes: Sequence[int]) -> list[StaticPoint]:
        batches.append(list(sizes))
        return [_point(n) for n in sizes]

    frontier = search(simulate, start=5, low_bar=0.97, high_bar=0.999, max_replicas=7, width=2)
    assert [p.replicas for p in frontier.static] == [3, 4, 5, 6]  # 3 misses 0.97, 6 reaches 0.999
    assert batches[0] == [5, 6]
    assert all(len(batch) <= 2 for batch in batches)
    # bounded by 1 replica and by max_replicas
    low = search(simulate, start=2, low_bar=0.1, high_bar=0.9, max_replicas=7, width=1)
    assert [p.replicas for p in low.static] == [1, 2, 3]
    high = search(simulate, start=6, low_bar=0.99, high_bar=0.99999, max_replicas=7, width=2)
    # walking down two at a time (5 and 4 reach 0.99, then 3 and 2 run together) may run one size past the end
    assert [p.replicas for p in high.static] == [2, 3, 4, 5, 6, 7]


def test_flapping_is_an_increase_a_decrease_and_an_increase_within_the_scale_down_delay() -> None:
    def change(t: float, before: int, after: int, role: str = "worker") -> ScalingChange:
        return ScalingChange(time_s=t, role=role, before=before, after=after, trigger="forecast")

    flapping = [change(0, 2, 3), change(120, 3, 2), change(240, 2, 3)]
    assert flaps(flapping, window_s=300.0) == 1
    assert flaps(flapping, window_s=200.0) == 0  # the second increase comes too late to count
    assert flaps([change(0, 2, 3), change(60, 3, 4), change(600, 4, 3)], window_s=300.0) == 0
    # pools are judged apart
    mixed = [change(0, 2, 3, "prefill"), change(60, 3, 2, "decode"), change(120, 2, 3, "prefill")]
    assert flaps(mixed, window_s=300.0) == 0


def test_a_disaggregated_static_size_walks_the_larger_pool_in_the_planners_proportion() -> None:
    split = {Role.PREFILL: 5.1, Role.DECODE: 1.3}
    roles = (Role.PREFILL, Role.DECODE)
    assert static_pools(5, roles=roles, split=split) == {Role.PREFILL: 5, Role.DECODE: 1}
    assert static_pools(8, roles=roles, split=split) == {Role.PREFILL: 8, Role.DECODE: 2}
    assert static_pools(3, roles=(Role.WORKER,), split={Role.WORKER: 2.0}) == {Role.WORKER: 3}


def test_the_walk_stops_climbing_when_larger_fleets_serve_worse() -> None:
    falling = {1: 0.90, 2: 0.995, 3: 0.99, 4: 0.985, 5: 0.98, 6: 0.97}

    def simulate(sizes: Sequence[int]) -> list[StaticPoint]:
        return [StaticPoint(replicas=n, slo_attainment=falling[n], gpu_hours=float(n)) for n in sizes]

    frontier = search(simulate, start=2, low_bar=0.95, high_bar=0.999, max_replicas=6, width=1)
    assert [p.replicas for p in frontier.static] == [1, 2, 3]
