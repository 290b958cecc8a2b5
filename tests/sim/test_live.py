"""Live replay: real ``copse router run`` and ``copse worker mock`` processes, a real NATS server."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from copse.sim import live
from copse.sim.live import run_live
from copse.sim.replay import ReplaySettings
from copse.sim.trace import TraceRequest
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
