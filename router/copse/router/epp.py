"""The router as a Gateway API Inference Extension endpoint picker (EPP): an Envoy ext_proc server.

A gateway (Envoy, or any implementation of the Inference Extension) streams each request to the
picker over gRPC (``envoy.service.ext_proc.v3.ExternalProcessor/Process``, the
``FULL_DUPLEX_STREAMED`` body mode) and sends it where the picker says; the tokens then flow
through the gateway. The protocol (the Inference Extension's proposal 004, v1.0.0):

* request headers: kept; a request without a body (``GET /v1/models``) goes to the least loaded
  ready worker at once;
* request body, in any number of messages: buffered to its end, parsed as an OpenAI completions
  or chat request (:meth:`RoutingService.prepare`), routed by the same :class:`Router` and policy
  as the HTTP frontend; the answer sets the header ``x-gateway-destination-endpoint: ip:port``
  (then ``fallback_endpoints`` more, comma-separated, best first) and the same value in the dynamic
  metadata ``envoy.lb``, then streams the body back (rewritten when it names a LoRA adapter: with
  the adapter's ``lora_request``, which ``trtllm-serve`` reads);
* ``x-gateway-destination-endpoint-subset`` in the filter metadata ``envoy.lb.subset_hint`` (a
  list, or one comma-separated string) restricts the choice to those endpoints;
* errors are ``ImmediateResponse`` s with an OpenAI error body: 400 for a body that is not a
  valid request, 404 for another model, 413 past the router's ``max_body_bytes``, 503 when no
  worker is ready (or none of the subset), 429 with ``retry-after`` when the request is shed
  (its tenant is over its rate limit, or it would miss its objective's TTFT target or find the
  queue full: :mod:`copse.router.objectives`); the request's objective and tenant come from its
  ``x-gateway-inference-objective``, ``authorization`` and ``x-gateway-inference-fairness-id``
  headers, as over HTTP;
* response headers: ``x-gateway-destination-endpoint-served`` in the metadata ``envoy.lb`` names
  the worker that answered; when it is a fallback the request's load moves there;
* response body: passed back unchanged, read on the way (first token, output tokens, ``[DONE]``);
  its end (or the stream's, e.g. a client that went away) releases the request's load.

gRPC health (``grpc.health.v1.Health``): ``liveness`` always serves; ``readiness``, ``""`` and
``envoy.service.ext_proc.v3.ExternalProcessor`` serve when the HTTP router's ``GET /ready`` would
(:meth:`RoutingService.readiness`): a usable worker and, once after starting, the workers' KV dumps,
a NATS connection and the peers' load snapshots (until ``recovery_timeout_s``); never while the
picker drains. The metrics port answers ``GET /ready`` with the same state and what it waits for.

Disaggregated pools: the picker names one endpoint, so prefill workers are left out and decode
workers serve whole requests (marked ``context_and_generation`` in the body, as the HTTP frontend
does for a short prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import grpc
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from copse.router.clients import Refused, client_key
from copse.router.config import EppSettings, RouterConfig
from copse.router.core import NoWorkers, Role, Route
from copse.router.discovery import Source
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
from copse.router.tokens import PromptTokenizer
from copse.workers.perf import PerfModel
from copse.workers.protocol.errors import error_body
from copse.workers.protocol.openai_api import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""Header (and ``envoy.lb`` metadata key) naming where the gateway sends the request."""
DESTINATION_NAMESPACE = "envoy.lb"
"""Metadata namespace of the destination (to Envoy) and of the served endpoint (from Envoy)."""
SERVED_KEY = "x-gateway-destination-endpoint-served"
"""``envoy.lb`` key of the endpoint that actually answered (after the gateway's retries)."""
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
"""Filter metadata restricting the endpoints the picker may choose from."""
BODY_CHUNK_BYTES = 62_000
"""Largest body chunk sent back (Envoy caps a streamed chunk at 64 KiB; the reference picker's margin)."""
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS, READINESS = "liveness", "readiness"
"""gRPC health service names the protocol defines, with ``EXT_PROC_SERVICE``."""


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    # Overwrite: a client-sent header of the same name must not survive next to the picker's.
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def immediate(
    status: int, body: bytes, *, content_type: str = "application/json", retry_after: str | None = None
) -> ext_proc.ProcessingResponse:
    """An answer the gateway sends the client instead of forwarding the request."""
    headers = [_header("content-type", content_type)]
    if retry_after is not None:
        headers.append(_header("retry-after", retry_after))
    return ext_proc.ProcessingResponse(
        immediate_response=ext_proc.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ext_proc.HeaderMutation(set_headers=headers),
            body=body,
            details=f"copse_endpoint_picker_{status}",
        )
    )


def error_answer(
    status: int, message: str, *, param: str | None = None, retry_after: str | None = None
) -> ext_proc.ProcessingResponse:
    """An ``ImmediateResponse`` carrying an OpenAI-shaped error (and ``Retry-After`` when given)."""
    return immediate(status, error_body(status, message, param=param), retry_after=retry_after)


def _metadata(message: ext_proc.ProcessingRequest, namespace: str) -> dict[str, Any]:
    if not message.HasField("metadata_context"):
        return {}
    filter_metadata = message.metadata_context.filter_metadata
    if namespace not in filter_metadata:
        return {}
    return json_format.MessageToDict(filter_metadata[namespace])


def subset_of(message: ext_proc.ProcessingRequest) -> list[str] | None:
    """The endpoints the gateway allows for this request, ``None`` when it does not restrict them.
    The protocol gives a list; gateways filling it from a header give one comma-separated string."""
    hint = _metadata(message, SUBSET_NAMESPACE)
    if SUBSET_KEY not in hint:
        return None
    raw = hint[SUBSET_KEY]
    items = raw if isinstance(raw, list) else [raw]
    return [
        part.strip() for item in items if isinstance(item, str) for part in item.split(",") if part.strip()
    ]


def served_of(message: ext_proc.ProcessingRequest) -> str | None:
    """The endpoint that answered, as the gateway reports it."""
    served = _metadata(message, DESTINATION_NAMESPACE).get(SERVED_KEY)
    return served if isinstance(served, str) and served else None


def _headers_of(headers: ext_proc.HttpHeaders) -> dict[str, str]:
    return {
        header.key.lower(): header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        for header in headers.headers.headers
    }


def _destination(endpoints: list[str], *, body_bytes: int | None) -> ext_proc.ProcessingResponse:
    value = ",".join(endpoints)
    headers = [_header(DESTINATION_HEADER, value)]
    if body_bytes is not None:
        headers.append(_header("content-length", str(body_bytes)))
    metadata = struct_pb2.Struct()
    metadata.update({DESTINATION_NAMESPACE: {DESTINATION_HEADER: value}})
    return ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(
            response=ext_proc.CommonResponse(
                clear_route_cache=True, header_mutation=ext_proc.HeaderMutation(set_headers=headers)
            )
        ),
        dynamic_metadata=metadata,
    )


def body_chunks(body: bytes, *, response: bool, end_of_stream: bool) -> list[ext_proc.ProcessingResponse]:
    """``body`` as streamed body responses of at most :data:`BODY_CHUNK_BYTES` (one, possibly
    empty, at least); the last carries ``end_of_stream``."""
    pieces = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)] or [b""]
    out = []
    for index, piece in enumerate(pieces):
        mutation = ext_proc.BodyMutation(
            streamed_response=ext_proc.StreamedBodyResponse(
                body=piece, end_of_stream=end_of_stream and index == len(pieces) - 1
            )
        )
        answer = ext_proc.BodyResponse(response=ext_proc.CommonResponse(body_mutation=mutation))
        out.append(
            ext_proc.ProcessingResponse(response_body=answer)
            if response
            else ext_proc.ProcessingResponse(request_body=answer)
        )
    return out


def address_of(url: str) -> str:
    """``ip:port`` (``[v6]:port``) of a worker's base URL, as the gateway names endpoints."""
    return urlsplit(url).netloc


class EndpointPicker(RoutingService):
    """The routing service answering a gateway's ext_proc streams."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        settings: EppSettings,
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
        self.settings = settings

    # -- endpoints ----------------------------------------------------------------------------

    def addresses(self) -> dict[str, str]:
        """``ip:port`` -> worker id of every usable worker."""
        return {address_of(url): worker_id for worker_id, url in self._urls.items()}

    def _excluded(self, subset: list[str] | None) -> frozenset[str]:
        """Workers the request may not go to: prefill workers (the picker names one endpoint, which
        serves the whole request) and, with a subset, every worker outside it."""
        excluded = {worker_id for worker_id, info in self.router.workers.items() if info.role is Role.PREFILL}
        if subset is not None:
            allowed = set(subset)
            excluded.update(
                worker_id for address, worker_id in self.addresses().items() if address not in allowed
            )
        return frozenset(excluded)

    def least_loaded(self, subset: list[str] | None) -> str | None:
        """Address of the usable, not draining worker with the fewest requests in flight (a
        request that is not a generation: nothing to learn from its prompt)."""
        excluded = self._excluded(subset)
        requests = self.router.sequences.requests
        best: tuple[float, str] | None = None
        for address, worker_id in sorted(self.addresses().items()):
            slot = self.router.slots.get(worker_id)
            info = self.router.workers.get(worker_id)
            if worker_id in excluded or slot is None or info is None or info.draining:
                continue  # a draining worker takes no new request, even one without a prompt
            load = float(requests[slot]) if slot < len(requests) else 0.0
            if best is None or load < best[0]:
                best = (load, address)
        return None if best is None else best[1]

    # -- ext_proc -----------------------------------------------------------------------------

    async def process(
        self, messages: AsyncIterator[ext_proc.ProcessingRequest]
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        """Answer one ext_proc stream (one HTTP request through the gateway)."""
        exchange = Exchange(self)
        incoming = aiter(messages)
        try:
            while True:
                wait_s = exchange.body_wait_s()
                try:
                    if wait_s is None:
                        message = await anext(incoming)
                    else:
                        message = await asyncio.wait_for(anext(incoming), wait_s)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    yield exchange.body_timed_out()
                    return
                for answer in await exchange.on(message):
                    yield answer
                if exchange.closed:
                    return
        finally:
            exchange.end()


@dataclasses.dataclass(slots=True)
class _Routed:
    """A generation request the picker sent somewhere, until its response ends."""

    request: RouteRequest
    route: Route
    primary: str
    """Address named first to the gateway."""
    stream: bool


class Exchange:
    """The picker's side of one HTTP request: its ext_proc messages, in order."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.arrived = picker.now()
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.body = bytearray()
        self.routed: _Routed | None = None
        self.closed = False
        """An immediate response ended the exchange."""
        self.status = "200"
        self.meter = StreamMeter()
        self._partial = b""
        """An SSE line split across response body messages."""
        self._response_body = bytearray()
        """A non-streamed response (to read its usage at the end)."""
        self._finished = False
        self.client = ""
        """The client key (:func:`copse.router.clients.client_key`) while the request is inside the
        client gate (a request with a body, from its headers to the exchange's end); "" when not."""
        self._held = 0
        """Body bytes counted in the gate (the body's announced size, or what arrived of it; then
        its own size; then 0 once the body went back to the gateway)."""
        self._body_deadline: float | None = None
        """When the body must have arrived (``clients.body_timeout_s`` after the headers)."""
        self._streaming = False
        """A stream counted against the client's ``clients.max_streams``."""

    def body_wait_s(self) -> float | None:
        """How long the picker waits for the gateway's next message: the rest of
        ``clients.body_timeout_s`` while the body is still coming, else ``None`` (no limit)."""
        if self._body_deadline is None:
            return None
        return max(0.0, self._body_deadline - self.picker.now())

    def body_timed_out(self) -> ext_proc.ProcessingResponse:
        """The 408 for a body that did not arrive within ``clients.body_timeout_s``."""
        limit = self.picker.config.clients.body_timeout_s
        return self._reject(408, f"request body not received within {limit:g} s (clients.body_timeout_s)")[0]

    async def on(self, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return self._on_request_headers(message)
        if kind == "request_body":
            chunk = message.request_body
            limit = self.picker.config.max_body_bytes
            if len(self.body) + len(chunk.body) > limit:
                return self._reject(413, f"request body exceeds {limit} bytes (max_body_bytes)")
            self.body += chunk.body
            if self.client and len(self.body) > self._held:  # past what was reserved: count it as it comes
                try:
                    self.picker.clients.grow(len(self.body) - self._held)
                except Refused as exc:
                    return self._reject(429, str(exc), retry_after="1")
                self._held = len(self.body)
            return await self._decide(trailers=False) if chunk.end_of_stream else []
        if kind == "request_trailers":
            return await self._decide(trailers=True)
        if kind == "response_headers":
            return self._on_response_headers(message)
        if kind == "response_body":
            return self._on_response_body(message.response_body)
        if kind == "response_trailers":
            self._finish()
            return [ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())]
        return []

    def _reject(
        self, status: int, message: str, *, param: str | None = None, retry_after: str | None = None
    ) -> list[ext_proc.ProcessingResponse]:
        self.closed = True
        self.status = str(status)
        self.picker.metrics.requests.labels(status=self.status).inc()
        log.info("endpoint picker answers %d: %s", status, message)
        return [error_answer(status, message, param=param, retry_after=retry_after)]

    def _on_request_headers(self, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        self.headers = _headers_of(message.request_headers)
        self.subset = subset_of(message)
        if not message.request_headers.end_of_stream:
            return self._enter()  # the body decides
        address = self.picker.least_loaded(self.subset)
        if address is None:
            return self._reject(503, "no worker is ready for this request")
        return [_destination([address], body_bytes=None)]

    def _enter(self) -> list[ext_proc.ProcessingResponse]:
        """Admit a request with a body under its client's bounds, as the HTTP frontend does: the
        client is its API key or fairness id (every client without one shares the key of the
        gateway, the picker's one peer); its body is reserved at its announced size (refused
        unread past ``max_body_bytes``), else counted as its chunks arrive, and must arrive within
        ``clients.body_timeout_s``."""
        picker = self.picker
        limit = picker.config.max_body_bytes
        announced = self.headers.get("content-length", "").strip()
        size = int(announced) if announced.isdigit() else None
        if size is not None and size > limit:
            return self._reject(413, f"request body exceeds {limit} bytes (max_body_bytes)")
        key = client_key(self.headers, peer="gateway")
        held = 0 if size is None else size
        try:
            picker.clients.enter(key, body_bytes=held)
        except Refused as exc:
            return self._reject(429, str(exc), retry_after="1")
        self.client, self._held = key, held
        self._body_deadline = self.arrived + picker.config.clients.body_timeout_s
        return []

    def _release_body(self) -> None:
        """The body went back to the gateway (or the exchange ended): the picker holds none of it."""
        self.body = bytearray()
        if self.client:
            self.picker.clients.resize(reserved=self._held, actual=0)
            self._held = 0

    async def _decide(self, *, trailers: bool) -> list[ext_proc.ProcessingResponse]:
        self._body_deadline = None
        path = self.headers.get(":path", "").split("?", 1)[0]
        model = GENERATE_PATHS.get(path)
        body = bytes(self.body)
        if self.client:
            self.picker.clients.resize(reserved=self._held, actual=len(body))
            self._held = len(body)
        try:
            return await self._answer(model, body, trailers=trailers)
        finally:
            self._release_body()

    async def _answer(
        self,
        model: type[CompletionRequest] | type[ChatCompletionRequest] | None,
        body: bytes,
        *,
        trailers: bool,
    ) -> list[ext_proc.ProcessingResponse]:
        if model is None:
            address = self.picker.least_loaded(self.subset)
            if address is None:
                return self._reject(503, "no worker is ready for this request")
            return [_destination([address], body_bytes=len(body)), *self._body(body, trailers)]
        try:
            prepared = await self.picker.prepare(model, body, self.headers)
        except Rejected as exc:
            return self._reject(exc.status, exc.message, param=exc.param)
        if prepared.request.stream and self.client:
            try:
                self.picker.clients.open_stream(self.client)
            except Refused as exc:
                return self._reject(429, str(exc), retry_after="1")
            self._streaming = True
        try:
            return await self._route(prepared, body, trailers)
        except Overloaded as exc:
            return self._reject(429, str(exc), retry_after=exc.retry_after)
        except Unavailable as exc:
            return self._reject(503, str(exc))

    def _body(self, body: bytes, trailers: bool) -> list[ext_proc.ProcessingResponse]:
        answers = body_chunks(body, response=False, end_of_stream=not trailers)
        if trailers:
            answers.append(ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse()))
        return answers

    async def _route(
        self, prepared: Prepared, body: bytes, trailers: bool
    ) -> list[ext_proc.ProcessingResponse]:
        picker = self.picker
        excluded = picker._excluded(self.subset)
        if self.subset is not None and not set(picker.router.workers) - excluded:
            raise Unavailable("none of the endpoints in the gateway's subset is a ready worker")
        # the gateway routes each request here once (its fallbacks come back through assign)
        route = await picker._route(prepared.route, excluded, retry=False)
        urls = picker._urls
        fallbacks = picker.router.fallbacks(
            prepared.route,
            primary=route.worker_id,
            exclude=excluded,
            count=picker.settings.fallback_endpoints,
            now=picker.now(),
        )
        endpoints = [address_of(urls[w]) for w in (route.worker_id, *fallbacks) if w in urls]
        if not endpoints:
            picker._finish(route.request_id)
            raise Unavailable(f"worker {route.worker_id} left while the request was routed")
        self.routed = _Routed(
            request=prepared.route, route=route, primary=endpoints[0], stream=prepared.request.stream
        )
        decode = picker.router.workers[route.worker_id].role is Role.DECODE
        if decode or prepared.rewritten:
            # The body as the engine needs it: through a LoRA adapter with its lora_request (what
            # prepare added: trtllm-serve does not read model), and a whole request on a decode
            # worker marked as trtllm-serve's conditional disaggregation marks it.
            payload = dict(prepared.body)
            if decode:
                payload["disaggregated_params"] = {"request_type": "context_and_generation"}
            body = json.dumps(payload).encode()
        return [_destination(endpoints, body_bytes=len(body)), *self._body(body, trailers)]

    def _on_response_headers(self, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        headers = _headers_of(message.response_headers)
        self.status = headers.get(":status", "200")
        served = served_of(message)
        routed = self.routed
        if routed is not None and served is not None and served != routed.primary:
            self._move(routed, served)
        if message.response_headers.end_of_stream:
            self._finish()
        return [ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())]

    def _move(self, routed: _Routed, served: str) -> None:
        """The gateway retried on another endpoint: charge the request there."""
        picker = self.picker
        worker_id = picker.addresses().get(served)
        picker.metrics.retries.inc()
        log.info(
            "request %s was served by %s, not %s (the gateway retried)",
            routed.route.request_id,
            served,
            routed.primary,
        )
        picker._finish(routed.route.request_id)
        if worker_id is None:
            self.routed = None  # served by an endpoint the router does not know: nothing to charge
            return
        try:
            routed.route = picker.router.assign(routed.request, worker_id, now=picker.now())
        except NoWorkers:
            self.routed = None
            return
        routed.primary = served
        picker._changed()

    def _on_response_body(self, chunk: ext_proc.HttpBody) -> list[ext_proc.ProcessingResponse]:
        if self.routed is not None and self.status == "200":
            self._read(chunk.body)
        answers = body_chunks(chunk.body, response=True, end_of_stream=chunk.end_of_stream)
        if chunk.end_of_stream:
            self._finish()
        return answers

    def _read(self, data: bytes) -> None:
        routed = self.routed
        assert routed is not None
        picker = self.picker
        if not routed.stream:
            self._response_body += data
            return
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            try:
                _, first = self.meter.feed(line[5:].strip(), now=picker.now())
            except ValueError:
                log.warning(
                    "request %s: a stream event that is not JSON: %r", routed.route.request_id, line[:200]
                )
                continue
            if first:
                picker._first_token(routed.route.request_id)
                picker.metrics.first_token(routed.request, self.meter.first_at - self.arrived)

    def _finish(self) -> None:
        """The response ended: account it and release the request's load (once)."""
        if self._finished:
            return
        self._finished = True
        picker = self.picker
        picker.metrics.requests.labels(status=self.status).inc()
        routed = self.routed
        if routed is None:
            return
        if routed.stream:
            picker._count_output(self.meter.output_tokens)
            itl = self.meter.mean_itl
            if itl is not None and self.meter.done:
                picker.metrics.inter_token(routed.request, itl)
            if self.meter.done and self.meter.events:
                picker.metrics.judged(ttft_s=self.meter.first_at - self.arrived, itl_s=itl)
        elif self.status == "200":
            picker._first_token(routed.route.request_id)
            picker.metrics.judged(ttft_s=picker.now() - self.arrived, itl_s=None)
            with contextlib.suppress(ValueError):
                picker._count_output(usage_tokens(json.loads(bytes(self._response_body))) or 0)
        picker.metrics.duration.observe(picker.now() - self.arrived)
        picker._finish(routed.route.request_id)
        self.routed = None

    def end(self) -> None:
        """The ext_proc stream closed: after the response, or because the client or the gateway
        went away before it ended; whatever is still charged is released."""
        if self.routed is not None and not self._finished:
            self.status = "499"  # the client closed the request (nginx's code)
            self._finish()
        self._body_deadline = None
        if self.client:
            self._release_body()
            if self._streaming:
                self.picker.clients.close_stream(self.client)
                self._streaming = False
            self.picker.clients.leave(self.client, body_bytes=0)
            self.client = ""


class _ExtProcServicer(ext_proc_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, picker: EndpointPicker) -> None:
        self._picker = picker

    async def Process(
        self,
        request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        # An async generator function: that is how grpc.aio recognises a streaming handler.
        async for answer in self._picker.process(request_iterator):
            yield answer


class _HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, picker: EndpointPicker) -> None:
        self._picker = picker

    def _status(self, service: str) -> int | None:
        if service == LIVENESS:
            return health_pb2.HealthCheckResponse.SERVING
        if service in (READINESS, "", EXT_PROC_SERVICE):
            ready, _ = self._picker.readiness()
            return (
                health_pb2.HealthCheckResponse.SERVING
                if ready
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
        return None

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> health_pb2.HealthCheckResponse:
        status = self._status(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)


def metrics_app(service: RoutingService) -> web.Application:
    """``/metrics``, ``/health``, ``/ready`` and ``/workers`` (what the operator reads while a group
    drains) of a picker over HTTP."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=service.metrics_text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def health(_: web.Request) -> web.Response:
        status, body = service.health()
        return web.json_response(body, status=status)

    async def workers(_: web.Request) -> web.Response:
        return web.json_response({"workers": service.workers_report()})

    async def ready(_: web.Request) -> web.Response:
        is_ready, waiting = service.readiness()
        if is_ready:
            return web.json_response({"ready": True})
        return web.json_response({"ready": False, "waiting_for": waiting}, status=503)

    app = web.Application()
    app.add_routes(
        [
            web.get("/metrics", metrics),
            web.get("/health", health),
            web.get("/ready", ready),
            web.get("/workers", workers),
        ]
    )
    return app


@dataclasses.dataclass(slots=True)
class PickerServer:
    """A picker's gRPC server and optional metrics server, started; :meth:`stop` ends both."""

    picker: EndpointPicker
    grpc_server: grpc.aio.Server
    grpc_port: int
    health_port: int | None
    metrics_runner: web.AppRunner | None
    metrics_url: str | None

    async def stop(self) -> None:
        await self.grpc_server.stop(grace=1.0)
        if self.metrics_runner is not None:
            await self.metrics_runner.cleanup()
        await self.picker.stop()


def _bind(server: grpc.aio.Server, host: str, port: int) -> int:
    shown = f"[{host}]" if ":" in host else host
    bound = server.add_insecure_port(f"{shown}:{port}")
    if bound == 0:
        raise ValueError(f"cannot listen on {shown}:{port} (gRPC)")
    return bound


async def start_picker(picker: EndpointPicker, *, host: str) -> PickerServer:
    """Start the picker's service, its gRPC server and its metrics server."""
    settings = picker.settings
    await picker.start()
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(_ExtProcServicer(picker), server)
    health_pb2_grpc.add_HealthServicer_to_server(_HealthServicer(picker), server)
    try:
        grpc_port = _bind(server, host, settings.grpc_port)
        health_port = None if settings.health_port is None else _bind(server, host, settings.health_port)
        await server.start()
        runner = url = None
        if settings.metrics_port is not None:
            runner = web.AppRunner(metrics_app(picker), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, host, settings.metrics_port).start()
            bound_host, bound_port = runner.addresses[0][:2]
            shown = f"[{bound_host}]" if ":" in bound_host else bound_host
            url = f"http://{shown}:{bound_port}"
    except BaseException:
        await server.stop(grace=None)
        await picker.stop()
        raise
    return PickerServer(
        picker=picker,
        grpc_server=server,
        grpc_port=grpc_port,
        health_port=health_port,
        metrics_runner=runner,
        metrics_url=url,
    )
