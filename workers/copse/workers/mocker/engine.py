"""The core of a mocked engine: a vLLM-v1-like scheduler over a :class:`BlockManager`, timed by a
:class:`~copse.workers.perf.PerfModel`. Synchronous and clock-free: the caller says what time it is.

Driving it (what :class:`~copse.workers.mocker.simulation.Simulator` and the HTTP server do)::

    engine.add_request(request_id="r1", tokens=ids, max_tokens=100, now_ms=t)
    end = engine.begin_step(now_ms=t)        # plan and start a step; None if there is nothing to do
    ...                                      # nothing may happen to this engine until ``end``
    out = engine.end_step()                  # tokens come out at ``end``; out.advanced / out.finished
    events = engine.drain_kv_events()        # KV events emitted so far, in order

Scheduling, once per step (vLLM v1): running sequences first, in order, each taking
``num_tokens - num_computed`` tokens of the step's budget (a prompt's remaining chunk, or 1 to
decode); a sequence that cannot get blocks preempts the most recently admitted running
sequence (LIFO), which frees its blocks, forgets its progress and goes back to the front of the
waiting queue. Then, unless something was preempted, waiting sequences that arrived by the step's
start are admitted in order while the budget, ``max_num_seqs`` and the free blocks allow; a
sequence's prefix-cache hit is applied when it is admitted. A sequence samples a token when a
step brings its computed tokens up to its length; the first such token is its first token.

Step time = ``prefill_batch_ms(chunks) / speedup + decode_itl_ms(...) / (speedup * decode_speedup)``;
an expert-parallel engine (``EngineConfig.moe``) stretches it by its slowest rank's share of the
step's expert activations and adds the all-to-all (:mod:`copse.workers.moe.step`). A step that
brings prefix blocks back from host memory or disk (offload tiers, ``EngineConfig.host_cache_bytes``)
first spends their copy time, ``blocks x block bytes / tier bandwidth``, divided by the speedup.
With ``step_time_cv`` set, the step then takes its noise factor: factor ``k`` of a seeded table for
the engine's ``k``-th step, so fused and step-by-step runs stay identical.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections import deque
from collections.abc import Sequence
from typing import Literal

import numpy as np

from copse.workers.mocker.adapters import AdapterCache
from copse.workers.mocker.blocks import BlockHolder, BlockManager, trusted_model
from copse.workers.mocker.config import EngineConfig
from copse.workers.mocker.trtllm_events import TrtllmEventBuffer
from copse.workers.moe import MoeStep
from copse.workers.perf import PerfModel
from copse.workers.protocol.hashing import hash_blocks, lora_int_id
from copse.workers.protocol.kv_events import DumpBlock, KvDump, KvEvent, KvEventData
from copse.workers.protocol.tokenizer import RESERVED_IDS, VOCAB_SIZE

RequestState = Literal["waiting", "transferring", "running", "finished", "aborted"]

#: Generated ids come from a seeded table of this many ids (cheap, and reproducible by seed): the id
#: at position ``p`` of a sequence (prompt then output) is ``table[(p + sequence offset) % size]``,
#: the offset a function of the sequence's first token. Like greedy decoding, the output depends on
#: the context only, not on the batch: an engine continuing a sequence (a migrated request, whose
#: prompt is the original prompt plus the tokens generated so far) emits exactly the same ids.
_SAMPLE_TABLE = 1 << 12
_SAMPLE_MASK = _SAMPLE_TABLE - 1
_OFFSET_MULTIPLIER = 2654435761
"""Knuth's multiplicative hash spreads first tokens over the table."""

#: Step-time noise cycles through a seeded table of this many factors per engine seed.
_NOISE_TABLE = 1 << 14
_NOISE_MASK = _NOISE_TABLE - 1

_EVENT_FIELDS = frozenset(("event_id", "data"))


@functools.lru_cache(maxsize=64)
def _sample_table(seed: int) -> tuple[int, ...]:
    """Token ids engines of one seed generate, shared by all of them (a thousand engines, one table)."""
    return tuple(np.random.default_rng(seed).integers(RESERVED_IDS, VOCAB_SIZE, _SAMPLE_TABLE).tolist())


@functools.lru_cache(maxsize=256)
def _noise_table(seed: int, cv: float) -> tuple[float, ...]:
    """Step-time factors of the engines of one seed: log-normal, mean 1, coefficient of variation ``cv``."""
    sigma2 = math.log1p(cv * cv)
    rng = np.random.default_rng((seed, 0x6E6F6973))  # a stream of its own, apart from the token samples
    return tuple(rng.lognormal(-sigma2 / 2, math.sqrt(sigma2), _NOISE_TABLE).tolist())


def _extend_cyclic(out: list[int], table: tuple[int, ...], *, start: int, count: int) -> None:
    """Append ``table[(start + k) & _SAMPLE_MASK]`` for ``k`` in ``range(count)``."""
    position = start & _SAMPLE_MASK
    while count > 0:
        take = min(count, _SAMPLE_TABLE - position)
        out.extend(table[position : position + take])
        count -= take
        position = (position + take) & _SAMPLE_MASK


class EngineOverloaded(RuntimeError):
    """The waiting queue is full (HTTP 503)."""


class RequestRejected(ValueError):
    """The request can never be served by this engine (HTTP 400); ``param`` names the field."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.param = param


class Request(BlockHolder):
    """One request inside an engine. Times are in the caller's milliseconds."""

    __slots__ = (
        "adapter",
        "arrival_ms",
        "awaiting_first",
        "cached_tokens",
        "expert_row",
        "finish_ms",
        "first_scheduled_ms",
        "first_token_ms",
        "hashes",
        "last_token_ms",
        "lora_id",
        "max_tokens",
        "num_computed",
        "num_output",
        "num_tokens",
        "output",
        "preemptions",
        "prompt_len",
        "ready_ms",
        "request_id",
        "sample_offset",
        "start_ms",
        "state",
        "tokens",
        "tokens_hashes",
    )

    def __init__(
        self,
        *,
        request_id: str,
        tokens: np.ndarray,
        prompt_len: int,
        max_tokens: int,
        arrival_ms: float,
        hashes: list[int],
        tokens_hashes: list[int],
        adapter: str | None = None,
        lora_id: int | None = None,
        start_ms: float | None = None,
    ) -> None:
        super().__init__()
        self.request_id = request_id
        self.adapter = adapter
        """The LoRA adapter it is served through (``None``: the base model)."""
        self.lora_id = lora_id
        """The adapter's integer id, which seeds the request's block hashes."""
        self.start_ms = arrival_ms if start_ms is None else max(arrival_ms, start_ms)
        """When it may first be scheduled: its arrival, or when its adapter is loaded."""
        self.tokens = tokens
        """Prompt token ids."""
        self.output: list[int] = []
        """Generated token ids."""
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.arrival_ms = arrival_ms
        self.hashes = hashes
        """Block hashes of the full blocks known so far (prompt, then output as it fills)."""
        self.tokens_hashes = tokens_hashes
        self.sample_offset = (int(tokens[0]) * _OFFSET_MULTIPLIER) & _SAMPLE_MASK if prompt_len else 0
        """Where the sequence's ids start in the sample table (from its first token)."""
        self.num_tokens = prompt_len
        """Prompt plus generated tokens."""
        self.num_computed = 0
        """Tokens whose KV is computed (or transferred) in this engine."""
        self.num_output = 0
        self.cached_tokens = -1
        """Prompt tokens found in the prefix cache at first admission (-1 before admission)."""
        self.first_scheduled_ms = math.nan
        """Start of the first step that worked on the request."""
        self.first_token_ms = math.nan
        self.last_token_ms = math.nan
        self.finish_ms = math.nan
        self.preemptions = 0
        self.ready_ms = math.nan
        """When transferred KV is in place (decode role); NaN otherwise."""
        self.awaiting_first = False
        """Admitted after a KV transfer; its given first token comes out at the end of this step."""
        self.state: RequestState = "waiting"
        self.expert_row = 0
        """Row of the request's expert shares in the engine's MoE state (MoE engines only)."""

    def token_slice(self, start: int, stop: int) -> np.ndarray:
        """Token ids ``[start, stop)`` of prompt followed by output."""
        prompt_len = self.prompt_len
        if stop <= prompt_len:
            return self.tokens[start:stop]
        head = self.tokens[min(start, prompt_len) : prompt_len]
        tail = np.asarray(self.output[max(start - prompt_len, 0) : stop - prompt_len], dtype=np.uint32)
        return np.concatenate((head, tail))

    def outcome(self) -> RequestOutcome:
        """What a simulation keeps of a request (without its token arrays)."""
        return RequestOutcome(
            request_id=self.request_id,
            arrival_ms=self.arrival_ms,
            first_token_ms=self.first_token_ms,
            finish_ms=self.finish_ms,
            prompt_tokens=self.prompt_len,
            cached_tokens=max(self.cached_tokens, 0),
            output_tokens=self.num_output,
            preemptions=self.preemptions,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutcome:
    """Timings and counts of one finished request."""

    request_id: str
    arrival_ms: float
    first_token_ms: float
    finish_ms: float
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens served from the prefix cache at first admission."""
    output_tokens: int
    preemptions: int

    @property
    def ttft_ms(self) -> float:
        return self.first_token_ms - self.arrival_ms

    @property
    def itl_ms(self) -> float:
        """Mean inter-token latency (NaN for a single-token output)."""
        if self.output_tokens < 2:
            return math.nan
        return (self.finish_ms - self.first_token_ms) / (self.output_tokens - 1)


@dataclasses.dataclass(slots=True)
class StepOutput:
    """What one step produced, at ``end_ms``."""

    start_ms: float
    end_ms: float
    steps: int
    """Engine steps this output covers (more than 1 only for fused decode steps)."""
    advanced: list[Request]
    """Requests that emitted tokens (``steps`` each; a first token when ``num_output == 1``)."""
    finished: list[Request]
    """Requests that completed this step (also listed in ``advanced``); the engine forgot them."""
    preempted: list[Request]
    """Requests preempted when the step was planned (back in the waiting queue)."""
    prefill_tokens: int
    """Tokens prefilled (computed for prompts or recomputation) in the step."""
    decode_tokens: int
    """Decode tokens computed (sequences decoding x steps)."""


class Engine:
    """One mocked engine (see the module docstring for how to drive it)."""

    def __init__(
        self,
        *,
        worker_id: str,
        config: EngineConfig,
        perf: PerfModel,
        epoch: int = 0,
        trtllm_event_buffer: int = 0,
    ) -> None:
        self.worker_id = worker_id
        self.config = config
        self.perf = perf
        self.epoch = epoch
        """Identifies this incarnation in KV events; a restarted engine must use a new value."""
        self.block_size = config.block_size
        num_blocks = config.num_blocks or perf.kv_capacity_tokens // config.block_size
        if num_blocks < 1:
            raise ValueError(
                f"perf model holds {perf.kv_capacity_tokens} KV tokens,"
                f" less than one block of {config.block_size}"
            )
        offload = config.offload
        host_blocks, disk_blocks = (
            offload.blocks(block_bytes=config.block_bytes) if offload.enabled else (0, 0)
        )
        self._onboard_ms = offload.block_ms(block_bytes=config.block_bytes)
        """Time to bring one block back from host memory and from disk, ms."""
        self.trtllm_events: TrtllmEventBuffer | None = None
        """TensorRT-LLM-format events for ``POST /kv_cache_events`` (bounded; oldest dropped)."""
        if trtllm_event_buffer:
            # TensorRT-LLM's cache levels are the GPU (primary) and host (secondary) pools; a disk
            # tier (mocked engines only) is a third level.
            levels = [num_blocks, host_blocks] + ([disk_blocks] if disk_blocks else [])
            self.trtllm_events = TrtllmEventBuffer(
                maxlen=trtllm_event_buffer, window_size=config.max_model_len, cache_levels=levels
            )
        self.blocks = BlockManager(
            num_blocks=num_blocks,
            block_size=config.block_size,
            emit=self._emit,
            keep_tokens=trtllm_event_buffer > 0,
            host_blocks=host_blocks,
            disk_blocks=disk_blocks,
        )
        self._keep_tokens = trtllm_event_buffer > 0
        self.adapters = AdapterCache(config.adapters)
        """The LoRA adapters the engine holds."""
        self._storing_lora: int | None = None
        """Adapter id of the request whose blocks the block manager stores (TensorRT-LLM's events
        name it per stored block)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        """Every request not yet finished or aborted, by id."""
        self._transfers: list[Request] = []
        self._pending_events: list[KvEvent] = []
        self._last_event_id = 0
        self._samples = _sample_table(config.seed)
        self._noise = _noise_table(config.seed, config.step_time_cv) if config.step_time_cv else None
        self._noise_array = None if self._noise is None else np.asarray(self._noise)
        """The same factors as an array (fused decode steps take many at once)."""
        self._step_count = 0
        """Steps run so far (indexes the noise table)."""
        self._busy_until: float | None = None
        self._step_start = 0.0
        self._scheduled: list[tuple[Request, int]] = []
        self._steps = 1
        self._step_ends: list[float] = []
        """End of each fused decode step in progress (empty for a single step)."""
        self._decodes = 0
        self._preempted: list[Request] = []
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._speed = config.speedup_ratio
        self._decode_speed = config.speedup_ratio * config.decode_speedup_ratio
        self.moe = None if config.moe is None else MoeStep(config.moe, seed=config.seed)
        """The expert-parallel state of an MoE engine (placement, loads, totals); None when dense."""
        self._moe_factor = 1.0
        self._moe_ms = 0.0
        self.capacity_tokens = num_blocks * config.block_size
        """KV tokens the engine holds."""
        # cumulative counters (metrics)
        self.onboarded_blocks_total = [0, 0]
        """Blocks brought back into the GPU from host memory and from disk."""
        self.prompt_tokens_total = 0
        """Prompt tokens of every request received."""
        self.admitted_prompt_tokens_total = 0
        """Prompt tokens of requests admitted to the running batch (denominator of the hit rate)."""
        self.cached_tokens_total = 0
        """Prompt tokens found in the prefix cache at first admission."""
        self.generation_tokens_total = 0
        self.requests_finished_total = 0
        self.preemptions_total = 0

    # requests -------------------------------------------------------------------------------

    def check_request(self, *, prompt_len: int, max_tokens: int) -> None:
        """Raise :class:`RequestRejected` if a request of this shape can never run here."""
        if max_tokens < 1:
            raise RequestRejected(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if prompt_len < 1:
            raise RequestRejected("prompt must hold at least one token", param="prompt")
        limit = min(self.config.max_model_len, self.capacity_tokens)
        if prompt_len > limit:
            raise RequestRejected(
                f"prompt has {prompt_len} tokens, more than this engine's context of {limit} tokens",
                param="prompt",
            )
        if not self.config.enable_chunked_prefill and prompt_len > self.config.max_num_batched_tokens:
            raise RequestRejected(
                f"prompt has {prompt_len} tokens, more than max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) with chunked prefill disabled",
                param="prompt",
            )
        if prompt_len + max_tokens > limit:
            raise RequestRejected(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds this engine's context "
                f"of {limit} tokens",
                param="max_tokens",
            )

    def add_request(
        self,
        *,
        request_id: str,
        tokens: Sequence[int] | np.ndarray,
        max_tokens: int,
        now_ms: float,
        block_hashes: tuple[list[int], list[int]] | None = None,
        transferred_first_token: int | None = None,
        adapter: str | None = None,
        lora_id: int | None = None,
    ) -> Request:
        """Queue a request arriving at ``now_ms``.

        ``block_hashes`` = ``(block hashes, tokens hashes)`` of the prompt's full blocks when the
        caller already computed them (saves hashing twice). ``transferred_first_token`` marks a
        generation-only request (decode role): its prompt's KV arrives from a prefill engine after
        ``prompt tokens * kv_bytes_per_token / bandwidth`` and it starts by emitting that token.
        ``adapter`` names the LoRA adapter it is served through (its integer id ``lora_id``, by
        default :func:`~copse.workers.protocol.hashing.lora_int_id` of the name, seeds its block
        hashes); it is scheduled once the engine holds the adapter (:mod:`copse.workers.mocker.adapters`).
        Raises :class:`RequestRejected` or :class:`EngineOverloaded`.
        """
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already in engine {self.worker_id}")
        prompt_len = len(tokens)
        self.check_request(prompt_len=prompt_len, max_tokens=max_tokens)
        if len(self.waiting) + len(self._transfers) >= self.config.max_waiting:
            raise EngineOverloaded(f"engine {self.worker_id} has {self.config.max_waiting} requests queued")
        try:
            array = np.asarray(tokens, dtype=np.uint32)
        except OverflowError as exc:
            raise RequestRejected(f"token ids must lie in [0, 2**32): {exc}", param="prompt") from exc
        if adapter is not None and lora_id is None:
            lora_id = lora_int_id(adapter)
        if block_hashes is None:
            chained, local = hash_blocks(array[:prompt_len], block_size=self.block_size, lora_id=lora_id)
        else:
            chained, local = list(block_hashes[0]), list(block_hashes[1])
            if len(chained) != prompt_len // self.block_size or len(local) != len(chained):
                raise ValueError(
                    f"block_hashes cover {len(chained)} blocks,"
                    f" the prompt has {prompt_len // self.block_size}"
                )
        request = Request(
            request_id=request_id,
            tokens=array,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            arrival_ms=now_ms,
            hashes=chained,
            tokens_hashes=local,
            adapter=adapter,
            lora_id=lora_id,
            start_ms=None if adapter is None else self.adapters.acquire(adapter, now_ms=now_ms),
        )
        if self.moe is not None:
            # The mocked model routes by content: the first block sets the request's expert shares.
            request.expert_row = self.moe.row(chained[0] if chained else None)
        self.requests[request_id] = request
        self.prompt_tokens_total += prompt_len
        if transferred_first_token is None:
            self.waiting.append(request)
            return request
        request.output.append(transferred_first_token)
        request.num_tokens = prompt_len + 1
        request.num_output = 1
        request.cached_tokens = 0
        request.state = "transferring"
        seconds = prompt_len * self.config.kv_bytes_per_token / (self.config.kv_transfer_bandwidth_gbps * 1e9)
        request.ready_ms = now_ms + seconds * 1000.0
        self._transfers.append(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        """Forget a request (client gone) and free its blocks; ``False`` if it is not here."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request.state == "running":
            self.running.remove(request)
            self.blocks.release(request)
        elif request.state == "waiting":
            self.waiting.remove(request)
        elif request.state == "transferring":
            self._transfers.remove(request)
        request.state = "aborted"
        return True

    # stepping -------------------------------------------------------------------------------

    @property
    def busy_until(self) -> float | None:
        """End of the step in progress, or ``None`` when idle."""
        return self._busy_until

    @property
    def num_waiting(self) -> int:
        """Requests queued, including KV transfers in flight."""
        return len(self.waiting) + len(self._transfers)

    def has_work(self) -> bool:
        """Whether anything is queued, running or in transfer."""
        return bool(self.running or self.waiting or self._transfers)

    def next_wake_ms(self) -> float | None:
        """When an idle engine with nothing schedulable next has something to do (a KV transfer
        completing, or a queued request arriving: a step admits only requests that arrived by its
        start); ``None`` if nothing is pending."""
        wakes = [request.ready_ms for request in self._transfers]
        if self.waiting and not self.running:
            wakes.append(self.waiting[0].start_ms)
        return min(wakes, default=None)

    def begin_step(self, now_ms: float, *, horizon_ms: float | None = None) -> float | None:
        """Plan a step starting at ``now_ms`` and return its end time; ``None`` if there is nothing to run.

        With ``horizon_ms``, a step that only decodes is fused with the identical steps that follow
        it, up to the horizon, the first block boundary, the first request finishing or a KV
        transfer completing: the outcome is exactly that of stepping one by one, without the
        per-step overhead, provided that no request arrives or is aborted before the horizon, or
        that :meth:`cut_steps` is called when one does.
        """
        if self._busy_until is not None:
            raise RuntimeError(f"engine {self.worker_id} is busy until {self._busy_until} ms")
        if self._transfers:
            self._collect_transfers(now_ms)
        if not self.running and not self.waiting:
            return None
        scheduled = self._scheduled
        preempted = self._preempted
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        chunks: list[tuple[int, int]] = []
        decode_kv = 0
        decodes = 0
        running = self.running
        size = self.block_size
        fuse_limit = self.config.max_model_len
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed
            n = request.num_tokens - computed
            if n > budget:
                if not chunked:
                    i += 1
                    continue
                n = budget
            target = computed + n
            # most steps need no new block (the _grow fast path, inlined: one call per request and step)
            if target // size != len(request.blocks) or (1 if target % size else 0) != request.partial:
                while not self._grow(request, target):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is request:
                        break
                if request.state != "running":
                    break
            scheduled.append((request, n))
            budget -= n
            if n == 1 and request.num_output:
                decodes += 1
                decode_kv += target
                # identical steps can follow this one until a request finishes or, after the step
                # that fills the block the next token goes to, needs a new block
                fuse_limit = min(fuse_limit, request.max_tokens - request.num_output, -target % size or 1)
            else:
                chunks.append((n, computed))
            i += 1
        if not preempted:
            max_seqs = self.config.max_num_seqs
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < max_seqs and waiting[0].start_ms <= now_ms:
                request = waiting[0]
                if request.awaiting_first:
                    if not self._grow(request, request.prompt_len):
                        break
                    request.num_computed = request.prompt_len
                    scheduled.append((request, 0))
                    request.first_scheduled_ms = now_ms
                else:
                    computed = self._admission_hit(request)
                    n = request.num_tokens - computed
                    if n > budget:
                        if chunked:
                            n = budget
                        elif scheduled:
                            break  # unchunked: wait for a step of its own (a recompute may exceed it)
                    if not self._grow(request, computed + n):
                        break
                    request.num_computed = computed
                    scheduled.append((request, n))
                    budget -= n
                    chunks.append((n, computed))
                    if request.cached_tokens < 0:  # first admission: its prefix hit and queueing time
                        request.cached_tokens = min(computed, request.prompt_len)
                        request.first_scheduled_ms = now_ms
                        self.cached_tokens_total += request.cached_tokens
                        self.admitted_prompt_tokens_total += request.prompt_len
                waiting.popleft()
                request.state = "running"
                running.append(request)
        if not scheduled:
            # everything left is blocked (a prompt larger than the budget without chunking, or no blocks)
            return None
        duration = 0.0
        onboard_ms = 0.0
        from_host, from_disk = self.blocks.take_onboarded()
        if from_host or from_disk:
            # The step's prefix hits below the GPU are copied back before the prefill runs.
            self.onboarded_blocks_total[0] += from_host
            self.onboarded_blocks_total[1] += from_disk
            host_ms, disk_ms = self._onboard_ms
            onboard_ms = (from_host * host_ms + from_disk * disk_ms) / self._speed
        if chunks:
            duration += self.perf.prefill_batch_ms(chunks=chunks) / self._speed
        if decodes:
            duration += (
                self.perf.decode_itl_ms(active_kv_tokens=decode_kv, context_length=decode_kv / decodes)
                / self._decode_speed
            )
        moe = self.moe
        if moe is not None:
            terms = moe.terms([r.expert_row for r, n in scheduled if n], [n for _, n in scheduled if n])
            self._moe_factor, self._moe_ms = terms.factor, terms.all_to_all_ms / self._speed
            duration = duration * self._moe_factor + self._moe_ms
        duration += onboard_ms
        if self._noise is not None:
            duration *= self._noise[self._step_count & _NOISE_MASK]
        end = now_ms + duration
        steps = 1
        self._step_ends = []
        if horizon_ms is not None and decodes == len(scheduled) and not preempted and end < horizon_ms:
            steps, end = self._fuse_decodes(
                end,
                now_ms=now_ms,
                horizon_ms=horizon_ms,
                decode_kv=decode_kv,
                decodes=decodes,
                limit=fuse_limit,
            )
        if moe is not None:
            # Fused steps share the batch, so their MoE terms: each is base x factor + all-to-all
            # (the onboarding copies are no MoE work).
            total = end - now_ms - onboard_ms
            moe.record(steps=steps, base_ms=(total - steps * self._moe_ms) / self._moe_factor, step_ms=total)
        self._steps = steps
        self._decodes = decodes
        self._prefill_tokens = sum(n for n, _ in chunks) if chunks else 0
        self._decode_tokens = decodes * steps
        self._step_start = now_ms
        self._busy_until = end
        return end

    def _fuse_decodes(
        self, end: float, *, now_ms: float, horizon_ms: float, decode_kv: int, decodes: int, limit: int
    ) -> tuple[int, float]:
        """How many identical decode steps, ``limit`` at most, can follow the planned one (starting
        at ``now_ms``), and when the last ends."""
        if self._transfers:
            horizon_ms = min(horizon_ms, *(r.ready_ms for r in self._transfers))
        if self.waiting and self.waiting[0].start_ms > now_ms:
            # a request waiting for its adapter's load joins the first step after the load ends
            horizon_ms = min(horizon_ms, self.waiting[0].start_ms)
        if limit <= 1:
            return 1, end
        # step k (k = 1, 2, ..., limit - 1) computes the KV of decode_kv + k * decodes tokens; all at
        # once in array math, each value as the step-by-step sum gives it (cumsum adds in order)
        kv = np.arange(decode_kv + decodes, decode_kv + limit * decodes, decodes, dtype=np.int64)
        steps = self.perf.decode_itl_many_ms(kv, sequences=decodes)
        # dividing by 1, multiplying by 1 and adding 0 change nothing: skipped (most engines)
        if self._decode_speed != 1.0:
            steps /= self._decode_speed
        if self._moe_factor != 1.0:
            steps *= self._moe_factor
        if self._moe_ms:
            steps += self._moe_ms
        noise = self._noise_array
        if noise is not None:
            first = (self._step_count + 1) & _NOISE_MASK  # factors of steps count + 1, ..., + limit - 1
            if first + limit - 1 <= _NOISE_TABLE:  # no wrap-around: one slice
                steps *= noise[first : first + limit - 1]
            else:
                steps *= noise[(first + np.arange(limit - 1)) & _NOISE_MASK]
        ends = np.cumsum(np.concatenate(([end], steps)))
        # the steps ending at or before the horizon, and at least the planned one: a transfer that
        # completes during it joins the step after it, as stepping one by one has it
        count = max(1, int(np.searchsorted(ends, horizon_ms, side="right")))
        if count > 1:
            self._step_ends = ends[:count].tolist()
        return count, float(ends[count - 1])

    def cut_steps(self, now_ms: float) -> float | None:
        """A request arrived (or was aborted) at ``now_ms`` during fused decode steps: end them
        where stepping one by one would first see it, at the first step end after ``now_ms``.
        Returns the new end of the step in progress, or ``None`` if it is unchanged."""
        ends = self._step_ends
        if self._busy_until is None or not ends:
            return None
        steps = bisect.bisect_right(ends, now_ms) + 1
        if steps >= self._steps:
            return None
        self._step_ends = ends[:steps]
        self._steps = steps
        self._decode_tokens = self._decodes * steps
        self._busy_until = ends[steps - 1]
        return self._busy_until

    def end_step(self) -> StepOutput:
        """Finish the step in progress: emit tokens, complete requests, free their blocks."""
        end = self._busy_until
        if end is None:
            raise RuntimeError(f"engine {self.worker_id} has no step in progress")
        finished: list[Request] = []
        samples = self._samples
        steps = self._steps
        if steps > 1:
            # fused decode steps: each samples one token per request at the request's next
            # positions, so a request takes ``steps`` consecutive samples (one slice)
            advanced = [request for request, _n in self._scheduled if request.state == "running"]
            for request in advanced:
                position = (request.sample_offset + request.num_tokens) & _SAMPLE_MASK
                if position + steps <= _SAMPLE_TABLE:  # no wrap-around: one slice
                    request.output.extend(samples[position : position + steps])
                else:
                    _extend_cyclic(request.output, samples, start=position, count=steps)
                tokens = request.num_tokens + steps
                request.num_tokens = tokens
                request.num_computed = tokens - 1
                request.num_output += steps
                request.last_token_ms = end
                if request.num_output >= request.max_tokens:
                    self._finish(request, end)
                    finished.append(request)
            self.generation_tokens_total += len(advanced) * steps
        else:
            advanced = []
            for request, n in self._scheduled:
                if request.state != "running":
                    continue  # aborted during the step
                if n == 0:
                    # a generation-only request emits the context engine's token: with max_tokens 1
                    # (a continuation with one token left) that token is also its last
                    request.awaiting_first = False
                    request.first_token_ms = request.last_token_ms = end
                else:
                    computed = request.num_computed + n
                    request.num_computed = computed
                    if computed < request.num_tokens:
                        continue
                    request.output.append(samples[(request.sample_offset + computed) & _SAMPLE_MASK])
                    request.num_tokens = computed + 1
                    request.num_output += 1
                    if request.num_output == 1:
                        request.first_token_ms = end
                    request.last_token_ms = end
                advanced.append(request)
                if request.num_output >= request.max_tokens:
                    self._finish(request, end)
                    finished.append(request)
            self.generation_tokens_total += len(advanced)
        self._step_count += steps
        if finished:
            self.running = [r for r in self.running if r.state == "running"]
        output = StepOutput(
            start_ms=self._step_start,
            end_ms=end,
            steps=self._steps,
            advanced=advanced,
            finished=finished,
            preempted=self._preempted,
            prefill_tokens=self._prefill_tokens,
            decode_tokens=self._decode_tokens,
        )
        self._scheduled = []
        self._preempted = []
        self._step_ends = []
        self._busy_until = None
        return output

    def _finish(self, request: Request, end: float) -> None:
        request.state = "finished"
        request.finish_ms = end
        self.blocks.release(request)
        del self.requests[request.request_id]
        self.requests_finished_total += 1

    def _collect_transfers(self, now_ms: float) -> None:
        ready = [r for r in self._transfers if r.ready_ms <= now_ms]
        if not ready:
            return
        ready.sort(key=lambda r: r.ready_ms)
        for request in ready:
            self._transfers.remove(request)
            request.state = "waiting"
            request.awaiting_first = True
            self.waiting.append(request)

    def _admission_hit(self, request: Request) -> int:
        """Tokens of ``request`` already cached (at least one token is always left to compute)."""
        size = self.block_size
        self._ensure_hashes(request, request.num_tokens // size)
        hit = self.blocks.match_prefix(request.hashes[: request.num_tokens // size]) * size
        return min(hit, request.num_tokens - 1)

    def _ensure_hashes(self, request: Request, full_blocks: int) -> None:
        hashes = request.hashes
        if len(hashes) >= full_blocks:
            return
        size = self.block_size
        start = len(hashes)
        chained, local = hash_blocks(
            request.token_slice(start * size, full_blocks * size),
            block_size=size,
            parent=hashes[-1] if hashes else None,
            lora_id=request.lora_id,
        )
        hashes.extend(chained)
        request.tokens_hashes.extend(local)

    def _grow(self, request: Request, num_tokens: int) -> bool:
        size = self.block_size
        full = num_tokens // size
        if full == len(request.blocks) and (1 if num_tokens % size else 0) == request.partial:
            return True  # the common decode step: the last block still has room
        if len(request.hashes) < full:
            self._ensure_hashes(request, full)
        self._storing_lora = request.lora_id
        return self.blocks.grow(
            request,
            num_tokens=num_tokens,
            hashes=request.hashes,
            tokens_hashes=request.tokens_hashes,
            tokens=request.token_slice(0, full * size) if self._keep_tokens else None,
        )

    def _preempt(self, request: Request) -> None:
        self.blocks.release(request)
        request.num_computed = 0
        request.awaiting_first = False
        request.preemptions += 1
        request.state = "waiting"
        self.preemptions_total += 1
        self.waiting.appendleft(request)

    # cache ----------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (emits ``cleared``); ``False`` while requests hold blocks."""
        cached = list(self.blocks.cached) if self.trtllm_events is not None else []
        if not self.blocks.clear():
            return False
        if self.trtllm_events is not None:
            self.trtllm_events.note_cleared(cached)
        return True

    @property
    def kv_utilization(self) -> float:
        """Fraction of blocks referenced by running requests."""
        return self.blocks.used_blocks / self.blocks.num_blocks

    def _emit(self, data: KvEventData, block_tokens: list[np.ndarray] | None) -> None:
        self._last_event_id += 1
        event = trusted_model(KvEvent, {"event_id": self._last_event_id, "data": data}, _EVENT_FIELDS)
        self._pending_events.append(event)
        if self.trtllm_events is not None:
            self.trtllm_events.add(data, block_tokens, lora_id=self._storing_lora)

    def drain_kv_events(self) -> list[KvEvent]:
        """KV events emitted since the last drain, oldest first."""
        events, self._pending_events = self._pending_events, []
        return events

    @property
    def last_event_id(self) -> int:
        """Id of the last event emitted (drained or not)."""
        return self._last_event_id

    def dump_kv(self) -> KvDump:
        """Everything cached, as of :attr:`last_event_id`."""
        tier_of = self.blocks.tier_of
        return KvDump(
            worker_id=self.worker_id,
            epoch=self.epoch,
            block_size=self.block_size,
            last_event_id=self._last_event_id,
            blocks=tuple(DumpBlock(h, p, t, tier_of(h)) for h, p, t in self.blocks.iter_cached()),
        )
