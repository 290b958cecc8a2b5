"""What the planner sees of one interval, wherever it came from (Prometheus, a recording, a trace)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

#: Quantiles of a prompt's uncached tokens (its prompt less the prefix the router predicted its
#: worker holds) the sources report, by field, with their levels. Their shape, not a fit through a
#: mean and a p90, sets the TTFT tail and the prefill chunks that stretch short answers: a long
#: conversation turn carries its long cached history, so uncached lengths are not prompt lengths
#: times the mean hit rate, and a context limit cuts the tail a two-parameter fit runs on past.
UNCACHED_QUANTILES: dict[str, float] = {
    "uncached_p50": 0.5,
    "uncached_p90": 0.9,
    "uncached_p99": 0.99,
    "uncached_max": 1.0,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Observation:
    """The load and latency of one interval that has ended.

    Token lengths are ``None`` when the interval had no requests; optional fields are ``None``
    when the source does not provide them.
    """

    timestamp: float
    """Start of the interval, seconds (any epoch; only differences matter)."""
    duration_s: float
    """Length of the interval, seconds."""
    num_requests: float
    """Requests that arrived in the interval: admitted by the router (routed at once or queued) or
    shed at the door for want of capacity; not those refused for their tenant's rate limit."""
    isl: float | None
    """Mean input (prompt) length, tokens."""
    osl: float | None
    """Mean output length, tokens."""
    isl_p90: float | None = None
    """90th percentile of the input length, tokens: long prompts set the TTFT tail."""
    osl_p10: float | None = None
    """10th percentile of the output length, tokens: short answers set the ITL tail (one prefill
    chunk in a few steps lifts their mean gap)."""
    uncached_p50: float | None = None
    """Median of the requests' uncached prompt tokens (:data:`UNCACHED_QUANTILES`)."""
    uncached_p90: float | None = None
    """90th percentile of the requests' uncached prompt tokens."""
    uncached_p99: float | None = None
    """99th percentile of the requests' uncached prompt tokens."""
    uncached_max: float | None = None
    """Most uncached prompt tokens of a request (from a histogram: the top bucket's bound)."""
    kv_hit_rate: float | None = None
    """Fraction of prompt tokens served from the prefix cache, in [0, 1] (on any tier: a prefix the
    engines keep in host memory or on disk counts, see :mod:`copse.workers.perf.tiers`)."""
    onboard_ms: float | None = None
    """Mean time a request's prefill spent bringing cached blocks back from host memory or disk,
    ms (the router's prediction; 0 without offload tiers)."""
    ttft_ms: float | None = None
    """Observed p99 time to first token, ms: an alert signal (read from histogram buckets, so coarse);
    the planner does not size from it."""
    itl_ms: float | None = None
    """Observed p99 of the requests' mean inter-token gaps (TPOT), ms: an alert signal like ttft_ms."""
    ttft_mean_ms: float | None = None
    """Mean time to first token of the interval's requests, ms (histogram sum over count: exact);
    with the capacity model's mean estimate it gives the prefill correction factor."""
    itl_mean_ms: float | None = None
    """Mean over the interval's requests of their mean inter-token gap (TPOT), ms; gives the decode
    correction factor."""
    serving: float | None = None
    """Replicas of the front pool (prefill, or aggregated workers) serving during the interval
    (engines reporting metrics; starting replicas do not). Corrections are solved against these."""
    decode_serving: float | None = None
    """Decode replicas serving during the interval (disaggregated)."""
    queue_depth: float | None = None
    """Requests waiting for prefill (or an aggregated worker) at the end of the interval (the fast path)."""
    decode_queue_depth: float | None = None
    """Prefilled requests waiting for a decode slot at the end of the interval (disaggregated)."""
    inflight: float | None = None
    """Requests decoding at the end of the interval (scale-down never drops their KV)."""
    slo_met: float | None = None
    """Requests that ended in the interval meeting the SLO (TTFT and mean inter-token gap within
    target), as the router judged them (``copse_router_slo_requests_total``); ``None``: not reported."""
    ttft_missed: float | None = None
    """Requests that ended in the interval with their first token after the TTFT target."""
    itl_missed: float | None = None
    """Requests that ended in the interval with their first token in time and a mean inter-token gap
    over its target."""
    refused: float | None = None
    """Requests the fleet refused in the interval (429 from a full queue or a shed, 503 without a
    worker): misses no latency histogram sees."""

    @property
    def missed(self) -> float | None:
        """Requests judged in the interval that missed the SLO, refused ones included (the router's
        counts); ``None`` when not reported."""
        if self.slo_met is None:
            return None
        return (self.ttft_missed or 0.0) + (self.itl_missed or 0.0) + (self.refused or 0.0)

    @property
    def attainment(self) -> float | None:
        """Share of the requests judged in the interval that met the SLO (the router's counts)."""
        if self.slo_met is None or self.missed is None:
            return None
        judged = self.slo_met + self.missed
        return self.slo_met / judged if judged > 0 else None

    @property
    def uncached_quantiles(self) -> tuple[float, ...] | None:
        """The uncached-token quantiles in :data:`UNCACHED_QUANTILES`' order, when all are given."""
        values = [getattr(self, field) for field in UNCACHED_QUANTILES]
        return None if any(value is None for value in values) else tuple(values)

    @property
    def rate(self) -> float:
        """Arrival rate, requests per second."""
        return self.num_requests / self.duration_s

    @property
    def end(self) -> float:
        return self.timestamp + self.duration_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pulse:
    """What the fast loop reads between decisions (every ``fast_path_poll_s``): the queues now, and
    the router's SLO counters over the last ``window_s`` (the burn window)."""

    time: float
    """When it was read, seconds."""
    window_s: float
    """Length of the window the SLO counts cover, seconds."""
    queue_depth: float = 0.0
    """Requests waiting for the front pool (the router's queue and the engines' waiting ones)."""
    decode_queue_depth: float = 0.0
    """Prefilled requests waiting for a decode slot (disaggregated)."""
    router_queue: float = 0.0
    """Of ``queue_depth``, those still in the router's queue (not routed: their prompt tokens are
    not in ``prefill_tokens``)."""
    prefill_tokens: float | None = None
    """Uncached prompt tokens routed and not yet prefilled, over every worker (the router's
    ``copse_router_worker_prefill_tokens``); ``None``: not reported (the queue counts alone decide)."""
    slo_met: float = 0.0
    """Requests that ended in the window meeting the SLO."""
    ttft_missed: float = 0.0
    """Requests that ended in the window with their first token late."""
    itl_missed: float = 0.0
    """Requests that ended in the window with their first token in time but slow tokens after it."""
    refused: float = 0.0
    """Requests refused in the window (429/503): misses of the front pool's capacity."""
    arrived: float | None = None
    """Requests that arrived in the window (as :attr:`Observation.num_requests` counts them): the
    load, where the SLO counts are the requests ending (a backlog draining counts in those on top
    of it); ``None``: not reported."""

    serving: float | None = None
    """Front-pool replicas serving now (engines reporting); ``None``: take the replicas held."""
    decode_serving: float | None = None
    """Decode replicas serving now (disaggregated)."""

    @property
    def judged(self) -> float:
        """Requests judged in the window."""
        return self.slo_met + self.ttft_missed + self.itl_missed + self.refused

    @classmethod
    def of(cls, obs: Observation) -> Pulse:
        """The pulse an interval's observation holds: its end-of-interval queues and its SLO counts
        (the interval is the window; the router's queue and prefill tokens are not in it)."""
        return cls(
            time=obs.end,
            window_s=obs.duration_s,
            queue_depth=obs.queue_depth or 0.0,
            decode_queue_depth=obs.decode_queue_depth or 0.0,
            slo_met=obs.slo_met or 0.0,
            ttft_missed=obs.ttft_missed or 0.0,
            itl_missed=obs.itl_missed or 0.0,
            refused=obs.refused or 0.0,
            serving=obs.serving,
            decode_serving=obs.decode_serving,
        )


def _weighted(values: Sequence[tuple[float | None, float]]) -> float | None:
    pairs = [(value, weight) for value, weight in values if value is not None and weight > 0]
    total = sum(weight for _, weight in pairs)
    if total == 0:
        return None
    return sum(value * weight for value, weight in pairs) / total


def _largest(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return max(present) if present else None


def _smallest(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return min(present) if present else None


def _total(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return sum(present) if present else None


def merge(group: Sequence[Observation]) -> Observation:
    """One observation covering consecutive ones: counts add, means weight by requests, and tail
    figures (p90, p99, queue) take the worst, which is what an SLO over the longer interval sees."""
    if not group:
        raise ValueError("cannot merge an empty group of observations")
    weights = [obs.num_requests for obs in group]
    prompt_tokens = [(obs.isl or 0.0) * obs.num_requests for obs in group]
    return Observation(
        timestamp=group[0].timestamp,
        duration_s=sum(obs.duration_s for obs in group),
        num_requests=sum(weights),
        isl=_weighted([(obs.isl, w) for obs, w in zip(group, weights, strict=True)]),
        osl=_weighted([(obs.osl, w) for obs, w in zip(group, weights, strict=True)]),
        isl_p90=_largest([obs.isl_p90 for obs in group]),
        osl_p10=_smallest([obs.osl_p10 for obs in group]),
        uncached_p50=_weighted([(obs.uncached_p50, w) for obs, w in zip(group, weights, strict=True)]),
        uncached_p90=_largest([obs.uncached_p90 for obs in group]),
        uncached_p99=_largest([obs.uncached_p99 for obs in group]),
        uncached_max=_largest([obs.uncached_max for obs in group]),
        # The hit rate is a fraction of prompt tokens, so it averages over prompt tokens.
        kv_hit_rate=_weighted([(obs.kv_hit_rate, t) for obs, t in zip(group, prompt_tokens, strict=True)]),
        onboard_ms=_weighted([(obs.onboard_ms, w) for obs, w in zip(group, weights, strict=True)]),
        ttft_ms=_largest([obs.ttft_ms for obs in group]),
        itl_ms=_largest([obs.itl_ms for obs in group]),
        ttft_mean_ms=_weighted([(obs.ttft_mean_ms, w) for obs, w in zip(group, weights, strict=True)]),
        itl_mean_ms=_weighted([(obs.itl_mean_ms, w) for obs, w in zip(group, weights, strict=True)]),
        serving=_weighted([(obs.serving, obs.duration_s) for obs in group]),
        decode_serving=_weighted([(obs.decode_serving, obs.duration_s) for obs in group]),
        queue_depth=group[-1].queue_depth,
        decode_queue_depth=group[-1].decode_queue_depth,
        inflight=group[-1].inflight,
        slo_met=_total([obs.slo_met for obs in group]),
        ttft_missed=_total([obs.ttft_missed for obs in group]),
        itl_missed=_total([obs.itl_missed for obs in group]),
        refused=_total([obs.refused for obs in group]),
    )


def resample(observations: Sequence[Observation], *, interval_s: float, source: str) -> list[Observation]:
    """Merge consecutive observations into intervals of ``interval_s`` seconds.

    ``interval_s`` must be a whole multiple of the recording's own interval; ``source`` names the
    input in the error otherwise.
    """
    if not observations:
        return []
    base = observations[0].duration_s
    factor = interval_s / base
    if factor < 1 or not math.isclose(factor, round(factor), rel_tol=1e-9):
        raise ValueError(
            f"{source}: --interval {interval_s:g}s is not a whole multiple of the recording's "
            f"interval ({base:g}s)"
        )
    size = round(factor)
    if size == 1:
        return list(observations)
    return [merge(observations[start : start + size]) for start in range(0, len(observations), size)]
