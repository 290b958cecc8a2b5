"""Cost terms: the scalar interpolation and the per-worker terms kept up to date incrementally."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from copse.router.cost import Interpolant, PerfTable, WorkerCosts
from copse.router.sequences import ActiveSequences
from copse.workers.perf import PolynomialPerfModel

_XS = np.array([0.0, 16.0, 32.0, 100.0, 1000.0, 4096.5])
_YS = np.array([3.0, 3.5, 4.25, 9.0, 70.0, 400.0])


@settings(max_examples=300, deadline=None)
@given(x=st.one_of(st.floats(-100.0, 5000.0, allow_nan=False), st.sampled_from(_XS.tolist())))
def test_interpolant_is_np_interp_to_the_bit(x: float) -> None:
    curve = Interpolant(_XS, _YS)
    assert curve(x) == float(np.interp(x, _XS, _YS))
    assert curve.many(np.array([x])).tolist() == [curve(x)]


def test_worker_terms_follow_each_change_of_load() -> None:
    perf = PerfTable(PolynomialPerfModel())
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
