"""Shared fixtures of the planner tests: a perf model simple enough to compute by hand."""

from __future__ import annotations

import dataclasses

import pytest

from copse.planner.capacity import CapacityModel
from copse.workers.perf import PerfModel


@dataclasses.dataclass(frozen=True)
class LinearPerf(PerfModel):
    """F(isl) = 10 + 0.01 * isl ms; a decode step takes 10 ms plus 0.1 ms per sequence."""

    kv_capacity_tokens: int = 100_000
    gpus_per_engine: int = 1

    def prefill_curve_ms(self, isl: float) -> float:
        return 10.0 + 0.01 * isl

    def decode_itl_ms(self, *, active_kv_tokens: float, context_length: float) -> float:
        return 10.0 + 0.1 * active_kv_tokens / context_length


@pytest.fixture
def linear() -> CapacityModel:
    """Capacity over :class:`LinearPerf` with batches of at most 64 sequences."""
    return CapacityModel(LinearPerf(), max_num_seqs=64)
