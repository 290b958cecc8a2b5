"""Live replay: real ``copse router run`` and ``copse worker mock`` processes, a real NATS server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from tests.router.conftest import eventually

from copse.router.config import RouterConfig
from copse.router.metrics import ADAPTER_LOADS, REQUESTS
from copse.sim import live
from copse.sim.gateway import gateway_config
from copse.sim.live import run_live
from copse.sim.replay import ReplaySettings
from copse.sim.trace import TokenSynth, TraceRequest
from copse.workers.metrics import MOCK_LORA_LOADS
from copse.workers.perf import PerfModel, load_perf_model
from copse.workers.testing import free_port


def test_a_live_replay_routes_every_request_and_reuses_shared_prefixes() -> None:
    # Three conversations of four turns each, every turn extending its conversation's prompt.
    trace = [
        TraceRequest(
            timestamp_ms=400.0 * (turn * 3 + conversation),
            input_length=512 * (turn + 2),
            output_length=4,
            hash_ids=tuple(1000 * conversation + block for block in range(turn + 2)),
        )
        for turn in range(4)
        for conversation in range(3)
    ]
    report = run_live(trace, ReplaySettings(policy="kv", workers=2, seed=3))
    assert (report.requests, report.failed) == (12, 0)
    # the KV-aware router keeps each conversation where its prefix is cached: from the second turn
    # on, every prompt but its newest block is a hit (and the router learns of the blocks over NATS)
    prompt = sum(r.input_length for r in trace)
    reusable = sum(r.input_length - 512 for r in trace if r.input_length > 1024)
    assert report.cache_hit_rate >= 0.8 * reusable / prompt
    assert report.engine_lag_ms is not None
    assert report.engine_lag_ms >= 0
    assert report.ttft_ms.p50 > 0


async def test_router_replicas_of_a_live_fleet_share_the_adapters_their_requests_load() -> None:
    """Two ``copse router run`` replicas over the real NATS server: the adapter a request through
    one replica loads is known to the other, which sends the next request for it to that worker
    and predicts no load; the engines load it once."""
    settings = ReplaySettings(policy="kv", workers=2, seed=4)
    router = {"loras": [{"name": "a"}], "lora_load_ms": 500.0}
    engine_args = ["--lora=a", "--lora-load-ms=500"]
    one, two = (
        TraceRequest(timestamp_ms=0.0, input_length=512, output_length=4, hash_ids=(conversation, 1))
        for conversation in (10, 20)
    )
    synth = TokenSynth(seed=4, trace_block_size=settings.trace_block_size)

    async def believed_held(admin_url: str) -> list[list[str]]:
        async with aiohttp.ClientSession() as http, http.get(f"{admin_url}/workers") as response:
            return [worker["loras"] for worker in (await response.json())["workers"]]

    async with live.live_fleet(settings, router=router, engine_args=engine_args, replicas=2) as fleet:
        (first,) = await live.drive(fleet.urls[0], [one], speedup=1.0, synth=synth, models=["a"])
        await eventually(lambda: _holds(believed_held(fleet.admin_urls[1])))
        (second,) = await live.drive([fleet.urls[1]], [two], speedup=1.0, synth=synth, models=["a"])
        engine_pages = [f"{url}/prometheus/metrics" for url in fleet.engine_urls]
        engine_loads = await live.metric_total(engine_pages, f"{MOCK_LORA_LOADS}_total")
        pages = [f"{url}/metrics" for url in fleet.admin_urls]
        predicted = [await live.metric_total([page], f"{ADAPTER_LOADS}_total") for page in pages]
        routed = [await live.metric_total([page], f"{REQUESTS}_total") for page in pages]
    assert (first.error, second.error) == (None, None)
    assert engine_loads == 1
    assert predicted == [1, 0], "the second replica knew the adapter was held"
    assert routed == [1, 1]


async def _holds(held: Awaitable[list[list[str]]]) -> bool:
    return any("a" in loras for loras in await held)


async def test_replicas_and_urls_that_cannot_be_served_are_refused_before_anything_starts() -> None:
    settings = ReplaySettings(workers=1, seed=1)
    with pytest.raises(ValueError, match=r"1 behind a gateway \(one picker\), got 2"):
        async with live.live_fleet(settings, gateway=True, replicas=2):
            pass
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        async with live.live_fleet(settings, replicas=0):
            pass
    trace = [TraceRequest(timestamp_ms=0.0, input_length=64, output_length=1, hash_ids=(1,))] * 2
    synth = TokenSynth(seed=1, trace_block_size=settings.trace_block_size)
    with pytest.raises(ValueError, match="1 URLs for 2 requests: one URL, or one per request"):
        await live.drive(["http://127.0.0.1:1"], trace, speedup=1.0, synth=synth)


async def test_a_router_start_that_is_abandoned_stops_the_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting for the router to see its engines can be cancelled (Ctrl-C, a timeout): the router
    process it started must not outlive the wait."""
    started: list[asyncio.subprocess.Process] = []
    spawn = asyncio.create_subprocess_exec

    async def recording_spawn(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        process = await spawn(*args, **kwargs)
        started.append(process)
        return process

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recording_spawn)
    port = free_port()
    config = {
        "model": "m",
        "engine": "mock",
        "policy": "round_robin",
        "port": port,
        "discovery": {"kind": "static", "workers": [{"url": f"http://127.0.0.1:{free_port()}"}]},
    }
    waiting = asyncio.create_task(
        live._router(config, workdir=tmp_path, workers=1, url=f"http://127.0.0.1:{port}")
    )
    while not started:  # the router process is spawned first thing
        await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert started[0].returncode is not None


def test_a_dilated_router_config_stretches_the_workloads_durations_and_targets() -> None:
    config = {
        "queue_timeout_s": 10.0,
        "health_timeout_s": 2.0,
        "objectives": {"premium": {"priority": 100, "ttft_ms": 3000.0, "itl_ms": None}},
        "slo": {"ttft_ms": 2000.0, "itl_ms": 50.0},
    }
    dilated = live.dilate_router(config, 4.0)
    assert dilated["queue_timeout_s"] == 40.0  # given: stretched; defaults too
    assert dilated["rate_window_s"] == 4.0 * RouterConfig.model_fields["rate_window_s"].default
    assert dilated["token_timeout_s"] == 4.0 * RouterConfig.model_fields["token_timeout_s"].default
    assert dilated["health_timeout_s"] == 2.0  # the processes' own work is not dilated
    assert dilated["objectives"] == {"premium": {"priority": 100, "ttft_ms": 12000.0, "itl_ms": None}}
    assert dilated["slo"] == {"ttft_ms": 8000.0, "itl_ms": 200.0}
    assert config["queue_timeout_s"] == 10.0  # the caller's config is left alone
    static = {"kind": "static", "workers": [{"url": "http://127.0.0.1:1"}]}
    RouterConfig.model_validate({"model": "m", "engine": "mock", "discovery": static, **dilated})
    with pytest.raises(ValueError, match=r"dilation must be a finite number >= 1, got 0\.5"):
        live.dilate_router(config, 0.5)


def test_an_answer_of_a_dilated_fleet_is_timed_back_in_the_workloads_time() -> None:
    answer = live.Answer(200, None, ttft_s=0.8, itl_s=0.04, e2e_s=2.0, cached=512, outputs=31)
    assert answer.undilated(4.0) == live.Answer(200, None, 0.2, 0.01, 0.5, 512, 31)


async def test_a_dilated_fleet_runs_its_engines_and_the_routers_model_that_much_slower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the engines are started with and what the router is told (its config and the profile it
    predicts with), for the same fleet undilated and dilated 4x."""
    speedups: list[float] = []
    routers: list[tuple[dict[str, Any], PerfModel]] = []

    class Done:
        returncode = 0

        def terminate(self) -> None:
            pass

        async def wait(self) -> int:
            return 0

    async def engines(settings: ReplaySettings, **_: Any) -> tuple[Done, list[str]]:
        speedups.append(settings.engines.config.speedup_ratio)
        return Done(), [f"http://127.0.0.1:{free_port()}"]

    async def router(config: dict[str, Any], **_: Any) -> Done:
        routers.append((config, load_perf_model(config["perf_profile"])))
        return Done()

    monkeypatch.setattr(live, "_engines", engines)
    monkeypatch.setattr(live, "_router", router)
    settings = ReplaySettings(workers=1, seed=1)
    objectives = {"objectives": {"premium": {"priority": 100, "ttft_ms": 3000.0}}}
    for dilation in (1.0, 4.0):
        async with live.live_fleet(settings, router=objectives, dilation=dilation):
            pass
    assert speedups == [1.0, 0.25]
    (plain, plain_model), (slow, slow_model) = routers
    assert slow["objectives"]["premium"]["ttft_ms"] == 4 * plain["objectives"]["premium"]["ttft_ms"]
    assert slow["queue_timeout_s"] == 4 * RouterConfig.model_fields["queue_timeout_s"].default
    # the one load generator stands for many clients: the router's per-client bounds do not hold it
    for config in (plain, slow):
        assert RouterConfig.model_validate(config).clients.max_requests >= 100_000
    # the router's profile is measured from the slowed engines: a prompt takes 4x as long (noise aside)
    for prompt in (512.0, 4096.0):
        assert slow_model.prefill_curve_ms(prompt) == pytest.approx(
            4 * plain_model.prefill_curve_ms(prompt), rel=0.1
        )


def test_the_test_gateway_holds_a_shared_fleets_requests_and_waits_longer_when_dilated() -> None:
    def timeouts(dilation: float) -> tuple[str, str]:
        config = gateway_config(
            listen_port=1,
            admin_port=2,
            picker="127.0.0.1:3",
            upstream="original_dst",
            engines=["http://127.0.0.1:4"],
            retries=0,
            dilation=dilation,
        )
        listener = config["static_resources"]["listeners"][0]
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        ext_proc = next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
        route = manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
        # a shared fleet holds more than Envoy's default 1,024 requests per cluster in flight
        for cluster in config["static_resources"]["clusters"]:
            (limits,) = cluster["circuit_breakers"]["thresholds"]
            assert (
                min(limits["max_pending_requests"], limits["max_requests"], limits["max_connections"])
                > 10_000
            )
        return ext_proc["typed_config"]["message_timeout"], route["timeout"]

    assert timeouts(1.0) == ("60s", "300s")
    assert timeouts(4.0) == ("240s", "1200s")


async def test_an_answer_that_did_not_complete_says_why() -> None:
    """A live benchmark counts requests refused otherwise than by a 429: each answer carries the
    status and message, the stream's error event or the client's exception behind it."""

    async def refuse(request: web.Request) -> web.StreamResponse:
        kind = request.headers["x-kind"]
        if kind == "refused":
            return web.json_response({"error": {"message": "no worker can serve it"}}, status=503)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        token = {"choices": [{"text": "a"}]}
        if kind == "error":
            await response.write(f"data: {json.dumps(token)}\n\n".encode())
            await response.write(b'data: {"error": {"message": "the worker failed"}}\n\n')
        elif kind == "ok":
            await response.write(f"data: {json.dumps(token)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as http:
            answers = {
                kind: await live.send(
                    http, f"http://127.0.0.1:{port}", tokens=[1, 2], max_tokens=2, headers={"x-kind": kind}
                )
                for kind in ("refused", "error", "empty", "ok")
            }
    finally:
        await runner.cleanup()
    assert answers["refused"].error == "HTTP 503: no worker can serve it"
    assert answers["error"].error == "stream error after 1 tokens: the worker failed"
    assert answers["empty"].error == "stream ended without a token"
    assert answers["ok"].error is None
    assert answers["ok"].outputs == 1
