"""A perf model interpolated from a measured profile (the layout NVIDIA Dynamo's profiler writes)."""

from __future__ import annotations

import bisect
import dataclasses
import itertools

from copse.workers.perf.model import PerfModel


def _segment(axis: tuple[float, ...], x: float) -> tuple[int, float]:
    """Index ``i`` of the segment ``[axis[i], axis[i+1]]`` used for ``x`` and the position within it.

    Outside the axis the edge segment is used, so the position is below 0 or above 1: that is
    linear extrapolation.
    """
    i = min(max(bisect.bisect_right(axis, x) - 1, 0), len(axis) - 2)
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])


@dataclasses.dataclass(frozen=True, slots=True)
class InterpolatedPerfModel(PerfModel):
    """Prefill time interpolated linearly over ISL, decode ITL bilinearly over (active KV tokens,
    context length).

    Outside the measured grid values are extrapolated linearly from the edge segment, then
    clamped: prefill time never below 0, and ITL never below the fastest step measured (an idle
    engine cannot step faster than anything profiled).
    """

    prefill_isl: tuple[float, ...]
    """Prompt lengths profiled (strictly increasing, at least two)."""
    prefill_ttft_ms: tuple[float, ...]
    """TTFT measured for a lone request at each ``prefill_isl``, ms."""
    decode_active_kv_tokens: tuple[float, ...]
    """Total KV tokens in the decode batch, first grid axis (strictly increasing, at least two)."""
    decode_context_length: tuple[float, ...]
    """Mean context length of the decode batch, second grid axis (strictly increasing, at least two)."""
    decode_itl: tuple[tuple[float, ...], ...]
    """ITL in ms, ``decode_itl[i][j]`` at ``decode_active_kv_tokens[i]`` and ``decode_context_length[j]``."""
    kv_capacity_tokens: int
    """KV cache size in tokens; bounds the decode batch in derived figures."""
    gpus_per_engine: int = 1
    """GPUs of the profiled engine (tensor parallelism), dividing per-engine throughput."""
    _min_itl_ms: float = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("prefill_isl", "decode_active_kv_tokens", "decode_context_length"):
            axis: tuple[float, ...] = getattr(self, name)
            if len(axis) < 2:
                raise ValueError(f"{name} needs at least two points, got {len(axis)}")
            if any(b <= a for a, b in itertools.pairwise(axis)):
                raise ValueError(f"{name} must be strictly increasing, got {list(axis)}")
        if len(self.prefill_ttft_ms) != len(self.prefill_isl):
            raise ValueError(
                f"prefill_ttft_ms has {len(self.prefill_ttft_ms)} values"
                f" for {len(self.prefill_isl)} prefill_isl points"
            )
        rows, cols = len(self.decode_active_kv_tokens), len(self.decode_context_length)
        if len(self.decode_itl) != rows or any(len(row) != cols for row in self.decode_itl):
            raise ValueError(
                f"decode_itl must be {rows}x{cols} (decode_active_kv_tokens x decode_context_length)"
            )
        if self.kv_capacity_tokens < 1:
            raise ValueError(f"kv_capacity_tokens={self.kv_capacity_tokens} must be at least 1")
        if self.gpus_per_engine < 1:
            raise ValueError(f"gpus_per_engine={self.gpus_per_engine} must be at least 1")
        object.__setattr__(self, "_min_itl_ms", min(min(row) for row in self.decode_itl))

    def prefill_curve_ms(self, isl: float) -> float:
        i, t = _segment(self.prefill_isl, isl)
        ys = self.prefill_ttft_ms
        return max(0.0, ys[i] + t * (ys[i + 1] - ys[i]))

    def decode_itl_ms(self, *, active_kv_tokens: float, context_length: float) -> float:
        i, s = _segment(self.decode_active_kv_tokens, active_kv_tokens)
        j, t = _segment(self.decode_context_length, context_length)
        grid = self.decode_itl
        low = grid[i][j] + t * (grid[i][j + 1] - grid[i][j])
        high = grid[i + 1][j] + t * (grid[i + 1][j + 1] - grid[i + 1][j])
        return max(self._min_itl_ms, low + s * (high - low))
