"""KV events and replica load sharing over a real NATS server."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import nats

from copse.router.config import RouterConfig, parse_config
from copse.router.core import FlightRecord, PeerChange
from copse.router.policies import RouteRequest
from copse.router.replica_sync import decode_changes, encode_changes
from copse.router.server import start_router
from copse.workers.nats_io import KvEventPublisher
from copse.workers.protocol import DumpBlock, KvDump, KvEvent, KvStored, StoredBlock, block_hashes
from copse.workers.testing import mock_fleet

from .conftest import eventually

MODEL = "mock-model"
PROMPT = list(range(1000, 1000 + 640))


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


def test_load_messages_round_trip() -> None:
    record = FlightRecord(worker_id="w", hashes=[1, 2], prefill_tokens=64, prefill_ms=3.5, kv_tokens=10.0)
    changes = [PeerChange(op="add", key="k", record=record), PeerChange(op="free", key="k")]
    router_id, decoded = decode_changes(encode_changes("me", changes))
    assert router_id == "me"
    assert decoded == changes


async def test_two_router_replicas_share_in_flight_load(nats_url: str) -> None:
    async with mock_fleet(engines=2, nats_url=nats_url, deployment="replicas") as fleet:
        one = await start_router(_config(fleet.urls, nats_url, "replicas"), router_id="one")
        two = await start_router(_config(fleet.urls, nats_url, "replicas"), router_id="two")
        try:
            sync_one, sync_two = one.replica_sync, two.replica_sync
            assert sync_one is not None
            assert sync_two is not None
            await eventually(lambda: len(one.service.router.workers) == len(two.service.router.workers) == 2)
            await eventually(lambda: "one" in sync_two.peers and "two" in sync_one.peers)
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
        finally:
            await one.close()
            await two.close()
