"""Placement quality: copse's scheduler (min-cost) and a first-fit baseline against the exact
optimum, side by side, on many small random clusters (``copse.placement.exact.random_instance``:
2-3 racks, 1-2 NVLink partitions per rack, 2-4 trays of 4 GPUs each, some trays cordoned,
some GPUs taken by other pods; aggregated or disaggregated requests of 2-4 groups, TP 2-8,
sometimes PP 2, about a third Mixture-of-Experts groups whose cost has the all-to-all term,
policies varied).

Gap = (strategy cost - optimal cost) / cost of the optimal final state, where the final state's
cost counts fragmentation in full (so it is >= 0); only instances where the strategy placed as
many GPUs as the optimum are comparable, the others are counted apart. Also checked on every
instance: no group spans NVLink domains while one domain could hold it.

    .venv/bin/python benchmarks/placement_quality.py [--instances 400] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import time

from copse.placement import STRATEGIES, CostModel, PlacementRequest, Plan, plan
from copse.placement.engine import Engine
from copse.placement.exact import exact_plan, random_instance
from copse.topology import Topology, build_topology


def _unplaced_gpus(request: PlacementRequest, result: Plan) -> int:
    keys = {item.key for item in result.unplaced}
    return sum(group.gpus for group in request.groups if group.key in keys)


def _needless_splits(topology: Topology, request: PlacementRequest, result: Plan) -> int:
    """Groups spanning domains although one domain could hold them in the final state."""
    engine = Engine(topology, request, CostModel())
    groups = {group.key: group for group in request.groups}
    for placement in result.placements():
        engine.add(groups[placement.key], [(engine.index[pod.node], pod.gpus) for pod in placement.pods])
    count = 0
    for group in result.groups:
        if group.domain is None:
            removed = engine.remove(group.key)
            count += bool(engine.cell_terms(removed.group).feasible.any())
            engine.add(removed.group, list(zip(removed.nodes, removed.gpus, strict=True)))
    return count


def _row(label: str, values: list[float], fewer: int | None, splits: int | None, millis: float | None) -> str:
    ordered = sorted(values)
    p95 = ordered[int(0.95 * (len(ordered) - 1))]
    optimal = sum(gap < 1e-9 for gap in ordered) / len(ordered)
    return (
        f"{label:<32} {len(ordered):>5} {statistics.fmean(ordered):>8.2%} {statistics.median(ordered):>8.2%} "
        f"{p95:>8.2%} {ordered[-1]:>8.2%} {optimal:>8.1%} {'' if fewer is None else fewer:>10} "
        f"{'' if splits is None else splits:>15} {'' if millis is None else f'{millis:.2f}':>11}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0, help="first instance seed")
    args = parser.parse_args()

    policies = ("same-nvswitch-domain", "none")
    gaps: dict[tuple[str, str], list[float]] = {(n, p): [] for n in STRATEGIES for p in policies}
    moe_gaps: dict[str, list[float]] = {n: [] for n in STRATEGIES}
    fewer: dict[str, int] = dict.fromkeys(STRATEGIES, 0)
    splits: dict[str, int] = dict.fromkeys(STRATEGIES, 0)
    seconds: dict[str, float] = dict.fromkeys([*STRATEGIES, "exact"], 0.0)
    for seed in range(args.seed, args.seed + args.instances):
        nodes, pods, request = random_instance(seed)
        topology = build_topology(nodes, pods=pods)
        policy = policies[0] if request.same_domain else policies[1]
        start = time.perf_counter()
        optimum = exact_plan(topology, request)
        seconds["exact"] += time.perf_counter() - start
        baseline = Engine(topology, request, CostModel()).fragmentation_level()
        for name in STRATEGIES:
            start = time.perf_counter()
            result = plan(topology, request, strategy=name)
            seconds[name] += time.perf_counter() - start
            splits[name] += _needless_splits(topology, request, result)
            if _unplaced_gpus(request, result) > _unplaced_gpus(request, optimum):
                fewer[name] += 1
                continue
            final = optimum.total_cost + baseline
            gap = (result.total_cost - optimum.total_cost) / final if final > 0 else 0.0
            gaps[name, policy].append(max(gap, 0.0))  # rounding noise only: the optimum is a lower bound
            if any(group.moe is not None for group in request.groups):
                moe_gaps[name].append(max(gap, 0.0))

    print(f"{args.instances} random instances (seeds {args.seed}..{args.seed + args.instances - 1})")
    print(
        f"{'strategy / affinityPolicy':<32} {'n':>5} {'mean gap':>8} {'median':>8} {'p95':>8} {'max':>8} "
        f"{'optimal':>8} {'fewer GPUs':>10} {'needless splits':>15} {'ms/instance':>11}"
    )
    for name in STRATEGIES:
        everything = [gap for policy in policies for gap in gaps[name, policy]]
        millis = 1000 * seconds[name] / args.instances
        print(_row(f"{name} / all", everything, fewer[name], splits[name], millis))
        for policy in policies:
            print(_row(f"  {policy}", gaps[name, policy], None, None, None))
        print(_row("  MoE groups (all-to-all)", moe_gaps[name], None, None, None))
    print(f"exact: {1000 * seconds['exact'] / args.instances:.2f} ms/instance")
    ratios = ", ".join(
        f"{name} {1 + statistics.fmean([g for p in policies for g in gaps[name, p]]):.3f}x"
        for name in STRATEGIES
    )
    print(f"mean final-state cost relative to the optimum: {ratios}")


if __name__ == "__main__":
    main()
