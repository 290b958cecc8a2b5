"""What every frontend of the router shares: the routing core, the live workers (discovery and
health probes), routing through the wait queue, the accounting of a request's first token and end,
and reading a worker's output stream.

Two frontends build on :class:`RoutingService`: the OpenAI HTTP server (:mod:`copse.router.frontend`),
which proxies each request itself, and the Gateway API Inference Extension endpoint picker
(:mod:`copse.router.epp`), which tells a gateway (Envoy) where to send it. KV event sync and replica
sync (:mod:`copse.router.kv_sync`, :mod:`copse.router.replica_sync`) attach to either.

Workers come from discovery; each is probed (``GET /health``) every ``health_interval_s``. A
worker that refuses connections (its process is gone) is dropped at the first probe, so within
``interval + timeout``; one that answers slowly or with errors after ``health_failures`` probes in
a row (an engine busy with a long step is not dead). A probe that times out while the worker's
streams sent output does not count: the worker is busy (or this router is slow), not hung. A
worker is registered under the id its ``GET /worker_info`` reports (mocked engines; the id their
KV events carry), else under the id discovery knows (the pod name, which the KV relay next to a
``trtllm-serve`` publishes under).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client import generate_latest

from copse.router.clients import ClientGate
from copse.router.config import RouterConfig
from copse.router.core import NoWorkers, RateLimited, Role, Route, Router, Shed, WorkerInfo
from copse.router.discovery import Endpoint, Source
from copse.router.metrics import RouterMetrics
from copse.router.models import Resolved, UnknownModel
from copse.router.policies import RouteRequest
from copse.router.tokens import PromptTokenizer, prompt_tokens
from copse.workers.perf import PerfModel
from copse.workers.protocol.hashing import block_hashes
from copse.workers.protocol.limits import check_context
from copse.workers.protocol.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    TokenIds,
    parse_request_object,
)

log = logging.getLogger(__name__)

GENERATE_PATHS: dict[str, type[CompletionRequest] | type[ChatCompletionRequest]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}
"""The OpenAI paths the router routes by prompt, and the request model of each."""


class Unavailable(Exception):
    """No healthy worker can take the request (503)."""


class Overloaded(Exception):
    """The request is shed (429 with ``Retry-After``): its tenant is over its rate limit, it would
    miss its objective's TTFT target, the queue is full, or it waited the whole queue timeout."""

    def __init__(self, message: str, *, retry_after_s: float, rate_limited: bool = False) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.rate_limited = rate_limited
        """The tenant's own excess, not the fleet's: no SLO miss (the planner must not size for it)."""

    @property
    def retry_after(self) -> str:
        """The ``Retry-After`` header's value (whole seconds, at least 1)."""
        return str(max(1, math.ceil(self.retry_after_s)))


class Rejected(Exception):
    """A request the router refuses as it is (an HTTP status and an OpenAI error)."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class Prepared:
    """A parsed generation request, ready to route."""

    request: CompletionRequest | ChatCompletionRequest
    body: dict[str, Any]
    """The request's JSON object as it is forwarded: as the client sent it, plus what the router
    adds (an adapter's ``lora_request``)."""
    tokens: TokenIds
    """The prompt's token ids."""
    route: RouteRequest
    resolved: Resolved
    """The base model and the LoRA adapter its ``model`` names."""
    rewritten: bool = False
    """Whether :attr:`body` differs from the client's bytes, which then cannot be forwarded as
    they are."""


@dataclass(slots=True)
class _Live:
    """A discovered worker that answers its health probe."""

    endpoint: Endpoint
    worker_id: str


def output_of(event: Mapping[str, Any], ids: list[int] | None = None) -> tuple[int, bool, bool]:
    """What an SSE chunk carries: its output tokens (its token ids, else one per choice with text),
    whether it is output at all (tokens, or a finish; not just the role header or usage), and
    whether it finishes; its token ids are appended to ``ids`` when given."""
    tokens, finished = 0, False
    for choice in event.get("choices") or ():
        token_ids = choice.get("token_ids")
        if token_ids:
            tokens += len(token_ids)
            if ids is not None:
                ids.extend(token_ids)
        elif choice.get("text") or (choice.get("delta") or {}).get("content"):
            tokens += 1
        finished = finished or bool(choice.get("finish_reason"))
    return tokens, tokens > 0 or finished, finished


def usage_tokens(body: object) -> int | None:
    """``usage.completion_tokens`` of a response or chunk (cumulative when streamed), if given."""
    usage = body.get("usage") if isinstance(body, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


class StreamMeter:
    """Reads a worker's SSE events as they pass: when the first output arrived, how many output
    events and tokens followed, whether one finished and the stream ended with ``[DONE]``; with
    ``ids``, also which tokens (appended there: what a migrated stream carries over)."""

    def __init__(self, *, ids: list[int] | None = None) -> None:
        self.ids = ids
        self.untracked = False
        """An output chunk came without its token ids (``ids`` lacks them)."""
        self.finished = False
        """A chunk carried a ``finish_reason``."""
        self.events = 0
        """Events that carried output."""
        self.first_at = 0.0
        self.last_at = 0.0
        self.done = False
        self.streamed = 0
        """Output tokens counted in the chunks."""
        self.reported: int | None = None
        """The worker's own cumulative count, when it sends usage."""

    def feed(self, data: bytes, *, now: float) -> tuple[object, bool]:
        """Account the payload of one ``data:`` line; returns the decoded event (``None`` for
        ``[DONE]``) and whether it is the stream's first output. Raises ``ValueError``
        (``json.JSONDecodeError``) for a payload that is not JSON."""
        if data == b"[DONE]":
            self.done = True
            return None, False
        event = json.loads(data)
        if not isinstance(event, dict):
            return event, False
        ids = self.ids
        known = 0 if ids is None else len(ids)
        produced, is_output, finished = output_of(event, ids)
        if ids is not None and len(ids) - known < produced:
            self.untracked = True
        self.finished = self.finished or finished
        self.streamed += produced
        self.reported = usage_tokens(event) or self.reported
        if not is_output:
            return event, False
        self.events += 1
        self.last_at = now
        if self.events == 1:
            self.first_at = now
        return event, self.events == 1

    @property
    def output_tokens(self) -> int:
        """The worker's count when it reported one, else the tokens streamed."""
        return self.streamed if self.reported is None else self.reported

    @property
    def mean_itl(self) -> float | None:
        """Mean gap between output events (seconds), when there were two or more."""
        if self.events < 2:
            return None
        return (self.last_at - self.first_at) / (self.events - 1)


class RoutingService:
    """A router's core, its live workers and its request accounting (no frontend)."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        source: Source,
        perf: PerfModel,
        tokenizer: PromptTokenizer,
        use_kv_events: bool,
        share_load: bool = False,
    ) -> None:
        self.config = config
        self.source = source
        self.tokenizer = tokenizer
        self.classes = config.classes()
        self.clients = ClientGate(config.clients)
        """Per-client bounds (:mod:`copse.router.clients`), over HTTP and as an endpoint picker."""
        """Objectives (config, and Kubernetes' InferenceObjectives) and tenant weights."""
        self.router = Router(
            perf=perf,
            settings=config.selection(),
            policy=config.policy,
            thresholds=config.thresholds(),
            disagg=config.kv_transfer,
            use_kv_events=use_kv_events,
            share_load=share_load,
            seed=config.seed,
            tenant_weight=self.classes.weight,
            limits=config.rate_limits(),
            adapters=config.adapter_routing(),
        )
        self.catalog = config.catalog()
        """The models and LoRA adapters requests may name (``GET /v1/models``)."""
        self._several_models = len(self.catalog.models) > 1
        self.metrics = RouterMetrics(
            lambda: self.router,
            tenants=config.tenants,
            tenant_labels=config.metrics_tenants,
            adapter_labels=config.metrics_adapters,
            model=config.model,
            slo=None if config.slo is None else config.slo.targets(),
        )
        self._endpoints: dict[str, Endpoint] = {}
        self._live: dict[str, _Live] = {}
        self._failures: dict[str, int] = {}
        """Consecutive failed health probes per endpoint."""
        self._urls: dict[str, str] = {}
        """Worker id -> base URL of the live workers."""
        self._waiting: dict[str, asyncio.Future[Route]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._probe_wake = asyncio.Event()
        self.heard: dict[str, float] = {}
        """Worker id -> when output of it last arrived (frontends set it as chunks pass)."""
        self.on_worker_added: list[Callable[[str, str], object]] = []
        """Callbacks ``(worker_id, url)`` run when a worker becomes usable (KV resync hooks)."""
        self.on_worker_removed: list[Callable[[str], object]] = []
        """Callbacks ``(worker_id)`` run when a worker is dropped (abandon what runs on it)."""
        self.on_changes: list[Callable[[], object]] = []
        """Callbacks run after the core changed in-flight load (replica sync flushes its outbox)."""
        self.readiness_checks: list[Callable[[], str | None]] = []
        """Each says what a starting router still waits for before it has a picture of the workers'
        caches and its peers' load (``None``: nothing more)."""
        self.draining = False
        """Shutting down: not ready, finishing what is in flight."""
        self.in_flight = 0
        """Requests this router is answering (what a drain waits for; its frontend counts them)."""
        self._started_at = 0.0
        self._recovered = False
        self._tokenize_pool = ThreadPoolExecutor(
            max_workers=config.tokenize_threads, thread_name_prefix="copse-tokenize"
        )

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router service is not started")
        return self._session

    async def start(self) -> None:
        """Open the worker HTTP session, start discovery and the health probes."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self.config.request_timeout_s)
        # No cap on connections to the workers: aiohttp's default (100 in all) held every stream
        # beyond the 100th outside the router's queue and busy thresholds, waiting for a connection
        # that a random host's release handed over (TTFT p99 of seconds at 256 streams).
        connector = aiohttp.TCPConnector(limit=0)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        self._started_at = self.now()
        self._tasks.append(asyncio.create_task(self.source.run(self._on_discovery), name="discovery"))
        self._tasks.append(asyncio.create_task(self._probe_loop(), name="health-probes"))

    async def stop(self) -> None:
        """Cancel every task of the service and close the session."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def add_task(self, task: asyncio.Task[None]) -> None:
        """Run ``task`` for the service's lifetime (cancelled at cleanup)."""
        self._tasks.append(task)

    def now(self) -> float:
        """The clock the core's backlog decays with (seconds)."""
        return time.monotonic()

    def _role(self, worker_id: str) -> Role | None:
        info = self.router.workers.get(worker_id)
        return None if info is None else info.role

    def _revision(self, worker_id: str) -> str:
        """The deployment revision a worker runs ("" when its pod carries none)."""
        info = self.router.workers.get(worker_id)
        return "" if info is None or info.revision is None else info.revision

    def worker_url(self, worker_id: str) -> str | None:
        """Base URL of a usable worker."""
        return self._urls.get(worker_id)

    # -- workers ------------------------------------------------------------------------------

    def _on_discovery(self, endpoints: Mapping[str, Endpoint]) -> None:
        self._endpoints = dict(endpoints)
        for key in list(self._live):
            live, endpoint = self._live[key], self._endpoints.get(key)
            if endpoint is not None and dataclasses.replace(endpoint, draining=live.endpoint.draining) == (
                live.endpoint
            ):
                if endpoint.draining != live.endpoint.draining:
                    self._set_draining(key, endpoint)
            else:
                self._drop(key, reason="gone from discovery")
        self._probe_wake.set()

    def _set_draining(self, key: str, endpoint: Endpoint) -> None:
        """A live worker starts (or stops) draining: it keeps its in-flight requests and gets no
        new ones."""
        live = self._live[key]
        live.endpoint = endpoint
        info = self.router.workers[live.worker_id]
        released = self.router.add_worker(
            dataclasses.replace(info, draining=endpoint.draining), now=self.now()
        )
        log.info("worker %s %s", live.worker_id, "drains" if endpoint.draining else "serves again")
        self._update_worker_gauges()
        self._dispatch(released)

    async def _probe_loop(self) -> None:
        while True:
            self._probe_wake.clear()
            endpoints = list(self._endpoints.values())
            if endpoints:
                await asyncio.gather(*(self._probe(endpoint) for endpoint in endpoints))
            # (asyncio.timeout, not wait_for: in Python 3.11 wait_for returns when the wake-up and
            # the cancellation at close arrive together, and the loop then never ends)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.health_interval_s):
                    await self._probe_wake.wait()

    async def _probe(self, endpoint: Endpoint) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        dead = False
        sent = self.now()
        try:
            async with self.session.get(f"{endpoint.url}/health", timeout=timeout) as response:
                healthy = response.status == 200
        except aiohttp.ClientConnectorError:
            healthy, dead = False, True  # nothing listens: the worker is gone
        except TimeoutError:
            # Slow: busy, or hung. A worker whose streams sent output while its probe waited is busy
            # (or this router is the slow one): only silence counts against it.
            live = self._live.get(endpoint.key)
            healthy = live is not None and self.heard.get(live.worker_id, -math.inf) >= sent
        except aiohttp.ClientError:
            healthy = False  # broken: maybe only busy
        if self._endpoints.get(endpoint.key) != endpoint:
            return  # discovery changed while probing
        failures = 0 if healthy else self._failures.get(endpoint.key, 0) + 1
        self._failures[endpoint.key] = failures
        if healthy and endpoint.key not in self._live:
            await self._register(endpoint)
        elif endpoint.key in self._live and (dead or failures >= self.config.health_failures):
            reason = "it refuses connections" if dead else f"{failures} health probes failed in a row"
            self._drop(endpoint.key, reason=reason)

    async def _register(self, endpoint: Endpoint) -> None:
        info: dict[str, Any] = {}
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s * 4)
        try:
            async with self.session.get(f"{endpoint.url}/worker_info", timeout=timeout) as response:
                if response.status == 200:
                    info = await response.json()
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
            log.info("worker %s: no /worker_info (%s)", endpoint.url, exc)
        # The engine's own id is what its KV events carry; discovery's (the pod name) otherwise.
        worker_id = str(info.get("worker_id") or endpoint.worker_id or endpoint.key)
        block_size = info.get("block_size")
        if block_size is not None and block_size != self.config.block_size:
            log.error(
                "worker %s (%s) hashes %s-token blocks but the router is configured with block_size %s;"
                " not using it",
                worker_id,
                endpoint.url,
                block_size,
                self.config.block_size,
            )
            return
        if self._endpoints.get(endpoint.key) != endpoint or endpoint.key in self._live:
            return
        self._live[endpoint.key] = _Live(endpoint=endpoint, worker_id=worker_id)
        self._urls[worker_id] = endpoint.url
        num_blocks = info.get("num_blocks")
        if isinstance(num_blocks, int) and num_blocks > 0:
            # The engine's own cache size, in blocks of the router's size (they are equal here).
            self.router.indexer.set_capacity(self.router.slots.slot(worker_id), num_blocks)
        max_loras, loras = info.get("max_loras"), info.get("loras")
        released = self.router.add_worker(
            WorkerInfo(
                worker_id=worker_id,
                role=endpoint.role,
                locality=endpoint.locality,
                draining=endpoint.draining,
                revision=endpoint.revision,
                model=endpoint.model or self.config.model,
                max_loras=max_loras if isinstance(max_loras, int) and max_loras > 0 else None,
                loras=tuple(name for name in loras if isinstance(name, str))
                if isinstance(loras, list)
                else None,
            ),
            now=self.now(),
        )
        log.info("worker %s (%s, %s) is up", worker_id, endpoint.url, endpoint.role.value)
        self._update_worker_gauges()
        for callback in self.on_worker_added:
            callback(worker_id, endpoint.url)
        self._dispatch(released)

    def _drop(self, key: str, *, reason: str) -> None:
        live = self._live.pop(key, None)
        if live is None:
            return
        self._urls.pop(live.worker_id, None)
        for callback in self.on_worker_removed:
            callback(live.worker_id)
        lost = self.router.remove_worker(live.worker_id)
        log.warning(
            "worker %s (%s) dropped: %s; %d requests in flight on it",
            live.worker_id,
            live.endpoint.url,
            reason,
            len(lost),
        )
        self._update_worker_gauges()
        self._changed()

    def _drop_worker_id(self, worker_id: str, *, reason: str) -> None:
        for key, live in list(self._live.items()):
            if live.worker_id == worker_id:
                self._drop(key, reason=reason)
        self._probe_wake.set()

    def _update_worker_gauges(self) -> None:
        counts = dict.fromkeys(Role, 0)
        for live in self._live.values():
            counts[live.endpoint.role] += 1
        for role, count in counts.items():
            self.metrics.workers.labels(role=role.value).set(count)

    # -- routing ------------------------------------------------------------------------------

    def _dispatch(self, routes: list[Route]) -> None:
        pending = collections.deque(routes)
        while pending:
            route = pending.popleft()
            future = self._waiting.pop(route.request_id, None)
            if future is not None and not future.done():
                future.set_result(route)
            else:  # nobody waits for it any more: free what routing it took, for the next in line
                pending.extend(self.router.finish(route.request_id, now=self.now()))
        self.metrics.queue_depth.set(self.router.queued)
        self._changed()

    def _changed(self) -> None:
        for callback in self.on_changes:
            callback()

    def released(self, routes: list[Route]) -> None:
        """Hand requests the core released from its queue to their waiting handlers."""
        self._dispatch(routes)

    async def _route(self, request: RouteRequest, exclude: frozenset[str], *, retry: bool) -> Route:
        """Route ``request`` to a worker not in ``exclude``, waiting in the queue for one if need
        be; a ``retry`` (routed before, and failed there) is neither rate limited nor charged to
        its tenant again (:meth:`Router.submit`)."""
        try:
            route = self.router.submit(request, now=self.now(), exclude=exclude, retry=retry)
        except Shed as exc:
            self.metrics.shed(request, reason=type(exc).__name__)
            raise Overloaded(
                str(exc), retry_after_s=exc.retry_after_s, rate_limited=isinstance(exc, RateLimited)
            ) from exc
        except NoWorkers as exc:
            raise Unavailable(f"{exc}; retry shortly") from exc
        if not retry:  # a retry was counted the first time
            self.metrics.admitted(request, queued=route is None)
        self.metrics.queue_depth.set(self.router.queued)
        if route is None:
            future: asyncio.Future[Route] = asyncio.get_running_loop().create_future()
            self._waiting[request.request_id] = future
            self._changed()  # a new queue head, maybe: peer replicas hear of it now
            try:
                route = await asyncio.wait_for(future, timeout=self.config.queue_timeout_s)
            except (TimeoutError, asyncio.CancelledError) as exc:
                # Out of the queue, or off its worker if routed just as the wait ended.
                self._waiting.pop(request.request_id, None)
                self.released(self.router.finish(request.request_id, now=self.now()))
                if isinstance(exc, asyncio.CancelledError):
                    raise  # the caller left (a gateway closing its stream, a shutdown)
                self.metrics.shed(request, reason="QueueTimeout")
                raise Overloaded(
                    f"all workers stayed busy for {self.config.queue_timeout_s:g} s (queue timeout)",
                    retry_after_s=1.0,
                ) from exc
        self.metrics.prompt_tokens.inc(route.prompt_tokens)
        self.metrics.prompt_length.observe(route.prompt_tokens)
        self.metrics.uncached_prompt.observe(route.prompt_tokens - route.cached_tokens)
        self.metrics.cached_tokens.inc(route.cached_tokens)
        self.metrics.onboard_seconds.inc(route.onboard_ms / 1000.0)
        self._changed()
        return route

    def _count_output(self, tokens: int) -> None:
        if tokens > 0:
            self.metrics.output_tokens.inc(tokens)
            self.metrics.output_length.observe(tokens)

    def _first_token(self, request_id: str) -> None:
        self._dispatch(self.router.prefill_done(request_id, now=self.now()))

    def _finish(self, request_id: str) -> None:
        self._dispatch(self.router.finish(request_id, now=self.now()))

    # -- requests -----------------------------------------------------------------------------

    async def prepare(
        self,
        model: type[CompletionRequest] | type[ChatCompletionRequest],
        raw: bytes,
        headers: Mapping[str, str] | None = None,
    ) -> Prepared:
        """Parse a generation request's body and hash its prompt. Raises :class:`Rejected` (400 for
        a malformed request, 404 for a model not served here). A body over
        ``tokenize_inline_bytes`` is tokenized on the tokenizer threads (``tokenizers`` releases the
        GIL while it encodes), so that a multi-megabyte prompt does not stall every other stream."""
        limits, context = self.config.limits, self.config.max_context_tokens
        inline = len(raw) <= self.config.tokenize_inline_bytes
        loop = asyncio.get_running_loop()
        try:
            if inline:
                request, body = parse_request_object(model, raw, limits=limits)
            else:  # megabytes of JSON: scanned and decoded on a tokenizer thread, the loop serves on
                request, body = await loop.run_in_executor(
                    self._tokenize_pool, functools.partial(parse_request_object, model, raw, limits=limits)
                )
            check_context(prompt_tokens=None, max_tokens=request.asked_tokens(), context=context)
        except RequestError as exc:
            raise Rejected(400, exc.message, param=exc.param) from exc
        try:
            resolved = self.catalog.resolve(request.model)
        except UnknownModel as exc:
            raise Rejected(404, str(exc), param="model") from exc
        if request.lora_request is not None:
            # Only adapters of the catalog, at the paths it gives: a client must not make engines
            # load weights from a path of its choosing.
            raise Rejected(
                400, "lora_request is set by the router: name the adapter as model", param="lora_request"
            )
        rewritten = resolved.adapter is not None
        if resolved.adapter is not None:
            body = {**body, "lora_request": resolved.adapter.lora_request()}
        try:
            if inline:
                tokens = prompt_tokens(request, self.tokenizer)
            else:
                tokens = await loop.run_in_executor(
                    self._tokenize_pool, prompt_tokens, request, self.tokenizer
                )
        except RequestError as exc:  # the model's chat template refused the chat
            raise Rejected(400, exc.message, param=exc.param) from exc
        if not tokens:
            raise Rejected(400, "prompt holds no tokens", param="prompt")
        try:
            check_context(prompt_tokens=len(tokens), max_tokens=request.asked_tokens(), context=context)
        except RequestError as exc:
            raise Rejected(400, exc.message, param=exc.param) from exc
        expected = min(request.requested_tokens(), context - len(tokens))
        route = self.route_request(
            uuid.uuid4().hex, tokens, max_tokens=expected, headers=headers or {}, resolved=resolved
        )
        return Prepared(
            request=request, body=body, tokens=tokens, route=route, resolved=resolved, rewritten=rewritten
        )

    def route_request(
        self,
        request_id: str,
        tokens: Sequence[int],
        *,
        max_tokens: int,
        headers: Mapping[str, str] | None = None,
        resolved: Resolved | None = None,
    ) -> RouteRequest:
        """What the core needs to route a prompt of ``tokens``; ``headers`` (lower-case names) name
        its objective and tenant (:meth:`copse.router.objectives.Classes.of`), ``resolved`` its
        model and adapter (the router's own base model when not given)."""
        objective, tenant = self.classes.of(headers or {})
        adapter = None if resolved is None else resolved.adapter
        model = "" if resolved is None or not self._several_models else resolved.model
        return RouteRequest(
            request_id=request_id,
            hashes=block_hashes(
                tokens,
                block_size=self.config.block_size,
                lora_id=None if adapter is None else adapter.lora_int_id,
            ),
            prompt_tokens=len(tokens),
            max_tokens=max_tokens,
            priority=objective.priority,
            tenant=tenant,
            ttft_slo_ms=objective.ttft_ms,
            itl_slo_ms=objective.itl_ms,
            objective=objective.name,
            model=model,
            adapter="" if adapter is None else adapter.name,
        )

    def metrics_text(self) -> bytes:
        """The Prometheus exposition of the router's metrics."""
        return generate_latest(self.metrics.registry)

    def workers_report(self) -> list[dict[str, Any]]:
        """Every live worker, whether it drains and this router's requests in flight on it (what
        the operator reads before it removes a draining group), its model and the LoRA adapters
        it is believed to hold (least recently used first)."""
        return [
            {
                "key": key,
                "worker_id": live.worker_id,
                "url": live.endpoint.url,
                "role": live.endpoint.role.value,
                "revision": live.endpoint.revision,
                "draining": self.router.workers[live.worker_id].draining,
                "in_flight": self.router.in_flight(live.worker_id),
                "model": self.router.workers[live.worker_id].model,
                "loras": self.router.adapters.held(self.router.slots.slot(live.worker_id)),
            }
            for key, live in sorted(self._live.items())
        ]

    def set_nats_connected(self, connected: bool) -> None:
        """Exact mode while NATS is connected (KV events keep the index); approximate mode while it
        is not (the index learns from this router's own decisions)."""
        if self.router.radix is not None:
            self.router.radix.learning = not connected
        self.metrics.nats_connected.set(1 if connected else 0)

    def readiness(self) -> tuple[bool, list[str]]:
        """Whether the router should get traffic, and if not what it waits for: a usable worker, and
        once after starting, a picture of the workers' caches and its peers' load (until
        ``recovery_timeout_s``: then it serves with what it has); never while draining."""
        waiting = []
        if self.draining:
            waiting.append("nothing: it is shutting down")
        if not self.router.workers:
            waiting.append("a usable worker")
        if not self._recovered:
            recovering = [reason for check in self.readiness_checks if (reason := check()) is not None]
            unprobed = sum(1 for key in self._endpoints if key not in self._failures)
            if unprobed:
                recovering.append(f"the first health probe of {unprobed} discovered workers")
            if not recovering and self.router.workers:
                self._recovered = True
                log.info("router ready: it knows the workers' caches and its peers' load")
            elif recovering and self.now() - self._started_at > self.config.recovery_timeout_s:
                self._recovered = True
                log.warning(
                    "router ready after recovery_timeout_s (%g s) without: %s",
                    self.config.recovery_timeout_s,
                    "; ".join(recovering),
                )
            else:
                waiting.extend(recovering)
        ready = not waiting
        self.metrics.ready.set(1 if ready else 0)
        return ready, waiting

    def health(self) -> tuple[int, dict[str, Any]]:
        """HTTP status and body of a health answer: 200 while at least one worker is usable."""
        workers = sum(1 for info in self.router.workers.values() if not info.draining)
        body = {"status": "ok" if workers else "no workers", "workers": workers, "queued": self.router.queued}
        return (200 if workers else 503), body
