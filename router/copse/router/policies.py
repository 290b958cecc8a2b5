"""Worker selection policies, by name.

Every policy sees the same :class:`Selection`: the request, which workers are eligible (right
role, not busy), how many leading prompt blocks each worker holds, and the in-flight load the
router tracks. Figures are arrays over all worker slots, so a decision costs a few array
operations however many workers there are. A policy returns the slot of its choice.

* ``kv`` (default): the predicted latency of this request on each worker, from the shared perf
  model, under ``SelectionSettings.objective``. ``e2e`` (default): its time to first token (the
  compute of the worker's prefill backlog and of the prompt tokens the worker does not hold, plus
  for every step that takes the fixed step cost and the worker's decode step), plus its decode
  under the batch it joins (which drains as it decodes), plus what joining costs the streams
  decoding there (its prefill shares their steps; its KV lengthens them): ``Selection.e2e_ms``.
  ``ttft``: the time to first token plus ``decode_weight`` x its decode time (weight 0 by
  default). ``goodput``: ``e2e`` among the workers predicted to meet the request's TTFT target.
  The minimum wins; a softmax temperature spreads near-ties.
* ``kv_expert``: ``kv``'s predicted time to first token plus ``expert_weight`` x the request's
  decode time on each worker, each step stretched by the slowest EP rank for the expert load in
  flight there plus the request's expected experts, and the all-to-all added, to the engines'
  balanced step (a profile's steps already hold both terms: :mod:`copse.router.experts`); ``kv``
  for a dense model. In disaggregated routing the decode
  worker is picked by that decode time plus the KV transfer.
* ``dynamo``: NVIDIA Dynamo's default cost, ``overlap_weight x prefill blocks + decode blocks``
  with weight 1, exact ties to the worker holding fewest blocks.
* ``prefix_only``: the longest cached prefix, ties at random.

Cache tiers. A worker may keep part of a prompt's prefix below the GPU (host memory, disk: see
:mod:`copse.workers.perf.tiers`). ``kv`` (and ``kv_expert``) count such blocks as cached and add the
time to onboard them at the tier's bandwidth (``SelectionSettings.host_block_ms`` /
``disk_block_ms``) to the worker's predicted time to first token, as the engine spends it. ``dynamo``
counts them as held, as Dynamo's router does (its TensorRT-LLM publisher ignores the engine's
``updated`` events, which are how a block's move to host memory shows: one view of all tiers).
``prefix_only`` weighs each leading block by its tier (``tier_weights``, llm-d's precise prefix
scorer: GPU 1.0, CPU 0.8 by default).
* ``least_loaded``: the fewest in-flight requests, ties at random.
* ``round_robin`` and ``random``: ignore caches and load.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence
from typing import Literal, Protocol, get_args

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
    priority: int = 0
    """Priority of its objective (``InferenceObjective`` ``spec.priority``; higher is served first
    while requests wait)."""
    tenant: str = ""
    """Who sent it (fair-share key: the ``x-gateway-inference-fairness-id`` header or the API key;
    empty: the one default tenant)."""
    objective: str = ""
    """Name of its objective ("" for the default one), for metrics."""
    ttft_slo_ms: float | None = None
    """Its objective's time-to-first-token target: a request predicted to wait past it is not
    admitted while the fleet is saturated (``None``: admitted while the queue has room)."""
    itl_slo_ms: float | None = None
    """Its objective's inter-token target: while it decodes on a worker, a request of lower
    priority goes there only if the worker's predicted step time stays within it (``None``: no
    such guard)."""
    model: str = ""
    """The base model whose workers may serve it ("": any worker; one model behind the router)."""
    adapter: str = ""
    """The LoRA adapter it is served through ("": the base model); its hashes include it."""


RoutingObjective = Literal["e2e", "ttft", "goodput"]
"""What ``kv`` minimises for each request (``SelectionSettings.objective``)."""
ROUTING_OBJECTIVES: tuple[str, ...] = get_args(RoutingObjective)


MISSED_TARGET_MS = 1e7
"""What the ``goodput`` objective adds to the cost of a worker predicted to miss the request's TTFT
target: more than any latency, so such workers are chosen only when every worker misses."""


@dataclasses.dataclass(frozen=True, slots=True)
class SelectionSettings:
    """Knobs of the cost functions."""

    block_size: int
    """Tokens per block of the hashes the indexer holds."""
    max_num_batched_tokens: int = 8192
    """Per-step token budget of the engines: a prefill of N tokens spans ceil(N / budget) steps."""
    temperature: float = 0.0
    """Softmax temperature over costs normalised by their spread; 0 picks the minimum."""
    objective: RoutingObjective = "e2e"
    """What ``kv`` minimises. ``e2e`` (default): the request's predicted end-to-end latency, its time
    to first token plus its decode under the batch it joins (what users feel: a worker holding the
    prefix but crowded with decoding sequences loses to one that is not). ``ttft``: the predicted
    time to first token plus ``decode_weight`` x the decode time (weight 0: time to first token
    alone, the best first token at the cost of slower streams on prefix holders). ``goodput``:
    ``e2e`` among the workers predicted to meet the request's TTFT target
    (``RouteRequest.ttft_slo_ms``), any other worker only when none is (a request without a target
    is routed as under ``e2e``)."""
    decode_weight: float = 0.0
    """Weight of the request's predicted decode time against its time to first token in the ``kv``
    cost under the ``ttft`` objective (``e2e`` weighs it 1 and counts the batch draining)."""
    overlap_weight: float = 1.0
    """Weight of prefill blocks in the ``dynamo`` cost."""
    expert_weight: float = 1.0
    """Weight of the request's predicted decode time with the MoE layers (``Selection.moe_decode_ms``)
    against its time to first token in the ``kv_expert`` cost."""
    host_block_ms: float = 0.0
    """Time an engine takes to onboard one block (of ``block_size`` tokens) it keeps in host memory
    (:meth:`copse.workers.perf.KvOffload.block_ms`), ms."""
    disk_block_ms: float = 0.0
    """Time an engine takes to onboard one block it keeps on disk, ms."""
    tier_weights: tuple[float, float, float] = (1.0, 0.8, 0.8)
    """What a leading block on the GPU, in host memory and on disk is worth to ``prefix_only``: llm-d's
    precise prefix scorer weighs ``gpu`` 1.0 and ``cpu`` 0.8 by default (``kvCacheBackendConfigs``);
    it names no disk medium (an unnamed one weighs 1.0 there), so copse gives disk the CPU weight."""


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
    adapter_ms: FloatArray | None = None
    """Time each worker would take to load the request's LoRA adapter first, ms (part of
    :meth:`ttft_ms`; ``None``: none to load)."""
    moe_perf: PerfTable | None = None
    """The expert-parallel engines' balanced step (without their MoE terms), which ``kv_expert``
    stretches for the expert load it expects; ``None``: ``perf``'s step holds the MoE terms of an
    average expert load (a profile of the MoE engines), and only the deviation from it is added."""
    _overlaps: FloatArray | None = None
    _lower: FloatArray | None = None
    _ttft: FloatArray | None = None
    _uncached: FloatArray | None = None
    _shared: FloatArray | None = None

    def overlaps(self) -> FloatArray:
        """Leading prompt blocks each worker holds."""
        if self._overlaps is None:
            self._overlaps = self.indexer.index.overlap_array(self.request.hashes, self.sequences.size)
        return self._overlaps

    def uncached_tokens(self) -> FloatArray:
        """Prompt tokens each worker would have to compute."""
        self.ttft_ms()
        assert self._uncached is not None
        return self._uncached

    def cached_tokens(self, slot: int) -> int:
        """Prompt tokens worker ``slot`` would not have to compute."""
        self.ttft_ms()
        assert self._uncached is not None
        return self.request.prompt_tokens - int(self._uncached.item(slot))

    def lower_tier_blocks(self) -> FloatArray:
        """Of the leading prompt blocks each worker holds, how many it keeps in host memory (row 0)
        and on disk (row 1)."""
        self.ttft_ms()
        assert self._lower is not None
        return self._lower

    def onboard_ms(self, slot: int) -> float:
        """Time worker ``slot`` would take to bring the prompt's leading blocks it keeps below the
        GPU back into GPU memory, ms (part of :meth:`ttft_ms`)."""
        lower = self.lower_tier_blocks()
        settings = self.settings
        return float(lower[0, slot] * settings.host_block_ms + lower[1, slot] * settings.disk_block_ms)

    def shared_active_blocks(self) -> FloatArray:
        """Leading prompt blocks already in use by in-flight requests on each worker."""
        if self._shared is None:
            self._shared = self.sequences.active_prefix_array(self.request.hashes)
        return self._shared

    def ttft_ms(self) -> FloatArray:
        """Predicted time to first token on each worker, ms: the compute of the worker's prefill
        backlog and of this prompt's uncached tokens (all but the cached prefix, and at least one
        token), plus, for every step that takes (the step budget bounds the tokens per step), the
        fixed step cost and the worker's decode step while it has sequences decoding, plus the
        onboarding of the cached prefix blocks it keeps below the GPU (host memory, disk), plus the
        load of the request's LoRA adapter where the worker does not hold it (:attr:`adapter_ms`).

        The backlog is the predicted prefill time of the worker's requests not yet prefilled, less
        the time the oldest one has been running (capped at its prediction). One compiled pass
        (``LoadTable.ttft``) walks the prefix index and evaluates every worker."""
        if self._ttft is not None:
            return self._ttft
        seq, perf, request, settings = self.sequences, self.perf, self.request, self.settings
        out = np.empty((5, seq.size))
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
            settings.host_block_ms,
            settings.disk_block_ms,
        )
        self._overlaps, self._ttft, self._uncached = out[0], out[3], out[4]
        self._lower = out[1:3]
        if self.adapter_ms is not None:
            self._ttft = self._ttft + self.adapter_ms
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
        times that worker's step once the request joined it: the balanced step (:attr:`moe_perf`)
        stretched by the slowest EP rank for the expert load in flight there plus the request's
        expected experts, plus the all-to-all; without a balanced step, the perf model's step plus
        the deviation of those terms from an average load's (:meth:`ExpertTracker.moe_ms`), ms.
        Needs :attr:`experts`."""
        request, seq, experts = self.request, self.sequences, self.experts
        if experts is None:
            raise ValueError("moe_decode_ms needs the expert tracker of a Mixture-of-Experts deployment")
        kv = seq.kv_tokens()
        perf = self.perf if self.moe_perf is None else self.moe_perf
        step_ms = perf.itl_ms(kv + request.prompt_tokens + request.max_tokens, seq.requests + 1.0)
        key = request.hashes[0] if request.hashes else None
        added = experts.moe_ms(key, step_ms, balanced=self.moe_perf is not None)
        out: FloatArray = request.max_tokens * (step_ms + added)
        return out

    def e2e_ms(self) -> FloatArray:
        """Predicted end-to-end cost of serving the request on each worker, ms: its time to first
        token, its decode under the batch it joins there, and what joining costs the sequences
        already decoding there (a worker is shared: the request's latency is not all users feel).

        - The batch drains as the request decodes: the sequences in flight are on average halfway
          through their expected outputs (:attr:`ActiveSequences.outputs`), so a worker's load
          stays for the fraction ``min(1, mean remaining output / this output)`` of the request's
          decode; for the rest, requests arriving meanwhile refill every eligible worker alike, to
          the eligible workers' mean.
        - Joining delays every sequence in flight there by the compute of the request's uncached
          prompt tokens (chunked prefill shares their decode steps; those still prefilling decode
          by the time this prompt's turn comes), and lengthens each of their steps, for as long as
          they overlap, by what the request's KV adds to the decode step.

        Time to first token alone piles requests sharing a prefix onto its holders until their
        streams slow down; decode load alone forgets that a cache hit spares every sequence on the
        worker the prefill it avoids."""
        request, seq = self.request, self.sequences
        osl = float(max(request.max_tokens, 1))
        requests = seq.requests
        kv = seq.kv_tokens()
        remaining = np.divide(seq.outputs, 2.0 * requests, out=np.zeros_like(kv), where=requests > 0)
        stays = np.minimum(1.0, remaining / osl)
        eligible = self.eligible
        mean_kv = float(kv[eligible].mean()) if eligible.any() else 0.0
        mean_requests = float(requests[eligible].mean()) if eligible.any() else 0.0
        own = request.prompt_tokens + osl / 2.0 - self.shared_active_blocks() * self.settings.block_size
        kv_during = mean_kv + (kv - mean_kv) * stays
        requests_during = mean_requests + (requests - mean_requests) * stays
        step_ms = self.perf.itl_ms(kv_during + own, requests_during + 1.0)
        decode = osl * step_ms
        ttft = self.ttft_ms()
        assert self._uncached is not None
        prefill = self.perf.compute_ms_array(
            new_tokens=self._uncached, total_tokens=float(request.prompt_tokens)
        )
        slowed = step_ms - self.perf.itl_ms(kv_during, np.maximum(requests_during, 1.0))
        overlap = requests * osl * stays
        out: FloatArray = ttft + decode + requests * prefill + overlap * slowed
        return out

    def latency_ms(self) -> FloatArray:
        """What ``kv`` minimises on each worker under :attr:`SelectionSettings.objective`, ms."""
        settings = self.settings
        if settings.objective == "e2e":
            return self.e2e_ms()
        if settings.objective == "goodput":
            cost = self.e2e_ms()
            target = self.request.ttft_slo_ms
            if target is None:
                return cost
            late: FloatArray = cost + np.where(self.ttft_ms() > target, MISSED_TARGET_MS, 0.0)
            return late
        if settings.decode_weight == 0.0:
            return self.ttft_ms()
        out: FloatArray = self.ttft_ms() + settings.decode_weight * self.decode_ms()
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
        if selection.experts is None:
            costs = selection.latency_ms()
        else:  # the decode term is the MoE one (whatever kv's objective)
            costs = selection.ttft_ms() + selection.settings.expert_weight * selection.moe_decode_ms()
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
    """The longest cached prefix, each leading block weighed by the tier it is on (llm-d's precise
    prefix scorer, ``SelectionSettings.tier_weights``); ties at random."""

    def choose(self, selection: Selection) -> int:
        return pick_lowest(-self.scores(selection), selection.exclusion, temperature=0.0, rng=selection.rng)

    @staticmethod
    def scores(selection: Selection) -> FloatArray:
        """Each worker's weighted prefix length, in blocks."""
        gpu, host, disk = selection.settings.tier_weights
        overlaps = selection.overlaps()
        if (gpu, host, disk) == (1.0, 1.0, 1.0):
            return overlaps
        lower = selection.lower_tier_blocks()
        out: FloatArray = gpu * (overlaps - lower[0] - lower[1]) + host * lower[0] + disk * lower[1]
        return out


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
