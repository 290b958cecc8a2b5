"""Request traces (Mooncake JSONL, Azure CSV) and the token ids synthesised for them.

Mooncake traces give one hash id per ``trace_block_size`` (512) prompt tokens, prefix-chained:
equal ids mean equal prefixes. Text is withheld, so each hash id is given ``trace_block_size``
deterministic token ids (a function of the seed, the id and the position in the block): requests
that share ids share token prefixes, and so share engine blocks whenever the engine block size
divides the trace block size. Azure traces carry no prefix information: every request gets
tokens of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from copse.workers.protocol.tokenizer import RESERVED_IDS, VOCAB_SIZE
from copse.workers.traces import TRACE_FORMATS, TraceError, TraceFormat, read_trace

__all__ = ["TRACE_FORMATS", "TokenSynth", "TraceError", "TraceFormat", "TraceRequest", "load_trace"]

#: Hash ids given to Azure requests start here, above any id a Mooncake trace uses.
_AZURE_ID_BASE = 1 << 48


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: float
    """Arrival, ms after the trace's start."""
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    """One id per ``trace_block_size`` prompt tokens; the last block may be partial."""


def load_trace(
    path: str | Path, *, fmt: TraceFormat = "mooncake", trace_block_size: int = 512
) -> list[TraceRequest]:
    """Every request of a trace, sorted by arrival (stable). Raises :class:`TraceError`.

    Every request generates at least one token; requests without hash ids (Azure) get blocks of
    their own.
    """
    trace = read_trace(path, fmt=fmt, block_tokens=trace_block_size)
    requests = []
    for index, record in enumerate(trace.records):
        hash_ids = record.hash_ids
        if hash_ids is None:
            base = _AZURE_ID_BASE + index * (1 << 20)
            hash_ids = tuple(range(base, base + -(-record.input_length // trace_block_size)))
        requests.append(
            TraceRequest(
                timestamp_ms=record.timestamp_ms,
                input_length=record.input_length,
                output_length=max(1, record.output_length),
                hash_ids=hash_ids,
            )
        )
    return requests


def offline_bound(trace: Sequence[TraceRequest], *, trace_block_size: int = 512) -> tuple[float, float]:
    """(block hit rate, prompt-token hit rate) of one infinite prefix cache seeing every request of
    ``trace`` in order (the first sight of a block always misses): what no fleet of finite caches
    can beat."""
    seen: set[int] = set()
    blocks = hit_blocks = tokens = hit_tokens = 0
    for request in trace:
        for position, block in enumerate(request.hash_ids):
            size = min(trace_block_size, request.input_length - position * trace_block_size)
            blocks += 1
            tokens += size
            if block in seen:
                hit_blocks += 1
                hit_tokens += size
            seen.add(block)
    return (hit_blocks / blocks if blocks else 0.0), (hit_tokens / tokens if tokens else 0.0)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0x94D049BB133111EB)
_SHIFT_MIX = np.uint64(31)
_SHIFT_OUT = np.uint64(17)
#: OR-ing a uint64 below 2**52 into these exponent bits gives the float64 ``2**52 + value``.
_EXPONENT_52 = np.uint64(0x4330000000000000)
_TWO_52 = float(2**52)
_SPAN = float(VOCAB_SIZE - RESERVED_IDS)


class TokenSynth:
    """Deterministic token ids for trace hash ids: the same (seed, id, position) always gives the
    same token, in ``[RESERVED_IDS, VOCAB_SIZE)`` like the mocked engines' tokenizer."""

    def __init__(self, *, seed: int, trace_block_size: int) -> None:
        self.trace_block_size = trace_block_size
        self._seed = np.uint64((seed * 0xD1B54A32D192ED03 + 1) & (2**64 - 1))
        self._positions = np.arange(trace_block_size, dtype=np.uint64) * _MIX

    def tokens(self, hash_ids: Sequence[int], length: int) -> npt.NDArray[np.uint32]:
        """The first ``length`` token ids of a prompt made of the blocks ``hash_ids``."""
        ids = np.asarray(hash_ids, dtype=np.uint64)
        with np.errstate(over="ignore"):
            # A multiply-xorshift of (id, position): distinct pairs give unrelated tokens.
            x = np.add.outer(ids * _GOLDEN + self._seed, self._positions).reshape(-1)[:length]
            x ^= x >> _SHIFT_MIX
            x *= _GOLDEN
            x >>= _SHIFT_OUT
        # x % span + RESERVED_IDS in float64, a third faster than a uint64 modulo and exact: x < 2**47
        # converts exactly, and x / span (correctly rounded) is never rounded up to an integer, as
        # it is at least 1 / span below the next one while its ulp is below 2**-20.
        x |= _EXPONENT_52
        f = x.view(np.float64)
        f -= _TWO_52
        quotient = f / _SPAN
        np.floor(quotient, out=quotient)
        quotient *= _SPAN
        f -= quotient
        f += _TWO_52 + RESERVED_IDS  # the float 2**52 + token, whose low 32 bits are the token
        out: npt.NDArray[np.uint32] = f.view(np.uint64).astype(np.uint32)
        return out
