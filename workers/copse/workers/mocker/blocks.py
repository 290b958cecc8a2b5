"""The KV block manager of a mocked engine: prefix reuse by block hash, LRU eviction, and the
events that mirror the cache contents exactly.

A physical block is in one of four states:

* **active** -- a full block with a known hash, referenced by ``refcount`` running sequences;
* **inactive** -- a full block no sequence uses, still cached and reusable; evicted in LRU order;
* **partial** -- the last, not yet full block of one sequence (never shared, never advertised);
* **free**.

Events: ``stored`` when a hash becomes cached, ``removed`` when an inactive block is evicted,
``cleared`` when everything is dropped. A block reused from the inactive pool emits nothing (it
never left the cache), so the set of stored-minus-removed hashes always equals
``active | inactive``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import islice, repeat
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel

from copse.workers.protocol.kv_events import KvCleared, KvEventData, KvRemoved, KvStored, StoredBlock

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
        self, *, num_blocks: int, block_size: int, emit: EventSink, keep_tokens: bool = False
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._emit = emit
        self._keep_tokens = keep_tokens
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
        """Every block hash currently cached (what the engine's events advertise)."""
        return set(self.active) | set(self.inactive)

    def match_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are cached."""
        active, inactive = self.active, self.inactive
        matched = 0
        for block_hash in hashes:
            if block_hash not in active and block_hash not in inactive:
                break
            matched += 1
        return matched

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
        segment = hashes[start:full]
        # filter() over the segment runs in C: a prefill step touches hundreds of blocks at once
        shared = list(filter(active.__contains__, segment)) if active else []
        reused = list(filter(inactive.__contains__, segment)) if inactive else []
        missing = len(segment) - len(shared) - len(reused)
        extra = missing + need_partial - holder.partial
        free = self.num_blocks - len(active) - len(inactive) - self.partial_blocks
        if extra > free + len(inactive) - len(reused):
            return False
        runs: list[tuple[int, int]] = []
        if missing and missing == len(segment):
            runs.append((start, full))
        elif missing:
            known = {*shared, *reused}
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
        self.partial_blocks += need_partial - holder.partial
        holder.partial = need_partial
        holder.blocks.extend(segment)
        if extra > free:  # moving reused blocks to active left the free count as it was
            evicted = tuple(islice(inactive, extra - free))
            meta = self.cached
            for block_hash in evicted:
                del inactive[block_hash]
                del meta[block_hash]
            removed = trusted_model(KvRemoved, {"type": "removed", "block_hashes": evicted}, _REMOVED_FIELDS)
            self._emit(removed, None)
        for run_start, run_stop in runs:
            self._store_run(run_start, run_stop, hashes, tokens_hashes, tokens)
        return True

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
        self.cached.clear()
        self._emit(KvCleared.model_construct(type="cleared"), None)
        return True

    def iter_cached(self) -> Iterator[tuple[int, int | None, int]]:
        """``(block hash, parent hash, tokens hash)`` of every cached block, parents before children."""
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
