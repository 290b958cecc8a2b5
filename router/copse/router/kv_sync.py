"""KV events from NATS into the router's radix indexer, with resync from dumps.

Every engine of the deployment publishes :class:`~copse.workers.protocol.kv_events.KvEventBatch`
messages on the deployment's subject. A gap in a worker's event ids, a new engine incarnation
that does not start at event 1, or a worker first heard mid-stream makes the indexer drop that
worker's blocks and ask for a dump (NATS request on the worker's dump subject, falling back to
the worker's ``GET /kv_dump``), retried until it arrives or the worker goes away. A newly usable
worker is also asked for a dump, so an idle worker's cache is known before its first event, and
so is every worker each time the NATS connection is made (again): events published while it was
down are lost. Dumps come over HTTP while NATS is down.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from pydantic import ValidationError

from copse.router.indexer import RadixIndexer
from copse.router.nats_link import NatsLink
from copse.router.service import RoutingService
from copse.router.subscriber import Subscriber
from copse.workers.nats_io import request_dump
from copse.workers.protocol.kv_events import KvDump, KvEventBatch
from copse.workers.protocol.subjects import kv_events_subject

log = logging.getLogger(__name__)


class KvEventSync(Subscriber):
    """Subscribes to a deployment's KV events and keeps the indexer exact."""

    def __init__(
        self,
        service: RoutingService,
        link: NatsLink,
        *,
        namespace: str,
        deployment: str,
        model: str | None = None,
        dump_timeout_s: float = 5.0,
        retry_s: float = 1.0,
    ) -> None:
        """``model``: the deployment's model when the router fronts several (its sync asks only
        that model's workers for dumps); ``None``: every worker is the deployment's."""
        radix = service.router.radix
        if radix is None:
            raise ValueError("KV event sync needs a router built with use_kv_events=True")
        super().__init__(link, subject=kv_events_subject(namespace=namespace, deployment=deployment))
        self.radix: RadixIndexer = radix
        self.service = service
        self.namespace = namespace
        self.deployment = deployment
        self.model = model
        self._dump_timeout_s = dump_timeout_s
        self._retry_s = retry_s
        self._pending: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        """Subscribe (on every connection), and ask each newly usable worker for its cache."""
        self.service.on_worker_added.append(
            lambda worker_id, _url: (
                self.resync(worker_id, reason="discovered") if self._ours(worker_id) else None
            )
        )
        self.service.readiness_checks.append(self.waiting_for)
        await super().start()

    async def on_connect(self, nc: NATS) -> None:
        """Subscribe, then ask every worker for its cache: events sent meanwhile were lost."""
        await super().on_connect(nc)
        for worker_id in list(self.service.router.workers):
            if self._ours(worker_id):
                self.resync(worker_id, reason="connected")

    def _ours(self, worker_id: str) -> bool:
        """Whether ``worker_id`` belongs to this sync's deployment."""
        info = self.service.router.workers.get(worker_id)
        return self.model is None or (info is not None and info.model == self.model)

    def waiting_for(self) -> str | None:
        """The dumps asked for and not loaded yet (``None``: none)."""
        return f"KV dumps of {len(self._pending)} workers" if self._pending else None

    async def stop(self) -> None:
        for task in self._pending.values():
            task.cancel()

    async def on_message(self, msg: Msg) -> None:
        try:
            batch = KvEventBatch.model_validate_json(msg.data)
        except ValidationError as exc:
            log.warning("ignoring a malformed KV event batch: %s", exc.errors()[0]["msg"])
            return
        self.service.metrics.kv_events.inc()
        needed = self.radix.apply(batch)
        if needed is not None:
            self.resync(needed.worker_id, reason=needed.reason)

    def resync(self, worker_id: str, *, reason: str) -> None:
        """Ask ``worker_id`` for a dump (once at a time per worker)."""
        if worker_id in self._pending:
            return
        self.service.metrics.kv_resyncs.labels(reason=reason).inc()
        self._pending[worker_id] = asyncio.create_task(self._resync(worker_id), name=f"kv-dump-{worker_id}")

    async def _resync(self, worker_id: str) -> None:
        try:
            while True:
                dump = await self._fetch(worker_id)
                if dump is not None:
                    if dump.block_size != self.service.config.block_size:
                        log.error(
                            "worker %s hashes %d-token blocks, the router %d: its KV events are unusable",
                            worker_id,
                            dump.block_size,
                            self.service.config.block_size,
                        )
                        return
                    again = self.radix.load_dump(dump)
                    if again is None:
                        return
                    log.info(
                        "worker %s: events missing after its dump (%s); asking again", worker_id, again.reason
                    )
                elif worker_id not in self.service.router.workers and not self.radix.awaiting_dump(worker_id):
                    return
                await asyncio.sleep(self._retry_s)
        finally:
            self._pending.pop(worker_id, None)

    async def _fetch(self, worker_id: str) -> KvDump | None:
        nc = self.link.nc
        if nc is not None:
            try:
                return await request_dump(
                    nc,
                    namespace=self.namespace,
                    deployment=self.deployment,
                    worker_id=worker_id,
                    timeout_s=self._dump_timeout_s,
                )
            except (TimeoutError, NatsError, ValidationError) as exc:
                log.info("dump of %s over NATS failed (%r); trying its HTTP endpoint", worker_id, exc)
        url = self.service.worker_url(worker_id)
        if url is None:
            return None
        try:
            async with self.service.session.get(f"{url}/kv_dump") as response:
                if response.status != 200:
                    return None
                return KvDump.model_validate_json(await response.read())
        except (TimeoutError, aiohttp.ClientError, ValidationError) as exc:
            log.warning("dump of %s over HTTP failed: %r", worker_id, exc)
            return None
