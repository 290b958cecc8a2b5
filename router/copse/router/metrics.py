"""Every Prometheus metric the router exports (names live here and nowhere else).

Per-worker load gauges are read from the routing core at scrape time, so they never drift from
what the router decides with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from copse.router.core import Router
from copse.router.policies import RouteRequest

PREFIX = "copse_router"

# Metric names (other packages import these rather than spell them) -----------------------------
REQUESTS = f"{PREFIX}_requests"
"""Counter (``_total``) by ``status``: requests answered."""
TTFT_SECONDS = f"{PREFIX}_time_to_first_token_seconds"
"""Histogram: request arrival to its first streamed token."""
ITL_SECONDS = f"{PREFIX}_inter_token_latency_seconds"
"""Histogram: mean gap between streamed tokens of a request."""
DURATION_SECONDS = f"{PREFIX}_request_duration_seconds"
"""Histogram: request arrival to its last byte."""
PROMPT_TOKENS = f"{PREFIX}_prompt_tokens"
"""Counter (``_total``): prompt tokens of routed requests."""
PROMPT_LENGTH_TOKENS = f"{PREFIX}_prompt_length_tokens"
"""Histogram: prompt length per request."""
UNCACHED_PROMPT_TOKENS = f"{PREFIX}_uncached_prompt_tokens"
"""Histogram: a routed request's prompt tokens its worker was not predicted to hold."""
OUTPUT_TOKENS = f"{PREFIX}_output_tokens"
"""Counter (``_total``): output tokens returned to clients."""
OUTPUT_LENGTH_TOKENS = f"{PREFIX}_output_length_tokens"
"""Histogram: output length per request."""
PREDICTED_CACHED_TOKENS = f"{PREFIX}_predicted_cached_tokens"
"""Counter (``_total``): prompt tokens the chosen worker was predicted to hold."""
PREDICTED_ONBOARD_SECONDS = f"{PREFIX}_predicted_onboard_seconds"
"""Counter (``_total``): predicted time to bring cached blocks back from host or disk."""
RETRIES = f"{PREFIX}_retries"
"""Counter (``_total``): requests sent again before their first token."""
MIGRATIONS = f"{PREFIX}_migrations"
"""Counter (``_total``) by ``reason``: streams continued on another worker."""
DISAGGREGATED_ROUTES = f"{PREFIX}_disaggregated_routes"
"""Counter (``_total``) by ``prefill_revision``, ``decode_revision``: requests sent to a prefill and
a decode worker, by the deployment revision each runs (a mixed pair would show as unequal labels)."""
FAILED_STREAMS = f"{PREFIX}_failed_streams"
"""Counter (``_total``) by ``reason``: streams ended with an error after their first token."""
KV_RESYNCS = f"{PREFIX}_kv_resyncs"
"""Counter (``_total``) by ``reason``: worker cache dumps requested."""
KV_EVENT_BATCHES = f"{PREFIX}_kv_event_batches"
"""Counter (``_total``): KV event batches received."""
QUEUE_DEPTH = f"{PREFIX}_queue_depth"
"""Gauge: requests waiting for a worker."""
WORKERS = f"{PREFIX}_workers"
"""Gauge by ``role``: workers the router may use."""
PEERS = f"{PREFIX}_peers"
"""Gauge: other router replicas heard from recently."""
PEER_SNAPSHOTS = f"{PREFIX}_peer_snapshots"
"""Counter (``_total``) by ``result``: load snapshots asked of peers."""
NATS_CONNECTED = f"{PREFIX}_nats_connected"
"""Gauge: 1 while connected to NATS (exact mode), 0 in approximate mode."""
READY = f"{PREFIX}_ready"
"""Gauge: 1 once the router has a picture of caches and peers' load."""
WORKER_INFLIGHT_REQUESTS = f"{PREFIX}_worker_inflight_requests"
"""Gauge by ``worker``: requests in flight."""
WORKER_CACHED_BLOCKS = f"{PREFIX}_worker_cached_blocks"
"""Gauge by ``worker``: blocks the index holds."""
WORKER_KV_APPROXIMATE = f"{PREFIX}_worker_kv_approximate"
"""Gauge by ``worker``: 1 while its KV picture is approximate."""
WORKER_KV_TOKENS = f"{PREFIX}_worker_kv_tokens"
"""Gauge by ``worker``: KV tokens in use."""
WORKER_PREFILL_TOKENS = f"{PREFIX}_worker_prefill_tokens"
"""Gauge by ``worker``: prompt tokens still to prefill."""

SLO_REQUESTS = f"{PREFIX}_slo_requests"
"""Counter (``_total``) by ``outcome``: requests judged against the deployment's SLO when they end
(:data:`SLO_OUTCOMES`); the planner's fast loop reads its burn rate from it."""
SLO_MET = "met"
"""Outcome: TTFT and the mean inter-token gap (TPOT) both within their targets."""
SLO_TTFT_MISSED = "ttft_missed"
"""Outcome: the first token came after the TTFT target."""
SLO_ITL_MISSED = "itl_missed"
"""Outcome: the first token was in time, the mean inter-token gap was over its target."""
SLO_REFUSED = "refused"
"""Outcome: answered without a stream because the fleet could not take it (429 from a full queue
or a shed, 503 without a worker): a miss the latency histograms never see."""
SLO_FAILED = "failed"
"""Outcome: the stream ended with an error after its first token (no worker could continue it)."""
SLO_OUTCOMES = (SLO_MET, SLO_TTFT_MISSED, SLO_ITL_MISSED, SLO_REFUSED, SLO_FAILED)
"""Every ``outcome`` label of :data:`SLO_REQUESTS`; all but ``met`` miss the SLO."""

CLASS_ADMITTED = f"{PREFIX}_class_admitted"
"""Counter (``_total``) by ``objective``, ``tenant``: requests admitted (routed now or queued)."""
CLASS_QUEUED = f"{PREFIX}_class_queued"
"""Counter (``_total``) by ``objective``, ``tenant``: admitted requests that waited in the queue."""
CLASS_SHED = f"{PREFIX}_class_shed"
"""Counter (``_total``) by ``objective``, ``tenant``, ``reason``: requests answered 429 because the
fleet could not serve them in time (``SloShed``, ``QueueFull``, ``QueueTimeout``)."""
CLASS_RATE_LIMITED = f"{PREFIX}_class_rate_limited"
"""Counter (``_total``) by ``objective``, ``tenant``: requests answered 429 for their tenant's limit."""
CLASS_TTFT_SECONDS = f"{PREFIX}_class_time_to_first_token_seconds"
"""Histogram by ``objective``, ``tenant``: request arrival to its first streamed token."""
CLASS_ITL_SECONDS = f"{PREFIX}_class_inter_token_latency_seconds"
"""Histogram by ``objective``, ``tenant``: mean gap between streamed tokens of a request."""
ADAPTER_ADMITTED = f"{PREFIX}_adapter_admitted"
"""Counter (``_total``) by ``model``, ``adapter``: requests admitted (routed now or queued);
``adapter`` is ``base`` for the base model."""
ADAPTER_TTFT_SECONDS = f"{PREFIX}_adapter_time_to_first_token_seconds"
"""Histogram by ``model``, ``adapter``: request arrival to its first streamed token."""
ADAPTER_ITL_SECONDS = f"{PREFIX}_adapter_inter_token_latency_seconds"
"""Histogram by ``model``, ``adapter``: mean gap between streamed tokens of a request."""
ADAPTER_LOADS = f"{PREFIX}_adapter_loads"
"""Counter (``_total``): LoRA adapter loads the router's choices made engines do (predicted from the
adapters it believes each worker holds)."""
BASE_ADAPTER = "base"
"""The ``adapter`` label of requests served by the base model."""
OTHER_LABEL = "other"
"""The ``tenant`` label of tenants, and the ``adapter`` label of adapters, beyond the labelled ones
(bounded label sets)."""
DEFAULT_LABEL = "default"
"""The ``objective``/``tenant`` label of the default objective and of requests naming no tenant."""

#: Latency buckets (seconds) spanning a fast decode step to a long queued prefill.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
#: Inter-token latency buckets (seconds).
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
#: Prompt-length buckets (tokens), powers of two from a chat turn to a 256k context.
PROMPT_LENGTH_BUCKETS = tuple(float(2**k) for k in range(6, 19))
#: Uncached-prompt buckets (tokens), half octaves from 64 to 256k: the planner reads the TTFT tail
#: off their quantiles, so a prompt's cost is placed within a factor of 1.4, not 2.
UNCACHED_PROMPT_BUCKETS = tuple(float(round(2 ** (k / 2))) for k in range(12, 37))
#: Output-length buckets (tokens), powers of two from one token to 32k: short answers are the ones
#: a prefill chunk in one of their few steps puts over the ITL target.
OUTPUT_LENGTH_BUCKETS = tuple(float(2**k) for k in range(16))


@dataclasses.dataclass(frozen=True, slots=True)
class SloTargets:
    """The deployment's per-request SLO: a request meets it when its TTFT and its mean inter-token
    gap (TPOT) are both within target."""

    ttft_s: float
    itl_s: float

    def outcome(self, *, ttft_s: float, itl_s: float | None) -> str:
        """The :data:`SLO_REQUESTS` outcome of a request that streamed (``itl_s`` is ``None`` for a
        single token, or a response that was not streamed: its first token is its whole answer)."""
        if ttft_s > self.ttft_s:
            return SLO_TTFT_MISSED
        if itl_s is not None and itl_s > self.itl_s:
            return SLO_ITL_MISSED
        return SLO_MET


class RouterMetrics:
    """The router's metrics in their own registry (one per router instance)."""

    def __init__(
        self,
        router: Callable[[], Router],
        *,
        tenants: Collection[str] = (),
        tenant_labels: int = 20,
        adapter_labels: int = 20,
        model: str = DEFAULT_LABEL,
        slo: SloTargets | None = None,
    ) -> None:
        """``tenants`` get their own ``tenant`` label, and so do the first ``tenant_labels`` others
        seen; the rest are ``other``. The first ``adapter_labels`` adapters seen get their own
        ``adapter`` label; the rest are ``other``; ``model`` labels requests naming no model (one
        model behind the router). ``slo``: the targets requests are judged against (without them,
        no request is judged and :data:`SLO_REQUESTS` stays at zero)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.adapters = AdapterMetrics(r, adapter_labels=adapter_labels, model=model)
        self.slo_targets = slo
        self.slo_requests = Counter(
            SLO_REQUESTS,
            "Requests judged against the deployment's SLO when they end, by outcome: met (TTFT and mean"
            " inter-token gap within target), ttft_missed, itl_missed, refused (429/503 because the fleet"
            " could not take it; not a tenant over its rate limit), failed (stream ended with an error).",
            ["outcome"],
            registry=r,
        )
        for outcome in SLO_OUTCOMES:  # every series exists from the start: increase() sees the first
            self.slo_requests.labels(outcome)
        self._labelled = set(tenants)
        self._unlisted = 0
        self._tenant_labels = tenant_labels
        classes = ["objective", "tenant"]
        self.class_admitted = Counter(
            CLASS_ADMITTED, "Requests admitted (routed now or queued).", classes, registry=r
        )
        self.class_queued = Counter(
            CLASS_QUEUED, "Admitted requests that waited in the queue.", classes, registry=r
        )
        self.class_shed = Counter(
            CLASS_SHED,
            "Requests answered 429 because the fleet could not serve them in time, by why: SloShed (predicted"
            " past the objective's TTFT target), QueueFull, QueueTimeout.",
            [*classes, "reason"],
            registry=r,
        )
        self.class_rate_limited = Counter(
            CLASS_RATE_LIMITED, "Requests answered 429 for their tenant's rate limit.", classes, registry=r
        )
        self.class_ttft = Histogram(
            CLASS_TTFT_SECONDS,
            "Time from request arrival to its first streamed token, by objective and tenant.",
            classes,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.class_itl = Histogram(
            CLASS_ITL_SECONDS,
            "Mean gap between streamed tokens of a request, by objective and tenant.",
            classes,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.requests = Counter(REQUESTS, "Requests answered, by HTTP status.", ["status"], registry=r)
        self.ttft = Histogram(
            TTFT_SECONDS,
            "Time from request arrival to its first streamed token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            ITL_SECONDS,
            "Mean gap between streamed tokens of a request.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            DURATION_SECONDS,
            "Time from request arrival to its last byte.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(PROMPT_TOKENS, "Prompt tokens of routed requests.", registry=r)
        self.prompt_length = Histogram(
            PROMPT_LENGTH_TOKENS,
            "Prompt length of routed requests (the planner sizes prefill for its p90).",
            buckets=PROMPT_LENGTH_BUCKETS,
            registry=r,
        )
        self.uncached_prompt = Histogram(
            UNCACHED_PROMPT_TOKENS,
            "Prompt tokens of routed requests not in the chosen worker's predicted cache (the planner "
            "sizes prefill and the TTFT tail from their quantiles).",
            buckets=UNCACHED_PROMPT_BUCKETS,
            registry=r,
        )
        self.output_tokens = Counter(
            OUTPUT_TOKENS,
            "Output tokens returned to clients: the worker's usage count when it reports one, else "
            "the tokens streamed.",
            registry=r,
        )
        self.output_length = Histogram(
            OUTPUT_LENGTH_TOKENS,
            "Output length of answered requests (the planner sizes for the share of short answers, "
            "whose mean inter-token gap one prefill chunk can spoil).",
            buckets=OUTPUT_LENGTH_BUCKETS,
            registry=r,
        )
        self.cached_tokens = Counter(
            PREDICTED_CACHED_TOKENS,
            "Prompt tokens the chosen worker was predicted to hold (hit rate = this / prompt tokens).",
            registry=r,
        )
        self.onboard_seconds = Counter(
            PREDICTED_ONBOARD_SECONDS,
            "Time the chosen workers were predicted to spend bringing cached prompt blocks back from "
            "host memory or disk (the planner adds it per request to its prefill service time).",
            registry=r,
        )
        self.retries = Counter(
            RETRIES, "Requests sent again to another worker before their first token.", registry=r
        )
        self.migrations = Counter(
            MIGRATIONS,
            "Streams continued on another worker after their worker failed mid-stream, by what failed:"
            " disconnected, ended_early, worker_error, worker_lost (dropped by health probes), timeout.",
            ["reason"],
            registry=r,
        )
        self.disaggregated_routes = Counter(
            DISAGGREGATED_ROUTES,
            "Requests sent to a prefill and a decode worker, by the deployment revision of each.",
            ["prefill_revision", "decode_revision"],
            registry=r,
        )
        self.failed_streams = Counter(
            FAILED_STREAMS,
            "Streams ended with an error event after their first token, by why they could not go on:"
            " limit (migration_limit reached), unavailable (no worker), untracked (no token ids streamed),"
            " refused (a worker answered the continuation with a 4xx).",
            ["reason"],
            registry=r,
        )
        self.kv_resyncs = Counter(
            KV_RESYNCS,
            "Worker cache dumps requested after a gap in KV events.",
            ["reason"],
            registry=r,
        )
        self.kv_events = Counter(KV_EVENT_BATCHES, "KV event batches received.", registry=r)
        self.queue_depth = Gauge(QUEUE_DEPTH, "Requests waiting for a worker.", registry=r)
        self.workers = Gauge(WORKERS, "Workers the router may use, by role.", ["role"], registry=r)
        self.peers = Gauge(PEERS, "Other router replicas heard from recently.", registry=r)
        self.peer_snapshots = Counter(
            PEER_SNAPSHOTS,
            "Load snapshots asked of peer replicas (a new or restarted peer, or lost messages), by result.",
            ["result"],
            registry=r,
        )
        self.nats_connected = Gauge(
            NATS_CONNECTED,
            "1 while connected to NATS (exact mode: KV events, shared load); 0 in approximate mode.",
            registry=r,
        )
        self.ready = Gauge(
            READY,
            "1 once the router has a picture of the workers' caches and its peers' load (or gave up"
            " waiting after recovery_timeout_s), 0 before and while draining.",
            registry=r,
        )
        r.register(_WorkerLoad(router))
        r.register(_AdapterLoads(router))

    def labels(self, request: RouteRequest) -> tuple[str, str]:
        """The ``objective`` and ``tenant`` labels of ``request`` (bounded: see the constructor)."""
        tenant = request.tenant or DEFAULT_LABEL
        if tenant not in self._labelled:
            if self._unlisted >= self._tenant_labels:
                tenant = OTHER_LABEL
            else:
                self._labelled.add(tenant)
                self._unlisted += 1
        return request.objective or DEFAULT_LABEL, tenant

    def admitted(self, request: RouteRequest, *, queued: bool) -> None:
        """``request`` was admitted: routed now, or queued."""
        labels = self.labels(request)
        self.class_admitted.labels(*labels).inc()
        self.adapters.admitted.labels(*self.adapters.labels(request)).inc()
        if queued:
            self.class_queued.labels(*labels).inc()

    def shed(self, request: RouteRequest, *, reason: str) -> None:
        """``request`` was answered 429 (``reason``: the core's exception, or ``QueueTimeout``)."""
        labels = self.labels(request)
        if reason == "RateLimited":
            self.class_rate_limited.labels(*labels).inc()
        else:
            self.class_shed.labels(*labels, reason).inc()

    def first_token(self, request: RouteRequest, seconds: float) -> None:
        """``request``'s first token came ``seconds`` after it arrived."""
        self.ttft.observe(seconds)
        self.class_ttft.labels(*self.labels(request)).observe(seconds)
        self.adapters.ttft.labels(*self.adapters.labels(request)).observe(seconds)

    def judged(self, *, ttft_s: float, itl_s: float | None) -> None:
        """A request that streamed ended: count its SLO outcome (when targets are set)."""
        if self.slo_targets is not None:
            self.slo_requests.labels(self.slo_targets.outcome(ttft_s=ttft_s, itl_s=itl_s)).inc()

    def missed(self, outcome: str) -> None:
        """A request ended without meeting the SLO for a reason latency does not show (``refused``,
        ``failed``)."""
        if self.slo_targets is not None:
            self.slo_requests.labels(outcome).inc()

    def inter_token(self, request: RouteRequest, seconds: float) -> None:
        """``request``'s tokens came ``seconds`` apart on average."""
        self.itl.observe(seconds)
        self.class_itl.labels(*self.labels(request)).observe(seconds)
        self.adapters.itl.labels(*self.adapters.labels(request)).observe(seconds)


class AdapterMetrics:
    """Per-adapter request metrics (labels bounded: the first ``adapter_labels`` adapters seen;
    adapters are the router's configured ones, never a client's string)."""

    def __init__(self, registry: CollectorRegistry, *, adapter_labels: int, model: str) -> None:
        names = ["model", "adapter"]
        self._model = model
        self._labelled: set[str] = set()
        self._limit = adapter_labels
        self.admitted = Counter(
            ADAPTER_ADMITTED,
            "Requests admitted (routed now or queued), by model and adapter.",
            names,
            registry=registry,
        )
        self.ttft = Histogram(
            ADAPTER_TTFT_SECONDS,
            "Time from request arrival to its first streamed token, by model and adapter.",
            names,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            ADAPTER_ITL_SECONDS,
            "Mean gap between streamed tokens of a request, by model and adapter.",
            names,
            buckets=ITL_BUCKETS,
            registry=registry,
        )

    def labels(self, request: RouteRequest) -> tuple[str, str]:
        """The ``model`` and ``adapter`` labels of ``request``."""
        adapter = request.adapter or BASE_ADAPTER
        if request.adapter and adapter not in self._labelled:
            if len(self._labelled) >= self._limit:
                adapter = OTHER_LABEL
            else:
                self._labelled.add(adapter)
        return request.model or self._model, adapter


class _AdapterLoads(Collector):
    def __init__(self, router: Callable[[], Router]) -> None:
        self._router = router

    def collect(self) -> Iterable[Metric]:
        loads = CounterMetricFamily(
            ADAPTER_LOADS, "LoRA adapter loads the router's choices caused (predicted)."
        )
        loads.add_metric([], float(self._router().adapters.loads))
        yield loads


class _WorkerLoad(Collector):
    def __init__(self, router: Callable[[], Router]) -> None:
        self._router = router

    def collect(self) -> Iterable[Metric]:
        router = self._router()
        seq = router.sequences
        kv = seq.kv_tokens()
        families = {
            "inflight": GaugeMetricFamily(
                WORKER_INFLIGHT_REQUESTS, "Requests in flight per worker.", labels=["worker"]
            ),
            "prefill": GaugeMetricFamily(
                WORKER_PREFILL_TOKENS,
                "Uncached prompt tokens still to prefill per worker.",
                labels=["worker"],
            ),
            "kv": GaugeMetricFamily(
                WORKER_KV_TOKENS,
                "KV tokens in use per worker (router's estimate).",
                labels=["worker"],
            ),
            "cached": GaugeMetricFamily(
                WORKER_CACHED_BLOCKS,
                "KV blocks the indexer believes each worker holds.",
                labels=["worker"],
            ),
            "approximate": GaugeMetricFamily(
                WORKER_KV_APPROXIMATE,
                "1 while a worker's KV events lost track: its cache is partly guessed from routing.",
                labels=["worker"],
            ),
        }
        for worker_id in router.workers:
            slot = router.slots.get(worker_id)
            if slot is None or slot >= seq.size:
                continue
            families["inflight"].add_metric([worker_id], float(seq.requests[slot]))
            families["prefill"].add_metric([worker_id], float(seq.prefill_tokens[slot]))
            families["kv"].add_metric([worker_id], float(kv[slot]))
            families["cached"].add_metric([worker_id], float(router.indexer.blocks_held(slot)))
            if router.radix is not None:
                families["approximate"].add_metric([worker_id], float(router.radix.approximate(slot)))
        yield from families.values()
