"""KV events over a real NATS server: the mocker publishes, answers dumps, and the relay turns a
trtllm-serve drain (here a mocked engine's) into the same copse events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import httpx
import nats
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from copse.workers.mocker import EngineConfig
from copse.workers.nats_io import request_dump
from copse.workers.protocol import KvEvent, KvEventBatch, kv_events_subject
from copse.workers.relay import run_relay
from copse.workers.testing import mock_fleet, nats_server


class Subscriber:
    """Collects batches and keeps an index: worker -> block hash -> cache tier."""

    def __init__(self) -> None:
        self.batches: list[KvEventBatch] = []
        self.tiers: dict[str, dict[int, int]] = {}
        self.changed = asyncio.Event()

    async def on_message(self, msg: Msg) -> None:
        batch = KvEventBatch.model_validate_json(msg.data)
        self.batches.append(batch)
        held = self.tiers.setdefault(batch.worker_id, {})
        for event in batch.events:
            self._apply(held, event)
        self.changed.set()

    @staticmethod
    def _apply(held: dict[int, int], event: KvEvent) -> None:
        data = event.data
        if data.type == "stored":
            held.update((b.block_hash, 0) for b in data.blocks)
        elif data.type == "removed":
            for block_hash in data.block_hashes:
                held.pop(block_hash, None)
        elif data.type == "updated":
            held.update(dict.fromkeys(data.block_hashes, data.tier))
        else:
            held.clear()

    async def until(self, worker: str, expected: set[int] | dict[int, int]) -> None:
        async with asyncio.timeout(10):
            while not self._matches(self.tiers.get(worker), expected):
                self.changed.clear()
                await self.changed.wait()

    @staticmethod
    def _matches(held: dict[int, int] | None, expected: set[int] | dict[int, int]) -> bool:
        if held is None:
            return not expected
        return held == expected if isinstance(expected, dict) else set(held) == expected


async def test_mocker_publishes_events_that_mirror_its_cache_and_answers_dumps(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    subscriber = Subscriber()
    await nc.subscribe(kv_events_subject(namespace="team-a", deployment="llama.v3"), cb=subscriber.on_message)
    config = EngineConfig(block_size=16, num_blocks=64)
    async with (
        mock_fleet(
            engines=2, config=config, nats_url=nats_url, namespace="team-a", deployment="llama.v3"
        ) as fleet,
        httpx.AsyncClient() as http,
    ):
        for i in range(6):  # more than 64 blocks in total: eviction happens
            reply = await http.post(
                f"{fleet.urls[i % 2]}/v1/completions",
                json={"model": "m", "prompt": list(range(1000 + 500 * i, 1400 + 500 * i)), "max_tokens": 2},
            )
            assert reply.status_code == 200
        for server in fleet.servers:
            engine = server.engine
            await subscriber.until(engine.worker_id, engine.blocks.cached_hashes())
            ids = [
                e.event_id for b in subscriber.batches if b.worker_id == engine.worker_id for e in b.events
            ]
            assert ids == list(range(1, len(ids) + 1))  # gap-free
            assert any(e.data.type == "removed" for b in subscriber.batches for e in b.events)
            dump = await request_dump(
                nc, namespace="team-a", deployment="llama.v3", worker_id=engine.worker_id
            )
            assert dump.last_event_id == ids[-1]
            assert dump.epoch == engine.epoch
            assert {b.block_hash for b in dump.blocks} == engine.blocks.cached_hashes()
    await nc.drain()


async def test_relay_publishes_what_the_engine_holds(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    subscriber = Subscriber()
    await nc.subscribe(kv_events_subject(namespace="ns", deployment="dep"), cb=subscriber.on_message)
    config = EngineConfig(block_size=16, num_blocks=48)
    async with mock_fleet(config=config) as fleet, httpx.AsyncClient() as http:
        engine = fleet.servers[0].engine
        stop = asyncio.Event()
        relay = asyncio.create_task(
            run_relay(
                engine_url=fleet.urls[0],
                nats_url=nats_url,
                worker_id="pod-0",
                namespace="ns",
                deployment="dep",
                block_size=16,
                interval_s=0.02,
                stop=stop,
            )
        )
        for i in range(5):
            await http.post(
                f"{fleet.urls[0]}/v1/completions",
                json={"model": "m", "prompt": list(range(2000 + 300 * i, 2200 + 300 * i)), "max_tokens": 20},
            )
        # the relay recomputes copse hashes from tokens: they equal the mocker's own block hashes
        await subscriber.until("pod-0", engine.blocks.cached_hashes())
        dump = await request_dump(nc, namespace="ns", deployment="dep", worker_id="pod-0")
        assert {b.block_hash for b in dump.blocks} == engine.blocks.cached_hashes()
        await http.post(f"{fleet.urls[0]}/reset_prefix_cache")
        await subscriber.until("pod-0", set())
        stop.set()
        await relay
    await nc.drain()


async def test_the_relay_says_which_tier_each_block_is_on(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    subscriber = Subscriber()
    await nc.subscribe(kv_events_subject(namespace="ns", deployment="tiers"), cb=subscriber.on_message)
    # 24 GPU blocks of 16 tokens and a host tier of 40: later prompts push earlier ones to host
    # memory, a repeated prompt brings its blocks back
    config = EngineConfig(block_size=16, num_blocks=24, kv_bytes_per_token=1, host_cache_bytes=40 * 16)
    async with mock_fleet(config=config) as fleet, httpx.AsyncClient() as http:
        engine = fleet.servers[0].engine
        stop = asyncio.Event()
        relay = asyncio.create_task(
            run_relay(
                engine_url=fleet.urls[0],
                nats_url=nats_url,
                worker_id="pod-0",
                namespace="ns",
                deployment="tiers",
                block_size=16,
                interval_s=0.02,
                stop=stop,
            )
        )
        prompts = [list(range(5000 + 400 * i, 5000 + 400 * i + 160)) for i in range(4)]
        for prompt in [*prompts, prompts[0]]:
            reply = await http.post(
                f"{fleet.urls[0]}/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1}
            )
            assert reply.status_code == 200
        expected = {h: engine.blocks.tier_of(h) for h in engine.blocks.cached_hashes()}
        assert set(expected.values()) == {0, 1}
        assert engine.onboarded_blocks_total[0] > 0
        await subscriber.until("pod-0", expected)
        dump = await request_dump(nc, namespace="ns", deployment="tiers", worker_id="pod-0")
        assert {b.block_hash: b.tier for b in dump.blocks} == expected
        stop.set()
        await relay
    await nc.drain()


class _Logged(logging.Handler):
    """Sets ``seen`` when a record of ``logger`` containing ``text`` is emitted."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text = text
        self.seen = asyncio.Event()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.records.append(record)
            self.seen.set()


@contextlib.contextmanager
def _logged(text: str) -> Iterator[_Logged]:
    handler = _Logged(text)
    logger = logging.getLogger("copse.workers.nats_io")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _relay(nats_url: str, stop: asyncio.Event) -> asyncio.Task[None]:
    return asyncio.create_task(
        run_relay(
            engine_url="http://127.0.0.1:1",
            nats_url=nats_url,
            worker_id="pod-0",
            namespace="ns",
            deployment="away",
            block_size=16,
            stop=stop,
        )
    )


async def test_a_relay_whose_nats_never_answers_stops_when_told() -> None:
    refusing = socket.socket()  # bound, not listening: connections are refused
    refusing.bind(("127.0.0.1", 0))
    url = f"nats://127.0.0.1:{refusing.getsockname()[1]}"
    try:
        with _logged(url) as logged:
            stop = asyncio.Event()
            relay = _relay(url, stop)
            while len(logged.records) < 2:  # the first attempt and a retry failed
                logged.seen.clear()
                await logged.seen.wait()
            stop.set()
            await asyncio.wait_for(relay, 10)
        assert all(record.exc_info is None for record in logged.records), "one line, no traceback"
        assert [r.levelno for r in logged.records[:2]] == [logging.WARNING, logging.DEBUG]
    finally:
        refusing.close()


async def test_a_relay_stops_cleanly_while_nats_is_gone_mid_run() -> None:
    stop = asyncio.Event()
    with _logged("disconnected") as logged:
        with nats_server() as url:
            nc = await nats.connect(url)
            relay = _relay(url, stop)
            while True:  # until the relay is connected: it answers dump requests
                try:
                    await request_dump(nc, namespace="ns", deployment="away", worker_id="pod-0", timeout_s=1)
                    break
                except NoRespondersError:
                    await asyncio.sleep(0.05)
            await nc.close()
        await logged.seen.wait()  # the server is gone and the relay knows it
        stop.set()
        await asyncio.wait_for(relay, 10)  # no drain of a reconnecting connection (that raises)
