"""Request migration: streams whose worker fails after their first token go on, token-exactly, on
another worker (mocked engines, behind a proxy that breaks, hangs or errs on command)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from copse.router.config import RouterConfig, parse_config
from copse.router.migration import StreamProgress
from copse.router.server import RunningRouter, start_router
from copse.router.service import StreamMeter
from copse.workers.mocker import EngineConfig
from copse.workers.protocol.tokenizer import token_text
from copse.workers.testing import mock_fleet

from .conftest import eventually

MODEL = "mock-model"
PROMPT = list(range(1000, 1000 + 150))
CHAT = [{"role": "user", "content": "tell me about the trees of the forest"}]


# -- the continuation itself ----------------------------------------------------------------------


def _feed(progress: StreamProgress, *events: dict[str, Any]) -> None:
    """What the frontend does with an attempt's chunks."""
    meter = StreamMeter(ids=progress.output)
    for event in events:
        event_back, first = meter.feed(json.dumps(event).encode(), now=0.0)
        if first and progress.stream_id is None:
            assert isinstance(event_back, dict)
            progress.note_first(event_back)
    progress.absorb(untracked=meter.untracked, finished=meter.finished)


def test_a_continuation_carries_the_ids_and_the_remaining_budget() -> None:
    progress = StreamProgress(prompt=(5, 6, 7), requested=10)
    _feed(
        progress,
        {"id": "cmpl-1", "created": 42, "choices": [{"text": " a b", "token_ids": [100, 101]}]},
        {"id": "cmpl-1", "created": 42, "choices": [{"text": " c", "token_ids": [102]}]},
    )
    assert progress.resumable
    assert (progress.stream_id, progress.created) == ("cmpl-1", 42)
    original = {"model": MODEL, "prompt": "five six seven", "max_tokens": 10, "min_tokens": 5, "echo": True}
    body = progress.continuation(original, chat=False)
    assert body == {"model": MODEL, "prompt": (5, 6, 7, 100, 101, 102), "max_tokens": 7, "min_tokens": 2}
    assert original["prompt"] == "five six seven"  # the client's request is left alone
    chat = progress.continuation({"model": MODEL, "messages": CHAT, "max_completion_tokens": 10}, chat=True)
    assert chat["prompt_token_ids"] == (5, 6, 7, 100, 101, 102)
    assert chat["max_completion_tokens"] == 7
    assert "max_tokens" not in chat
    assert progress.continuation({"model": MODEL, "messages": CHAT}, chat=True)["max_tokens"] == 7


def test_a_continuation_chunk_keeps_the_first_id_drops_the_second_role_header_and_counts_usage() -> None:
    progress = StreamProgress(prompt=(5, 6, 7), requested=4)
    _feed(
        progress,
        {"id": "chatcmpl-1", "created": 42, "choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"id": "chatcmpl-1", "created": 42, "choices": [{"delta": {"content": " a"}, "token_ids": [9]}]},
    )
    progress.start_attempt()
    header = {"id": "chatcmpl-2", "created": 50, "choices": [{"delta": {"role": "assistant", "content": ""}}]}
    assert progress.rewrite(header) is None
    chunk = {"id": "chatcmpl-2", "created": 50, "choices": [{"delta": {"content": " b"}, "token_ids": [10]}]}
    assert progress.rewrite(chunk) == {
        "id": "chatcmpl-1",
        "created": 42,
        "choices": [{"delta": {"content": " b"}, "token_ids": [10]}],
    }
    # the second worker saw a prompt of 3 + 1 tokens and generated 3
    usage = {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    rewritten = progress.rewrite({"id": "chatcmpl-2", "choices": [], "usage": usage})
    assert rewritten is not None
    assert rewritten["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


def test_a_stream_without_token_ids_or_with_nothing_left_is_not_resumable() -> None:
    text_only = StreamProgress(prompt=(1,), requested=5)
    _feed(text_only, {"id": "x", "choices": [{"text": " a"}]})
    assert not text_only.resumable
    finished = StreamProgress(prompt=(1,), requested=5)
    _feed(finished, {"id": "x", "choices": [{"text": " a", "token_ids": [3], "finish_reason": "stop"}]})
    assert not finished.resumable
    assert finished.output == [3]


# -- against engines ------------------------------------------------------------------------------


@dataclass
class Flaky:
    """A worker that proxies a mocked engine and fails as told after ``after`` output chunks."""

    url: str
    engine: str
    mode: str = "pass"
    """pass | break (close the connection) | hang (send nothing more) | error (an error event) |
    reject (answer every request with a 400) | truncate (the whole stream, then close the
    connection before the end of the chunked body)."""
    after: int = 3
    tokens: int | None = None
    """With ``break``: close the connection once this many output tokens passed (the chunk that
    reaches it is cut to fit), instead of after ``after`` chunks (an engine's chunk may carry
    several tokens)."""
    healthy: bool = True
    requests: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)


@contextlib.asynccontextmanager
async def flaky(engine_url: str, *, name: str) -> AsyncIterator[Flaky]:
    state = Flaky(url="", engine=engine_url)
    session = aiohttp.ClientSession()

    async def health(_: web.Request) -> web.Response:
        if not state.healthy:
            await state.release.wait()  # answers nothing, like a stopped process
        return web.Response(status=200)

    async def info(_: web.Request) -> web.Response:
        async with session.get(f"{engine_url}/worker_info") as response:
            return web.json_response({**(await response.json()), "worker_id": name})

    async def generate(request: web.Request) -> web.StreamResponse:
        state.requests += 1
        if state.mode == "reject":
            error = {"object": "error", "message": "prompt too long", "type": "BadRequestError", "code": 400}
            return web.json_response(error, status=400)
        async with session.post(f"{engine_url}{request.path}", data=await request.read()) as upstream:
            response = web.StreamResponse(
                status=upstream.status, headers={"Content-Type": upstream.content_type}
            )
            await response.prepare(request)
            outputs = 0
            passed = 0
            async for line in upstream.content:
                if state.tokens is not None and state.mode == "break" and line.startswith(b"data: {"):
                    event = json.loads(line[5:])
                    choice = event["choices"][0] if event.get("choices") else {}
                    ids = choice.get("token_ids") or []
                    if ids and passed + len(ids) >= state.tokens:
                        kept = ids[: state.tokens - passed]
                        text = "".join(token_text(t) for t in kept)
                        choice.update(token_ids=kept, finish_reason=None)
                        if "delta" in choice:
                            choice["delta"]["content"] = text
                        else:
                            choice["text"] = text
                        await response.write(f"data: {json.dumps(event)}\n\n".encode())
                        assert request.transport is not None
                        request.transport.close()
                        return response
                    passed += len(ids)
                if line.startswith(b"data: {") and b"token_ids" in line:
                    outputs += 1
                    if outputs > state.after and state.mode != "pass" and state.tokens is None:
                        if state.mode == "break":
                            assert request.transport is not None
                            request.transport.close()
                            return response
                        if state.mode == "hang":
                            await state.release.wait()
                        if state.mode == "error":
                            await response.write(
                                b'data: {"error": {"message": "engine fault", "code": 500}}\n\n'
                            )
                            return response
                await response.write(line)
            if state.mode == "truncate":
                assert request.transport is not None
                request.transport.close()  # the chunked body never gets its terminator
            return response

    app = web.Application()
    app.add_routes(
        [
            web.get("/health", health),
            web.get("/worker_info", info),
            web.post("/v1/completions", generate),
            web.post("/v1/chat/completions", generate),
        ]
    )
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    state.url = f"http://{host}:{port}"
    try:
        yield state
    finally:
        state.release.set()
        await runner.cleanup()
        await session.close()


def _config(workers: list[dict[str, Any]], **extra: Any) -> RouterConfig:
    raw: dict[str, Any] = {
        "model": MODEL,
        "engine": "mock",
        "port": 0,
        "block_size": 32,
        "discovery": {"kind": "static", "workers": workers},
        "health_interval_s": 0.05,
        "health_timeout_s": 0.2,
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


def _body(chat: bool, max_tokens: int = 12) -> tuple[str, dict[str, Any]]:
    common = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        return "/v1/chat/completions", {**common, "messages": CHAT}
    return "/v1/completions", {**common, "prompt": PROMPT}


def _text(events: list[Any]) -> tuple[str, list[int]]:
    text = ""
    ids: list[int] = []
    for event in events:
        if isinstance(event, dict) and event.get("choices"):
            choice = event["choices"][0]
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            ids += choice.get("token_ids") or []
    return text, ids


async def _stream(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    async with aiohttp.ClientSession() as http, http.post(f"{url}{path}", json=body) as response:
        assert response.status == 200
        return await _sse(response)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("mode", ["break", "error"])
async def test_a_stream_whose_worker_fails_goes_on_elsewhere_token_exactly(chat: bool, mode: str) -> None:
    path, body = _body(chat)
    async with mock_fleet(engines=2) as fleet, flaky(fleet.urls[0], name="flaky") as bad:
        reference = await _stream(fleet.urls[1], path, body)
        bad.mode = mode
        config = _config([{"url": bad.url}, {"url": fleet.urls[1]}], policy="round_robin")
        running = await _started(config, 2)
        try:
            # round robin starts one of the two on the flaky worker
            both = [await _stream(running.url, path, body) for _ in range(2)]
        finally:
            await running.close()
    assert bad.requests == 1
    assert _text(both[0]) == _text(both[1])
    events = both[0] if len(both[0]) != len(reference) else both[1]  # the migrated one
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events if isinstance(e, dict))
    assert _text(events) == _text(reference)
    assert len(_text(events)[1]) == 12
    chunks = [e for e in events if isinstance(e, dict)]
    assert {e["id"] for e in chunks} == {chunks[0]["id"]}  # one stream, one id
    assert len({e["created"] for e in chunks}) == 1
    if chat:
        assert sum(1 for e in chunks if e["choices"] and "role" in e["choices"][0]["delta"]) == 1
    usage = chunks[-1]["usage"]
    expected_prompt = reference[-2]["usage"]["prompt_tokens"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (expected_prompt, 12)
    reason = "disconnected" if mode == "break" else "worker_error"
    metrics = running.service.metrics
    assert metrics.migrations.labels(reason=reason)._value.get() == 1
    assert running.service.router.sequences.requests.sum() == 0


async def test_a_silent_stream_moves_after_the_token_timeout() -> None:
    path, body = _body(chat=False, max_tokens=10)
    async with mock_fleet(engines=2) as fleet, flaky(fleet.urls[0], name="flaky") as bad:
        reference = await _stream(fleet.urls[1], path, body)
        bad.mode = "hang"
        config = _config(
            [{"url": bad.url}, {"url": fleet.urls[1]}], policy="round_robin", token_timeout_s=0.3
        )
        running = await _started(config, 2)
        try:
            both = [await _stream(running.url, path, body) for _ in range(2)]
        finally:
            await running.close()
    assert bad.requests == 1
    assert _text(both[0]) == _text(both[1]) == _text(reference)
    assert running.service.metrics.migrations.labels(reason="timeout")._value.get() == 1
    assert "flaky" in running.service.router.workers  # its probes still pass


async def test_the_streams_of_a_worker_that_stops_answering_move_when_probes_drop_it() -> None:
    path, body = _body(chat=False, max_tokens=10)
    async with mock_fleet(engines=2) as fleet, flaky(fleet.urls[0], name="flaky") as bad:
        reference = await _stream(fleet.urls[1], path, body)
        bad.mode = "hang"
        config = _config([{"url": bad.url}, {"url": fleet.urls[1]}], policy="round_robin")
        running = await _started(config, 2)
        try:
            both = [asyncio.create_task(_stream(running.url, path, body)) for _ in range(2)]
            await eventually(lambda: bad.requests == 1)  # round robin sent one of the two there
            bad.healthy = False  # now the whole engine hangs: its probes time out
            results = await asyncio.gather(*both)
        finally:
            await running.close()
    assert [_text(events) for events in results] == [_text(reference)] * 2
    assert running.service.metrics.migrations.labels(reason="worker_lost")._value.get() == 1
    assert "flaky" not in running.service.router.workers


async def test_past_the_migration_limit_the_stream_ends_with_an_error_event() -> None:
    path, body = _body(chat=False, max_tokens=20)
    async with (
        mock_fleet(engines=2) as fleet,
        flaky(fleet.urls[0], name="a") as first,
        flaky(fleet.urls[1], name="b") as second,
    ):
        first.mode = second.mode = "break"
        first.after = second.after = 2
        config = _config([{"url": first.url}, {"url": second.url}], migration_limit=1)
        running = await _started(config, 2)
        try:
            events = await _stream(running.url, path, body)
        finally:
            await running.close()
    assert 4 <= len(_text(events)[1]) < 20  # two chunks (of a token or more) from each worker
    assert events[-1]["error"]["code"] == 502
    assert "migration_limit 1" in events[-1]["error"]["message"]
    assert "[DONE]" not in events
    assert running.service.metrics.failed_streams.labels(reason="limit")._value.get() == 1


@dataclass(frozen=True, kw_only=True)
class _BrokenDecodeRun:
    references: list[list[Any]]
    """Each prompt's stream from one aggregated engine, undisturbed."""
    results: list[list[Any]]
    """The same prompts through the router, one of whose two decode workers breaks its streams."""
    bad: Flaky
    migrations: float
    """Streams the router continued after a disconnect."""
    prefilled: int
    """Prompt tokens the prefill engine computed (continuations included)."""


async def _through_a_breaking_decode_worker(
    path: str, body: dict[str, Any], prompts: list[list[int]], *, tokens: int | None = None
) -> _BrokenDecodeRun:
    """``prompts`` through a router with one prefill and two decode engines, the first decode
    engine behind a proxy that breaks its streams (after ``tokens`` tokens when given)."""
    async with (
        mock_fleet(engines=1) as reference_engine,
        mock_fleet(engines=1, config=EngineConfig(role="prefill")) as prefill,
        mock_fleet(engines=2, config=EngineConfig(role="decode")) as decode,
        flaky(decode.urls[0], name="flaky-decode") as bad,
    ):
        references = [await _stream(reference_engine.urls[0], path, {**body, "prompt": p}) for p in prompts]
        bad.mode, bad.tokens = "break", tokens
        workers = [
            {"url": prefill.urls[0], "role": "prefill"},
            {"url": bad.url, "role": "decode"},
            {"url": decode.urls[1], "role": "decode"},
        ]
        running = await _started(_config([], discovery={"kind": "static", "workers": workers}), 3)
        try:
            results = await asyncio.gather(
                *(_stream(running.url, path, {**body, "prompt": p}) for p in prompts)
            )
        finally:
            await running.close()
        return _BrokenDecodeRun(
            references=references,
            results=list(results),
            bad=bad,
            migrations=running.service.metrics.migrations.labels(reason="disconnected")._value.get(),
            prefilled=prefill.servers[0].engine.prompt_tokens_total,
        )


async def test_a_failed_decode_worker_continues_through_prefill_again() -> None:
    path, body = _body(chat=False, max_tokens=12)
    # distinct prompts (not cached anywhere yet: each is worth prefilling remotely), sent at once so
    # that the decode load spreads them over both decode workers
    prompts = [[5000 + i, *range(6000, 6000 + 2047)] for i in range(4)]
    run = await _through_a_breaking_decode_worker(path, body, prompts)
    assert [_text(events) for events in run.results] == [_text(events) for events in run.references]
    bad = run.bad
    assert bad.requests >= 1
    assert run.migrations == bad.requests
    # each continuation re-entered through prefill, with the prompt and the tokens carried over
    # (3 chunks: 3 tokens, or more when the engine's chunks carry several)
    carried = run.prefilled - 4 * 2048 - bad.requests * 2048
    assert 3 * bad.requests <= carried < 12 * bad.requests


async def test_a_worker_streaming_output_is_not_dropped_for_slow_probes() -> None:
    """Probes that time out while the worker's streams flow say it is busy, not hung."""
    path, body = _body(chat=False, max_tokens=30)
    async with (
        mock_fleet(engines=1, config=EngineConfig(decode_speedup_ratio=0.05)) as fleet,
        flaky(fleet.urls[0], name="busy") as busy,
    ):
        running = await _started(_config([{"url": busy.url}]), 1)
        try:
            async with aiohttp.ClientSession() as http:
                response = await http.post(f"{running.url}{path}", json=body)
                first = await response.content.readline()  # it streams
                busy.healthy = False  # every probe hangs from now on, for seconds of streaming
                events = [json.loads(first[5:]), *await _sse(response)]
                response.release()
            assert events[-1] == "[DONE]"
            assert len(_text(events)[1]) == 30
            assert not running.service.metrics.migrations._metrics  # it never left its worker
            # silent now: its slow probes count, and it goes
            await eventually(lambda: "busy" not in running.service.router.workers)
        finally:
            await running.close()


async def test_a_continuation_refused_as_a_bad_request_ends_the_stream_with_the_reason() -> None:
    path, body = _body(chat=False, max_tokens=12)
    async with (
        mock_fleet(engines=1) as fleet,
        flaky(fleet.urls[0], name="breaks") as breaks,
        flaky(fleet.urls[0], name="rejects") as rejects,
    ):
        breaks.mode, rejects.mode = "break", "reject"
        running = await _started(
            _config([{"url": breaks.url}, {"url": rejects.url}], policy="round_robin"), 2
        )
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(2):  # round robin starts one of them on the breaking worker
                    async with http.post(f"{running.url}{path}", json=body) as response:
                        if response.status == 400:
                            continue  # started on the rejecting worker: a plain 400
                        events = await _sse(response)
                        break
        finally:
            await running.close()
    assert breaks.requests == 1
    assert len(_text(events)[1]) == 3
    assert "refused the continuation" in events[-1]["error"]["message"]
    assert "prompt too long" in events[-1]["error"]["message"]
    assert running.service.metrics.failed_streams.labels(reason="refused")._value.get() == 1


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("left", [1, 5], ids=["last-token-left", "five-left"])
async def test_an_aggregated_continuation_delivers_exactly_max_tokens(chat: bool, left: int) -> None:
    """A stream that breaks with ``left`` tokens to go gets exactly them from the next worker."""
    path, body = _body(chat, max_tokens=12)
    async with mock_fleet(engines=2) as fleet, flaky(fleet.urls[0], name="flaky") as bad:
        reference = await _stream(fleet.urls[1], path, body)
        bad.mode, bad.tokens = "break", 12 - left
        config = _config([{"url": bad.url}, {"url": fleet.urls[1]}], policy="round_robin")
        running = await _started(config, 2)
        try:
            both = [await _stream(running.url, path, body) for _ in range(2)]
        finally:
            await running.close()
    assert bad.requests == 1
    assert running.service.metrics.migrations.labels(reason="disconnected")._value.get() == 1
    for events in both:
        assert events[-1] == "[DONE]"
        assert _text(events) == _text(reference)
        chunks = [e for e in events if isinstance(e, dict)]
        assert chunks[-1]["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("left", [1, 5], ids=["last-token-left", "five-left"])
async def test_a_disaggregated_continuation_delivers_exactly_max_tokens(left: int) -> None:
    """The continuation of a stream whose decode worker broke is prefilled again: the prefill
    engine computes its first token, the decode engine emits it and the rest. With one token left
    the decode engine must emit that token only (it used to decode one more: 13 of 12)."""
    path, body = _body(chat=False, max_tokens=12)
    prompts = [[7000 + i, *range(8000, 8000 + 2047)] for i in range(4)]
    run = await _through_a_breaking_decode_worker(path, body, prompts, tokens=12 - left)
    bad = run.bad
    assert bad.requests >= 1
    assert run.migrations == bad.requests
    # every continuation went through prefill again, carrying the tokens the client had: at most
    # the ones the proxy let through (the router may not have read the last chunk before the break)
    carried = run.prefilled - 4 * 2048 - bad.requests * 2048
    assert 0 < carried <= (12 - left) * bad.requests
    for events, reference in zip(run.results, run.references, strict=True):
        assert events[-1] == "[DONE]"
        assert len(_text(events)[1]) == 12
        assert _text(events) == _text(reference)
        chunks = [e for e in events if isinstance(e, dict)]
        assert chunks[-1]["usage"]["completion_tokens"] == 12


async def test_a_stream_whose_worker_breaks_after_its_done_ends_once() -> None:
    """A worker connection that breaks after ``[DONE]`` (before the chunked body's end) lost
    nothing: the client gets one ``[DONE]``, and the worker is not blamed."""
    path, body = _body(chat=False, max_tokens=8)
    async with mock_fleet(engines=1) as fleet, flaky(fleet.urls[0], name="truncates") as bad:
        bad.mode = "truncate"
        running = await _started(_config([{"url": bad.url}]), 1)
        try:
            events = await _stream(running.url, path, body)
        finally:
            await running.close()
    assert events.count("[DONE]") == 1
    assert events[-1] == "[DONE]"
    assert len(_text(events)[1]) == 8
    assert not running.service.metrics.migrations._metrics
