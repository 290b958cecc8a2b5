"""The scheduler against the exact optimum on small random clusters."""

from __future__ import annotations

import pytest

from copse.placement import WORKER, CostModel, PlacementRequest, plan, pool
from copse.placement.engine import Engine
from copse.placement.exact import SearchTooLarge, exact_plan, random_instance
from copse.topology import build_topology, fake


def unplaced_gpus(request: PlacementRequest, keys: set[tuple[str, int]]) -> int:
    return sum(group.gpus for group in request.groups if group.key in keys)


def test_exact_finds_the_packing_best_fit_one_group_at_a_time_misses() -> None:
    # Domain A has 12 usable GPUs, domain B 16; four 4-GPU groups fill B exactly.
    nodes = fake.gpu_nodes(racks=2, trays_per_rack=4, cordoned=1)
    topology = build_topology(nodes)
    request = PlacementRequest(groups=pool(role=WORKER, replicas=4, tensor_parallelism=4))
    exact = exact_plan(topology, request)
    assert {group.rack for group in exact.groups} == {fake.rack_uuid(1)}
    assert plan(topology, request).total_cost == pytest.approx(exact.total_cost)


def test_exact_search_refuses_instances_that_are_too_large() -> None:
    topology = build_topology(fake.gpu_nodes(racks=4, trays_per_rack=6))
    request = PlacementRequest(groups=pool(role=WORKER, replicas=6, tensor_parallelism=4))
    with pytest.raises(SearchTooLarge):
        exact_plan(topology, request, max_branches=1000)


def test_scheduler_is_within_two_percent_of_the_optimum_on_random_clusters() -> None:
    gaps = []
    for seed in range(60):
        nodes, pods, request = random_instance(seed)
        topology = build_topology(nodes, pods=pods)
        greedy, exact = plan(topology, request), exact_plan(topology, request)
        greedy_left = unplaced_gpus(request, {u.key for u in greedy.unplaced})
        exact_left = unplaced_gpus(request, {u.key for u in exact.unplaced})
        assert greedy_left == exact_left, seed  # as many GPUs placed as possible
        assert greedy.total_cost >= exact.total_cost - 1e-6, seed  # the optimum is a lower bound
        # Relative to the cost of the final state (fragmentation counted in full, so >= 0).
        baseline = Engine(topology, request, CostModel()).fragmentation_level()
        gaps.append((greedy.total_cost - exact.total_cost) / (exact.total_cost + baseline))
    assert sum(gaps) / len(gaps) <= 0.02
