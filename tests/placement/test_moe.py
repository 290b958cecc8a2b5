"""Mixture-of-Experts groups: the all-to-all term, and wide-EP groups inside NVLink domains."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from copse.api import load_deployment
from copse.placement import WORKER, CostModel, ExpertParallel, PlacementRequest, plan, pool
from copse.placement.cost import all_to_all_us, comm_us
from copse.placement.spec import request_from_spec
from copse.topology import build_topology, fake
from copse.topology.links import LinkTable, LinkTier

DEEPSEEK = Path(__file__).resolve().parents[2] / "examples" / "deployment-deepseek-v3-wide-ep.yaml"
DEP32 = ExpertParallel(
    ranks=32, experts_per_token=8, hidden_size=7168, activation_bytes=2, attention_data_parallel=True
)


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


def dep(replicas: int, moe: ExpertParallel = DEP32, **policy: bool) -> PlacementRequest:
    return PlacementRequest(
        groups=pool(role=WORKER, replicas=replicas, tensor_parallelism=moe.ranks, moe=moe), **policy
    )


def test_all_to_all_is_the_formula_over_the_tier_bandwidth() -> None:
    links, model = LinkTable(), CostModel()
    # 8 trays of 4 ranks in one NVLink domain: 128 tokens x 8 experts x 7168 x 2 x 2 bytes per rank,
    # 31/32 of it to the other ranks (3 over the tray's NVLink, 28 through the NVLink switches).
    ranks = [pod for pod in range(8) for _ in range(4)]
    tier = [[LinkTier.NODE if i == j else LinkTier.DOMAIN for j in range(8)] for i in range(8)]
    per_peer = 128 * 8 * 7168 * 2 * 2 * (31 / 32) / 31
    expected = per_peer * 3 / (900 * 1e3) + per_peer * 28 / (900 * 1e3) + 2 * links.domain.latency_us
    assert all_to_all_us(links=links, model=model, moe=DEP32, ranks=ranks, tier=tier) == pytest.approx(
        expected
    )
    # One rank per EP group, or EP 1: nothing moves.
    single = ExpertParallel(ranks=1, experts_per_token=8, hidden_size=7168)
    assert all_to_all_us(links=links, model=model, moe=single, ranks=ranks, tier=tier) == 0.0


def test_an_ep_group_leaving_its_nvlink_domain_costs_what_it_really_costs() -> None:
    links, model = LinkTable(), CostModel()

    def cost(between: LinkTier) -> float:
        # Two halves of 16 ranks (4 trays each), the halves ``between`` apart.
        tier = [
            [
                LinkTier.NODE if i == j else (LinkTier.DOMAIN if (i < 4) == (j < 4) else between)
                for j in range(8)
            ]
            for i in range(8)
        ]
        return comm_us(
            links=links, model=model, tensor_parallelism=32, pipeline_parallelism=1, pod_gpus=[4] * 8,
            tier=tier, moe=DEP32,
        )  # fmt: skip

    inside, across_racks = cost(LinkTier.DOMAIN), cost(LinkTier.RACK)
    # Half the traffic over 400 Gb/s NICs instead of NVLink 5: an order of magnitude slower.
    assert across_racks > 8 * inside
    # Attention data parallelism has no tensor-parallel all-reduce; TEP pays both.
    tep = ExpertParallel(ranks=32, experts_per_token=8, hidden_size=7168)
    tier = [[LinkTier.NODE if i == j else LinkTier.DOMAIN for j in range(8)] for i in range(8)]
    tep_cost = comm_us(
        links=links, model=model, tensor_parallelism=32, pipeline_parallelism=1, pod_gpus=[4] * 8,
        tier=tier, moe=tep,
    )  # fmt: skip
    assert tep_cost == pytest.approx(inside + links.domain.ring_allreduce_us(32, model.allreduce_bytes))


def test_two_dep32_groups_share_an_nvl72_rack_when_its_trays_allow() -> None:
    topology = build_topology(fake.gpu_nodes(racks=2))
    result = plan(topology, dep(2, same_domain=True, spread_racks=False))
    assert result.feasible
    assert len({group.domain for group in result.groups}) == 1, "32 + 32 of 72 GPUs: one rack holds both"
    for group in result.groups:
        assert group.domain is not None
        assert [pod.gpus for pod in group.pods] == [4] * 8


def test_a_second_dep32_goes_elsewhere_when_trays_are_taken() -> None:
    nodes = fake.gpu_nodes(racks=2)
    # Three trays of rack 0 hold one GPU of something else: 15 whole trays, room for one DEP32 only.
    taken = [busy(f"gb200-r000-t{tray:02d}", 1) for tray in (0, 5, 10)]
    topology = build_topology(nodes, pods=taken)
    result = plan(topology, dep(4, same_domain=True, spread_racks=False))
    per_domain = {group.domain: 0 for group in result.groups}
    for group in result.groups:
        per_domain[group.domain] += 1
    assert per_domain == {f"{fake.rack_uuid(0)}.0": 1, f"{fake.rack_uuid(1)}.0": 2}
    assert len(result.unplaced) == 1, "a fourth fits neither rack whole"
    assert "32 GPUs" in result.unplaced[0].reason


def test_without_domain_affinity_an_ep_group_spans_as_few_tiers_as_it_can() -> None:
    # Two 9-tray NVLink partitions per rack (2 x36): a DEP64 group cannot fit one partition.
    topology = build_topology(fake.gpu_nodes(racks=2, cliques_per_rack=2))
    moe = ExpertParallel(ranks=64, experts_per_token=8, hidden_size=7168, attention_data_parallel=True)
    result = plan(topology, dep(1, moe=moe, same_domain=False))
    [group] = result.groups
    assert group.domain is None
    assert group.rack is not None, "both partitions of one rack, not two racks"
    # Its cost is dominated by the all-to-all over the rack's NICs, and the score says so.
    assert group.cost.comm > 10 * group.cost.ideal
    assert result.score < 0.2


def test_the_deepseek_manifest_places_its_ep_groups_inside_nvlink_domains() -> None:
    request = request_from_spec(load_deployment(DEEPSEEK).spec)
    decode = [group for group in request.groups if group.role == "decode"]
    assert {group.moe for group in decode} == {DEP32}
    topology = build_topology(fake.gpu_nodes(racks=2))
    result = plan(topology, request)
    assert result.feasible
    assert all(group.domain is not None for group in result.groups)
    decode_racks = {group.rack for group in result.groups if group.role == "decode"}
    assert len(decode_racks) == 2, "spread across racks"
