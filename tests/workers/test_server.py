"""The mocked engines' HTTP surface, driven by real clients on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest

from copse.workers.mocker import Engine, EngineConfig, server
from copse.workers.mocker.clock import RealClock, VirtualClock
from copse.workers.mocker.server import EngineServer, _Stream
from copse.workers.perf import PolynomialPerfModel
from copse.workers.protocol import KvDump
from copse.workers.protocol.tokenizer import encode, render_chat
from copse.workers.testing import mock_fleet

PERF = PolynomialPerfModel()


async def _eventually(condition: Callable[[], bool], *, timeout_s: float = 10.0) -> None:
    """Wait for a condition the server reaches asynchronously (polled, bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


async def test_openai_client_streams_completions_and_chat() -> None:
    async with mock_fleet(virtual_clock=True) as fleet:
        client = openai.AsyncOpenAI(base_url=f"{fleet.urls[0]}/v1", api_key="unused")
        stream = await client.completions.create(
            model="mock-model",
            prompt=list(range(300, 400)),
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        texts: list[str] = []
        finish: list[str | None] = []
        usage = None
        async for chunk in stream:
            if chunk.choices:
                texts.append(chunk.choices[0].text)
                finish.append(chunk.choices[0].finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage
        assert len(texts) == 5
        assert all(text.startswith(" ") for text in texts)
        assert finish == [None, None, None, None, "length"]
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (100, 5)

        chat = await client.chat.completions.create(
            model="mock-model",
            messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=4,
            stream=True,
        )
        deltas = [chunk.choices[0].delta async for chunk in chat if chunk.choices]
        assert deltas[0].role == "assistant"
        assert len([d for d in deltas if d.content]) == 4

        whole = await client.chat.completions.create(
            model="mock-model", messages=[{"role": "user", "content": "Hello there"}], max_tokens=3
        )
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage is not None
        prompt = encode(render_chat([("user", "Hello there")]))
        assert whole.usage.prompt_tokens == len(prompt)
        await client.close()


async def test_ttft_and_itl_in_metrics_follow_the_perf_model_on_a_virtual_clock() -> None:
    async with mock_fleet(virtual_clock=True) as fleet, httpx.AsyncClient(base_url=fleet.urls[0]) as http:
        reply = await http.post(
            "/v1/completions", json={"model": "mock-model", "prompt": list(range(256, 1256)), "max_tokens": 3}
        )
        assert reply.status_code == 200
        assert reply.json()["usage"]["completion_tokens"] == 3
        metrics = (await http.get("/prometheus/metrics")).text
        ttft = PERF.prefill_ms(new_tokens=1000) / 1000
        itl = [PERF.decode_itl_ms(active_kv_tokens=n, context_length=n) / 1000 for n in (1001, 1002)]
        values = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("trtllm_") and ("_sum{" in line or "_count{" in line or "_total{" in line)
        }
        assert values["trtllm_time_to_first_token_seconds_sum"] == pytest.approx(ttft)
        assert values["trtllm_time_per_output_token_seconds_count"] == 2
        assert values["trtllm_time_per_output_token_seconds_sum"] == pytest.approx(sum(itl))
        assert values["trtllm_prompt_tokens_total"] == 1000
        assert values["trtllm_generation_tokens_total"] == 3
        assert 'trtllm_num_requests_running{engine_type="aggregated",model_name="mock-model"} 0.0' in metrics
        assert "trtllm_kv_cache_utilization" in metrics
        # GET /metrics: TensorRT-LLM's JSON iteration stats since the last call.
        stats = (await http.get("/metrics")).json()
        assert [entry["iter"] for entry in stats] == list(range(1, len(stats) + 1))
        assert sum(entry["numCompletedRequests"] for entry in stats) == 1
        first = stats[0]
        assert first["iterLatencyMS"] == pytest.approx(ttft * 1000)
        assert first["inflightBatchingStats"]["numScheduledRequests"] == 1
        kv = stats[-1]["kvCacheStats"]
        assert kv["tokensPerBlock"] == 32
        assert kv["usedNumBlocks"] + kv["freeNumBlocks"] == kv["maxNumBlocks"]
        assert (await http.get("/metrics")).json() == []  # drained


async def test_a_late_event_loop_delays_tokens_but_does_not_slow_the_engine() -> None:
    # Steps start when the previous one ended, not when the process gets round to them: a loop
    # blocked mid-stream (a loaded machine, other engines in the process) is caught up on.
    max_tokens = 12
    async with mock_fleet() as fleet, httpx.AsyncClient(base_url=fleet.urls[0], timeout=30) as http:
        body = {
            "model": "mock-model",
            "prompt": list(range(256, 1256)),
            "max_tokens": max_tokens,
            "stream": True,
        }
        async with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data:"):
                    time.sleep(0.3)  # blocks every engine step of the process for 300 ms
                    break
            rest = [line async for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
        metrics = (await http.get("/prometheus/metrics")).text
    e2e = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("trtllm_e2e_request_latency_seconds_sum{")
    ]
    itl = [
        PERF.decode_itl_ms(active_kv_tokens=1000 + k, context_length=1000 + k) for k in range(1, max_tokens)
    ]
    assert e2e == [pytest.approx((PERF.prefill_ms(new_tokens=1000) + sum(itl)) / 1000, rel=1e-9)]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (b"{", None, "not valid JSON"),
        (json.dumps({"model": "m"}).encode(), "prompt", "field required"),
        (json.dumps({"model": "m", "prompt": "x", "max_tokens": 0}).encode(), "max_tokens", ">= 1"),
        (json.dumps({"model": "m", "prompt": [1, "a"]}).encode(), "prompt", "prompt[1]"),
        (json.dumps({"model": "m", "prompt": "x", "color": "red"}).encode(), "color", "unknown field"),
        (json.dumps({"model": "m", "prompt": [300] * 200_000}).encode(), "prompt", "context"),
        (json.dumps({"model": "m", "prompt": "x", "max_tokens": 200_000}).encode(), "max_tokens", "context"),
    ],
)
async def test_bad_requests_get_400_naming_the_field(body: bytes, param: str | None, fragment: str) -> None:
    async with mock_fleet() as fleet, httpx.AsyncClient(base_url=fleet.urls[0]) as http:
        reply = await http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["param"] == param
        assert fragment in error["message"].replace("greater than or equal to", ">=")
        assert error["code"] == 400


async def test_overload_answers_503_with_retry_after() -> None:
    # one running, one waiting; every step takes minutes, so both stay put
    config = EngineConfig(max_num_seqs=1, max_waiting=1, speedup_ratio=1e-4)
    async with (
        mock_fleet(config=config) as fleet,
        httpx.AsyncClient(base_url=fleet.urls[0], timeout=30) as http,
    ):
        body = {"model": "m", "prompt": list(range(256, 300)), "max_tokens": 5, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as first:
            assert first.status_code == 200
            async with http.stream("POST", "/v1/completions", json=body) as second:
                assert second.status_code == 200
                third = await http.post("/v1/completions", json=body)
                assert third.status_code == 503
                assert third.headers["Retry-After"] == "1"
                assert "queued" in third.json()["error"]["message"]


async def test_a_client_that_disconnects_frees_its_blocks() -> None:
    config = EngineConfig(speedup_ratio=0.05)  # ~0.1 s per decode step: the request is still running
    async with mock_fleet(config=config) as fleet:
        engine = fleet.servers[0].engine
        async with httpx.AsyncClient(base_url=fleet.urls[0], timeout=30) as http:
            body = {"model": "m", "prompt": list(range(256, 1256)), "max_tokens": 1000, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                async for line in reply.aiter_lines():
                    if line.startswith("data:"):
                        break  # first token seen; now hang up
            assert engine.blocks.used_blocks > 0 or engine.requests
        await _eventually(lambda: not engine.requests and engine.blocks.used_blocks == 0)
        assert len(engine.blocks.inactive) >= 31  # what it computed stays cached for reuse

        # a non-streaming client that gives up is aborted too
        async with httpx.AsyncClient(base_url=fleet.urls[0], timeout=0.5) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/completions", json={**body, "stream": False})
        await _eventually(lambda: not engine.requests and engine.blocks.used_blocks == 0)


async def test_kv_cache_events_drain_and_dump() -> None:
    async with mock_fleet(virtual_clock=True) as fleet, httpx.AsyncClient(base_url=fleet.urls[0]) as http:
        await http.post(
            "/v1/completions", json={"model": "m", "prompt": list(range(256, 356)), "max_tokens": 1}
        )
        events = (await http.post("/kv_cache_events")).json()
        assert events[0]["data"]["type"] == "created"
        stored = [e for e in events if e["data"]["type"] == "stored"]
        assert sum(len(e["data"]["blocks"]) for e in stored) == 3  # 100 tokens, blocks of 32
        assert (await http.post("/kv_cache_events")).json() == []  # drained
        dump = KvDump.model_validate_json((await http.get("/kv_dump")).content)
        assert {b.block_hash for b in dump.blocks} == {
            b["block_hash"] for e in stored for b in e["data"]["blocks"]
        }
        info = (await http.get("/worker_info")).json()
        assert info["worker_id"] == dump.worker_id
        assert info["block_size"] == 32
        assert (await http.post("/reset_prefix_cache")).json() == {"reset": True}
        cleared = (await http.post("/kv_cache_events")).json()
        assert cleared[-1]["data"]["type"] == "removed"
        assert len(cleared[-1]["data"]["block_hashes"]) == 3
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/v1/models")).json()["data"][0]["id"] == "mock-model"


async def test_disaggregated_context_then_generation() -> None:
    async with (
        mock_fleet(config=EngineConfig(role="prefill"), virtual_clock=True) as prefill,
        mock_fleet(config=EngineConfig(role="decode"), virtual_clock=True) as decode,
        httpx.AsyncClient() as http,
    ):
        prompt = list(range(256, 556))
        wrong = await http.post(f"{prefill.urls[0]}/v1/completions", json={"model": "m", "prompt": prompt})
        assert wrong.status_code == 400
        assert wrong.json()["error"]["param"] == "disaggregated_params"
        context = await http.post(
            f"{prefill.urls[0]}/v1/completions",
            json={
                "model": "m",
                "prompt": prompt,
                "max_tokens": 8,
                "disaggregated_params": {"request_type": "context_only"},
            },
        )
        assert context.status_code == 200
        choice = context.json()["choices"][0]
        params = choice["disaggregated_params"]
        assert params["request_type"] == "context_only"
        assert len(params["first_gen_tokens"]) == 1
        assert choice["token_ids"] == params["first_gen_tokens"]
        generation = await http.post(
            f"{decode.urls[0]}/v1/completions",
            json={
                "model": "m",
                "prompt": prompt,
                "max_tokens": 8,
                "disaggregated_params": {**params, "request_type": "generation_only"},
            },
        )
        assert generation.status_code == 200
        tokens = generation.json()["choices"][0]["token_ids"]
        assert len(tokens) == 8
        assert tokens[0] == params["first_gen_tokens"][0]
        missing = await http.post(
            f"{decode.urls[0]}/v1/completions",
            json={
                "model": "m",
                "prompt": prompt,
                "disaggregated_params": {"request_type": "generation_only"},
            },
        )
        assert missing.json()["error"]["param"] == "disaggregated_params.first_gen_tokens"
        # A short prompt the router keeps on the decode engine is prefilled there.
        whole = await http.post(f"{decode.urls[0]}/v1/completions", json={"model": "m", "prompt": prompt})
        assert whole.status_code == 200
        assert len(whole.json()["choices"][0]["token_ids"]) == 32  # the default max_tokens
        context_here = await http.post(
            f"{decode.urls[0]}/v1/completions",
            json={"model": "m", "prompt": prompt, "disaggregated_params": {"request_type": "context_only"}},
        )
        assert context_here.status_code == 400


async def test_a_chunked_request_body_is_read_whole() -> None:
    """A gateway that rewrites the body (Envoy's ext_proc in FULL_DUPLEX_STREAMED mode) drops
    Content-Length and sends it chunked."""
    body = json.dumps({"model": "mock-model", "prompt": list(range(300, 400)), "max_tokens": 3}).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 50):
            yield body[start : start + 50]

    async with mock_fleet(virtual_clock=True) as fleet, httpx.AsyncClient() as client:
        response = await client.post(f"{fleet.urls[0]}/v1/completions", content=pieces())
        assert response.request.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in response.request.headers
        assert response.status_code == 200
        assert response.json()["usage"]["prompt_tokens"] == 100


async def test_large_bodies_are_parsed_and_tokenized_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A multi-megabyte prompt must not stall the engine's loop (its steps and its /health: the
    abuse soak saw a router drop a mocked engine whose loop parsed an 8 MiB prompt for seconds)."""
    threads: list[str] = []
    parse = server._completion_prompt

    def recording(raw: bytes) -> tuple[Any, tuple[int, ...]]:
        threads.append(threading.current_thread().name)
        return parse(raw)

    monkeypatch.setattr(server, "_completion_prompt", recording)
    async with mock_fleet() as fleet, httpx.AsyncClient(base_url=fleet.urls[0], timeout=60) as http:
        for prompt in ("small", "x" * (2 * server.INLINE_BODY_BYTES)):
            body = {"model": "mock-model", "prompt": prompt, "max_tokens": 2}
            response = await http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
    main = threading.main_thread().name
    assert threads[0] == main
    assert threads[1] != main


async def test_tokens_that_come_while_a_chunk_is_written_are_still_sent() -> None:
    """The engine may finish a request while its handler writes the previous chunk (a client
    slow to read makes the write wait): the tokens of those steps still go out."""
    engine = Engine(worker_id="e0", config=EngineConfig(), perf=PolynomialPerfModel())
    engine_server = EngineServer(engine=engine, model_name="mock-model", clock=VirtualClock())
    request = engine.add_request(request_id="r", tokens=list(range(100, 400)), max_tokens=4, now_ms=0.0)
    stream = _Stream(request)
    tokens = engine_server._tokens(stream)

    now = [0.0]

    def step() -> None:
        end = engine.begin_step(now[0])
        assert end is not None
        now[0] = end
        engine.end_step()
        stream.wake.set()

    step()  # the prompt's step: the first token
    first = await anext(tokens)
    while engine.has_work():  # the rest, while the first chunk is being written
        step()
    rest = [new async for new in tokens]
    assert [*first, *(t for new in rest for t in new)] == list(request.output)
    assert len(request.output) == 4


async def test_stopping_the_engine_as_work_arrives_ends_its_wait() -> None:
    """A cancellation (stop()) arriving together with new work ends the step loop's wait (Python
    3.11's wait_for returned normally then, and the loop, and stop(), went on forever)."""
    engine = Engine(worker_id="e0", config=EngineConfig(), perf=PolynomialPerfModel())
    engine_server = EngineServer(engine=engine, model_name="mock-model", clock=RealClock())
    task = asyncio.create_task(engine_server._sleep_until_or_work(RealClock().now_ms() + 600_000.0))
    async with asyncio.timeout(60.0):
        while not engine_server._work._waiters:  # the task reaches its wait
            await asyncio.sleep(0)
    engine_server._work.set()
    task.cancel()
    await asyncio.wait({task}, timeout=60.0)
    assert task.cancelled()
