"""An InferenceDeployment spec becomes a placement request."""

from __future__ import annotations

from pathlib import Path

from copse.api import load_deployment, parse_deployment
from copse.placement import DECODE, PREFILL, WORKER
from copse.placement.spec import request_from_spec
from copse.topology import Toleration

SEED = Path(__file__).resolve().parents[2] / "examples" / "seed-inferencedeployment.yaml"


def test_seed_manifest_asks_for_min_replicas_tp8_groups_in_one_domain_spread_over_racks() -> None:
    request = request_from_spec(load_deployment(SEED).spec)
    assert [(g.role, g.replica, g.gpus) for g in request.groups] == [(WORKER, 0, 8), (WORKER, 1, 8)]
    assert request.same_domain
    assert request.spread_racks


def test_disaggregated_pools_carry_their_shapes_tolerations_and_node_selector() -> None:
    deployment = parse_deployment(
        {
            "apiVersion": "copse.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": "d"},
            "spec": {
                "model": {"name": "m", "tensorParallelism": 8},
                "prefill": {"replicas": 2, "tensorParallelism": 4},
                "decode": {"replicas": 1, "pipelineParallelism": 2},
                "placement": {"affinityPolicy": "none", "antiAffinityPolicy": "none"},
                "pod": {
                    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "nodeSelector": {"pool": "llm"},
                },
            },
        },
        source="test",
    )
    request = request_from_spec(deployment.spec)
    shapes = [(g.role, g.replica, g.tensor_parallelism, g.pipeline_parallelism) for g in request.groups]
    assert shapes == [(PREFILL, 0, 4, 1), (PREFILL, 1, 4, 1), (DECODE, 0, 8, 2)]
    assert not request.same_domain
    assert not request.spread_racks
    for group in request.groups:
        assert group.tolerations == (Toleration(key="gpu", operator="Exists", effect="NoSchedule"),)
        assert group.node_selector == (("pool", "llm"),)
