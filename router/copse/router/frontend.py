"""The OpenAI-compatible HTTP frontend: routes each request with the core and proxies it.

=============================  ==============================================================
``POST /v1/completions``       OpenAI completions (token-id or text prompt), SSE with ``stream``
``POST /v1/chat/completions``  OpenAI chat completions, SSE with ``stream``
``GET /v1/models``             the served models and their LoRA adapters
``GET /health``                200 while at least one worker is usable, else 503
``GET /ready``                 200 once the router has a picture of caches and peers (readiness probe)
``GET /metrics``               Prometheus (:mod:`copse.router.metrics`)
``GET /workers``               live workers: draining, requests here, model, adapters held
=============================  ==============================================================

Errors, every one in the OpenAI error shape: 400 with the workers' error body naming the field;
404 for a model not served here (or an unknown path); 413 for a body over ``max_body_bytes``;
429 with ``Retry-After`` when the request is shed: its tenant is over its rate limit, the router
predicts it would wait past its objective's TTFT target, the queue is full, or the wait in it
timed out (objectives and tenants: :mod:`copse.router.objectives`); 503 with ``Retry-After`` only
when no worker is up to serve it.

A request whose worker fails before its first token (connection refused or reset, a 5xx, a
stream that ends early) is sent to another worker, at most ``max_retries`` times; nothing has
reached the client yet, so the client sees one clean answer. A stream whose worker fails after
its first token (the connection breaks, the stream ends unfinished, the worker sends an error
event, health probes drop it, or it stays silent for ``token_timeout_s``) is migrated: continued
on another worker from the tokens already streamed (:mod:`copse.router.migration`), at most
``migration_limit`` times; beyond that, or when it cannot be continued, the client gets an SSE
``data: {"error": ...}`` event and the stream ends.

Workers, their health probes and the accounting of in-flight load are the shared
:class:`~copse.router.service.RoutingService`'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from copse.router.auth import ApiKeys
from copse.router.clients import Refused, bearer_token, client_key
from copse.router.config import RouterConfig
from copse.router.core import Role, Route
from copse.router.discovery import Source
from copse.router.metrics import SLO_FAILED, SLO_REFUSED
from copse.router.migration import MigrationReason, StreamProgress
from copse.router.policies import RouteRequest
from copse.router.service import (
    GENERATE_PATHS,
    Overloaded,
    Prepared,
    Rejected,
    RoutingService,
    StreamMeter,
    Unavailable,
    usage_tokens,
)
from copse.router.token_streams import ENGINE_PATH, TokenRelay, relayable
from copse.router.tokens import HfPromptTokenizer, PromptTokenizer
from copse.workers.perf import PerfModel
from copse.workers.protocol.errors import as_openai_error, error_body, error_event
from copse.workers.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from copse.workers.serving import openai_errors

log = logging.getLogger(__name__)

_T = TypeVar("_T")

RETRY_AFTER_S = 1
"""``Retry-After`` of a 503: about the time a worker takes to come back or be replaced."""

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_JSON_HEADERS = {"Content-Type": "application/json"}


def error_response(
    status: int, message: str, *, param: str | None = None, retry_after: str | None = None
) -> web.Response:
    """An error answer in the workers' (``trtllm-serve``'s) shape; a 503 and a 429 carry
    ``Retry-After`` (``retry_after``, else :data:`RETRY_AFTER_S`)."""
    if retry_after is None and status in (429, 503):
        retry_after = str(RETRY_AFTER_S)
    headers = None if retry_after is None else {"Retry-After": retry_after}
    return web.json_response(
        text=error_body(status, message, param=param).decode(), status=status, headers=headers
    )


class _ClientGone(ConnectionError):
    """The client of a stream went away, or stopped reading it for longer than
    ``clients.write_timeout_s``: its worker request is given up (the engine aborts it)."""


class _AttemptFailed(Exception):
    """One attempt at a request failed on a worker: the request may go on elsewhere (retried when
    the client has received nothing yet, migrated when it has)."""

    def __init__(
        self, message: str, *, worker_id: str, reason: MigrationReason = MigrationReason.DISCONNECTED
    ) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        """The worker that failed (not tried again for this request)."""
        self.reason = reason


class _Refused(Exception):
    """A worker refused a stream's continuation as a bad request (4xx): another would too."""


class _Abandoned(Exception):
    """The router gave up on the worker of an attempt (see :meth:`_Attempt.abandon`)."""


@dataclass(eq=False, slots=True)
class _Attempt:
    """A request in flight on its worker(s), which the router may abandon: when health probes drop
    a worker (a hung engine still accepts connections) or the stream stays silent too long."""

    workers: tuple[str, ...]
    silent_since: float | None = None
    """When the stream last sent output (``None`` before its first token)."""
    abandoned: MigrationReason | None = None
    culprit: str = ""
    """The worker given up on."""
    pending: asyncio.Future[Any] | None = None
    """The call waiting for a worker's answer, cancelled on abandon."""
    upstream: aiohttp.ClientResponse | None = None
    """The worker's answer once it came; abandoning fails its next read."""

    def abandon(self, reason: MigrationReason, *, worker_id: str) -> None:
        if self.abandoned is not None:
            return
        self.abandoned = reason
        self.culprit = worker_id
        if self.pending is not None:
            self.pending.cancel()
        if self.upstream is not None:
            self.upstream.content.set_exception(_Abandoned(f"abandoned ({reason.value})"))


@dataclass(slots=True)
class _ClientStream:
    """A streamed answer to the client, across the attempts (workers) that serve it."""

    progress: StreamProgress
    arrived: float
    write_timeout_s: float
    """Longest one write may wait for the client to read."""
    request: RouteRequest
    """What the router routed (its objective and tenant label the latency metrics)."""
    relay: TokenRelay | None = None
    """Set when the engine streams token ids that the router turns into the client's text."""
    client: web.StreamResponse | None = None
    first_at: float = 0.0
    last_at: float = 0.0
    events: int = 0
    """Output events the client received."""
    open_event: bool = False
    """The last line written left an SSE event open (its blank line never came)."""

    async def open(self, http: web.Request, held: list[bytes]) -> None:
        """Start the client's answer with the lines held back so far."""
        self.client = web.StreamResponse(headers=_SSE_HEADERS)
        try:
            await self.client.prepare(http)
        except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
            raise _ClientGone(repr(exc)) from exc
        await self.write_lines(held)

    async def write(self, line: bytes) -> None:
        await self.write_lines([line])

    async def write_lines(self, lines: list[bytes]) -> None:
        """Send ``lines`` (each ending with its newline) to the client in one write: one chunk and
        one system call for all the events a worker had sent since the last read. A client gone,
        or not reading for ``write_timeout_s`` (its socket buffer full), raises :class:`_ClientGone`."""
        if not lines:
            return
        assert self.client is not None
        try:
            await asyncio.wait_for(
                self.client.write(lines[0] if len(lines) == 1 else b"".join(lines)), self.write_timeout_s
            )
        except (ConnectionError, TimeoutError, aiohttp.ClientConnectionResetError) as exc:
            raise _ClientGone(repr(exc)) from exc
        self.open_event = lines[-1].strip() != b""

    async def end(self) -> None:
        """Finish the chunked answer. A client that closed its connection once it read ``[DONE]``
        has everything: the terminator's failed write is not an error (and never the worker's)."""
        assert self.client is not None
        try:
            await self.client.write_eof()
        except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
            log.debug("client left before the stream's terminator: %r", exc)

    async def seal(self) -> None:
        """End an event a broken stream left open, so that the next one stays separate."""
        if self.open_event:
            await self.write(b"\n")

    def absorb(self, meter: StreamMeter) -> None:
        """Account an attempt's stream."""
        self.events += meter.events
        if meter.events:
            self.last_at = meter.last_at
        self.progress.absorb(untracked=meter.untracked, finished=meter.finished)


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
        tokenizer: PromptTokenizer,
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
        self.app = web.Application(
            client_max_size=config.max_body_bytes,
            middlewares=[
                openai_errors(max_body_bytes=config.max_body_bytes, on_error=self._count_error),
                self._authenticate,
            ],
        )
        self.app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/ready", self._ready),
                web.get("/metrics", self._metrics),
                web.get("/workers", self._workers),
            ]
        )
        self.app.on_startup.append(self._on_startup)
        self.app.on_cleanup.append(self._on_cleanup)
        self.api_keys = None if config.api_keys_file is None else ApiKeys(config.api_keys_file)
        """The keys ``/v1/`` requests must carry (:mod:`copse.router.auth`); ``None``: no auth."""
        self._attempts: set[_Attempt] = set()
        """Requests in flight on workers (what dropping a worker or the silence watchdog abandons)."""
        self.on_worker_removed.append(self._abandon_worker)

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """With API keys configured, ``/v1/`` paths need ``Authorization: Bearer <key>`` (probes,
        metrics and ``/workers`` stay open to the cluster); the key is never logged."""
        if self.api_keys is None or not request.path.startswith("/v1/"):
            return await handler(request)
        token = bearer_token(request.headers)
        if token is None or not self.api_keys.accepts(token):
            self._count_error(request, 401)
            why = "no API key" if token is None else "an invalid API key"
            response = error_response(401, f"{why}: send Authorization: Bearer <key>")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return await handler(request)

    def _count_error(self, request: web.Request, status: int) -> None:
        if request.path in GENERATE_PATHS:
            self.metrics.requests.labels(status=str(status)).inc()

    async def _on_startup(self, _: web.Application) -> None:
        await self.start()
        self.add_task(asyncio.create_task(self._silence_watchdog(), name="silence-watchdog"))

    async def _on_cleanup(self, _: web.Application) -> None:
        await self.stop()

    # -- attempts -----------------------------------------------------------------------------

    def _abandon_worker(self, worker_id: str) -> None:
        """Give up on everything in flight on a dropped worker (its streams migrate)."""
        for attempt in list(self._attempts):
            if worker_id in attempt.workers:
                attempt.abandon(MigrationReason.WORKER_LOST, worker_id=worker_id)

    async def _silence_watchdog(self) -> None:
        """Abandon streams silent for longer than ``token_timeout_s`` after their first token (an
        engine stuck on them while its health probe still passes)."""
        limit = self.config.token_timeout_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            now = self.now()
            for attempt in list(self._attempts):
                if attempt.silent_since is not None and now - attempt.silent_since > limit:
                    attempt.abandon(MigrationReason.TIMEOUT, worker_id=attempt.workers[0])

    async def _abandonable(self, attempt: _Attempt, awaitable: Awaitable[_T]) -> _T:
        """Await ``awaitable`` unless ``attempt`` is abandoned first (then :class:`_AttemptFailed`)."""
        pending = asyncio.ensure_future(awaitable)
        attempt.pending = pending
        try:
            return await pending
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if attempt.abandoned is None or (task is not None and task.cancelling()):
                raise
            raise _AttemptFailed(
                f"gave up on worker {attempt.culprit} ({attempt.abandoned.value})",
                worker_id=attempt.culprit,
                reason=attempt.abandoned,
            ) from None
        finally:
            attempt.pending = None

    # -- HTTP ---------------------------------------------------------------------------------

    async def _completions(self, http: web.Request) -> web.StreamResponse:
        return await self._counted(http, CompletionRequest, "/v1/completions")

    async def _chat(self, http: web.Request) -> web.StreamResponse:
        return await self._counted(http, ChatCompletionRequest, "/v1/chat/completions")

    async def _counted(
        self,
        http: web.Request,
        model: type[CompletionRequest] | type[ChatCompletionRequest],
        path: str,
    ) -> web.StreamResponse:
        """Admit a request under its client's bounds (:mod:`copse.router.clients`), read its body
        within ``clients.body_timeout_s`` and serve it."""
        key = client_key(http.headers, peer=http.remote)
        announced = http.content_length
        if announced is not None and announced > self.config.max_body_bytes:  # refused unread
            raise web.HTTPRequestEntityTooLarge(max_size=self.config.max_body_bytes, actual_size=announced)
        held = self.config.max_body_bytes if announced is None else min(announced, self.config.max_body_bytes)
        try:
            self.clients.enter(key, body_bytes=held)
        except Refused as exc:
            self.metrics.requests.labels(status="429").inc()
            return error_response(429, str(exc))
        self.in_flight += 1
        try:
            arrived = self.now()
            try:
                raw = await asyncio.wait_for(http.read(), self.config.clients.body_timeout_s)
            except ConnectionError:  # the client went away mid-body: nobody to answer
                response = error_response(400, "connection lost while reading the request body")
                response.force_close()
                return response
            except TimeoutError:
                self.metrics.requests.labels(status="408").inc()
                limit = self.config.clients.body_timeout_s
                response = error_response(
                    408, f"request body not received within {limit:g} s (clients.body_timeout_s)"
                )
                response.force_close()
                return response
            self.clients.resize(reserved=held, actual=len(raw))
            held = len(raw)
            return await self._generate(http, model, path, raw=raw, key=key, arrived=arrived)
        finally:
            self.in_flight -= 1
            self.clients.leave(key, body_bytes=held)

    async def _generate(
        self,
        http: web.Request,
        model: type[CompletionRequest] | type[ChatCompletionRequest],
        path: str,
        *,
        raw: bytes,
        key: str,
        arrived: float,
    ) -> web.StreamResponse:
        try:
            prepared = await self.prepare(
                model, raw, {name.lower(): value for name, value in http.headers.items()}
            )
        except Rejected as exc:
            self.metrics.requests.labels(status=str(exc.status)).inc()
            return error_response(exc.status, exc.message, param=exc.param)
        if not prepared.request.stream:
            return await self._serve(http, prepared, path=path, raw=raw, arrived=arrived, model=model)
        try:
            self.clients.open_stream(key)
        except Refused as exc:
            self.metrics.requests.labels(status="429").inc()
            return error_response(429, str(exc))
        try:
            return await self._serve(http, prepared, path=path, raw=raw, arrived=arrived, model=model)
        finally:
            self.clients.close_stream(key)

    async def _serve(
        self,
        http: web.Request,
        prepared: Prepared,
        *,
        path: str,
        raw: bytes,
        arrived: float,
        model: type[CompletionRequest] | type[ChatCompletionRequest],
    ) -> web.StreamResponse:
        """Route a prepared request and answer it, retrying and migrating across workers."""
        request, route_request = prepared.request, prepared.route
        original = prepared.body
        payload, engine_path, relay = original, path, self._token_relay(prepared, original)
        if relay is not None:
            payload, engine_path = relay.body, ENGINE_PATH
        stream = None
        if request.stream:
            progress = StreamProgress(prompt=prepared.tokens, requested=request.requested_tokens())
            stream = _ClientStream(
                progress=progress,
                arrived=arrived,
                request=route_request,
                relay=relay,
                write_timeout_s=self.config.clients.write_timeout_s,
            )
        exclude: set[str] = set()
        retries = 0
        while True:
            try:
                # exclude holds the workers that failed the request: it is re-routed once it has one
                route = await self._route(route_request, frozenset(exclude), retry=bool(exclude))
            except (Unavailable, Overloaded) as exc:
                if stream is not None and stream.client is not None:
                    return await self._end_stream(
                        stream, f"no worker can continue the stream: {exc}", why="unavailable"
                    )
                if not (isinstance(exc, Overloaded) and exc.rate_limited):
                    self.metrics.missed(SLO_REFUSED)
                if isinstance(exc, Overloaded):
                    self.metrics.requests.labels(status="429").inc()
                    return error_response(429, str(exc), retry_after=exc.retry_after)
                self.metrics.requests.labels(status="503").inc()
                return error_response(503, str(exc))
            try:
                response = await self._forward(
                    http,
                    route,
                    payload,
                    path=engine_path,
                    stream=stream,
                    raw=raw if payload is original and not prepared.rewritten else None,
                )
            except _ClientGone as exc:
                self._finish(route.request_id)
                log.info("stream %s: client gone (%s); its worker request is aborted", route.request_id, exc)
                self.metrics.failed_streams.labels(reason="client_gone").inc()
                assert stream is not None
                assert stream.client is not None
                return stream.client
            except _Refused as exc:
                self._finish(route.request_id)
                assert stream is not None
                await stream.seal()
                return await self._end_stream(stream, str(exc), why="refused")
            except _AttemptFailed as exc:
                self._finish(route.request_id)
                exclude.add(exc.worker_id)
                if stream is None or stream.client is None:
                    log.warning(
                        "request %s failed on %s before its first token: %s",
                        route.request_id,
                        route.worker_id,
                        exc,
                    )
                    if retries == self.config.max_retries:
                        self.metrics.missed(SLO_REFUSED)
                        self.metrics.requests.labels(status="503").inc()
                        attempts = retries + 1
                        return error_response(
                            503, f"no worker could serve the request after {attempts} attempts: {exc}"
                        )
                    retries += 1
                    self.metrics.retries.inc()
                    continue
                progress = stream.progress
                await stream.seal()
                if not progress.resumable:
                    if progress.finished or progress.remaining <= 0:
                        return await self._complete_stream(stream)  # only the end was lost
                    return await self._end_stream(
                        stream,
                        f"the worker serving this stream failed ({exc}) and it cannot be continued elsewhere:"
                        " the worker streams no token ids",
                        why="untracked",
                    )
                if progress.migrations >= self.config.migration_limit:
                    return await self._end_stream(
                        stream,
                        f"the worker serving this stream failed ({exc}) after {progress.migrations}"
                        f" migrations (migration_limit {self.config.migration_limit})",
                        why="limit",
                    )
                log.warning(
                    "stream %s broke on %s after %d tokens (%s: %s); continuing it on another worker",
                    route.request_id,
                    route.worker_id,
                    len(progress.output),
                    exc.reason.value,
                    exc,
                )
                self.metrics.migrations.labels(reason=exc.reason.value).inc()
                progress.start_attempt()
                if relay is None:
                    payload = progress.continuation(original, chat=model is ChatCompletionRequest)
                else:
                    payload = progress.continuation(relay.body, chat=False)
                route_request = self.route_request(
                    route_request.request_id,
                    progress.continued_prompt,
                    max_tokens=progress.remaining,
                    resolved=prepared.resolved,
                )
                continue
            except BaseException:
                self._finish(route.request_id)
                raise
            self._finish(route.request_id)
            self.metrics.requests.labels(status=str(response.status)).inc()
            self.metrics.duration.observe(self.now() - arrived)
            if stream is None and response.status == 200:  # not streamed: the answer is its first token
                self.metrics.judged(ttft_s=self.now() - arrived, itl_s=None)
            return response

    def _token_relay(self, prepared: Prepared, payload: dict[str, Any]) -> TokenRelay | None:
        """How a stream to ``trtllm-serve`` is made migratable: in token ids, decoded here
        (:mod:`copse.router.token_streams`); ``None`` for anything passed as it is."""
        if self.config.engine != "trtllm" or not relayable(prepared.request):
            return None
        assert isinstance(self.tokenizer, HfPromptTokenizer)  # engine: trtllm loads one
        return TokenRelay(
            request=prepared.request, payload=payload, tokens=prepared.tokens, tokenizer=self.tokenizer
        )

    async def _end_stream(self, stream: _ClientStream, message: str, *, why: str) -> web.StreamResponse:
        """End a stream the client receives with an error event (its worker failed for good)."""
        assert stream.client is not None
        log.warning("stream ended with an error: %s", message)
        self.metrics.failed_streams.labels(reason=why).inc()
        self.metrics.missed(SLO_FAILED)
        await stream.write(error_event(502, message))
        return await self._close_stream(stream)

    async def _complete_stream(self, stream: _ClientStream) -> web.StreamResponse:
        """End a stream whose output is complete but whose worker failed before ``[DONE]``."""
        await stream.write(b"data: [DONE]\n\n")
        return await self._close_stream(stream)

    async def _close_stream(self, stream: _ClientStream) -> web.StreamResponse:
        assert stream.client is not None
        await stream.end()
        self.metrics.requests.labels(status=str(stream.client.status)).inc()
        self.metrics.duration.observe(self.now() - stream.arrived)
        return stream.client

    async def _prefill_remotely(
        self, route: Route, payload: dict[str, Any], path: str, attempt: _Attempt
    ) -> dict[str, Any]:
        """Run the context phase on the prefill worker; returns its ``disaggregated_params``."""
        assert route.prefill_worker_id is not None
        url = self._urls.get(route.prefill_worker_id)
        if url is None:
            raise _AttemptFailed(
                f"prefill worker {route.prefill_worker_id} is gone", worker_id=route.prefill_worker_id
            )
        dropped = ("stream", "stream_options", "max_completion_tokens")
        context = {key: value for key, value in payload.items() if key not in dropped}
        context["max_tokens"] = 1
        context["disaggregated_params"] = {"request_type": "context_only"}

        async def call() -> tuple[int, Any]:
            async with self.session.post(f"{url}{path}", json=context) as response:
                if response.status >= 500:
                    return response.status, None
                return response.status, await response.json()

        try:
            status, body = await self._abandonable(attempt, call())
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
            self._drop_worker_id(route.prefill_worker_id, reason=f"request failed: {exc}")
            raise _AttemptFailed(
                f"prefill worker {route.prefill_worker_id}: {exc}", worker_id=route.prefill_worker_id
            ) from exc
        if status >= 500:
            raise _AttemptFailed(f"prefill worker answered {status}", worker_id=route.prefill_worker_id)
        choices = body.get("choices") if isinstance(body, dict) else None
        params = choices[0].get("disaggregated_params") if choices else None
        if not isinstance(params, dict):
            raise _AttemptFailed(
                f"prefill worker {route.prefill_worker_id} returned no disaggregated_params",
                worker_id=route.prefill_worker_id,
            )
        return {**params, "request_type": "generation_only"}

    async def _forward(
        self,
        http: web.Request,
        route: Route,
        payload: dict[str, Any],
        *,
        path: str,
        stream: _ClientStream | None,
        raw: bytes | None = None,
    ) -> web.StreamResponse:
        """Send ``payload`` to the route's worker(s) and relay the answer; ``raw``: ``payload``'s
        bytes as the client sent them, forwarded as they are when the worker gets it unchanged
        (a long prompt is not encoded again)."""
        url = self._urls.get(route.worker_id)
        if url is None:
            raise _AttemptFailed(f"worker {route.worker_id} is gone", worker_id=route.worker_id)
        workers = (
            (route.worker_id,)
            if route.prefill_worker_id is None
            else (route.worker_id, route.prefill_worker_id)
        )
        attempt = _Attempt(workers)
        self._attempts.add(attempt)
        upstream = None
        sent: bytes | None = None
        try:
            if route.prefill_worker_id is not None:
                pair = (self._revision(route.prefill_worker_id), self._revision(route.worker_id))
                self.metrics.disaggregated_routes.labels(*pair).inc()
                log.debug(
                    "request %s: prefill on %s (revision %s), decode on %s (revision %s)",
                    route.request_id, route.prefill_worker_id, pair[0], route.worker_id, pair[1],
                )  # fmt: skip
                params = await self._prefill_remotely(route, payload, path, attempt)
                payload = {**payload, "disaggregated_params": params}
            elif self._role(route.worker_id) is Role.DECODE:
                # A whole request on a decode worker (short prompt, or no prefill worker): trtllm-serve's
                # conditional disaggregation marks it so.
                payload = {**payload, "disaggregated_params": {"request_type": "context_and_generation"}}
            else:
                sent = raw
            post = (
                self.session.post(f"{url}{path}", json=payload)
                if sent is None
                else self.session.post(f"{url}{path}", data=sent, headers=_JSON_HEADERS)
            )
            upstream = await self._abandonable(attempt, post)
            attempt.upstream = upstream
            if attempt.abandoned is not None:
                raise _Abandoned(attempt.abandoned.value)
            if upstream.status >= 500:
                raise _AttemptFailed(
                    f"worker answered {upstream.status}: {(await upstream.text())[:200]}",
                    worker_id=route.worker_id,
                )
            if upstream.status != 200 and stream is not None and stream.client is not None:
                raise _Refused(
                    f"worker {route.worker_id} refused the continuation: {(await upstream.text())[:300]}"
                )
            if upstream.status != 200 or stream is None:
                body = await upstream.read()
                if upstream.status == 200:
                    self._first_token(route.request_id)
                    self._count_output(usage_tokens(_json_or_none(body)) or 0)
                else:
                    body = as_openai_error(body, status=upstream.status)
                return web.Response(
                    body=body,
                    status=upstream.status,
                    content_type=upstream.content_type or "application/json",
                )
            return await self._relay_stream(http, route, upstream, stream=stream, attempt=attempt)
        except _Abandoned as exc:
            reason = attempt.abandoned or MigrationReason.WORKER_LOST
            culprit = attempt.culprit or route.worker_id
            raise _AttemptFailed(f"worker {culprit}: {exc}", worker_id=culprit, reason=reason) from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            self._drop_worker_id(route.worker_id, reason=f"request failed: {exc}")
            raise _AttemptFailed(f"worker {route.worker_id}: {exc!r}", worker_id=route.worker_id) from exc
        finally:
            self._attempts.discard(attempt)
            if upstream is not None:
                if attempt.abandoned is not None or not upstream.content.is_eof():
                    upstream.close()  # trtllm-serve and the mocked engines abort the request
                else:
                    upstream.release()

    async def _relay_stream(
        self,
        http: web.Request,
        route: Route,
        upstream: aiohttp.ClientResponse,
        *,
        stream: _ClientStream,
        attempt: _Attempt,
    ) -> web.StreamResponse:
        """Relay an SSE stream. Nothing is sent to the client before the first token arrives; a
        continuation's chunks are rewritten to continue the client's stream."""
        progress, translator = stream.progress, stream.relay
        resumed = stream.client is not None
        meter = StreamMeter(ids=progress.output)
        held: list[bytes] = []
        out: list[bytes] = []
        partial = b""
        ended = False
        """The router ended the stream itself (a stop string the engine did not stop on)."""

        async def relay(lines: list[bytes]) -> None:
            """Account and pass on complete lines; what reaches the client goes in one write, also
            when a line ends the attempt (the client must get every token accounted before it)."""
            nonlocal ended
            try:
                for line in lines:
                    if ended:
                        break
                    if not line.startswith(b"data:"):
                        if translator is None:  # a translated stream is written as whole events
                            (out if stream.client is not None else held).append(line)
                        continue
                    event, first = meter.feed(line[5:].strip(), now=self.now())
                    if isinstance(event, dict) and "error" in event:
                        raise _AttemptFailed(
                            f"worker stream error: {event['error']}",
                            worker_id=route.worker_id,
                            reason=MigrationReason.WORKER_ERROR,
                        )
                    if meter.events:
                        attempt.silent_since = self.heard[route.worker_id] = meter.last_at
                    events: list[Any] = [event]
                    if translator is not None and isinstance(event, dict):
                        events, ended = translator.translate(event, progress=progress)
                    if first:
                        self._first_token(route.request_id)
                        if stream.client is None:
                            assert isinstance(events[0], dict)
                            progress.note_first(events[0])
                            stream.first_at = meter.first_at
                            self.metrics.first_token(stream.request, meter.first_at - stream.arrived)
                            await stream.open(http, held)
                    lines_out = self._client_lines(
                        events, line, resumed=resumed, progress=progress, relay=translator
                    )
                    if ended:
                        meter.finished = meter.done = True
                        lines_out.append(b"data: [DONE]\n\n")
                    (out if stream.client is not None else held).extend(lines_out)
            finally:
                if out and stream.client is not None:
                    await stream.write_lines(out)
                out.clear()

        try:
            # Whatever the worker sent since the last read, split into lines (a worker behind on
            # its writes, or a router behind on its reads, batches several events).
            async for chunk in upstream.content.iter_any():
                lines = (partial + chunk).split(b"\n")
                partial = lines.pop()
                await relay([line + b"\n" for line in lines])
                if ended:
                    upstream.close()  # trtllm-serve aborts a request whose client went away
                    break
            if partial and not ended:
                await relay([partial])
        except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError, _Abandoned) as exc:
            if not meter.done:
                reason = attempt.abandoned or (
                    MigrationReason.TIMEOUT if isinstance(exc, TimeoutError) else MigrationReason.DISCONNECTED
                )
                if stream.client is None and attempt.abandoned is None:
                    self._drop_worker_id(route.worker_id, reason=f"stream failed: {exc}")
                else:
                    self._probe_wake.set()  # probe the worker now rather than at the next period
                culprit = attempt.culprit or route.worker_id
                raise _AttemptFailed(
                    f"worker {culprit} stream broke: {exc!r}", worker_id=culprit, reason=reason
                ) from exc
            # The break came after [DONE], which the client has: nothing is lost, nothing is
            # continued (a continuation would end the stream with a second [DONE]).
            log.debug("stream %s: worker %s broke after [DONE]: %r", route.request_id, route.worker_id, exc)
            self._probe_wake.set()
        finally:
            self._count_output(meter.output_tokens)
            stream.absorb(meter)
        if not meter.events:
            raise _AttemptFailed(
                f"worker {route.worker_id} ended the stream before any token",
                worker_id=route.worker_id,
                reason=MigrationReason.ENDED_EARLY,
            )
        if not meter.done:
            if not progress.finished:
                raise _AttemptFailed(
                    f"worker {route.worker_id} ended the stream unfinished",
                    worker_id=route.worker_id,
                    reason=MigrationReason.ENDED_EARLY,
                )
            await stream.seal()
            await stream.write(b"data: [DONE]\n\n")
        itl = (stream.last_at - stream.first_at) / (stream.events - 1) if stream.events > 1 else None
        if itl is not None:
            self.metrics.inter_token(stream.request, itl)
        self.metrics.judged(ttft_s=stream.first_at - stream.arrived, itl_s=itl)
        assert stream.client is not None
        await stream.end()
        return stream.client

    @staticmethod
    def _client_lines(
        events: list[Any], line: bytes, *, resumed: bool, progress: StreamProgress, relay: TokenRelay | None
    ) -> list[bytes]:
        """The SSE lines the client gets for one worker event (``line``, translated by the relay
        into ``events``); a continuation's chunks are rewritten to continue the client's stream."""
        if relay is None and not (resumed and isinstance(events[0], dict)):
            return [line]
        lines = []
        for event in events:
            if event is None:
                lines.append(b"data: [DONE]\n\n")
                continue
            rewritten = progress.rewrite(event) if resumed and isinstance(event, dict) else event
            if rewritten is not None:
                data = json.dumps(rewritten, separators=(",", ":"), ensure_ascii=False).encode()
                lines.append(b"data: " + data + (b"\n" if relay is None else b"\n\n"))
        return lines

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response(self.catalog.listing())

    async def _health(self, _: web.Request) -> web.Response:
        status, body = self.health()
        return web.json_response(body, status=status)

    async def _workers(self, _: web.Request) -> web.Response:
        return web.json_response({"workers": self.workers_report()})

    async def _ready(self, _: web.Request) -> web.Response:
        ready, waiting = self.readiness()
        if ready:
            return web.json_response({"ready": True})
        return web.json_response({"ready": False, "waiting_for": waiting}, status=503)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics_text(), headers={"Content-Type": CONTENT_TYPE_LATEST})
