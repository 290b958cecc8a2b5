"""Sharing in-flight load between router replicas over NATS, so they do not herd.

Each replica publishes what it charges workers (request routed: the worker, prompt blocks,
prefill tokens and time, KV tokens; first token; end) on the deployment's load subject, and
mirrors what its peers publish into its own load tracker. Replicas also publish a heartbeat;
a peer silent for ``peer_timeout_s`` is forgotten with everything it charged (it stopped, or
its messages are not arriving). A peer's prefill backlog decays from when its message arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from pydantic import BaseModel, ConfigDict, ValidationError

from copse.router.core import FlightRecord, PeerChange
from copse.router.service import RoutingService
from copse.router.subscriber import Subscriber
from copse.workers.protocol.subjects import subject_token

log = logging.getLogger(__name__)


def load_subject(*, namespace: str, deployment: str) -> str:
    """Subject on which the router replicas of one deployment share their load."""
    return f"copse.router.load.{subject_token(namespace)}.{subject_token(deployment)}"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WireRecord(_Wire):
    worker_id: str
    hashes: list[int]
    prefill_tokens: int
    prefill_ms: float
    kv_tokens: float


class WireChange(_Wire):
    op: str
    key: str
    record: WireRecord | None = None


class LoadMessage(_Wire):
    """One message on the load subject."""

    router: str
    """Id of the replica that sent it."""
    changes: list[WireChange]
    """Empty for a heartbeat."""


def encode_changes(router_id: str, changes: list[PeerChange]) -> bytes:
    """The wire form of ``changes``."""
    wire = [
        WireChange(
            op=change.op,
            key=change.key,
            record=None
            if change.record is None
            else WireRecord(
                worker_id=change.record.worker_id,
                hashes=list(change.record.hashes),
                prefill_tokens=change.record.prefill_tokens,
                prefill_ms=change.record.prefill_ms,
                kv_tokens=change.record.kv_tokens,
            ),
        )
        for change in changes
    ]
    return LoadMessage(router=router_id, changes=wire).model_dump_json().encode()


def decode_changes(data: bytes) -> tuple[str, list[PeerChange]]:
    """``(router id, changes)`` of a message; ``ValidationError`` for a malformed one."""
    message = LoadMessage.model_validate_json(data)
    changes = []
    for change in message.changes:
        if change.op not in ("add", "prefilled", "free"):
            raise ValueError(f"unknown load change {change.op!r}")
        record = change.record
        changes.append(
            PeerChange(
                op=change.op,  # type: ignore[arg-type]
                key=change.key,
                record=None
                if record is None
                else FlightRecord(
                    worker_id=record.worker_id,
                    hashes=record.hashes,
                    prefill_tokens=record.prefill_tokens,
                    prefill_ms=record.prefill_ms,
                    kv_tokens=record.kv_tokens,
                ),
            )
        )
    return message.router, changes


class ReplicaSync(Subscriber):
    """Publishes this replica's load changes and mirrors its peers'."""

    def __init__(
        self,
        service: RoutingService,
        nc: NATS,
        *,
        namespace: str,
        deployment: str,
        router_id: str,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 5.0,
    ) -> None:
        if service.router.outbox is None:
            raise ValueError("replica sync needs a router built with share_load=True")
        super().__init__(nc, subject=load_subject(namespace=namespace, deployment=deployment))
        self.service = service
        self.router_id = router_id
        self._heartbeat_s = heartbeat_s
        self._peer_timeout_s = peer_timeout_s
        self.peers: dict[str, float] = {}
        """Peer id -> when it was last heard (service clock)."""
        self._sending: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    async def start(self) -> None:
        await super().start()
        self.service.on_changes.append(self._wake.set)
        self.service.add_task(asyncio.create_task(self._run(), name="replica-sync"))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_beat = loop.time()
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, next_beat - loop.time()))
            self._wake.clear()
            await self.flush(heartbeat=loop.time() >= next_beat)
            if loop.time() >= next_beat:
                next_beat = loop.time() + self._heartbeat_s
                self._forget_silent_peers()

    async def flush(self, *, heartbeat: bool = False) -> None:
        """Publish pending changes (or an empty heartbeat)."""
        outbox = self.service.router.outbox
        assert outbox is not None
        if not outbox and not heartbeat:
            return
        changes = list(outbox)
        outbox.clear()
        await self._nc.publish(self.subject, encode_changes(self.router_id, changes))

    def _forget_silent_peers(self) -> None:
        now = self.service.now()
        for peer, seen in list(self.peers.items()):
            if now - seen > self._peer_timeout_s:
                log.warning("router replica %s silent for %.1f s: forgetting its load", peer, now - seen)
                del self.peers[peer]
                self.service.released(self.service.router.forget_peer(peer, now=now))
        self.service.metrics.peers.set(len(self.peers))

    async def on_message(self, msg: Msg) -> None:
        try:
            peer, changes = decode_changes(msg.data)
        except (ValidationError, ValueError) as exc:
            log.warning("ignoring a malformed load message: %s", exc)
            return
        if peer == self.router_id:
            return
        now = self.service.now()
        if peer not in self.peers:
            log.info("router replica %s joined", peer)
        self.peers[peer] = now
        self.service.metrics.peers.set(len(self.peers))
        for change in changes:
            self.service.released(self.service.router.apply_peer(change, peer=peer, now=now))
