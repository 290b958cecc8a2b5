"""The OpenAI-compatible HTTP frontend: routes each request with the core and proxies it.

=============================  ==============================================================
``POST /v1/completions``       OpenAI completions (token-id or text prompt), SSE with ``stream``
``POST /v1/chat/completions``  OpenAI chat completions, SSE with ``stream``
``GET /v1/models``             the served model
``GET /health``                200 while at least one worker is usable, else 503
``GET /metrics``               Prometheus (:mod:`copse.router.metrics`)
=============================  ==============================================================

Errors: 400 with the workers' error body naming the field; 404 for a model not served here;
503 with ``Retry-After`` when every worker is busy and the queue is full (or the wait in it
timed out) or no worker is up.

A request whose worker fails before its first token (connection refused or reset, a 5xx, a
stream that ends early) is sent to another worker, at most ``max_retries`` times; nothing has
reached the client yet, so the client sees one clean answer. After the first token the client
gets an SSE ``data: {"error": ...}`` event and the stream ends.

Workers come from discovery; each is probed (``GET /health``) every ``health_interval_s``. A
worker that refuses connections (its process is gone) is dropped at the first probe, so within
``interval + timeout``; one that answers slowly or with errors after ``health_failures`` probes in
a row (an engine busy with a long step is not dead). A worker
is registered under the id its ``GET /worker_info`` reports (mocked engines; the id their KV
events carry), else under the id discovery knows (the pod name, which the KV relay next to a
``trtllm-serve`` publishes under).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from copse.router.approx import ApproximateIndexer
from copse.router.config import RouterConfig
from copse.router.core import NoWorkers, QueueFull, Role, Route, Router, WorkerInfo
from copse.router.discovery import Endpoint, Source
from copse.router.metrics import RouterMetrics
from copse.router.policies import RouteRequest
from copse.router.tokens import Tokenizer, prompt_tokens
from copse.workers.perf import PerfModel
from copse.workers.protocol.hashing import block_hashes
from copse.workers.protocol.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    RequestError,
    parse_request,
)

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""``Retry-After`` of a 503: about the time a busy worker takes to admit more work."""

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_KINDS = {
    400: "BadRequestError",
    404: "NotFoundError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


def error_response(status: int, message: str, *, param: str | None = None) -> web.Response:
    """An error answer in the workers' (``trtllm-serve``'s) shape."""
    body = ErrorResponse(message=message, type=_KINDS.get(status, "Error"), param=param, code=status)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return web.json_response(text=body.model_dump_json(), status=status, headers=headers)


class _EarlyFailure(Exception):
    """The worker failed before anything reached the client: the request may go elsewhere."""


class _Unavailable(Exception):
    """No worker can take the request now (503)."""


@dataclass(slots=True)
class _Live:
    """A discovered worker that answers its health probe."""

    endpoint: Endpoint
    worker_id: str


def _output(event: Mapping[str, Any]) -> tuple[int, bool]:
    """What an SSE chunk carries: its output tokens (its token ids, else one per choice with text)
    and whether it is output at all (tokens, or a finish; not just the role header or usage)."""
    tokens, finished = 0, False
    for choice in event.get("choices") or ():
        token_ids = choice.get("token_ids")
        if token_ids:
            tokens += len(token_ids)
        elif choice.get("text") or (choice.get("delta") or {}).get("content"):
            tokens += 1
        finished = finished or bool(choice.get("finish_reason"))
    return tokens, tokens > 0 or finished


def _json_or_none(body: bytes) -> object:
    """A worker's JSON answer, or ``None`` when it is not JSON (it is relayed as it is anyway)."""
    try:
        return json.loads(body)
    except ValueError:
        return None


def _usage_tokens(body: object) -> int | None:
    """``usage.completion_tokens`` of a response or chunk (cumulative when streamed), if given."""
    usage = body.get("usage") if isinstance(body, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


class RouterService:
    """One router: core, worker liveness, HTTP frontend."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        source: Source,
        perf: PerfModel,
        tokenizer: Tokenizer,
        use_kv_events: bool,
        share_load: bool = False,
    ) -> None:
        self.config = config
        self.source = source
        self.tokenizer = tokenizer
        self.router = Router(
            perf=perf,
            settings=config.selection(),
            policy=config.policy,
            thresholds=config.thresholds(),
            disagg=config.kv_transfer,
            use_kv_events=use_kv_events,
            share_load=share_load,
            seed=config.seed,
        )
        self.metrics = RouterMetrics(lambda: self.router)
        self.app = web.Application()
        self.app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
            ]
        )
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)
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
        self.on_worker_added: list[Any] = []
        """Callbacks ``(worker_id, url)`` run when a worker becomes usable (KV resync hooks)."""
        self.on_changes: list[Any] = []
        """Callbacks run after the core changed in-flight load (replica sync flushes its outbox)."""

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router service is not started")
        return self._session

    async def _on_startup(self, _: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self.config.request_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._tasks.append(asyncio.create_task(self.source.run(self._on_discovery), name="discovery"))
        self._tasks.append(asyncio.create_task(self._probe_loop(), name="health-probes"))

    async def _on_cleanup(self, _: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()

    def add_task(self, task: asyncio.Task[None]) -> None:
        """Run ``task`` for the service's lifetime (cancelled at cleanup)."""
        self._tasks.append(task)

    def now(self) -> float:
        """The clock the core's backlog decays with (seconds)."""
        return time.monotonic()

    def _role(self, worker_id: str) -> Role | None:
        info = self.router.workers.get(worker_id)
        return None if info is None else info.role

    def worker_url(self, worker_id: str) -> str | None:
        """Base URL of a usable worker."""
        return self._urls.get(worker_id)

    # -- workers ------------------------------------------------------------------------------

    def _on_discovery(self, endpoints: Mapping[str, Endpoint]) -> None:
        self._endpoints = dict(endpoints)
        for key in list(self._live):
            if key not in self._endpoints or self._endpoints[key] != self._live[key].endpoint:
                self._drop(key, reason="gone from discovery")
        self._probe_wake.set()

    async def _probe_loop(self) -> None:
        while True:
            self._probe_wake.clear()
            endpoints = list(self._endpoints.values())
            if endpoints:
                await asyncio.gather(*(self._probe(endpoint) for endpoint in endpoints))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._probe_wake.wait(), timeout=self.config.health_interval_s)

    async def _probe(self, endpoint: Endpoint) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        dead = False
        try:
            async with self.session.get(f"{endpoint.url}/health", timeout=timeout) as response:
                healthy = response.status == 200
        except aiohttp.ClientConnectorError:
            healthy, dead = False, True  # nothing listens: the worker is gone
        except (TimeoutError, aiohttp.ClientError):
            healthy = False  # slow or broken: maybe only busy
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
        indexer = self.router.indexer
        num_blocks = info.get("num_blocks")
        if isinstance(indexer, ApproximateIndexer) and isinstance(num_blocks, int) and num_blocks > 0:
            # The engine's own cache size, in blocks of the router's size (they are equal here).
            indexer.set_capacity(self.router.slots.slot(worker_id), num_blocks)
        released = self.router.add_worker(
            WorkerInfo(worker_id=worker_id, role=endpoint.role, locality=endpoint.locality), now=self.now()
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
        for route in routes:
            future = self._waiting.pop(route.request_id, None)
            if future is not None and not future.done():
                future.set_result(route)
            elif future is None:
                self.router.finish(route.request_id, now=self.now())
        self.metrics.queue_depth.set(self.router.queued)
        self._changed()

    def _changed(self) -> None:
        for callback in self.on_changes:
            callback()

    def released(self, routes: list[Route]) -> None:
        """Hand requests the core released from its queue to their waiting handlers."""
        self._dispatch(routes)

    async def _route(self, request: RouteRequest, exclude: frozenset[str]) -> Route:
        try:
            route = self.router.submit(request, now=self.now(), exclude=exclude)
        except QueueFull as exc:
            raise _Unavailable(str(exc)) from exc
        except NoWorkers as exc:
            raise _Unavailable(f"{exc}; retry shortly") from exc
        self.metrics.queue_depth.set(self.router.queued)
        if route is None:
            future: asyncio.Future[Route] = asyncio.get_running_loop().create_future()
            self._waiting[request.request_id] = future
            try:
                route = await asyncio.wait_for(future, timeout=self.config.queue_timeout_s)
            except TimeoutError as exc:
                self._waiting.pop(request.request_id, None)
                self.router.finish(request.request_id, now=self.now())
                raise _Unavailable(
                    f"all workers stayed busy for {self.config.queue_timeout_s:g} s (queue timeout)"
                ) from exc
        self.metrics.prompt_tokens.inc(route.prompt_tokens)
        self.metrics.prompt_length.observe(route.prompt_tokens)
        self.metrics.cached_tokens.inc(route.cached_tokens)
        self._changed()
        return route

    def _count_output(self, tokens: int) -> None:
        if tokens > 0:
            self.metrics.output_tokens.inc(tokens)

    def _first_token(self, request_id: str) -> None:
        self._dispatch(self.router.prefill_done(request_id, now=self.now()))

    def _finish(self, request_id: str) -> None:
        self._dispatch(self.router.finish(request_id, now=self.now()))

    # -- HTTP ---------------------------------------------------------------------------------

    async def _completions(self, http: web.Request) -> web.StreamResponse:
        return await self._generate(http, CompletionRequest, "/v1/completions")

    async def _chat(self, http: web.Request) -> web.StreamResponse:
        return await self._generate(http, ChatCompletionRequest, "/v1/chat/completions")

    async def _generate(
        self,
        http: web.Request,
        model: type[CompletionRequest] | type[ChatCompletionRequest],
        path: str,
    ) -> web.StreamResponse:
        arrived = self.now()
        raw = await http.read()
        try:
            request = parse_request(model, raw)
        except RequestError as exc:
            self.metrics.requests.labels(status="400").inc()
            return error_response(400, exc.message, param=exc.param)
        if request.model != self.config.model:
            self.metrics.requests.labels(status="404").inc()
            served = self.config.model
            message = f"model {request.model!r} is not served here (GET /v1/models lists {served!r})"
            return error_response(404, message, param="model")
        tokens = prompt_tokens(request, self.tokenizer)
        if not tokens:
            self.metrics.requests.labels(status="400").inc()
            return error_response(400, "prompt holds no tokens", param="prompt")
        route_request = RouteRequest(
            request_id=uuid.uuid4().hex,
            hashes=block_hashes(tokens, block_size=self.config.block_size),
            prompt_tokens=len(tokens),
            max_tokens=request.requested_tokens(),
        )
        payload = json.loads(raw)
        exclude: set[str] = set()
        failure = ""
        for attempt in range(self.config.max_retries + 1):
            try:
                route = await self._route(route_request, frozenset(exclude))
            except _Unavailable as exc:
                self.metrics.requests.labels(status="503").inc()
                return error_response(503, str(exc))
            if attempt:
                self.metrics.retries.inc()
            try:
                response = await self._forward(
                    http, route, payload, path=path, stream=request.stream, arrived=arrived
                )
            except _EarlyFailure as exc:
                failure = str(exc)
                log.warning(
                    "request %s failed on %s before its first token: %s",
                    route.request_id,
                    route.worker_id,
                    exc,
                )
                self._finish(route.request_id)
                exclude.add(route.worker_id)
                if route.prefill_worker_id is not None:
                    exclude.add(route.prefill_worker_id)
                continue
            except BaseException:
                self._finish(route.request_id)
                raise
            self._finish(route.request_id)
            self.metrics.requests.labels(status=str(response.status)).inc()
            self.metrics.duration.observe(self.now() - arrived)
            return response
        self.metrics.requests.labels(status="503").inc()
        attempts = self.config.max_retries + 1
        return error_response(503, f"no worker could serve the request after {attempts} attempts: {failure}")

    async def _prefill_remotely(self, route: Route, payload: dict[str, Any], path: str) -> dict[str, Any]:
        """Run the context phase on the prefill worker; returns its ``disaggregated_params``."""
        assert route.prefill_worker_id is not None
        url = self._urls.get(route.prefill_worker_id)
        if url is None:
            raise _EarlyFailure(f"prefill worker {route.prefill_worker_id} is gone")
        dropped = ("stream", "stream_options", "max_completion_tokens")
        context = {key: value for key, value in payload.items() if key not in dropped}
        context["max_tokens"] = 1
        context["disaggregated_params"] = {"request_type": "context_only"}
        try:
            async with self.session.post(f"{url}{path}", json=context) as response:
                if response.status >= 500:
                    raise _EarlyFailure(f"prefill worker answered {response.status}")
                body = await response.json()
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
            self._drop_worker_id(route.prefill_worker_id, reason=f"request failed: {exc}")
            raise _EarlyFailure(f"prefill worker {route.prefill_worker_id}: {exc}") from exc
        choices = body.get("choices") if isinstance(body, dict) else None
        params = choices[0].get("disaggregated_params") if choices else None
        if not isinstance(params, dict):
            raise _EarlyFailure(f"prefill worker {route.prefill_worker_id} returned no disaggregated_params")
        return {**params, "request_type": "generation_only"}

    async def _forward(
        self,
        http: web.Request,
        route: Route,
        payload: dict[str, Any],
        *,
        path: str,
        stream: bool,
        arrived: float,
    ) -> web.StreamResponse:
        url = self._urls.get(route.worker_id)
        if url is None:
            raise _EarlyFailure(f"worker {route.worker_id} is gone")
        if route.prefill_worker_id is not None:
            payload = {**payload, "disaggregated_params": await self._prefill_remotely(route, payload, path)}
        elif self._role(route.worker_id) is Role.DECODE:
            # A whole request on a decode worker (short prompt, or no prefill worker): trtllm-serve's
            # conditional disaggregation marks it so.
            payload = {**payload, "disaggregated_params": {"request_type": "context_and_generation"}}
        upstream = None
        try:
            upstream = await self.session.post(f"{url}{path}", json=payload)
            if upstream.status >= 500:
                raise _EarlyFailure(f"worker answered {upstream.status}: {(await upstream.text())[:200]}")
            if upstream.status != 200 or not stream:
                body = await upstream.read()
                if upstream.status == 200:
                    self._first_token(route.request_id)
                    self._count_output(_usage_tokens(_json_or_none(body)) or 0)
                return web.Response(
                    body=body,
                    status=upstream.status,
                    content_type=upstream.content_type or "application/json",
                )
            return await self._relay_stream(http, route, upstream, arrived=arrived)
        except (TimeoutError, aiohttp.ClientError) as exc:
            self._drop_worker_id(route.worker_id, reason=f"request failed: {exc}")
            raise _EarlyFailure(f"worker {route.worker_id}: {exc!r}") from exc
        finally:
            if upstream is not None:
                upstream.release()

    async def _relay_stream(
        self, http: web.Request, route: Route, upstream: aiohttp.ClientResponse, *, arrived: float
    ) -> web.StreamResponse:
        """Relay an SSE stream; nothing is sent to the client before the first token arrives."""
        pending: list[bytes] = []
        client: web.StreamResponse | None = None
        first_at = last_at = 0.0
        tokens = 0
        streamed = 0  # output tokens in the chunks
        reported: int | None = None  # the worker's own (cumulative) count, when it sends usage
        done = False
        try:
            async for line in upstream.content:
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                    else:
                        event = json.loads(data)
                        if isinstance(event, dict) and "error" in event and client is None:
                            raise _EarlyFailure(f"worker stream error: {event['error']}")
                        is_output = False
                        if isinstance(event, dict):
                            produced, is_output = _output(event)
                            streamed += produced
                            reported = _usage_tokens(event) or reported
                        if is_output:
                            now = self.now()
                            tokens += 1
                            last_at = now
                            if client is None:
                                first_at = now
                                self._first_token(route.request_id)
                                self.metrics.ttft.observe(now - arrived)
                                client = web.StreamResponse(headers=_SSE_HEADERS)
                                await client.prepare(http)
                                for held in pending:
                                    await client.write(held)
                                pending.clear()
                if client is not None:
                    await client.write(line)
                else:
                    pending.append(line)
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
            if client is None:
                self._drop_worker_id(route.worker_id, reason=f"stream failed: {exc}")
                raise _EarlyFailure(f"worker {route.worker_id} stream broke: {exc!r}") from exc
            self._count_output(streamed)
            log.warning(
                "stream of %s from %s broke after its first token: %r", route.request_id, route.worker_id, exc
            )
            error = ErrorResponse(
                message=f"the worker serving this request failed mid-stream: {exc!r}",
                type="BadGatewayError",
                code=502,
            )
            await client.write(f"data: {json.dumps({'error': error.model_dump()})}\n\n".encode())
            await client.write_eof()
            return client
        if client is None:
            raise _EarlyFailure(f"worker {route.worker_id} ended the stream before any token")
        self._count_output(streamed if reported is None else reported)
        if not done:
            error = ErrorResponse(
                message="the worker ended the stream early", type="BadGatewayError", code=502
            )
            await client.write(f"data: {json.dumps({'error': error.model_dump()})}\n\n".encode())
        elif tokens > 1:
            self.metrics.itl.observe((last_at - first_at) / (tokens - 1))
        await client.write_eof()
        return client

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.config.model, "object": "model", "created": 0, "owned_by": "copse"}],
            }
        )

    async def _health(self, _: web.Request) -> web.Response:
        workers = len(self.router.workers)
        status = 200 if workers else 503
        return web.json_response(
            {"status": "ok" if workers else "no workers", "workers": workers, "queued": self.router.queued},
            status=status,
        )

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )
