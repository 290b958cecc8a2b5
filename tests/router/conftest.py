"""Shared fixtures: a real nats-server for the session, and routers in front of mocked engines."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterator

import pytest

from copse.workers.testing import nats_server


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    with nats_server() as url:
        yield url


async def eventually(condition: Callable[[], bool | Awaitable[bool]], *, timeout_s: float = 10.0) -> None:
    """Wait until ``condition()`` holds (polling the event loop); fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.02)


def leading_blocks_reference(held: dict[int, set[int]], hashes: list[int]) -> dict[int, int]:
    """Brute force: for every slot holding at least the first of ``hashes``, how many leading
    blocks it holds (``held``: slot -> the blocks it holds)."""
    out = {}
    for slot, blocks in held.items():
        depth = 0
        while depth < len(hashes) and hashes[depth] in blocks:
            depth += 1
        if depth:
            out[slot] = depth
    return out
