"""Sharing in-flight load between router replicas over NATS, so they do not herd.

Each replica publishes what it charges workers (request routed: the worker, prompt blocks,
prefill tokens and time, KV tokens, its LoRA adapter; first token; end) on the deployment's load
subject, and mirrors what its peers publish into its own load tracker (and, through the adapter,
into its mirror of each worker's adapter cache). Replicas also publish a heartbeat;
a peer silent for ``peer_timeout_s`` is forgotten with everything it charged (it stopped, or
its messages are not arriving). A peer's prefill backlog decays from when its message arrived.

Messages are numbered per sender. A replica that hears a peer it does not know (it just started,
or the peer did, or they lost each other) or sees a gap in a peer's numbers (messages lost, e.g.
while NATS was down: a replica that cannot publish still numbers what it drops) asks that peer
for a *snapshot* of its in-flight charges (NATS request on the peer's snapshot subject), holds
the peer's messages meanwhile, loads the snapshot and replays the held messages numbered after
it. So a replica that starts or restarts while others run knows their load before it reports
ready (:meth:`ReplicaSync.waiting_for`): it listens two heartbeats for peers and waits for their
snapshots.

Replicas also share their wait queues' heads (:class:`~copse.router.fairness.QueueHead`: per
priority band, each waiting tenant's start tag, and the band's virtual time), so that capacity
a finished request frees goes to the request that comes first across every replica's queue
(:mod:`copse.router.fairness`). They travel on a subject of their own (:func:`heads_subject`), which
replicas of earlier versions do not hear, when they changed since last built and a peer listens,
and with each heartbeat, so that they stay fresh; each names the last load message sent before
it, and applies once that message's changes are (a head's tag already counts them). A peer's head
holds nothing back for longer than ``Thresholds.peer_queue_max_age_s`` after its request was first
sent, and the replica routes what it held back as soon as that lapses (a wake-up at that moment), so a
dead peer, or a head its peer cannot route, holds nothing back for longer. Heads are whole state,
not changes: only the latest waits.

Replicas of an earlier version refuse fields they do not know. Fields at their default are left
out of the wire form, changes naming a LoRA adapter or a retry travel in messages of their own
(:func:`batches`), and a snapshot request without :data:`SNAPSHOT_WITH_ADAPTERS` (theirs) is
answered without the adapter fields: during a roll they lose only the adapters and the retries'
load (until the gap brings them a snapshot), not the rest of the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import NamedTuple

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from pydantic import BaseModel, ConfigDict, ValidationError

from copse.router.core import FlightRecord, PeerChange
from copse.router.fairness import HeardHeads, QueueHead
from copse.router.nats_link import NatsLink
from copse.router.service import RoutingService
from copse.router.subscriber import Subscriber
from copse.workers.protocol.subjects import subject_token

log = logging.getLogger(__name__)


def load_subject(*, namespace: str, deployment: str) -> str:
    """Subject on which the router replicas of one deployment share their load."""
    return f"copse.router.load.{subject_token(namespace)}.{subject_token(deployment)}"


def heads_subject(*, namespace: str, deployment: str) -> str:
    """Subject on which the router replicas of one deployment share their queue heads (apart from
    the load subject: replicas of earlier versions refuse a load message with fields they do not
    know)."""
    return f"{load_subject(namespace=namespace, deployment=deployment)}.heads"


def snapshot_subject(*, namespace: str, deployment: str, router_id: str) -> str:
    """Subject on which one router replica answers snapshot requests."""
    scope = f"{subject_token(namespace)}.{subject_token(deployment)}"
    return f"copse.router.snapshot.{scope}.{subject_token(router_id)}"


SNAPSHOT_WITH_ADAPTERS = b"adapters"
"""The body of a snapshot request from a replica that reads adapters; replicas of earlier versions
send an empty one, and are answered without the adapter fields their schema refuses."""


class _Wire(BaseModel):
    # Fields a later version adds are ignored, not refused.
    model_config = ConfigDict(extra="ignore")


class WireRecord(_Wire):
    worker_id: str
    hashes: list[int]
    prefill_tokens: int
    prefill_ms: float
    kv_tokens: float
    output_tokens: int = 0
    """Output tokens expected (absent from replicas of earlier versions)."""
    tenant: str = ""
    priority: int = 0
    adapter: str = ""
    """LoRA adapter of the request (absent from replicas of earlier versions, and for the base model)."""
    retry: bool = False
    """The request was routed before (absent at its first route, and from replicas of earlier
    versions): a peer mirrors its load but charges its tenant only once."""


class WireChange(_Wire):
    op: str
    key: str
    record: WireRecord | None = None


class WireHead(_Wire):
    priority: int
    start: float
    tenant: str
    virtual: float
    tokens: float = 0.0
    waited_s: float = 0.0
    model: str = ""


class LoadMessage(_Wire):
    """One message on the load subject."""

    router: str
    """Id of the replica that sent it."""
    seq: int = 0
    """Its number among the sender's messages (1, 2, ...); 0 from a sender that does not number."""
    changes: list[WireChange]
    """Empty for a heartbeat."""


class HeadsMessage(_Wire):
    """One message on the heads subject."""

    router: str
    """Id of the replica that sent it."""
    seq: int
    """Number of the last load message the sender had sent before it: its heads apply once those
    changes are (a head's tag already counts the charges they carry)."""
    queues: list[WireHead]
    """The sender's queue heads, all of them (empty: nothing waits there)."""


class SnapshotFlight(_Wire):
    key: str
    record: WireRecord
    prefilling: bool


class Snapshot(_Wire):
    """A replica's answer to a snapshot request: everything it has in flight."""

    router: str
    seq: int
    """Number of the last load message it had sent when it took the snapshot."""
    flights: list[SnapshotFlight]
    adapters: dict[str, list[str]] = {}
    """Per worker id, the LoRA adapters it believes the worker holds, least recently used first."""


def _wire(record: FlightRecord) -> WireRecord:
    return WireRecord(
        worker_id=record.worker_id,
        hashes=list(record.hashes),
        prefill_tokens=record.prefill_tokens,
        prefill_ms=record.prefill_ms,
        kv_tokens=record.kv_tokens,
        output_tokens=record.output_tokens,
        tenant=record.tenant,
        priority=record.priority,
        adapter=record.adapter,
        retry=record.retry,
    )


def _record(wire: WireRecord) -> FlightRecord:
    return FlightRecord(
        worker_id=wire.worker_id,
        hashes=wire.hashes,
        prefill_tokens=wire.prefill_tokens,
        prefill_ms=wire.prefill_ms,
        kv_tokens=wire.kv_tokens,
        output_tokens=wire.output_tokens,
        tenant=wire.tenant,
        priority=wire.priority,
        adapter=wire.adapter,
        retry=wire.retry,
    )


def encode_changes(router_id: str, changes: list[PeerChange], *, seq: int = 0) -> bytes:
    """The wire form of ``changes``."""
    wire = [
        WireChange(
            op=change.op, key=change.key, record=None if change.record is None else _wire(change.record)
        )
        for change in changes
    ]
    # Fields at their default are left out: a replica of an earlier version, whose schema refuses
    # fields it does not know, still reads every message that uses none of the newer ones.
    message = LoadMessage(router=router_id, seq=seq, changes=wire)
    return message.model_dump_json(exclude_defaults=True).encode()


def encode_heads(router_id: str, heads: list[QueueHead], *, seq: int) -> bytes:
    """The wire form of a replica's queue ``heads`` (all of them), sent after its load message
    ``seq``."""
    queues = [WireHead(**dataclasses.asdict(head)) for head in heads]
    return HeadsMessage(router=router_id, seq=seq, queues=queues).model_dump_json().encode()


def decode_heads(data: bytes) -> tuple[str, int, list[QueueHead]]:
    """``(router id, seq, queue heads)`` of a heads message; ``ValidationError`` for a malformed one."""
    message = HeadsMessage.model_validate_json(data)
    return message.router, message.seq, [QueueHead(**head.model_dump()) for head in message.queues]


def batches(changes: list[PeerChange]) -> list[list[PeerChange]]:
    """``changes`` cut, in order, into runs that each carry an adapter or a retry, or neither, one
    load message each: a replica of an earlier version drops a message naming an adapter or a
    retry (its schema refuses the fields), and so loses only those changes, not the frees and
    first-route base-model charges sent with them (the gap in the numbers then brings it a
    snapshot it can read)."""
    runs: list[list[PeerChange]] = []
    for change in changes:
        if runs and _carries(runs[-1][0]) == _carries(change):
            runs[-1].append(change)
        else:
            runs.append([change])
    return runs


def _carries(change: PeerChange) -> bool:
    return change.record is not None and (bool(change.record.adapter) or change.record.retry)


def decode_message(data: bytes) -> tuple[str, int, list[PeerChange]]:
    """``(router id, seq, changes)`` of a message; ``ValidationError``/``ValueError`` for a malformed one."""
    message = LoadMessage.model_validate_json(data)
    changes = []
    for change in message.changes:
        if change.op not in ("add", "prefilled", "free"):
            raise ValueError(f"unknown load change {change.op!r}")
        changes.append(
            PeerChange(
                op=change.op,  # type: ignore[arg-type]
                key=change.key,
                record=None if change.record is None else _record(change.record),
            )
        )
    return message.router, message.seq, changes


def decode_changes(data: bytes) -> tuple[str, list[PeerChange]]:
    """``(router id, changes)`` of a message; ``ValidationError`` for a malformed one."""
    router_id, _seq, changes = decode_message(data)
    return router_id, changes


MAX_EARLIER_HEADS = 16
"""A peer's heads heard while earlier ones still wait to be applied are kept, up to this many
(the oldest, and the latest after it): the requests they name keep when they were first heard."""


class _PendingHeads(NamedTuple):
    """A peer's queue heads heard before they may be applied."""

    seq: int
    """Number of the load message the peer sent before them."""
    heads: list[QueueHead]
    heard: float
    """When they were heard (service clock): applied later, they keep it, so that a request the
    peer keeps sending holds this queue back for the cap after it was first heard, not after its
    heads could be applied (a snapshot pending for seconds would restart the hold)."""
    earlier: tuple[HeardHeads, ...] = ()
    """The peer's heads heard before these while they waited, oldest first."""

    def then(self, *, seq: int, heads: list[QueueHead], heard: float) -> _PendingHeads:
        """The peer's next heads, heard at ``heard`` while these still wait."""
        earlier = (*self.earlier, HeardHeads(heard=self.heard, heads=self.heads))
        if len(earlier) > MAX_EARLIER_HEADS:
            earlier = (earlier[0], *earlier[-(MAX_EARLIER_HEADS - 1) :])
        return _PendingHeads(seq=seq, heads=heads, heard=heard, earlier=earlier)


@dataclasses.dataclass(slots=True)
class _Peer:
    """What this replica knows of one peer."""

    heard: float
    """When it was last heard (service clock)."""
    seq: int = 0
    """Number of its last message applied."""
    synced: bool = False
    """Its snapshot was loaded (else its messages are held)."""
    held: list[tuple[int, list[PeerChange]]] = dataclasses.field(default_factory=list)
    heads: _PendingHeads | None = None
    """Its latest queue heads not applied yet: they wait until the changes of the load message
    sent before them are applied."""


class ReplicaSync(Subscriber):
    """Publishes this replica's load changes and mirrors its peers' (see the module documentation)."""

    def __init__(
        self,
        service: RoutingService,
        link: NatsLink,
        *,
        namespace: str,
        deployment: str,
        router_id: str,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 5.0,
        snapshot_timeout_s: float = 2.0,
    ) -> None:
        if service.router.outbox is None:
            raise ValueError("replica sync needs a router built with share_load=True")
        super().__init__(link, subject=load_subject(namespace=namespace, deployment=deployment))
        self._heads_subject = heads_subject(namespace=namespace, deployment=deployment)
        self.service = service
        self.router_id = router_id
        self.namespace = namespace
        self.deployment = deployment
        self._heartbeat_s = heartbeat_s
        self._peer_timeout_s = peer_timeout_s
        self._snapshot_timeout_s = snapshot_timeout_s
        self.peers: dict[str, _Peer] = {}
        self._seq = 0
        """Number of the last load message sent (or dropped while disconnected)."""
        self._heads_sent: list[QueueHead] | None = None
        """The queue heads this replica last published (``None``: none yet)."""
        self._heads_version = -1
        """The router's :attr:`~copse.router.core.Router.queue_version` when they were built."""
        self._listen_until: float | None = None
        """End of the first listening window for peers (``None`` before the first connection)."""
        self._wake = asyncio.Event()
        self._syncs: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await super().start()
        self.service.readiness_checks.append(self.waiting_for)
        self.service.on_changes.append(self._wake.set)
        self.service.add_task(asyncio.create_task(self._run(), name="replica-sync"))

    async def stop(self) -> None:
        for task in self._syncs:
            task.cancel()

    async def on_connect(self, nc: NATS) -> None:
        await super().on_connect(nc)
        subject = snapshot_subject(
            namespace=self.namespace, deployment=self.deployment, router_id=self.router_id
        )
        await nc.subscribe(subject, cb=self._answer_snapshot)
        await nc.subscribe(self._heads_subject, cb=self._on_heads)
        if self._listen_until is None:
            self._listen_until = self.service.now() + 2 * self._heartbeat_s

    def waiting_for(self) -> str | None:
        """What this replica still waits for before it knows its peers' load (``None``: nothing)."""
        if self._listen_until is None:
            return None  # the NATS link says it is not connected
        if self.service.now() < self._listen_until:
            return "peer routers' heartbeats"
        syncing = sorted(peer for peer, state in self.peers.items() if not state.synced)
        return f"load snapshots of peer routers {', '.join(syncing)}" if syncing else None

    # -- publishing ---------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_beat = loop.time()
        hold_ends: float | None = None  # when peers' queue heads stop holding this queue back
        while True:
            # (asyncio.timeout, not wait_for: in Python 3.11 wait_for can swallow a cancellation
            # that arrives as the wake-up does, and the router's close then waits forever)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(next_beat if hold_ends is None else min(next_beat, hold_ends)):
                    await self._wake.wait()
            self._wake.clear()
            beat = loop.time() >= next_beat
            await self.flush(heartbeat=beat)
            if beat:
                next_beat = loop.time() + self._heartbeat_s
                self._forget_silent_peers()
            router = self.service.router
            now = self.service.now()
            if router.queued and (beat or (hold_ends is not None and loop.time() >= hold_ends)):
                self.service.released(router.drain(now=now))  # the hold lapsed (or a peer went silent)
            ends = router.hold_ends(now=now) if router.queued else None
            hold_ends = None if ends is None else loop.time() + (ends - now)

    async def flush(self, *, heartbeat: bool = False) -> None:
        """Publish pending changes, and the queue heads when they changed while peers listen (or
        a heartbeat, which always carries the heads). Without a connection they are dropped,
        numbered all the same: peers see the gap and ask for a snapshot."""
        outbox = self.service.router.outbox
        assert outbox is not None
        runs = (batches(list(outbox)) or [[]]) if outbox or heartbeat else []
        outbox.clear()
        first = self._seq + 1
        self._seq += len(runs)
        # The heads are built before any await: routed meanwhile, a request's charge would count in
        # their tags before the message carrying it is sent, and peers would charge it twice.
        heads = self._heads_to_send(heartbeat=heartbeat)
        for seq, changes in enumerate(runs, start=first):
            nc = self.link.nc
            if nc is None:
                continue
            try:
                await nc.publish(self.subject, encode_changes(self.router_id, changes, seq=seq))
            except (NatsError, OSError) as exc:
                log.info("load message %d not sent (%r); peers will ask for a snapshot", seq, exc)
        nc = self.link.nc
        if heads is not None and nc is not None:
            with contextlib.suppress(NatsError, OSError):
                await nc.publish(self._heads_subject, heads)

    def _heads_to_send(self, *, heartbeat: bool) -> bytes | None:
        """The wire form of the queue heads, when they are to be sent now (they changed while
        peers listen, or a heartbeat), naming the last load message numbered; else ``None``."""
        router = self.service.router
        version = router.queue_version
        if self.link.nc is None or not (heartbeat or (self.peers and version != self._heads_version)):
            return None
        self._heads_version = version
        heads = router.queue_heads(now=self.service.now())
        if not heartbeat and heads == self._heads_sent:
            return None
        self._heads_sent = heads
        return encode_heads(self.router_id, heads, seq=self._seq)

    async def _answer_snapshot(self, msg: Msg) -> None:
        await self.flush()  # what the snapshot holds is then all sent, up to its number
        # A replica of an earlier version asks with an empty request and refuses the adapter
        # fields: its answer leaves them out (it still gets every request's load).
        adapters = msg.data == SNAPSHOT_WITH_ADAPTERS
        flights = [
            SnapshotFlight(
                key=key,
                record=_wire(record if adapters else dataclasses.replace(record, adapter="")),
                prefilling=prefilling,
            )
            for key, record, prefilling in self.service.router.own_flights()
        ]
        snapshot = Snapshot(
            router=self.router_id,
            seq=self._seq,
            flights=flights,
            adapters=self.service.router.held_adapters() if adapters else {},
        )
        with contextlib.suppress(NatsError, OSError):
            await msg.respond(snapshot.model_dump_json(exclude_defaults=True).encode())

    # -- mirroring ----------------------------------------------------------------------------

    def _forget_silent_peers(self) -> None:
        now = self.service.now()
        for peer, state in list(self.peers.items()):
            if now - state.heard > self._peer_timeout_s:
                log.warning(
                    "router replica %s silent for %.1f s: forgetting its load", peer, now - state.heard
                )
                del self.peers[peer]
                self.service.released(self.service.router.forget_peer(peer, now=now))
                self._apply_pending_heads()  # they may have waited for its snapshot
        self.service.metrics.peers.set(len(self.peers))

    async def on_message(self, msg: Msg) -> None:
        try:
            peer, seq, changes = decode_message(msg.data)
        except (ValidationError, ValueError) as exc:
            log.warning("ignoring a malformed load message: %s", exc)
            return
        if peer == self.router_id:
            return
        now = self.service.now()
        state = self.peers.get(peer)
        if state is None:
            log.info("router replica %s joined: asking for its load snapshot", peer)
            state = self.peers[peer] = _Peer(heard=now)
            self.service.metrics.peers.set(len(self.peers))
            self._start_sync(peer, state)
        state.heard = now
        if not state.synced:
            state.held.append((seq, changes))
            return
        if seq and seq <= state.seq:
            return  # already in its snapshot
        if seq and seq != state.seq + 1:
            log.warning(
                "router replica %s: messages %d..%d lost; asking for its load snapshot",
                peer,
                state.seq + 1,
                seq - 1,
            )
            state.synced = False
            state.held = [(seq, changes)]
            self._start_sync(peer, state)
            return
        state.seq = seq
        self._apply(peer, changes, now=now)
        self._apply_heads(peer, state)

    async def _on_heads(self, msg: Msg) -> None:
        try:
            peer, seq, heads = decode_heads(msg.data)
        except ValidationError as exc:
            log.warning("ignoring a malformed queue heads message: %s", exc)
            return
        state = self.peers.get(peer)
        if state is None:
            return  # not heard on the load subject yet: its next heartbeat repeats them
        heard, pending = self.service.now(), state.heads
        if pending is None:
            state.heads = _PendingHeads(seq=seq, heads=heads, heard=heard)
        else:
            state.heads = pending.then(seq=seq, heads=heads, heard=heard)
        self._apply_heads(peer, state)

    def _apply_heads(self, peer: str, state: _Peer) -> None:
        """Apply ``peer``'s pending queue heads once the changes sent before them are applied, and
        while no peer's messages are held (its snapshot pending): ``peer`` may have applied one of
        those, and its tags count a charge this replica would otherwise count again when it
        replays the message."""
        pending = state.heads
        if pending is None or not state.synced or state.seq < pending.seq:
            return
        if any(not other.synced for other in self.peers.values()):
            return  # _sync applies them once every peer is synced
        state.heads = None
        router, now = self.service.router, self.service.now()
        released = router.apply_peer_queue(
            peer, pending.heads, now=now, heard=pending.heard, earlier=pending.earlier
        )
        self.service.released(released)
        self._wake.set()  # a hold on this replica's queue may begin or end: when it lapses

    def _apply(self, peer: str, changes: list[PeerChange], *, now: float) -> None:
        router = self.service.router
        for change in changes:
            self.service.released(router.apply_peer(change, peer=peer, now=now))

    def _start_sync(self, peer: str, state: _Peer) -> None:
        task = asyncio.create_task(self._sync(peer, state), name=f"peer-snapshot-{peer}")
        self._syncs.add(task)
        task.add_done_callback(self._syncs.discard)

    async def _sync(self, peer: str, state: _Peer) -> None:
        snapshot = await self._request_snapshot(peer)
        if self.peers.get(peer) is not state:
            return  # forgotten meanwhile
        now = self.service.now()
        base = 0
        if snapshot is not None:
            flights = [(flight.key, _record(flight.record), flight.prefilling) for flight in snapshot.flights]
            self.service.released(
                self.service.router.load_peer_snapshot(peer, flights, now=now, adapters=snapshot.adapters)
            )
            base = snapshot.seq
            self.service.metrics.peer_snapshots.labels(result="loaded").inc()
        else:
            self.service.metrics.peer_snapshots.labels(result="failed").inc()
        held, state.held = state.held, []
        state.seq = base
        for seq, changes in held:
            if seq and seq <= base:
                continue
            self._apply(peer, changes, now=now)
            state.seq = max(state.seq, seq)
        state.synced = True
        if state.heads is not None and snapshot is None:
            state.heads = state.heads._replace(seq=state.seq)  # the changes before them are lost for good
        self._apply_pending_heads()

    def _apply_pending_heads(self) -> None:
        """Apply every peer's pending queue heads that may now be (:meth:`_apply_heads`)."""
        for peer, state in list(self.peers.items()):
            self._apply_heads(peer, state)

    async def _request_snapshot(self, peer: str) -> Snapshot | None:
        nc = self.link.nc
        if nc is None:
            return None
        subject = snapshot_subject(namespace=self.namespace, deployment=self.deployment, router_id=peer)
        try:
            reply = await nc.request(subject, SNAPSHOT_WITH_ADAPTERS, timeout=self._snapshot_timeout_s)
            snapshot = Snapshot.model_validate_json(reply.data)
        except (NatsError, OSError, TimeoutError, ValidationError) as exc:
            log.warning(
                "no load snapshot from router replica %s (%r): mirroring its messages only", peer, exc
            )
            return None
        if snapshot.router != peer:
            log.warning("snapshot of %s answered by %s: ignored", peer, snapshot.router)
            return None
        log.info("router replica %s: loaded its snapshot (%d in flight)", peer, len(snapshot.flights))
        return snapshot
