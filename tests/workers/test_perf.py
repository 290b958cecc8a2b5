"""The shared perf model: formulas, derived capacity figures, profile files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from copse.workers.perf import (
    InterpolatedPerfModel,
    PolynomialPerfModel,
    ProfileError,
    load_perf_model,
    load_profile,
    save_profile,
)


def test_polynomial_prefill_is_the_documented_curve() -> None:
    model = PolynomialPerfModel()
    expected = 4.209989e-7 * 4096**2 + 1.518344e-2 * 4096 + 16.50142
    assert model.prefill_ms(new_tokens=4096) == pytest.approx(expected)


def test_cached_prefix_costs_the_increment_of_the_curve_plus_one_overhead() -> None:
    model = PolynomialPerfModel()
    f = model.prefill_curve_ms
    assert model.prefill_ms(new_tokens=1000, cached_tokens=3000) == pytest.approx(f(4000) - f(3000) + f(0))
    assert model.prefill_ms(new_tokens=1000, cached_tokens=3000) < model.prefill_ms(new_tokens=4000)


def test_chunked_prefill_costs_the_whole_prompt_plus_one_overhead_per_extra_step() -> None:
    model = PolynomialPerfModel()
    chunks = [model.prefill_ms(new_tokens=2048, cached_tokens=c) for c in (0, 2048, 4096, 6144)]
    assert sum(chunks) == pytest.approx(model.prefill_ms(new_tokens=8192) + 3 * model.prefill_curve_ms(0))


def test_batched_prefill_pays_the_step_overhead_once() -> None:
    model = PolynomialPerfModel()
    one = model.prefill_ms(new_tokens=500)
    batch = model.prefill_batch_ms(chunks=[(500, 0), (500, 0)])
    assert batch == pytest.approx(2 * one - model.prefill_curve_ms(0))
    assert model.prefill_batch_ms(chunks=[]) == 0.0


def test_polynomial_decode_depends_on_cache_utilisation() -> None:
    model = PolynomialPerfModel(kv_capacity_tokens=1000)
    assert model.decode_itl_ms(active_kv_tokens=0, context_length=100) == pytest.approx(5.74)
    assert model.decode_itl_ms(active_kv_tokens=1000, context_length=100) == pytest.approx(
        5.74 + 54.01 - 25.74
    )


def test_throughput_is_per_gpu() -> None:
    one = PolynomialPerfModel(gpus_per_engine=1)
    four = PolynomialPerfModel(gpus_per_engine=4)
    assert four.prefill_tokens_per_s_per_gpu(isl=4096) == pytest.approx(
        one.prefill_tokens_per_s_per_gpu(isl=4096) / 4
    )
    rate = one.prefill_tokens_per_s_per_gpu(isl=4096)
    assert rate == pytest.approx(4096 * 1000 / one.prefill_ms(new_tokens=4096))


def test_prefix_hits_raise_prefill_throughput_in_new_tokens() -> None:
    model = PolynomialPerfModel()
    cold = model.prefill_tokens_per_s_per_gpu(isl=8192)
    warm = model.prefill_tokens_per_s_per_gpu(isl=8192, cached_tokens=4096)
    assert warm < cold  # attention over the cached half makes each new token dearer
    assert warm == pytest.approx(4096 * 1000 / model.prefill_ms(new_tokens=4096, cached_tokens=4096))
    with pytest.raises(ValueError, match="cached_tokens"):
        model.prefill_tokens_per_s_per_gpu(isl=100, cached_tokens=100)


def test_best_decode_point_respects_the_itl_bound() -> None:
    model = PolynomialPerfModel(kv_capacity_tokens=100_000)
    point = model.best_decode_point(itl_ms=20.0, context_length=1000)
    assert point is not None
    assert point.itl_ms <= 20.0
    one_more = model.decode_itl_ms(active_kv_tokens=(point.batch_size + 1) * 1000, context_length=1000)
    assert one_more > 20.0
    assert point.tokens_per_s_per_gpu == pytest.approx(point.batch_size * 1000 / point.itl_ms)
    looser = model.best_decode_tokens_per_s_per_gpu(itl_ms=30.0, context_length=1000)
    assert looser > point.tokens_per_s_per_gpu


def test_best_decode_point_is_capped_and_can_be_infeasible() -> None:
    model = PolynomialPerfModel(kv_capacity_tokens=100_000)
    capped = model.best_decode_point(itl_ms=1000.0, context_length=1000, max_num_seqs=8)
    assert capped is not None
    assert capped.batch_size == 8
    full = model.best_decode_point(itl_ms=1000.0, context_length=1000)
    assert full is not None
    assert full.batch_size == 100
    assert model.best_decode_point(itl_ms=1.0, context_length=1000) is None
    assert model.best_decode_tokens_per_s_per_gpu(itl_ms=1.0, context_length=1000) == 0.0
    assert model.best_decode_point(itl_ms=100.0, context_length=200_000) is None


def test_best_decode_point_samples_large_batch_ranges() -> None:
    model = PolynomialPerfModel(kv_capacity_tokens=10_000_000)
    point = model.best_decode_point(itl_ms=20.0, context_length=100)
    assert point is not None
    assert point.itl_ms <= 20.0
    assert point.batch_size > 4096


@pytest.mark.parametrize("suffix", [".npz", ".json"])
def test_saved_profile_reproduces_the_polynomial_on_its_grid(tmp_path: Path, suffix: str) -> None:
    poly = PolynomialPerfModel(kv_capacity_tokens=200_000, gpus_per_engine=2)
    path = tmp_path / f"profile{suffix}"
    save_profile(poly, path, max_context_length=32768, points=50)
    loaded = load_profile(path)
    assert loaded.gpus_per_engine == 2
    assert loaded.kv_capacity_tokens == 200_000
    for isl in loaded.prefill_isl[::7]:
        assert loaded.prefill_curve_ms(isl) == pytest.approx(poly.prefill_curve_ms(isl))
    # between grid points linear interpolation of a convex curve stays close above it
    assert loaded.prefill_ms(new_tokens=10_000) == pytest.approx(poly.prefill_ms(new_tokens=10_000), rel=0.01)
    itl = loaded.decode_itl_ms(active_kv_tokens=123_456, context_length=5000)
    assert itl == pytest.approx(poly.decode_itl_ms(active_kv_tokens=123_456, context_length=5000), rel=0.01)
    assert loaded.best_decode_tokens_per_s_per_gpu(itl_ms=20, context_length=2000) == pytest.approx(
        poly.best_decode_tokens_per_s_per_gpu(itl_ms=20, context_length=2000), rel=0.02
    )


def _dynamo_layout() -> dict[str, Any]:
    return {
        "prefill_isl": np.array([100.0, 1000.0, 4000.0]),
        "prefill_ttft_ms": np.array([20.0, 40.0, 130.0]),
        "decode_active_kv_tokens": np.array([1000.0, 50_000.0]),
        "decode_context_length": np.array([100.0, 5000.0]),
        "decode_itl": np.array([[8.0, 9.0], [20.0, 24.0]]),
    }


def test_dynamo_profile_layout_loads_and_interpolates(tmp_path: Path) -> None:
    path = tmp_path / "raw_data.npz"
    np.savez(path, **_dynamo_layout())
    model = load_profile(path, gpus_per_engine=4)
    assert model.kv_capacity_tokens == 50_000
    assert model.gpus_per_engine == 4
    assert model.prefill_curve_ms(550) == pytest.approx(30.0)
    assert model.decode_itl_ms(active_kv_tokens=25_500, context_length=2550) == pytest.approx(
        (8 + 9 + 20 + 24) / 4
    )


def test_extrapolation_is_linear_and_clamped(tmp_path: Path) -> None:
    path = tmp_path / "raw_data.json"
    path.write_text(json.dumps({key: value.tolist() for key, value in _dynamo_layout().items()}))
    model = load_profile(path)
    assert model.prefill_curve_ms(7000) == pytest.approx(130 + 3000 * 90 / 3000)
    assert model.prefill_curve_ms(0) == pytest.approx(20 - 100 * 20 / 900)
    assert model.decode_itl_ms(active_kv_tokens=0, context_length=0) >= 8.0
    assert model.decode_itl_ms(active_kv_tokens=99_000, context_length=5000) == pytest.approx(24 + (24 - 9))


def test_prefill_never_goes_negative() -> None:
    model = InterpolatedPerfModel(
        prefill_isl=(100.0, 200.0),
        prefill_ttft_ms=(1.0, 100.0),
        decode_active_kv_tokens=(1.0, 2.0),
        decode_context_length=(1.0, 2.0),
        decode_itl=((1.0, 1.0), (1.0, 1.0)),
        kv_capacity_tokens=10,
    )
    assert model.prefill_curve_ms(0) == 0.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"decode_itl": None}, "missing array 'decode_itl'"),
        ({"prefill_isl": np.array([100.0, 100.0, 200.0])}, "prefill_isl must be strictly increasing"),
        ({"decode_itl": np.array([1.0, 2.0])}, "decode_itl must have 2 dimension"),
        ({"decode_itl": np.ones((3, 2))}, "decode_itl must be 2x2"),
        ({"prefill_ttft_ms": np.array([1.0, np.nan, 3.0])}, "prefill_ttft_ms holds non-finite"),
        ({"max_kv_tokens": np.array(0)}, "max_kv_tokens must be a single number >= 1"),
    ],
)
def test_bad_profiles_name_file_and_field(
    tmp_path: Path, change: dict[str, np.ndarray | None], message: str
) -> None:
    arrays = _dynamo_layout()
    for key, value in change.items():
        if value is None:
            del arrays[key]
        else:
            arrays[key] = value
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ProfileError, match=message) as info:
        load_profile(path)
    assert str(path) in str(info.value)


def test_unreadable_profiles(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="no such profile file"):
        load_profile(tmp_path / "absent.npz")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(broken)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip")
    with pytest.raises(ProfileError, match="not a readable NPZ"):
        load_profile(garbage)


def test_load_perf_model_defaults_to_the_polynomial(tmp_path: Path) -> None:
    model = load_perf_model(None, gpus_per_engine=8, kv_capacity_tokens=4096)
    assert isinstance(model, PolynomialPerfModel)
    assert (model.gpus_per_engine, model.kv_capacity_tokens) == (8, 4096)
    path = tmp_path / "p.npz"
    np.savez(path, **_dynamo_layout())
    assert isinstance(load_perf_model(path), InterpolatedPerfModel)


def test_decode_steps_in_array_math_equal_the_step_by_step_values() -> None:
    # fused decode steps take their times from decode_itl_many_ms: value for value decode_itl_ms
    active = np.arange(1, 400, dtype=np.int64) * 37 + 5
    interpolated = InterpolatedPerfModel(  # the base class's loop
        prefill_isl=(100.0, 200.0),
        prefill_ttft_ms=(1.0, 100.0),
        decode_active_kv_tokens=(1.0, 20_000.0),
        decode_context_length=(1.0, 2000.0),
        decode_itl=((5.0, 9.0), (7.0, 15.0)),
        kv_capacity_tokens=20_000,
    )
    for model in (PolynomialPerfModel(), interpolated):
        many = model.decode_itl_many_ms(active, sequences=37)
        one = [model.decode_itl_ms(active_kv_tokens=a, context_length=a / 37) for a in active.tolist()]
        assert many.tolist() == one
