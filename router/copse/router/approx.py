"""The approximate indexer, for engines that publish no KV events.

It learns only from the router's own decisions: a request routed to a worker leaves its prompt
blocks cached there. Instead of forgetting blocks after a fixed time (Dynamo's 120 s TTL), it
simulates each worker's LRU cache with that worker's real capacity in blocks: blocks are touched
in the order an engine releases them (output blocks first, then the prompt from its tail to its
head, so shared prefixes stay longest), and the least recently touched blocks are evicted once
the worker's capacity is exceeded. Output blocks occupy capacity but are never matched (the router
cannot know their hashes).

The same guessing covers a worker whose KV events lost track (:class:`copse.router.indexer.RadixIndexer`
keeps its guesses in its own index): there a block the index already holds for the worker is known
from events, not guessed, and events confirm or drop guesses (:meth:`ApproximateIndexer.forget`).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from copse.router.indexer import BlockIndex, Overlaps


class ApproximateIndexer:
    """A :class:`BlockIndex` fed by routing decisions, with one simulated LRU cache per worker."""

    __slots__ = ("_anonymous", "_capacity", "_lru", "default_capacity_blocks", "index")

    def __init__(self, *, default_capacity_blocks: int, index: BlockIndex) -> None:
        if default_capacity_blocks < 1:
            raise ValueError(f"default_capacity_blocks={default_capacity_blocks} must be at least 1")
        self.default_capacity_blocks = default_capacity_blocks
        """Cache size assumed for a worker whose own size is not known."""
        self.index = index
        """Where the guesses go (blocks it holds for a worker and did not guess are never touched)."""
        self._lru: dict[int, OrderedDict[int, None]] = {}
        self._capacity: dict[int, int] = {}
        self._anonymous = itertools.count(-1, -1)

    def set_capacity(self, slot: int, blocks: int) -> None:
        """The worker in ``slot`` holds at most ``blocks`` blocks (from its engine config)."""
        if blocks < 1:
            raise ValueError(f"capacity of slot {slot} must be at least 1 block, got {blocks}")
        self._capacity[slot] = blocks
        self._evict(slot)

    def capacity(self, slot: int) -> int:
        """Blocks the worker in ``slot`` is assumed to hold at most."""
        return self._capacity.get(slot, self.default_capacity_blocks)

    def overlaps(self, hashes: Sequence[int]) -> Overlaps:
        return self.index.overlaps(hashes)

    def blocks_held(self, slot: int) -> int:
        return self.index.blocks_held(slot)

    def on_routed(self, slot: int, hashes: Sequence[int], *, total_blocks: int) -> None:
        lru = self._lru.get(slot)
        if lru is None:
            lru = self._lru[slot] = OrderedDict()
        anonymous = self._anonymous
        # Output blocks beyond the capacity would only evict each other: at most a full cache of
        # them, so that a request's max_tokens never sizes the router's memory.
        for _ in range(min(total_blocks - len(hashes), self.capacity(slot))):
            lru[next(anonymous)] = None
        new: list[int] = []
        holds = self.index.holds
        for block in reversed(hashes):
            if block in lru:
                lru.move_to_end(block)
            elif not holds(slot, block):
                lru[block] = None
                new.append(block)
        self.index.store(slot, new)
        self._evict(slot)

    def forget(self, slot: int, hashes: Iterable[int]) -> None:
        """These blocks of the worker in ``slot`` are no longer guesses (events said they are held,
        or not); the index is the caller's to update."""
        lru = self._lru.get(slot)
        if lru:
            for block in hashes:
                lru.pop(block, None)

    def drop_guesses(self, slot: int) -> None:
        """Take every guess of the worker in ``slot`` out of the index and forget its simulated cache."""
        lru = self._lru.pop(slot, None)
        if lru:
            self.index.remove(slot, [block for block in lru if block >= 0])

    def forget_worker(self, slot: int) -> None:
        """Forget the simulated cache of the worker in ``slot`` (its blocks were cleared from the index)."""
        self._lru.pop(slot, None)

    def drop_worker(self, slot: int) -> None:
        self._lru.pop(slot, None)
        self._capacity.pop(slot, None)
        self.index.clear(slot)

    def _evict(self, slot: int) -> None:
        lru = self._lru.get(slot)
        if lru is None:
            return
        excess = len(lru) - self.capacity(slot)
        if excess <= 0:
            return
        evicted = [lru.popitem(last=False)[0] for _ in range(excess)]
        self.index.remove(slot, [block for block in evicted if block >= 0])
