"""The shared perf model in the vectorised form a routing decision needs.

A decision evaluates decode step times for every worker at once; the perf model answers one
point per call. :class:`PerfTable` samples the model's ITL once on a grid (active KV tokens x
context length) and interpolates bilinearly with numpy, clamping outside the grid (the model's
own extrapolation is not needed for ranking workers). Prefill times are few distinct values per
decision (one per distinct cached-prefix length), so they come from the model itself.

:class:`WorkerCosts` holds the per-worker terms of the routing cost that depend on that worker's
in-flight load alone (its decode step time, whether it is saturated): they are recomputed when
some worker's load changed, not on every decision.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from copse.router.sequences import ActiveSequences
from copse.workers.perf import PerfModel

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


class PerfTable:
    """Vectorised ITL and exact prefill times of one :class:`PerfModel`."""

    __slots__ = (
        "_active",
        "_context",
        "_curve",
        "_curve_x",
        "_itl",
        "_itl_by_active",
        "f0",
        "kv_capacity_tokens",
        "model",
    )

    def __init__(
        self,
        model: PerfModel,
        *,
        max_context: int = 131072,
        active_points: int = 65,
        context_points: int = 33,
        curve_step: int = 16,
    ) -> None:
        self.model = model
        self._curve_x = np.arange(0.0, max_context + 1.0, float(curve_step))
        self._curve = np.array([model.prefill_curve_ms(float(x)) for x in self._curve_x])
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
        # Models whose ITL ignores the context length (the polynomial default) need one axis only.
        flat = bool(np.all(self._itl == self._itl[:, :1]))
        self._itl_by_active = self._itl[:, 0].copy() if flat else None

    def compute_ms(self, *, new_tokens: int, cached_tokens: int) -> float:
        """Compute time of prefilling ``new_tokens`` after ``cached_tokens``, without the fixed
        per-step cost ``f0`` (a prefill spanning several steps pays ``f0`` in each), ms."""
        curve = self.model.prefill_curve_ms
        return curve(float(cached_tokens + new_tokens)) - curve(float(cached_tokens))

    def prefill_curve_ms(self, tokens: FloatArray) -> FloatArray:
        """``F`` (:meth:`PerfModel.prefill_curve_ms`) for many token counts: exact at multiples of
        the sampling step (block sizes are), linear in between, clamped beyond the longest context."""
        out: FloatArray = np.interp(tokens, self._curve_x, self._curve)
        return out

    def itl_ms(self, active_kv_tokens: FloatArray, sequences: FloatArray) -> FloatArray:
        """Decode step time of each worker holding ``active_kv_tokens`` of KV over ``sequences``
        sequences (their mean context length is the ratio), ms."""
        active, context = self._active, self._context
        if self._itl_by_active is not None:
            flat: FloatArray = np.interp(active_kv_tokens, active, self._itl_by_active)
            return flat
        context_length = active_kv_tokens / np.maximum(sequences, 1.0)
        a = np.minimum(np.maximum(active_kv_tokens, active[0]), active[-1])
        c = np.minimum(np.maximum(context_length, context[0]), context[-1])
        i = np.minimum(active.searchsorted(a, side="right"), len(active) - 1)
        j = np.minimum(context.searchsorted(c, side="right"), len(context) - 1)
        a0 = active[i - 1]
        c0 = context[j - 1]
        s = (a - a0) / (active[i] - a0)
        t = (c - c0) / (context[j] - c0)
        grid = self._itl
        g00 = grid[i - 1, j - 1]
        g01 = grid[i - 1, j]
        low = g00 + t * (g01 - g00)
        g10 = grid[i, j - 1]
        high = g10 + t * (grid[i, j] - g10)
        out: FloatArray = low + s * (high - low)
        return out


class WorkerCosts:
    """Load-dependent cost terms per worker slot, brought up to date by :meth:`refresh` from the
    slots :class:`ActiveSequences` reports as changed (this object empties that set)."""

    __slots__ = (
        "_busy_kv_tokens",
        "_busy_prefill_tokens",
        "_decoding",
        "_perf",
        "_seq",
        "free",
        "step_ms",
        "version",
    )

    def __init__(
        self,
        sequences: ActiveSequences,
        perf: PerfTable,
        *,
        busy_prefill_tokens: float,
        busy_kv_tokens: float,
    ) -> None:
        self._seq = sequences
        self._perf = perf
        self._busy_prefill_tokens = busy_prefill_tokens
        self._busy_kv_tokens = busy_kv_tokens
        self.step_ms: FloatArray = np.zeros(0)
        """Time each prefill step of the worker takes beyond its prefill compute: the fixed step
        cost plus, while the worker has sequences decoding, their decode step, ms."""
        self.free: BoolArray = np.zeros(0, dtype=bool)
        """Workers below both busy thresholds (uncached prompt tokens to prefill, KV in use)."""
        self.version = 0
        """Incremented whenever an entry of :attr:`free` changes (callers cache masks built on it)."""
        self._decoding: BoolArray = np.zeros(0, dtype=bool)

    def refresh(self) -> None:
        """Bring every term up to date with the in-flight load."""
        seq = self._seq
        changed = seq.changed
        if not changed:
            return
        if len(self.step_ms) != seq.size:
            self.step_ms = np.zeros(seq.size)
            self.free = np.zeros(seq.size, dtype=bool)
            self._decoding = np.zeros(seq.size, dtype=bool)
            changed.update(range(seq.size))
            self.version += 1
        kv = seq.kv_tokens()
        prefill_tokens = seq.prefill_tokens
        free = self.free
        for slot in changed:
            now_free = not (
                prefill_tokens[slot] > self._busy_prefill_tokens or kv[slot] > self._busy_kv_tokens
            )
            if now_free != free[slot]:
                free[slot] = now_free
                self.version += 1
        changed.clear()
        perf = self._perf
        step = perf.itl_ms(kv, seq.requests)
        np.greater(seq.requests, seq.prefilling, out=self._decoding)
        np.multiply(step, self._decoding, out=self.step_ms)
        np.add(self.step_ms, perf.f0, out=self.step_ms)
