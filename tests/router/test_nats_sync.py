"""KV events and replica load sharing over a real NATS server."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import nats
import pytest
from nats.aio.client import Client as NatsClient
from pydantic import BaseModel, ConfigDict, ValidationError

from copse.router import server
from copse.router.config import RouterConfig, parse_config
from copse.router.core import FlightRecord, PeerChange
from copse.router.fairness import QueueHead
from copse.router.policies import RouteRequest
from copse.router.replica_sync import (
    MAX_EARLIER_HEADS,
    SNAPSHOT_WITH_ADAPTERS,
    ReplicaSync,
    Snapshot,
    _PendingHeads,
    batches,
    decode_changes,
    decode_heads,
    encode_changes,
    encode_heads,
    heads_subject,
    load_subject,
    snapshot_subject,
)
from copse.router.server import RunningRouter, start_router
from copse.router.service import Overloaded
from copse.workers.mocker import EngineConfig
from copse.workers.nats_io import KvEventPublisher
from copse.workers.protocol import (
    DumpBlock,
    KvDump,
    KvEvent,
    KvStored,
    StoredBlock,
    block_hashes,
    lora_int_id,
)
from copse.workers.relay import run_relay
from copse.workers.testing import mock_fleet

from .conftest import eventually

MODEL = "mock-model"
PROMPT = list(range(1000, 1000 + 640))


def _config(urls: list[str], nats_url: str | None, deployment: str, **extra: Any) -> RouterConfig:
    raw: dict[str, Any] = {
        "model": MODEL,
        "engine": "mock",
        "port": 0,
        "block_size": 32,
        "nats_url": nats_url,
        "deployment": deployment,
        "discovery": {"kind": "static", "workers": [{"url": url} for url in urls]},
        "health_interval_s": 0.05,
        "seed": 2,
    }
    raw.update(extra)
    return parse_config(raw, source="test")


async def test_kv_events_teach_the_router_where_prefixes_live(nats_url: str) -> None:
    async with mock_fleet(engines=3, nats_url=nats_url, deployment="kvsync") as fleet:
        running = await start_router(_config(fleet.urls, nats_url, "kvsync"), router_id="r1")
        try:
            router = running.service.router
            await eventually(lambda: len(router.workers) == 3)
            hashes = block_hashes(PROMPT, block_size=32)
            async with aiohttp.ClientSession() as http:
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
                async with http.post(f"{running.url}/v1/completions", json=body) as response:
                    assert response.status == 200
                await eventually(lambda: bool(router.indexer.overlaps(hashes)))
                (slot, depth), *_ = router.indexer.overlaps(hashes).items()
                assert depth == len(hashes)
                holder = router.slots.worker_id(slot)
                for _ in range(3):  # the same prompt keeps going where it is cached
                    async with http.post(f"{running.url}/v1/completions", json=body) as response:
                        assert response.status == 200
                        usage = (await response.json())["usage"]
                    # everything but the last token, which is always computed
                    assert usage["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) - 1
            assert running.service.metrics.cached_tokens._value.get() == 3 * (len(PROMPT) - 1)
            assert holder in router.workers
        finally:
            await running.close()


async def test_a_gap_in_events_is_healed_from_the_workers_dump(nats_url: str) -> None:
    """A fake engine publishes events 1 and 3 (2 is lost) and answers dump requests."""
    nc = await nats.connect(nats_url)
    publisher = KvEventPublisher(nc, namespace="default", deployment="gap")
    hashes = block_hashes(PROMPT, block_size=32)
    blocks = [StoredBlock(block_hash=h, tokens_hash=h) for h in hashes]
    dump = KvDump(
        worker_id="fake-engine",
        epoch=5,
        block_size=32,
        last_event_id=2,
        blocks=tuple(
            DumpBlock(block_hash=h, parent_hash=hashes[i - 1] if i else None, tokens_hash=h)
            for i, h in enumerate(hashes[:15])
        ),
    )
    dumps = 0

    def answer() -> KvDump:
        nonlocal dumps
        dumps += 1
        return dump

    await publisher.serve_dumps(worker_id="fake-engine", dump=answer)
    running = await start_router(_config(["http://127.0.0.1:9"], nats_url, "gap"), router_id="r-gap")
    try:
        radix = running.service.router.radix
        assert radix is not None
        first = KvEvent(event_id=1, data=KvStored(parent_hash=None, blocks=tuple(blocks[:10])))
        third = KvEvent(event_id=3, data=KvStored(parent_hash=hashes[14], blocks=tuple(blocks[15:20])))
        # NATS keeps nothing: event 1 must not go out before the router's subscriptions are made
        # (start_router returns after the first connection attempt, which can be slow on a busy box)
        await eventually(lambda: running.service.metrics.nats_connected._value.get() == 1)
        await publisher.publish(worker_id="fake-engine", epoch=5, events=[first])
        await eventually(lambda: radix.last_event_id("fake-engine") == 1)
        await publisher.publish(worker_id="fake-engine", epoch=5, events=[third])
        await eventually(lambda: radix.last_event_id("fake-engine") == 3)
        assert dumps == 1
        slot = running.service.router.slots.slot("fake-engine")
        assert radix.overlaps(hashes) == {slot: 20}  # dump (15 blocks) + the buffered event 3
        metrics = running.service.metrics.kv_resyncs.labels(reason="gap")._value.get()
        assert metrics == 1
    finally:
        await running.close()
        await nc.drain()


async def test_behind_a_relay_started_late_the_router_guesses_then_knows_and_never_invents(
    nats_url: str,
) -> None:
    """A mocked engine serving TensorRT-LLM's /kv_cache_events, a KV relay that starts after the
    engine filled its cache (it has missed the first events), a router over NATS: the worker is
    approximate and every block the router reports for it is one the engine holds or one it routed
    there; once every block cached before the relay started is evicted the relay proves it knows
    everything, and the router's view is the engine's."""
    blocks = 64
    config = EngineConfig(block_size=32, num_blocks=blocks)
    prompts = [list(range(10_000 * (k + 1), 10_000 * (k + 1) + 320)) for k in range(18)]
    async with mock_fleet(config=config) as fleet, aiohttp.ClientSession() as http:
        engine = fleet.servers[0].engine
        for prompt in prompts[:8]:  # 80 blocks of prompts: the cache is full of them
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            async with http.post(f"{fleet.urls[0]}/v1/completions", json=body) as response:
                assert response.status == 200
        async with http.post(f"{fleet.urls[0]}/kv_cache_events") as response:
            assert (await response.json())[0]["event_id"] == 0  # a relay drained these, then died
        stop = asyncio.Event()
        relay = asyncio.create_task(
            run_relay(
                engine_url=fleet.urls[0],
                nats_url=nats_url,
                worker_id=engine.worker_id,
                namespace="default",
                deployment="late",
                block_size=32,
                capacity_blocks=blocks,
                interval_s=0.02,
                stop=stop,
            )
        )
        running = await start_router(_config(fleet.urls, nats_url, "late"), router_id="r1")
        try:
            router = running.service.router
            radix = router.radix
            assert radix is not None
            await eventually(lambda: len(router.workers) == 1)
            slot = router.slots.slot(engine.worker_id)
            await eventually(lambda: radix.approximate(slot))
            universe = {h for prompt in prompts for h in block_hashes(prompt, block_size=32)}
            routed: set[int] = set()

            def reported() -> set[int]:
                return {h for h in universe if radix.index.holds(slot, h)}

            assert not reported()  # what the engine cached before the relay started is unknown
            for prompt in prompts[8:]:  # 100 new blocks through the router: the old ones are evicted
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
                async with http.post(f"{running.url}/v1/completions", json=body) as response:
                    assert response.status == 200
                routed.update(block_hashes(prompt, block_size=32))
                assert reported() <= engine.blocks.cached_hashes() | routed
            await eventually(lambda: not radix.approximate(slot))
            await eventually(lambda: reported() == engine.blocks.cached_hashes())
        finally:
            await running.close()
            stop.set()
            await relay


def test_load_messages_round_trip() -> None:
    record = FlightRecord(worker_id="w", hashes=[1, 2], prefill_tokens=64, prefill_ms=3.5, kv_tokens=10.0)
    retry = dataclasses.replace(record, retry=True)
    changes = [
        PeerChange(op="add", key="k", record=record),
        PeerChange(op="free", key="k"),
        PeerChange(op="add", key="k", record=retry),
    ]
    router_id, decoded = decode_changes(encode_changes("me", changes))
    assert router_id == "me"
    assert decoded == changes
    heads = [QueueHead(priority=100, start=12.5, tenant="t", virtual=3.0)]
    assert decode_heads(encode_heads("me", heads, seq=3)) == ("me", 3, heads)
    assert decode_heads(encode_heads("me", [], seq=0)) == ("me", 0, []), "nothing waits there"


@contextlib.asynccontextmanager
async def _two_replicas(
    nats_url: str, deployment: str, *, engines: int, **extra: Any
) -> AsyncIterator[tuple[RunningRouter, RunningRouter]]:
    """Routers "one" and "two" over ``engines`` mocked engines, once each knows the engines and
    hears the other."""
    async with mock_fleet(engines=engines, nats_url=nats_url, deployment=deployment) as fleet:
        one = await start_router(_config(fleet.urls, nats_url, deployment, **extra), router_id="one")
        two = await start_router(_config(fleet.urls, nats_url, deployment, **extra), router_id="two")
        try:
            sync_one, sync_two = one.replica_sync, two.replica_sync
            assert sync_one is not None
            assert sync_two is not None
            await eventually(
                lambda: len(one.service.router.workers) == len(two.service.router.workers) == engines
            )
            await eventually(lambda: "one" in sync_two.peers and "two" in sync_one.peers)
            yield one, two
        finally:
            await one.close()
            await two.close()


async def test_two_router_replicas_share_in_flight_load(nats_url: str) -> None:
    async with _two_replicas(nats_url, "replicas", engines=2) as (one, two):
        hashes = block_hashes(PROMPT, block_size=32)
        request = RouteRequest(request_id="held", hashes=hashes, prompt_tokens=640, max_tokens=5)
        route = one.service.router.submit(request, now=time.monotonic())
        assert route is not None
        one.service.released([])  # publish the change
        mirror = two.service.router
        slot = mirror.slots.slot(route.worker_id)
        await eventually(lambda: mirror.sequences.requests[slot] == 1)
        assert mirror.sequences.prefill_tokens[slot] == 640
        one.service.router.finish("held", now=time.monotonic())
        one.service.released([])
        await eventually(lambda: mirror.sequences.requests[slot] == 0)


async def test_a_tenants_rate_limit_holds_across_router_replicas(nats_url: str) -> None:
    """A tenant's request through replica one empties its bucket at replica two as well (heard
    over the load messages): through two it is answered 429 with Retry-After; another tenant is not."""
    tenants = {"team": {"tokens_per_minute": 50}}
    async with _two_replicas(nats_url, "ratelimit", engines=1, tenants=tenants) as (one, two):
        team = {"x-gateway-inference-fairness-id": "team"}
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}  # more than a minute's 50 tokens
        limits = two.service.router.limits
        assert limits is not None
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{one.url}/v1/completions", json=body, headers=team) as response:
                assert response.status == 200
            await eventually(lambda: limits.wait_s("team", 1.0, now=two.service.now()) > 0.0)
            async with http.post(f"{two.url}/v1/completions", json=body, headers=team) as response:
                assert response.status == 429
                assert int(response.headers["Retry-After"]) >= 1
                assert "tenant team is over its limit" in (await response.json())["error"]["message"]
            other = {"x-gateway-inference-fairness-id": "other"}
            async with http.post(f"{two.url}/v1/completions", json=body, headers=other) as response:
                assert response.status == 200


class _OldWire(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _OldRecord(_OldWire):
    worker_id: str
    hashes: list[int]
    prefill_tokens: int
    prefill_ms: float
    kv_tokens: float
    output_tokens: int = 0
    tenant: str = ""
    priority: int = 0
    adapter: str = ""


class _OldChange(_OldWire):
    op: str
    key: str
    record: _OldRecord | None = None


class _OldLoadMessage(_OldWire):
    """The load message of the version before queue heads (it refuses fields it does not know)."""

    router: str
    seq: int = 0
    changes: list[_OldChange]


async def test_two_router_replicas_share_their_queue_heads(nats_url: str) -> None:
    """Replica two frees the only worker while replica one has a light tenant's request waiting
    that comes before two's own heavy one: two holds its request back until one has taken the
    capacity (a released request without a client is ended at once, freeing it again)."""
    # one request in flight makes the worker busy
    async with _two_replicas(nats_url, "heads", engines=1, busy_kv_fraction=1e-9) as (one, two):
        # a replica of the version before queue heads reads every load message (its schema
        # refuses unknown fields); the heads travel on a subject of their own
        nc = await nats.connect(nats_url)
        refused: list[str] = []

        async def read_as_old(msg: Any) -> None:
            try:
                _OldLoadMessage.model_validate_json(msg.data)
            except ValidationError as exc:
                refused.append(str(exc))

        await nc.subscribe(load_subject(namespace="default", deployment="heads"), cb=read_as_old)
        released: list[str] = []
        for running in (one, two):
            original = running.service.released

            def record(routes: list[Any], original: Any = original) -> None:
                released.extend(route.request_id for route in routes)
                original(routes)

            running.service.released = record  # type: ignore[method-assign]
        hashes = block_hashes(PROMPT, block_size=32)

        def request(rid: str, tenant: str) -> RouteRequest:
            return RouteRequest(request_id=rid, hashes=hashes, prompt_tokens=640, max_tokens=5, tenant=tenant)

        assert two.service.router.submit(request("heavy-0", "heavy"), now=time.monotonic()) is not None
        two.service.released([])
        await eventually(lambda: int(one.service.router.sequences.requests.sum()) == 1)
        assert one.service.router.submit(request("light-0", "light"), now=time.monotonic()) is None
        one.service.released([])
        assert two.service.router.submit(request("heavy-1", "heavy"), now=time.monotonic()) is None
        await eventually(lambda: two.service.router.hold_ends(now=time.monotonic()) is not None)
        two.service.router.finish("heavy-0", now=time.monotonic())
        two.service.released(two.service.router.drain(now=time.monotonic()))
        assert two.service.router.queued == 1, "held back for one's light request"
        await eventually(lambda: released == ["light-0", "heavy-1"])
        assert one.service.router.queued == two.service.router.queued == 0
        await nc.flush()
        await nc.close()
        assert refused == []


async def test_replicas_share_the_adapters_their_requests_load(nats_url: str) -> None:
    """A replica routing a request through an adapter tells its peer, whose mirror of that
    worker's adapter cache then holds it; a replica's snapshot names the adapters it believes each
    worker holds (a replica started later merges them; whether they arrive before or after its
    engines report their own adapters decides which is believed: see test_lora_routing)."""
    async with _two_replicas(nats_url, "adapters", engines=2) as (one, two):
        hashes = block_hashes(PROMPT, block_size=32, lora_id=lora_int_id("sql"))
        request = RouteRequest(request_id="r", hashes=hashes, prompt_tokens=640, max_tokens=5, adapter="sql")
        route = one.service.router.submit(request, now=time.monotonic())
        assert route is not None
        one.service.released([])  # publish the change
        mirror = two.service.router
        slot = mirror.slots.slot(route.worker_id)
        await eventually(lambda: mirror.adapters.held(slot) == ["sql"])
        assert mirror.adapters.peer_loads == 1
        # What a replica that joins (or missed messages) asks for: the peer's snapshot names
        # the request's adapter and the adapters it believes each worker holds (merged there:
        # test_lora_routing); asked as a replica of an earlier version asks (an empty request),
        # it leaves the adapter fields out, which that replica's schema refuses.
        nc = await nats.connect(nats_url)
        try:
            subject = snapshot_subject(namespace="default", deployment="adapters", router_id="one")
            new = Snapshot.model_validate_json(
                (await nc.request(subject, SNAPSHOT_WITH_ADAPTERS, timeout=5.0)).data
            )
            old = (await nc.request(subject, b"", timeout=5.0)).data
        finally:
            await nc.close()
        assert new.adapters == {route.worker_id: ["sql"]}
        assert [flight.record.adapter for flight in new.flights] == ["sql"]
        assert b"adapter" not in old
        assert [flight.key for flight in Snapshot.model_validate_json(old).flights] == ["r"]

        one.service.router.finish("r", now=time.monotonic())
        one.service.released([])
        await eventually(lambda: mirror.sequences.requests[slot] == 0)
        assert mirror.adapters.held(slot) == ["sql"], "the engine keeps the adapter after the request"


def test_load_messages_leave_out_fields_at_their_default() -> None:
    """A replica of an earlier version refuses fields it does not know: a request through the base
    model at its first route sends none of the newer ones (tenant, priority, adapter, retry)."""
    record = FlightRecord(worker_id="w", hashes=[1], prefill_tokens=8, prefill_ms=1.0, kv_tokens=0.0)
    sent = json.loads(encode_changes("me", [PeerChange(op="add", key="k", record=record)], seq=4))
    assert set(sent["changes"][0]["record"]) == {
        "worker_id",
        "hashes",
        "prefill_tokens",
        "prefill_ms",
        "kv_tokens",
    }
    assert decode_changes(json.dumps(sent).encode())[1][0].record == record


def test_changes_naming_an_adapter_or_a_retry_travel_in_messages_of_their_own() -> None:
    """A replica of an earlier version drops a whole message naming an adapter or a retry: the
    frees and first-route base-model charges of the same flush go in other messages, in order."""

    def record(adapter: str = "", *, retry: bool = False) -> FlightRecord:
        return FlightRecord(
            worker_id="w",
            hashes=[1],
            prefill_tokens=8,
            prefill_ms=1.0,
            kv_tokens=0.0,
            adapter=adapter,
            retry=retry,
        )

    changes = [
        PeerChange(op="add", key="a", record=record()),
        PeerChange(op="add", key="b", record=record("sql")),
        PeerChange(op="add", key="c", record=record("chat")),
        PeerChange(op="free", key="b"),
        PeerChange(op="prefilled", key="a"),
        PeerChange(op="add", key="d", record=record("sql")),
        PeerChange(op="free", key="a"),
        PeerChange(op="add", key="a", record=record(retry=True)),
    ]
    runs = batches(changes)
    keys = [["a"], ["b", "c"], ["b", "a"], ["d"], ["a"], ["a"]]
    assert [[change.key for change in run] for run in runs] == keys
    assert [change for run in runs for change in run] == changes
    readable = [
        run
        for run in runs
        if not any(field in encode_changes("me", run, seq=1) for field in (b"adapter", b"retry"))
    ]
    assert [[change.key for change in run] for run in readable] == [["a"], ["b", "a"], ["a"]]
    assert batches([]) == []


async def test_a_request_starting_or_ending_its_wait_wakes_replica_sync(nats_url: str) -> None:
    """Peers learn of a new queue head, and of one gone at its queue timeout, at once, not at the
    next heartbeat: both wake replica sync."""
    async with mock_fleet(engines=1, nats_url=nats_url, deployment="wake") as fleet:
        config = _config(fleet.urls, nats_url, "wake", busy_kv_fraction=1e-9, queue_timeout_s=0.3)
        running = await start_router(config, router_id="one")
        try:
            router = running.service.router
            await eventually(lambda: len(router.workers) == 1)
            hashes = block_hashes(PROMPT, block_size=32)

            def request(rid: str) -> RouteRequest:
                return RouteRequest(request_id=rid, hashes=hashes, prompt_tokens=640, max_tokens=5)

            assert router.submit(request("busy"), now=time.monotonic()) is not None
            wakes: list[int] = []
            running.service.on_changes.append(lambda: wakes.append(router.queued))
            with pytest.raises(Overloaded):
                await running.service._route(request("waits"), frozenset(), retry=False)
            assert wakes == [1, 0]
            running.service.released(router.finish("busy", now=time.monotonic()))
        finally:
            await running.close()


def _stop_replica_sync_loop(running: RunningRouter) -> None:
    """Cancel ``running``'s replica sync loop (heartbeats and wake-ups): the test flushes itself."""
    for task in running.service._tasks:
        if task.get_name() == "replica-sync":
            task.cancel()


async def test_queue_heads_are_rebuilt_only_when_they_changed_and_a_peer_listens(nats_url: str) -> None:
    """A flush builds the queue heads only when the queue changed since they were last built and a
    peer listens (a heartbeat always carries them): a lone router, and a flush with nothing new,
    pay nothing for them."""
    hashes = block_hashes(PROMPT, block_size=32)

    def request(rid: str) -> RouteRequest:
        return RouteRequest(request_id=rid, hashes=hashes, prompt_tokens=640, max_tokens=5, tenant=rid)

    def counted(running: RunningRouter) -> list[float]:
        builds: list[float] = []
        router = running.service.router
        original = router.queue_heads

        def queue_heads(*, now: float) -> list[QueueHead]:
            builds.append(now)
            return original(now=now)

        router.queue_heads = queue_heads  # type: ignore[method-assign]
        return builds

    async with mock_fleet(engines=1, nats_url=nats_url, deployment="alone") as fleet:
        alone = await start_router(
            _config(fleet.urls, nats_url, "alone", busy_kv_fraction=1e-9), router_id="alone"
        )
        try:
            sync = alone.replica_sync
            assert sync is not None
            await eventually(lambda: len(alone.service.router.workers) == 1)
            _stop_replica_sync_loop(alone)
            builds = counted(alone)
            router = alone.service.router
            assert router.submit(request("busy"), now=time.monotonic()) is not None
            assert router.submit(request("waits"), now=time.monotonic()) is None
            await sync.flush()
            assert builds == [], "no peer listens"
            await sync.flush(heartbeat=True)
            assert len(builds) == 1
        finally:
            await alone.close()
    async with _two_replicas(nats_url, "cheap", engines=1, busy_kv_fraction=1e-9) as (one, _two):
        sync = one.replica_sync
        assert sync is not None
        _stop_replica_sync_loop(one)
        builds = counted(one)
        router = one.service.router
        assert router.submit(request("busy"), now=time.monotonic()) is not None
        await sync.flush()
        assert builds == [], "nothing waits, as before"
        assert router.submit(request("waits"), now=time.monotonic()) is None
        await sync.flush()
        assert len(builds) == 1, "a new head, and a peer listens"
        await sync.flush()
        assert len(builds) == 1, "nothing changed"
        await sync.flush(heartbeat=True)
        assert len(builds) == 2


async def test_a_flush_builds_the_queue_heads_before_it_sends_anything(nats_url: str) -> None:
    """A request routed while a flush awaits its publishes is charged in a load message sent after
    the heads: were they built after that await, their tags would count a charge the load message
    they name does not carry, and peers would charge it again when it came."""
    hashes = block_hashes(PROMPT, block_size=32)
    async with _two_replicas(nats_url, "ordered", engines=1, busy_kv_fraction=1e-9) as (one, _two):
        sync = one.replica_sync
        assert sync is not None
        nc = sync.link.nc
        assert nc is not None
        _stop_replica_sync_loop(one)
        router = one.service.router
        events: list[str] = []
        original_heads, original_publish = router.queue_heads, nc.publish

        def queue_heads(*, now: float) -> list[QueueHead]:
            events.append("heads built")
            return original_heads(now=now)

        async def publish(subject: str, payload: bytes = b"", **kwargs: Any) -> None:
            events.append("heads sent" if subject.endswith(".heads") else "load sent")
            await original_publish(subject, payload, **kwargs)

        router.queue_heads = queue_heads  # type: ignore[method-assign]
        nc.publish = publish  # type: ignore[method-assign,assignment]
        for rid in ("busy", "waits"):
            router.submit(
                RouteRequest(request_id=rid, hashes=hashes, prompt_tokens=640, max_tokens=5, tenant="t"),
                now=time.monotonic(),
            )
        await sync.flush()
        assert events == ["heads built", "load sent", "heads sent"]


@contextlib.asynccontextmanager
async def _held_for_a_played_peer(
    nats_url: str, monkeypatch: pytest.MonkeyPatch, deployment: str
) -> AsyncIterator[tuple[RunningRouter, ReplicaSync, NatsClient]]:
    """Replica "two" over one mocked engine with a 2 s hold cap and a heartbeat of a minute, and
    a NATS connection on which the test plays its peer "one"."""
    monkeypatch.setattr(server, "ReplicaSync", functools.partial(ReplicaSync, heartbeat_s=60.0))
    async with mock_fleet(engines=1, nats_url=nats_url, deployment=deployment) as fleet:
        config = _config(fleet.urls, nats_url, deployment, busy_kv_fraction=1e-9, peer_queue_max_age_s=2.0)
        running = await start_router(config, router_id="two")
        nc = await nats.connect(nats_url)
        try:
            sync = running.replica_sync
            assert sync is not None
            await eventually(lambda: len(running.service.router.workers) == 1)
            await eventually(lambda: running.service.metrics.nats_connected._value.get() == 1)
            yield running, sync, nc
        finally:
            await nc.close()
            await running.close()


def _heavy(request_id: str) -> RouteRequest:
    """A request of the heavy tenant that takes the one worker."""
    hashes = block_hashes(PROMPT, block_size=32)
    return RouteRequest(request_id=request_id, hashes=hashes, prompt_tokens=640, max_tokens=5, tenant="heavy")


async def test_a_replica_routes_what_a_peers_head_held_back_as_soon_as_the_hold_lapses(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer (played by the test) sends a head once and never again (it cannot route it): the
    replica it held back routes its own request when the hold lapses (peer_queue_max_age_s after
    the head was first sent), not at its next heartbeat (a minute here)."""
    async with _held_for_a_played_peer(nats_url, monkeypatch, "lapse") as (running, sync, nc):
        router = running.service.router

        async def answer(msg: Any) -> None:
            await msg.respond(Snapshot(router="one", seq=1, flights=[]).model_dump_json().encode())

        await nc.subscribe(
            snapshot_subject(namespace="default", deployment="lapse", router_id="one"), cb=answer
        )
        await nc.publish(
            load_subject(namespace="default", deployment="lapse"), encode_changes("one", [], seq=1)
        )
        await eventually(lambda: "one" in sync.peers and sync.peers["one"].synced)
        assert router.submit(_heavy("busy"), now=time.monotonic()) is not None
        assert router.submit(_heavy("heavy-1"), now=time.monotonic()) is None
        light = QueueHead(priority=0, start=0.0, tenant="light", virtual=0.0)
        heads = heads_subject(namespace="default", deployment="lapse")
        await nc.publish(heads, encode_heads("one", [light], seq=1))
        await eventually(lambda: router.hold_ends(now=time.monotonic()) is not None)
        running.service.released(router.finish("busy", now=time.monotonic()))
        assert router.queued == 1, "held back for the peer's light request"
        await eventually(lambda: router.queued == 0)


async def test_heads_heard_while_a_peers_snapshot_is_pending_hold_from_when_they_were_heard(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer's heads heard while its snapshot is pending wait for it, and are then applied as
    heard when they arrived: the hold a stuck head puts on this replica lapses at the cap after it
    was first heard (the peer sent it again meanwhile), not after the snapshot came (a pending
    snapshot would otherwise prolong it)."""
    async with _held_for_a_played_peer(nats_url, monkeypatch, "pending") as (running, sync, nc):
        router = running.service.router
        clock = [time.monotonic()]
        monkeypatch.setattr(running.service, "now", lambda: clock[0])
        snapshot_asked, answer_now = asyncio.Event(), asyncio.Event()

        async def answer(msg: Any) -> None:
            snapshot_asked.set()
            await answer_now.wait()
            await msg.respond(Snapshot(router="one", seq=1, flights=[]).model_dump_json().encode())

        subject = snapshot_subject(namespace="default", deployment="pending", router_id="one")
        await nc.subscribe(subject, cb=answer)
        await nc.publish(
            load_subject(namespace="default", deployment="pending"), encode_changes("one", [], seq=1)
        )
        await snapshot_asked.wait()
        assert router.submit(_heavy("busy"), now=clock[0]) is not None
        assert router.submit(_heavy("heavy-1"), now=clock[0]) is None
        heard = clock[0]
        light = QueueHead(priority=0, start=0.0, tenant="light", virtual=0.0)
        heads = heads_subject(namespace="default", deployment="pending")
        await nc.publish(heads, encode_heads("one", [light], seq=1))
        await eventually(lambda: sync.peers["one"].heads is not None)
        assert router.hold_ends(now=clock[0]) is None, "they wait for the peer's snapshot"
        clock[0] += 1.0  # the snapshot takes its time; the peer sends its stuck head again
        again = dataclasses.replace(light, waited_s=1.0)
        await nc.publish(heads, encode_heads("one", [again], seq=1))
        await eventually(
            lambda: (pending := sync.peers["one"].heads) is not None and pending.heard == clock[0]
        )
        clock[0] += 0.5
        answer_now.set()
        await eventually(lambda: sync.peers["one"].synced and sync.peers["one"].heads is None)
        assert router.hold_ends(now=clock[0]) == pytest.approx(heard + 2.0), "held from when heard"


def test_heads_waiting_to_be_applied_keep_the_oldest_and_the_latest_earlier_ones() -> None:
    """A peer sending heads all the time while they wait (its snapshot pending) keeps a bounded
    list of them: the oldest (when its stuck requests were first heard) and the latest."""
    light = QueueHead(priority=0, start=0.0, tenant="light", virtual=0.0)
    pending = _PendingHeads(seq=1, heads=[light], heard=0.0)
    for heard in range(1, 41):
        pending = pending.then(seq=1, heads=[light], heard=float(heard))
    assert pending.heard == 40.0
    assert len(pending.earlier) == MAX_EARLIER_HEADS
    assert [older.heard for older in pending.earlier] == [0.0, *range(40 - MAX_EARLIER_HEADS + 1, 40)]


async def test_two_replicas_holding_each_others_heads_back_route_every_request(nats_url: str) -> None:
    """Two replicas share one worker that takes one request at a time; each has both tenants'
    requests waiting, so each holds its head back for the other's at times. With a hold cap too
    long to matter, every request is still routed and answered: the replicas share one order and
    the one holding the first request never waits (a deadlock fails the test after a minute,
    instead of hanging it)."""
    async with (
        asyncio.timeout(60.0),
        _two_replicas(
            nats_url,
            "live",
            engines=1,
            busy_kv_fraction=1e-9,
            peer_queue_max_age_s=600.0,
            queue_timeout_s=600.0,
        ) as (one, two),
    ):
        held: dict[str, int] = {"one": 0, "two": 0}
        for name, running in (("one", one), ("two", two)):
            router = running.service.router
            original = router.hold_ends

            def hold_ends(*, now: float, name: str = name, original: Any = original) -> float | None:
                ends: float | None = original(now=now)
                held[name] += ends is not None
                return ends

            router.hold_ends = hold_ends  # type: ignore[method-assign]
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}

        async def send(http: aiohttp.ClientSession, running: RunningRouter, tenant: str) -> int:
            headers = {"x-gateway-inference-fairness-id": tenant}
            async with http.post(f"{running.url}/v1/completions", json=body, headers=headers) as response:
                await response.read()
                return response.status

        async with aiohttp.ClientSession() as http:
            sends = [
                send(http, running, tenant)
                for running, mix in (
                    (one, ("heavy",) * 4 + ("light",) * 2),
                    (two, ("light",) * 4 + ("heavy",) * 2),
                )
                for tenant in mix
            ]
            statuses = await asyncio.gather(*sends)
        assert statuses == [200] * 12
        assert held["one"] > 0, "each replica held its head back for the other's at times"
        assert held["two"] > 0
        assert one.service.router.queued == two.service.router.queued == 0


async def test_closing_a_router_as_its_probes_are_woken_ends_the_probe_loop() -> None:
    """The health probe loop cancelled at close while a worker change wakes it ends (Python 3.11's
    wait_for returned normally then, and the loop, and the router's close, went on forever)."""
    async with mock_fleet(engines=1) as fleet:
        running = await start_router(_config(fleet.urls, None, "probes", health_interval_s=600.0))
        try:
            await eventually(lambda: len(running.service.router.workers) == 1)
            (task,) = [task for task in running.service._tasks if task.get_name() == "health-probes"]
            wake = running.service._probe_wake
            await eventually(lambda: bool(wake._waiters))  # the loop reaches its wait after the probes
            wake.set()
            task.cancel()
            await asyncio.wait({task}, timeout=60.0)
            assert task.cancelled()
        finally:
            await running.close()
