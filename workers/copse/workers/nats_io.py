"""KV events over NATS: publishing batches and answering dump requests (mocker and relay)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import nats
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


async def connect(url: str) -> NATS:
    """A connection for publishing KV events that outlives NATS restarts: it retries every
    :data:`RECONNECT_WAIT_S` for ever (the first connection too) and resubscribes when back."""
    return await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=RECONNECT_WAIT_S)


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
