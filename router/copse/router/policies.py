"""Worker selection policies, by name.

Every policy sees the same :class:`Selection`: the request, the eligible workers (right role,
not busy) with how many leading prompt blocks each holds, and the in-flight load the router
tracks. It returns the position of its choice among the eligible workers.

* ``kv`` (default): the predicted latency of this request on each worker, from the shared perf
  model: its time to first token (the worker's prefill backlog, then the prefill of the prompt
  tokens the worker does not hold, with every step of it also paying the worker's current decode
  step) plus its decode time (output tokens x the decode step time once its KV joins the worker's).
  The minimum wins; a softmax temperature spreads near-ties.
* ``dynamo``: NVIDIA Dynamo's default cost, ``overlap_weight x prefill blocks + decode blocks``
  with weight 1, ties to the worker holding fewest blocks.
* ``prefix_only``: the longest cached prefix, ties at random.
* ``least_loaded``: the fewest in-flight requests, ties at random.
* ``round_robin`` and ``random``: ignore caches and load.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from copse.router.cost import FloatArray, PerfTable
from copse.router.indexer import Indexer
from copse.router.sequences import ActiveSequences

IntArray = npt.NDArray[np.int64]


@dataclasses.dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router knows of a request when it routes it."""

    request_id: str
    hashes: Sequence[int]
    """Chained block hashes of the prompt's full blocks, at the router's block size."""
    prompt_tokens: int
    """Prompt length in tokens (the partial last block included)."""
    max_tokens: int
    """Output tokens expected (the request's ``max_tokens``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class SelectionSettings:
    """Knobs of the cost functions."""

    block_size: int
    """Tokens per block of the hashes the indexer holds."""
    max_num_batched_tokens: int = 8192
    """Per-step token budget of the engines: a prefill of N tokens spans ceil(N / budget) steps."""
    temperature: float = 0.0
    """Softmax temperature over costs normalised by their spread; 0 picks the minimum."""
    decode_weight: float = 1.0
    """Weight of the predicted decode time against the time to first token in the ``kv`` cost."""
    overlap_weight: float = 1.0
    """Weight of prefill blocks in the ``dynamo`` cost."""


@dataclasses.dataclass(slots=True)
class Selection:
    """One decision's inputs."""

    request: RouteRequest
    slots: IntArray
    """Eligible worker slots."""
    overlaps: FloatArray
    """Leading prompt blocks each eligible worker holds (aligned with ``slots``)."""
    sequences: ActiveSequences
    indexer: Indexer
    perf: PerfTable
    settings: SelectionSettings
    rng: random.Random
    now: float
    """Seconds on the caller's clock (the backlog of a worker decays with it)."""

    def subset(self, position: int) -> Selection:
        """The same decision restricted to the eligible worker at ``position``."""
        return dataclasses.replace(
            self, slots=self.slots[position : position + 1], overlaps=self.overlaps[position : position + 1]
        )

    def cached_tokens(self) -> FloatArray:
        """Prompt tokens each eligible worker would not have to compute (at least one token is)."""
        request = self.request
        out: FloatArray = np.minimum(self.overlaps * self.settings.block_size, request.prompt_tokens - 1)
        return np.maximum(out, 0.0)

    def shared_active_blocks(self) -> FloatArray:
        """Leading prompt blocks already in use by in-flight requests on each eligible worker."""
        out = np.zeros(len(self.slots))
        hashes = self.request.hashes
        for position in np.flatnonzero(self.overlaps):
            out[position] = self.sequences.active_prefix(
                int(self.slots[position]), hashes, limit=int(self.overlaps[position])
            )
        return out


class Policy(Protocol):
    """Chooses one of the eligible workers."""

    def choose(self, selection: Selection) -> int:
        """Position in ``selection.slots`` of the chosen worker."""
        ...


def pick_lowest(costs: FloatArray, *, temperature: float, rng: random.Random) -> int:
    """The position of the lowest cost (a random one among exact ties) at temperature 0; otherwise a
    sample with probability proportional to ``exp(-(cost - min) / ((max - min) * temperature))``."""
    low = float(costs.min())
    if temperature > 0.0:
        span = float(costs.max()) - low
        if span > 0.0:
            weights = np.exp(-(costs - low) / (span * temperature))
            cumulative = np.cumsum(weights)
            return int(np.searchsorted(cumulative, rng.random() * float(cumulative[-1]), side="right"))
    ties = np.flatnonzero(costs <= low + 1e-9 * max(1.0, abs(low)))
    return int(ties[0]) if len(ties) == 1 else int(ties[rng.randrange(len(ties))])


class KvPolicy:
    """Minimum predicted latency (time to first token + decode time) from the shared perf model."""

    def choose(self, selection: Selection) -> int:
        return pick_lowest(
            self.latency_ms(selection),
            temperature=selection.settings.temperature,
            rng=selection.rng,
        )

    @staticmethod
    def ttft_ms(selection: Selection) -> FloatArray:
        """Predicted time to first token on each eligible worker, ms."""
        request, seq, perf = selection.request, selection.sequences, selection.perf
        slots = selection.slots
        isl = request.prompt_tokens
        cached = selection.cached_tokens()
        own = np.full(len(slots), perf.prefill_ms(new_tokens=isl, cached_tokens=0))
        by_cached: dict[float, float] = {}
        for position in np.flatnonzero(cached):
            value = float(cached[position])
            ms = by_cached.get(value)
            if ms is None:
                ms = by_cached[value] = perf.prefill_ms(new_tokens=isl - int(value), cached_tokens=int(value))
            own[position] = ms
        backlog = seq.backlog_ms(selection.now)[slots]
        budget = selection.settings.max_num_batched_tokens
        steps = np.ceil((seq.prefill_tokens[slots] + (isl - cached)) / budget)
        requests = seq.requests[slots]
        decoding = requests - seq.prefilling[slots]
        kv = seq.kv_tokens()[slots]
        itl = perf.itl_ms(kv, kv / np.maximum(requests, 1.0))
        out: FloatArray = backlog + own + steps * np.where(decoding > 0, itl, 0.0)
        return out

    @classmethod
    def latency_ms(cls, selection: Selection) -> FloatArray:
        """Predicted time to first token plus (weighted) decode time on each eligible worker, ms."""
        ttft = cls.ttft_ms(selection)
        weight = selection.settings.decode_weight
        if weight == 0.0:
            return ttft
        out: FloatArray = ttft + weight * cls.decode_ms(selection)
        return out

    @staticmethod
    def decode_ms(selection: Selection) -> FloatArray:
        """Predicted decode time of the request on each eligible worker: its output tokens times the
        decode step time once its KV joins what the worker already holds, ms."""
        request, seq = selection.request, selection.sequences
        slots = selection.slots
        osl = request.max_tokens
        kv_after = (
            seq.kv_tokens()[slots]
            + request.prompt_tokens
            + osl
            - selection.shared_active_blocks() * selection.settings.block_size
        )
        itl_after = selection.perf.itl_ms(kv_after, kv_after / (seq.requests[slots] + 1.0))
        out: FloatArray = osl * itl_after
        return out


class DynamoPolicy:
    """NVIDIA Dynamo's default: ``overlap_weight x prefill blocks + decode blocks``, lowest wins;
    at temperature 0 exact ties go to the worker holding the fewest blocks, then at random."""

    def choose(self, selection: Selection) -> int:
        logits = self.logits(selection)
        temperature = selection.settings.temperature
        if temperature > 0.0:
            return pick_lowest(logits, temperature=temperature, rng=selection.rng)
        ties = np.flatnonzero(logits == logits.min())
        if len(ties) > 1:
            sizes = np.array(
                [selection.indexer.blocks_held(int(selection.slots[t])) for t in ties], dtype=np.float64
            )
            ties = ties[sizes == sizes.min()]
        return int(ties[0]) if len(ties) == 1 else int(ties[selection.rng.randrange(len(ties))])

    @staticmethod
    def logits(selection: Selection) -> FloatArray:
        """Dynamo's logit per eligible worker, in blocks."""
        request, seq, settings = selection.request, selection.sequences, selection.settings
        slots = selection.slots
        bs = settings.block_size
        prompt_blocks = math.ceil(request.prompt_tokens / bs)
        prefill_tokens = seq.prefill_tokens[slots] + request.prompt_tokens - selection.overlaps * bs
        decode_blocks = seq.active_blocks[slots] + prompt_blocks - selection.shared_active_blocks()
        out: FloatArray = settings.overlap_weight * prefill_tokens / bs + decode_blocks
        return out


class PrefixOnlyPolicy:
    """The longest cached prefix; ties at random."""

    def choose(self, selection: Selection) -> int:
        return pick_lowest(-selection.overlaps, temperature=0.0, rng=selection.rng)


class LeastLoadedPolicy:
    """The fewest in-flight requests; ties at random."""

    def choose(self, selection: Selection) -> int:
        return pick_lowest(selection.sequences.requests[selection.slots], temperature=0.0, rng=selection.rng)


class RandomPolicy:
    """Any eligible worker, uniformly."""

    def choose(self, selection: Selection) -> int:
        return selection.rng.randrange(len(selection.slots))


class RoundRobinPolicy:
    """The next eligible worker after the previous choice, in slot order."""

    def __init__(self) -> None:
        self._last = -1

    def choose(self, selection: Selection) -> int:
        slots = selection.slots
        position = int(np.searchsorted(slots, self._last, side="right"))
        if position >= len(slots):
            position = 0
        self._last = int(slots[position])
        return position


POLICIES: dict[str, Callable[[], Policy]] = {
    "kv": KvPolicy,
    "dynamo": DynamoPolicy,
    "prefix_only": PrefixOnlyPolicy,
    "least_loaded": LeastLoadedPolicy,
    "random": RandomPolicy,
    "round_robin": RoundRobinPolicy,
}
"""Policy name -> factory (one instance per router: some policies keep state)."""


def make_policy(name: str) -> Policy:
    """A fresh policy by name; ``ValueError`` naming the known ones otherwise."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return factory()
