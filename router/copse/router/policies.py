"""Worker selection policies, by name.

Every policy sees the same :class:`Selection`: the request, which workers are eligible (right
role, not busy), how many leading prompt blocks each worker holds, and the in-flight load the
router tracks. Figures are arrays over all worker slots, so a decision costs a few array
operations however many workers there are. A policy returns the slot of its choice.

* ``kv`` (default): the predicted latency of this request on each worker, from the shared perf
  model: its time to first token (the compute of the worker's prefill backlog and of the prompt
  tokens the worker does not hold, plus for every step that takes the fixed step cost and the
  worker's decode step, which is how decode load slows a prefill), plus ``decode_weight`` x its
  decode time (output tokens x the decode step time once its KV joins the worker's; weight 0 by
  default, see ``SelectionSettings``). The minimum wins; a softmax temperature spreads near-ties.
* ``kv_expert``: ``kv``'s predicted time to first token plus ``expert_weight`` x the request's
  decode time on each worker, each step stretched by the slowest EP rank for the expert load in
  flight there plus the request's expected experts, and the all-to-all added
  (:mod:`copse.router.experts`); ``kv`` for a dense model. In disaggregated routing the decode
  worker is picked by that decode time plus the KV transfer.
* ``dynamo``: NVIDIA Dynamo's default cost, ``overlap_weight x prefill blocks + decode blocks``
  with weight 1, exact ties to the worker holding fewest blocks.
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

from copse.router import loops
from copse.router.cost import FloatArray, PerfTable, WorkerCosts
from copse.router.experts import ExpertTracker
from copse.router.indexer import Indexer
from copse.router.sequences import ActiveSequences

BoolArray = npt.NDArray[np.bool_]


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
    decode_weight: float = 0.0
    """Weight of the request's predicted decode time against its time to first token in the ``kv``
    cost; 0 ranks by time to first token alone, which still charges decode work through the
    decode part of every prefill step (see benchmarks/RESULTS.md for the measured effect)."""
    overlap_weight: float = 1.0
    """Weight of prefill blocks in the ``dynamo`` cost."""
    expert_weight: float = 1.0
    """Weight of the request's predicted decode time with the MoE layers (``Selection.moe_decode_ms``)
    against its time to first token in the ``kv_expert`` cost."""


@dataclasses.dataclass(slots=True)
class Selection:
    """One decision's inputs (arrays over every worker slot)."""

    request: RouteRequest
    eligible: BoolArray
    """Workers that may take the request."""
    exclusion: FloatArray | None
    """0 for the eligible workers, +inf for the others (added to a cost, it rules them out);
    ``None`` when every slot is eligible."""
    sequences: ActiveSequences
    costs: WorkerCosts
    """Load-dependent cost terms, up to date with ``sequences``."""
    indexer: Indexer
    perf: PerfTable
    settings: SelectionSettings
    rng: random.Random
    now: float
    """Seconds on the caller's clock (the backlog of a worker decays with it)."""
    experts: ExpertTracker | None = None
    """Expert placement and load per worker (Mixture-of-Experts deployments)."""
    _overlaps: FloatArray | None = None
    _ttft: FloatArray | None = None
    _uncached: FloatArray | None = None
    _shared: FloatArray | None = None

    def overlaps(self) -> FloatArray:
        """Leading prompt blocks each worker holds."""
        if self._overlaps is None:
            self._overlaps = self.indexer.index.overlap_array(self.request.hashes, self.sequences.size)
        return self._overlaps

    def cached_tokens(self, slot: int) -> int:
        """Prompt tokens worker ``slot`` would not have to compute."""
        self.ttft_ms()
        assert self._uncached is not None
        return self.request.prompt_tokens - int(self._uncached.item(slot))

    def shared_active_blocks(self) -> FloatArray:
        """Leading prompt blocks already in use by in-flight requests on each worker."""
        if self._shared is None:
            self._shared = self.sequences.active_prefix_array(self.request.hashes)
        return self._shared

    def ttft_ms(self) -> FloatArray:
        """Predicted time to first token on each worker, ms: the compute of the worker's prefill
        backlog and of this prompt's uncached tokens (all but the cached prefix, and at least one
        token), plus, for every step that takes (the step budget bounds the tokens per step), the
        fixed step cost and the worker's decode step while it has sequences decoding.

        The backlog is the predicted prefill time of the worker's requests not yet prefilled, less
        the time the oldest one has been running (capped at its prediction). One compiled pass
        (``LoadTable.ttft``) walks the prefix index and evaluates every worker."""
        if self._ttft is not None:
            return self._ttft
        seq, perf, request, settings = self.sequences, self.perf, self.request, self.settings
        out = np.empty((3, seq.size))
        seq.load.ttft(
            self.indexer.index,
            request.hashes,
            out,
            perf.prefill_curve,
            request.prompt_tokens,
            settings.block_size,
            settings.max_num_batched_tokens,
            self.now,
            perf.model.prefill_curve_ms(float(request.prompt_tokens)),
        )
        self._overlaps, self._ttft, self._uncached = out
        return self._ttft

    def decode_ms(self) -> FloatArray:
        """Predicted decode time of the request on each worker: its output tokens times the decode
        step time once its KV joins what the worker already holds, ms."""
        request, seq = self.request, self.sequences
        osl = float(request.max_tokens)
        kv_after = (
            seq.kv_tokens()
            + (request.prompt_tokens + osl)
            - self.shared_active_blocks() * self.settings.block_size
        )
        out: FloatArray = osl * self.perf.itl_ms(kv_after, seq.requests + 1.0)
        return out

    def moe_decode_ms(self) -> FloatArray:
        """Predicted decode time of the request on each expert-parallel worker: its output tokens
        times that worker's step once the request joined it (``decode_ms``'s balanced step,
        stretched by the slowest EP rank for the expert load in flight there plus the request's
        expected experts, plus the all-to-all; :meth:`ExpertTracker.moe_ms`), ms. Needs
        :attr:`experts`."""
        request, seq, experts = self.request, self.sequences, self.experts
        if experts is None:
            raise ValueError("moe_decode_ms needs the expert tracker of a Mixture-of-Experts deployment")
        kv = seq.kv_tokens()
        step_ms = self.perf.itl_ms(kv + request.prompt_tokens + request.max_tokens, seq.requests + 1.0)
        key = request.hashes[0] if request.hashes else None
        out: FloatArray = request.max_tokens * (step_ms + experts.moe_ms(key, step_ms))
        return out

    def latency_ms(self) -> FloatArray:
        """Predicted time to first token plus (weighted) decode time on each worker, ms."""
        weight = self.settings.decode_weight
        if weight == 0.0:
            return self.ttft_ms()
        out: FloatArray = self.ttft_ms() + weight * self.decode_ms()
        return out


class Policy(Protocol):
    """Chooses one of the eligible workers."""

    def choose(self, selection: Selection) -> int:
        """The slot of the chosen worker (one of ``selection.eligible``)."""
        ...


def _random_of(candidates: npt.NDArray[np.intp], rng: random.Random) -> int:
    return int(candidates[0]) if len(candidates) == 1 else int(candidates[rng.randrange(len(candidates))])


def excluded(costs: FloatArray, exclusion: FloatArray | None) -> FloatArray:
    """``costs`` with the slots that may not take the request at +inf (see
    :attr:`Selection.exclusion`)."""
    return costs if exclusion is None else costs + exclusion


def pick_lowest(
    costs: FloatArray, exclusion: FloatArray | None, *, temperature: float, rng: random.Random
) -> int:
    """The eligible slot (see :attr:`Selection.exclusion`) of lowest cost (a random one among
    exact ties) at temperature 0; otherwise a sample with probability proportional to
    ``exp(-(cost - min) / ((max - min) * temperature))`` over eligible slots."""
    if temperature > 0.0:
        masked = excluded(costs, exclusion)
        low = float(masked.min())
        span = float((costs if exclusion is None else costs[exclusion == 0.0]).max()) - low
        if span > 0.0:
            weights = np.exp(-(masked - low) / (span * temperature))
            cumulative = np.cumsum(weights)
            return int(np.searchsorted(cumulative, rng.random() * float(cumulative[-1]), side="right"))
    found = loops.lowest(costs, exclusion)
    return found if isinstance(found, int) else found[rng.randrange(len(found))]


class KvPolicy:
    """Minimum predicted latency (time to first token + decode time) from the shared perf model."""

    def choose(self, selection: Selection) -> int:
        return pick_lowest(
            selection.latency_ms(),
            selection.exclusion,
            temperature=selection.settings.temperature,
            rng=selection.rng,
        )


class KvExpertPolicy:
    """``kv``'s predicted time to first token plus ``expert_weight`` x the request's predicted
    decode time with the MoE layers (``Selection.moe_decode_ms``); ``kv`` for a dense model."""

    def choose(self, selection: Selection) -> int:
        costs = selection.latency_ms()
        if selection.experts is not None:
            costs = costs + selection.settings.expert_weight * selection.moe_decode_ms()
        return pick_lowest(
            costs, selection.exclusion, temperature=selection.settings.temperature, rng=selection.rng
        )


class DynamoPolicy:
    """NVIDIA Dynamo's default: ``overlap_weight x prefill blocks + decode blocks``, lowest wins;
    at temperature 0 exact ties go to the worker holding the fewest blocks, then at random."""

    def choose(self, selection: Selection) -> int:
        logits = self.logits(selection)
        temperature = selection.settings.temperature
        if temperature > 0.0:
            return pick_lowest(logits, selection.exclusion, temperature=temperature, rng=selection.rng)
        masked = excluded(logits, selection.exclusion)
        ties = np.flatnonzero(masked == masked.min())
        if len(ties) > 1:
            sizes = np.array([selection.indexer.blocks_held(int(slot)) for slot in ties])
            ties = ties[sizes == sizes.min()]
        return _random_of(ties, selection.rng)

    @staticmethod
    def logits(selection: Selection) -> FloatArray:
        """Dynamo's logit per worker, in blocks."""
        request, seq, settings = selection.request, selection.sequences, selection.settings
        bs = settings.block_size
        prompt_blocks = math.ceil(request.prompt_tokens / bs)
        prefill_tokens = seq.prefill_tokens + request.prompt_tokens - selection.overlaps() * bs
        decode_blocks = seq.active_blocks + prompt_blocks - selection.shared_active_blocks()
        out: FloatArray = settings.overlap_weight * prefill_tokens / bs + decode_blocks
        return out


class PrefixOnlyPolicy:
    """The longest cached prefix; ties at random."""

    def choose(self, selection: Selection) -> int:
        return pick_lowest(-selection.overlaps(), selection.exclusion, temperature=0.0, rng=selection.rng)


class LeastLoadedPolicy:
    """The fewest in-flight requests; ties at random."""

    def choose(self, selection: Selection) -> int:
        return pick_lowest(
            selection.sequences.requests, selection.exclusion, temperature=0.0, rng=selection.rng
        )


class RandomPolicy:
    """Any eligible worker, uniformly."""

    def choose(self, selection: Selection) -> int:
        return _random_of(np.flatnonzero(selection.eligible), selection.rng)


class RoundRobinPolicy:
    """The next eligible worker after the previous choice, in slot order."""

    def __init__(self) -> None:
        self._last = -1

    def choose(self, selection: Selection) -> int:
        candidates = np.flatnonzero(selection.eligible)
        position = int(np.searchsorted(candidates, self._last, side="right"))
        self._last = int(candidates[position if position < len(candidates) else 0])
        return self._last


POLICIES: dict[str, Callable[[], Policy]] = {
    "kv": KvPolicy,
    "kv_expert": KvExpertPolicy,
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
