"""KV events over NATS: publishing batches and answering dump requests (mocker and relay)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, overload

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from pydantic import ValidationError

from copse.workers.protocol.kv_events import KvDump, KvDumpRequest, KvEvent, KvEventBatch
from copse.workers.protocol.subjects import kv_dump_subject, kv_events_subject

log = logging.getLogger(__name__)

RECONNECT_WAIT_S = 1
"""Seconds between attempts to reach a NATS server that went away."""


class _ConnectionLog:
    """nats-py's callbacks for one connection, each one log line (its default error callback logs
    a whole traceback for every failed attempt, once a second while NATS is away): the first
    failure of an outage is a warning, the retries after it debug lines, the return an info line."""

    def __init__(self, url: str, nc: NATS) -> None:
        self.url = url
        self.nc = nc
        self.away = False

    async def error(self, exc: Exception) -> None:
        level = logging.DEBUG if self.away else logging.WARNING
        self.away = not self.nc.is_connected
        retrying = f"; retrying every {RECONNECT_WAIT_S:g} s" if self.away else ""
        log.log(level, "NATS at %s: %s%s", self.url, exc or repr(exc), retrying)

    async def disconnected(self) -> None:
        if not self.away:
            log.warning("NATS at %s disconnected; retrying every %g s", self.url, RECONNECT_WAIT_S)
        self.away = True

    async def connected(self) -> None:
        if self.away:
            log.info("NATS at %s connected", self.url)
        self.away = False


@overload
async def connect(url: str) -> NATS: ...
@overload
async def connect(url: str, *, stop: asyncio.Event) -> NATS | None: ...
async def connect(url: str, *, stop: asyncio.Event | None = None) -> NATS | None:
    """A connection for publishing KV events that outlives NATS restarts: it retries every
    :data:`RECONNECT_WAIT_S` for ever (the first connection too) and resubscribes when back.

    ``None`` when ``stop`` is set before the first connection succeeds (the attempt is abandoned
    and closed): a process told to stop while NATS is unreachable stops."""
    nc = NATS()
    callbacks = _ConnectionLog(url, nc)
    attempt = asyncio.ensure_future(
        nc.connect(
            url,
            max_reconnect_attempts=-1,
            reconnect_time_wait=RECONNECT_WAIT_S,
            error_cb=callbacks.error,
            disconnected_cb=callbacks.disconnected,
            reconnected_cb=callbacks.connected,
        )
    )
    waits: set[asyncio.Future[Any]] = {attempt}
    if stop is not None:
        waits.add(asyncio.ensure_future(stop.wait()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits - {attempt}:
            waiting.cancel()
        if not attempt.done():
            attempt.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await attempt
            await nc.close()
    if attempt.cancelled():
        return None
    attempt.result()  # raises what made connecting fail for good
    await callbacks.connected()
    return nc


async def close_connection(nc: NATS) -> None:
    """Flush what is pending and close; only close when NATS is away (a drain would raise)."""
    if nc.is_connected:
        with contextlib.suppress(NatsError, OSError, TimeoutError):
            await nc.drain()
            return
    await nc.close()


class KvEventPublisher:
    """Publishes the KV events of engines of one deployment on its subject."""

    def __init__(self, nc: NATS, *, namespace: str, deployment: str) -> None:
        self._nc = nc
        self.namespace = namespace
        self.deployment = deployment
        self.subject = kv_events_subject(namespace=namespace, deployment=deployment)

    async def publish(self, *, worker_id: str, epoch: int, events: list[KvEvent]) -> None:
        """Send ``events`` (consecutive ids) as one :class:`KvEventBatch`; nothing when empty."""
        if not events:
            return
        batch = KvEventBatch.model_construct(worker_id=worker_id, epoch=epoch, events=tuple(events))
        try:
            await self._nc.publish(self.subject, batch.model_dump_json().encode())
        except (NatsError, OSError) as exc:
            # NATS is away longer than its send buffer lasts: the events are lost; subscribers see
            # the gap in event ids and ask for a dump. The engine keeps serving.
            log.warning(
                "KV events %d..%d of %s not sent: %r", events[0].event_id, events[-1].event_id, worker_id, exc
            )

    async def serve_dumps(self, *, worker_id: str, dump: Callable[[], KvDump]) -> Subscription:
        """Answer :class:`KvDumpRequest` messages on the worker's dump subject with ``dump()``."""
        subject = kv_dump_subject(namespace=self.namespace, deployment=self.deployment, worker_id=worker_id)

        async def answer(msg: Msg) -> None:
            if msg.data:
                try:
                    request = KvDumpRequest.model_validate_json(msg.data)
                except ValidationError as exc:
                    log.warning("ignoring malformed dump request on %s: %s", subject, exc)
                    return
                if request.worker_id not in (None, worker_id):
                    log.warning("dump request for %s arrived on %s", request.worker_id, subject)
                    return
            await msg.respond(dump().model_dump_json().encode())

        subscription: Subscription = await self._nc.subscribe(subject, cb=answer)
        return subscription


async def request_dump(
    nc: NATS, *, namespace: str, deployment: str, worker_id: str, timeout_s: float = 5.0
) -> KvDump:
    """Ask one worker for everything it holds (what a subscriber does after a gap)."""
    subject = kv_dump_subject(namespace=namespace, deployment=deployment, worker_id=worker_id)
    reply = await nc.request(
        subject, KvDumpRequest(worker_id=worker_id).model_dump_json().encode(), timeout=timeout_s
    )
    return KvDump.model_validate_json(reply.data)
