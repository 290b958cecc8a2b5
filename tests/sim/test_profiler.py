"""The simulated profiler: what a deployment would measure of its engines, and mis-specified models."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from copse.sim.profiler import ProfileGrid, ScaledPerfModel, measure_profile
from copse.workers.mocker import EngineConfig
from copse.workers.moe import MoeConfig
from copse.workers.perf import PolynomialPerfModel

PERF = PolynomialPerfModel()
SMALL = ProfileGrid(prefill_points=6, context_points=3, batch_points=4, decode_steps=8)


def test_a_noise_free_profile_reproduces_the_model_where_it_measured() -> None:
    config = EngineConfig(block_size=64, num_blocks=2048)
    profile = measure_profile(config=config, perf=PERF, grid=SMALL)
    for isl, ttft in zip(profile.prefill_isl, profile.prefill_ttft_ms, strict=True):
        if isl <= config.max_num_batched_tokens:  # one step: TTFT is exactly F(isl)
            assert ttft == pytest.approx(PERF.prefill_curve_ms(isl))
        else:  # chunked: each extra chunk pays the step overhead again, as a profiler sees it
            assert ttft > PERF.prefill_curve_ms(isl)
    # measured decode points lie on the model (ITL depends on active KV alone here), where a batch
    # of that context can hold that much KV
    checked = 0
    for context in profile.decode_context_length:
        for active in (20_000.0, 60_000.0):
            if active < 2 * context:
                continue
            checked += 1
            itl = profile.decode_itl_ms(active_kv_tokens=active, context_length=context)
            exact = PERF.decode_itl_ms(active_kv_tokens=active, context_length=context)
            assert itl == pytest.approx(exact, rel=0.05)
    assert checked >= 3
    assert profile.kv_capacity_tokens == 2048 * 64


def test_a_noisy_profile_is_close_but_not_exact_and_repeatable() -> None:
    config = EngineConfig(block_size=64, num_blocks=2048, step_time_cv=0.1, seed=3)
    noisy = measure_profile(config=config, perf=PERF, grid=SMALL)
    assert noisy == measure_profile(config=config, perf=PERF, grid=SMALL)
    exact = np.array([PERF.prefill_curve_ms(x) for x in noisy.prefill_isl[:3]])
    errors = np.array(noisy.prefill_ttft_ms[:3]) / exact - 1
    assert np.all(np.abs(errors) < 0.25)
    assert np.any(errors != 0.0)
    other = measure_profile(
        config=EngineConfig(block_size=64, num_blocks=2048, step_time_cv=0.1, seed=4), perf=PERF, grid=SMALL
    )
    assert other.prefill_ttft_ms != noisy.prefill_ttft_ms


def test_scaled_model_changes_prefill_only() -> None:
    faster = ScaledPerfModel(base=PERF, prefill_scale=0.7)
    assert faster.prefill_curve_ms(4000.0) == pytest.approx(0.7 * PERF.prefill_curve_ms(4000.0))
    assert faster.decode_itl_ms(active_kv_tokens=5e5, context_length=3000.0) == PERF.decode_itl_ms(
        active_kv_tokens=5e5, context_length=3000.0
    )
    assert faster.kv_capacity_tokens == PERF.kv_capacity_tokens
    with pytest.raises(ValueError, match="prefill_scale=0 must be positive"):
        ScaledPerfModel(base=PERF, prefill_scale=0)


def test_the_balanced_profile_of_an_moe_engine_is_its_step_without_the_moe_terms() -> None:
    moe = MoeConfig(experts=16, experts_per_token=2, hidden_size=4096, layers=8, expert_parallelism=4)
    config = EngineConfig(block_size=64, num_blocks=2048, moe=moe)
    measured = measure_profile(config=config, perf=PERF, grid=SMALL)
    balanced = measure_profile(config=config, perf=PERF, grid=SMALL, balanced=True)
    dense = measure_profile(config=dataclasses.replace(config, moe=None), perf=PERF, grid=SMALL)
    assert balanced.prefill_ttft_ms == measured.prefill_ttft_ms, "only the decode steps differ"
    measured_itl, balanced_itl, dense_itl = (
        np.array(profile.decode_itl) for profile in (measured, balanced, dense)
    )
    assert np.all(measured_itl > dense_itl), "a profile times the stretch and all-to-all too"
    assert balanced_itl == pytest.approx(dense_itl, rel=1e-6)
    assert (
        measure_profile(config=dataclasses.replace(config, moe=None), perf=PERF, grid=SMALL, balanced=True)
        == dense
    )
