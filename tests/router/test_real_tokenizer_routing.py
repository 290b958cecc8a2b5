"""A router configured for ``trtllm-serve`` (``engine: trtllm``) in front of a fake engine whose KV
cache holds the blocks of a chat as ``trtllm-serve`` tokenizes it (``transformers``, the model's
chat template): the same chat sent to the router is predicted cached on that engine, a different
one is not. This is the end-to-end form of "router hashes == engine hashes"."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import nats
import pytest
from aiohttp import web

from copse.router.config import parse_config
from copse.router.server import start_router
from copse.workers.nats_io import KvEventPublisher
from copse.workers.protocol.hashing import hash_blocks
from copse.workers.protocol.kv_events import DumpBlock, KvDump

from .conftest import eventually
from .hf_models import engine_chat_ids, engine_tokenizer, llama3_like

BLOCK = 4
WORKER = "llama-worker-0-0"
MODEL = "llama"
OTHER = {"messages": [{"role": "user", "content": "Something else entirely."}]}
CHAT = {
    "messages": [
        {"role": "system", "content": "You answer questions about KV-cache-aware routing."},
        {"role": "user", "content": "Which engine holds my prefix, and why does it matter?"},
    ]
}


@pytest.fixture
async def engine_url() -> AsyncIterator[str]:
    """A ``trtllm-serve``-shaped worker: ``/health``, no ``/worker_info``, a chat endpoint."""

    async def chat(_: web.Request) -> web.Response:
        answer = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        return web.json_response(answer)

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def test_a_chat_is_predicted_cached_where_the_engine_cached_it(
    tmp_path: Path, nats_url: str, engine_url: str
) -> None:
    model = llama3_like(tmp_path / "model")
    engine = engine_tokenizer(model)
    engine_ids = engine_chat_ids(engine, CHAT)
    block_hashes, tokens_hashes = hash_blocks(engine_ids, block_size=BLOCK)
    assert len(block_hashes) >= 8
    # The other chat shares only the template's opening (BOS, system header) with CHAT.
    other_hashes = hash_blocks(engine_chat_ids(engine, OTHER), block_size=BLOCK)[0]
    shared = next(i for i, (a, b) in enumerate(zip(block_hashes, other_hashes, strict=False)) if a != b)
    assert 0 < shared < len(block_hashes) // 2
    dump = KvDump(
        worker_id=WORKER,
        epoch=1,
        block_size=BLOCK,
        last_event_id=0,
        blocks=tuple(
            DumpBlock(block_hash=h, parent_hash=block_hashes[i - 1] if i else None, tokens_hash=t)
            for i, (h, t) in enumerate(zip(block_hashes, tokens_hashes, strict=True))
        ),
    )
    nc = await nats.connect(nats_url)
    await KvEventPublisher(nc, namespace="default", deployment="realtok").serve_dumps(
        worker_id=WORKER, dump=lambda: dump
    )
    raw: dict[str, Any] = {
        "model": MODEL,
        "engine": "trtllm",
        "tokenizer": str(model),
        "kv_capacity_tokens": 100_000,
        "port": 0,
        "block_size": BLOCK,
        "nats_url": nats_url,
        "deployment": "realtok",
        "discovery": {"kind": "static", "workers": [{"url": engine_url, "id": WORKER}]},
        "health_interval_s": 0.05,
    }
    running = await start_router(parse_config(raw, source="test"), router_id="realtok")
    try:
        radix = running.service.router.radix
        assert radix is not None
        await eventually(lambda: bool(radix.overlaps(block_hashes)))
        cached = running.service.metrics.cached_tokens
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{running.url}/v1/chat/completions", json={"model": MODEL, **OTHER}
            ) as response:
                assert response.status == 200, await response.text()
            assert cached._value.get() == shared * BLOCK
            async with http.post(
                f"{running.url}/v1/chat/completions", json={"model": MODEL, **CHAT}
            ) as response:
                assert response.status == 200, await response.text()
        # Every full block the engine holds is predicted cached (at least one token is always computed).
        whole = min(len(block_hashes) * BLOCK, len(engine_ids) - 1)
        assert cached._value.get() == shared * BLOCK + whole
        assert running.service.metrics.prompt_tokens._value.get() >= len(engine_ids)
        body = {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{running.url}/v1/chat/completions", json=body) as response,
        ):
            assert response.status == 400
            error = json.loads(await response.text())["error"]
        assert "Conversation roles must be user or assistant" in error["message"]
        assert error["param"] == "messages"
    finally:
        await running.close()
        await nc.drain()
