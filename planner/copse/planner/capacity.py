"""Capacity from the shared perf model: latency of a load on given replicas, and replicas for a target.

Built on :class:`copse.workers.perf.PerfModel` (the same model the mocker and the router use), with
queueing added here:

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

Sizing searches the fewest replicas whose estimate meets the target, starting from the
throughput bound the issue asks for: prefill tokens/s net of the prefix-cache hit rate over the
perf model's prefill tokens/s per GPU, and output tokens/s over the best decode tokens/s per GPU
whose ITL meets the target at the expected context length.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from copse.api import Role
from copse.planner.queueing import lognormal_scv, normal_quantile, wait_quantile_s
from copse.workers.perf import PerfModel

#: Largest replica count sizing will consider before calling a target unreachable.
_SEARCH_LIMIT = 1 << 20
#: Segment length sizing checks use: steady state (no transient bound, a backlog never drains).
_STEADY = math.inf
#: Entries of the best-decode-point cache before it is emptied (a few per distinct context length).
_CACHE_SIZE = 4096
#: Bisection steps for the decode concurrency fixed point (2^-40 of the batch range).
_BISECTION_STEPS = 40


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
        isl_scv: float = 1.0,
    ) -> None:
        if not 0 < quantile < 1:
            raise ValueError(f"quantile={quantile} must lie in (0, 1)")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be at least 1")
        self.perf = perf
        self.quantile = quantile
        self.max_num_seqs = max_num_seqs
        self.isl_scv = isl_scv
        self._z = normal_quantile(quantile)
        self._best_decode: dict[tuple[float, int], float] = {}

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

    # --- sizing ------------------------------------------------------------------------------

    def prefill_replicas(self, load: Workload, *, ttft_ms: float, scale: float = 1.0) -> Sizing:
        """Fewest prefill engines whose TTFT estimate for ``load`` meets ``ttft_ms``."""
        if load.rate <= 0:
            return Sizing(replicas=0, throughput_replicas=0, feasible=True)
        isl = max(2, round(load.isl))
        cached = min(isl - 1, round(isl * load.kv_hit_rate))
        per_request_ms = (
            self.perf.prefill_ms(new_tokens=isl - cached, cached_tokens=cached) + load.onboard_ms
        ) * scale
        # the throughput bound: a prefill engine serves one prompt at a time
        bound = math.ceil(load.rate * per_request_ms / 1000.0)
        tail = self.prefill_service_ms(
            load.isl_p90 or load.isl, hit_rate=load.kv_hit_rate, scale=scale, onboard_ms=load.onboard_ms
        )
        if tail > ttft_ms:
            return Sizing(replicas=bound, throughput_replicas=bound, feasible=False)
        corrections = Corrections(prefill=scale)

        def meets(servers: int) -> bool:
            estimate = self.estimate(
                replicas={Role.PREFILL: servers, Role.DECODE: 0},
                load=load,
                duration_s=_STEADY,
                corrections=corrections,
            )
            return estimate.ttft_ms <= ttft_ms

        return Sizing(replicas=_search(meets, bound), throughput_replicas=bound, feasible=True)

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

    def decode_replicas(self, load: Workload, *, itl_ms: float, scale: float = 1.0) -> Sizing:
        """Fewest decode engines whose ITL estimate for ``load`` meets ``itl_ms``."""
        if load.rate <= 0:
            return Sizing(replicas=0, throughput_replicas=0, feasible=True)
        per_engine = self.decode_throughput_per_engine(load, itl_ms=itl_ms, scale=scale)
        if per_engine <= 0:
            # No batch meets the target: size for throughput at full batches and say so.
            n_max = self.max_batch(load.context_length)
            full = (
                n_max * 1000.0 / self.decode_step_ms(n_max, context_length=load.context_length, scale=scale)
            )
            bound = math.ceil(load.rate * load.osl / full)
            return Sizing(replicas=bound, throughput_replicas=bound, feasible=False)
        bound = math.ceil(load.rate * load.osl / per_engine)

        def meets(servers: int) -> bool:
            itl, _, _ = self._decode(
                servers=servers, rate=load.rate, load=load, backlog=0.0, duration_s=_STEADY, scale=scale
            )
            return itl <= itl_ms

        return Sizing(replicas=_search(meets, bound), throughput_replicas=bound, feasible=True)

    def aggregated_replicas(
        self, load: Workload, *, ttft_ms: float, itl_ms: float, corrections: Corrections | None = None
    ) -> Sizing:
        """Fewest aggregated engines whose TTFT and ITL estimates both meet their targets."""
        if load.rate <= 0:
            return Sizing(replicas=0, throughput_replicas=0, feasible=True)
        corrections = corrections or Corrections()
        service = self.prefill_service_ms(
            load.isl, hit_rate=load.kv_hit_rate, scale=corrections.prefill, onboard_ms=load.onboard_ms
        )
        per_engine = self.decode_throughput_per_engine(load, itl_ms=itl_ms, scale=corrections.decode)
        feasible = per_engine > 0
        if not feasible:
            n_max = self.max_batch(load.context_length)
            per_engine = (
                n_max
                * 1000.0
                / self.decode_step_ms(n_max, context_length=load.context_length, scale=corrections.decode)
            )
        # Engine-seconds per second: prefill time plus decode time at the best batch.
        bound = math.ceil(load.rate * service / 1000.0 + load.rate * load.osl / per_engine)
        tail = self.prefill_service_ms(
            load.isl_p90 or load.isl,
            hit_rate=load.kv_hit_rate,
            scale=corrections.prefill,
            onboard_ms=load.onboard_ms,
        )
        # With unlimited engines a lone request still pays its prefill and one decode step.
        alone = self.decode_step_ms(1.0, context_length=load.context_length, scale=corrections.decode)
        if not feasible or tail + alone > ttft_ms:
            return Sizing(replicas=bound, throughput_replicas=bound, feasible=False)

        def meets(servers: int) -> bool:
            estimate = self._aggregated(
                servers=servers, load=load, duration_s=_STEADY, backlog=Backlog(), corrections=corrections
            )
            return estimate.ttft_ms <= ttft_ms and estimate.itl_ms <= itl_ms

        return Sizing(replicas=_search(meets, bound), throughput_replicas=bound, feasible=True)
