"""Reading the load from Prometheus over its HTTP API (``/api/v1/query`` and ``query_range``).

httpx rather than prometheus-api-client: the planner needs two endpoints, asynchronously, and
prometheus-api-client is synchronous (requests) and, before 0.7, pulled pandas and matplotlib
into every install. Forty lines of ``httpx.AsyncClient`` do it and test with respx.

The default queries read the router's request-level series (``copse_router_*``: every request of
a deployment passes its router, so request counts, prompt and output lengths and latencies do not
depend on which engine serves) and the engines' queue/batch gauges (TensorRT-LLM's
``num_requests_waiting``/``num_requests_running``, with or without the ``trtllm_`` prefix; the
mocker exports the same names). ``tests/planner/test_trtllm_metrics.py`` evaluates them against
a ``/prometheus/metrics`` text built from ``tensorrt_llm/metrics/collector.py``; the planner does not
import the router, so ``tests/planner/test_router_metrics.py`` checks every ``copse_router_*``
series named here against a real router's scrape and evaluates every query on two such scrapes. ``{selector}``
picks one deployment's series (the chart's PodMonitor labels them ``namespace``, ``deployment``,
``role``), ``{window}`` is the decision interval and ``{quantile}`` the SLO quantile.
"""

from __future__ import annotations

import math
from typing import Any

import httpx

from copse.planner.config import PrometheusConfig
from copse.planner.observations import UNCACHED_QUANTILES, Observation, Pulse
from copse.planner.policy import Limits
from copse.planner.recording import SLO_FIELDS

#: Requests routed in the window: one prompt length is observed per routed request.
_ROUTED = "sum(increase(copse_router_prompt_length_tokens_count{{{selector}}}[{window}]))"
#: Requests arriving in the window: admitted (routed at once or queued), or shed at the door because
#: the fleet could not serve them in time. A request shed after queueing was admitted first; one
#: refused for its tenant's rate limit is not load the fleet is sized for.
_ARRIVED = (
    "sum(increase(copse_router_class_admitted_total{{{selector}}}[{window}]))"
    ' + (sum(increase(copse_router_class_shed_total{{{selector},reason!="QueueTimeout"}}[{window}]))'
    " or vector(0))"
)

#: PromQL per observation field. Ratios of increases are window means; NaN (0/0) means no traffic.
#: Engine gauges are matched as ``{__name__=~"(trtllm_)?<name>"}``: ``trtllm_<name>`` as
#: ``collector.py`` exports them since TensorRT-LLM 1.3 (and copse's mocked engines), or the bare
#: name (the prefix came with 1.3; dropping it again was proposed upstream). They exist only with
#: ``enable_iter_perf_stats`` (the operator sets it) and from 1.3 on: with an older engine these
#: fields read as absent (the queue falls back to the router's own).
_SLO = "sum(increase(copse_router_slo_requests_total{{{{{{selector}},{outcome}}}}}[{{window}}]))"
DEFAULT_QUERIES: dict[str, str] = {
    # The load arriving: requests ending in the window (copse_router_requests_total) lag it by their
    # service, and while a backlog drains count it on top of the load.
    "num_requests": _ARRIVED,
    "isl": "sum(increase(copse_router_prompt_tokens_total{{{selector}}}[{window}])) / " + _ROUTED,
    # Output tokens as the router returned them to clients (whatever engine produced them).
    "osl": (
        "sum(increase(copse_router_output_tokens_total{{{selector}}}[{window}]))"
        " / sum(increase(copse_router_requests_total{{{selector}}}[{window}]))"
    ),
    "isl_p90": (
        "histogram_quantile(0.9, "
        "sum by (le) (rate(copse_router_prompt_length_tokens_bucket{{{selector}}}[{window}])))"
    ),
    "osl_p10": (
        "histogram_quantile(0.1, "
        "sum by (le) (rate(copse_router_output_length_tokens_bucket{{{selector}}}[{window}])))"
    ),
    **{
        field: (
            f"histogram_quantile({level}, "
            "sum by (le) (rate(copse_router_uncached_prompt_tokens_bucket{{{selector}}}[{window}])))"
        )
        for field, level in UNCACHED_QUANTILES.items()
    },
    "kv_hit_rate": (
        "sum(increase(copse_router_predicted_cached_tokens_total{{{selector}}}[{window}]))"
        " / sum(increase(copse_router_prompt_tokens_total{{{selector}}}[{window}]))"
    ),
    "onboard_ms": (
        "1000 * sum(increase(copse_router_predicted_onboard_seconds_total{{{selector}}}[{window}]))"
        " / " + _ROUTED
    ),
    "ttft_ms": (
        "1000 * histogram_quantile({quantile}, "
        "sum by (le) (rate(copse_router_time_to_first_token_seconds_bucket{{{selector}}}[{window}])))"
    ),
    "itl_ms": (
        "1000 * histogram_quantile({quantile}, "
        "sum by (le) (rate(copse_router_inter_token_latency_seconds_bucket{{{selector}}}[{window}])))"
    ),
    # Means from the histograms' _sum and _count: exact, where quantiles interpolate coarse buckets.
    "ttft_mean_ms": (
        "1000 * sum(increase(copse_router_time_to_first_token_seconds_sum{{{selector}}}[{window}]))"
        " / sum(increase(copse_router_time_to_first_token_seconds_count{{{selector}}}[{window}]))"
    ),
    # The router observes each request's mean inter-token gap (TPOT): this is their mean.
    "itl_mean_ms": (
        "1000 * sum(increase(copse_router_inter_token_latency_seconds_sum{{{selector}}}[{window}]))"
        " / sum(increase(copse_router_inter_token_latency_seconds_count{{{selector}}}[{window}]))"
    ),
    # Engines reporting at the end of the window: a starting replica has no engine to scrape yet.
    "serving": 'count({{__name__=~"(trtllm_)?num_requests_running",{selector},role=~"prefill|worker"}})',
    "decode_serving": 'count({{__name__=~"(trtllm_)?num_requests_running",{selector},role="decode"}})',
    "queue_depth": (
        "(sum(copse_router_queue_depth{{{selector}}}) or vector(0))"
        ' + (sum({{__name__=~"(trtllm_)?num_requests_waiting",{selector},role=~"prefill|worker"}})'
        " or vector(0))"
    ),
    "decode_queue_depth": 'sum({{__name__=~"(trtllm_)?num_requests_waiting",{selector},role="decode"}})',
    "inflight": 'sum({{__name__=~"(trtllm_)?num_requests_running",{selector},role=~"decode|worker"}})',
    # The router's per-request SLO judgements (copse_router_slo_requests_total, by outcome).
    "slo_met": _SLO.format(outcome='outcome="met"'),
    "ttft_missed": _SLO.format(outcome='outcome="ttft_missed"'),
    "itl_missed": _SLO.format(outcome='outcome="itl_missed"'),
    "refused": _SLO.format(outcome='outcome="refused"'),
}
#: PromQL of the fast loop's extra gauges (a :class:`~copse.planner.observations.Pulse`; read with
#: the SLO counts over the burn window, not the interval).
PULSE_QUERIES: dict[str, str] = {
    "router_queue": "sum(copse_router_queue_depth{{{selector}}})",
    "prefill_tokens": "sum(copse_router_worker_prefill_tokens{{{selector}}})",
    "arrived": _ARRIVED,
}


class PrometheusError(RuntimeError):
    """Prometheus could not be asked, or answered with an error; the message says which query."""


def _window(seconds: float) -> str:
    """A PromQL duration for ``seconds`` (whole milliseconds)."""
    return f"{round(seconds * 1000)}ms"


class Queries:
    """The PromQL of each field for one deployment."""

    def __init__(
        self, config: PrometheusConfig, *, namespace: str, name: str, interval_s: float, quantile: float
    ) -> None:
        unknown = sorted(set(config.queries) - set(DEFAULT_QUERIES))
        if unknown:
            known = ", ".join(DEFAULT_QUERIES)
            raise ValueError(f"prometheus.queries: unknown field {', '.join(unknown)} (known: {known})")
        selector = config.selector.format(namespace=namespace, name=name)
        self._templates = {**DEFAULT_QUERIES, **config.queries}
        self._selector, self._quantile = selector, quantile
        self.text = self._format(self._templates, interval_s)
        """Every observation field's PromQL over the interval."""

    def over(self, window_s: float) -> dict[str, str]:
        """Every field's PromQL over a window of ``window_s`` (the fast loop's burn window), and
        the fast loop's gauges."""
        return self._format({**self._templates, **PULSE_QUERIES}, window_s)

    def _format(self, templates: dict[str, str], window_s: float) -> dict[str, str]:
        return {
            field: template.format(selector=self._selector, window=_window(window_s), quantile=self._quantile)
            for field, template in templates.items()
        }


class PrometheusClient:
    """The two Prometheus HTTP API calls the planner makes."""

    def __init__(self, *, url: str, timeout_s: float, client: httpx.AsyncClient | None = None) -> None:
        self.url = url.rstrip("/")
        self._client = client or httpx.AsyncClient(timeout=timeout_s)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _get(self, path: str, params: dict[str, str]) -> dict[str, Any]:
        url = f"{self.url}{path}"
        try:
            response = await self._client.get(url, params=params)
        except httpx.HTTPError as exc:
            raise PrometheusError(f"{url} ({params['query']}): {type(exc).__name__}: {exc}") from exc
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code != 200 or not isinstance(body, dict) or body.get("status") != "success":
            detail = body.get("error") if isinstance(body, dict) else response.text[:200]
            raise PrometheusError(f"{url} answered {response.status_code} for {params['query']!r}: {detail}")
        return body

    async def query(self, promql: str, *, at: float) -> float | None:
        """The single value of an instant query at ``at`` (unix seconds); ``None`` when it has no
        series or its value is NaN (a ratio over an interval without traffic)."""
        body = await self._get("/api/v1/query", {"query": promql, "time": f"{at:.3f}"})
        result = body["data"]["result"]
        if not result:
            return None
        if len(result) > 1:
            raise PrometheusError(f"{promql!r} returned {len(result)} series; aggregate it to one with sum()")
        value = float(result[0]["value"][1])
        return value if math.isfinite(value) else None

    async def query_range(self, promql: str, *, start: float, end: float, step_s: float) -> dict[str, Any]:
        """The raw ``query_range`` response (what ``copse planner record`` stores)."""
        return await self._get(
            "/api/v1/query_range",
            {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": _window(step_s)},
        )


class PrometheusSource:
    """Observations of one deployment, one per interval, read at the interval's end."""

    def __init__(self, *, client: PrometheusClient, queries: Queries, interval_s: float) -> None:
        self.client = client
        self.queries = queries
        self.interval_s = interval_s

    async def observe(self, *, end: float) -> Observation:
        """The interval ``[end - interval, end)``."""
        values = {
            field: await self.client.query(promql, at=end) for field, promql in self.queries.text.items()
        }
        if values["num_requests"] is None:
            # No series at all is not "no traffic": scaling to the minimum on it would be wrong.
            raise PrometheusError(
                f"no series for num_requests ({self.queries.text['num_requests']}): is the router scraped?"
            )
        num_requests = max(0.0, values["num_requests"])
        busy = num_requests > 0
        return Observation(
            timestamp=end - self.interval_s,
            duration_s=self.interval_s,
            num_requests=num_requests,
            isl=values["isl"] if busy else None,
            osl=values["osl"] if busy else None,
            isl_p90=values["isl_p90"] if busy else None,
            osl_p10=values["osl_p10"] if busy else None,
            **{field: values[field] if busy else None for field in UNCACHED_QUANTILES},
            kv_hit_rate=_fraction(values["kv_hit_rate"]),
            onboard_ms=values["onboard_ms"] if busy else None,
            ttft_ms=values["ttft_ms"] if busy else None,
            itl_ms=values["itl_ms"] if busy else None,
            ttft_mean_ms=values["ttft_mean_ms"] if busy else None,
            itl_mean_ms=values["itl_mean_ms"] if busy else None,
            serving=values["serving"],
            decode_serving=values["decode_serving"],
            queue_depth=values["queue_depth"],
            decode_queue_depth=values["decode_queue_depth"],
            inflight=values["inflight"],
            **{field: values[field] for field in SLO_FIELDS},
        )

    async def pulse(self, *, at: float, window_s: float, limits: Limits) -> Pulse:
        """What the fast loop reads between decisions: the queue gauges, the router's outstanding
        prefill tokens and its SLO counts over the last ``window_s``."""
        text = self.queries.over(window_s)
        fields = ["queue_depth", "router_queue", "prefill_tokens", "arrived", "serving", *SLO_FIELDS]
        if limits.disaggregated:
            fields += ["decode_queue_depth", "decode_serving"]
        values = {field: await self.client.query(text[field], at=at) for field in fields}
        return Pulse(
            time=at,
            window_s=window_s,
            queue_depth=values["queue_depth"] or 0.0,
            decode_queue_depth=values.get("decode_queue_depth") or 0.0,
            router_queue=values["router_queue"] or 0.0,
            prefill_tokens=values["prefill_tokens"],
            slo_met=values["slo_met"] or 0.0,
            ttft_missed=values["ttft_missed"] or 0.0,
            itl_missed=values["itl_missed"] or 0.0,
            refused=values["refused"] or 0.0,
            arrived=values["arrived"],
            serving=values["serving"],
            decode_serving=values.get("decode_serving"),
        )

    async def export(self, *, start: float, end: float) -> dict[str, Any]:
        """Every field's ``query_range`` response over ``[start, end]`` at the interval as step:
        the Prometheus export :func:`copse.planner.recording.read_prometheus_export` reads."""
        return {
            field: await self.client.query_range(promql, start=start, end=end, step_s=self.interval_s)
            for field, promql in self.queries.text.items()
        }


def _fraction(value: float | None) -> float | None:
    return None if value is None else min(max(value, 0.0), 1.0)
