"""The KV relay: runs next to a ``trtllm-serve`` worker, drains its ``POST /kv_cache_events`` and
publishes copse KV events on NATS, answering dump requests from what it knows.

TensorRT-LLM names blocks by opaque engine hashes; the relay recomputes copse's block hashes from
the tokens each stored block carries (:mod:`copse.workers.protocol.hashing`), so a router matches
prompts against them directly.

Never a block the engine does not hold. The relay publishes a block as held only from a
``stored`` event whose parent it holds (so what it holds is closed under prefixes, as the
engine's radix tree is), and a ``removed`` event takes the block's descendants with it (recent
engines send one event for a whole subtree, see :mod:`copse.workers.protocol.trtllm`). What it
can miss is engine events: the engine numbers them and drops the oldest when its buffer
(``event_buffer_max_size``) is full, and a relay (re)started after the engine missed its start.
Either shows as a gap in the ids (or a first event that is not the engine's ``created`` event 0,
per attention-DP rank); an event of a known type that cannot be read counts as one too (it may
have been a removal). The relay then forgets what it held, publishes a ``reset`` (a router forgets
that worker's blocks and guesses from its own routing meanwhile) and goes on: what it learns
afterwards is a subset of what the engine holds. It remembers the blocks it forgot (not as held)
to translate their removals and, when a stored block extends one of them, to publish that
ancestry again (the engine holds a stored block's ancestors).

An engine that restarts numbers its events from 0 again; its ``created`` event tells the relay,
but a full buffer can drop it, and the ids that follow could then look consecutive. A restarting
engine does not answer for a while (``trtllm-serve`` loads the model again): after a poll that
found nothing listening, the next event must be ``created`` 0 or the relay counts it as lost.

It publishes ``exact`` again once it can prove it knows every block: every reset starts a bound on
the engine's held-but-unknown blocks at the engine's cache size (its ``created`` events, or
``capacity_blocks``), each removal of an unknown block and each ancestry published again lowers
it by one, each stored block it cannot translate raises it; at 0 nothing is unknown. (Engines
with several block pools, attention DP or several window sizes, are never proven: their blocks
may repeat across pools.) An engine restart (``created`` 0 again) makes everything known (empty).

Cache tiers: an ``updated`` event that changes a held block's ``cache_level`` (offloaded to host
memory, onboarded back; see :mod:`copse.workers.perf.tiers`) becomes a copse ``updated`` event with
the block's new tier, and so does a stored block on a lower level; dumps and ancestries published
again keep each block's tier. Priority-only updates are no news to a router.

Events of a type it does not know are skipped one at a time and counted; their ids count. Dumps
list what it holds, ``exact=False`` while it has lost track (never blocks it does not hold).
Blocks it cannot translate are dropped and counted (``copse_kv_relay_dropped_blocks_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import ValidationError

from copse.workers import metrics as names
from copse.workers.nats_io import KvEventPublisher, close_connection, connect
from copse.workers.protocol.hashing import adapter_seed, chain_hash, tokens_hashes
from copse.workers.protocol.kv_events import (
    DumpBlock,
    KvCleared,
    KvDump,
    KvEvent,
    KvEventData,
    KvExact,
    KvRemoved,
    KvReset,
    KvStored,
    KvUpdated,
    StoredBlock,
)
from copse.workers.protocol.trtllm import (
    TRTLLM_EVENT_DATA,
    TrtllmCreated,
    TrtllmEventEnvelope,
    TrtllmRemoved,
    TrtllmStored,
    TrtllmUpdated,
)

log = logging.getLogger(__name__)

#: Forgotten blocks remembered after a reset when the engine's cache size is not known.
DEFAULT_MEMORY_BLOCKS = 1 << 18


@dataclasses.dataclass(slots=True)
class _Block:
    copse: DumpBlock
    parent: int | None
    """Engine hash of the block before it (``None`` for a first block)."""


class KvRelay:
    """Pure translation state of one engine: TensorRT-LLM events in, numbered copse events out."""

    def __init__(
        self,
        *,
        worker_id: str,
        block_size: int,
        epoch: int,
        capacity_blocks: int | None = None,
        registry: CollectorRegistry | None = None,
    ):
        self.worker_id = worker_id
        self.block_size = block_size
        self.epoch = epoch
        self.capacity_blocks = capacity_blocks
        """The engine's cache size in blocks (every cache level), for a relay that starts after
        the engine to prove when it knows every block again; its ``created`` events say it otherwise."""
        self.last_event_id = 0
        self.exact = False
        """Whether every block the engine holds is known (false until the engine's start is seen)."""
        self._held: dict[int, _Block] = {}
        """Engine block hash -> the copse block it is, for the blocks known to be held."""
        self._remembered: dict[int, _Block] = {}
        """Blocks forgotten at a reset (maybe held, maybe not), to translate what names them later."""
        self._children: dict[int, set[int]] = {}
        """Engine hash -> engine hashes of the blocks stored after it (held or remembered)."""
        self._next_id: dict[int | None, int] = {}
        """Next engine event id per attention-DP rank."""
        self._pools: set[tuple[int | None, int | None]] = set()
        """(window size, attention-DP rank) of the events seen: one block pool each."""
        self._capacity: dict[tuple[int | None, int | None], int] = {}
        """Blocks per pool, from the engine's ``created`` events."""
        self._unknown = math.inf
        """Upper bound on the blocks the engine holds that the relay does not know (while not exact)."""
        self._unreachable = False
        """The engine did not answer since the last event: it may have restarted."""
        self._out: list[KvEvent] = []
        registry = registry or CollectorRegistry()
        self._published = Counter(
            names.RELAY_EVENTS, "copse KV events published", ["type"], registry=registry
        )
        self._engine_events = Counter(
            names.RELAY_ENGINE_EVENTS, "TensorRT-LLM events drained", ["type"], registry=registry
        )
        self._resets = Counter(
            names.RELAY_RESETS, "times engine events were lost", ["reason"], registry=registry
        )
        self._dropped = Counter(
            names.RELAY_DROPPED_BLOCKS, "engine blocks not translated", ["reason"], registry=registry
        )
        self._exact_gauge = Gauge(names.RELAY_EXACT, "1 while every engine block is known", registry=registry)
        self.poll_errors = Counter(
            names.RELAY_POLL_ERRORS, "failed polls of /kv_cache_events", registry=registry
        )
        self._emit(KvReset())  # a relay starts knowing nothing

    # -- events in ------------------------------------------------------------------------------

    def engine_unreachable(self) -> None:
        """Nothing listened at the engine's address: it may be restarting (see the module doc)."""
        self._unreachable = True

    def ingest(self, events: Sequence[Mapping[str, Any]]) -> list[KvEvent]:
        """Translate drained engine events (the JSON objects ``/kv_cache_events`` lists) into copse
        events with consecutive ids (everything emitted since the last call)."""
        for raw in events:
            self._ingest(raw)
        out, self._out = self._out, []
        return out

    def _ingest(self, raw: Mapping[str, Any]) -> None:
        try:
            envelope = TrtllmEventEnvelope.model_validate(raw)
        except ValidationError as exc:
            self._engine_events.labels("malformed").inc()
            log.warning("unreadable engine event (%s): its successors may miss what it said", _first(exc))
            self._lose_track("malformed")
            return
        kind = envelope.data.get("type")
        model = TRTLLM_EVENT_DATA.get(kind) if isinstance(kind, str) else None
        rank, event_id = envelope.attention_dp_rank, envelope.event_id
        expected = self._next_id.get(rank)
        created = model is TrtllmCreated and event_id == 0
        if self._unreachable:
            self._unreachable = False
            if not created:
                self._lose_track("restart")
        if created:
            if expected is not None or not self._next_id:
                self._engine_started()
            # else another rank of an engine starting: nothing was missed
        elif expected is None:
            self._lose_track("start")  # the relay started after the engine (or a rank appears mid-stream)
        elif event_id != expected:
            self._lose_track("gap")
        self._next_id[rank] = event_id + 1
        pool = (envelope.window_size, rank)
        if pool not in self._pools:
            self._pools.add(pool)
            if len(self._pools) > 1 and not self.exact:
                self._unknown = math.inf  # blocks may repeat across pools: no bound holds
        if model is None:
            self._engine_events.labels("unknown").inc()
            log.debug("skipping an engine event of unknown type %r (id %d)", kind, event_id)
            return
        try:
            data = model.model_validate(envelope.data)
        except ValidationError as exc:
            self._engine_events.labels("malformed").inc()
            log.warning("unreadable %s event %d (%s): counted as lost", kind, event_id, _first(exc))
            self._lose_track("malformed")
            return
        self._engine_events.labels(data.type).inc()
        if isinstance(data, TrtllmStored):
            self._stored(data)
        elif isinstance(data, TrtllmRemoved):
            self._removed(data.block_hashes)
        elif isinstance(data, TrtllmCreated):
            self._capacity[pool] = sum(data.num_blocks_per_cache_level)
        elif isinstance(data, TrtllmUpdated):
            self._updated(data)
        if not self.exact and self._unknown <= 0:
            self._now_exact()

    def _stored(self, data: TrtllmStored) -> None:
        parent_engine = data.parent_hash
        parent: int | None = None
        if parent_engine is not None:
            if parent_engine not in self._held:
                self._recall(parent_engine)
            known = self._held.get(parent_engine)
            if known is None:
                self._dropped.labels("unknown_parent").inc(len(data.blocks))
                if self.exact:
                    self._lose_track("unknown_parent")
                self._unknown += len(data.blocks)
                return
            parent = known.copse.block_hash
        first_parent, previous = parent, parent_engine
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
            ids = [t.token_id for t in block.tokens]
            (local,) = tokens_hashes(ids, block_size=self.block_size, seed=adapter_seed(block.lora_id))
            block_hash = chain_hash(parent, local)
            if block.block_hash not in self._held:
                self._unlink(block.block_hash, self._remembered.pop(block.block_hash, None))
                tier = block.cache_level if 0 <= block.cache_level <= 2 else 0
                self._hold(block.block_hash, _Block(DumpBlock(block_hash, parent, local, tier), previous))
                blocks.append(StoredBlock(block_hash, local))
            elif blocks:
                break  # a known block inside the run: the rest would not be consecutive after it
            else:
                first_parent = block_hash
            parent, previous = block_hash, block.block_hash
        if blocks:
            self._emit(KvStored(parent_hash=first_parent, blocks=tuple(blocks)))
            self._emit_tiers([self._held[b.block_hash] for b in data.blocks if b.block_hash in self._held])

    def _emit_tiers(self, blocks: Sequence[_Block]) -> None:
        """Blocks just published as stored (on the GPU) that are on a lower tier: say so."""
        for tier in (1, 2):
            moved = tuple(b.copse.block_hash for b in blocks if b.copse.tier == tier)
            if moved:
                self._emit(KvUpdated(block_hashes=moved, tier=tier, previous_tier=0))

    def _updated(self, data: TrtllmUpdated) -> None:
        level = data.cache_level
        block = self._held.get(data.block_hash)
        if level is None or level.new_value == level.old_value:
            return  # a priority change
        if not 0 <= level.new_value <= 2:
            self._dropped.labels("cache_level").inc()
            return
        if block is None:
            remembered = self._remembered.get(data.block_hash)
            if remembered is not None:  # not published as held: only keep its tier right
                remembered.copse = remembered.copse._replace(tier=level.new_value)
            return
        if block.copse.tier == level.new_value:
            return
        previous = block.copse.tier
        block.copse = block.copse._replace(tier=level.new_value)
        self._emit(
            KvUpdated(block_hashes=(block.copse.block_hash,), tier=level.new_value, previous_tier=previous)
        )

    def _recall(self, engine_hash: int) -> None:
        """``engine_hash`` is the parent of a stored block, so the engine holds it and its ancestors:
        publish again the remembered ones, if the chain reaches a held block or the root."""
        chain: list[int] = []
        cursor: int | None = engine_hash
        while cursor is not None and cursor not in self._held:
            block = self._remembered.get(cursor)
            if block is None:
                return  # a link is unknown: what hangs below it could not be removed with it
            chain.append(cursor)
            cursor = block.parent
        chain.reverse()
        recalled = [self._remembered.pop(h) for h in chain]
        for engine, block in zip(chain, recalled, strict=True):
            self._held[engine] = block
        self._unknown -= len(chain)
        self._emit(
            KvStored(
                parent_hash=recalled[0].copse.parent_hash,
                blocks=tuple(StoredBlock(b.copse.block_hash, b.copse.tokens_hash) for b in recalled),
            )
        )
        self._emit_tiers(recalled)

    def _removed(self, engine_hashes: Sequence[int]) -> None:
        gone: list[int] = []
        for engine_hash in engine_hashes:
            if engine_hash not in self._held:
                self._unknown -= 1  # the engine held it and the relay did not know it
                if engine_hash not in self._remembered:
                    continue
            for descendant in self._subtree(engine_hash):
                block = self._held.pop(descendant, None) or self._remembered.pop(descendant)
                self._unlink(descendant, block)
                self._children.pop(descendant, None)
                gone.append(block.copse.block_hash)
        if gone:
            self._emit(KvRemoved(block_hashes=tuple(gone)))

    def _subtree(self, engine_hash: int) -> Iterator[int]:
        """``engine_hash`` and every block known to descend from it (descendants first)."""
        stack, order = [engine_hash], []
        while stack:
            current = stack.pop()
            if current in self._held or current in self._remembered:
                order.append(current)
                stack.extend(self._children.get(current, ()))
        return reversed(order)

    # -- state changes ----------------------------------------------------------------------------

    def _hold(self, engine_hash: int, block: _Block) -> None:
        self._held[engine_hash] = block
        if block.parent is not None:
            self._children.setdefault(block.parent, set()).add(engine_hash)

    def _unlink(self, engine_hash: int, block: _Block | None) -> None:
        if block is not None and block.parent is not None:
            siblings = self._children.get(block.parent)
            if siblings is not None:
                siblings.discard(engine_hash)
                if not siblings:
                    del self._children[block.parent]

    def _engine_started(self) -> None:
        """The engine (re)started: it holds nothing, and every event from here on is seen."""
        self._held.clear()
        self._remembered.clear()
        self._children.clear()
        self._next_id.clear()
        self._pools.clear()
        self._capacity.clear()
        self._unknown = 0
        self.exact = True
        self._exact_gauge.set(1)
        self._emit(KvCleared())

    def _lose_track(self, reason: str) -> None:
        self._resets.labels(reason).inc()
        log.warning("KV events of %s lost (%s): publishing a reset", self.worker_id, reason)
        capacity = sum(self._capacity.values()) or self.capacity_blocks
        self._unknown = float(capacity) if capacity is not None and len(self._pools) <= 1 else math.inf
        if not self.exact and not self._held:
            return  # subscribers already know nothing of this engine's blocks
        self._remembered.update(self._held)
        self._held.clear()
        limit = capacity or DEFAULT_MEMORY_BLOCKS
        for engine_hash in list(self._remembered)[: max(0, len(self._remembered) - limit)]:
            self._unlink(engine_hash, self._remembered.pop(engine_hash))
        self.exact = False
        self._exact_gauge.set(0)
        self._emit(KvReset())

    def _now_exact(self) -> None:
        log.info("KV events of %s describe every block again", self.worker_id)
        for engine_hash, block in list(self._remembered.items()):
            self._unlink(engine_hash, block)
        self._remembered.clear()
        self.exact = True
        self._exact_gauge.set(1)
        self._emit(KvExact())

    def _emit(self, data: KvEventData) -> None:
        self.last_event_id += 1
        self._out.append(KvEvent(event_id=self.last_event_id, data=data))
        self._published.labels(data.type).inc()

    # -- dumps ------------------------------------------------------------------------------------

    def dump(self) -> KvDump:
        """Every block known to be held (parents first, as stored) as of :attr:`last_event_id`;
        ``exact=False`` while the engine may hold others."""
        return KvDump(
            worker_id=self.worker_id,
            epoch=self.epoch,
            block_size=self.block_size,
            last_event_id=self.last_event_id,
            blocks=tuple(block.copse for block in self._held.values()),
            exact=self.exact,
        )


def _first(exc: ValidationError) -> str:
    error = exc.errors()[0]
    return f"{'.'.join(str(part) for part in error['loc']) or 'event'}: {error['msg']}"


async def run_relay(
    *,
    engine_url: str,
    nats_url: str,
    worker_id: str,
    namespace: str,
    deployment: str,
    block_size: int,
    capacity_blocks: int | None = None,
    interval_s: float = 0.1,
    registry: CollectorRegistry | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Poll the engine every ``interval_s`` (immediately again while it has events) until ``stop``."""
    stop = stop or asyncio.Event()
    relay = KvRelay(
        worker_id=worker_id,
        block_size=block_size,
        epoch=time.time_ns(),
        capacity_blocks=capacity_blocks,
        registry=registry,
    )
    connection = await connect(nats_url, stop=stop)
    if connection is None:  # stopped before NATS could be reached
        return
    publisher = KvEventPublisher(connection, namespace=namespace, deployment=deployment)
    await publisher.publish(worker_id=worker_id, epoch=relay.epoch, events=relay.ingest([]))
    await publisher.serve_dumps(worker_id=worker_id, dump=relay.dump)
    url = engine_url.rstrip("/") + "/kv_cache_events"
    try:
        async with httpx.AsyncClient(timeout=10.0) as http:
            while not stop.is_set():
                events: list[Mapping[str, Any]] = []
                try:
                    reply = await http.post(url)
                    reply.raise_for_status()
                    events = _event_list(reply.content)
                except (httpx.HTTPError, ValueError, RecursionError) as exc:  # a body nested too deep
                    relay.poll_errors.inc()
                    log.warning("polling %s failed: %s", url, exc)
                    if isinstance(exc, httpx.ConnectError):
                        relay.engine_unreachable()
                await publisher.publish(worker_id=worker_id, epoch=relay.epoch, events=relay.ingest(events))
                if not events:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), interval_s)
    finally:
        await close_connection(connection)


def _event_list(body: bytes) -> list[Mapping[str, Any]]:
    """The JSON list of events a drain answers (each element read later, on its own)."""
    events = json.loads(body)
    if not isinstance(events, list):
        raise ValueError(f"expected a JSON list of events, got {type(events).__name__}")
    return [event if isinstance(event, dict) else {"malformed": event} for event in events]
