"""The exact optimum of the placement cost on small clusters, to measure the scheduler against.

Depth-first branch and bound over every feasible placement of every group: in every domain
every subset of nodes that fits the group's pods (and, when the policy allows it, every
multi-domain subset), plus "leave it unplaced". Groups of the same shape are interchangeable,
so their options are taken in non-decreasing order; a branch stops when even the cheapest
completion (ideal all-reduce, the largest possible fragmentation refund) cannot beat the best
leaf. The objective is lexicographic: most GPUs placed (as the scheduler, which places the
largest groups first), then least total cost. A leaf is
valid only if no group spans NVLink domains while one domain could hold it in the final state
(the rule the scheduler guarantees), so both search the same space.

Exponential by nature: for tests and benchmarks on a dozen nodes, never for real clusters.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass
from typing import Any

from copse.placement.cost import CostModel
from copse.placement.engine import Engine, PodChoice
from copse.placement.model import (
    DECODE,
    PREFILL,
    WORKER,
    ExpertParallel,
    GroupPlacement,
    GroupRequest,
    PlacementRequest,
    Plan,
    Pod,
    pool,
)
from copse.placement.scheduler import evaluate
from copse.topology import fake
from copse.topology.graph import Topology


class SearchTooLarge(ValueError):
    """The instance has more branches than the search is allowed to visit."""


def _options(engine: Engine, group: GroupRequest) -> list[PodChoice]:
    view = engine.view(group)
    sizes = engine.pod_sizes(group.gpus)
    options: list[PodChoice] = []
    for cell, members in enumerate(engine.cell_nodes):
        pod_gpus = int(sizes[engine.cell_product[cell]])
        nodes = [int(i) for i in members if view.eligible[i] and engine.free[i] >= pod_gpus]
        for combo in itertools.combinations(nodes, group.gpus // pod_gpus):
            options.append([(node, pod_gpus) for node in combo])
    if not engine.request.same_domain:
        for product, size in enumerate(sizes):
            pod_gpus = int(size)
            nodes = [
                i
                for i in range(len(engine.names))
                if view.eligible[i] and engine.node_product[i] == product and engine.free[i] >= pod_gpus
            ]
            for combo in itertools.combinations(nodes, group.gpus // pod_gpus):
                if len({int(engine.cell_of[node]) for node in combo}) > 1:
                    options.append([(node, pod_gpus) for node in combo])
    return options


def _fragmentation_floor(engine: Engine, group: GroupRequest) -> float:
    """The most a group's placement can lower the fragmentation terms (a lower bound, <= 0)."""
    model = engine.model
    best = 0.0
    sizes = engine.pod_sizes(group.gpus)
    for cell in range(engine.n_cells):
        capacity = float(engine.cell_cap[cell])
        if capacity < group.gpus:
            continue
        pod_gpus = float(sizes[engine.cell_product[cell]])
        per_node = float(engine.product_cap[engine.cell_product[cell]])
        # Filling a cell (node) exactly: W drops by g (c - g) / c.
        cell_refund = group.gpus * (capacity - group.gpus) / capacity
        node_refund = (group.gpus / pod_gpus) * pod_gpus * (per_node - pod_gpus) / per_node
        best = min(
            best,
            -model.domain_fragmentation_us * cell_refund - model.node_fragmentation_us * node_refund,
        )
    return best


@dataclass
class _Best:
    unplaced: int
    """GPUs of the groups left unplaced."""
    cost: float
    assignment: dict[tuple[str, int], PodChoice]


def exact_plan(
    topology: Topology,
    request: PlacementRequest,
    *,
    model: CostModel | None = None,
    max_branches: int = 2_000_000,
) -> Plan:
    """The assignment of least total cost among those placing the most groups."""
    model = model or CostModel()
    engine = Engine(topology, request, model)
    by_shape: dict[tuple[Any, ...], list[GroupRequest]] = {}
    for group in request.groups:
        by_shape.setdefault(group.shape, []).append(group)
    groups = [group for members in by_shape.values() for group in members]
    options = [_options(engine, group) for group in groups]
    comms = [
        [engine.comm(group, choice) for choice in opts] for group, opts in zip(groups, options, strict=True)
    ]
    floors = [
        (min(costs) if costs else 0.0) + _fragmentation_floor(engine, group)
        for group, costs in zip(groups, comms, strict=True)
    ]
    suffix = [0.0] * (len(groups) + 1)
    for i in range(len(groups) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + floors[i]

    best = _Best(unplaced=sum(group.gpus for group in groups) + 1, cost=float("inf"), assignment={})
    chosen: dict[tuple[str, int], PodChoice] = {}
    branches = 0

    def valid_leaf() -> bool:
        for key, choice in list(chosen.items()):
            if len({int(engine.cell_of[node]) for node, _ in choice}) == 1:
                continue
            placed = engine.remove(key)
            fits_one_domain = bool(engine.cell_terms(placed.group).feasible.any())
            engine.add(placed.group, choice)
            if fits_one_domain:
                return False
        return True

    def search(i: int, start: int, unplaced: int, partial: float) -> None:
        nonlocal branches
        branches += 1
        if branches > max_branches:
            raise SearchTooLarge(f"more than {max_branches} branches; use a smaller instance")
        if unplaced > best.unplaced:
            return
        if unplaced == best.unplaced and partial + suffix[i] >= best.cost - 1e-9:
            return
        if i == len(groups):
            if not valid_leaf():
                return
            kv = 0.0
            for placed in engine.placed.values():
                nearest = engine.nearest_counterpart(placed)
                kv += engine.kv_of(nearest) if nearest is not None else 0.0
            total = partial + kv
            if (unplaced, total) < (best.unplaced, best.cost - 1e-9):
                best.unplaced, best.cost, best.assignment = unplaced, total, dict(chosen)
            return
        group = groups[i]
        same_next = i + 1 < len(groups) and groups[i + 1].shape == group.shape
        for index in range(start, len(options[i])):
            choice = options[i][index]
            if any(engine.free[node] < gpus for node, gpus in choice):
                continue
            step = (
                comms[i][index] + engine.spread_delta(group, choice) + engine.fragmentation_delta(choice, +1)
            )
            engine.add(group, choice)
            chosen[group.key] = choice
            search(i + 1, index if same_next else 0, unplaced, partial + step)
            del chosen[group.key]
            engine.remove(group.key)
        # Leaving it unplaced sorts after every option, so identical groups after it stay unplaced too.
        skip = len(options[i])
        search(i + 1, skip if same_next else 0, unplaced + group.gpus, partial)

    search(0, 0, 0, 0.0)
    placements = [
        GroupPlacement(
            role=role,
            replica=replica,
            pods=tuple(Pod(node=engine.names[node], gpus=gpus) for node, gpus in choice),
        )
        for (role, replica), choice in best.assignment.items()
    ]
    reasons = {
        group.key: "left unplaced by the exact optimum"
        for group in groups
        if group.key not in best.assignment
    }
    return evaluate(topology, request, placements, model=model, reasons=reasons)


def random_instance(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], PlacementRequest]:
    """A small random cluster (nodes, pods holding GPUs) and request, exact-solvable in seconds.

    2-3 racks, 1-2 NVLink partitions per rack, 2-4 trays of 4 GPUs per partition, some trays
    cordoned and some GPUs taken by other pods; 2-4 groups, aggregated or disaggregated,
    TP 2-8, sometimes PP 2; affinity and spread policies vary. About a third are Mixture-of-
    Experts groups (DeepSeek-V3's top-8 of hidden 7168; wide EP or EP = TP / 2, attention data
    parallel or not), drawn from a stream of their own so the other instances stay as they were.
    """
    rng = random.Random(seed)
    cliques = rng.choice([1, 1, 2])
    trays = cliques * rng.randint(2, 4 if cliques == 1 else 2)
    racks = rng.randint(2, 3)
    nodes = fake.gpu_nodes(
        racks=racks,
        trays_per_rack=trays,
        gpus_per_tray=4,
        cordoned=rng.randint(0, 1),
        cliques_per_rack=cliques,
        racks_per_block=2,
    )
    pods = fake.busy_pods(nodes, fraction=rng.choice([0.0, 0.2, 0.4]), seed=seed)
    same_domain = rng.random() < 0.75
    spread = rng.random() < 0.5
    if rng.random() < 0.35:
        prefill_tp = rng.choice([2, 4])
        decode_tp = rng.choice([4, 8])
        groups = pool(role=PREFILL, replicas=rng.randint(1, 2), tensor_parallelism=prefill_tp) + pool(
            role=DECODE, replicas=rng.randint(1, 2), tensor_parallelism=decode_tp
        )
    else:
        tp = rng.choice([2, 4, 4, 8, 8])
        pp = 2 if tp <= 4 and rng.random() < 0.25 else 1
        groups = pool(role=WORKER, replicas=rng.randint(2, 4), tensor_parallelism=tp, pipeline_parallelism=pp)
    moe_rng = random.Random(f"moe-{seed}")
    if moe_rng.random() < 0.35:
        layouts = {
            (role, tp): ExpertParallel(
                ranks=tp if tp < 4 or moe_rng.random() < 0.7 else tp // 2,
                experts_per_token=8,
                hidden_size=7168,
                attention_data_parallel=moe_rng.random() < 0.5,
            )
            for role, tp in sorted({(g.role, g.tensor_parallelism) for g in groups})
        }
        groups = tuple(dataclasses.replace(g, moe=layouts[g.role, g.tensor_parallelism]) for g in groups)
    return nodes, pods, PlacementRequest(groups=groups, same_domain=same_domain, spread_racks=spread)
