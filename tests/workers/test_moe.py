"""Mixture-of-Experts: the model's expert popularity, placement (static and EPLB), and what an
expert-parallel engine adds to its steps."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from copse.workers.mocker import Engine, EngineConfig, Simulator
from copse.workers.moe import (
    ExpertPopularity,
    MoeConfig,
    MoeStep,
    eplb,
    skewed_popularity,
    static_placement,
    step_terms,
)
from copse.workers.perf import PolynomialPerfModel

PERF = PolynomialPerfModel()
DEP8 = MoeConfig()


def imbalance(loads: np.ndarray) -> float:
    return float(loads.max() / loads.mean())


def test_popularity_is_skewed_like_deepseek_v3() -> None:
    shares = skewed_popularity(256)
    assert shares.sum() == pytest.approx(1.0)
    assert np.all(np.diff(shares) <= 0)
    assert shares[:32].sum() == pytest.approx(0.39, abs=0.01)  # the design documents' "about 40 %"
    assert skewed_popularity(256, skew=1.0)[:32].sum() == pytest.approx(0.26, abs=0.01)


def test_a_prompt_prefers_its_own_experts_and_always_the_same() -> None:
    model = ExpertPopularity(experts=256, prompt_weight=0.8)
    a, again, b = model.of(11), model.of(11), model.of(12)
    assert a is again
    assert a.sum() == pytest.approx(1.0)
    assert int(np.argmax(a)) != int(np.argmax(b))
    assert np.array_equal(model.of(None), model.model_wide)
    assert np.array_equal(ExpertPopularity(experts=256, prompt_weight=0.8).of(11), a), "seeded, not random"


def test_static_placement_is_contiguous_and_eplb_balances_with_replicas() -> None:
    static = static_placement(experts=256, ranks=8)
    assert static.slots[1] == tuple(range(32, 64))
    load = ExpertPopularity(experts=256).of(7)
    balanced = eplb(load, ranks=8, slots=264)
    assert balanced.slots_per_rank == 33
    assert sorted(balanced.global_assignments()) != list(range(256))
    assert balanced.replicas().sum() == 264
    assert balanced.replicas()[int(np.argmax(load))] >= 2, "the hottest expert is replicated"
    before, after = load @ static.shares(), load @ balanced.shares()
    assert imbalance(before) > 1.1
    assert imbalance(after) < 1.01
    with pytest.raises(ValueError, match="do not divide"):
        eplb(load, ranks=8, slots=260)


def test_step_terms_follow_the_formula() -> None:
    balanced = step_terms(DEP8, np.full(8, 100.0))
    assert balanced.factor == pytest.approx(1.0)
    per_layer_us = 2 * DEP8.link_latency_us + 100 * 7 / 8 * 7168 * 2 * 2 / (900 * 1e3)
    assert balanced.all_to_all_ms == pytest.approx(58 * per_layer_us / 1000)
    skewed = step_terms(DEP8, np.array([200.0] + [100.0] * 6 + [0.0]))
    assert skewed.factor == pytest.approx(1 + 0.4 * (200 / 100 - 1))
    assert skewed.all_to_all_ms > balanced.all_to_all_ms
    # Leaving the NVLink domain: 400 Gb/s NICs instead of NVLink 5.
    nic = step_terms(dataclasses.replace(DEP8, link_bandwidth_gbps=50.0), np.full(8, 100.0))
    assert nic.all_to_all_ms > 10 * balanced.all_to_all_ms
    assert (
        step_terms(
            dataclasses.replace(DEP8, expert_parallelism=1, experts=256), np.array([5.0])
        ).all_to_all_ms
        == 0
    )
    assert step_terms(DEP8, np.zeros(8)) == (1.0, 0.0, 0.0, 0.0)


def _prompt(n: int, *, salt: int) -> list[int]:
    return [(i * 7919 + salt * 104729) % 30000 + 256 for i in range(n)]


def _run(config: EngineConfig, salts: list[int], *, max_tokens: int = 64) -> tuple[Engine, float]:
    """The engine after serving one request per salt (all at once), and its total step time."""
    engine = Engine(worker_id="w", config=config, perf=PERF)
    busy = [0.0]
    sim = Simulator([engine], on_step=lambda _, out: busy.__setitem__(0, busy[0] + out.end_ms - out.start_ms))
    for index, salt in enumerate(salts):
        sim.submit(0, request_id=str(index), tokens=_prompt(256, salt=salt), max_tokens=max_tokens)
    sim.run()
    return engine, busy[0]


def test_moe_engine_steps_are_longer_than_dense_by_the_moe_terms() -> None:
    salts = list(range(16))
    _, dense_ms = _run(EngineConfig(), salts)
    moe_engine, moe_busy_ms = _run(EngineConfig(moe=DEP8), salts)
    assert moe_engine.moe is not None
    assert moe_engine.moe.moe_ms > 0
    assert moe_engine.moe.step_ms == pytest.approx(moe_busy_ms)
    assert moe_busy_ms == pytest.approx(dense_ms + moe_engine.moe.moe_ms), (
        "same schedule, each step stretched and the all-to-all added"
    )
    # Every token of every request went through 58 layers' all-to-all: 8 copies, 7/8 remote.
    passes = 16 * (256 + 63)
    assert moe_engine.moe.token_passes == pytest.approx(passes)
    assert moe_engine.moe.all_to_all_bytes == pytest.approx(passes * 8 * 7 / 8 * 7168 * 4 * 58)


def test_one_prompt_class_loads_ranks_unevenly_and_a_mix_less() -> None:
    config = EngineConfig(moe=dataclasses.replace(DEP8, prompt_weight=0.8))
    one_class, _ = _run(config, [3] * 32)
    mixed, _ = _run(config, list(range(32)))
    assert one_class.moe is not None
    assert mixed.moe is not None
    assert one_class.moe.imbalance > mixed.moe.imbalance > 1.0


def test_online_rebalancing_and_redundant_experts_cut_the_imbalance() -> None:
    skewed = dataclasses.replace(DEP8, prompt_weight=0.8)
    static, _ = _run(EngineConfig(moe=skewed), [3] * 32, max_tokens=512)
    online, _ = _run(
        EngineConfig(moe=dataclasses.replace(skewed, redundant_experts=8, rebalance_steps=58)),
        [3] * 32,
        max_tokens=512,
    )
    assert static.moe is not None
    assert online.moe is not None
    assert online.moe.version > 0, "the balancer re-placed the experts"
    assert online.moe.imbalance < static.moe.imbalance - 0.05
    assert online.moe.moe_ms < static.moe.moe_ms


def test_reported_activations_sample_the_prompts_expert_shares() -> None:
    state = MoeStep(dataclasses.replace(DEP8, prompt_weight=0.8), seed=1)
    row = state.row(42)
    counts = state.activations(row, 10_000)
    assert counts.sum() == 80_000
    assert np.corrcoef(counts, state.shares_of(row))[0, 1] > 0.95
