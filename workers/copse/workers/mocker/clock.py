"""Clocks for the engine loops of the HTTP server: real time, or a virtual time per engine."""

from __future__ import annotations

import asyncio
from typing import Protocol


class Clock(Protocol):
    """Milliseconds as the engine loop sees them."""

    def now_ms(self) -> float: ...

    async def sleep_until(self, t_ms: float) -> None: ...


class RealClock:
    """The event loop's monotonic clock; steps take real time."""

    def now_ms(self) -> float:
        return asyncio.get_running_loop().time() * 1000.0

    async def sleep_until(self, t_ms: float) -> None:
        """Sleep until ``t_ms``; when it has passed, still yield once (a loop catching up lets the
        HTTP handlers run between steps)."""
        delay = t_ms - self.now_ms()
        await asyncio.sleep(delay / 1000.0 if delay > 0 else 0)


class VirtualClock:
    """An engine's own virtual time: a step "takes" its duration without any sleeping, so an engine
    runs as fast as the CPU allows. A request arriving over HTTP is stamped with its engine's
    current virtual time. (For replays with exact arrival times use
    :class:`~copse.workers.mocker.simulation.Simulator`.)"""

    def __init__(self, start_ms: float = 0.0) -> None:
        self._now = start_ms

    def now_ms(self) -> float:
        return self._now

    async def sleep_until(self, t_ms: float) -> None:
        self._now = max(self._now, t_ms)
        await asyncio.sleep(0)  # let HTTP handlers run between steps
