"""The gang scheduler: whole groups, NVLink domains, best fit, spread, KV locality, scaling."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from copse.placement import (
    DECODE,
    PREFILL,
    WORKER,
    CostModel,
    GroupPlacement,
    PlacementRequest,
    Plan,
    Pod,
    choose_victims,
    evaluate,
    invalid_groups,
    plan,
    pool,
    unready_groups,
)
from copse.placement.engine import Engine
from copse.placement.scheduler import min_cost
from copse.topology import Toleration, Topology, build_topology, fake


def busy(node: str, gpus: int) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {"name": f"busy-{node}"},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
        },
        "status": {"phase": "Running"},
    }


def workers(replicas: int, tp: int = 8, pp: int = 1, **policy: bool) -> PlacementRequest:
    return PlacementRequest(
        groups=pool(role=WORKER, replicas=replicas, tensor_parallelism=tp, pipeline_parallelism=pp), **policy
    )


def domains_of(result: Plan) -> dict[tuple[str, int], str | None]:
    return {group.key: group.domain for group in result.groups}


def test_seed_deployment_spreads_two_tp8_groups_over_two_racks() -> None:
    topology = build_topology(fake.gpu_nodes(racks=2, cordoned=2))
    result = plan(topology, workers(2, same_domain=True, spread_racks=True))
    assert result.feasible
    assert result.score == pytest.approx(1.0)
    racks = {group.rack for group in result.groups}
    assert racks == {fake.rack_uuid(0), fake.rack_uuid(1)}
    for group in result.groups:
        assert [pod.gpus for pod in group.pods] == [4, 4]
        assert group.domain is not None
        assert {topology.nodes[pod.node].domain for pod in group.pods} == {group.domain}
        assert group.cost.spread == 0


def test_without_spread_groups_pack_into_one_domain() -> None:
    topology = build_topology(fake.gpu_nodes(racks=2))
    result = plan(topology, workers(3, same_domain=True, spread_racks=False))
    assert len(set(domains_of(result).values())) == 1


def test_spread_is_soft_more_replicas_than_racks_still_place() -> None:
    topology = build_topology(fake.gpu_nodes(racks=2))
    result = plan(topology, workers(5, spread_racks=True))
    assert result.feasible
    per_rack = sorted(
        sum(group.rack == rack for group in result.groups) for rack in {g.rack for g in result.groups}
    )
    assert per_rack == [2, 3]
    assert result.score == pytest.approx(1.0)  # as even as 5 over 2 racks can be


def test_a_group_is_placed_whole_or_not_at_all() -> None:
    # Each rack has 7 free GPUs scattered over trays: no room for 2 pods of 4.
    nodes = fake.gpu_nodes(racks=2, trays_per_rack=2)
    pods = [busy("gb200-r000-t00", 1), busy("gb200-r000-t01", 0), busy("gb200-r001-t00", 4)]
    topology = build_topology(nodes, pods=pods)
    result = plan(topology, workers(1))
    assert not result.feasible
    assert result.groups == ()
    [unplaced] = result.unplaced
    assert unplaced.key == (WORKER, 0)
    assert "needs 8 GPUs (TP 8 x PP 1) as 2 pods x 4 GPUs" in unplaced.reason
    assert "would fit across NVLink domains, but affinityPolicy is same-nvswitch-domain" in unplaced.reason


def test_same_domain_is_required_only_when_asked() -> None:
    nodes = fake.gpu_nodes(racks=2, trays_per_rack=2, racks_per_block=2)
    pods = [busy("gb200-r000-t00", 4), busy("gb200-r001-t00", 4)]
    topology = build_topology(nodes, pods=pods)
    assert not plan(topology, workers(1, same_domain=True)).feasible
    spanning = plan(topology, workers(1, same_domain=False))
    [group] = spanning.groups
    assert group.domain is None
    assert group.rack is None
    assert sorted(pod.node for pod in group.pods) == ["gb200-r000-t01", "gb200-r001-t01"]
    # Split over the fabric, its all-reduce is several times the NVLink one.
    assert group.cost.comm > 5 * group.cost.ideal
    assert spanning.score < 0.5


def test_groups_never_span_domains_while_one_domain_could_hold_them() -> None:
    for seed in range(20):
        nodes = fake.gpu_nodes(racks=3, trays_per_rack=4, cliques_per_rack=2, racks_per_block=2)
        topology = build_topology(nodes, pods=fake.busy_pods(nodes, fraction=0.4, seed=seed))
        request = workers(4, tp=8, same_domain=False, spread_racks=seed % 2 == 0)
        result = plan(topology, request)
        engine = Engine(topology, request, CostModel())
        for placement in result.placements():
            engine.add(
                next(g for g in request.groups if g.key == placement.key),
                [(engine.index[pod.node], pod.gpus) for pod in placement.pods],
            )
        for group in result.groups:
            if group.domain is None:
                removed = engine.remove(group.key)
                assert not engine.cell_terms(removed.group).feasible.any(), (seed, group.key)
                engine.add(removed.group, list(zip(removed.nodes, removed.gpus, strict=True)))


def test_best_fit_keeps_a_whole_domain_free_where_first_fit_does_not() -> None:
    # Rack 0 is empty; rack 1 has exactly 16 GPUs left. Two TP=8 groups belong in rack 1.
    nodes = fake.gpu_nodes(racks=2)
    pods = [busy(f"gb200-r001-t{tray:02d}", 4) for tray in range(14)]
    topology = build_topology(nodes, pods=pods)
    result = plan(topology, workers(2))
    assert set(domains_of(result).values()) == {f"{fake.rack_uuid(1)}.0"}
    first = plan(topology, workers(2), strategy="first-fit")
    assert set(domains_of(first).values()) == {f"{fake.rack_uuid(0)}.0"}
    assert result.total_cost < first.total_cost
    # Only min-cost left room for a later TP=72 group, which needs a whole NVL72.
    big = PlacementRequest(groups=pool(role="big", replicas=1, tensor_parallelism=72))
    after = [p.placements() for p in (result, first)]
    used = [
        {pod.node: pod.gpus for placement in placements for pod in placement.pods} for placements in after
    ]
    assert plan(build_topology(nodes, pods=pods + [busy(n, g) for n, g in used[0].items()]), big).feasible
    assert not plan(build_topology(nodes, pods=pods + [busy(n, g) for n, g in used[1].items()]), big).feasible


def test_partly_used_trays_are_filled_before_whole_ones() -> None:
    nodes = fake.gpu_nodes(racks=1, trays_per_rack=4)
    topology = build_topology(nodes, pods=[busy("gb200-r000-t02", 2)])
    result = plan(topology, workers(1, tp=2))
    assert [pod.node for pod in result.groups[0].pods] == ["gb200-r000-t02"]


def test_pipeline_stages_make_more_pods_and_pay_a_handoff() -> None:
    topology = build_topology(fake.gpu_nodes(racks=1, trays_per_rack=4))
    flat, staged = (plan(topology, workers(1, tp=tp, pp=pp)).groups[0] for tp, pp in ((8, 1), (4, 2)))
    assert len(staged.pods) == 2
    assert staged.domain is not None
    # TP=4 rings stay inside a tray; the stages hand activations over NVLink once.
    assert staged.cost.comm < flat.cost.comm


def test_mixed_products_never_share_a_group() -> None:
    nodes = [fake.gpu_node("h1", clique="r.0", product="NVIDIA-H100"), fake.gpu_node("g1", clique="r.0")]
    nodes += [fake.gpu_node("g2", clique="r.0", product="NVIDIA-GB200")]
    topology = build_topology(nodes)
    result = plan(topology, workers(2, tp=8))
    assert [unplaced.key for unplaced in result.unplaced] == [(WORKER, 1)]
    assert sorted(pod.node for pod in result.groups[0].pods) == ["g1", "g2"]


def test_tainted_nodes_are_used_only_by_tolerating_groups() -> None:
    taint = [{"key": "dedicated", "value": "llm", "effect": "NoSchedule"}]
    nodes = [fake.gpu_node(f"t{i}", clique="r.0", taints=taint) for i in range(2)]
    topology = build_topology(nodes)
    blocked = plan(topology, workers(1))
    assert "2 with taint dedicated=llm:NoSchedule not tolerated" in blocked.unplaced[0].reason
    tolerating = PlacementRequest(
        groups=pool(
            role=WORKER,
            replicas=1,
            tensor_parallelism=8,
            tolerations=[Toleration(key="dedicated", operator="Exists")],
        )
    )
    assert plan(topology, tolerating).feasible


def test_unplaced_reasons_name_excluded_nodes() -> None:
    nodes = fake.gpu_nodes(racks=1, trays_per_rack=4, cordoned=1, not_ready=1)
    topology = build_topology(nodes, pods=[busy("gb200-r000-t01", 1)])
    [unplaced] = plan(topology, workers(1)).unplaced
    assert "1 cordoned" in unplaced.reason
    assert "1 NotReady" in unplaced.reason
    assert "has 1 node(s) with >= 4 free GPUs of the 2 it needs" in unplaced.reason


def test_oversized_groups_say_so() -> None:
    topology = build_topology(fake.gpu_nodes(racks=2, trays_per_rack=2))
    [unplaced] = plan(topology, workers(1, tp=16)).unplaced
    assert "larger than any NVLink domain it may use (largest: 8 GPUs)" in unplaced.reason


def test_disaggregated_prefill_and_decode_share_nvlink_domains() -> None:
    nodes = fake.gpu_nodes(racks=4, trays_per_rack=6)
    # Rack 0 is nearly full: only room for a prefill group, none for a decode bundle.
    topology = build_topology(nodes, pods=[busy(f"gb200-r000-t{tray:02d}", 4) for tray in range(5)])
    request = PlacementRequest(
        groups=pool(role=PREFILL, replicas=4, tensor_parallelism=4)
        + pool(role=DECODE, replicas=2, tensor_parallelism=8),
        spread_racks=True,
    )
    result = plan(topology, request)
    assert result.feasible
    for group in result.groups:
        partners = [g.domain for g in result.groups if g.role != group.role]
        assert group.domain in partners, group.key
        assert group.cost.kv == pytest.approx(result.groups[0].cost.kv)
    # Decode groups spread over racks, each with its own prefill groups beside it.
    assert len({g.rack for g in result.groups if g.role == DECODE}) == 2
    assert fake.rack_uuid(0) not in {g.rack for g in result.groups}


def test_scale_up_keeps_running_groups_where_they_are() -> None:
    topology = build_topology(fake.gpu_nodes(racks=3))
    first = plan(topology, workers(2, spread_racks=True))
    bigger = plan(topology, workers(4, spread_racks=True), existing=first.placements())
    kept = {group.key: group.pods for group in bigger.groups}
    for group in first.groups:
        assert kept[group.key] == group.pods
    assert bigger.feasible
    assert len({group.rack for group in bigger.groups}) == 3
    with pytest.raises(ValueError, match="not in the request"):
        plan(topology, workers(1), existing=first.placements())


def test_scale_down_frees_a_whole_domain() -> None:
    topology = build_topology(fake.gpu_nodes(racks=2))
    packed = [
        GroupPlacement(
            role=WORKER,
            replica=replica,
            pods=(
                Pod(node=f"gb200-r{rack:03d}-t{2 * slot:02d}", gpus=4),
                Pod(node=f"gb200-r{rack:03d}-t{2 * slot + 1:02d}", gpus=4),
            ),
        )
        for replica, (rack, slot) in enumerate([(0, 0), (1, 0), (0, 1), (0, 2)])
    ]
    request = workers(4)
    assert choose_victims(topology, request, packed, role=WORKER, count=1) == [(WORKER, 1)]
    # Ties go to the highest replica, as a StatefulSet would.
    assert choose_victims(topology, request, packed, role=WORKER, count=2) == [(WORKER, 1), (WORKER, 3)]
    assert choose_victims(topology, request, packed, role=PREFILL, count=1) == []


def test_scale_down_prefers_groups_split_across_domains() -> None:
    topology = build_topology(fake.gpu_nodes(racks=2, trays_per_rack=4))
    split = GroupPlacement(
        role=WORKER, replica=0, pods=(Pod(node="gb200-r000-t00", gpus=4), Pod(node="gb200-r001-t00", gpus=4))
    )
    whole = GroupPlacement(
        role=WORKER, replica=1, pods=(Pod(node="gb200-r000-t01", gpus=4), Pod(node="gb200-r000-t02", gpus=4))
    )
    request = workers(2, same_domain=False)
    assert choose_victims(topology, request, [split, whole], role=WORKER, count=1) == [(WORKER, 0)]


def _node(nodes: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return nodes[[n["metadata"]["name"] for n in nodes].index(name)]


def test_invalid_groups_report_lost_nodes_and_evicting_taints() -> None:
    nodes = fake.gpu_nodes(racks=1, trays_per_rack=4)
    request = workers(2)
    running = plan(build_topology(nodes), request).placements()
    gone = build_topology([n for n in nodes if n["metadata"]["name"] != running[1].pods[1].node])
    assert list(invalid_groups(gone, request, running)) == [running[1].key]
    assert "is gone" in invalid_groups(gone, request, running)[running[1].key]
    _node(nodes, running[0].pods[0].node)["spec"]["taints"] = [{"key": "maintenance", "effect": "NoExecute"}]
    broken = invalid_groups(build_topology(nodes), request, running)
    assert list(broken) == [running[0].key]
    assert "maintenance:NoExecute" in broken[running[0].key]


def test_cordoned_and_not_ready_nodes_do_not_invalidate_their_groups() -> None:
    """A cordon stops new pods, not running ones; a NotReady node may come back (callers weigh
    unready_groups against a grace period), and so may one with the node controller's taints."""
    nodes = fake.gpu_nodes(racks=1, trays_per_rack=6)
    request = workers(2)
    running = plan(build_topology(nodes), request).placements()
    cordoned, unready = running[0].pods[0].node, running[1].pods[0].node
    _node(nodes, cordoned)["spec"]["unschedulable"] = True
    ready = next(c for c in _node(nodes, unready)["status"]["conditions"] if c["type"] == "Ready")
    ready.update(status="Unknown", lastTransitionTime="2025-01-01T10:00:00Z")
    _node(nodes, unready)["spec"]["taints"] = [
        {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": "2025-01-01T10:00:40Z"}
    ]
    topology = build_topology(nodes)
    assert invalid_groups(topology, request, running) == {}
    since = datetime(2025, 1, 1, 10, 0, tzinfo=UTC).timestamp()
    assert unready_groups(topology, running) == {running[1].key: (unready, since)}
    # The cordoned node takes no new group: placing a third one avoids it.
    grown = plan(topology, workers(3), existing=running)
    new = next(g for g in grown.groups if g.replica == 2)
    assert all(pod.node not in (cordoned, unready) for pod in new.pods)


def test_unready_groups_date_a_taint_without_a_ready_condition_change() -> None:
    nodes = fake.gpu_nodes(racks=1, trays_per_rack=2)
    request = workers(1)
    running = plan(build_topology(nodes), request).placements()
    node = running[0].pods[0].node
    _node(nodes, node)["spec"]["taints"] = [
        {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute", "timeAdded": "2025-01-01T10:00:40Z"},
        {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"},
    ]
    since = datetime(2025, 1, 1, 10, 0, 40, tzinfo=UTC).timestamp()
    assert unready_groups(build_topology(nodes), running) == {running[0].key: (node, since)}
    # A NotReady condition without a time has been so for as long as anyone knows.
    ready = next(c for c in _node(nodes, node)["status"]["conditions"] if c["type"] == "Ready")
    ready["status"] = "False"
    assert unready_groups(build_topology(nodes), running) == {running[0].key: (node, 0.0)}


def test_evaluate_rescoring_matches_the_plan() -> None:
    nodes = fake.gpu_nodes(racks=3, trays_per_rack=8)
    topology = build_topology(nodes, pods=fake.busy_pods(nodes, fraction=0.3, seed=5))
    request = workers(5, tp=4, spread_racks=True)
    result = plan(topology, request)
    again = evaluate(topology, request, result.placements())
    assert again.groups == result.groups
    assert again.score == result.score


def test_plan_json_has_the_documented_shape() -> None:
    topology = build_topology(fake.gpu_nodes(racks=1, trays_per_rack=2))
    document = plan(topology, workers(2)).to_json()
    assert set(document) == {"feasible", "score", "groups", "unplaced"}
    assert document["feasible"] is False
    [group] = document["groups"]
    assert set(group) == {"role", "replica", "domain", "cost", "pods"}
    assert group["pods"] == [{"node": "gb200-r000-t00", "gpus": 4}, {"node": "gb200-r000-t01", "gpus": 4}]
    assert set(document["unplaced"][0]) == {"role", "replica", "reason"}


def test_unknown_strategy_is_refused() -> None:
    topology = build_topology(fake.gpu_nodes(racks=1))
    with pytest.raises(ValueError, match="unknown placement strategy 'magic'"):
        plan(topology, workers(1), strategy="magic")


def _random_state(seed: int) -> tuple[Topology, PlacementRequest, Engine]:
    nodes = fake.gpu_nodes(racks=4, trays_per_rack=5, cliques_per_rack=1 + seed % 2, racks_per_block=2)
    topology = build_topology(nodes, pods=fake.busy_pods(nodes, fraction=0.4, seed=seed))
    request = PlacementRequest(
        groups=pool(role=PREFILL, replicas=3, tensor_parallelism=2)
        + pool(role=DECODE, replicas=2, tensor_parallelism=4),
        same_domain=seed % 3 != 0,
        spread_racks=seed % 2 == 0,
    )
    return topology, request, Engine(topology, request, CostModel())


@pytest.mark.parametrize("seed", range(8))
def test_marginal_costs_add_up_to_the_evaluated_total(seed: int) -> None:
    topology, request, engine = _random_state(seed)
    total = 0.0
    for group in request.groups:
        choice = min_cost(engine, group)
        if choice is None:
            continue
        total += engine.marginal(group, choice)
        engine.add(group, choice)
    placements = [
        GroupPlacement(
            role=p.group.role,
            replica=p.group.replica,
            pods=tuple(Pod(node=engine.names[n], gpus=g) for n, g in zip(p.nodes, p.gpus, strict=True)),
        )
        for p in engine.placed.values()
    ]
    full = evaluate(topology, request, placements).total_cost
    assert full == pytest.approx(total)
    for placement in placements:
        without = [p for p in placements if p.key != placement.key]
        smaller = evaluate(topology, request, without).total_cost
        assert engine.removal_delta(placement.key) == pytest.approx(smaller - full)


@pytest.mark.parametrize("seed", range(8))
def test_vectorised_cell_costs_equal_the_exact_marginal(seed: int) -> None:
    _, request, engine = _random_state(seed)
    for group in request.groups:
        terms = engine.cell_terms(group)
        vector = terms.comm + terms.fragmentation + engine.kv_delta_cells(group) + engine.spread_cells(group)
        for cell in range(engine.n_cells):
            if not terms.feasible[cell]:
                continue
            pod_gpus, pods = int(terms.pod_gpus[cell]), int(terms.pods[cell])
            choice = [(node, pod_gpus) for node in engine.best_nodes(group, cell, pod_gpus, pods)]
            assert vector[cell] == pytest.approx(engine.marginal(group, choice)), (group.key, cell)
        chosen = min_cost(engine, group)
        if chosen is not None:
            engine.add(group, chosen)
