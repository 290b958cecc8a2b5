"""A shared fleet above capacity, premium and batch objectives: through the real HTTP router, and
through a real Envoy with copse's endpoint picker."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from e2e.local_router import MODEL, until
from e2e.local_router import static_router as _router

from copse.router.server import RunningRouter
from copse.sim.gateway import envoy_gateway
from copse.sim.live import Answer, send
from copse.workers.testing import mock_fleet

pytestmark = pytest.mark.e2e

PREMIUM = {"x-gateway-inference-objective": "premium", "x-gateway-inference-fairness-id": "team-a"}
BATCH = {"x-gateway-inference-objective": "batch", "x-gateway-inference-fairness-id": "team-b"}
SETTINGS: dict[str, Any] = {
    "busy_prefill_tokens": 8,  # each engine takes one request at a time
    "rate_window_s": 2.0,
    "objectives": {"premium": {"priority": 100, "ttft_ms": 60000}, "batch": {"priority": 0, "ttft_ms": 1}},
}


PROMPT_TOKENS = 320
MAX_TOKENS = 48
_prompts = itertools.count()


async def _post(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> Answer:
    """A streamed completion, as the live benchmark sends it (benchmarks/shared_fleets.py --live),
    of a prompt no other request shares: each holds its engine busy until its first token (a
    cached prompt would leave the engine free at once, and nothing would ever wait)."""
    start = 1000 + PROMPT_TOKENS * next(_prompts)
    tokens = list(range(start, start + PROMPT_TOKENS))
    return await send(http, url, tokens=tokens, max_tokens=MAX_TOKENS, headers=headers, model=MODEL)


def _complete(answer: Answer) -> bool:
    """Answered 200 and streamed every token to the end."""
    return answer.status == 200 and answer.outputs == MAX_TOKENS and not math.isnan(answer.e2e_s)


@contextlib.asynccontextmanager
async def _entry(mode: str, urls: list[str], tmp_path: Path) -> AsyncIterator[tuple[RunningRouter, str]]:
    """The router and the URL clients call: the router itself, or Envoy asking the picker."""
    if mode == "http":
        async with _router(urls, **SETTINGS) as running:
            yield running, running.url
        return
    async with _router(urls, epp={}, **SETTINGS) as running:
        assert running.grpc_target is not None
        with envoy_gateway(
            picker=running.grpc_target, upstream="original_dst", engines=urls, scratch=tmp_path
        ) as url:
            yield running, url


@pytest.mark.parametrize("mode", ["http", "envoy"])
async def test_above_capacity_premium_is_served_and_batch_is_shed_with_429(mode: str, tmp_path: Path) -> None:
    """Two engines that take one request each at a time, a burst of 10 premium and 30 batch
    streams: the queue serves premium first, and batch requests that would wait past their 1 ms
    TTFT target are answered 429 with Retry-After at once. What gives the live benchmark's figure:
    no premium stream is shed or cut short while batch is shed, every admitted batch stream
    completes (an admitted request is never dropped), and nothing is answered otherwise (503 only
    means no healthy worker)."""
    async with (
        mock_fleet(engines=2) as fleet,
        _entry(mode, fleet.urls, tmp_path) as (running, url),
        aiohttp.ClientSession() as http,
    ):
        service = running.service
        burst_done = asyncio.Event()

        async def steady() -> list[Answer]:
            """Premium streams one after another until the burst is over: the router keeps a
            history of the rate it routes at (what admission predicts waits with), however long
            a loaded machine takes to deliver the burst."""
            answers = []
            while not burst_done.is_set():
                answers.append(await _post(http, url, PREMIUM))
            return answers

        background = asyncio.create_task(steady())
        await until(lambda: service.router.routed_tokens_per_s(now=service.now()) is not None)
        burst = [_post(http, url, PREMIUM if i % 4 == 0 else BATCH) for i in range(40)]
        answers = await asyncio.gather(*burst)
        burst_done.set()
        steady_answers = await background
        metrics = service.metrics_text().decode()
    assert all(_complete(answer) for answer in steady_answers), steady_answers
    premium = [answers[i] for i in range(40) if i % 4 == 0]
    batch = [answers[i] for i in range(40) if i % 4]
    assert all(_complete(answer) for answer in premium), premium
    shed = [answer.retry_after for answer in batch if answer.status == 429]
    assert shed, "the saturated fleet sheds batch requests"
    assert all(retry is not None and int(retry) >= 1 for retry in shed)
    admitted = [answer for answer in batch if answer.status != 429]
    assert all(_complete(answer) for answer in admitted), admitted
    counted = (
        f'copse_router_class_shed_total{{objective="batch",reason="SloShed",tenant="team-b"}} {len(shed)}.0'
    )
    assert counted in metrics
    assert 'objective="premium",reason=' not in metrics
