"""The HTTP surface of ``trtllm-serve`` in front of mocked engines, many engines per process.

Per engine (one port each):

=============================  ================================================================
``POST /v1/completions``       OpenAI completions; ``prompt`` as text or token ids; SSE with ``stream``
``POST /v1/chat/completions``  OpenAI chat completions (mock chat template and tokenizer, or token ids)
``GET /v1/models``             the served model name and its LoRA adapters
``GET /health``                200 when the engine loop runs
``GET /prometheus/metrics``    Prometheus: TensorRT-LLM's names, types, labels and buckets
``GET /metrics``               JSON iteration stats since the last call (drained), as TensorRT-LLM
``POST /kv_cache_events``      drains TensorRT-LLM-format KV events (each returned once)
``GET /kv_dump``               copse :class:`~copse.workers.protocol.kv_events.KvDump` (resync)
``GET /worker_info``           worker id, model, role, block size, limits and the LoRA adapters held
``POST /reset_prefix_cache``   drop the cache (emits ``cleared``); 409 while requests hold blocks
=============================  ================================================================

Errors, in the one error shape (:mod:`copse.workers.protocol.errors`): 400 naming the field or the
limit (:mod:`copse.workers.protocol.limits`); 413 for a body over 64 MiB;
503 with ``Retry-After`` when the engine's queue is full. A client that disconnects (or stops
reading a stream) has its request aborted and its blocks freed.

LoRA adapters: a request is served through an adapter named in its ``lora_request`` (what
``trtllm-serve`` reads), or through the adapter its ``model`` names when that is one of the
engine's listed adapters (``--lora``); any other ``model`` is served by the base model, as
``trtllm-serve`` does (it does not check ``model``). An adapter the engine does not hold is loaded
first (:mod:`copse.workers.mocker.adapters`).

Streamed chunks carry their output ``token_ids``, in completions as ``trtllm-serve`` does with
``detokenize: false`` (whose text is then empty) and, unlike ``trtllm-serve``, with text and in chat
too (what the router needs to migrate a stream of a mocked engine; see :mod:`copse.router.migration`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from copse.workers.mocker.clock import Clock, RealClock, VirtualClock
from copse.workers.mocker.config import EngineConfig
from copse.workers.mocker.engine import Engine, EngineOverloaded, Request, RequestRejected, StepOutput
from copse.workers.mocker.telemetry import EngineMetrics, iteration_stats
from copse.workers.nats_io import KvEventPublisher
from copse.workers.perf import PerfModel
from copse.workers.protocol.openai_api import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DisaggregatedParams,
    PromptTokensDetails,
    RequestError,
    TokenIds,
    UsageInfo,
    new_chat_id,
    new_completion_id,
    parse_request,
)
from copse.workers.protocol.tokenizer import chat_tokens, encode, token_text
from copse.workers.serving import DEFAULT_MAX_BODY_BYTES, error_response, openai_errors

log = logging.getLogger(__name__)

TRTLLM_EVENT_BUFFER = 1024
"""Events kept for ``POST /kv_cache_events`` (TensorRT-LLM's ``event_buffer_max_size`` as Dynamo sets it)."""
ITERATION_STATS_KEPT = 1000
"""Iteration stats kept between two ``GET /metrics`` (TensorRT-LLM keeps a bounded queue too)."""
RETRY_AFTER_S = 1
"""``Retry-After`` of a 503: one second, about the time a full batch takes to turn over."""


_Parsed = TypeVar("_Parsed", CompletionRequest, ChatCompletionRequest)

INLINE_BODY_BYTES = 64 * 1024
"""Request bodies up to this size are parsed and tokenized on the event loop; larger ones on a
thread, so that a multi-megabyte prompt does not stall the engine's steps and its ``/health``
(whose probes time out while the loop is stuck, and the router then drops the engine)."""


def _completion_prompt(raw: bytes) -> tuple[CompletionRequest, TokenIds]:
    body = parse_request(CompletionRequest, raw)
    return body, tuple(encode(body.prompt)) if isinstance(body.prompt, str) else body.prompt


def _chat_prompt(raw: bytes) -> tuple[ChatCompletionRequest, TokenIds]:
    body = parse_request(ChatCompletionRequest, raw)
    if body.prompt_token_ids is not None:
        return body, body.prompt_token_ids
    return body, tuple(chat_tokens(body.turns(), add_generation_prompt=body.add_generation_prompt))


async def _off_loop_if_large(
    parse: Callable[[bytes], tuple[_Parsed, TokenIds]], raw: bytes
) -> tuple[_Parsed, TokenIds]:
    """``parse(raw)``, on a thread when ``raw`` is over :data:`INLINE_BODY_BYTES`."""
    if len(raw) <= INLINE_BODY_BYTES:
        return parse(raw)
    return await asyncio.to_thread(parse, raw)


def _error(
    status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return error_response(status, message, param=param, headers=headers)


def _json(model: BaseModel) -> web.Response:
    return web.json_response(text=model.model_dump_json(exclude_none=True))


@dataclass(eq=False)
class _Stream:
    """A request being served over HTTP: what has been sent, and a wake-up for the handler."""

    request: Request
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    sent: int = 0
    last_ms: float | None = None


class EngineServer:
    """One mocked engine, its step loop and its HTTP application."""

    def __init__(
        self,
        *,
        engine: Engine,
        model_name: str,
        clock: Clock,
        publisher: KvEventPublisher | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        loras: tuple[str, ...] = (),
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.loras = frozenset(loras)
        """The LoRA adapters the engine lists and resolves from ``model``."""
        self._lora_order = loras
        self.url = ""
        """Base URL once listening."""
        self.clock = clock
        self.publisher = publisher
        self.metrics = EngineMetrics(engine, model_name=model_name)
        self._iterations: deque[dict[str, Any]] = deque(maxlen=ITERATION_STATS_KEPT)
        self._iteration = 0
        self._streams: dict[str, _Stream] = {}
        self._work = asyncio.Event()
        self._ids = itertools.count(1)
        self._loop_task: asyncio.Task[None] | None = None
        # trtllm-serve (uvicorn) has no body limit; a mocked engine keeps the router's, so that no
        # client-chosen size makes it allocate without bound.
        self.app = web.Application(
            client_max_size=max_body_bytes, middlewares=[openai_errors(max_body_bytes=max_body_bytes)]
        )
        self.app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/metrics", self._iteration_stats),
                web.get("/prometheus/metrics", self._metrics),
                web.post("/kv_cache_events", self._kv_cache_events),
                web.get("/kv_dump", self._kv_dump),
                web.get("/worker_info", self._worker_info),
                web.post("/reset_prefix_cache", self._reset_prefix_cache),
            ]
        )

    # engine loop ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step loop (idempotent)."""
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name=f"engine-{self.engine.worker_id}")

    async def stop(self) -> None:
        """Stop the step loop and abort whatever is in flight."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        for stream in self._streams.values():
            stream.wake.set()

    async def _run(self) -> None:
        """Step the engine on its own timeline: a step starts when the previous one ended (on an idle
        engine, when work came), not when this process got round to it. The time the host takes
        between steps (the other engines of the process, HTTP, a loaded machine) then delays the
        tokens' delivery but does not slow the engine down: a step whose end has already passed runs
        at once, and the loop catches up. (Starting each step at the wall clock instead made every
        step as much longer as the process was late: on a busy 2-core box, engines ran at half the
        speed their perf model gives, and routing was judged against engines it could not predict.)"""
        engine = self.engine
        clock = self.clock
        while True:
            await self._work.wait()
            self._work.clear()
            at = clock.now_ms()
            if engine.waiting:  # an idle engine starts on a request when it arrived
                at = min(at, engine.waiting[0].arrival_ms)
            while engine.has_work():
                end = engine.begin_step(at)
                if end is None:
                    wake = engine.next_wake_ms()
                    if wake is None:
                        break
                    await self._sleep_until_or_work(wake)
                    # new work (arriving now) or the wake-up time, whichever came first
                    at = max(at, min(wake, clock.now_ms()))
                    continue
                await clock.sleep_until(end)
                self._deliver(engine.end_step())
                await self._publish()
                at = end
            await self._publish()

    async def _sleep_until_or_work(self, t_ms: float) -> None:
        if isinstance(self.clock, VirtualClock):
            await self.clock.sleep_until(t_ms)
            return
        self._work.clear()
        # (asyncio.timeout, not wait_for: in Python 3.11 wait_for returns when work and the
        # cancellation at stop() arrive together, and the step loop then never ends)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, (t_ms - self.clock.now_ms()) / 1000.0)):
                await self._work.wait()

    def _deliver(self, output: StepOutput) -> None:
        metrics = self.metrics
        self._iteration += 1
        self._iterations.append(iteration_stats(self.engine, output, iteration=self._iteration))
        metrics.step_lag.observe(max(0.0, self.clock.now_ms() - output.end_ms) / 1000.0)
        for request in output.advanced:
            stream = self._streams.get(request.request_id)
            if stream is None:
                continue
            if stream.last_ms is None:
                metrics.first_token(request)
            else:
                metrics.next_token(output.end_ms - stream.last_ms)
            stream.last_ms = output.end_ms
            stream.wake.set()
        for request in output.finished:
            metrics.finished(request)

    async def _publish(self) -> None:
        events = self.engine.drain_kv_events()
        if self.publisher is not None and events:
            await self.publisher.publish(
                worker_id=self.engine.worker_id, epoch=self.engine.epoch, events=events
            )

    # serving ----------------------------------------------------------------------------------

    def _admit(self, tokens: Sequence[int], body: CompletionRequest | ChatCompletionRequest) -> Request:
        """Add a request to the engine per its role; raises RequestError/RequestRejected/EngineOverloaded."""
        role = self.engine.config.role
        params = body.disaggregated_params
        kind = params.request_type if params is not None else "context_and_generation"
        if role == "prefill" and kind != "context_only":
            raise RequestError(
                "this is a context (prefill) engine: send disaggregated_params.request_type='context_only'",
                param="disaggregated_params",
            )
        if role == "decode" and kind == "context_only":
            # A generation engine also serves whole requests (TensorRT-LLM's conditional
            # disaggregation: short prompts are cheaper to prefill here than to transfer).
            raise RequestError(
                "this is a generation (decode) engine: send disaggregated_params.request_type="
                "'generation_only', or no disaggregated_params for a whole request",
                param="disaggregated_params",
            )
        first_token: int | None = None
        if kind == "generation_only":
            assert params is not None
            if not params.first_gen_tokens:
                raise RequestError(
                    "generation_only requests need the context engine's first_gen_tokens",
                    param="disaggregated_params.first_gen_tokens",
                )
            first_token = params.first_gen_tokens[0]
        max_tokens = 1 if kind == "context_only" else body.requested_tokens()
        request_id = f"{self.engine.worker_id}-{next(self._ids)}"
        lora = body.lora_request
        adapter = lora.lora_name if lora is not None else body.model if body.model in self.loras else None
        return self.engine.add_request(
            request_id=request_id,
            tokens=tokens,
            max_tokens=max_tokens,
            now_ms=self.clock.now_ms(),
            transferred_first_token=first_token,
            adapter=adapter,
            lora_id=None if lora is None else lora.lora_int_id,
        )

    def _context_params(self, request: Request) -> DisaggregatedParams:
        state = {"worker_id": self.engine.worker_id, "prompt_tokens": request.prompt_len}
        return DisaggregatedParams(
            request_type="context_only",
            first_gen_tokens=tuple(request.output[:1]),
            ctx_request_id=int(request.request_id.rsplit("-", 1)[1]),
            encoded_opaque_state=base64.b64encode(json.dumps(state).encode()).decode(),
        )

    async def _tokens(self, stream: _Stream) -> AsyncIterator[list[int]]:
        """New output tokens of a request as they come out, until it finishes."""
        request = stream.request
        while True:
            new = request.output[stream.sent : request.num_output]
            if new:
                stream.sent += len(new)
                yield new
                continue  # steps that ended while the chunk was written may have added (the last) tokens
            if request.state == "finished":
                return
            if request.state == "aborted":
                raise web.HTTPServiceUnavailable(text="engine stopped")
            await stream.wake.wait()
            stream.wake.clear()

    async def _serve(
        self, http: web.Request, body: CompletionRequest | ChatCompletionRequest, tokens: TokenIds
    ) -> web.StreamResponse:
        try:
            request = self._admit(tokens, body)
        except RequestError as exc:
            return _error(400, exc.message, param=exc.param)
        except RequestRejected as exc:
            return _error(400, str(exc), param=exc.param)
        except EngineOverloaded as exc:
            return _error(503, str(exc), headers={"Retry-After": str(RETRY_AFTER_S)})
        stream = _Stream(request)
        self._streams[request.request_id] = stream
        self._work.set()
        try:
            if body.stream:
                return await self._stream_response(http, body, stream)
            return await self._full_response(body, stream)
        finally:
            del self._streams[request.request_id]
            if request.state != "finished" and self.engine.abort_request(request.request_id):
                log.info("request %s aborted (client gone)", request.request_id)
                self._work.set()

    def _usage(self, request: Request) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=request.prompt_len,
            completion_tokens=request.num_output,
            total_tokens=request.prompt_len + request.num_output,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=max(request.cached_tokens, 0)),
        )

    async def _full_response(
        self, body: CompletionRequest | ChatCompletionRequest, stream: _Stream
    ) -> web.Response:
        async for _ in self._tokens(stream):
            pass
        request = stream.request
        text = "".join(token_text(t) for t in request.output)
        params = self._context_params(request) if self._is_context_only(body) else None
        if isinstance(body, CompletionRequest):
            return _json(
                CompletionResponse(
                    model=self.model_name,
                    choices=[
                        CompletionChoice(
                            text=text if body.detokenize else "",
                            token_ids=list(request.output),
                            finish_reason="length",
                            disaggregated_params=params,
                        )
                    ],
                    usage=self._usage(request),
                    prompt_token_ids=[int(t) for t in request.tokens] if params is not None else None,
                )
            )
        return _json(
            ChatCompletionResponse(
                model=self.model_name,
                choices=[
                    ChatChoice(
                        message=AssistantMessage(content=text),
                        finish_reason="length",
                        disaggregated_params=params,
                    )
                ],
                usage=self._usage(request),
                prompt_token_ids=[int(t) for t in request.tokens] if params is not None else None,
            )
        )

    @staticmethod
    def _is_context_only(body: CompletionRequest | ChatCompletionRequest) -> bool:
        return (
            body.disaggregated_params is not None and body.disaggregated_params.request_type == "context_only"
        )

    async def _stream_response(
        self, http: web.Request, body: CompletionRequest | ChatCompletionRequest, stream: _Stream
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(http)
        request = stream.request
        options = body.stream_options
        every_chunk_usage = options is not None and options.continuous_usage_stats
        chat = isinstance(body, ChatCompletionRequest)
        detokenize = isinstance(body, ChatCompletionRequest) or body.detokenize
        response_id = new_chat_id() if chat else new_completion_id()
        created = int(time.time())

        async def send(model: BaseModel) -> None:
            await response.write(f"data: {model.model_dump_json(exclude_none=True)}\n\n".encode())

        if chat:
            await send(
                ChatCompletionStreamResponse(
                    id=response_id,
                    created=created,
                    model=self.model_name,
                    choices=[ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""))],
                )
            )
        async for new in self._tokens(stream):
            done = request.state == "finished" and stream.sent == request.num_output
            reason = "length" if done else None
            usage = self._usage(request) if every_chunk_usage else None
            text = "".join(token_text(t) for t in new)
            if chat:
                await send(
                    ChatCompletionStreamResponse(
                        id=response_id,
                        created=created,
                        model=self.model_name,
                        choices=[
                            ChatStreamChoice(
                                delta=DeltaMessage(content=text), token_ids=new, finish_reason=reason
                            )
                        ],
                        usage=usage,
                    )
                )
            else:
                await send(
                    CompletionStreamResponse(
                        id=response_id,
                        created=created,
                        model=self.model_name,
                        choices=[
                            CompletionStreamChoice(
                                text=text if detokenize else "", token_ids=new, finish_reason=reason
                            )
                        ],
                        usage=usage,
                    )
                )
        if options is not None and options.include_usage:
            final: BaseModel
            if chat:
                final = ChatCompletionStreamResponse(
                    id=response_id,
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=self._usage(request),
                )
            else:
                final = CompletionStreamResponse(
                    id=response_id,
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=self._usage(request),
                )
            await send(final)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _completions(self, http: web.Request) -> web.StreamResponse:
        try:
            body, tokens = await _off_loop_if_large(_completion_prompt, await http.read())
        except RequestError as exc:
            return _error(400, exc.message, param=exc.param)
        if not tokens:
            return _error(400, "prompt holds no tokens", param="prompt")
        return await self._serve(http, body, tokens)

    async def _chat(self, http: web.Request) -> web.StreamResponse:
        try:
            body, tokens = await _off_loop_if_large(_chat_prompt, await http.read())
        except RequestError as exc:
            return _error(400, exc.message, param=exc.param)
        return await self._serve(http, body, tokens)

    # housekeeping -----------------------------------------------------------------------------

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": self.model_name, "object": "model", "owned_by": "copse-mocker"},
                    *(
                        {"id": name, "object": "model", "owned_by": "copse-mocker", "parent": self.model_name}
                        for name in self._lora_order
                    ),
                ],
            }
        )

    async def _health(self, _: web.Request) -> web.Response:
        if self._loop_task is None or self._loop_task.done():
            return web.Response(status=503, text="engine loop not running")
        return web.Response(status=200)

    async def _iteration_stats(self, _: web.Request) -> web.Response:
        stats = list(self._iterations)
        self._iterations.clear()
        return web.json_response(stats)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _kv_cache_events(self, _: web.Request) -> web.Response:
        buffer = self.engine.trtllm_events
        return web.json_response(buffer.drain() if buffer is not None else [])

    async def _kv_dump(self, _: web.Request) -> web.Response:
        return _json(self.engine.dump_kv())

    async def _worker_info(self, _: web.Request) -> web.Response:
        engine = self.engine
        config = engine.config
        return web.json_response(
            {
                "worker_id": engine.worker_id,
                "epoch": engine.epoch,
                "model": self.model_name,
                "role": config.role,
                "block_size": config.block_size,
                "num_blocks": engine.blocks.num_blocks,
                "max_num_seqs": config.max_num_seqs,
                "max_num_batched_tokens": config.max_num_batched_tokens,
                "max_model_len": config.max_model_len,
                "gpus_per_engine": engine.perf.gpus_per_engine,
                "max_loras": config.adapters.max_loras,
                "loras": engine.adapters.held(),
            }
        )

    async def _reset_prefix_cache(self, _: web.Request) -> web.Response:
        if not self.engine.reset_prefix_cache():
            return _error(409, "requests hold KV blocks; the cache can only be reset when idle")
        await self._publish()
        return web.json_response({"reset": True})


@dataclass
class MockFleetSettings:
    """What ``copse worker mock`` serves."""

    engines: int = 1
    """Engines in this process, on consecutive ports."""
    port_base: int = 8000
    """Port of the first engine; engine ``i`` listens on ``port_base + i`` (0: any free ports)."""
    host: str = "127.0.0.1"
    """Address every engine binds."""
    model_name: str = "mock-model"
    """Model name the engines report and accept."""
    loras: tuple[str, ...] = ()
    """LoRA adapters the engines list in ``/v1/models`` and serve when ``model`` names one."""
    worker_prefix: str = "mock"
    """Worker ids are ``<prefix>-<port>``, unique per host."""
    virtual_clock: bool = False
    """Run steps without sleeping (see :class:`VirtualClock`)."""
    drain_timeout_s: float = 300.0
    """Longest :meth:`MockFleet.drain` waits for in-flight requests (a pod's termination grace
    ends sooner anyway, with SIGKILL)."""


class MockFleet:
    """Many :class:`EngineServer` s in one process, each on its own port."""

    def __init__(self, servers: list[EngineServer], runners: list[web.AppRunner]) -> None:
        self.servers = servers
        self._runners = runners

    @property
    def urls(self) -> list[str]:
        """Base URL of every engine (``http://127.0.0.1:<port>``)."""
        return [server.url for server in self.servers]

    async def kill(self, index: int) -> None:
        """Stop engine ``index`` as if its process died: its listener closes (connections are
        refused) and its open connections drop."""
        await self.servers[index].stop()
        await self._runners[index].cleanup()

    async def drain(self) -> None:
        """What SIGTERM does: stop listening, let the requests in flight finish (up to the
        fleet's ``drain_timeout_s``, then they are cancelled), close the connections. The engine
        loops keep running meanwhile; :meth:`close` stops them after."""
        await asyncio.gather(*(runner.cleanup() for runner in self._runners))

    async def close(self) -> None:
        """Stop every engine loop and close every listener."""
        for server in self.servers:
            await server.stop()
        for runner in self._runners:
            await runner.cleanup()


async def start_fleet(
    settings: MockFleetSettings,
    *,
    config: EngineConfig,
    perf: PerfModel,
    publisher: KvEventPublisher | None = None,
) -> MockFleet:
    """Start ``settings.engines`` engines; with a publisher, each publishes KV events and answers dumps."""
    servers: list[EngineServer] = []
    runners: list[web.AppRunner] = []
    fleet = MockFleet(servers, runners)
    try:
        for index in range(settings.engines):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((settings.host, settings.port_base + index if settings.port_base else 0))
            except OSError:
                sock.close()
                raise
            port = sock.getsockname()[1]
            engine = Engine(
                worker_id=f"{settings.worker_prefix}-{port}",
                config=config,
                perf=perf,
                epoch=time.time_ns(),
                trtllm_event_buffer=TRTLLM_EVENT_BUFFER,
            )
            clock: Clock = VirtualClock() if settings.virtual_clock else RealClock()
            server = EngineServer(
                engine=engine,
                model_name=settings.model_name,
                clock=clock,
                publisher=publisher,
                loras=settings.loras,
            )
            server.url = f"http://{settings.host}:{port}"
            runner = web.AppRunner(
                server.app,
                handler_cancellation=True,
                access_log=None,
                shutdown_timeout=settings.drain_timeout_s,
            )
            await runner.setup()
            runners.append(runner)
            await web.SockSite(runner, sock).start()
            server.start()
            servers.append(server)
            if publisher is not None:
                await publisher.serve_dumps(worker_id=engine.worker_id, dump=engine.dump_kv)
    except BaseException:
        await fleet.close()
        raise
    return fleet
