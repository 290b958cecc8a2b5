"""Helpers the router's end-to-end tests share: awaiting a condition, and a router in this process
in front of a static list of engines."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from copse.router.config import parse_config
from copse.router.server import RunningRouter, start_router

MODEL = "mock-model"


async def until(condition: Callable[[], bool], *, timeout_s: float = 30.0, poll_s: float = 0.05) -> None:
    """Return once ``condition()`` holds; AssertionError after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(poll_s)


@contextlib.asynccontextmanager
async def static_router(
    urls: list[str], *, epp: dict[str, Any] | None = None, **extra: Any
) -> AsyncIterator[RunningRouter]:
    """A router on a free port of 127.0.0.1 routing to ``urls`` (mocked engines), once it sees them
    all; ``epp`` (picker settings) serves it as an endpoint picker too; ``extra`` are config keys."""
    raw: dict[str, Any] = {
        "model": MODEL,
        "engine": "mock",
        "port": 0,
        "block_size": 32,
        "discovery": {"kind": "static", "workers": [{"url": url} for url in urls]},
        "health_interval_s": 0.1,
        **extra,
    }
    if epp is not None:
        raw["epp"] = {"grpc_port": 0, "health_port": None, "metrics_port": 0, **epp}
    running = await start_router(parse_config(raw, source="e2e"), router_id=f"e2e-{uuid.uuid4().hex[:6]}")
    try:
        await until(lambda: len(running.service.router.workers) == len(urls))
        yield running
    finally:
        await running.close()
