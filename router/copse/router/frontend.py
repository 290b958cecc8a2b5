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

Workers, their health probes and the accounting of in-flight load are the shared
:class:`~copse.router.service.RoutingService`'s.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from copse.router.config import RouterConfig
from copse.router.core import Role, Route
from copse.router.discovery import Source
from copse.router.service import (
    Rejected,
    RoutingService,
    StreamMeter,
    Unavailable,
    error_body,
    usage_tokens,
)
from copse.router.tokens import Tokenizer
from copse.workers.perf import PerfModel
from copse.workers.protocol.openai_api import ChatCompletionRequest, CompletionRequest, ErrorResponse

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
"""``Retry-After`` of a 503: about the time a busy worker takes to admit more work."""

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def error_response(status: int, message: str, *, param: str | None = None) -> web.Response:
    """An error answer in the workers' (``trtllm-serve``'s) shape."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return web.json_response(
        text=error_body(status, message, param=param).decode(), status=status, headers=headers
    )


class _EarlyFailure(Exception):
    """The worker failed before anything reached the client: the request may go elsewhere."""


def _json_or_none(body: bytes) -> object:
    """A worker's JSON answer, or ``None`` when it is not JSON (it is relayed as it is anyway)."""
    try:
        return json.loads(body)
    except ValueError:
        return None


class RouterService(RoutingService):
    """One router: the shared routing service behind the OpenAI HTTP frontend."""

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
        super().__init__(
            config,
            source=source,
            perf=perf,
            tokenizer=tokenizer,
            use_kv_events=use_kv_events,
            share_load=share_load,
        )
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

    async def _on_startup(self, _: web.Application) -> None:
        await self.start()

    async def _on_cleanup(self, _: web.Application) -> None:
        await self.stop()

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
            prepared = self.prepare(model, raw)
        except Rejected as exc:
            self.metrics.requests.labels(status=str(exc.status)).inc()
            return error_response(exc.status, exc.message, param=exc.param)
        request, route_request = prepared.request, prepared.route
        payload = json.loads(raw)
        exclude: set[str] = set()
        failure = ""
        for attempt in range(self.config.max_retries + 1):
            try:
                route = await self._route(route_request, frozenset(exclude))
            except Unavailable as exc:
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
                    self._count_output(usage_tokens(_json_or_none(body)) or 0)
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
        meter = StreamMeter()
        try:
            async for line in upstream.content:
                if line.startswith(b"data:"):
                    event, first = meter.feed(line[5:].strip(), now=self.now())
                    if isinstance(event, dict) and "error" in event and client is None:
                        raise _EarlyFailure(f"worker stream error: {event['error']}")
                    if first:
                        self._first_token(route.request_id)
                        self.metrics.ttft.observe(meter.first_at - arrived)
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
            self._count_output(meter.streamed)
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
        self._count_output(meter.output_tokens)
        itl = meter.mean_itl
        if not meter.done:
            error = ErrorResponse(
                message="the worker ended the stream early", type="BadGatewayError", code=502
            )
            await client.write(f"data: {json.dumps({'error': error.model_dump()})}\n\n".encode())
        elif itl is not None:
            self.metrics.itl.observe(itl)
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
        status, body = self.health()
        return web.json_response(body, status=status)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics_text(), headers={"Content-Type": CONTENT_TYPE_LATEST})
