"""The endpoint picker (ext_proc) against real mocked engines: golden request/response exchanges
ported from the Gateway API Inference Extension's hermetic EPP test table
(``test/integration/epp/hermetic_test.go``: request in, expected headers/metadata out, shedding,
a body split across messages, subsets, response streaming), then the picker's own lifecycle
(served endpoint, load release, fallbacks) and its gRPC surface (health, Process)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aiohttp
import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from copse.router.config import parse_config
from copse.router.epp import BODY_CHUNK_BYTES, EndpointPicker, address_of
from copse.router.policies import RouteRequest
from copse.router.server import RunningRouter, start_router
from copse.workers.protocol import lora_int_id
from copse.workers.testing import mock_fleet

from .conftest import eventually

MODEL = "mock-model"


async def _picker(urls: list[str], *, settings: dict[str, Any] | None = None, **epp: Any) -> RunningRouter:
    raw: dict[str, Any] = {
        "model": MODEL,
        "engine": "mock",
        "block_size": 32,
        "discovery": {"kind": "static", "workers": [{"url": url} for url in urls]},
        "health_interval_s": 0.05,
        "seed": 1,
        "queue_timeout_s": 2.0,
        "epp": {"grpc_port": 0, "health_port": None, "metrics_port": None, **epp},
        **(settings or {}),
    }
    running = await start_router(parse_config(raw, source="test"), router_id="test-epp")
    await eventually(lambda: len(running.service.router.workers) == len(urls))
    return running


def _service(running: RunningRouter) -> EndpointPicker:
    assert isinstance(running.service, EndpointPicker)
    return running.service


# -- requests as the gateway sends them ---------------------------------------------------------


def _metadata(namespace: str, values: dict[str, Any]) -> base_pb2.Metadata:
    metadata = base_pb2.Metadata()
    entry = struct_pb2.Struct()
    entry.update(values)
    metadata.filter_metadata[namespace].CopyFrom(entry)
    return metadata


def request_headers(
    path: str = "/v1/completions",
    *,
    end_of_stream: bool = False,
    subset: Any = None,
    extra: dict[str, str] | None = None,
) -> ext_proc.ProcessingRequest:
    headers = [
        base_pb2.HeaderValue(key=":method", raw_value=b"POST" if not end_of_stream else b"GET"),
        base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
        base_pb2.HeaderValue(key="hi", value="mom"),
        base_pb2.HeaderValue(key="x-request-id", value="test-request-id"),
        *(base_pb2.HeaderValue(key=key, raw_value=value.encode()) for key, value in (extra or {}).items()),
    ]
    message = ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=headers), end_of_stream=end_of_stream
        )
    )
    if subset is not None:
        message.metadata_context.CopyFrom(
            _metadata("envoy.lb.subset_hint", {"x-gateway-destination-endpoint-subset": subset})
        )
    return message


def request_body(*chunks: bytes) -> list[ext_proc.ProcessingRequest]:
    return [
        ext_proc.ProcessingRequest(
            request_body=ext_proc.HttpBody(body=chunk, end_of_stream=index == len(chunks) - 1)
        )
        for index, chunk in enumerate(chunks)
    ]


def response_headers(
    *, status: str = "200", content_type: str = "text/event-stream", served: str | None = None
) -> ext_proc.ProcessingRequest:
    headers = [
        base_pb2.HeaderValue(key=":status", raw_value=status.encode()),
        base_pb2.HeaderValue(key="content-type", raw_value=content_type.encode()),
    ]
    message = ext_proc.ProcessingRequest(
        response_headers=ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers))
    )
    if served is not None:
        message.metadata_context.CopyFrom(
            _metadata("envoy.lb", {"x-gateway-destination-endpoint-served": served})
        )
    return message


def response_body(*chunks: bytes) -> list[ext_proc.ProcessingRequest]:
    return [
        ext_proc.ProcessingRequest(
            response_body=ext_proc.HttpBody(body=chunk, end_of_stream=index == len(chunks) - 1)
        )
        for index, chunk in enumerate(chunks)
    ]


def completion(prompt: Any, *, max_tokens: int = 100, stream: bool = False) -> bytes:
    body: dict[str, Any] = {"max_tokens": max_tokens, "model": MODEL, "prompt": prompt, "temperature": 0}
    if stream:
        body["stream"] = True
    return json.dumps(body).encode()


# -- what the picker must answer ----------------------------------------------------------------


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def expect_route(endpoint: str, body: bytes | None) -> list[ext_proc.ProcessingResponse]:
    """The reference picker's answer: the destination header (and Content-Length of the body it
    streams back), route cache cleared, the same destination in ``envoy.lb``; then the body."""
    headers = [_set("x-gateway-destination-endpoint", endpoint)]
    if body is not None:
        headers.append(_set("content-length", str(len(body))))
    metadata = struct_pb2.Struct()
    metadata.update({"envoy.lb": {"x-gateway-destination-endpoint": endpoint}})
    out = [
        ext_proc.ProcessingResponse(
            request_headers=ext_proc.HeadersResponse(
                response=ext_proc.CommonResponse(
                    clear_route_cache=True, header_mutation=ext_proc.HeaderMutation(set_headers=headers)
                )
            ),
            dynamic_metadata=metadata,
        )
    ]
    if body is not None:
        out.append(_chunk(body, end_of_stream=True, response=False))
    return out


def _chunk(body: bytes, *, end_of_stream: bool, response: bool) -> ext_proc.ProcessingResponse:
    answer = ext_proc.BodyResponse(
        response=ext_proc.CommonResponse(
            body_mutation=ext_proc.BodyMutation(
                streamed_response=ext_proc.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
            )
        )
    )
    if response:
        return ext_proc.ProcessingResponse(response_body=answer)
    return ext_proc.ProcessingResponse(request_body=answer)


def expect_reject(status: int, error_type: str, message: str) -> tuple[int, str, str]:
    return status, error_type, message


def _rejection(answers: list[ext_proc.ProcessingResponse]) -> tuple[int, str, str]:
    assert len(answers) == 1, answers
    reply = answers[0].immediate_response
    assert answers[0].WhichOneof("response") == "immediate_response"
    content_type = {h.header.key: h.header.raw_value for h in reply.headers.set_headers}["content-type"]
    assert content_type == b"application/json"
    error = json.loads(reply.body)["error"]  # the one error shape, as the HTTP frontend's
    assert error["code"] == reply.status.code
    return reply.status.code, error["type"], error["message"]


async def _exchange(
    picker: EndpointPicker, messages: Iterable[ext_proc.ProcessingRequest]
) -> list[ext_proc.ProcessingResponse]:
    async def feed() -> AsyncIterator[ext_proc.ProcessingRequest]:
        for message in messages:
            yield message

    return [answer async for answer in picker.process(feed())]


def _load(picker: EndpointPicker, worker_url: str, requests: int) -> None:
    """Put ``requests`` long requests in flight on a worker."""
    worker_id = picker.addresses()[address_of(worker_url)]
    for i in range(requests):
        request = RouteRequest(
            request_id=f"load-{worker_id}-{i}", hashes=[], prompt_tokens=3000, max_tokens=50
        )
        picker.router.assign(request, worker_id, now=picker.now())


def _destination_of(answer: ext_proc.ProcessingResponse) -> str:
    return str(answer.request_headers.response.header_mutation.set_headers[0].header.raw_value.decode())


def _inflight(picker: EndpointPicker) -> dict[str, int]:
    requests = picker.router.sequences.requests
    return {
        address: int(requests[slot])
        for address, worker_id in picker.addresses().items()
        if (slot := picker.router.slots.get(worker_id)) is not None
    }


# -- the hermetic table -------------------------------------------------------------------------


async def test_hermetic_table() -> None:
    async with mock_fleet(engines=3) as fleet:
        running = await _picker(fleet.urls, settings={"slo": {"ttft_ms": 60_000, "itl_ms": 10_000}})
        picker = _service(running)
        a, b, c = (address_of(url) for url in fleet.urls)
        try:
            # "select lower queue and kv cache": loads 3, 0, 10 -> the idle worker.
            _load(picker, fleet.urls[0], 3)
            _load(picker, fleet.urls[2], 10)
            body = completion("test1")
            got = await _exchange(picker, [request_headers(), *request_body(body)])
            assert got == expect_route(b, body)

            # "split body across chunks": the same answer when the body comes in two messages.
            body = completion("test6")
            got = await _exchange(picker, [request_headers(), *request_body(body[:20], body[20:])])
            assert got == expect_route(b, body)

            # "subsetting: select best from subset" / "partial match": only the subset's workers.
            got = await _exchange(picker, [request_headers(subset=[a, b, c]), *request_body(body)])
            assert got == expect_route(b, body)
            got = await _exchange(picker, [request_headers(subset=[c]), *request_body(body)])
            assert got == expect_route(c, body)
            # A gateway filling the hint from a header gives one comma-separated string.
            got = await _exchange(picker, [request_headers(subset=f"{a}, {c}"), *request_body(body)])
            assert got == expect_route(a, body)

            # "subsetting: no pods match": 503.
            got = await _exchange(
                picker, [request_headers(subset=["192.168.1.99:8000"]), *request_body(body)]
            )
            assert _rejection(got) == expect_reject(
                503,
                "ServiceUnavailableError",
                "none of the endpoints in the gateway's subset is a ready worker",
            )

            # "invalid json body": 400 in the OpenAI error shape, the stream ends cleanly.
            got = await _exchange(picker, [request_headers(), *request_body(b"no healthy upstream")])
            status, kind, message = _rejection(got)
            assert (status, kind) == (400, "BadRequestError")
            assert "JSON" in message

            # "request missing model field": 400 naming the field.
            got = await _exchange(picker, [request_headers(), *request_body(b'{"prompt":"hello world"}')])
            status, kind, message = _rejection(got)
            assert (status, kind) == (400, "BadRequestError")
            assert "model" in message

            # The reported failures of issue 23, as the HTTP frontend answers them.
            huge = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 10**12}).encode()
            alien = json.dumps({"model": MODEL, "messages": [{"role": "alien", "content": "x"}]}).encode()
            for path, bad, fragment in (
                ("/v1/completions", huge, "context of"),
                ("/v1/completions", b"[" * 5000 + b"]" * 5000, "max_json_depth"),
                ("/v1/chat/completions", alien, "role must be one of"),
            ):
                got = await _exchange(picker, [request_headers(path), *request_body(bad)])
                status, kind, message = _rejection(got)
                assert (status, kind) == (400, "BadRequestError")
                assert fragment in message

            # Another model: 404, as the HTTP frontend answers.
            other = json.dumps({"model": "other", "prompt": "x", "max_tokens": 1}).encode()
            got = await _exchange(picker, [request_headers(), *request_body(other)])
            assert _rejection(got)[:2] == (404, "NotFoundError")

            # "protocol: simple GET (header only)": the least loaded worker, no body.
            got = await _exchange(picker, [request_headers("/v1/models", end_of_stream=True)])
            assert got == expect_route(b, None)

            # "response streaming: SSE token counting": chunks pass back unchanged, the last with EoS.
            chunks = [
                b'data: {"choices":[{"index":0,"text":"a"}]}\n\ndata: {"cho',
                b'ices":[{"index":0,"text":"b"}]}\n\n',
                b'data: {"choices":[],"usage":{"prompt_tokens":7,"total_tokens":17,"completion_tokens":10}}'
                b"\n\ndata: [DONE]\n\n",
                b"",
            ]
            body = completion("test7", stream=True)
            before = picker.metrics.output_tokens._value.get()
            met = picker.metrics.slo_requests.labels("met")._value.get()
            got = await _exchange(
                picker,
                [request_headers(), *request_body(body), response_headers(), *response_body(*chunks)],
            )
            assert got[:2] == expect_route(b, body)
            assert got[2] == ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())
            assert got[3:] == [
                _chunk(chunk, end_of_stream=index == len(chunks) - 1, response=True)
                for index, chunk in enumerate(chunks)
            ]
            assert picker.metrics.output_tokens._value.get() - before == 10
            assert picker.metrics.slo_requests.labels("met")._value.get() - met == 1  # judged once it ended
            # Only the synthetic load is left in flight: every exchange released what it took.
            assert _inflight(picker) == {a: 3, b: 0, c: 10}
        finally:
            await running.close()


async def test_no_ready_worker_is_503_and_a_full_queue_sheds_with_429() -> None:
    async with mock_fleet(engines=1) as fleet:
        # Every worker busy (prefill backlog past the threshold) and no room to wait: shed.
        running = await _picker(fleet.urls, settings={"busy_prefill_tokens": 1000, "queue_size": 0})
        picker = _service(running)
        try:
            _load(picker, fleet.urls[0], 1)
            body = completion("x")
            got = await _exchange(picker, [request_headers(), *request_body(body)])
            assert _rejection(got)[:2] == (429, "RateLimitError")
            headers = {
                h.header.key: h.header.raw_value for h in got[0].immediate_response.headers.set_headers
            }
            assert headers["retry-after"] == b"1"
        finally:
            await running.close()
    async with mock_fleet(engines=1) as fleet:
        # A tenant (named by its fairness id) over its token rate: 429 with when to retry.
        limited = {"tenants": {"team-a": {"tokens_per_minute": 100}}}
        running = await _picker(fleet.urls, settings=limited)
        picker = _service(running)
        team_a = {"x-gateway-inference-fairness-id": "team-a", "x-gateway-inference-objective": "unknown"}
        try:
            body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 60}).encode()
            got = await _exchange(picker, [request_headers(extra=team_a), *request_body(body)])
            assert got[0].WhichOneof("response") == "request_headers", "the first one fits the minute"
            got = await _exchange(picker, [request_headers(extra=team_a), *request_body(body)])
            assert _rejection(got)[:2] == (429, "RateLimitError")
            headers = {
                h.header.key: h.header.raw_value for h in got[0].immediate_response.headers.set_headers
            }
            assert int(headers["retry-after"]) >= 1
            assert picker.metrics.class_rate_limited.labels("default", "team-a")._value.get() == 1
        finally:
            await running.close()
    async with mock_fleet(engines=1) as gone:
        running = await _picker(gone.urls)
        await gone.close()  # the engine's process is gone: its next probe drops it
        await eventually(lambda: not running.service.router.workers)
        try:
            got = await _exchange(picker_of(running), [request_headers(), *request_body(completion("x"))])
            assert _rejection(got)[:2] == (503, "ServiceUnavailableError")
            got = await _exchange(picker_of(running), [request_headers("/v1/models", end_of_stream=True)])
            assert _rejection(got)[:2] == (503, "ServiceUnavailableError")
        finally:
            await running.close()


async def test_a_request_in_a_gateways_subset_is_charged_and_rate_limited_at_its_first_route() -> None:
    """The gateway's subset excludes endpoints on a request's first route: that is no retry. The
    request is admitted (counted), charged to its tenant and taken from its token rate, so the
    tenant's next request over the limit is refused with 429."""
    async with mock_fleet(engines=2) as fleet:
        limited = {"tenants": {"team-a": {"tokens_per_minute": 100}}}
        running = await _picker(fleet.urls, settings=limited)
        picker = _service(running)
        team_a = {"x-gateway-inference-fairness-id": "team-a", "x-gateway-inference-objective": "unknown"}
        subset = [address_of(fleet.urls[0])]
        try:
            body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 60}).encode()
            got = await _exchange(picker, [request_headers(subset=subset, extra=team_a), *request_body(body)])
            assert _destination_of(got[0]) == subset[0], "the first one fits the minute"
            assert picker.metrics.class_admitted.labels("default", "team-a")._value.get() == 1
            assert picker.router._queue._bands[0].served["team-a"] > 0, "charged to its tenant"
            got = await _exchange(picker, [request_headers(subset=subset, extra=team_a), *request_body(body)])
            assert _rejection(got)[:2] == (429, "RateLimitError")
            assert picker.metrics.class_rate_limited.labels("default", "team-a")._value.get() == 1
        finally:
            await running.close()


def picker_of(running: RunningRouter) -> EndpointPicker:
    return _service(running)


async def test_oversized_body_is_413_and_large_bodies_stream_back_in_chunks() -> None:
    async with mock_fleet(engines=1) as fleet:
        running = await _picker(fleet.urls, settings={"max_body_bytes": 200_000})
        picker = _service(running)
        try:
            long_prompt = "word " * 30_000  # 150 kB: three chunks back to the gateway
            body = completion(long_prompt)
            got = await _exchange(picker, [request_headers(), *request_body(body[:70_000], body[70_000:])])
            assert got[0] == expect_route(address_of(fleet.urls[0]), body)[0]
            streamed = [answer.request_body.response.body_mutation.streamed_response for answer in got[1:]]
            assert b"".join(piece.body for piece in streamed) == body
            assert all(len(piece.body) <= BODY_CHUNK_BYTES for piece in streamed)
            assert [piece.end_of_stream for piece in streamed] == [False, False, True]
            got = await _exchange(picker, [request_headers(), *request_body(b"x" * 150_000, b"x" * 60_000)])
            assert _rejection(got)[:2] == (413, "RequestTooLargeError")
        finally:
            await running.close()


async def test_the_prefix_holder_wins_and_a_fallback_that_served_takes_the_load() -> None:
    async with mock_fleet(engines=3) as fleet:
        running = await _picker(fleet.urls, fallback_endpoints=2)
        picker = _service(running)
        try:
            prompt = list(range(1000, 1000 + 256))
            first = await _exchange(picker, [request_headers(), *request_body(completion(prompt))])
            chosen = (
                first[0].request_headers.response.header_mutation.set_headers[0].header.raw_value.decode()
            )
            endpoints = chosen.split(",")
            assert len(endpoints) == 3
            assert len(set(endpoints)) == 3
            metadata = first[0].dynamic_metadata.fields["envoy.lb"].struct_value
            assert metadata.fields["x-gateway-destination-endpoint"].string_value == chosen
            # The same prefix again: the worker that got it first (it holds the prefix now).
            again = await _exchange(picker, [request_headers(), *request_body(completion([*prompt, 7, 8]))])
            assert _destination_of(again[0]).split(",")[0] == endpoints[0]

            # The gateway retried on the second endpoint: the request's load moves there, and is
            # released when the response ends.
            messages: asyncio.Queue[ext_proc.ProcessingRequest | None] = asyncio.Queue()

            async def feed() -> AsyncIterator[ext_proc.ProcessingRequest]:
                while (message := await messages.get()) is not None:
                    yield message

            answers: list[ext_proc.ProcessingResponse] = []

            async def consume() -> None:
                async for answer in picker.process(feed()):
                    answers.append(answer)

            task = asyncio.create_task(consume())
            for message in [request_headers(), *request_body(completion(prompt, stream=True))]:
                await messages.put(message)
            await eventually(lambda: len(answers) == 2)
            primary, fallback = (
                answers[0]
                .request_headers.response.header_mutation.set_headers[0]
                .header.raw_value.decode()
                .split(",")[:2]
            )
            assert _inflight(picker)[primary] == 1
            await messages.put(response_headers(served=fallback))
            await eventually(lambda: len(answers) == 3)
            assert _inflight(picker)[primary] == 0
            assert _inflight(picker)[fallback] == 1
            assert picker.metrics.retries._value.get() == 1
            await messages.put(response_body(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n')[0])
            await eventually(lambda: len(answers) == 4)
            # The gateway closes the stream without an end of body (the client went away).
            await messages.put(None)
            await task
            assert sum(_inflight(picker).values()) == 0
        finally:
            await running.close()


async def test_grpc_health_and_process_over_a_real_channel() -> None:
    async with mock_fleet(engines=1) as fleet:
        running = await _picker(fleet.urls)
        try:
            assert running.grpc_target is not None
            async with grpc.aio.insecure_channel(running.grpc_target) as channel:
                health: Any = health_pb2_grpc.HealthStub(channel)  # the stubs' HealthStub lacks Check
                for service in ("liveness", "readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor"):
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
                with pytest.raises(grpc.aio.AioRpcError) as unknown:
                    await health.Check(health_pb2.HealthCheckRequest(service="nope"))
                assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
                stub = ext_proc_grpc.ExternalProcessorStub(channel)
                body = completion("over grpc")
                call = stub.Process()
                for message in [request_headers(), *request_body(body)]:
                    await call.write(message)
                got = [await call.read(), await call.read()]
                await call.done_writing()
                assert got == expect_route(address_of(fleet.urls[0]), body)
        finally:
            await running.close()


async def test_grpc_readiness_is_the_routers_recovery_state() -> None:
    """Readiness waits for what the HTTP router's GET /ready waits for (KV dumps, NATS, peers'
    snapshots), not only for discovery to list the pool; liveness serves meanwhile."""
    async with mock_fleet(engines=1) as fleet:
        running = await _picker(fleet.urls, metrics_port=0)
        picker = _service(running)
        recovering = ["the KV dumps of 1 workers"]
        picker.readiness_checks.append(lambda: recovering[0] if recovering else None)
        try:
            assert running.grpc_target is not None
            async with (
                grpc.aio.insecure_channel(running.grpc_target) as channel,
                aiohttp.ClientSession() as http,
            ):
                health: Any = health_pb2_grpc.HealthStub(channel)

                async def status(service: str) -> Any:
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                    return reply.status

                assert await status("liveness") == health_pb2.HealthCheckResponse.SERVING
                for service in ("readiness", "", "envoy.service.ext_proc.v3.ExternalProcessor"):
                    assert await status(service) == health_pb2.HealthCheckResponse.NOT_SERVING, service
                async with http.get(f"{running.url}/ready") as response:
                    assert response.status == 503
                    assert (await response.json())["waiting_for"] == recovering
                recovering.clear()
                assert await status("readiness") == health_pb2.HealthCheckResponse.SERVING
                async with http.get(f"{running.url}/ready") as response:
                    assert response.status == 200
                picker.draining = True
                assert await status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
                assert await status("liveness") == health_pb2.HealthCheckResponse.SERVING
        finally:
            await running.close()


def test_immediate_status_codes_are_envoy_http_statuses() -> None:
    # The ImmediateResponse status is Envoy's StatusCode enum: its numbers are the HTTP codes.
    for code in (400, 404, 413, 429, 503):
        assert http_status_pb2.StatusCode.Name(code)


async def test_a_draining_worker_gets_no_new_request() -> None:
    async with mock_fleet(engines=2) as fleet:
        running = await _picker(fleet.urls)
        picker = _service(running)
        try:
            idle, other = (address_of(url) for url in fleet.urls)
            _load(picker, fleet.urls[1], 2)  # the draining worker is the idle one: it still gets nothing
            worker_id = picker.addresses()[idle]
            info = picker.router.workers[worker_id]
            picker.router.add_worker(dataclasses.replace(info, draining=True), now=picker.now())
            got = await _exchange(picker, [request_headers("/v1/models", end_of_stream=True)])
            assert got == expect_route(other, None)
            body = completion("drain")
            got = await _exchange(picker, [request_headers(), *request_body(body)])
            assert got == expect_route(other, body)
        finally:
            await running.close()


async def test_the_picker_reports_draining_workers_over_http() -> None:
    """The operator asks a picker, like an HTTP router, what is still in flight on a draining group."""
    async with mock_fleet(engines=1) as fleet:
        running = await _picker(fleet.urls, metrics_port=0)
        picker = _service(running)
        try:
            _load(picker, fleet.urls[0], 2)
            worker_id = picker.addresses()[address_of(fleet.urls[0])]
            info = picker.router.workers[worker_id]
            picker.router.add_worker(dataclasses.replace(info, draining=True), now=picker.now())
            async with aiohttp.ClientSession() as http, http.get(f"{running.url}/workers") as response:
                [report] = (await response.json())["workers"]
            assert (report["draining"], report["in_flight"]) == (True, 2)
        finally:
            await running.close()


class _Gateway:
    """One ext_proc stream whose messages the test sends one at a time (a gateway mid-request)."""

    def __init__(self, picker: EndpointPicker) -> None:
        self._inbox: asyncio.Queue[ext_proc.ProcessingRequest | None] = asyncio.Queue()
        self.answers: list[ext_proc.ProcessingResponse] = []
        self.task = asyncio.create_task(self._run(picker))

    async def _feed(self) -> AsyncIterator[ext_proc.ProcessingRequest]:
        while (message := await self._inbox.get()) is not None:
            yield message

    async def _run(self, picker: EndpointPicker) -> None:
        async for answer in picker.process(self._feed()):
            self.answers.append(answer)

    def send(self, *messages: ext_proc.ProcessingRequest) -> None:
        for message in messages:
            self._inbox.put_nowait(message)

    async def close(self) -> None:
        self._inbox.put_nowait(None)
        await self.task


async def test_client_bounds_hold_in_epp_mode() -> None:
    """The HTTP frontend's ``clients.*`` bounds apply to what the gateway streams to the picker: per
    client (API key or fairness id) requests and streams, the body bytes held, the body's time."""
    bounds = {"max_requests": 2, "max_streams": 1, "max_body_bytes_held": 4096}
    async with mock_fleet(engines=1) as fleet:
        running = await _picker(fleet.urls, settings={"clients": bounds})
        picker = _service(running)
        gate = picker.clients
        # Each body announces its size (as Envoy forwards Content-Length): held from the headers.
        team = {"x-gateway-inference-fairness-id": "team-a", "content-length": "100"}
        try:
            # Two requests of team-a whose bodies are still coming: a third one is refused at its
            # headers, another tenant's is not.
            first, second = _Gateway(picker), _Gateway(picker)
            first.send(request_headers(extra=team))
            second.send(request_headers(extra=team))
            await eventually(lambda: gate.clients() == 1 and gate.body_bytes > 0)
            refused = await _exchange(picker, [request_headers(extra=team), *request_body(completion("x"))])
            status, kind, message = _rejection(refused)
            assert (status, kind) == (429, "RateLimitError")
            assert "clients.max_requests 2" in message
            reply = refused[0].immediate_response
            retry_after = {h.header.key: h.header.raw_value for h in reply.headers.set_headers}["retry-after"]
            assert retry_after == b"1"
            other = {"x-gateway-inference-fairness-id": "team-b", "content-length": "100"}
            got = await _exchange(picker, [request_headers(extra=other), *request_body(completion("y"))])
            assert got[0].WhichOneof("response") == "request_headers"
            # One stream of team-a is open (routed, its response not ended): a second is refused.
            first.send(*request_body(completion("stream one", stream=True)))
            await eventually(lambda: len(first.answers) == 2)
            assert first.answers[0].WhichOneof("response") == "request_headers"
            second.send(*request_body(completion("stream two", stream=True)))
            await second.task
            status, _, message = _rejection(second.answers)
            assert status == 429
            assert "clients.max_streams 1" in message
            # The routed request's body went back to the gateway: the picker holds none of it.
            assert gate.body_bytes == 0
            assert gate.clients() == 1
            await first.close()
            assert gate.clients() == 0
            # Bodies announced past what all clients may hold together: 429, unread.
            big = {**team, "content-length": "5000"}
            got = await _exchange(picker, [request_headers(extra=big)])
            status, _, message = _rejection(got)
            assert status == 429
            assert "clients.max_body_bytes_held" in message
            # A body of unknown size is counted as its chunks arrive: refused once past the bound.
            unannounced = {"x-gateway-inference-fairness-id": "team-c"}
            part = ext_proc.HttpBody(body=b"x" * 3000, end_of_stream=False)
            got = await _exchange(
                picker,
                [
                    request_headers(extra=unannounced),
                    ext_proc.ProcessingRequest(request_body=part),
                    ext_proc.ProcessingRequest(request_body=part),
                ],
            )
            status, _, message = _rejection(got)
            assert status == 429
            assert "clients.max_body_bytes_held" in message
            assert (gate.clients(), gate.body_bytes) == (0, 0)
        finally:
            await running.close()
        # A body that does not arrive within clients.body_timeout_s: 408, and nothing stays held.
        running = await _picker(fleet.urls, settings={"clients": {"body_timeout_s": 0.3}})
        picker = _service(running)
        gate = picker.clients
        try:
            stalled = _Gateway(picker)
            part = ext_proc.HttpBody(body=b'{"model":', end_of_stream=False)
            stalled.send(request_headers(extra=team), ext_proc.ProcessingRequest(request_body=part))
            await stalled.task
            status, kind, message = _rejection(stalled.answers)
            assert (status, kind) == (408, "RequestTimeoutError")
            assert "clients.body_timeout_s" in message
            assert (gate.clients(), gate.body_bytes) == (0, 0)
        finally:
            await running.close()


async def test_a_request_through_an_adapter_reaches_the_engine_with_its_lora_request() -> None:
    """The picker sends the engine the body with the adapter's ``lora_request`` (what
    trtllm-serve reads; the gateway forwards the picker's body) and hashes with the adapter."""
    async with mock_fleet(engines=1, loras=("sql",)) as fleet:
        running = await _picker(
            fleet.urls, settings={"loras": [{"name": "sql", "path": "/models/loras/sql"}]}
        )
        picker = _service(running)
        try:
            sent = json.dumps({"model": "sql", "prompt": list(range(300, 400)), "max_tokens": 1}).encode()
            got = await _exchange(picker, [request_headers(), *request_body(sent)])
            forwarded = json.loads(
                b"".join(a.request_body.response.body_mutation.streamed_response.body for a in got[1:])
            )
            assert forwarded["lora_request"] == {
                "lora_name": "sql",
                "lora_int_id": lora_int_id("sql"),
                "lora_path": "/models/loras/sql",
            }
            assert {k: v for k, v in forwarded.items() if k != "lora_request"} == json.loads(sent)
            assert picker.router.adapters.loads == 1  # the picker charged the adapter's load
        finally:
            await running.close()
