"""Cost terms: the interpolants (compiled and in Python) against numpy, and the per-worker terms
kept up to date incrementally."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from copse.router import _pyloops, loops
from copse.router.cost import PerfTable, WorkerCosts
from copse.router.sequences import ActiveSequences
from copse.workers.perf import InterpolatedPerfModel, PolynomialPerfModel

from .test_native import IMPLEMENTATIONS

_XS = np.array([0.0, 16.0, 32.0, 100.0, 1000.0, 4096.5])
_YS = np.array([3.0, 3.5, 4.25, 9.0, 70.0, 400.0])

# ITL that grows with the context length too: PerfTable evaluates it on a grid.
_CONTEXT_MODEL = InterpolatedPerfModel(
    prefill_isl=(1.0, 1024.0, 131072.0),
    prefill_ttft_ms=(5.0, 60.0, 9000.0),
    decode_active_kv_tokens=(0.0, 65536.0, 1048576.0),
    decode_context_length=(1.0, 4096.0, 131072.0),
    decode_itl=((6.0, 7.0, 9.5), (8.0, 10.0, 13.0), (20.0, 26.0, 40.0)),
    kv_capacity_tokens=1048576,
)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@settings(max_examples=300, deadline=None)
@given(x=st.one_of(st.floats(-100.0, 5000.0, allow_nan=False), st.sampled_from(_XS.tolist())))
def test_curve_is_np_interp_to_the_bit(impl: ModuleType, x: float) -> None:
    assert impl.Curve(_XS, _YS)(x) == float(np.interp(x, _XS, _YS))


@settings(max_examples=300, deadline=None)
@given(
    active=st.one_of(st.floats(-10.0, 2e6, allow_nan=False), st.just(65536.0)),
    sequences=st.floats(0.0, 600.0, allow_nan=False),
)
def test_grid_is_the_numpy_bilinear_to_the_bit(active: float, sequences: float) -> None:
    perf = PerfTable(_CONTEXT_MODEL)
    assert isinstance(perf.itl, loops.Grid)
    want = float(perf.itl_ms(np.array([active]), np.array([sequences]))[0])
    assert perf.itl(active, sequences) == want


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@settings(max_examples=100, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(st.floats(-10.0, 2e6, allow_nan=False), st.floats(0.0, 600.0, allow_nan=False)),
        max_size=40,
    )
)
def test_grid_fill_is_the_numpy_bilinear_to_the_bit(
    impl: ModuleType, pairs: list[tuple[float, float]]
) -> None:
    perf = PerfTable(_CONTEXT_MODEL)
    active = np.array([a for a, _ in pairs], dtype=np.float64)
    sequences = np.array([s for _, s in pairs], dtype=np.float64)
    grid = impl.Grid(perf._active, perf._context, perf._itl)
    out = np.full(len(pairs), np.nan)
    grid.fill(active, sequences, out)
    want = _pyloops.bilinear(perf._active, perf._context, perf._itl, active, sequences)
    assert out.tobytes() == want.tobytes()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_grid_fill_refuses_arrays_of_other_lengths(impl: ModuleType) -> None:
    perf = PerfTable(_CONTEXT_MODEL)
    grid = impl.Grid(perf._active, perf._context, perf._itl)
    with pytest.raises(ValueError, match="same length"):
        grid.fill(np.zeros(3), np.zeros(2), np.zeros(3))
    with pytest.raises(TypeError, match="out must be a contiguous 1-d float64 array"):
        grid.fill(np.zeros(3), np.zeros(3), np.zeros(3, dtype=np.float32))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bad_curves_are_refused(impl: ModuleType) -> None:
    with pytest.raises(ValueError, match="as many ys as xs"):
        impl.Curve(_XS, _YS[:-1])
    with pytest.raises(ValueError, match=r"curve xs must increase, but xs\[2\] <= xs\[1\]"):
        impl.Curve(np.array([0.0, 16.0, 16.0]), np.zeros(3))


@pytest.mark.parametrize("model", [PolynomialPerfModel(), _CONTEXT_MODEL], ids=["flat", "context"])
def test_worker_terms_follow_each_change_of_load(model: PolynomialPerfModel | InterpolatedPerfModel) -> None:
    perf = PerfTable(model)
    seq = ActiveSequences(block_size=16, slots=2)
    costs = WorkerCosts(seq, perf, busy_prefill_tokens=1000, busy_kv_tokens=1e9)
    costs.refresh()
    assert costs.step_ms[:2].tolist() == [perf.f0, perf.f0]
    assert costs.free[:2].tolist() == [True, True]

    seq.add("a", slot=1, hashes=[1, 2], prefill_tokens=2000, prefill_ms=50.0, kv_tokens=10.0, now=0.0)
    version = costs.version
    costs.refresh()
    assert costs.free[:2].tolist() == [True, False]  # over the prefill threshold
    assert costs.version > version
    assert costs.step_ms[1] == perf.f0  # nothing decodes yet

    seq.prefill_done("a", now=0.1)
    costs.refresh()
    assert costs.free[1]
    kv = 2 * 16 + 10.0
    assert costs.step_ms[1] == perf.f0 + float(perf.itl_ms(np.array([kv]), np.array([1.0]))[0])

    seq.add("b", slot=40, hashes=[3], prefill_tokens=1, prefill_ms=1.0, kv_tokens=0.0, now=0.2)
    costs.refresh()  # the arrays grow with the tracker's
    assert len(costs.step_ms) == seq.size
    assert costs.free[40]
