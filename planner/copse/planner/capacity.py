"""Capacity from the shared perf model: latency of a load on given replicas, and replicas for a target.

Built on :class:`copse.workers.perf.PerfModel` (the same model the mocker and the router use), with
queueing added here. Latency of an interval at a quantile (:meth:`CapacityModel.estimate`, the dry
run's table):

* **Prefill** (TTFT). Each prefill engine serves one prompt at a time; a prompt of ``isl`` tokens
  with hit rate ``h`` costs ``prefill_ms(new_tokens=isl*(1-h), cached_tokens=isl*h)``, plus the
  time to bring the part of its cached prefix kept in host memory or on disk back to the GPU
  (``onboard_ms``): with an offload tier the fleet's hit rate is higher and some hits cost a copy.
  The pool is
  an M/G/c queue: TTFT = the ``quantile`` of the wait (Erlang C tail, Allen-Cunneen scaled by the
  prompt-length variability) + the prefill time of a p90-length prompt (the mean when no p90 is
  known).
* **Decode** (ITL). By Little's law a decode engine holds ``n = rate * osl * step(n) / c``
  sequences, where ``step(n)`` is the perf model's decode step time with ``n`` sequences at the
  mean context ``isl + osl/2``; the fixed point is found by bisection. ITL = the step time at the
  ``quantile`` of the (Poisson) concurrency, ``n + z*sqrt(n)``, capped by the largest batch the
  KV cache and ``max_num_seqs`` allow.
* **Aggregated** engines do both: prefill takes a share ``rho`` of each engine's time, decode steps
  stretch by ``1/(1-rho)``, and a first token waits for one decode step of its batch.
* **Overload** is a fluid queue: when arrivals exceed what the replicas complete, the backlog grows
  by the difference for the whole segment and carries over to the next one; the last request in
  the backlog waits ``backlog / capacity``. Prefill backlog adds to TTFT; a prefilled request
  waiting for a decode slot sees that wait as an inter-token gap, so it adds to ITL.

Sizing (:meth:`CapacityModel.attainment`) is per request, not per interval p99: the fewest replicas
that serve a goal share of the requests within both targets, starting from the throughput bound
(prefill tokens/s net of the prefix-cache hit rate over the perf model's prefill tokens/s per GPU,
plus output tokens/s over the best decode tokens/s per GPU whose ITL meets the target). A prompt's
TTFT is the M/G/c wait plus its own prefill (prompts spread as the router's quantiles of their
uncached tokens, else a gamma through the observed mean and p90 length), so prompts too long for
the target are lost on any fleet and do not make it grow;
a request's mean inter-token gap is the decode step at the pool's concurrency plus, in aggregated
engines, the prefill chunks that share its few or many steps (output lengths: a gamma with the
observed mean and p10; short answers are the ones a chunk spoils), the modelled misses scaled by a
factor learned from the router's counts (:attr:`Corrections.itl_tail`). :meth:`CapacityModel.means` gives
the mean TTFT and mean gap the correction factors are solved from. :meth:`CapacityModel.estimate`
(latency at a quantile, with a backlog carried between segments) is what the dry run reports.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import numpy as np
from numpy.typing import NDArray
from scipy.special import gammaln, ndtr

from copse.api import Role
from copse.planner.config import PlannerConfig
from copse.planner.observations import UNCACHED_QUANTILES
from copse.planner.policy import Limits
from copse.planner.queueing import (
    gamma_points,
    lognormal_scv,
    mean_wait_s,
    normal_quantile,
    quantile_points,
    wait_exceeds,
    wait_quantile_s,
)
from copse.workers.perf import PerfModel

#: Largest replica count sizing will consider before calling a target unreachable.
_SEARCH_LIMIT = 1 << 20
#: Segment length sizing checks use: steady state (no transient bound, a backlog never drains).
_STEADY = math.inf
#: Entries of the best-decode-point cache before it is emptied (a few per distinct context length).
_CACHE_SIZE = 4096
#: Bisection steps for the decode concurrency fixed point (2^-40 of the batch range).
_BISECTION_STEPS = 40
#: Equally likely prompt lengths the share of requests meeting the TTFT target is summed over:
#: steps of 0.5 %, finer than the 1 % a 99 % goal leaves.
_PROMPT_POINTS = 200
#: Equally likely output lengths the share of requests meeting the ITL target is averaged over.
_OUTPUT_POINTS = 64
#: Every how many of the prompt points the ITL tail takes (a pair sum over all of them would cost
#: 40,000 terms per output length; 50 prompts resolve a 1 % tail).
_CHUNK_PROMPT_STRIDE = 4
#: Decode pool sizes a disaggregated sizing tries above the fewest that serve the goal alone: each
#: more decode engine takes fewer misses off the prefill pool's share.
_DECODE_TRIES = 4
#: Tables kept per load shape: prefill times (one per prompt-length distribution, unscaled) and
#: output lengths (one per output-length distribution).
_SHAPE_CACHE_SIZE = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """A load to serve: arrival rate and request shape."""

    rate: float
    """Requests per second."""
    isl: float
    """Mean input length, tokens."""
    osl: float
    """Mean output length, tokens."""
    isl_p90: float | None = None
    """90th percentile input length; sets the TTFT tail and the service-time variability."""
    osl_p10: float | None = None
    """10th percentile output length; sets the share of short answers, the ITL tail."""
    uncached_quantiles: tuple[float, ...] | None = None
    """A prompt's uncached tokens at the levels of
    :data:`~copse.planner.observations.UNCACHED_QUANTILES`: when known, the prompts' spread is read
    off them (:func:`~copse.planner.queueing.quantile_points`, at the mean prompt), not fitted
    through ``isl_p90``."""
    kv_hit_rate: float = 0.0
    """Fraction of prompt tokens found in the prefix cache (not recomputed), on any tier."""
    onboard_ms: float = 0.0
    """Mean time a prompt's cached blocks kept below the GPU take to come back, ms."""

    def __post_init__(self) -> None:
        if self.rate < 0 or self.isl <= 0 or self.osl <= 0:
            raise ValueError(f"workload needs rate >= 0 and positive isl/osl, got {self}")
        if not 0 <= self.kv_hit_rate <= 1:
            raise ValueError(f"kv_hit_rate={self.kv_hit_rate} must lie in [0, 1]")
        if self.onboard_ms < 0:
            raise ValueError(f"onboard_ms={self.onboard_ms} must not be negative")
        if self.uncached_quantiles is not None and len(self.uncached_quantiles) != len(UNCACHED_QUANTILES):
            raise ValueError(
                f"uncached_quantiles={self.uncached_quantiles} must hold one value per level of "
                f"{tuple(UNCACHED_QUANTILES.values())}"
            )

    @property
    def context_length(self) -> int:
        """Mean context of a decoding sequence: the prompt plus half the output."""
        return max(1, round(self.isl + self.osl / 2))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Corrections:
    """How much slower the engines are than the perf model says (1.0 = as profiled)."""

    prefill: float = 1.0
    """Multiplies prefill times (TTFT)."""
    decode: float = 1.0
    """Multiplies decode step times (ITL)."""
    itl_tail: float = 1.0
    """Multiplies the modelled share of requests whose mean gap misses the ITL target (learned from
    the router's per-request SLO counts: the tail model's level, where ``decode`` is its speed)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backlog:
    """Requests queued beyond what the replicas could serve, carried from one segment to the next."""

    prefill: float = 0.0
    """Waiting for prefill (aggregated: for admission)."""
    decode: float = 0.0
    """Prefilled, waiting for a decode slot (disaggregated only)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimate:
    """Latency of a load served by given replicas for one segment of time."""

    ttft_ms: float
    """Estimated TTFT at the model's quantile (0 when nothing arrives)."""
    itl_ms: float
    """Estimated ITL at the model's quantile (0 when nothing decodes)."""
    backlog: Backlog
    """Queues at the end of the segment."""
    decoding: float
    """Sequences decoding across the pool (Little's law), which scale-down must keep room for."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizing:
    """Replicas a pool needs for a target, and how the figure came about."""

    replicas: int
    """Fewest replicas whose estimate meets the target."""
    throughput_replicas: int
    """The throughput bound it started from (tokens/s over tokens/s per replica)."""
    feasible: bool
    """False when no replica count meets the target (even one request alone misses it)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Attainment:
    """Shares of requests expected to meet each target: the per-request SLO, estimated."""

    ttft: float
    """Share whose TTFT (queueing, its own prefill, one decode step) is within the target."""
    itl: float
    """Share whose mean inter-token gap (TPOT) is within the target."""
    reachable: float
    """Share whose own prefill alone fits the TTFT target: no fleet size serves the others in time."""

    @property
    def both(self) -> float:
        """Share meeting both targets (taken as independent)."""
        return self.ttft * self.itl


@dataclasses.dataclass(frozen=True, kw_only=True)
class Means:
    """Mean latencies of a load on given replicas: what engine speed is learned from."""

    ttft_ms: float
    """Mean TTFT."""
    itl_ms: float
    """Mean over requests of their mean inter-token gap (TPOT)."""
    queue_ms: float
    """Of the mean TTFT, the part spent waiting (queueing and draining a backlog)."""


def _search(meets: Callable[[int], bool], start: int) -> int:
    """Smallest ``c >= start`` with ``meets(c)``, for a monotone ``meets``; exponential then binary."""
    low = max(start, 1)
    if meets(low):
        return low
    high = low * 2
    while not meets(high):
        if high >= _SEARCH_LIMIT:
            return _SEARCH_LIMIT
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if meets(middle):
            high = middle
        else:
            low = middle
    return high


class CapacityModel:
    """Estimates and sizing for one engine type described by a :class:`PerfModel`."""

    def __init__(
        self,
        perf: PerfModel,
        *,
        quantile: float = 0.99,
        max_num_seqs: int = 256,
        max_batch_tokens: int = 8192,
        isl_scv: float = 1.0,
        osl_scv: float = 1.0,
        busy_kv_fraction: float = 0.95,
    ) -> None:
        if not 0 < quantile < 1:
            raise ValueError(f"quantile={quantile} must lie in (0, 1)")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be at least 1")
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens={max_batch_tokens} must be at least 1")
        self.perf = perf
        self.quantile = quantile
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.isl_scv = isl_scv
        self.osl_scv = osl_scv
        self.busy_kv_fraction = busy_kv_fraction
        self._z = normal_quantile(quantile)
        self._best_decode: dict[tuple[float, int], float] = {}
        self._prefill_points: dict[tuple[object, ...], _Prompts] = {}
        self._output_points: dict[tuple[float, float | None], NDArray[np.float64]] = {}

    # --- building blocks -----------------------------------------------------------------

    def prefill_service_ms(
        self, isl: float, *, hit_rate: float, scale: float = 1.0, onboard_ms: float = 0.0
    ) -> float:
        """Prefill time of one prompt of ``isl`` tokens with ``hit_rate`` of them cached, after
        ``onboard_ms`` bringing the cached blocks kept below the GPU back, ms."""
        total = max(1, round(isl))
        new_tokens = max(1, round(total * (1.0 - hit_rate)))
        return (
            self.perf.prefill_ms(new_tokens=new_tokens, cached_tokens=total - new_tokens) + onboard_ms
        ) * scale

    def service_scv(self, load: Workload) -> float:
        """Squared coefficient of variation of prefill service time (from p90 when known)."""
        if load.isl_p90 is None:
            return self.isl_scv
        return lognormal_scv(mean=load.isl, p90=load.isl_p90)

    def max_batch(self, context_length: int) -> int:
        """Most sequences one decode engine holds at this context (KV cache and max_num_seqs)."""
        return max(1, min(self.perf.kv_capacity_tokens // context_length, self.max_num_seqs))

    def decode_step_ms(self, sequences: float, *, context_length: int, scale: float = 1.0) -> float:
        """One decode step with ``sequences`` sequences at ``context_length``, ms."""
        return (
            self.perf.decode_itl_ms(
                active_kv_tokens=max(sequences, 1.0) * context_length, context_length=context_length
            )
            * scale
        )

    def _concurrency(
        self, *, servers: int, rate: float, osl: float, step: Callable[[float], float], n_max: int
    ) -> float | None:
        """Sequences per engine at steady state, or ``None`` when the engines cannot keep up."""
        per_engine = rate * osl / (1000.0 * servers)
        if per_engine == 0:
            return 0.0
        if n_max - per_engine * step(n_max) < 0:
            return None
        low, high = 0.0, float(n_max)
        for _ in range(_BISECTION_STEPS):
            middle = (low + high) / 2
            if middle - per_engine * step(middle) < 0:
                low = middle
            else:
                high = middle
        return high

    def _queue(
        self,
        *,
        servers: int,
        rate: float,
        service_ms: float,
        tail_ms: float,
        scv: float,
        backlog: float,
        duration_s: float,
    ) -> tuple[float, float]:
        """(latency ms at the quantile, backlog at the end) of an M/G/c queue with a fluid overload."""
        if rate <= 0 and backlog <= 0:
            return 0.0, 0.0
        if servers == 0:
            return duration_s * 1000.0 + tail_ms, backlog + rate * duration_s
        capacity = servers * 1000.0 / service_ms
        end = max(0.0, backlog + (rate - capacity) * duration_s)
        stationary = math.inf
        if rate < capacity:
            stationary = wait_quantile_s(
                servers=servers,
                arrival_rate=rate,
                service_s=service_ms / 1000.0,
                quantile=self.quantile,
                service_scv=scv,
            )
        wait = self._tail_wait_s(
            rate=rate,
            capacity=capacity,
            stationary_s=stationary,
            backlog=backlog,
            end=end,
            duration_s=duration_s,
            scv=scv,
        )
        return wait * 1000.0 + tail_ms, end

    def _tail_wait_s(
        self,
        *,
        rate: float,
        capacity: float,
        stationary_s: float,
        backlog: float,
        end: float,
        duration_s: float,
        scv: float,
    ) -> float:
        """Wait at the quantile: the steady-state tail plus draining any backlog, but never more
        than a segment this long can build up -- the fluid backlog plus ``z`` standard deviations
        of arrivals minus completions (a Brownian bound, which is what holds near and past
        saturation, where the steady state is never reached)."""
        queued = max(backlog, end)
        steady = stationary_s + queued / capacity
        spread = self._z * math.sqrt((rate + capacity * scv) * duration_s)
        return min(steady, (queued + spread) / capacity)

    def _decode(
        self,
        *,
        servers: int,
        rate: float,
        load: Workload,
        backlog: float,
        duration_s: float,
        scale: float,
        slowdown: float = 1.0,
    ) -> tuple[float, float, float]:
        """(ITL ms at the quantile, backlog at the end, sequences per engine) of a decode pool."""
        if rate <= 0 and backlog <= 0:
            return 0.0, 0.0, 0.0
        if servers == 0:
            return duration_s * 1000.0, backlog + rate * duration_s, 0.0
        context = load.context_length
        n_max = self.max_batch(context)

        def step(n: float) -> float:
            return self.decode_step_ms(n, context_length=context, scale=scale) * slowdown

        full_rate = servers * n_max * 1000.0 / (step(n_max) * load.osl)
        sequences = self._concurrency(servers=servers, rate=rate, osl=load.osl, step=step, n_max=n_max)
        busy = float(n_max) if sequences is None else sequences
        tail = min(busy + self._z * math.sqrt(busy), float(n_max))
        end = max(0.0, backlog + (rate - full_rate) * duration_s)
        stall_ms = max(backlog, end) / full_rate * 1000.0
        return step(tail) + stall_ms, end, busy

    # --- estimates ---------------------------------------------------------------------------

    def estimate(
        self,
        *,
        replicas: Mapping[Role, int],
        load: Workload,
        duration_s: float,
        backlog: Backlog | None = None,
        corrections: Corrections | None = None,
    ) -> Estimate:
        """TTFT and ITL of ``load`` for ``duration_s`` on ``replicas`` (``{WORKER: n}`` for aggregated
        serving, ``{PREFILL: p, DECODE: d}`` for disaggregated), starting with ``backlog`` queued."""
        backlog = backlog or Backlog()
        corrections = corrections or Corrections()
        if Role.WORKER in replicas:
            return self._aggregated(
                servers=replicas[Role.WORKER],
                load=load,
                duration_s=duration_s,
                backlog=backlog,
                corrections=corrections,
            )
        prefill, decode = replicas[Role.PREFILL], replicas[Role.DECODE]
        service = self.prefill_service_ms(
            load.isl, hit_rate=load.kv_hit_rate, scale=corrections.prefill, onboard_ms=load.onboard_ms
        )
        tail = self.prefill_service_ms(
            load.isl_p90 or load.isl,
            hit_rate=load.kv_hit_rate,
            scale=corrections.prefill,
            onboard_ms=load.onboard_ms,
        )
        ttft, prefill_end = self._queue(
            servers=prefill,
            rate=load.rate,
            service_ms=service,
            tail_ms=tail,
            scv=self.service_scv(load),
            backlog=backlog.prefill,
            duration_s=duration_s,
        )
        # Decode receives what prefill completes, not what arrives.
        offered = load.rate + backlog.prefill / duration_s
        handed_over = min(offered, prefill * 1000.0 / service) if prefill else 0.0
        itl, decode_end, per_engine = self._decode(
            servers=decode,
            rate=handed_over,
            load=load,
            backlog=backlog.decode,
            duration_s=duration_s,
            scale=corrections.decode,
        )
        return Estimate(
            ttft_ms=ttft,
            itl_ms=itl,
            backlog=Backlog(prefill=prefill_end, decode=decode_end),
            decoding=per_engine * decode,
        )

    def _aggregated(
        self, *, servers: int, load: Workload, duration_s: float, backlog: Backlog, corrections: Corrections
    ) -> Estimate:
        if load.rate <= 0 and backlog.prefill <= 0:
            return Estimate(ttft_ms=0.0, itl_ms=0.0, backlog=Backlog(), decoding=0.0)
        if servers == 0:
            # Nothing serves: everything waits for the whole segment.
            waited = duration_s * 1000.0
            end = backlog.prefill + load.rate * duration_s
            return Estimate(ttft_ms=waited, itl_ms=waited, backlog=Backlog(prefill=end), decoding=0.0)
        service = self.prefill_service_ms(
            load.isl, hit_rate=load.kv_hit_rate, scale=corrections.prefill, onboard_ms=load.onboard_ms
        )
        tail = self.prefill_service_ms(
            load.isl_p90 or load.isl,
            hit_rate=load.kv_hit_rate,
            scale=corrections.prefill,
            onboard_ms=load.onboard_ms,
        )
        context = load.context_length
        n_max = self.max_batch(context)

        def step(n: float) -> float:
            return self.decode_step_ms(n, context_length=context, scale=corrections.decode)

        # Engine time per request at full batches: its prefill plus its share of decode steps.
        work_ms = service + load.osl * step(n_max) / n_max
        capacity = servers * 1000.0 / work_ms
        share = load.rate * service / (1000.0 * servers)
        sequences = None
        if share < 1:
            sequences = self._concurrency(
                servers=servers,
                rate=load.rate,
                osl=load.osl,
                step=lambda n: step(n) / (1.0 - share),
                n_max=n_max,
            )
        end = max(0.0, backlog.prefill + (load.rate - capacity) * duration_s)
        scv = self.service_scv(load)
        stationary = math.inf
        if sequences is not None:
            stationary = wait_quantile_s(
                servers=servers,
                arrival_rate=load.rate,
                service_s=service / 1000.0,
                quantile=self.quantile,
                service_scv=scv,
            )
        wait_ms = 1000.0 * self._tail_wait_s(
            rate=load.rate,
            capacity=capacity,
            stationary_s=stationary,
            backlog=backlog.prefill,
            end=end,
            duration_s=duration_s,
            scv=scv,
        )
        if sequences is None:
            # Saturated: batches are full and prefill gets the time full batches leave it; requests
            # waiting for admission also stall those decoding behind them.
            busy, share, stall_ms = float(n_max), capacity * service / (1000.0 * servers), wait_ms
        else:
            busy, stall_ms = sequences, 0.0
        tail_busy = min(busy + self._z * math.sqrt(busy), float(n_max))
        return Estimate(
            ttft_ms=wait_ms + tail + step(busy),
            itl_ms=step(tail_busy) / (1.0 - share) + stall_ms,
            backlog=Backlog(prefill=end),
            decoding=busy * servers,
        )

    # --- per-request attainment and means -------------------------------------------------

    def prompt_prefill_ms(self, load: Workload, *, scale: float = 1.0) -> NDArray[np.float64]:
        """Prefill times of ``_PROMPT_POINTS`` equally likely prompts of ``load`` (lengths spread as
        its uncached tokens' quantiles, else a gamma with its mean and p90, :meth:`_prompt_lengths`;
        each prompt's uncached part at the hit rate), ms, ascending."""
        return self._prompts(load, scale=scale).times

    def _prompts(self, load: Workload, *, scale: float) -> _Prompts:
        p90 = None if load.isl_p90 is None else round(load.isl_p90, 3)
        quantiles = load.uncached_quantiles
        spread = None if quantiles is None else tuple(round(q, 3) for q in quantiles)
        # Not keyed on the scale (times are proportional to it): solving a correction factor
        # tries thirty scales on one interval's load.
        key = (round(load.isl, 3), p90, spread, round(load.kv_hit_rate, 9), round(load.onboard_ms, 6))
        prompts = self._prefill_points.get(key)
        if prompts is None:
            lengths = self._prompt_lengths(load, p90=p90, uncached=spread)
            times = np.array(
                [
                    self.prefill_service_ms(float(x), hit_rate=load.kv_hit_rate, onboard_ms=load.onboard_ms)
                    for x in lengths
                ]
            )
            uncached = np.maximum(1.0, np.round(lengths * (1.0 - load.kv_hit_rate)))
            chunks = np.ceil(uncached / self.max_batch_tokens)
            if len(self._prefill_points) >= _SHAPE_CACHE_SIZE:
                self._prefill_points.clear()
            prompts = self._prefill_points[key] = _Prompts(lengths=lengths, times=times, chunks=chunks)
        return prompts if scale == 1.0 else dataclasses.replace(prompts, times=prompts.times * scale)

    def _prompt_lengths(
        self, load: Workload, *, p90: float | None, uncached: tuple[float, ...] | None
    ) -> NDArray[np.float64]:
        """``_PROMPT_POINTS`` equally likely prompt lengths with ``load``'s mean: spread as its
        uncached tokens' quantiles say (each at the mean hit rate: a prompt that carries a long
        cached history counts as the short prompt it costs), else a gamma through the mean and
        ``p90``."""
        missed = 1.0 - load.kv_hit_rate
        if uncached is None or uncached[-1] <= 0 or missed <= 0:
            return gamma_points(mean=load.isl, p90=p90, scv=self.isl_scv, count=_PROMPT_POINTS)
        return quantile_points(
            levels=tuple(UNCACHED_QUANTILES.values()),
            values=tuple(value / missed for value in uncached),
            mean=load.isl,
            count=_PROMPT_POINTS,
        )

    def _output_lengths(self, load: Workload) -> NDArray[np.float64]:
        """``_OUTPUT_POINTS`` equally likely output lengths: a gamma with ``load``'s mean and p10, or
        ``osl_scv`` without a p10. Kept per shape: fitting the gamma costs more than the rest of an
        :meth:`attainment`, which sizing asks for many times per load."""
        key = (round(load.osl, 3), None if load.osl_p10 is None else round(load.osl_p10, 3))
        outputs = self._output_points.get(key)
        if outputs is None:
            if len(self._output_points) >= _SHAPE_CACHE_SIZE:
                self._output_points.clear()
            outputs = self._output_points[key] = gamma_points(
                mean=load.osl, p10=load.osl_p10, scv=self.osl_scv, count=_OUTPUT_POINTS
            )
        return outputs

    def _pool_state(
        self, *, servers: int, rate: float, load: Workload, corrections: Corrections, prefill_share: bool
    ) -> _PoolState | None:
        """Prefill times, decode step and concurrency of ``servers`` engines at ``rate``; ``None`` when
        they cannot keep up. ``prefill_share``: the engines also prefill (aggregated serving)."""
        times = self.prompt_prefill_ms(load, scale=corrections.prefill)
        context = load.context_length
        n_max = self.max_batch(context)
        share = rate * float(times.mean()) / (1000.0 * servers) if prefill_share else 0.0
        if share >= 1:
            return None

        def step(n: float) -> float:
            return self.decode_step_ms(n, context_length=context, scale=corrections.decode)

        sequences = self._concurrency(
            servers=servers, rate=rate, osl=load.osl, step=lambda n: step(n) / (1.0 - share), n_max=n_max
        )
        if sequences is None:
            return None
        return _PoolState(times=times, share=share, sequences=sequences, step=step, n_max=n_max)

    def _batch_spread_ms(self, state: _PoolState) -> float:
        """Standard deviation of a request's gap from its batch varying around the pool's mean
        concurrency (Poisson, ``sqrt(n)``)."""
        n = state.sequences
        return (state.step(n + math.sqrt(max(n, 1.0))) - state.step(n)) / (1.0 - state.share)

    def _itl_attainment(
        self, state: _PoolState, *, servers: int, rate: float, load: Workload, itl_ms: float, scale: float
    ) -> float:
        """Share of requests whose mean inter-token gap is within ``itl_ms``, over output lengths
        (gamma with the load's mean and p10, or ``osl_scv`` without a p10).

        A decode pool's gap is the step at its concurrency, spread by the batch (normal). In an
        aggregated engine a request of ``g`` gaps takes ``g`` steps of ``b`` ms, plus the prefill
        chunks that share them (``max_batch_tokens`` tokens each): the prompts that arrive during
        its steps (at the engine's prompt rate over ``g * b``; on average half its steps left to
        share) and those in progress when it starts (at that rate over each prompt's own duration;
        on average half their chunks left), a Poisson number. A short output has few gaps, so one
        long prompt's chunk can put its mean gap over the target: this is the tail that misses, not
        the mean stretch of ``1 / (1 - share)``. Sums of one and two prompts are exact over the
        prompt points; three or more are normal."""
        outputs = self._output_lengths(load)
        gaps = np.maximum(np.round(outputs) - 1.0, 0.0)
        step = state.step(state.sequences)
        batch = self._batch_spread_ms(state)
        if state.share <= 0:
            if batch == 0:
                return 1.0 if step <= itl_ms else 0.0
            return _normal_cdf((itl_ms - step) / batch)
        prompts = self._prompts(load, scale=scale)
        times = prompts.times[_CHUNK_PROMPT_STRIDE // 2 :: _CHUNK_PROMPT_STRIDE]
        chunks = prompts.chunks[_CHUNK_PROMPT_STRIDE // 2 :: _CHUNK_PROMPT_STRIDE]
        g, share = np.unique(gaps[gaps > 0], return_counts=True)
        if not len(g):
            return 1.0
        col = g[:, None]
        chunk_ms = times / chunks
        # Prompts arriving during the request's steps (on average half of its steps left to share)
        # and prompts already in progress when it starts (on average half of their chunks left).
        arriving = chunk_ms * np.minimum(chunks, np.maximum(1.0, col / 2.0))
        in_progress = chunk_ms * np.minimum(np.floor(chunks / 2.0), col)
        duration = np.broadcast_to(times + chunks * step, arriving.shape)  # a prompt's own steps, ms
        windows = np.concatenate([np.broadcast_to(col * step, arriving.shape), duration], axis=1)
        slack = g * (itl_ms - step)  # extra time a request of g gaps can take
        missed = _compound_poisson_tail(
            slack,
            mean_count=rate / servers / 1000.0 * windows.sum(axis=1) / len(times),
            values=np.concatenate([arriving, in_progress], axis=1),
            weights=windows / windows.sum(axis=1, keepdims=True),
            spread=batch * g,
        )
        missed = np.where(slack <= 0, 1.0, missed)
        return 1.0 - float(np.dot(share, missed)) / len(gaps)

    def _kv_overflow(self, state: _PoolState, *, servers: int, rate: float, load: Workload) -> float:
        """Share of the time no decode worker takes a new request, so that a request arriving then
        waits for room before its first token: the router charges each request its prompt and its
        whole output from routing (its prefill on a prefill worker included) to its last token,
        and skips a worker whose charges pass ``busy_kv_fraction`` of its cache. In flight: the
        ``servers x state.sequences`` decoding plus those in prefill (``rate`` times the mean
        prefill), a Poisson number of them, each charge held as long as its output takes (so
        outputs count weighted by their length); their sum is near normal, mean ``n E[c]`` and
        variance ``n E[c^2]``, against the pool's room (the router balances the charges, so a
        request waits only when the pool as a whole is full). Long prompts fill a cache well before
        its mean batch does: this, not the decode step, is what one decode engine too few costs."""
        if state.sequences <= 0:
            return 0.0
        prompts = self._prompts(load, scale=1.0).lengths
        outputs = self._output_lengths(load)
        held = outputs / outputs.mean()
        prompt, output = float(prompts.mean()), float(np.mean(outputs * held))
        mean_charge = prompt + output
        charge_square = (
            float(np.mean(prompts * prompts)) + 2.0 * prompt * output + float(np.mean(outputs**2 * held))
        )
        in_flight = servers * state.sequences + rate * float(state.times.mean()) / 1000.0
        mean = in_flight * mean_charge
        std = math.sqrt(in_flight * charge_square)
        room = servers * self.busy_kv_fraction * self.perf.kv_capacity_tokens
        return 1.0 - _normal_cdf((room - mean) / std)

    def reachable(self, load: Workload, *, ttft_ms: float, corrections: Corrections) -> float:
        """Share of ``load``'s requests whose own prefill and first decode step fit ``ttft_ms``: no
        fleet size serves the others in time."""
        times = self.prompt_prefill_ms(load, scale=corrections.prefill)
        first_step = self.decode_step_ms(1.0, context_length=load.context_length, scale=corrections.decode)
        return float(np.mean(times + first_step <= ttft_ms))

    def attainment(
        self,
        *,
        replicas: Mapping[Role, int],
        load: Workload,
        ttft_ms: float,
        itl_ms: float,
        corrections: Corrections | None = None,
    ) -> Attainment:
        """Shares of ``load``'s requests meeting ``ttft_ms`` and ``itl_ms`` at steady state on
        ``replicas``: each prompt's TTFT is the M/G/c wait (Erlang C tail) plus its own prefill
        (its uncached tokens) plus one decode step, and in a disaggregated fleet a request that
        finds its decode engine's cache full (:meth:`_kv_overflow`) is late; each request's mean
        gap is the decode step at the pool's concurrency, stretched by the engine time prefill takes
        (aggregated), with the spread of :meth:`_gap_spread_ms` (normal)."""
        corrections = corrections or Corrections()
        times = self.prompt_prefill_ms(load, scale=corrections.prefill)
        aggregated = Role.WORKER in replicas
        reachable = self.reachable(load, ttft_ms=ttft_ms, corrections=corrections)
        if load.rate <= 0:
            return Attainment(ttft=1.0, itl=1.0, reachable=reachable)
        if aggregated:
            front = back = replicas[Role.WORKER]
        else:
            front, back = replicas[Role.PREFILL], replicas[Role.DECODE]
        if front == 0 or back == 0:
            return Attainment(ttft=0.0, itl=0.0, reachable=reachable)
        state = self._pool_state(
            servers=back, rate=load.rate, load=load, corrections=corrections, prefill_share=aggregated
        )
        if state is None:
            return Attainment(ttft=0.0, itl=0.0, reachable=reachable)
        # The front queue: an engine's time per request (its prefill, plus in aggregated engines its
        # share of decode steps at full batches); the variability is that of the prefills.
        mean_prefill = float(times.mean())
        work_ms = mean_prefill
        if aggregated:
            work_ms += load.osl * state.step(state.n_max) / state.n_max
        # The first token is a decode step's: an aggregated engine's, or the decode engine's once
        # it has taken the request's KV.
        first = state.step(state.sequences)
        late = wait_exceeds(
            (ttft_ms - times - first) / 1000.0,
            servers=front,
            arrival_rate=load.rate,
            service_s=work_ms / 1000.0,
            service_scv=float(np.var(times)) / (work_ms * work_ms),
        )
        modelled = self._itl_attainment(
            state, servers=back, rate=load.rate, load=load, itl_ms=itl_ms, scale=corrections.prefill
        )
        itl = 1.0 - min(1.0, corrections.itl_tail * (1.0 - modelled))
        ttft = float(np.mean(1.0 - late))
        if not aggregated:
            ttft *= 1.0 - self._kv_overflow(state, servers=back, rate=load.rate, load=load)
        return Attainment(ttft=ttft, itl=itl, reachable=reachable)

    def means(
        self,
        *,
        replicas: Mapping[Role, int],
        load: Workload,
        duration_s: float,
        backlog: float = 0.0,
        corrections: Corrections | None = None,
    ) -> Means:
        """Mean TTFT and mean TPOT of ``load`` served for ``duration_s`` by ``replicas`` that start with
        ``backlog`` requests queued: the M/G/c mean wait, plus draining the backlog (a fluid queue),
        plus the mean prefill and one decode step; the mean gap as in :meth:`attainment`. Saturated
        pools get full batches and the fluid queue's mean wait."""
        corrections = corrections or Corrections()
        times = self.prompt_prefill_ms(load, scale=corrections.prefill)
        mean_prefill = float(times.mean())
        aggregated = Role.WORKER in replicas
        if aggregated:
            front = back = replicas[Role.WORKER]
        else:
            front, back = replicas[Role.PREFILL], replicas[Role.DECODE]
        context = load.context_length
        n_max = self.max_batch(context)
        full_step = self.decode_step_ms(n_max, context_length=context, scale=corrections.decode)
        work_ms = mean_prefill + (load.osl * full_step / n_max if aggregated else 0.0)
        if front == 0 or back == 0:
            waited = duration_s * 1000.0
            return Means(ttft_ms=waited + mean_prefill, itl_ms=full_step, queue_ms=waited)
        capacity = front * 1000.0 / work_ms
        state = self._pool_state(
            servers=back, rate=load.rate, load=load, corrections=corrections, prefill_share=aggregated
        )
        if state is None or load.rate >= capacity:
            # Saturated: the queue grows through the segment; requests wait on average for half of it.
            growth = max(load.rate - capacity, 0.0) * duration_s
            queue_ms = (backlog + growth / 2.0) / capacity * 1000.0
            share = min(load.rate, capacity) * mean_prefill / (1000.0 * front) if aggregated else 0.0
            itl = full_step / max(1.0 - share, 1e-3)
            return Means(ttft_ms=queue_ms + mean_prefill + full_step, itl_ms=itl, queue_ms=queue_ms)
        wait_ms = 1000.0 * mean_wait_s(
            servers=front,
            arrival_rate=load.rate,
            service_s=work_ms / 1000.0,
            service_scv=float(np.var(times)) / (work_ms * work_ms),
        )
        if backlog > 0:
            # The backlog drains at the spare capacity; the requests arriving meanwhile find half of it.
            drain_s = backlog / (capacity - load.rate)
            wait_ms += min(1.0, drain_s / duration_s) * backlog / 2.0 / capacity * 1000.0
        first = state.step(state.sequences)
        gap = first / (1.0 - state.share)
        return Means(ttft_ms=wait_ms + mean_prefill + first, itl_ms=gap, queue_ms=wait_ms)

    # --- sizing ------------------------------------------------------------------------------

    def _size(
        self,
        *,
        replicas: Callable[[int], Mapping[Role, int]],
        load: Workload,
        ttft_ms: float,
        itl_ms: float,
        corrections: Corrections,
        goal: float,
        bound: int,
        check_ttft: bool = True,
        check_itl: bool = True,
    ) -> Sizing:
        """Fewest ``c`` (from ``bound``) with ``replicas(c)`` serving ``goal`` of the requests that can
        be served in time at all (``goal x reachable``): requests whose own prefill exceeds the TTFT
        target are lost whatever the fleet, so they do not make the fleet grow."""
        alone = self.decode_step_ms(1.0, context_length=load.context_length, scale=corrections.decode)
        probe = self.attainment(
            replicas=replicas(max(bound, 1)),
            load=load,
            ttft_ms=ttft_ms,
            itl_ms=itl_ms,
            corrections=corrections,
        )
        reachable = probe.reachable if check_ttft else 1.0
        feasible = reachable >= goal and not (check_itl and alone > itl_ms)
        if reachable <= 0 or (check_itl and alone > itl_ms):
            return Sizing(replicas=bound, throughput_replicas=bound, feasible=False)
        need = goal * reachable

        def meets(servers: int) -> bool:
            att = self.attainment(
                replicas=replicas(servers), load=load, ttft_ms=ttft_ms, itl_ms=itl_ms, corrections=corrections
            )
            return (att.ttft if check_ttft else 1.0) * (att.itl if check_itl else 1.0) >= need

        return Sizing(replicas=_search(meets, bound), throughput_replicas=bound, feasible=feasible)

    def prefill_replicas(
        self,
        load: Workload,
        *,
        ttft_ms: float,
        scale: float = 1.0,
        goal: float = 0.99,
        decode: int = 1 << 16,
    ) -> Sizing:
        """Fewest prefill engines serving ``goal`` of ``load``'s requests (that can meet it) within
        ``ttft_ms``; ``decode`` engines take the handed-over requests (enough not to matter)."""
        if load.rate <= 0:
            return Sizing(replicas=0, throughput_replicas=0, feasible=True)
        mean_ms = float(self.prompt_prefill_ms(load, scale=scale).mean())
        bound = math.ceil(load.rate * mean_ms / 1000.0)  # one prompt at a time per engine
        return self._size(
            replicas=lambda c: {Role.PREFILL: c, Role.DECODE: decode},
            load=load,
            ttft_ms=ttft_ms,
            itl_ms=math.inf,
            corrections=Corrections(prefill=scale),
            goal=goal,
            bound=bound,
            check_itl=False,
        )

    def decode_throughput_per_engine(self, load: Workload, *, itl_ms: float, scale: float = 1.0) -> float:
        """Output tokens/s of one engine at the best batch whose ITL meets ``itl_ms`` (0 if none)."""
        key = (round(itl_ms / scale, 9), load.context_length)
        per_gpu = self._best_decode.get(key)
        if per_gpu is None:
            # The perf model scans every batch size; the answer depends only on the key.
            per_gpu = self.perf.best_decode_tokens_per_s_per_gpu(
                itl_ms=key[0], context_length=key[1], max_num_seqs=self.max_num_seqs
            )
            if len(self._best_decode) >= _CACHE_SIZE:
                self._best_decode.clear()
            self._best_decode[key] = per_gpu
        return per_gpu * self.perf.gpus_per_engine / scale

    def _full_batch_tokens_per_s(self, load: Workload, *, scale: float) -> float:
        n_max = self.max_batch(load.context_length)
        return n_max * 1000.0 / self.decode_step_ms(n_max, context_length=load.context_length, scale=scale)

    def decode_replicas(
        self, load: Workload, *, itl_ms: float, scale: float = 1.0, goal: float = 0.99
    ) -> Sizing:
        """Fewest decode engines giving ``goal`` of ``load``'s requests a mean gap within ``itl_ms``
        and room in their cache when they are handed over (the TTFT a decode pool can cost)."""
        if load.rate <= 0:
            return Sizing(replicas=0, throughput_replicas=0, feasible=True)
        per_engine = self.decode_throughput_per_engine(load, itl_ms=itl_ms, scale=scale)
        if per_engine <= 0:
            # No batch meets the target: size for throughput at full batches and say so.
            bound = math.ceil(load.rate * load.osl / self._full_batch_tokens_per_s(load, scale=scale))
            return Sizing(replicas=bound, throughput_replicas=bound, feasible=False)
        bound = math.ceil(load.rate * load.osl / per_engine)
        return self._size(
            replicas=lambda c: {Role.PREFILL: 1 << 16, Role.DECODE: c},
            load=load,
            ttft_ms=math.inf,
            itl_ms=itl_ms,
            corrections=Corrections(decode=scale),
            goal=goal,
            bound=bound,
        )

    def disaggregated_replicas(
        self,
        load: Workload,
        *,
        ttft_ms: float,
        itl_ms: float,
        gpus_per_replica: Mapping[Role, int],
        corrections: Corrections | None = None,
        goal: float = 0.99,
    ) -> dict[Role, Sizing]:
        """Cheapest prefill and decode pools (by GPUs) serving ``goal`` of ``load``'s requests (of
        those that can be served in time) within both targets, the pools judged together: a request
        meets the SLO only if both serve it in time, so the misses fall where they save the most
        GPUs, not half in each pool. Neither pool is smaller than what the goal needs of it alone;
        decode sizes from there up are tried while one can still cost less."""
        if load.rate <= 0:
            empty = Sizing(replicas=0, throughput_replicas=0, feasible=True)
            return {Role.PREFILL: empty, Role.DECODE: empty}
        corrections = corrections or Corrections()
        prefill = self.prefill_replicas(load, ttft_ms=ttft_ms, scale=corrections.prefill, goal=goal)
        decode = self.decode_replicas(load, itl_ms=itl_ms, scale=corrections.decode, goal=goal)
        if not (prefill.feasible and decode.feasible):
            return {Role.PREFILL: prefill, Role.DECODE: decode}

        def fewest(replicas: Callable[[int], Mapping[Role, int]], *, bound: int) -> int:
            return self._size(
                replicas=replicas,
                load=load,
                ttft_ms=ttft_ms,
                itl_ms=itl_ms,
                corrections=corrections,
                goal=goal,
                bound=bound,
            ).replicas

        # With every prompt prefilled at once only the decode pool misses: alone it must meet the goal.
        first_d = fewest(lambda servers: {Role.PREFILL: 1 << 16, Role.DECODE: servers}, bound=decode.replicas)
        gpus_p, gpus_d = gpus_per_replica[Role.PREFILL], gpus_per_replica[Role.DECODE]
        best = (math.inf, prefill.replicas, first_d)  # (GPUs, prefill, decode)
        for servers_d in range(first_d, first_d + _DECODE_TRIES):
            if prefill.replicas * gpus_p + servers_d * gpus_d >= best[0]:
                break

            def pools(servers: int, servers_d: int = servers_d) -> Mapping[Role, int]:
                return {Role.PREFILL: servers, Role.DECODE: servers_d}

            servers_p = fewest(pools, bound=prefill.replicas)
            if servers_p * gpus_p + servers_d * gpus_d < best[0]:
                best = (servers_p * gpus_p + servers_d * gpus_d, servers_p, servers_d)
        _, servers_p, servers_d = best
        return {
            Role.PREFILL: dataclasses.replace(prefill, replicas=servers_p),
            Role.DECODE: dataclasses.replace(decode, replicas=servers_d),
        }

    def aggregated_replicas(
        self,
        load: Workload,
        *,
        ttft_ms: float,
        itl_ms: float,
        corrections: Corrections | None = None,
        goal: float = 0.99,
    ) -> Sizing:
        """Fewest aggregated engines serving ``goal`` of ``load``'s requests (of those that can be
        served in time) within both targets."""
        if load.rate <= 0:
            return Sizing(replicas=0, throughput_replicas=0, feasible=True)
        corrections = corrections or Corrections()
        mean_ms = float(self.prompt_prefill_ms(load, scale=corrections.prefill).mean())
        per_engine = self.decode_throughput_per_engine(load, itl_ms=itl_ms, scale=corrections.decode)
        if per_engine <= 0:
            per_engine = self._full_batch_tokens_per_s(load, scale=corrections.decode)
        # Engine-seconds per second: prefill time plus decode time at the best batch.
        bound = math.ceil(load.rate * mean_ms / 1000.0 + load.rate * load.osl / per_engine)
        return self._size(
            replicas=lambda c: {Role.WORKER: c},
            load=load,
            ttft_ms=ttft_ms,
            itl_ms=itl_ms,
            corrections=corrections,
            goal=goal,
            bound=bound,
        )


def capacity_for(perf: PerfModel, *, config: PlannerConfig, limits: Limits) -> CapacityModel:
    """The capacity model a planner with ``config`` uses for a deployment with ``limits``."""
    return CapacityModel(
        perf,
        quantile=config.quantile,
        max_num_seqs=limits.max_num_seqs,
        max_batch_tokens=limits.max_batch_tokens,
        isl_scv=config.isl_scv,
        osl_scv=config.osl_scv,
        busy_kv_fraction=config.router_busy_kv_fraction,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Prompts:
    """Equally likely prompts of a load."""

    lengths: NDArray[np.float64]
    """Their tokens, cached or not."""
    times: NDArray[np.float64]
    """Prefill time of each, ms, ascending."""
    chunks: NDArray[np.float64]
    """Steps each prefill takes (its uncached tokens over the step's token budget, rounded up)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class _PoolState:
    """A pool at steady state: what attainment and means are computed from."""

    times: NDArray[np.float64]
    """Prefill times of equally likely prompts, ms."""
    share: float
    """Share of engine time prefill takes (0 for a decode pool)."""
    sequences: float
    """Sequences decoding per engine (Little's law)."""
    step: Callable[[float], float]
    """Decode step time (ms) with that many sequences."""
    n_max: int
    """Largest batch."""


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def _compound_poisson_tail(
    threshold: NDArray[np.float64],
    *,
    mean_count: NDArray[np.float64],
    values: NDArray[np.float64],
    weights: NDArray[np.float64],
    spread: NDArray[np.float64],
) -> NDArray[np.float64]:
    """Per row: P(Y_1 + ... + Y_N + e > threshold), N Poisson with ``mean_count``, the Y drawn from
    the row of ``values`` with that row of ``weights`` (summing to 1), e normal with standard
    deviation ``spread``. Exact for N of one and two (e left out), normal for three or more."""
    x = threshold[:, None]
    one = np.sum(weights * (values > x), axis=1)
    # pairs only where some pass and some do not (the rest: all or none)
    top_value = values.max(axis=1)
    two = np.where(2.0 * values.min(axis=1) > threshold, 1.0, 0.0)
    mixed = (2.0 * top_value > threshold) & (two == 0.0)
    if mixed.any():
        v, w = values[mixed], weights[mixed]
        passes = (v[:, :, None] + v[:, None, :] > threshold[mixed][:, None, None]).astype(np.float64)
        two[mixed] = np.sum(w * (passes @ w[:, :, None])[:, :, 0], axis=1)
    mean = np.sum(weights * values, axis=1)
    variance = np.maximum(np.sum(weights * values * values, axis=1) - mean * mean, 0.0)
    top = max(3, math.ceil(float(mean_count.max()) + 8.0 * math.sqrt(float(mean_count.max())) + 5.0))
    counts = np.arange(3, top + 1, dtype=np.float64)[None, :]
    m = mean_count[:, None]
    sd = np.sqrt(counts * variance[:, None] + (spread * spread)[:, None])
    more = ndtr((counts * mean[:, None] - x) / np.maximum(sd, 1e-12))
    weights_n = np.exp(counts * np.log(np.maximum(m, 1e-300)) - m - gammaln(counts + 1.0))
    p0 = np.exp(-mean_count)
    zero = np.where(spread > 0, 1.0 - ndtr(threshold / np.maximum(spread, 1e-12)), 0.0)
    tail = p0 * (zero + mean_count * one + mean_count**2 / 2.0 * two) + np.sum(weights_n * more, axis=1)
    return np.asarray(np.clip(tail, 0.0, 1.0), dtype=np.float64)
