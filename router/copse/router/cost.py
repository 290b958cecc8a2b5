"""The shared perf model in the form a routing decision needs.

The perf model answers one point per call. :class:`PerfTable` samples the model's ITL once on a
grid (active KV tokens x context length) and interpolates bilinearly, clamping outside the grid
(the model's own extrapolation is not needed for ranking workers), and samples the prefill curve
at every multiple of 16 tokens. The compiled load table evaluates these per worker
(:class:`copse.router.loops.Curve` and :class:`~copse.router.loops.Grid`, the same arithmetic
as numpy's); the decode cost of a request evaluates all workers at once with numpy.

:class:`WorkerCosts` keeps the per-worker terms of the routing cost that depend on that worker's
in-flight load alone (its decode step time, whether it is saturated): they are recomputed when
some worker's load changed, not on every decision.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from copse.router import loops
from copse.router.sequences import ActiveSequences
from copse.workers.perf import PerfModel

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


class PerfTable:
    """Interpolated ITL and prefill times of one :class:`PerfModel`."""

    __slots__ = (
        "_active",
        "_context",
        "_curve_x",
        "_curve_y",
        "_itl",
        "_itl_flat",
        "f0",
        "itl",
        "kv_capacity_tokens",
        "model",
        "prefill_curve",
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
        curve_y = np.array([model.prefill_curve_ms(float(x)) for x in curve_x])
        self._curve_x, self._curve_y = curve_x, curve_y
        self.prefill_curve = loops.Curve(curve_x, curve_y)
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
        self._itl_flat = bool(np.all(self._itl == self._itl[:, :1]))
        self.itl: loops.Curve | loops.Grid = (
            loops.Curve(self._active, np.ascontiguousarray(self._itl[:, 0]))
            if self._itl_flat
            else loops.Grid(self._active, self._context, self._itl)
        )
        """Decode step time of one worker: ``itl(active_kv_tokens)`` (a Curve) when the model ignores
        the context length, else ``itl(active_kv_tokens, sequences)`` (a Grid); as :meth:`itl_ms`."""

    def compute_ms(self, *, new_tokens: int, cached_tokens: int) -> float:
        """Compute time of prefilling ``new_tokens`` after ``cached_tokens``, without the fixed
        per-step cost ``f0`` (a prefill spanning several steps pays ``f0`` in each), ms."""
        curve = self.model.prefill_curve_ms
        return curve(float(cached_tokens + new_tokens)) - curve(float(cached_tokens))

    def compute_ms_array(self, *, new_tokens: FloatArray, total_tokens: float | FloatArray) -> FloatArray:
        """:meth:`compute_ms` of prefilling the last ``new_tokens`` (one figure per worker) of a
        ``total_tokens`` prompt, from the sampled curve, ms."""
        xs, ys = self._curve_x, self._curve_y
        out: FloatArray = np.interp(total_tokens, xs, ys) - np.interp(total_tokens - new_tokens, xs, ys)
        return out

    def itl_ms(self, active_kv_tokens: FloatArray, sequences: FloatArray) -> FloatArray:
        """Decode step time of each worker holding ``active_kv_tokens`` of KV over ``sequences``
        sequences (their mean context length is the ratio), ms."""
        if self._itl_flat:
            flat: FloatArray = np.interp(active_kv_tokens, self._active, self._itl[:, 0])
            return flat
        grid = self.itl
        assert isinstance(grid, loops.Grid)
        out: FloatArray = np.empty(len(active_kv_tokens))
        grid.fill(
            np.ascontiguousarray(active_kv_tokens, dtype=np.float64),
            np.ascontiguousarray(sequences, dtype=np.float64),
            out,
        )
        return out


class WorkerCosts:
    """Load-dependent cost terms per worker slot (rows of the tracker's columns, computed by its
    compiled load table), brought up to date by :meth:`refresh` from the slots
    :class:`ActiveSequences` reports as changed (this object empties that set)."""

    __slots__ = ("_busy_kv_tokens", "_busy_prefill_tokens", "_perf", "_seq", "_size", "version")

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
        self._size = 0
        self.version = 0
        """Incremented whenever an entry of :attr:`free` changes (callers cache masks built on it)."""

    @property
    def step_ms(self) -> FloatArray:
        """Time each prefill step of the worker takes beyond its prefill compute: the fixed step
        cost plus, while the worker has sequences decoding, their decode step, ms."""
        return self._seq.step_ms

    @property
    def free(self) -> BoolArray:
        """Workers below both busy thresholds (uncached prompt tokens to prefill, KV in use)."""
        flags: BoolArray = self._seq.free_flags != 0.0
        return flags

    def refresh(self) -> None:
        """Bring every term up to date with the in-flight load."""
        seq = self._seq
        changed = seq.changed
        if not changed:
            return
        if seq.size != self._size:
            self._size = seq.size
            changed.update(range(seq.size))
            self.version += 1
        perf = self._perf
        self.version += seq.load.refresh(
            changed, perf.itl, perf.f0, self._busy_prefill_tokens, self._busy_kv_tokens
        )
        changed.clear()
