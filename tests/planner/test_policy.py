"""Bounds, the shared GPU budget in whole groups, and the scale-down gate."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from copse.api import Role, load_deployment, parse_deployment
from copse.planner.policy import Limits, ScaleDownGate, clamp, fit_budget

SEED = Path(__file__).resolve().parents[2] / "examples" / "seed-inferencedeployment.yaml"
P, D, W = Role.PREFILL, Role.DECODE, Role.WORKER


def limits(**overrides: object) -> Limits:
    values: dict[str, object] = {
        "roles": (P, D),
        "gpus_per_replica": {P: 2, D: 1},
        "ttft_ms": 500.0,
        "itl_ms": 50.0,
        "min_replicas": 1,
        "max_replicas": 8,
    }
    values.update(overrides)
    return Limits(**values)  # type: ignore[arg-type]


def test_clamp_keeps_each_pool_within_bounds() -> None:
    assert clamp({P: 0, D: 20}, limits()) == {P: 1, D: 8}
    assert clamp({}, limits(min_replicas=2)) == {P: 2, D: 2}


def test_budget_within_reach_changes_nothing() -> None:
    assert fit_budget({P: 2, D: 3}, limits(gpu_budget=7)) == {P: 2, D: 3}


def test_budget_shares_the_shortfall_in_whole_groups() -> None:
    # Wants 4 prefill groups of 2 GPUs and 6 decode groups of 1 GPU (14 GPUs) in a budget of 10.
    # From the minimums (1, 1), each next group goes to the pool furthest from its ask:
    # D (5/6) -> P (3/4) -> D (4/6) -> P (tie at 1/2, prefill first) -> D.
    assert fit_budget({P: 4, D: 6}, limits(gpu_budget=10)) == {P: 3, D: 4}


def test_budget_never_splits_a_group() -> None:
    granted = fit_budget({P: 4, D: 1}, limits(gpu_budget=6))
    assert granted == {P: 2, D: 1}  # 5 GPUs: a third prefill group would need 2 more


def test_limits_reject_a_budget_below_the_minimums() -> None:
    with pytest.raises(
        ValueError, match=r"GPU budget \(2\) cannot hold min_replicas \(1\) of every pool \(3 GPUs\)"
    ):
        limits(gpu_budget=2)


def test_limits_reject_min_above_max() -> None:
    with pytest.raises(ValueError, match=r"min_replicas \(5\) must lie in \[0, max_replicas \(3\)\]"):
        limits(min_replicas=5, max_replicas=3)


def test_limits_from_the_seed_manifest() -> None:
    spec = load_deployment(SEED).spec
    got = Limits.from_spec(spec)
    assert got.roles == (W,)
    assert got.gpus_per_replica == {W: spec.model.tensor_parallelism}
    assert (got.ttft_ms, got.itl_ms) == (500.0, 50.0)
    assert got.min_replicas == spec.scaling.min_replicas
    assert got.scale_down_delay_s == spec.scaling.scale_down_delay_s


def test_limits_from_a_disaggregated_spec() -> None:
    deployment = parse_deployment(
        {
            "apiVersion": "copse.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": "llama"},
            "spec": {
                "model": {"name": "m", "tensorParallelism": 4},
                "prefill": {"replicas": 2, "tensorParallelism": 2},
                "decode": {"replicas": 3},
                "scaling": {
                    "minReplicas": 1,
                    "maxReplicas": 10,
                    "maxGpus": 40,
                    "scaleDownDelay": "10m",
                    "targetLatency": {"ttft_p99_ms": 300, "tbt_p99_ms": 25},
                    "scaleUpTrigger": {"queueDepth": 4},
                },
                "engine": {"maxNumSequences": 128},
            },
        },
        source="test",
    )
    got = Limits.from_spec(deployment.spec)
    assert got.roles == (P, D)
    assert got.gpus_per_replica == {P: 2, D: 4}
    assert (got.gpu_budget, got.scale_down_delay_s, got.queue_depth, got.max_num_seqs) == (40, 600.0, 4, 128)
    assert (got.ttft_ms, got.itl_ms) == (300.0, 25.0)


@given(
    wants=st.fixed_dictionaries({P: st.integers(0, 50), D: st.integers(0, 50)}),
    budget=st.one_of(st.none(), st.integers(3, 60)),
    tp=st.integers(1, 4),
)
def test_bounds_and_budget_always_hold(wants: dict[Role, int], budget: int | None, tp: int) -> None:
    bounds = limits(
        gpus_per_replica={P: tp, D: 1}, gpu_budget=None if budget is None or budget < tp + 1 else budget
    )
    target = fit_budget(clamp(wants, bounds), bounds)
    for role in (P, D):
        assert bounds.min_replicas <= target[role] <= bounds.max_replicas
        assert target[role] <= max(clamp(wants, bounds)[role], bounds.min_replicas)
    if bounds.gpu_budget is not None:
        assert bounds.gpus(target) <= bounds.gpu_budget


def test_gate_passes_scale_ups_at_once() -> None:
    gate = ScaleDownGate()
    assert gate.settle(now=0.0, current={P: 2}, desired={P: 5}, delay_s=300.0) == {P: 5}


def test_gate_holds_scale_downs_for_the_delay() -> None:
    gate = ScaleDownGate()
    settled = [
        gate.settle(now=t, current={P: 5}, desired={P: 2}, delay_s=300.0)[P] for t in range(0, 400, 60)
    ]
    # Down only once a desire of 2 has stood for the whole 300 s (from t=0 to t=300).
    assert settled == [5, 5, 5, 5, 5, 2, 2]


def test_gate_ignores_a_short_dip() -> None:
    gate = ScaleDownGate()
    wants = [5, 5, 5, 5, 5, 5, 2, 2, 5, 5, 2, 2, 2, 2, 2, 2]
    current = 5
    applied = []
    for step, want in enumerate(wants):
        current = gate.settle(now=step * 60.0, current={P: current}, desired={P: want}, delay_s=300.0)[P]
        applied.append(current)
    assert applied == [5] * 15 + [2]


def test_gate_scales_down_to_the_largest_need_in_the_window() -> None:
    gate = ScaleDownGate()
    gate.settle(now=0.0, current={P: 8}, desired={P: 8}, delay_s=120.0)
    gate.settle(now=60.0, current={P: 8}, desired={P: 6}, delay_s=120.0)
    gate.settle(now=120.0, current={P: 8}, desired={P: 4}, delay_s=120.0)
    assert gate.settle(now=180.0, current={P: 8}, desired={P: 3}, delay_s=120.0) == {P: 6}


def test_gate_with_no_delay_follows_the_need() -> None:
    gate = ScaleDownGate()
    assert gate.settle(now=0.0, current={P: 8}, desired={P: 3}, delay_s=0.0) == {P: 3}
