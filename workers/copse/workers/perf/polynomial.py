"""The default perf model: two polynomials with documented constants."""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt

from copse.workers.perf.model import FloatArray, PerfModel


@dataclasses.dataclass(frozen=True, slots=True)
class PolynomialPerfModel(PerfModel):
    """Prefill and decode step times as low-order polynomials.

    * ``F(isl) = prefill_a * isl**2 + prefill_b * isl + prefill_c`` (ms);
    * ``ITL = max(min_itl_ms, decode_a * u**2 + decode_b * u + decode_c)`` (ms), where
      ``u = active_kv_tokens / kv_capacity_tokens`` is the KV cache utilisation. The default
      decode curve does not depend on the context length (only on total KV in use).

    The default constants are the ones NVIDIA Dynamo's mocker ships as its default model (one
    GPU per engine, 16,384 blocks of 64 tokens): a 4k-token prefill takes ~85 ms, a decode step
    5.7 ms when idle and 34 ms with a full cache.
    """

    prefill_a: float = 4.209989e-7
    """Quadratic prefill term (attention over the prompt), ms per token squared."""
    prefill_b: float = 1.518344e-2
    """Linear prefill term (weights and MLP per token), ms per token."""
    prefill_c: float = 16.50142
    """Fixed cost of a prefill step, ms."""
    decode_a: float = -25.74
    """Quadratic term of ITL in KV utilisation, ms."""
    decode_b: float = 54.01
    """Linear term of ITL in KV utilisation, ms."""
    decode_c: float = 5.74
    """ITL of an idle engine, ms."""
    min_itl_ms: float = 1.0
    """Floor on ITL so that extrapolation never yields a free or negative step."""
    kv_capacity_tokens: int = 16384 * 64
    """KV cache size in tokens; ``u`` is measured against it."""
    gpus_per_engine: int = 1
    """GPUs of one engine (tensor parallelism), dividing per-engine throughput."""

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens={self.kv_capacity_tokens} must be at least 1")
        if self.gpus_per_engine < 1:
            raise ValueError(f"gpus_per_engine={self.gpus_per_engine} must be at least 1")

    def prefill_curve_ms(self, isl: float) -> float:
        return (self.prefill_a * isl + self.prefill_b) * isl + self.prefill_c

    def decode_itl_ms(self, *, active_kv_tokens: float, context_length: float) -> float:
        u = active_kv_tokens / self.kv_capacity_tokens
        return max(self.min_itl_ms, (self.decode_a * u + self.decode_b) * u + self.decode_c)

    def decode_itl_many_ms(self, active_kv_tokens: npt.NDArray[np.int64], *, sequences: int) -> FloatArray:
        u = active_kv_tokens / self.kv_capacity_tokens
        out: FloatArray = np.maximum(self.min_itl_ms, (self.decode_a * u + self.decode_b) * u + self.decode_c)
        return out
