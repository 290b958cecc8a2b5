"""The router's NATS connection, which may come and go without the router going down.

The link connects in the background (the router serves meanwhile), and after losing the server
reconnects with exponential backoff (``nats_backoff_s`` doubling up to ``nats_backoff_max_s``),
each time on a fresh client: whoever needs NATS (KV event sync, replica sync) registers
``on_connect`` callbacks that subscribe and resync, and ``on_disconnect`` ones that fall back.

While disconnected the router is in *approximate* mode: no KV events arrive, so the index learns
from the router's own decisions (as without NATS at all) and peers' load is not shared; once
connected again, every worker's cache is resynced from its dump and the router is *exact* again.
The gauge ``copse_router_nats_connected`` and a log line at every change say which mode it is in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2
"""Time allowed to open one connection (TCP and the NATS handshake)."""
PING_INTERVAL_S = 5
"""Client pings; two unanswered ones (a server that hangs rather than closes) end the connection."""


class NatsLink:
    """A NATS connection kept up in the background (see the module documentation)."""

    def __init__(
        self,
        url: str,
        *,
        name: str,
        backoff_s: float = 0.25,
        backoff_max_s: float = 8.0,
        on_state: Callable[[bool], object] | None = None,
    ) -> None:
        self.url = url
        self.name = name
        self._backoff = (backoff_s, backoff_max_s)
        self.on_state = on_state
        """Told ``True`` at each connection, ``False`` at the start and at each loss."""
        self.nc: NATS | None = None
        """The connected client, ``None`` while disconnected."""
        self.connections = 0
        """Connections made so far (the first, then one per reconnect)."""
        self.on_connect: list[Callable[[NATS], Awaitable[object]]] = []
        """Run (in order) after each (re)connection: subscribe, resync."""
        self.on_disconnect: list[Callable[[], object]] = []
        """Run when the connection is lost."""
        self._task: asyncio.Task[None] | None = None
        self._tried = asyncio.Event()

    @property
    def connected(self) -> bool:
        return self.nc is not None

    async def start(self) -> None:
        """Start connecting; returns after the first attempt, connected or not (then the link
        keeps trying in the background)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"nats-link-{self.name}")
        await self._tried.wait()

    async def close(self) -> None:
        """Stop reconnecting and close the connection."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        nc, self.nc = self.nc, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(NatsError, OSError, TimeoutError):
                await nc.drain()

    async def _run(self) -> None:
        delay = self._backoff[0]
        if self.on_state is not None:
            self.on_state(False)
        while True:
            lost = asyncio.Event()

            async def closed() -> None:
                lost.set()  # noqa: B023 (one event per connection, read before the next)

            try:
                nc = await nats.connect(
                    self.url,
                    name=self.name,
                    # This loop reconnects, with its own backoff; connect() itself gives up on a
                    # refusing server after a second immediate attempt.
                    allow_reconnect=False,
                    max_reconnect_attempts=1,
                    reconnect_time_wait=0,
                    connect_timeout=CONNECT_TIMEOUT_S,
                    ping_interval=PING_INTERVAL_S,
                    max_outstanding_pings=2,
                    closed_cb=closed,
                    error_cb=self._error,
                )
            except (OSError, NatsError, TimeoutError) as exc:
                log.warning(
                    "NATS at %s unreachable (%s): approximate mode (the index learns from this router's"
                    " own decisions, no load sharing); retrying in %.2g s",
                    self.url,
                    exc or type(exc).__name__,
                    delay,
                )
                self._tried.set()
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._backoff[1])
                continue
            delay = self._backoff[0]
            self.nc = nc
            self.connections += 1
            try:
                for callback in self.on_connect:
                    await callback(nc)
                await confirm_subscriptions(nc, timeout_s=CONNECT_TIMEOUT_S)
            except (OSError, NatsError, TimeoutError) as exc:  # lost again while setting up
                log.warning("NATS setup after connecting failed: %r", exc)
            log.info(
                "NATS at %s connected (connection %d): exact mode (KV events, shared load)",
                self.url,
                self.connections,
            )
            self._tried.set()
            if self.on_state is not None:
                self.on_state(True)
            await lost.wait()
            self.nc = None
            if self.on_state is not None:
                self.on_state(False)
            log.warning("NATS connection to %s lost: approximate mode until it is back", self.url)
            for on_lost in self.on_disconnect:
                on_lost()

    async def _error(self, exc: Exception) -> None:
        log.debug("NATS client error: %r", exc)


async def confirm_subscriptions(nc: NATS, *, timeout_s: float) -> None:
    """Return once the server holds every subscription made on ``nc`` so far.

    ``nc.flush()`` does not promise it: nats-py (2.16) writes the flush's PING straight to the
    socket, ahead of the SUBs still queued for its flusher task, so the PONG can come back before
    the server has them (seen on a busy machine: the router reported itself connected and the next
    KV event, published from another connection, was never delivered). A message to a fresh inbox
    of our own is queued behind those SUBs: when it comes back, the server has processed them.
    """
    probe = await nc.subscribe(nc.new_inbox(), max_msgs=1)
    await nc.publish(probe.subject, b"")
    await probe.next_msg(timeout=timeout_s)
