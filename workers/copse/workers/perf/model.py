"""The perf model interface: step times of an engine, and the capacity figures derived from them.

One model answers three callers so that they agree: the mocker (how long a step takes),
the router (what a candidate worker's TTFT would be) and the planner (tokens/s per GPU).

Two primitives define a model:

* ``prefill_curve_ms(isl)`` -- the time to prefill ``isl`` uncached tokens in one step
  (what a profiler measures as TTFT of a lone request), written ``F(isl)`` below;
* ``decode_itl_ms(active_kv_tokens=, context_length=)`` -- the time of one decode step of a
  batch holding ``active_kv_tokens`` tokens of KV in total, at a mean context length.

Prefill with a cached prefix, chunked prefill and batched prefill all follow from ``F`` by
treating it as a cumulative cost: computing tokens ``[c, c+n)`` costs ``F(c+n) - F(c)``, and a
step pays the fixed overhead ``F(0)`` once. So a lone uncached prompt costs exactly ``F(isl)``,
a prompt split into chunks costs ``F(isl)`` plus one overhead per extra step, and attention
over the cached prefix is still paid (``F`` is superlinear).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

#: Most batch sizes evaluated when searching for the best decode point; beyond this the search
#: samples batch sizes evenly, which is exact for monotone ITL curves and close otherwise.
_DECODE_SEARCH_POINTS = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class DecodePoint:
    """An operating point of a decode engine: a batch size and what it yields."""

    batch_size: int
    """Concurrent sequences decoding, each at the requested context length."""
    itl_ms: float
    """Inter-token latency of one decode step at this batch size."""
    tokens_per_s_per_gpu: float
    """Output tokens per second of the whole engine divided by its GPU count."""


class PerfModel(ABC):
    """Step-time model of one engine (a tensor-parallel group of ``gpus_per_engine`` GPUs)."""

    gpus_per_engine: int
    """GPUs of one engine (tensor parallelism), so that per-GPU throughput compares across TP sizes."""
    kv_capacity_tokens: int
    """Tokens of KV cache the engine holds; bounds the decode batch."""

    @abstractmethod
    def prefill_curve_ms(self, isl: float) -> float:
        """Time to prefill ``isl`` uncached tokens of one request in one step (``F(isl)``), ms."""

    @abstractmethod
    def decode_itl_ms(self, *, active_kv_tokens: float, context_length: float) -> float:
        """Time of one decode step, ms, for a batch holding ``active_kv_tokens`` tokens of KV at
        mean ``context_length``."""

    def decode_itl_many_ms(self, active_kv_tokens: npt.NDArray[np.int64], *, sequences: int) -> FloatArray:
        """:meth:`decode_itl_ms` of ``sequences`` sequences holding each of ``active_kv_tokens``
        (a run of decode steps), value for value the same; models override it with array math."""
        return np.array(
            [
                self.decode_itl_ms(active_kv_tokens=active, context_length=active / sequences)
                for active in active_kv_tokens.tolist()
            ],
            dtype=np.float64,
        )

    def prefill_ms(self, *, new_tokens: int, cached_tokens: int = 0) -> float:
        """Time to prefill ``new_tokens`` of one request after ``cached_tokens`` already in KV, ms."""
        return self.prefill_batch_ms(chunks=((new_tokens, cached_tokens),))

    def prefill_batch_ms(self, *, chunks: Sequence[tuple[int, int]]) -> float:
        """Time of the prefill part of one step, ms.

        ``chunks`` holds one ``(new_tokens, cached_tokens)`` pair per request prefilled in the
        step, ``cached_tokens`` counting every token already in KV (prefix hits and earlier
        chunks). An empty batch takes no time.
        """
        if not chunks:
            return 0.0
        curve = self.prefill_curve_ms
        total = curve(0.0)
        for new_tokens, cached_tokens in chunks:
            if new_tokens < 0 or cached_tokens < 0:
                raise ValueError(f"prefill chunk ({new_tokens}, {cached_tokens}) has a negative count")
            total += curve(float(cached_tokens + new_tokens)) - curve(float(cached_tokens))
        return total

    def prefill_tokens_per_s_per_gpu(self, *, isl: int, cached_tokens: int = 0) -> float:
        """Prefill throughput, in newly computed tokens per second per GPU, for requests of
        ``isl`` tokens of which ``cached_tokens`` hit the prefix cache, prefilled one at a time."""
        if not 0 <= cached_tokens < isl:
            raise ValueError(f"cached_tokens={cached_tokens} must lie in [0, isl={isl})")
        new_tokens = isl - cached_tokens
        ms = self.prefill_ms(new_tokens=new_tokens, cached_tokens=cached_tokens)
        return new_tokens * 1000.0 / ms / self.gpus_per_engine

    def best_decode_point(
        self, *, itl_ms: float, context_length: int, max_num_seqs: int | None = None
    ) -> DecodePoint | None:
        """The batch size with the most output tokens/s whose ITL stays within ``itl_ms``,
        with every sequence at ``context_length`` tokens; ``None`` if even one sequence is too slow
        or does not fit in the KV cache."""
        if context_length < 1:
            raise ValueError(f"context_length={context_length} must be at least 1")
        largest = self.kv_capacity_tokens // context_length
        if max_num_seqs is not None:
            largest = min(largest, max_num_seqs)
        if largest < 1:
            return None
        if largest <= _DECODE_SEARCH_POINTS:
            batches: Sequence[int] = range(1, largest + 1)
        else:
            batches = np.unique(
                np.linspace(1, largest, _DECODE_SEARCH_POINTS).round().astype(np.int64)
            ).tolist()
        best: DecodePoint | None = None
        for batch in batches:
            step = self.decode_itl_ms(
                active_kv_tokens=float(batch * context_length), context_length=context_length
            )
            if step > itl_ms:
                continue
            rate = batch * 1000.0 / step / self.gpus_per_engine
            if best is None or rate > best.tokens_per_s_per_gpu:
                best = DecodePoint(batch_size=batch, itl_ms=step, tokens_per_s_per_gpu=rate)
        return best

    def best_decode_tokens_per_s_per_gpu(
        self, *, itl_ms: float, context_length: int, max_num_seqs: int | None = None
    ) -> float:
        """Output tokens/s per GPU at :meth:`best_decode_point`; 0.0 when no batch meets ``itl_ms``."""
        point = self.best_decode_point(
            itl_ms=itl_ms, context_length=context_length, max_num_seqs=max_num_seqs
        )
        return 0.0 if point is None else point.tokens_per_s_per_gpu
