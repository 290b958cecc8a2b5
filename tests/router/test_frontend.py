"""The HTTP frontend against real mocked engines (and small fake workers for failures)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from copse.router.config import RouterConfig, parse_config
from copse.router.frontend import _ClientStream
from copse.router.metrics import DISAGGREGATED_ROUTES
from copse.router.migration import StreamProgress
from copse.router.policies import RouteRequest
from copse.router.server import RunningRouter, start_router
from copse.router.tokens import PromptTokenizer
from copse.workers.mocker import EngineConfig
from copse.workers.protocol.openai_api import ChatCompletionRequest
from copse.workers.testing import mock_fleet

from .conftest import eventually

MODEL = "mock-model"


def _config(urls: list[str], **extra: Any) -> RouterConfig:
    raw: dict[str, Any] = {
        "model": MODEL,
        "engine": "mock",
        "port": 0,
        "block_size": 32,
        "discovery": {"kind": "static", "workers": [{"url": url} for url in urls]},
        "health_interval_s": 0.05,
        "seed": 1,
    }
    raw.update(extra)
    return parse_config(raw, source="test")


async def _started(config: RouterConfig, workers: int) -> RunningRouter:
    running = await start_router(config, router_id="test-router")
    await eventually(lambda: len(running.service.router.workers) == workers)
    return running


async def _sse(response: aiohttp.ClientResponse) -> list[Any]:
    events: list[Any] = []
    async for line in response.content:
        if line.startswith(b"data:"):
            data = line[5:].strip()
            events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


PROMPT = list(range(300, 300 + 200))


async def test_streams_a_completion_and_exposes_health_models_and_metrics() -> None:
    async with mock_fleet(engines=2) as fleet:
        running = await _started(_config(fleet.urls, slo={"ttft_ms": 60_000, "itl_ms": 10_000}), 2)
        try:
            async with aiohttp.ClientSession() as http:
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}
                async with http.post(f"{running.url}/v1/completions", json=body) as response:
                    assert response.status == 200
                    assert response.headers["Content-Type"].startswith("text/event-stream")
                    events = await _sse(response)
                assert events[-1] == "[DONE]"
                texts = [e["choices"][0]["text"] for e in events[:-1] if e["choices"]]
                assert len(texts) == 5
                async with http.post(
                    f"{running.url}/v1/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": "hi there"}],
                        "max_tokens": 3,
                    },
                ) as response:
                    chat = await response.json()
                assert chat["choices"][0]["message"]["content"]
                async with http.get(f"{running.url}/v1/models") as response:
                    assert (await response.json())["data"][0]["id"] == MODEL
                async with http.get(f"{running.url}/health") as response:
                    assert response.status == 200
                    assert (await response.json())["workers"] == 2
                async with http.get(f"{running.url}/metrics") as response:
                    metrics = await response.text()
            assert "copse_router_time_to_first_token_seconds_count 1.0" in metrics
            # 5 streamed tokens + the chat answer's usage count (3); both prompts were measured.
            assert "copse_router_output_tokens_total 8.0" in metrics
            # one length per answer: 3 tokens in (2, 4], 5 in (4, 8]
            assert 'copse_router_output_length_tokens_bucket{le="4.0"} 1.0' in metrics
            assert 'copse_router_output_length_tokens_bucket{le="8.0"} 2.0' in metrics
            assert "copse_router_prompt_length_tokens_count 2.0" in metrics
            # each prompt less what its worker was predicted to hold: the planner's prefill tail
            series = dict(re.findall(r"^(copse_router_\w+) ([\d.e+]+)$", metrics, re.MULTILINE))
            assert "copse_router_uncached_prompt_tokens_count 2.0" in metrics
            assert float(series["copse_router_uncached_prompt_tokens_sum"]) == float(
                series["copse_router_prompt_tokens_total"]
            ) - float(series["copse_router_predicted_cached_tokens_total"])
            assert 'copse_router_requests_total{status="200"} 2.0' in metrics
            # both within the (generous) SLO: the stream by its TTFT and mean gap, the chat by its answer
            assert 'copse_router_slo_requests_total{outcome="met"} 2.0' in metrics
            assert "copse_router_worker_inflight_requests" in metrics
            assert running.service.router.sequences.requests.sum() == 0  # everything was released
        finally:
            await running.close()


async def test_bad_input_unknown_model_and_no_workers() -> None:
    async with mock_fleet(engines=1) as fleet:
        running = await _started(_config(fleet.urls), 1)
        try:
            async with aiohttp.ClientSession() as http:
                bad = {"model": MODEL, "prompt": PROMPT, "max_tokens": "5"}
                async with http.post(f"{running.url}/v1/completions", json=bad) as response:
                    assert response.status == 400
                    error = await response.json()
                async with http.post(f"{fleet.urls[0]}/v1/completions", json=bad) as response:
                    assert error == await response.json()  # the same 400 the workers give
                assert error["error"]["param"] == "max_tokens"
                other = {"model": "gpt-9", "prompt": PROMPT}
                async with http.post(f"{running.url}/v1/completions", json=other) as response:
                    assert response.status == 404
                    assert "gpt-9" in (await response.json())["error"]["message"]
                await fleet.servers[0].stop()  # the only worker dies
                await eventually(lambda: not running.service.router.workers)
                async with http.get(f"{running.url}/health") as response:
                    assert response.status == 503
                good = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
                async with http.post(f"{running.url}/v1/completions", json=good) as response:
                    assert response.status == 503
                    assert response.headers["Retry-After"] == "1"
        finally:
            await running.close()


def _padded_chat(size: int) -> bytes:
    """A chat request of ``size`` bytes whose prompt is short: JSON whitespace between its fields
    (what the size limit is about is bytes; a prompt that long would not fit a mock engine)."""
    head = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})[:-1] + ","
    tail = '"max_tokens": 3}'
    return (head + " " * (size - len(head) - len(tail)) + tail).encode()


async def test_large_bodies_pass_up_to_the_limit_and_every_error_is_an_openai_error() -> None:
    async with mock_fleet(engines=1) as fleet:
        running = await _started(_config(fleet.urls), 1)  # the default limit, 64 MiB
        try:
            async with aiohttp.ClientSession() as http:
                body = _padded_chat(20_000_000)
                headers = {"Content-Type": "application/json"}
                url = f"{running.url}/v1/chat/completions"
                async with http.post(url, data=body, headers=headers) as response:
                    assert response.status == 200, await response.text()
                    assert (await response.json())["choices"][0]["message"]["content"]
                # mocked engines take any size, as trtllm-serve does
                engine = f"{fleet.urls[0]}/v1/chat/completions"
                async with http.post(engine, data=body, headers=headers) as response:
                    assert response.status == 200
        finally:
            await running.close()
        running = await _started(_config(fleet.urls, max_body_bytes=1024 * 1024), 1)
        try:
            async with aiohttp.ClientSession() as http:
                url = f"{running.url}/v1/chat/completions"
                async with http.post(url, data=_padded_chat(1024 * 1024), headers=headers) as response:
                    assert response.status == 200  # exactly the limit
                async with http.post(url, data=_padded_chat(1024 * 1024 + 1), headers=headers) as response:
                    assert response.status == 413
                    assert response.content_type == "application/json"
                    assert await response.json() == {
                        "error": {
                            "message": "request body over 1048576 bytes (max_body_bytes)",
                            "type": "RequestTooLargeError",
                            "param": None,
                            "code": 413,
                        }
                    }
                async with http.get(f"{running.url}/v1/chat/completions") as response:
                    assert response.status == 405
                    assert (await response.json())["error"]["type"] == "MethodNotAllowedError"
                async with http.post(f"{running.url}/v1/embeddings", json={}) as response:
                    assert response.status == 404
                    error = (await response.json())["error"]
                    assert error["type"] == "NotFoundError"
            metrics = running.service.metrics.requests
            assert metrics.labels(status="413")._value.get() == 1
        finally:
            await running.close()


@pytest.fixture
async def fake_worker() -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """A worker that is healthy but misbehaves as ``state['mode']`` says."""
    state: dict[str, Any] = {"mode": "error", "hits": 0, "release": asyncio.Event()}

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def info(_: web.Request) -> web.Response:
        return web.json_response({"worker_id": "fake", "block_size": 32, "num_blocks": 1000})

    async def completions(request: web.Request) -> web.StreamResponse:
        state["hits"] += 1
        if state["mode"] == "error":
            return web.Response(status=500, text="engine crashed")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if state["mode"] == "hold":
            await state["release"].wait()
        if state["mode"] == "split":
            # three events in one write, then the rest in 7-byte pieces that cut lines anywhere
            events = [
                {
                    "id": "x",
                    "object": "text_completion",
                    "model": MODEL,
                    "choices": [{"index": 0, "text": f" t{i}"}],
                }
                for i in range(6)
            ]
            sse = (
                b"".join(f"data: {json.dumps(event)}\n\n".encode() for event in events) + b"data: [DONE]\n\n"
            )
            cut = sse.index(b"data:", sse.index(b" t3"))
            await response.write(sse[:cut])
            for start in range(cut, len(sse), 7):
                await asyncio.sleep(0.005)
                await response.write(sse[start : start + 7])
            return response
        chunk = {
            "id": "x",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": " a"}],
        }
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if state["mode"] == "break":
            assert request.transport is not None
            request.transport.close()  # dies mid-stream
            return response
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.add_routes(
        [web.get("/health", health), web.get("/worker_info", info), web.post("/v1/completions", completions)]
    )
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    yield f"http://{host}:{port}", state
    state["release"].set()
    await runner.cleanup()


async def test_a_worker_failing_before_the_first_token_is_retried_elsewhere(
    fake_worker: tuple[str, dict[str, Any]],
) -> None:
    url, state = fake_worker
    async with mock_fleet(engines=1) as fleet:
        running = await _started(_config([url, *fleet.urls], policy="round_robin"), 2)
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(2):  # round robin sends one of the two to the broken worker
                    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
                    async with http.post(f"{running.url}/v1/completions", json=body) as response:
                        assert response.status == 200
                        events = await _sse(response)
                    assert events[-1] == "[DONE]"
                    assert all("error" not in e for e in events if isinstance(e, dict))
            assert state["hits"] >= 1
            assert running.service.metrics.retries._value.get() >= 1
        finally:
            await running.close()


async def test_a_retry_elsewhere_is_neither_charged_nor_rate_limited_again(
    fake_worker: tuple[str, dict[str, Any]],
) -> None:
    """Two requests of a tenant whose limit takes two and no more, failed by the broken worker
    and retried on the other: both are answered, each counted and charged once."""
    url, state = fake_worker
    tokens = len(PROMPT) + 3
    tenants = {"team-a": {"tokens_per_minute": 2 * tokens + tokens // 2}}
    async with mock_fleet(engines=1) as fleet:
        running = await _started(_config([url, *fleet.urls], policy="round_robin", tenants=tenants), 2)
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(2):  # round robin sends one of the two to the broken worker
                    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
                    headers = {"x-gateway-inference-fairness-id": "team-a"}
                    async with http.post(
                        f"{running.url}/v1/completions", json=body, headers=headers
                    ) as response:
                        assert response.status == 200, await response.text()
            metrics = running.service.metrics
            assert metrics.retries._value.get() == state["hits"] >= 1, "each hit of the broken one retried"
            assert metrics.class_admitted.labels("default", "team-a")._value.get() == 2
            assert running.service.router._queue._bands[0].served["team-a"] == 2 * tokens
        finally:
            await running.close()


async def test_a_worker_failing_mid_stream_ends_it_with_an_error_event(
    fake_worker: tuple[str, dict[str, Any]],
) -> None:
    url, state = fake_worker
    state["mode"] = "break"
    running = await _started(_config([url]), 1)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
            async with http.post(f"{running.url}/v1/completions", json=body) as response:
                assert response.status == 200
                events = await _sse(response)
        assert events[0]["choices"][0]["text"] == " a"
        assert events[-1]["error"]["code"] == 502
        assert "[DONE]" not in events
    finally:
        await running.close()


async def test_events_packed_into_one_read_or_cut_across_reads_reach_the_client_whole(
    fake_worker: tuple[str, dict[str, Any]],
) -> None:
    url, state = fake_worker
    state["mode"] = "split"
    running = await _started(_config([url]), 1)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": True}
            async with http.post(f"{running.url}/v1/completions", json=body) as response:
                assert response.status == 200
                events = await _sse(response)
        assert [e["choices"][0]["text"] for e in events[:-1]] == [f" t{i}" for i in range(6)]
        assert events[-1] == "[DONE]"
    finally:
        await running.close()


async def test_a_full_queue_sheds_with_429_and_retry_after(fake_worker: tuple[str, dict[str, Any]]) -> None:
    url, state = fake_worker
    state["mode"] = "hold"
    slo = {"ttft_ms": 60_000, "itl_ms": 10_000}
    running = await _started(_config([url], queue_size=0, busy_prefill_tokens=10, slo=slo), 1)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
            first = asyncio.create_task(http.post(f"{running.url}/v1/completions", json=body))
            await eventually(lambda: running.service.router.sequences.prefill_tokens.sum() > 10)
            async with http.post(f"{running.url}/v1/completions", json=body) as response:
                assert response.status == 429, "shed: workers exist but are saturated (503 means none)"
                assert response.headers["Retry-After"] == "1"
                assert "busy" in (await response.json())["error"]["message"]
            state["release"].set()
            held = await first
            assert held.status == 200
            held.release()
        # the refusal is a miss the latency histograms never see
        assert running.service.metrics.slo_requests.labels("refused")._value.get() == 1
    finally:
        await running.close()


async def test_requests_wait_in_the_queue_until_a_worker_frees(
    fake_worker: tuple[str, dict[str, Any]],
) -> None:
    url, state = fake_worker
    state["mode"] = "hold"
    running = await _started(_config([url], queue_size=4, busy_prefill_tokens=10), 1)
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
            first = asyncio.create_task(http.post(f"{running.url}/v1/completions", json=body))
            await eventually(lambda: running.service.router.sequences.prefill_tokens.sum() > 10)
            second = asyncio.create_task(http.post(f"{running.url}/v1/completions", json=body))
            await eventually(lambda: running.service.router.queued == 1)
            state["release"].set()
            for task in (first, second):
                response = await task
                assert response.status == 200
                assert (await _sse(response))[-1] == "[DONE]"
    finally:
        await running.close()


async def test_more_streams_than_a_connection_pool_holds_all_reach_the_worker_at_once(
    fake_worker: tuple[str, dict[str, Any]],
) -> None:
    """The router caps streams with its queue and busy thresholds only: 150 held streams are all on
    the worker together (aiohttp's default pool held the 101st back until one of them ended)."""
    url, state = fake_worker
    state["mode"] = "hold"
    streams = 150
    unbounded = {"max_requests": streams, "max_streams": streams}  # one client (this test) sends them all
    config = _config([url], busy_prefill_tokens=1e9, busy_kv_fraction=1e9, clients=unbounded)
    running = await _started(config, 1)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
            tasks = [
                asyncio.create_task(http.post(f"{running.url}/v1/completions", json=body))
                for _ in range(streams)
            ]
            await eventually(lambda: state["hits"] == streams)
            assert running.service.router.queued == 0
            state["release"].set()
            for task in tasks:
                response = await task
                assert response.status == 200
                assert (await _sse(response))[-1] == "[DONE]"
    finally:
        await running.close()


async def test_disaggregated_requests_prefill_on_one_worker_and_decode_on_another() -> None:
    async with (
        mock_fleet(engines=1, config=EngineConfig(role="prefill")) as prefill,
        mock_fleet(engines=1, config=EngineConfig(role="decode")) as decode,
    ):
        workers = [{"url": prefill.urls[0], "role": "prefill"}, {"url": decode.urls[0], "role": "decode"}]
        config = _config([], discovery={"kind": "static", "workers": workers})
        running = await _started(config, 2)
        try:
            async with aiohttp.ClientSession() as http:
                long_prompt = list(range(5000, 5000 + 2048))
                body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 6, "stream": True}
                async with http.post(f"{running.url}/v1/completions", json=body) as response:
                    assert response.status == 200
                    events = await _sse(response)
                assert events[-1] == "[DONE]"
                assert len([e for e in events[:-1] if e["choices"]]) == 6
                assert prefill.servers[0].engine.prompt_tokens_total == 2048  # the context phase ran there
                assert decode.servers[0].engine.prompt_tokens_total == 2048  # and the generation phase here
            assert running.service.router.sequences.requests.sum() == 0
            # Counted by the revisions of the pair (static workers carry none).
            routes = running.service.metrics.registry.get_sample_value(
                f"{DISAGGREGATED_ROUTES}_total", {"prefill_revision": "", "decode_revision": ""}
            )
            assert routes == 1
            assert [w["revision"] for w in running.service.workers_report()] == [None, None]
        finally:
            await running.close()


class _PodWatch:
    """A pod API whose watch delivers what the test pushes (label changes, deletions)."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.events: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()

    async def list_pods(self, *, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        return list(self.pods), "1"

    async def watch_pods(
        self, *, namespace: str, selector: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        while True:
            yield await self.events.get()

    async def list_pools(self, *, namespace: str, name: str) -> tuple[list[dict[str, Any]], str]:
        raise AssertionError("this router discovers pods by label, not through an InferencePool")

    async def watch_pools(
        self, *, namespace: str, name: str, resource_version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        raise AssertionError("this router discovers pods by label, not through an InferencePool")
        yield  # an async generator, like the real one


def _leader(*, draining: bool) -> dict[str, Any]:
    labels = {"copse.dev/role": "worker", **({"copse.dev/draining": "true"} if draining else {})}
    return {
        "metadata": {"name": "llama-worker-0-0", "labels": labels},
        "spec": {"nodeName": "node-a"},
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


async def test_a_draining_worker_finishes_its_stream_takes_nothing_new_and_reports_it() -> None:
    """The operator labels a group it removes ``copse.dev/draining=true``; the router stops sending
    it requests, lets the ones in flight finish and reports them at ``GET /workers``."""
    slow = EngineConfig(decode_speedup_ratio=0.2)  # a stream that lasts while the test looks at it
    async with mock_fleet(engines=1, config=slow) as fleet:
        port = int(fleet.urls[0].rsplit(":", 1)[1])
        pods = _PodWatch([_leader(draining=False)])
        discovery = {"kind": "kubernetes", "namespace": "serving", "selector": "x=y", "port": port}
        running = await start_router(_config([], discovery=discovery), router_id="t", pod_api=pods)
        await eventually(lambda: len(running.service.router.workers) == 1)

        async def workers(http: aiohttp.ClientSession) -> list[dict[str, Any]]:
            async with http.get(f"{running.url}/workers") as response:
                report: list[dict[str, Any]] = (await response.json())["workers"]
                return report

        try:
            async with aiohttp.ClientSession() as http:
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "stream": True}
                async with http.post(f"{running.url}/v1/completions", json=body) as stream:
                    first = await stream.content.readline()
                    assert first.startswith(b"data:")
                    await pods.events.put(("MODIFIED", _leader(draining=True)))
                    await eventually(lambda: running.service.workers_report()[0]["draining"])
                    [report] = await workers(http)
                    assert report["key"] == "llama-worker-0-0"
                    assert (report["draining"], report["in_flight"]) == (True, 1)
                    async with http.post(f"{running.url}/v1/completions", json=body) as refused:
                        assert refused.status == 503, "a draining worker takes no new request"
                    async with http.get(f"{running.url}/health") as health:
                        assert health.status == 503
                    events = await _sse(stream)
                assert events[-1] == "[DONE]"
                texts = [e for e in events[:-1] if e["choices"] and e["choices"][0]["text"]]
                assert len(texts) == 15, "the stream in flight ran to its end"
                await eventually(lambda: running.service.workers_report()[0]["in_flight"] == 0)
                await pods.events.put(("MODIFIED", _leader(draining=False)))
                await eventually(lambda: not running.service.workers_report()[0]["draining"])
                async with http.post(
                    f"{running.url}/v1/completions", json={**body, "stream": False}
                ) as again:
                    assert again.status == 200
        finally:
            await running.close()


class _GatedTokenizer:
    """The mocked engines' tokenizer, whose encoding of a large prompt waits for the test."""

    def __init__(self, inner: PromptTokenizer, *, large: int) -> None:
        self.inner, self.large = inner, large
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []

    def completion_tokens(self, prompt: str, *, add_special_tokens: bool) -> list[int]:
        if len(prompt) >= self.large:
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            # On the event loop this would stall every stream (and the test) until it times out.
            if not self.release.wait(timeout=20):
                raise AssertionError("the large prompt was tokenized on the event loop")
        return self.inner.completion_tokens(prompt, add_special_tokens=add_special_tokens)

    def chat_tokens(self, request: ChatCompletionRequest) -> list[int]:
        return self.inner.chat_tokens(request)


async def test_a_large_prompt_tokenizes_off_the_event_loop_while_other_streams_flow() -> None:
    large = " ".join(f"word{i}" for i in range(20_000))  # ~190 kB, over tokenize_inline_bytes
    async with mock_fleet(engines=1) as fleet:
        running = await _started(_config(fleet.urls, tokenize_inline_bytes=64 * 1024), 1)
        gated = _GatedTokenizer(running.service.tokenizer, large=len(large))
        running.service.tokenizer = gated
        try:
            async with aiohttp.ClientSession() as http:
                big = asyncio.create_task(
                    http.post(
                        f"{running.url}/v1/completions",
                        json={"model": MODEL, "prompt": large, "max_tokens": 2},
                    )
                )
                await eventually(gated.entered.is_set)
                body = {"model": MODEL, "prompt": "a small one", "max_tokens": 8, "stream": True}
                async with http.post(f"{running.url}/v1/completions", json=body) as response:
                    events = await _sse(response)
                assert not gated.release.is_set()  # it streamed to its end while the large one encoded
                assert events[-1] == "[DONE]"
                assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1] if e["choices"]) == 8
                gated.release.set()
                answer = await big
                assert answer.status == 200
                usage = (await answer.json())["usage"]
                answer.release()
            assert gated.threads
            assert all(name.startswith("copse-tokenize") for name in gated.threads)
            # the same tokens as on the loop: the engine's own count of the prompt
            assert usage["prompt_tokens"] == len(
                gated.inner.completion_tokens(large, add_special_tokens=True)
            )
        finally:
            gated.release.set()
            await running.close()


async def test_tenants_over_their_token_rate_get_429_and_requests_are_counted_by_objective_and_tenant() -> (
    None
):
    async with mock_fleet(engines=1) as fleet:
        config = _config(
            fleet.urls,
            objectives={"premium": {"priority": 100, "ttft_ms": 2000}},
            tenants={"team-a": {"tokens_per_minute": 60}},
            slo={"ttft_ms": 60_000, "itl_ms": 10_000},
        )
        running = await _started(config, 1)
        try:
            async with aiohttp.ClientSession() as http:
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 40}
                team_a = {
                    "x-gateway-inference-fairness-id": "team-a",
                    "x-gateway-inference-objective": "premium",
                }
                async with http.post(f"{running.url}/v1/completions", json=body, headers=team_a) as response:
                    assert response.status == 200, "the first request fits the minute's allowance"
                async with http.post(f"{running.url}/v1/completions", json=body, headers=team_a) as response:
                    assert response.status == 429
                    assert int(response.headers["Retry-After"]) >= 1
                    assert "team-a" in (await response.json())["error"]["message"]
                team_b = {"x-gateway-inference-fairness-id": "team-b"}
                async with http.post(f"{running.url}/v1/completions", json=body, headers=team_b) as response:
                    assert response.status == 200, "another tenant is not limited"
                async with http.get(f"{running.url}/metrics") as response:
                    metrics = await response.text()
            assert 'copse_router_class_admitted_total{objective="premium",tenant="team-a"} 1.0' in metrics
            assert 'copse_router_class_rate_limited_total{objective="premium",tenant="team-a"} 1.0' in metrics
            assert 'copse_router_class_admitted_total{objective="default",tenant="team-b"} 1.0' in metrics
            assert 'copse_router_requests_total{status="429"} 1.0' in metrics
            # a tenant's excess is its own, not a miss of the fleet's SLO: the planner must not size for it
            slo = running.service.metrics.slo_requests
            assert slo.labels("refused")._value.get() == 0
            assert slo.labels("met")._value.get() == 2
        finally:
            await running.close()


async def test_a_client_that_leaves_after_done_ends_its_stream_without_blaming_the_worker() -> None:
    class LeftAfterDone(web.StreamResponse):
        async def write_eof(self, data: bytes = b"") -> None:
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")

    stream = _ClientStream(
        progress=StreamProgress(prompt=(1, 2, 3), requested=4),
        arrived=0.0,
        request=RouteRequest(request_id="r", hashes=[], prompt_tokens=3, max_tokens=4),
        write_timeout_s=1.0,
        client=LeftAfterDone(),
    )
    await stream.end()  # the chunked terminator's failed write is not an error the worker caused
