"""The KV block manager of a mocked engine: prefix reuse by block hash, LRU eviction, offload to
the tiers below the GPU, and the events that mirror the cache contents exactly.

A physical GPU block is in one of four states:

* **active** -- a full block with a known hash, referenced by ``refcount`` running sequences;
* **inactive** -- a full block no sequence uses, still cached and reusable; evicted in LRU order;
* **partial** -- the last, not yet full block of one sequence (never shared, never advertised);
* **free**.

With offload tiers (:class:`copse.workers.perf.KvOffload`: host memory, then disk), a block evicted
from the GPU moves to the host tier, one evicted from the host tier to disk, one evicted from the
last tier leaves the cache: every tier is an LRU pool of its own (TensorRT-LLM offloads an evicted
primary block to its secondary, host pool the same way). A prefix hit on a lower tier *onboards*
the blocks: they move back into GPU blocks (which may push others down) and the engine spends the
copy time (:meth:`take_onboarded` says how many blocks came from each tier).

Events: ``stored`` when a hash becomes cached (on the GPU), ``updated`` when cached blocks move
to another tier (with the tier they are on now), ``removed`` when a block leaves the cache,
``cleared`` when everything is dropped. A block reused from the inactive pool emits nothing (it
never left the GPU), so the set of stored-minus-removed hashes always equals
``active | inactive | host | disk``, each on the tier its last event says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import islice, repeat
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel

from copse.workers.protocol.kv_events import (
    KvCleared,
    KvEventData,
    KvRemoved,
    KvStored,
    KvUpdated,
    StoredBlock,
)

#: Builds a named tuple from a plain one without the Python-level ``__new__`` of named tuples.
_new_tuple = tuple.__new__

_Model = TypeVar("_Model", bound=BaseModel)

#: Sets an attribute of a frozen model (as pydantic itself does when it builds one).
_set_attribute = object.__setattr__


def trusted_model(cls: type[_Model], values: dict[str, Any], fields_set: frozenset[str]) -> _Model:
    """What ``cls.model_construct(...)`` builds from trusted ``values`` (every field, in field order;
    ``fields_set`` names those given rather than defaulted): the four attributes it (and unpickling)
    sets, without its loop over the fields -- three times as fast, and engines emit an event for
    every block run they store or evict."""
    model = cls.__new__(cls)
    _set_attribute(model, "__dict__", values)
    _set_attribute(model, "__pydantic_fields_set__", set(fields_set))
    _set_attribute(model, "__pydantic_extra__", None)
    _set_attribute(model, "__pydantic_private__", None)
    return model


_STORED_FIELDS = frozenset(("type", "parent_hash", "blocks"))
_REMOVED_FIELDS = frozenset(("block_hashes",))
_UPDATED_FIELDS = frozenset(("type", "block_hashes", "tier", "previous_tier"))

#: Receives each event and, when the manager keeps tokens, the token ids of each stored block.
EventSink = Callable[[KvEventData, list[np.ndarray] | None], None]


class BlockHolder:
    """What a sequence holds: its full blocks in order, and whether it holds a partial block."""

    __slots__ = ("blocks", "partial")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        """Block hashes of the full blocks the sequence references, in sequence order."""
        self.partial: int = 0
        """1 if the sequence holds a partial last block, else 0."""


class BlockManager:
    """Blocks of one engine; every method is O(blocks touched), never O(cache size)."""

    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int,
        emit: EventSink,
        keep_tokens: bool = False,
        host_blocks: int = 0,
        disk_blocks: int = 0,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be at least 1")
        if host_blocks < 0 or disk_blocks < 0:
            raise ValueError(f"host_blocks={host_blocks} and disk_blocks={disk_blocks} must not be negative")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._emit = emit
        self._keep_tokens = keep_tokens
        self.lower_capacity = (host_blocks, disk_blocks)
        """Blocks the host and the disk tier hold (0: no such tier)."""
        self.lower: tuple[dict[int, None], dict[int, None]] = ({}, {})
        """Block hashes kept in host memory and on disk, each least recently moved there first."""
        self._onboarded = [0, 0]
        self.active: dict[int, int] = {}
        """Block hash -> number of sequences referencing it."""
        self.inactive: dict[int, None] = {}
        """Cached, unreferenced block hashes, least recently released first (a plain dict keeps
        insertion order and is twice as fast as an OrderedDict here)."""
        self.cached: dict[int, tuple[int | None, int]] = {}
        """Block hash -> (parent block hash, tokens hash) of every cached block, in caching order
        (for dumps)."""
        self.partial_blocks = 0
        """Partial blocks held by sequences."""

    @property
    def free_blocks(self) -> int:
        """Blocks holding nothing."""
        return self.num_blocks - len(self.active) - len(self.inactive) - self.partial_blocks

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by running sequences (active and partial)."""
        return len(self.active) + self.partial_blocks

    def cached_hashes(self) -> set[int]:
        """Every block hash currently cached, on any tier (what the engine's events advertise)."""
        host, disk = self.lower
        return set(self.active) | set(self.inactive) | set(host) | set(disk)

    def tier_of(self, block_hash: int) -> int:
        """The tier a cached block is on (0 the GPU, 1 host memory, 2 disk)."""
        host, disk = self.lower
        return 1 if block_hash in host else 2 if block_hash in disk else 0

    def match_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are cached, on any tier."""
        active, inactive = self.active, self.inactive
        host, disk = self.lower
        matched = 0
        if host or disk:
            for block_hash in hashes:
                if (
                    block_hash not in active
                    and block_hash not in inactive
                    and block_hash not in host
                    and block_hash not in disk
                ):
                    break
                matched += 1
            return matched
        for block_hash in hashes:
            if block_hash not in active and block_hash not in inactive:
                break
            matched += 1
        return matched

    def take_onboarded(self) -> tuple[int, int]:
        """Blocks brought back into the GPU from host memory and from disk since the last call."""
        host, disk = self._onboarded
        self._onboarded = [0, 0]
        return host, disk

    def grow(
        self,
        holder: BlockHolder,
        *,
        num_tokens: int,
        hashes: Sequence[int],
        tokens_hashes: Sequence[int],
        tokens: np.ndarray | None = None,
    ) -> bool:
        """Make ``holder`` hold blocks for its first ``num_tokens`` tokens; ``False`` (and no change)
        when there are not enough free or evictable blocks.

        ``hashes``/``tokens_hashes`` cover at least ``num_tokens // block_size`` blocks; ``tokens``
        (the sequence's token ids) is only read when the manager keeps tokens for events.
        """
        size = self.block_size
        full = num_tokens // size
        need_partial = 1 if num_tokens % size else 0
        start = len(holder.blocks)
        if full == start and need_partial == holder.partial:
            return True
        active, inactive = self.active, self.inactive
        host, disk = self.lower
        segment = hashes[start:full]
        # filter() over the segment runs in C: a prefill step touches hundreds of blocks at once
        shared = list(filter(active.__contains__, segment)) if active else []
        reused = list(filter(inactive.__contains__, segment)) if inactive else []
        from_host = list(filter(host.__contains__, segment)) if host else []
        from_disk = list(filter(disk.__contains__, segment)) if disk else []
        onboarded = len(from_host) + len(from_disk)
        missing = len(segment) - len(shared) - len(reused) - onboarded
        extra = missing + onboarded + need_partial - holder.partial
        free = self.num_blocks - len(active) - len(inactive) - self.partial_blocks
        if extra > free + len(inactive) - len(reused):
            return False
        runs: list[tuple[int, int]] = []
        if missing and missing == len(segment):
            runs.append((start, full))
        elif missing:
            known = {*shared, *reused, *from_host, *from_disk}
            for index in range(start, full):
                if hashes[index] in known:
                    continue
                if runs and runs[-1][1] == index:
                    runs[-1] = (runs[-1][0], index + 1)
                else:
                    runs.append((index, index + 1))
        if shared:
            active.update(zip(shared, map((1).__add__, map(active.__getitem__, shared)), strict=True))
        if reused:
            for block_hash in reused:  # del in a loop: map(d.__delitem__) is twice as slow
                del inactive[block_hash]
            active.update(dict.fromkeys(reused, 1))
        if onboarded:
            for block_hash in from_host:
                del host[block_hash]
            for block_hash in from_disk:
                del disk[block_hash]
            active.update(dict.fromkeys(from_host, 1))
            active.update(dict.fromkeys(from_disk, 1))
            self._onboarded[0] += len(from_host)
            self._onboarded[1] += len(from_disk)
            if from_host:
                self._emit_updated(tuple(from_host), tier=0, previous=1)
            if from_disk:
                self._emit_updated(tuple(from_disk), tier=0, previous=2)
        self.partial_blocks += need_partial - holder.partial
        holder.partial = need_partial
        holder.blocks.extend(segment)
        if extra > free:  # moving reused blocks to active left the free count as it was
            evicted = tuple(islice(inactive, extra - free))
            for block_hash in evicted:
                del inactive[block_hash]
            self._push_down(evicted, tier=1, source=0)
        for run_start, run_stop in runs:
            self._store_run(run_start, run_stop, hashes, tokens_hashes, tokens)
        return True

    def _push_down(self, blocks: tuple[int, ...], *, tier: int, source: int) -> None:
        """``blocks`` (least recently used first), on tier ``source``, leave it for ``tier`` below;
        the least recently used blocks of ``tier`` go further down to make room; what leaves the
        last tier leaves the cache. The deepest moves are announced first."""
        if tier > len(self.lower):
            meta = self.cached
            for block_hash in blocks:
                del meta[block_hash]
            removed = trusted_model(KvRemoved, {"type": "removed", "block_hashes": blocks}, _REMOVED_FIELDS)
            self._emit(removed, None)
            return
        capacity = self.lower_capacity[tier - 1]
        if not capacity:
            self._push_down(blocks, tier=tier + 1, source=source)
            return
        pool = self.lower[tier - 1]
        overflow = len(pool) + len(blocks) - capacity
        arriving = blocks
        if overflow > 0:
            leaving = tuple(islice(pool, overflow))
            for block_hash in leaving:
                del pool[block_hash]
            if leaving:
                self._push_down(leaving, tier=tier + 1, source=tier)
            if len(leaving) < overflow:  # more arrive than the tier holds: the oldest go on down
                passing = overflow - len(leaving)
                self._push_down(blocks[:passing], tier=tier + 1, source=source)
                arriving = blocks[passing:]
        if arriving:
            pool.update(dict.fromkeys(arriving))
            self._emit_updated(arriving, tier=tier, previous=source)

    def _emit_updated(self, blocks: tuple[int, ...], *, tier: int, previous: int) -> None:
        event = trusted_model(
            KvUpdated,
            {"type": "updated", "block_hashes": blocks, "tier": tier, "previous_tier": previous},
            _UPDATED_FIELDS,
        )
        self._emit(event, None)

    def _store_run(
        self,
        start: int,
        stop: int,
        hashes: Sequence[int],
        tokens_hashes: Sequence[int],
        tokens: np.ndarray | None,
    ) -> None:
        """Register blocks ``[start, stop)`` of a sequence (all new) and emit their ``stored`` event."""
        new = hashes[start:stop]
        local = tokens_hashes[start:stop]
        parent = hashes[start - 1] if start else None
        self.active.update(dict.fromkeys(new, 1))
        self.cached.update(zip(new, zip([parent, *new[:-1]], local, strict=True), strict=True))
        blocks = tuple(map(_new_tuple, repeat(StoredBlock), zip(new, local, strict=True)))
        event = trusted_model(
            KvStored, {"type": "stored", "parent_hash": parent, "blocks": blocks}, _STORED_FIELDS
        )
        block_tokens = None
        if self._keep_tokens and tokens is not None:
            size = self.block_size
            block_tokens = [tokens[i * size : (i + 1) * size] for i in range(start, stop)]
        self._emit(event, block_tokens)

    def release(self, holder: BlockHolder) -> None:
        """Drop ``holder``'s references, last block first, so that suffixes are evicted before the
        prefixes other sequences may share."""
        active, inactive = self.active, self.inactive
        tail_first = holder.blocks[::-1]
        if max(map(active.__getitem__, tail_first), default=0) == 1:
            # the common case, no block shared
            for block_hash in tail_first:
                del active[block_hash]
            inactive.update(dict.fromkeys(tail_first))
        else:
            for block_hash in tail_first:
                count = active[block_hash] - 1
                if count:
                    active[block_hash] = count
                else:
                    del active[block_hash]
                    inactive[block_hash] = None
        holder.blocks = []
        self.partial_blocks -= holder.partial
        holder.partial = 0

    def clear(self) -> bool:
        """Drop every cached block (only possible when no sequence holds any); ``False`` otherwise."""
        if self.active or self.partial_blocks:
            return False
        self.inactive.clear()
        for pool in self.lower:
            pool.clear()
        self.cached.clear()
        self._emit(KvCleared.model_construct(type="cleared"), None)
        return True

    def iter_cached(self) -> Iterator[tuple[int, int | None, int]]:
        """``(block hash, parent hash, tokens hash)`` of every cached block (on any tier, see
        :meth:`tier_of`), parents before children."""
        cached = self.cached
        emitted: set[int] = set()

        def visit(block_hash: int) -> Iterator[tuple[int, int | None, int]]:
            chain: list[int] = []
            while block_hash not in emitted and block_hash in cached:
                chain.append(block_hash)
                parent = cached[block_hash][0]
                if parent is None:
                    break
                block_hash = parent
            for item in reversed(chain):
                emitted.add(item)
                parent, tokens_hash = cached[item]
                yield item, parent, tokens_hash

        for block_hash in list(cached):
            yield from visit(block_hash)
