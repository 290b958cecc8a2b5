"""Which workers hold which prompt prefixes: the radix-tree indexer fed by KV events.

A prompt is a sequence of chained block hashes (:mod:`copse.workers.protocol.hashing`): the hash
of block *i* names the whole prefix up to and including block *i*, so it *is* the path from the
root of the prefix tree to that node. The tree is therefore stored as one map from node (block
hash) to the set of workers holding it, with no child maps to walk: matching a prompt is one map
look-up per block and an intersection of worker sets, here bitmasks over worker slots, up to the
first block no worker holds. The map and the walk are compiled (``_native.c``): a decision walks
a million-block index in a few microseconds.

The index also keeps the tier of its cache each worker keeps each block on (the GPU, host memory,
disk: ``updated`` events move blocks between tiers, see :mod:`copse.workers.perf.tiers`); a block
below the GPU is still held (a prefix hit there costs its onboarding, which the routing cost adds).

For a prompt, :meth:`BlockIndex.overlaps` answers how many leading blocks each worker holds: a
worker counts up to the first block it does not hold, even if it holds later ones (it cannot
reuse KV after a gap); :meth:`BlockIndex.overlap_array` answers the same as an array over worker
slots, which is what a routing decision uses.

:class:`RadixIndexer` keeps the index in step with each worker's event stream: events are
applied in ``event_id`` order per engine incarnation (``epoch``); a gap, a new incarnation that
does not start at event 1, or events from a worker never seen before (the router started after
it) drop what is known of that worker and ask for a dump (:class:`ResyncNeeded`); events that
arrive meanwhile are buffered and replayed after the dump.

A worker whose publisher lost engine events (a ``reset`` event, or a dump with ``exact=False``:
the KV relay next to ``trtllm-serve``, see :mod:`copse.workers.relay`) is *approximate*: its
blocks are forgotten, what its events say afterwards is applied as usual (never a block it does
not hold), and the blocks of the requests routed to it are guessed as the approximate indexer
does (:mod:`copse.router.approx`: a simulated LRU cache of the worker's size). Events confirm
guesses (stored) or drop them (removed); ``exact`` or ``cleared`` (the events describe the whole
cache again) takes the remaining guesses out. A guess of a block the worker evicted while its
events could not name it stays until the simulated cache evicts it: guesses are predictions.
While no events can arrive at all (the NATS connection is down) it is in *learning* mode: the
requests routed to every worker are guessed that way, until dumps replace them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from copse.router import loops
from copse.router.approx import ApproximateIndexer
from copse.router.slots import WorkerSlots
from copse.workers.protocol import (
    KvCleared,
    KvDump,
    KvEvent,
    KvEventBatch,
    KvExact,
    KvRemoved,
    KvReset,
    KvStored,
    KvUpdated,
)

FloatArray = npt.NDArray[np.float64]
Overlaps = dict[int, int]
"""Worker slot -> number of leading prompt blocks that worker holds (only workers with at least one)."""

#: Events kept per worker while a dump is awaited; older ones are dropped, which the id check
#: after the dump turns into a new resync rather than a silent divergence.
MAX_BUFFERED_EVENTS = 65536


class BlockIndex(loops.BlockIndex):
    """The prefix tree: block hash -> the worker slots holding that block (compiled: a hash table
    of bitmasks over slots, see ``_native.c``).

    ``store(slot, hashes)``, ``remove(slot, hashes)`` (unknown blocks are ignored), ``clear(slot)``,
    ``holds(slot, block)``, ``blocks_held(slot)`` and ``len()`` (distinct blocks held by at least one
    worker) come from the compiled base; hashes are unsigned 64-bit integers (``ValueError``
    otherwise) and slots ``0 .. 65535``."""

    __slots__ = ()

    def overlaps(self, hashes: Sequence[int]) -> Overlaps:
        """For every worker holding at least the first block: how many leading blocks it holds."""
        depths = self.overlap_array(hashes, self.slot_limit)
        return {int(slot): int(depths.item(slot)) for slot in np.flatnonzero(depths)}

    def overlap_array(self, hashes: Sequence[int], size: int) -> FloatArray:
        """:meth:`overlaps` as an array over slots ``0 .. size-1`` (0 for the others): one look-up
        per block up to the first block no worker holds, a worker counting up to the first block it
        does not hold even if it holds later ones (it cannot reuse KV after a gap)."""
        out = np.empty(size)
        self.leading_blocks(hashes, out)
        return out


class Indexer(Protocol):
    """What the router asks of an indexer, whichever way it learns the workers' caches."""

    @property
    def index(self) -> BlockIndex:
        """The blocks each worker is believed to hold (a routing decision walks it)."""
        ...

    def overlaps(self, hashes: Sequence[int]) -> Overlaps:
        """Leading blocks of ``hashes`` each worker holds."""
        ...

    def blocks_held(self, slot: int) -> int:
        """Blocks the worker in ``slot`` is believed to hold."""
        ...

    def on_routed(self, slot: int, hashes: Sequence[int], *, total_blocks: int) -> None:
        """The router sent a request with prompt ``hashes`` (``total_blocks`` of KV including its
        output) to ``slot``."""
        ...

    def drop_worker(self, slot: int) -> None:
        """Forget a worker that left."""
        ...

    def set_capacity(self, slot: int, blocks: int) -> None:
        """The worker in ``slot`` holds at most ``blocks`` blocks (from its engine), for guesses."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class ResyncNeeded:
    """The index lost track of ``worker_id`` at ``epoch``: ask it for a dump."""

    worker_id: str
    epoch: int
    reason: str
    """Why, for logs and metrics: ``gap``, ``new-worker`` or ``new-epoch``."""


@dataclasses.dataclass(slots=True)
class _Stream:
    epoch: int
    last_event_id: int = 0
    awaiting_dump: bool = False
    buffer: list[KvEvent] = dataclasses.field(default_factory=list)


class RadixIndexer:
    """The exact indexer: a :class:`BlockIndex` driven by each worker's KV event stream (guessing
    for the workers whose events lost track, see the module documentation)."""

    __slots__ = ("_approximate", "_streams", "guesses", "index", "learning", "slots", "stats")

    def __init__(self, slots: WorkerSlots, *, default_capacity_blocks: int) -> None:
        self.slots = slots
        self.index = BlockIndex()
        self.learning = False
        """Guess for every worker (no events arrive: the NATS connection is down)."""
        self.guesses = ApproximateIndexer(default_capacity_blocks=default_capacity_blocks, index=self.index)
        """The guessed blocks of approximate workers (in :attr:`index`) and their simulated caches."""
        self._approximate: set[int] = set()
        self._streams: dict[str, _Stream] = {}
        self.stats: dict[str, int] = {
            "events": 0,
            "blocks": 0,
            "resyncs": 0,
            "duplicates": 0,
            "stale": 0,
            "resets": 0,
        }

    # -- queries ----------------------------------------------------------------------------

    def overlaps(self, hashes: Sequence[int]) -> Overlaps:
        return self.index.overlaps(hashes)

    def blocks_held(self, slot: int) -> int:
        return self.index.blocks_held(slot)

    def approximate(self, slot: int) -> bool:
        """Whether the worker in ``slot`` lost track of its events (its blocks are partly guessed)."""
        return slot in self._approximate

    def on_routed(self, slot: int, hashes: Sequence[int], *, total_blocks: int) -> None:
        """Guessed for an approximate worker, or any in learning mode; otherwise nothing to learn:
        its events will say."""
        if self.learning or slot in self._approximate:
            self.guesses.on_routed(slot, hashes, total_blocks=total_blocks)

    def set_capacity(self, slot: int, blocks: int) -> None:
        self.guesses.set_capacity(slot, blocks)

    def awaiting_dump(self, worker_id: str) -> bool:
        """Whether a dump of ``worker_id`` is awaited (its blocks are unknown meanwhile)."""
        stream = self._streams.get(worker_id)
        return stream is not None and stream.awaiting_dump

    def last_event_id(self, worker_id: str) -> int | None:
        """Id of the last event applied for ``worker_id``; ``None`` for an unknown worker."""
        stream = self._streams.get(worker_id)
        return None if stream is None else stream.last_event_id

    # -- updates ----------------------------------------------------------------------------

    def drop_worker(self, slot: int) -> None:
        self._clear(slot, approximate=False)
        self.guesses.drop_worker(slot)

    def forget(self, worker_id: str) -> None:
        """Forget a worker that left: its blocks and its event stream position."""
        self._streams.pop(worker_id, None)
        slot = self.slots.get(worker_id)
        if slot is not None:
            self.drop_worker(slot)

    def apply(self, batch: KvEventBatch) -> ResyncNeeded | None:
        """Apply one batch; returns a :class:`ResyncNeeded` when a dump must now be requested."""
        return self.apply_events(batch.worker_id, epoch=batch.epoch, events=batch.events)

    def apply_events(self, worker_id: str, *, epoch: int, events: Sequence[KvEvent]) -> ResyncNeeded | None:
        """Apply consecutive events of one engine incarnation (what a batch carries)."""
        stream = self._streams.get(worker_id)
        if stream is not None and epoch < stream.epoch:
            self.stats["stale"] += 1
            return None
        slot = self.slots.slot(worker_id)
        if stream is None or epoch != stream.epoch:
            reason = "new-worker" if stream is None else "new-epoch"
            self._clear(slot, approximate=False)
            stream = self._streams[worker_id] = _Stream(epoch=epoch)
            if events and events[0].event_id != 1:
                return self._lose_track(worker_id, stream, events, reason=reason)
        if stream.awaiting_dump:
            self._buffer(stream, events)
            return None
        return self._apply_events(worker_id, slot, stream, events)

    def load_dump(self, dump: KvDump) -> ResyncNeeded | None:
        """Replace what is known of ``dump.worker_id`` with the dump, then replay the events buffered
        since the resync began. A dump older than what is already applied is ignored."""
        stream = self._streams.get(dump.worker_id)
        if stream is not None and (
            dump.epoch < stream.epoch
            or (
                dump.epoch == stream.epoch
                and not stream.awaiting_dump
                and dump.last_event_id < stream.last_event_id
            )
        ):
            self.stats["stale"] += 1
            return None
        if stream is None or dump.epoch != stream.epoch:
            stream = self._streams[dump.worker_id] = _Stream(epoch=dump.epoch)
        slot = self.slots.slot(dump.worker_id)
        self._clear(slot, approximate=not dump.exact)
        self.index.store(slot, (block.block_hash for block in dump.blocks))
        for tier in {block.tier for block in dump.blocks} - {0}:
            self.index.set_tier(slot, [block.block_hash for block in dump.blocks if block.tier == tier], tier)
        stream.last_event_id = dump.last_event_id
        stream.awaiting_dump = False
        buffered, stream.buffer = stream.buffer, []
        return self._apply_events(dump.worker_id, slot, stream, buffered)

    def _clear(self, slot: int, *, approximate: bool) -> None:
        """Forget every block of ``slot`` (guesses too); it is approximate afterwards or not."""
        self.index.clear(slot)
        self.guesses.forget_worker(slot)
        if approximate:
            self._approximate.add(slot)
        else:
            self._approximate.discard(slot)

    def _apply_events(
        self, worker_id: str, slot: int, stream: _Stream, events: Sequence[KvEvent]
    ) -> ResyncNeeded | None:
        index = self.index
        stats = self.stats
        approximate = self._approximate
        for position, event in enumerate(events):
            if event.event_id <= stream.last_event_id:
                stats["duplicates"] += 1
                continue
            if event.event_id != stream.last_event_id + 1:
                self._clear(slot, approximate=slot in approximate)
                return self._lose_track(worker_id, stream, events[position:], reason="gap")
            data = event.data
            if isinstance(data, KvStored):
                hashes = [block.block_hash for block in data.blocks]
                index.store(slot, hashes)
                if slot in approximate:
                    self.guesses.forget(slot, hashes)  # confirmed
                stats["blocks"] += len(hashes)
            elif isinstance(data, KvRemoved):
                index.remove(slot, data.block_hashes)
                if slot in approximate:
                    self.guesses.forget(slot, data.block_hashes)
                stats["blocks"] += len(data.block_hashes)
            elif isinstance(data, KvUpdated):
                index.set_tier(slot, data.block_hashes, data.tier)
                if slot in approximate:
                    self.guesses.forget(slot, data.block_hashes)  # held, so no longer a guess
                stats["blocks"] += len(data.block_hashes)
            elif isinstance(data, KvCleared):
                self._clear(slot, approximate=False)
            elif isinstance(data, KvReset):
                self._clear(slot, approximate=True)
                stats["resets"] += 1
            elif isinstance(data, KvExact):
                self.guesses.drop_guesses(slot)
                approximate.discard(slot)
            stream.last_event_id = event.event_id
            stats["events"] += 1
        return None

    def _lose_track(
        self, worker_id: str, stream: _Stream, events: Sequence[KvEvent], *, reason: str
    ) -> ResyncNeeded:
        stream.awaiting_dump = True
        stream.buffer = []
        self._buffer(stream, events)
        self.stats["resyncs"] += 1
        return ResyncNeeded(worker_id=worker_id, epoch=stream.epoch, reason=reason)

    @staticmethod
    def _buffer(stream: _Stream, events: Sequence[KvEvent]) -> None:
        stream.buffer.extend(events)
        excess = len(stream.buffer) - MAX_BUFFERED_EVENTS
        if excess > 0:
            del stream.buffer[:excess]
