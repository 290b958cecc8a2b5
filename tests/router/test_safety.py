"""No request can hurt the serving path: bounded memory per request, parse limits, validation,
client isolation and API keys, against a router in front of real mocked engines."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from copse.router.approx import ApproximateIndexer
from copse.router.clients import CLIENT_KEEPALIVE_S, ClientGate, ClientLimits, Refused, client_key
from copse.router.config import RouterConfig, parse_config
from copse.router.core import Route
from copse.router.frontend import RouterService
from copse.router.indexer import BlockIndex
from copse.router.policies import RouteRequest
from copse.router.server import RunningRouter, start_router
from copse.router.service import RoutingService
from copse.workers.mocker import EngineConfig
from copse.workers.testing import mock_fleet

from .conftest import eventually

MODEL = "mock-model"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}


def _config(urls: list[str], **extra: Any) -> RouterConfig:
    raw: dict[str, Any] = {
        "model": MODEL,
        "engine": "mock",
        "port": 0,
        "discovery": {"kind": "static", "workers": [{"url": url} for url in urls]},
        "health_interval_s": 0.05,
        "seed": 1,
    }
    raw.update(extra)
    return parse_config(raw, source="test")


async def _started(config: RouterConfig) -> RunningRouter:
    running = await start_router(config, router_id="test-router")
    await eventually(lambda: len(running.service.router.workers) == 1)
    return running


def _gate(running: RunningRouter) -> ClientGate:
    assert isinstance(running.service, RouterService)
    return running.service.clients


async def _post(http: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    async with http.post(url, data=data, headers=headers, **kw) as response:
        return response.status, await response.json()


def test_the_approximate_index_holds_no_more_output_blocks_than_a_cache() -> None:
    """What made a 10**12 max_tokens grow the router to 24 GB: one anonymous block per output block."""
    indexer = ApproximateIndexer(default_capacity_blocks=100, index=BlockIndex())
    indexer.on_routed(0, [1, 2, 3], total_blocks=10**12 // 32)
    assert indexer.blocks_held(0) == 3  # the prompt, touched last, stays
    indexer.on_routed(0, [1, 2, 3, 4], total_blocks=10)
    assert indexer.overlaps([1, 2, 3, 4]) == {0: 4}


async def test_the_three_reported_failures_are_400s_and_the_router_serves_on() -> None:
    async with mock_fleet(engines=1) as fleet:
        running = await _started(_config(fleet.urls, max_context_tokens=4096))
        url = f"{running.url}/v1/chat/completions"
        try:
            async with aiohttp.ClientSession() as http:
                status, body = await _post(http, url, {**GOOD, "max_tokens": 10**12})
                assert status == 400
                assert body["error"]["param"] == "max_tokens"
                assert "context of 4096 tokens" in body["error"]["message"]
                status, body = await _post(http, url, {**GOOD, "max_tokens": 4090})  # prompt + 4090 > 4096
                assert (status, body["error"]["param"]) == (400, "max_tokens")
                assert "plus max_tokens (4090) exceeds" in body["error"]["message"]
                status, body = await _post(http, url, b"[" * 5000 + b"]" * 5000)
                assert status == 400
                assert "max_json_depth" in body["error"]["message"]
                status, body = await _post(
                    http, url, {**GOOD, "messages": [{"role": "alien", "content": "x"}]}
                )
                assert (status, body["error"]["param"]) == (400, "messages[0].role")
                status, body = await _post(http, url, GOOD)
                assert status == 200, body
            assert running.service.router.sequences.requests.sum() == 0
        finally:
            await running.close()


async def test_one_client_past_its_bounds_gets_429_and_the_others_are_served() -> None:
    async with mock_fleet(engines=1) as fleet:
        running = await _started(_config(fleet.urls, clients={"max_requests": 2, "max_streams": 1}))
        url = f"{running.url}/v1/chat/completions"
        stream = {**GOOD, "max_tokens": 400, "stream": True}
        try:
            async with aiohttp.ClientSession() as http:
                hog = {"x-gateway-inference-fairness-id": "hog"}
                first = await http.post(url, json=stream, headers=hog)
                assert first.status == 200
                status, body = await _post(http, url, stream, headers=hog)  # a second stream
                assert status == 429
                assert "clients.max_streams 1" in body["error"]["message"]
                other = {"x-gateway-inference-fairness-id": "other"}
                assert (await _post(http, url, GOOD, headers=other))[0] == 200
                first.close()
                await eventually(lambda: _gate(running).clients() == 0)
        finally:
            await running.close()


def test_client_keys_prefer_the_api_key_never_keep_it_and_bound_their_size() -> None:
    secret = "sk-very-secret"
    key = client_key(
        {"Authorization": f"Bearer {secret}", "x-gateway-inference-fairness-id": "t"}, peer="1.2.3.4"
    )
    assert key.startswith("key-")
    assert secret not in key
    assert client_key({"x-gateway-inference-fairness-id": "team-a"}, peer="1.2.3.4") == "team-a"
    assert len(client_key({"x-gateway-inference-fairness-id": "x" * 10_000}, peer=None)) < 40
    assert client_key({}, peer="1.2.3.4") == "peer:1.2.3.4"


def test_the_gate_bounds_held_body_bytes_across_clients() -> None:
    gate = ClientGate(ClientLimits(max_body_bytes_held=10_000))
    gate.enter("a", body_bytes=6000)
    with pytest.raises(Refused, match="max_body_bytes_held"):
        gate.enter("b", body_bytes=6000)
    gate.resize(reserved=6000, actual=1000)
    gate.enter("b", body_bytes=6000)
    gate.leave("a", body_bytes=1000)
    gate.leave("b", body_bytes=6000)
    assert (gate.clients(), gate.body_bytes) == (0, 0)


def test_the_project_s_clients_expire_idle_connections_before_the_router_closes_them() -> None:
    """The load drivers (live replays, the abuse soak) keep idle connections CLIENT_KEEPALIVE_S;
    at aiohttp's 15 s a connection the router was closing at 10 s was sometimes written to, and the
    request failed with "Can not write request body" instead of being answered."""
    assert ClientLimits().header_timeout_s > CLIENT_KEEPALIVE_S


async def test_slow_headers_and_slow_bodies_are_cut_off() -> None:
    async with mock_fleet(engines=1) as fleet:
        limits = {"header_timeout_s": 0.5, "body_timeout_s": 0.5}
        running = await _started(_config(fleet.urls, clients=limits))
        host, port = running.url.removeprefix("http://").split(":")
        try:
            # slowloris: a request head that never ends
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the router
            writer.close()
            # a body announced but never sent
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 408")
            length = int(
                next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))[15:]
            )
            assert b"clients.body_timeout_s" in await reader.readexactly(length)
            writer.close()
            async with aiohttp.ClientSession() as http:
                assert (await _post(http, f"{running.url}/v1/chat/completions", GOOD))[0] == 200
            assert _gate(running).clients() == 0
        finally:
            await running.close()


async def test_a_client_that_disconnects_or_stops_reading_frees_the_engine_slot() -> None:
    # a fast engine, so that a client that does not read fills the socket buffers within seconds
    async with mock_fleet(engines=1, config=EngineConfig(speedup_ratio=200.0)) as fleet:
        running = await _started(_config(fleet.urls, clients={"write_timeout_s": 0.5}))
        engine = fleet.servers[0].engine
        stream = {**GOOD, "max_tokens": 100_000, "stream": True}
        try:
            async with aiohttp.ClientSession() as http:
                response = await http.post(f"{running.url}/v1/chat/completions", json=stream)
                await response.content.readline()
                assert engine.requests
                response.close()  # gone mid-stream
                await eventually(lambda: not engine.requests)
            # a client that never reads: its socket buffers fill, the write times out
            host, port = running.url.removeprefix("http://").split(":")
            _, writer = await asyncio.open_connection(host, int(port), limit=1024)
            transport = writer.transport
            assert isinstance(transport, asyncio.Transport)
            body = json.dumps(stream).encode()
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            transport.pause_reading()  # never read the stream
            await eventually(lambda: bool(engine.requests))
            await eventually(lambda: not engine.requests, timeout_s=60)
            writer.close()
            await eventually(lambda: _gate(running).clients() == 0)
        finally:
            await running.close()


def _waiting_for(service: RoutingService, request_id: str) -> Coroutine[Any, Any, Route]:
    """Route a small request through ``service``, waiting in its queue if need be."""
    request = RouteRequest(request_id=request_id, hashes=[], prompt_tokens=64, max_tokens=5)
    return service._route(request, frozenset(), retry=False)


@contextlib.asynccontextmanager
async def _one_at_a_time() -> AsyncIterator[tuple[RoutingService, Route]]:
    """A router over one engine that takes one request at a time (the rest wait in its queue):
    its service, and the route of the one request it holds."""
    async with mock_fleet(engines=1) as fleet:
        running = await _started(_config(fleet.urls, busy_kv_fraction=1e-9, queue_timeout_s=600.0))
        try:
            yield running.service, await _waiting_for(running.service, "busy")
        finally:
            await running.close()


async def test_a_caller_that_leaves_while_queued_takes_no_engine_slot() -> None:
    """A waiting request whose caller is cancelled (a gateway closing its stream) leaves the queue;
    released later, it would hold its worker forever, and every request after it would wait."""
    async with _one_at_a_time() as (service, busy):
        router = service.router
        leaves = asyncio.create_task(_waiting_for(service, "leaves"))
        await eventually(lambda: router.queued == 1)
        leaves.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaves
        assert router.queued == 0
        service._finish(busy.request_id)
        assert router.in_flight(busy.worker_id) == 0
        nxt = await asyncio.wait_for(_waiting_for(service, "next"), 5.0)
        assert nxt.worker_id == busy.worker_id


async def test_a_request_released_with_nobody_waiting_passes_its_place_on() -> None:
    """A request the queue releases after its waiter is gone is finished at once, and what that
    frees goes to the next in line: nothing released is dropped."""
    async with _one_at_a_time() as (service, busy):
        router = service.router
        gone = asyncio.create_task(_waiting_for(service, "gone"))
        waits = asyncio.create_task(_waiting_for(service, "waits"))
        await eventually(lambda: router.queued == 2)
        service._waiting.pop("gone").cancel()  # its waiter went without a word
        service._finish(busy.request_id)
        route = await asyncio.wait_for(waits, 5.0)
        assert route.worker_id == busy.worker_id
        assert router.in_flight(busy.worker_id) == 1, "only the request someone waits for"
        with pytest.raises(asyncio.CancelledError):
            await gone


async def test_api_keys_guard_the_openai_paths_and_never_reach_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nsk-alpha-123\n\nsk-beta-456\n")
    caplog.set_level(logging.DEBUG)
    async with mock_fleet(engines=1) as fleet:
        running = await _started(_config(fleet.urls, api_keys_file=str(keys)))
        url = f"{running.url}/v1/chat/completions"
        try:
            async with aiohttp.ClientSession() as http:
                status, body = await _post(http, url, GOOD)
                assert (status, body["error"]["type"]) == (401, "AuthenticationError")
                bad = {"Authorization": "Bearer sk-wrong-789"}
                assert (await _post(http, url, GOOD, headers=bad))[0] == 401
                good = {"Authorization": "Bearer sk-beta-456"}
                assert (await _post(http, url, GOOD, headers=good))[0] == 200
                async with http.get(f"{running.url}/health") as response:
                    assert response.status == 200  # probes need no key
                async with http.get(f"{running.url}/v1/models") as response:
                    assert response.status == 401
        finally:
            await running.close()
    for secret in ("sk-alpha-123", "sk-beta-456", "sk-wrong-789"):
        assert secret not in caplog.text
