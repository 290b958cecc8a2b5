"""The KV relay: runs next to a ``trtllm-serve`` worker, drains its ``POST /kv_cache_events`` and
publishes copse KV events on NATS, answering dump requests from what it has seen.

TensorRT-LLM names blocks by opaque engine hashes; the relay recomputes copse's block hashes
from the tokens each stored block carries (:mod:`copse.workers.protocol.hashing`), so a router
matches prompts against them directly. It keeps ``engine hash -> copse block`` for every block
the engine holds, which is also what it dumps.

Blocks it cannot translate are dropped and counted (``copse_kv_relay_dropped_blocks_total``):
a stored block whose parent it never saw (the relay started after the engine) or whose token
count is not the block size. The router then simply does not know those blocks (a cache miss,
never a wrong hit). A ``created`` event (the engine started) clears everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import httpx
from prometheus_client import CollectorRegistry, Counter
from pydantic import TypeAdapter, ValidationError

from copse.workers import metrics as names
from copse.workers.nats_io import KvEventPublisher, connect
from copse.workers.protocol.hashing import chain_hash, tokens_hashes
from copse.workers.protocol.kv_events import (
    DumpBlock,
    KvCleared,
    KvDump,
    KvEvent,
    KvEventData,
    KvRemoved,
    KvStored,
    StoredBlock,
)
from copse.workers.protocol.trtllm import TrtllmCreated, TrtllmKvCacheEvent, TrtllmRemoved, TrtllmStored

log = logging.getLogger(__name__)

_EVENTS = TypeAdapter(list[TrtllmKvCacheEvent])


class KvRelay:
    """Pure translation state of one engine: TensorRT-LLM events in, numbered copse events out."""

    def __init__(
        self, *, worker_id: str, block_size: int, epoch: int, registry: CollectorRegistry | None = None
    ):
        self.worker_id = worker_id
        self.block_size = block_size
        self.epoch = epoch
        self.last_event_id = 0
        self._blocks: dict[int, DumpBlock] = {}
        """Engine block hash -> the copse block it is."""
        registry = registry or CollectorRegistry()
        self._published = Counter(
            names.RELAY_EVENTS, "copse KV events published", ["type"], registry=registry
        )
        self._dropped = Counter(
            names.RELAY_DROPPED_BLOCKS, "engine blocks not translated", ["reason"], registry=registry
        )
        self.poll_errors = Counter(
            names.RELAY_POLL_ERRORS, "failed polls of /kv_cache_events", registry=registry
        )

    def ingest(self, events: Sequence[TrtllmKvCacheEvent]) -> list[KvEvent]:
        """Translate drained engine events into copse events with consecutive ids."""
        out: list[KvEvent] = []
        for event in events:
            data = event.data
            translated: KvEventData | None = None
            if isinstance(data, TrtllmStored):
                translated = self._stored(data)
            elif isinstance(data, TrtllmRemoved):
                removed = [self._blocks.pop(h).block_hash for h in data.block_hashes if h in self._blocks]
                translated = KvRemoved(block_hashes=tuple(removed)) if removed else None
            elif isinstance(data, TrtllmCreated) and self._blocks:
                self._blocks.clear()
                translated = KvCleared()
            if translated is not None:
                self.last_event_id += 1
                out.append(KvEvent(event_id=self.last_event_id, data=translated))
                self._published.labels(translated.type).inc()
        return out

    def _stored(self, data: TrtllmStored) -> KvStored | None:
        if data.parent_hash is None:
            parent: int | None = None
        elif data.parent_hash in self._blocks:
            parent = self._blocks[data.parent_hash].block_hash
        else:
            self._dropped.labels("unknown_parent").inc(len(data.blocks))
            return None
        first_parent = parent
        blocks: list[StoredBlock] = []
        for index, block in enumerate(data.blocks):
            if len(block.tokens) != self.block_size:
                self._dropped.labels("block_size").inc(len(data.blocks) - index)
                log.warning(
                    "engine block of %d tokens, relay block size is %d: dropping the rest of the event",
                    len(block.tokens),
                    self.block_size,
                )
                break
            (local,) = tokens_hashes([t.token_id for t in block.tokens], block_size=self.block_size)
            block_hash = chain_hash(parent, local)
            if block.block_hash not in self._blocks:
                self._blocks[block.block_hash] = DumpBlock(block_hash, parent, local)
                blocks.append(StoredBlock(block_hash, local))
            elif blocks:
                break  # a known block inside the run: the rest would not be consecutive after it
            else:
                first_parent = block_hash
            parent = block_hash
        if not blocks:
            return None
        return KvStored(parent_hash=first_parent, blocks=tuple(blocks))

    def dump(self) -> KvDump:
        """Every block the engine holds (parents first, as stored), as of :attr:`last_event_id`."""
        return KvDump(
            worker_id=self.worker_id,
            epoch=self.epoch,
            block_size=self.block_size,
            last_event_id=self.last_event_id,
            blocks=tuple(self._blocks.values()),
        )


async def run_relay(
    *,
    engine_url: str,
    nats_url: str,
    worker_id: str,
    namespace: str,
    deployment: str,
    block_size: int,
    interval_s: float = 0.1,
    registry: CollectorRegistry | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Poll the engine every ``interval_s`` (immediately again while it has events) until ``stop``."""
    stop = stop or asyncio.Event()
    relay = KvRelay(worker_id=worker_id, block_size=block_size, epoch=time.time_ns(), registry=registry)
    connection = await connect(nats_url)
    publisher = KvEventPublisher(connection, namespace=namespace, deployment=deployment)
    await publisher.serve_dumps(worker_id=worker_id, dump=relay.dump)
    url = engine_url.rstrip("/") + "/kv_cache_events"
    try:
        async with httpx.AsyncClient(timeout=10.0) as http:
            while not stop.is_set():
                events: list[TrtllmKvCacheEvent] = []
                try:
                    reply = await http.post(url)
                    reply.raise_for_status()
                    events = _EVENTS.validate_json(reply.content)
                except (httpx.HTTPError, ValidationError) as exc:
                    relay.poll_errors.inc()
                    log.warning("polling %s failed: %s", url, exc)
                await publisher.publish(worker_id=worker_id, epoch=relay.epoch, events=relay.ingest(events))
                if not events:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), interval_s)
    finally:
        await connection.drain()
