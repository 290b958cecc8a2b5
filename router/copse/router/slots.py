"""Small integer slots for worker ids, shared by the indexers and the load tracker.

Per-worker state lives in arrays and bitmasks indexed by slot, so that a routing decision touches
integers rather than strings. A released slot is reused by the next new worker.
"""

from __future__ import annotations

import heapq


class WorkerSlots:
    """A bijection between worker ids and the smallest free non-negative integers."""

    __slots__ = ("_free", "_ids", "_slots")

    def __init__(self) -> None:
        self._slots: dict[str, int] = {}
        self._ids: list[str | None] = []
        self._free: list[int] = []

    def slot(self, worker_id: str) -> int:
        """The slot of ``worker_id``, assigning one if it has none."""
        slot = self._slots.get(worker_id)
        if slot is not None:
            return slot
        if self._free:
            slot = heapq.heappop(self._free)
            self._ids[slot] = worker_id
        else:
            slot = len(self._ids)
            self._ids.append(worker_id)
        self._slots[worker_id] = slot
        return slot

    def get(self, worker_id: str) -> int | None:
        """The slot of ``worker_id``, or ``None`` when it has none."""
        return self._slots.get(worker_id)

    def worker_id(self, slot: int) -> str:
        """The worker id holding ``slot``; ``KeyError`` for a free slot."""
        worker_id = self._ids[slot] if 0 <= slot < len(self._ids) else None
        if worker_id is None:
            raise KeyError(f"slot {slot} is free")
        return worker_id

    def release(self, worker_id: str) -> int | None:
        """Free the slot of ``worker_id``; returns it, or ``None`` when the worker had none."""
        slot = self._slots.pop(worker_id, None)
        if slot is not None:
            self._ids[slot] = None
            heapq.heappush(self._free, slot)
        return slot

    @property
    def size(self) -> int:
        """One more than the highest slot ever assigned (the length per-slot arrays need)."""
        return len(self._ids)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def items(self) -> list[tuple[str, int]]:
        """``(worker_id, slot)`` of every assigned slot."""
        return list(self._slots.items())
