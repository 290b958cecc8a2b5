"""The shared perf model in the vectorised form a routing decision needs.

A decision evaluates decode step times for every worker at once; the perf model answers one
point per call. :class:`PerfTable` samples the model's ITL once on a grid (active KV tokens x
context length) and interpolates bilinearly with numpy, clamping outside the grid (the model's
own extrapolation is not needed for ranking workers). Prefill times are few distinct values per
decision (one per distinct cached-prefix length), so they come from the model itself.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from copse.workers.perf import PerfModel

FloatArray = npt.NDArray[np.float64]


class PerfTable:
    """Vectorised ITL and exact prefill times of one :class:`PerfModel`."""

    __slots__ = ("_active", "_context", "_itl", "f0", "kv_capacity_tokens", "model")

    def __init__(
        self,
        model: PerfModel,
        *,
        max_context: int = 131072,
        active_points: int = 65,
        context_points: int = 33,
    ) -> None:
        self.model = model
        self.kv_capacity_tokens = float(model.kv_capacity_tokens)
        """KV cache size of one worker, tokens."""
        self.f0 = model.prefill_curve_ms(0.0)
        """Fixed cost of a prefill step (ms)."""
        self._active = np.linspace(0.0, 1.25 * self.kv_capacity_tokens, active_points)
        self._context = np.geomspace(1.0, float(max_context), context_points)
        itl = model.decode_itl_ms
        self._itl = np.array(
            [
                [itl(active_kv_tokens=float(a), context_length=float(c)) for c in self._context]
                for a in self._active
            ]
        )

    def prefill_ms(self, *, new_tokens: int, cached_tokens: int) -> float:
        """Time to prefill ``new_tokens`` after ``cached_tokens`` (the model's own answer), ms."""
        curve = self.model.prefill_curve_ms
        return self.f0 + curve(float(cached_tokens + new_tokens)) - curve(float(cached_tokens))

    def itl_ms(self, active_kv_tokens: FloatArray, context_length: FloatArray) -> FloatArray:
        """Decode step time for each pair of (active KV tokens, mean context length), ms."""
        a = np.clip(active_kv_tokens, self._active[0], self._active[-1])
        c = np.clip(context_length, self._context[0], self._context[-1])
        i = np.clip(np.searchsorted(self._active, a, side="right") - 1, 0, len(self._active) - 2)
        j = np.clip(np.searchsorted(self._context, c, side="right") - 1, 0, len(self._context) - 2)
        a0, a1 = self._active[i], self._active[i + 1]
        c0, c1 = self._context[j], self._context[j + 1]
        s = (a - a0) / (a1 - a0)
        t = (c - c0) / (c1 - c0)
        grid = self._itl
        low = grid[i, j] + t * (grid[i, j + 1] - grid[i, j])
        high = grid[i + 1, j] + t * (grid[i + 1, j + 1] - grid[i + 1, j])
        out: FloatArray = low + s * (high - low)
        return out
