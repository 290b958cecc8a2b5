"""Router restarts and outages: NATS coming and going (approximate mode, then resync), replicas
that start while others run (peer load snapshots), readiness, and draining on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from copse.router.config import RouterConfig, parse_config
from copse.router.core import FlightRecord, PeerChange
from copse.router.fairness import QueueHead
from copse.router.nats_link import NatsLink
from copse.router.policies import RouteRequest
from copse.router.replica_sync import (
    Snapshot,
    SnapshotFlight,
    WireRecord,
    encode_changes,
    encode_heads,
    heads_subject,
    load_subject,
    snapshot_subject,
)
from copse.router.server import RunningRouter, start_router
from copse.workers.protocol import block_hashes
from copse.workers.testing import free_port, mock_fleet, nats_server

from .conftest import eventually

MODEL = "mock-model"
PROMPT = list(range(2000, 2000 + 640))


def _config(urls: list[str], nats_url: str, deployment: str, **extra: Any) -> RouterConfig:
    raw: dict[str, Any] = {
        "model": MODEL,
        "engine": "mock",
        "port": 0,
        "block_size": 32,
        "nats_url": nats_url,
        "deployment": deployment,
        "discovery": {"kind": "static", "workers": [{"url": url} for url in urls]},
        "health_interval_s": 0.05,
        "nats_reconnect_max_s": 0.5,
        "seed": 3,
    }
    raw.update(extra)
    return parse_config(raw, source="test")


async def _ready(running: RunningRouter) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(f"{running.url}/ready") as response:
        body: dict[str, Any] = await response.json()
        return response.status, body


async def _is_ready(running: RunningRouter) -> bool:
    return (await _ready(running))[0] == 200


async def _complete(running: RunningRouter, prompt: list[int]) -> None:
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        async with http.post(f"{running.url}/v1/completions", json=body) as response:
            assert response.status == 200


def _holders(running: RunningRouter, prompt: list[int]) -> dict[str, int]:
    router = running.service.router
    overlaps = router.indexer.overlaps(block_hashes(prompt, block_size=32))
    return {router.slots.worker_id(slot): depth for slot, depth in overlaps.items()}


async def test_without_nats_the_router_serves_approximately_and_resyncs_when_it_comes() -> None:
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    async with mock_fleet(engines=2) as fleet:  # engines without NATS: their dumps come over HTTP
        running = await start_router(
            _config(fleet.urls, url, "late", recovery_timeout_s=1.0), router_id="late"
        )
        try:
            metrics = running.service.metrics
            await eventually(lambda: len(running.service.router.workers) == 2)
            status, body = await _ready(running)
            assert status == 503
            assert f"a NATS connection ({url})" in body["waiting_for"]
            assert metrics.nats_connected._value.get() == 0
            await _complete(running, PROMPT)  # served meanwhile, learning from its own decision
            learned = _holders(running, PROMPT)
            assert list(learned.values()) == [20]
            await eventually(lambda: _is_ready(running), timeout_s=5)  # gave up waiting for NATS
            with nats_server(port=port):
                await eventually(lambda: metrics.nats_connected._value.get() == 1)
                assert metrics.kv_resyncs.labels(reason="connected")._value.get() == 2
                radix = running.service.router.radix
                assert radix is not None
                await eventually(
                    lambda: not any(radix.awaiting_dump(w) for w in running.service.router.workers)
                )
                assert not radix.learning
                # the dumps say what the engines really hold: the whole prompt where it was served
                assert _holders(running, PROMPT) == learned
            await eventually(lambda: metrics.nats_connected._value.get() == 0)
            assert radix.learning
            await _complete(running, PROMPT)  # and it keeps serving
        finally:
            await running.close()


async def _fake_nats(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, log: list[str]) -> None:
    """Just enough of the NATS protocol for one client, answering in order like a real server and
    logging what it processed (``<-`` received, ``->`` sent)."""
    writer.write(b'INFO {"server_id":"fake","version":"2.10.0","max_payload":1048576,"headers":true}\r\n')
    subscriptions: dict[str, str] = {}  # subject -> sid
    while line := (await reader.readline()).decode().strip():
        verb, *args = line.split()
        log.append(f"<- {verb} {args[0] if args and verb != 'CONNECT' else ''}".strip())
        if verb == "PING":
            writer.write(b"PONG\r\n")
            log.append("-> PONG")
        elif verb == "SUB":
            subscriptions[args[0]] = args[-1]
        elif verb == "PUB":
            payload = await reader.readexactly(int(args[-1]) + 2)
            if args[0] in subscriptions:
                writer.write(f"MSG {args[0]} {subscriptions[args[0]]} {args[-1]}\r\n".encode() + payload)
                log.append(f"-> MSG {args[0]}")
        await writer.drain()


async def test_the_link_is_connected_only_once_the_server_holds_its_subscriptions() -> None:
    """Events published right after the router reports NATS connected reach it: the server has
    processed its subscriptions before it says so (a flush's PONG does not prove that: nats-py
    writes the PING ahead of the SUBs it still queues)."""
    log: list[str] = []
    server = await asyncio.start_server(lambda r, w: _fake_nats(r, w, log), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    link = NatsLink(f"nats://127.0.0.1:{port}", name="order")
    seen_when_connected: list[str] = []

    async def subscribe(nc: NATS) -> None:
        await nc.subscribe("copse.kv.events.default.order")

    link.on_connect.append(subscribe)
    link.on_state = lambda connected: seen_when_connected.extend(log) if connected else None
    try:
        await link.start()
        assert link.connected
        subscribed = seen_when_connected.index("<- SUB copse.kv.events.default.order")
        answers = [i for i, entry in enumerate(seen_when_connected) if entry.startswith("->")]
        assert answers[-1] > subscribed, f"connected on an answer sent before the SUB: {seen_when_connected}"
    finally:
        await link.close()
        server.close()


async def test_nats_restarting_under_a_router_and_engines_loses_nothing_for_good() -> None:
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    server = contextlib.ExitStack()
    server.enter_context(nats_server(port=port))
    try:
        async with mock_fleet(engines=2, nats_url=url, deployment="restart") as fleet:
            running = await start_router(_config(fleet.urls, url, "restart"), router_id="restart")
            try:
                metrics = running.service.metrics
                await eventually(lambda: len(running.service.router.workers) == 2)
                assert metrics.nats_connected._value.get() == 1
                await _complete(running, PROMPT)
                await eventually(lambda: bool(_holders(running, PROMPT)))
                server.close()  # NATS goes away under the running engines and router
                await eventually(lambda: metrics.nats_connected._value.get() == 0)
                await _complete(running, PROMPT)
                server.enter_context(nats_server(port=port))
                await eventually(lambda: metrics.nats_connected._value.get() == 1, timeout_s=15)
                other = list(range(9000, 9000 + 320))
                await _complete(running, other)
                # KV events flow again: the router learns the new prompt from the engine's event
                await eventually(lambda: list(_holders(running, other).values()) == [10], timeout_s=15)
                assert metrics.kv_resyncs.labels(reason="connected")._value.get() >= 2
            finally:
                await running.close()
    finally:
        server.close()


async def test_a_replica_starting_while_another_runs_knows_its_load_before_it_is_ready(nats_url: str) -> None:
    async with mock_fleet(engines=2, nats_url=nats_url, deployment="peers") as fleet:
        one = await start_router(_config(fleet.urls, nats_url, "peers"), router_id="one")
        try:
            await eventually(lambda: len(one.service.router.workers) == 2)
            held = RouteRequest(
                request_id="held", hashes=block_hashes(PROMPT, block_size=32), prompt_tokens=640, max_tokens=5
            )
            route = one.service.router.submit(held, now=time.monotonic())
            assert route is not None
            one.service.router.prefill_done("held", now=time.monotonic())
            one.service.released([])
            two = await start_router(_config(fleet.urls, nats_url, "peers"), router_id="two")
            try:
                status, body = await _ready(two)
                assert status == 503
                assert any("peer routers" in reason for reason in body["waiting_for"])
                await eventually(lambda: _is_ready(two))
                # what "one" had in flight before "two" existed, from its snapshot
                mirror = two.service.router
                slot = mirror.slots.slot(route.worker_id)
                assert mirror.sequences.requests[slot] == 1
                assert mirror.sequences.prefilling[slot] == 0  # its first token had come
                assert two.service.metrics.peer_snapshots.labels(result="loaded")._value.get() == 1
                one.service.router.finish("held", now=time.monotonic())
                one.service.released([])
                await eventually(lambda: mirror.sequences.requests[slot] == 0)
            finally:
                await two.close()
        finally:
            await one.close()


@contextlib.asynccontextmanager
async def _router_beside_fake_peers(
    nats_url: str, deployment: str
) -> AsyncIterator[tuple[RunningRouter, NATS, str]]:
    """Router "me" over one mocked engine, and a NATS connection on which the test plays its peer
    replicas; yields them and the engine's worker id."""
    async with mock_fleet(engines=1) as fleet:
        running = await start_router(_config(fleet.urls, nats_url, deployment), router_id="me")
        nc = await nats.connect(nats_url)
        try:
            await eventually(lambda: len(running.service.router.workers) == 1)
            (worker,) = running.service.router.workers
            yield running, nc, worker
        finally:
            await nc.drain()
            await running.close()


async def test_lost_messages_of_a_peer_bring_a_new_snapshot(nats_url: str) -> None:
    """A fake peer numbers its messages 1, 2, then 5 (3 and 4 lost); its snapshot is the truth."""
    async with _router_beside_fake_peers(nats_url, "gaps") as (running, nc, worker):
        wire = WireRecord(
            worker_id=worker,
            hashes=block_hashes(PROMPT, block_size=32),
            prefill_tokens=640,
            prefill_ms=9.0,
            kv_tokens=8.0,
        )
        record = FlightRecord(**wire.model_dump())
        state: dict[str, SnapshotFlight] = {}  # the fake peer's in-flight charges
        sent = 0
        snapshots = 0

        async def answer(msg: Msg) -> None:
            nonlocal snapshots
            snapshots += 1
            snapshot = Snapshot(router="fake", seq=sent, flights=list(state.values()))
            await msg.respond(snapshot.model_dump_json().encode())

        await nc.subscribe(
            snapshot_subject(namespace="default", deployment="gaps", router_id="fake"), cb=answer
        )

        async def send(*changes: PeerChange, seq: int, lost: bool = False) -> None:
            nonlocal sent
            for change in changes:
                if change.op == "add":
                    state[change.key] = SnapshotFlight(key=change.key, record=wire, prefilling=True)
                else:
                    state.pop(change.key, None)
            sent = seq
            if not lost:
                message = encode_changes("fake", list(changes), seq=seq)
                await nc.publish(load_subject(namespace="default", deployment="gaps"), message)

        sync = running.replica_sync
        assert sync is not None
        held = running.service.router.sequences

        def mirrored() -> list[str]:
            return sorted(key for key in ("fake/a", "fake/b", "fake/c") if key in held)

        await send(PeerChange(op="add", key="a", record=record), seq=1)
        await eventually(lambda: "fake" in sync.peers and sync.peers["fake"].synced)
        assert snapshots == 1  # a peer heard for the first time is asked for its snapshot
        assert mirrored() == ["fake/a"]
        await send(PeerChange(op="add", key="b", record=record), seq=2)
        await eventually(lambda: mirrored() == ["fake/a", "fake/b"])
        await send(PeerChange(op="free", key="a"), PeerChange(op="free", key="b"), seq=3, lost=True)
        await send(PeerChange(op="add", key="c", record=record), seq=4, lost=True)
        await send(seq=5)  # a heartbeat after the gap
        await eventually(lambda: snapshots == 2)
        await eventually(lambda: mirrored() == ["fake/c"])
        assert running.service.metrics.peer_snapshots.labels(result="loaded")._value.get() == 2


async def test_a_draining_router_is_not_ready_and_finishes_its_streams() -> None:
    async with mock_fleet(engines=1) as fleet:
        config = parse_config(
            {
                "model": MODEL,
                "engine": "mock",
                "port": 0,
                "block_size": 32,
                "discovery": {"kind": "static", "workers": [{"url": fleet.urls[0]}]},
                "health_interval_s": 0.05,
            },
            source="test",
        )
        running = await start_router(config, router_id="drain")
        try:
            await eventually(lambda: _is_ready(running))
            async with aiohttp.ClientSession() as http:
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "stream": True}
                async with http.post(f"{running.url}/v1/completions", json=body) as response:
                    first = await response.content.readline()
                    assert first.startswith(b"data:")
                    drain = asyncio.create_task(running.drain(10.0))
                    await eventually(lambda: running.service.draining)
                    status, body = await _ready(running)
                    assert status == 503
                    assert body["waiting_for"] == ["nothing: it is shutting down"]
                    assert not drain.done()  # the stream is still going
                    rest = await response.read()
                assert rest.rstrip().endswith(b"data: [DONE]")
            await asyncio.wait_for(drain, 5)
        finally:
            await running.close()


def _routed_for_t(worker: str) -> tuple[FlightRecord, float]:
    """A peer's charge of tenant t's request on ``worker``, and the tokens it charges t."""
    hashes = block_hashes(PROMPT, block_size=32)
    record = FlightRecord(
        worker_id=worker,
        hashes=hashes,
        prefill_tokens=640,
        prefill_ms=9.0,
        kv_tokens=8.0,
        output_tokens=5,
        tenant="t",
    )
    return record, len(hashes) * 32 + 8.0


async def test_a_peers_queue_heads_apply_after_the_changes_sent_before_them(nats_url: str) -> None:
    """A peer routes tenant t's request (its charge in load message 2) and then sends its queue
    heads (t's tag after that charge); the heads arrive first. Applied at once they would raise t's
    tag to the post-charge one, and the charge would then count a second time."""
    async with _router_beside_fake_peers(nats_url, "order") as (running, nc, worker):

        async def answer(msg: Msg) -> None:
            await msg.respond(Snapshot(router="fake", seq=1, flights=[]).model_dump_json().encode())

        await nc.subscribe(
            snapshot_subject(namespace="default", deployment="order", router_id="fake"), cb=answer
        )
        subject = load_subject(namespace="default", deployment="order")
        await nc.publish(subject, encode_changes("fake", [], seq=1))
        sync = running.replica_sync
        assert sync is not None
        await eventually(lambda: "fake" in sync.peers and sync.peers["fake"].synced)
        record, charged = _routed_for_t(worker)
        heads = [QueueHead(priority=0, start=charged, tenant="t", virtual=0.0)]
        await nc.publish(
            heads_subject(namespace="default", deployment="order"), encode_heads("fake", heads, seq=2)
        )
        await nc.flush()
        await nc.publish(
            subject, encode_changes("fake", [PeerChange(op="add", key="a", record=record)], seq=2)
        )
        await eventually(lambda: "fake/a" in running.service.router.sequences)
        queue = running.service.router._queue
        await eventually(lambda: "fake" in queue._peers and list(queue._peers["fake"].heads) == heads)
        assert queue._bands[0].served["t"] == charged, "charged once"


async def test_a_peers_heads_wait_while_another_peers_snapshot_is_pending(nats_url: str) -> None:
    """Three replicas: c routes tenant t's request (load message 1) while this replica waits for
    c's snapshot (so holds the message); a applied it and sends its heads (t's tag after that
    charge). Applied at once they would raise t's tag, and replaying c's message after the
    snapshot would charge t a second time: they wait until c is synced."""
    async with _router_beside_fake_peers(nats_url, "three") as (running, nc, worker):
        release_c = asyncio.Event()

        def answers(router: str, *, seq: int, wait: asyncio.Event | None = None) -> Any:
            async def answer(msg: Msg) -> None:
                if wait is not None:
                    await wait.wait()
                await msg.respond(Snapshot(router=router, seq=seq, flights=[]).model_dump_json().encode())

            return answer

        for router, seq, wait in (("a", 1, None), ("c", 0, release_c)):
            subject = snapshot_subject(namespace="default", deployment="three", router_id=router)
            await nc.subscribe(subject, cb=answers(router, seq=seq, wait=wait))
        load = load_subject(namespace="default", deployment="three")
        sync = running.replica_sync
        assert sync is not None
        await nc.publish(load, encode_changes("a", [], seq=1))
        await eventually(lambda: "a" in sync.peers and sync.peers["a"].synced)
        record, charged = _routed_for_t(worker)
        await nc.publish(load, encode_changes("c", [PeerChange(op="add", key="r", record=record)], seq=1))
        await eventually(lambda: "c" in sync.peers and bool(sync.peers["c"].held))
        heads = [QueueHead(priority=0, start=charged, tenant="t", virtual=0.0)]
        queue = running.service.router._queue
        await nc.publish(
            heads_subject(namespace="default", deployment="three"), encode_heads("a", heads, seq=1)
        )
        await eventually(lambda: sync.peers["a"].heads is not None or "a" in queue._peers)
        release_c.set()
        await eventually(lambda: "c/r" in running.service.router.sequences)
        await eventually(lambda: "a" in queue._peers and list(queue._peers["a"].heads) == heads)
        assert queue._bands[0].served["t"] == charged, "charged once"
