"""The gang scheduler: place whole TP groups, score the result, pick scale-down victims.

Groups are placed largest first (ties in request order). For each group the ``min-cost``
strategy computes the exact cost change of putting it into every (NVLink domain, product)
cell at once and takes the cheapest; only when no single domain can hold it, and the policy
allows, does it span domains, and then over the narrowest tier that has room (one rack, one
block, anywhere). A group is therefore never split while one domain could hold it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from copse.placement.cost import CostModel, waste
from copse.placement.engine import Engine, PodChoice
from copse.placement.explain import explain
from copse.placement.model import (
    DECODE,
    PREFILL,
    GroupCost,
    GroupKey,
    GroupPlacement,
    GroupRequest,
    PlacedGroup,
    PlacementRequest,
    Plan,
    Pod,
    Unplaced,
)
from copse.topology.graph import Topology
from copse.topology.kube import NODE_CONDITION_TAINTS, tolerated
from copse.topology.links import LinkTier

Strategy = Callable[[Engine, GroupRequest], PodChoice | None]
"""Chooses pods for one group in the engine's current state, or None when it fits nowhere."""

SPAN_CANDIDATES = 8
IMPROVE_PASSES = 3
"""Rounds of single-group moves after the greedy pass; each round stops early when nothing moves."""
"""Multi-domain candidates whose exact cost is computed per tier (cheapest by a quick proxy)."""


def _spanning(engine: Engine, group: GroupRequest, *, best: bool) -> PodChoice | None:
    """The group across NVLink domains, inside the narrowest tier (rack, block, all) with room.

    Inside a scope, the domains with the most fitting nodes go first (fewest domains), and
    within a domain the fullest nodes that fit a pod (best fit).
    """
    view = engine.view(group)
    sizes = engine.pod_sizes(group.gpus)
    scopes = {LinkTier.RACK: engine.node_rack, LinkTier.BLOCK: engine.node_block}
    for tier in (LinkTier.RACK, LinkTier.BLOCK, LinkTier.BEYOND):
        candidates: list[tuple[tuple[int, int], PodChoice]] = []
        for product, size in enumerate(sizes):
            pod_gpus = int(size)
            pods = group.gpus // pod_gpus
            fitting = np.flatnonzero(
                view.eligible & (engine.node_product == product) & (engine.free >= pod_gpus)
            )
            if len(fitting) < pods:
                continue
            scope_of = scopes[tier][fitting] if tier in scopes else np.zeros(len(fitting), dtype=np.int64)
            for scope in np.unique(scope_of):
                members = fitting[scope_of == scope]
                if len(members) < pods:
                    continue
                by_cell: dict[int, list[int]] = {}
                for node in members:
                    by_cell.setdefault(int(engine.cell_of[node]), []).append(int(node))
                order = sorted(by_cell, key=lambda cell: (-len(by_cell[cell]), cell))
                chosen: list[int] = []
                for cell in order:
                    nodes = (
                        sorted(by_cell[cell], key=lambda i: (int(engine.free[i]), i))
                        if best
                        else by_cell[cell]
                    )
                    chosen.extend(nodes[: pods - len(chosen)])
                    if len(chosen) == pods:
                        break
                leftover = int(sum(int(engine.free[node]) - pod_gpus for node in chosen))
                cells_used = len({int(engine.cell_of[node]) for node in chosen})
                candidates.append(((cells_used, leftover), [(node, pod_gpus) for node in chosen]))
        if candidates:
            if not best:
                return candidates[0][1]
            candidates.sort(key=lambda item: item[0])
            shortlist = [choice for _, choice in candidates[:SPAN_CANDIDATES]]
            return min(shortlist, key=lambda choice: engine.marginal(group, choice))
    return None


def min_cost(engine: Engine, group: GroupRequest) -> PodChoice | None:
    """The cheapest cell by exact marginal cost (best fit, spread, KV distance together)."""
    terms = engine.cell_terms(group)
    if terms.feasible.any():
        delta = (
            terms.comm
            + terms.fragmentation
            + engine.kv_delta_cells(group)
            + engine.spread_cells(group)
            + engine.partner_lookahead(group, terms)
        )
        cell = int(np.argmin(np.where(terms.feasible, delta, np.inf)))
        pod_gpus, pods = int(terms.pod_gpus[cell]), int(terms.pods[cell])
        return [(node, pod_gpus) for node in engine.best_nodes(group, cell, pod_gpus, pods)]
    if engine.request.same_domain:
        return None
    return _spanning(engine, group, best=True)


def first_fit(engine: Engine, group: GroupRequest) -> PodChoice | None:
    """The baseline a plain scheduler gives: the first domain (and nodes) in name order that fit."""
    terms = engine.cell_terms(group)
    if terms.feasible.any():
        cell = int(np.argmax(terms.feasible))
        pod_gpus, pods = int(terms.pod_gpus[cell]), int(terms.pods[cell])
        eligible = engine.view(group).eligible
        nodes = [int(i) for i in engine.cell_nodes[cell] if eligible[i] and engine.free[i] >= pod_gpus]
        return [(node, pod_gpus) for node in nodes[:pods]]
    if engine.request.same_domain:
        return None
    return _spanning(engine, group, best=False)


STRATEGIES: dict[str, Strategy] = {"min-cost": min_cost, "first-fit": first_fit}
"""Placement strategies by name; ``min-cost`` is copse's, ``first-fit`` the comparison baseline."""


def _choice(engine: Engine, placement: GroupPlacement) -> PodChoice:
    choice = []
    for pod in placement.pods:
        if pod.node not in engine.index:
            raise ValueError(
                f"group {placement.role}-{placement.replica}: "
                f"node {pod.node!r} is not a GPU node of the topology"
            )
        choice.append((engine.index[pod.node], pod.gpus))
    return choice


def _requested(
    request: PlacementRequest, placements: Sequence[GroupPlacement]
) -> dict[GroupKey, GroupRequest]:
    groups = {group.key: group for group in request.groups}
    for placement in placements:
        if placement.key not in groups:
            raise ValueError(f"group {placement.role}-{placement.replica} is placed but not in the request")
    return groups


def plan(
    topology: Topology,
    request: PlacementRequest,
    *,
    existing: Sequence[GroupPlacement] = (),
    model: CostModel | None = None,
    strategy: str = "min-cost",
) -> Plan:
    """Place every requested group that ``existing`` does not already place.

    ``existing`` are groups of this deployment that stay where they are (scale-up keeps the
    running groups); ``topology`` must not count their GPUs as used. Every placement is whole;
    groups that fit nowhere are listed in ``Plan.unplaced`` with the reason.
    """
    model = model or CostModel()
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r}; known: {sorted(STRATEGIES)}")
    choose = STRATEGIES[strategy]
    groups = _requested(request, existing)
    engine = Engine(topology, request, model)
    for placement in existing:
        engine.add(groups[placement.key], _choice(engine, placement))
    missing = [group for group in request.groups if group.key not in engine.placed]
    # Largest first; among equals, roles take turns (prefill 0, decode 0, prefill 1, ...) so
    # that a short cluster does not end up with one role only.
    rank: dict[GroupKey, int] = {}
    seen: dict[str, int] = {}
    for group in missing:
        rank[group.key] = seen.get(group.role, 0)
        seen[group.role] = rank[group.key] + 1
    position = {group.key: i for i, group in enumerate(request.groups)}
    order = sorted(missing, key=lambda g: (-g.gpus, rank[g.key], position[g.key]))
    recipes = _recipes(engine, order) if strategy == "min-cost" else [[]]
    if len(recipes) == 1:
        reasons = _run(engine, order, recipes[0], choose, improve=strategy == "min-cost")
    else:
        outcomes = []
        for bundles in recipes:
            outcome_reasons = _run(engine, order, bundles, choose, improve=True)
            chosen = {
                key: list(zip(engine.placed[key].nodes, engine.placed[key].gpus, strict=True))
                for key in (group.key for group in order)
                if key in engine.placed
            }
            unplaced_gpus = sum(group.gpus for group in order if group.key not in chosen)
            outcomes.append(((unplaced_gpus, engine.objective()), chosen, outcome_reasons))
            for key in chosen:
                engine.remove(key)
        _, chosen, reasons = min(outcomes, key=lambda outcome: outcome[0])
        for group in order:
            if group.key in chosen:
                engine.add(group, chosen[group.key])
    placements = [
        GroupPlacement(
            role=placed.group.role,
            replica=placed.group.replica,
            pods=tuple(
                Pod(node=engine.names[node], gpus=gpus)
                for node, gpus in zip(placed.nodes, placed.gpus, strict=True)
            ),
        )
        for placed in engine.placed.values()
    ]
    return evaluate(topology, request, placements, model=model, reasons=reasons)


def _run(
    engine: Engine,
    order: Sequence[GroupRequest],
    bundles: Sequence[Sequence[GroupRequest]],
    choose: Strategy,
    *,
    improve: bool,
) -> dict[GroupKey, str]:
    """Place ``bundles`` (each whole into one domain, when one fits it), then the rest one by
    one in ``order``; returns why groups stayed unplaced."""
    engine.pending = {}
    for group in order:
        engine.pending.setdefault(group.role, {})[group.key] = group
    for whole in bundles:
        # A bundle that fits no domain is shrunk from its end (fewer prefill groups per decode).
        for size in range(len(whole), 1, -1):
            cell = _bundle_cell(engine, whole[:size])
            if cell is not None:
                break
        if cell is None:
            continue
        for group in whole[:size]:
            del engine.pending[group.role][group.key]
            terms = engine.cell_terms(group)
            pod_gpus, pods = int(terms.pod_gpus[cell]), int(terms.pods[cell])
            nodes = engine.best_nodes(group, cell, pod_gpus, pods)
            engine.add(group, [(node, pod_gpus) for node in nodes])
    reasons: dict[GroupKey, str] = {}
    for group in order:
        if group.key in engine.placed:
            continue
        del engine.pending[group.role][group.key]
        choice = choose(engine, group)
        if choice is None:
            reasons[group.key] = explain(engine, group)
        else:
            engine.add(group, choice)
    if improve:
        _improve(engine, [group.key for group in order if group.key in engine.placed])
    return reasons


def _recipes(engine: Engine, order: Sequence[GroupRequest]) -> list[list[list[GroupRequest]]]:
    """Ways to seed the greedy pass, each tried from the same state; the cheapest result wins.

    Always: disaggregated bundles (decode + its prefill share). When they fit one domain:
    the whole request together, and each pool of identical groups together. Best fit one
    group at a time misses both (it breaks a small domain for the first group when a large
    one would have been filled exactly by all of them).
    """
    largest = float(engine.cell_cap.max()) if engine.n_cells else 0.0
    recipes = [_bundles(order)]
    if len(order) > 1 and sum(g.gpus for g in order) <= largest and len({g.eligibility for g in order}) == 1:
        recipes.append([list(order)])
    pools: dict[tuple[object, ...], list[GroupRequest]] = {}
    for group in order:
        pools.setdefault(group.shape, []).append(group)
    together = [pool for pool in pools.values() if len(pool) > 1 and sum(g.gpus for g in pool) <= largest]
    if together:
        recipes.append(together)
    return recipes


def _bundles(order: Sequence[GroupRequest]) -> list[list[GroupRequest]]:
    """Disaggregated serving: each decode group with its share of prefill groups, to be placed in
    one NVLink domain so their KV moves over NVLink. Largest bundles first."""
    decodes = [group for group in order if group.role == DECODE]
    prefills = [group for group in order if group.role == PREFILL]
    if not decodes or not prefills:
        return []
    bundles: list[list[GroupRequest]] = [[decode] for decode in decodes]
    for index, prefill in enumerate(prefills):
        bundles[index % len(bundles)].append(prefill)
    return sorted(
        (bundle for bundle in bundles if len(bundle) > 1 and len({g.eligibility for g in bundle}) == 1),
        key=lambda bundle: -sum(group.gpus for group in bundle),
    )


def _bundle_cell(engine: Engine, bundle: Sequence[GroupRequest]) -> int | None:
    costs = engine.bundle_costs(bundle)
    cell = int(np.argmin(costs))
    return cell if np.isfinite(costs[cell]) else None


def _improve(engine: Engine, keys: Sequence[GroupKey]) -> None:
    """Re-place each new group where it is cheapest now that all the others are down.

    Greedy placement is myopic (a decode group placed before the prefill groups cannot sit
    next to them); moving one group at a time, only when that lowers the total, fixes most of
    it. A group spanning domains moves into one domain whenever one can hold it, whatever
    the cost, so no group stays split while a single domain fits it.
    """
    for _ in range(IMPROVE_PASSES):
        moved = False
        for key in keys:
            placed = engine.remove(key)
            current = list(zip(placed.nodes, placed.gpus, strict=True))
            candidate = min_cost(engine, placed.group)
            spans = len({int(engine.cell_of[node]) for node in placed.nodes}) > 1
            if candidate is None or sorted(candidate) == sorted(current):
                engine.add(placed.group, current)
                continue
            consolidates = spans and len({int(engine.cell_of[node]) for node, _ in candidate}) == 1
            if (
                consolidates
                or engine.marginal(placed.group, candidate) < engine.marginal(placed.group, current) - 1e-9
            ):
                engine.add(placed.group, candidate)
                moved = True
            else:
                engine.add(placed.group, current)
        moved |= _swap_far_partners(engine, keys)
        if not moved:
            return


def _swap_far_partners(engine: Engine, keys: Sequence[GroupKey]) -> bool:
    """Swap a disaggregated group whose KV leaves its NVLink domain with a same-shaped group of
    the other role, when that lowers the total (a decode and a prefill each next to the wrong
    partner: neither single move helps, the exchange does)."""
    swapped = False
    for key in keys:
        placed = engine.placed.get(key)
        nearest = engine.nearest_counterpart(placed) if placed is not None else None
        if placed is None or nearest is None or nearest <= LinkTier.DOMAIN:
            continue
        for other_key in keys:
            other = engine.placed[other_key]
            if (
                other.group.role == placed.group.role
                or other.gpus != placed.gpus
                or other.group.eligibility != placed.group.eligibility
                or other.domains == placed.domains
            ):
                continue
            mine = list(zip(placed.nodes, placed.gpus, strict=True))
            theirs = list(zip(other.nodes, other.gpus, strict=True))
            engine.remove(other_key)
            before = engine.marginal(other.group, theirs)
            engine.remove(key)
            before += engine.marginal(placed.group, mine)
            after = engine.marginal(placed.group, theirs)
            engine.add(placed.group, theirs)
            after += engine.marginal(other.group, mine)
            if after < before - 1e-9:
                engine.add(other.group, mine)
                swapped = True
                break
            engine.remove(key)
            engine.add(placed.group, mine)
            engine.add(other.group, theirs)
    return swapped


def _spread_floor(groups: int, racks: int) -> float:
    """Fewest same-rack pairs ``groups`` groups can have over ``racks`` racks (spread evenly)."""
    racks = max(racks, 1)
    share, extra = divmod(groups, racks)
    return extra * (share + 1) * share / 2 + (racks - extra) * share * (share - 1) / 2


def evaluate(
    topology: Topology,
    request: PlacementRequest,
    placements: Sequence[GroupPlacement],
    *,
    model: CostModel | None = None,
    reasons: Mapping[GroupKey, str] | None = None,
) -> Plan:
    """Cost, score and unplaced list of a given assignment (the operator re-scores with it).

    ``reasons`` explains requested groups missing from ``placements``.
    """
    model = model or CostModel()
    groups = _requested(request, placements)
    engine = Engine(topology, request, model)

    # The best each group could get on its own, on the cluster as it was before this
    # deployment: all-reduce inside one domain, KV over NVLink, replicas spread evenly.
    role_sizes: dict[str, int] = {}
    for group in request.groups:
        role_sizes[group.role] = role_sizes.get(group.role, 0) + 1
    ideals: dict[tuple[object, ...], float] = {}
    for group in request.groups:
        if group.shape in ideals:
            continue
        view = engine.view(group)
        products = {int(p) for p in engine.node_product[view.eligible]}
        sizes = engine.pod_sizes(group.gpus)
        ideal = min((engine.single_domain_comm(group, int(sizes[p])) for p in products), default=0.0)
        if engine.kv_partner_role(group.role) is not None:
            ideal += engine.kv_of(LinkTier.DOMAIN)
        if request.spread_racks:
            feasible = engine.cell_terms(group).feasible
            racks = len({int(r) for r in engine.cell_rack[feasible]})
            ideal += model.spread_us * _spread_floor(role_sizes[group.role], racks) / role_sizes[group.role]
        ideals[group.shape] = ideal

    initial_node_free = np.clip(engine.free, 0, None).astype(np.float64)
    initial_cell_free = engine.cell_free.copy()
    for placement in placements:
        engine.add(groups[placement.key], _choice(engine, placement))

    node_share = np.zeros(len(engine.names))
    cell_share = np.zeros(engine.n_cells)
    for placed in engine.placed.values():
        for node, gpus in zip(placed.nodes, placed.gpus, strict=True):
            if engine.counted[node]:
                node_share[node] += gpus
        for cell, gpus in placed.cell_gpus.items():
            cell_share[cell] += gpus

    def node_change(node: int) -> float:
        capacity = float(engine.product_cap[engine.node_product[node]])
        return waste(float(max(engine.free[node], 0)), capacity) - waste(
            float(initial_node_free[node]), capacity
        )

    def cell_change(cell: int) -> float:
        capacity = float(engine.cell_cap[cell])
        return waste(float(engine.cell_free[cell]), capacity) - waste(
            float(initial_cell_free[cell]), capacity
        )

    placed_groups = []
    for group in request.groups:
        if group.key not in engine.placed:
            continue
        placed = engine.placed[group.key]
        choice = list(zip(placed.nodes, placed.gpus, strict=True))
        nearest = engine.nearest_counterpart(placed)
        kv = engine.kv_of(nearest) if nearest is not None else 0.0
        spread = 0.0
        if request.spread_racks:
            counts = engine.role_racks[group.role]
            spread = model.spread_us / 2 * float(sum(int(counts[r]) - 1 for r in placed.racks))
        domain_part = sum(
            cell_change(cell) * gpus / cell_share[cell] for cell, gpus in placed.cell_gpus.items()
        )
        node_part = sum(
            node_change(node) * gpus / node_share[node] for node, gpus in choice if engine.counted[node]
        )
        fragmentation = float(
            model.domain_fragmentation_us * domain_part + model.node_fragmentation_us * node_part
        )
        cost = GroupCost(
            comm=engine.comm(group, choice),
            kv=kv,
            spread=spread,
            fragmentation=fragmentation,
            ideal=ideals[group.shape],
        )
        excess = max(cost.comm + cost.kv + cost.spread - cost.ideal, 0.0)
        domain = engine.domain_names[next(iter(placed.domains))] if len(placed.domains) == 1 else None
        rack = engine.rack_names[next(iter(placed.racks))] if len(placed.racks) == 1 else None
        placed_groups.append(
            PlacedGroup(
                role=group.role,
                replica=group.replica,
                pods=tuple(Pod(node=engine.names[node], gpus=gpus) for node, gpus in choice),
                domain=domain,
                rack=rack,
                cost=cost,
                score=float(model.score_scale_us / (model.score_scale_us + excess)),
            )
        )
    unplaced = tuple(
        Unplaced(role=group.role, replica=group.replica, reason=(reasons or {}).get(group.key, "not placed"))
        for group in request.groups
        if group.key not in engine.placed
    )
    # Over the deployment, not a mean of group scores: terms such as spread are shared
    # unevenly between groups (three in one rack, two in the next) even when optimal overall.
    total = len(request.groups)
    score = 1.0
    if placed_groups:
        excess = sum(g.cost.comm + g.cost.kv + g.cost.spread - g.cost.ideal for g in placed_groups)
        excess = max(excess, 0.0) / len(placed_groups)
        score = len(placed_groups) / total * model.score_scale_us / (model.score_scale_us + excess)
    elif total:
        score = 0.0
    return Plan(groups=tuple(placed_groups), unplaced=unplaced, score=score, warnings=topology.warnings)


def choose_victims(
    topology: Topology,
    request: PlacementRequest,
    placements: Sequence[GroupPlacement],
    *,
    role: str,
    count: int,
    model: CostModel | None = None,
) -> list[GroupKey]:
    """The ``count`` groups of ``role`` whose removal lowers the total cost most, one at a time.

    Removing the last group of a domain frees it whole (the fragmentation term drops), a
    group in a crowded rack relieves spread, a split group saves its slow all-reduce. Ties
    go to the highest replica, as a StatefulSet would scale down.
    """
    model = model or CostModel()
    groups = _requested(request, placements)
    engine = Engine(topology, request, model)
    for placement in placements:
        engine.add(groups[placement.key], _choice(engine, placement))
    victims: list[GroupKey] = []
    for _ in range(count):
        candidates = [key for key in engine.placed if key[0] == role]
        if not candidates:
            break
        victim = min(candidates, key=lambda key: (round(engine.removal_delta(key), 6), -key[1]))
        engine.remove(victim)
        victims.append(victim)
    return victims


def invalid_groups(
    topology: Topology, request: PlacementRequest, placements: Sequence[GroupPlacement]
) -> dict[GroupKey, str]:
    """Placed groups that can no longer run where they are, with the reason (restart them whole).

    A cordon is not one: it stops new pods, not running ones. Nor is a NotReady or unreachable
    node (its node-controller taints included): it may come back, so callers weigh
    :func:`unready_groups` against their grace period. ``topology`` counts only other workloads'
    GPUs, as for :func:`plan`.
    """
    groups = _requested(request, placements)
    demand: dict[str, int] = {}
    for placement in placements:
        for pod in placement.pods:
            demand[pod.node] = demand.get(pod.node, 0) + pod.gpus
    broken: dict[GroupKey, str] = {}
    for placement in placements:
        group = groups[placement.key]
        for pod in placement.pods:
            node = topology.nodes.get(pod.node)
            reason = None
            if node is None:
                reason = f"node {pod.node} is gone"
            elif evicting := [
                t
                for t in node.taints
                if t.effect == "NoExecute"
                and t.key not in NODE_CONDITION_TAINTS
                and not tolerated(t, group.tolerations)
            ]:
                reason = f"node {pod.node} has taint {evicting[0]}, which evicts its pods"
            elif demand[pod.node] > node.free:
                reason = (
                    f"node {pod.node} has {node.free} GPUs left by other workloads "
                    f"but this deployment's pods there need {demand[pod.node]}"
                )
            if reason is not None:
                broken[placement.key] = reason
                break
    return broken


def unready_groups(
    topology: Topology, placements: Sequence[GroupPlacement]
) -> dict[GroupKey, tuple[str, float]]:
    """Placed groups with a pod on a NotReady or unreachable node: the node that has been so the
    longest and since when (s since the epoch)."""
    unready: dict[GroupKey, tuple[str, float]] = {}
    for placement in placements:
        down = [
            (since, pod.node)
            for pod in placement.pods
            if (node := topology.nodes.get(pod.node)) is not None
            and (since := node.not_ready_since) is not None
        ]
        if down:
            since, node_name = min(down)
            unready[placement.key] = (node_name, since)
    return unready
