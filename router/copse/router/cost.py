"""The shared perf model in the form a routing decision needs.

The perf model answers one point per call. :class:`PerfTable` samples the model's ITL once on a
grid (active KV tokens x context length) and interpolates bilinearly with numpy, clamping outside
the grid (the model's own extrapolation is not needed for ranking workers), and samples the
prefill curve at every multiple of 16 tokens. A decision needs these at a few points each (one per
changed worker, one per distinct cached-prefix length), where :class:`Interpolant` answers
without numpy's per-call overhead; the decode cost of a request evaluates all workers at once.

:class:`WorkerCosts` holds the per-worker terms of the routing cost that depend on that worker's
in-flight load alone (its decode step time, whether it is saturated): they are recomputed when
some worker's load changed, not on every decision.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np
import numpy.typing as npt

from copse.router.sequences import ActiveSequences
from copse.workers.perf import PerfModel

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


class Interpolant:
    """The piecewise-linear function through ``(xs[i], ys[i])`` (``xs`` increasing), constant
    beyond the ends: ``np.interp`` for many points, and for one point the same arithmetic (the
    same result to the bit) in plain floats, without numpy's per-call overhead."""

    __slots__ = ("_slope_list", "_x_list", "_y_list", "slopes", "xs", "ys")

    def __init__(self, xs: FloatArray, ys: FloatArray) -> None:
        self.xs = np.ascontiguousarray(xs, dtype=np.float64)
        self.ys = np.ascontiguousarray(ys, dtype=np.float64)
        self.slopes: FloatArray = (self.ys[1:] - self.ys[:-1]) / (self.xs[1:] - self.xs[:-1])
        """Slope of each piece (what compiled callers evaluate the function with)."""
        self._x_list: list[float] = self.xs.tolist()
        self._y_list: list[float] = self.ys.tolist()
        self._slope_list: list[float] = self.slopes.tolist()

    def many(self, x: FloatArray) -> FloatArray:
        """The function at every point of ``x``."""
        out: FloatArray = np.interp(x, self.xs, self.ys)
        return out

    def __call__(self, x: float) -> float:
        xs, ys = self._x_list, self._y_list
        if x >= xs[-1]:
            return ys[-1]
        if x <= xs[0]:
            return ys[0]
        i = bisect_right(xs, x) - 1
        if xs[i] == x:
            return ys[i]
        return self._slope_list[i] * (x - xs[i]) + ys[i]


class PerfTable:
    """Interpolated ITL and prefill times of one :class:`PerfModel`."""

    __slots__ = (
        "_active",
        "_context",
        "_itl",
        "_itl_by_active",
        "f0",
        "kv_capacity_tokens",
        "model",
        "prefill_curve_ms",
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
        curve_x = np.arange(0.0, max_context + 1.0, float(curve_step))
        self.prefill_curve_ms = Interpolant(
            curve_x, np.array([model.prefill_curve_ms(float(x)) for x in curve_x])
        )
        """``F`` (:meth:`PerfModel.prefill_curve_ms`) by token count: exact at multiples of the
        sampling step (block sizes are), linear in between, constant beyond the longest context."""
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
        self._itl_by_active = Interpolant(self._active, self._itl[:, 0]) if flat else None

    def compute_ms(self, *, new_tokens: int, cached_tokens: int) -> float:
        """Compute time of prefilling ``new_tokens`` after ``cached_tokens``, without the fixed
        per-step cost ``f0`` (a prefill spanning several steps pays ``f0`` in each), ms."""
        curve = self.model.prefill_curve_ms
        return curve(float(cached_tokens + new_tokens)) - curve(float(cached_tokens))

    def itl_ms_at(self, active_kv_tokens: float, sequences: float) -> float:
        """:meth:`itl_ms` of one worker."""
        if self._itl_by_active is not None:
            return self._itl_by_active(active_kv_tokens)
        return float(self.itl_ms(np.array([active_kv_tokens]), np.array([sequences]))[0])

    def itl_ms(self, active_kv_tokens: FloatArray, sequences: FloatArray) -> FloatArray:
        """Decode step time of each worker holding ``active_kv_tokens`` of KV over ``sequences``
        sequences (their mean context length is the ratio), ms."""
        active, context = self._active, self._context
        if self._itl_by_active is not None:
            return self._itl_by_active.many(active_kv_tokens)
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

    def refresh(self) -> None:
        """Bring every term up to date with the in-flight load."""
        seq = self._seq
        changed = seq.changed
        if not changed:
            return
        if len(self.step_ms) != seq.size:
            self.step_ms = np.zeros(seq.size)
            self.free = np.zeros(seq.size, dtype=bool)
            changed.update(range(seq.size))
            self.version += 1
        kv, requests, prefilling = seq.kv_tokens(), seq.requests, seq.prefilling
        prefill_tokens = seq.prefill_tokens
        step, free = self.step_ms, self.free
        itl, f0 = self._perf.itl_ms_at, self._perf.f0
        busy_prefill, busy_kv = self._busy_prefill_tokens, self._busy_kv_tokens
        for slot in changed:
            active_kv, sequences = kv.item(slot), requests.item(slot)
            # The decode step joins every prefill step while some sequence decodes.
            step[slot] = f0 + itl(active_kv, sequences) if sequences > prefilling.item(slot) else f0
            now_free = not (prefill_tokens.item(slot) > busy_prefill or active_kv > busy_kv)
            if now_free is not free.item(slot):
                free[slot] = now_free
                self.version += 1
        changed.clear()
