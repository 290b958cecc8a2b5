"""The KV events a mocked engine keeps for ``POST /kv_cache_events``, in TensorRT-LLM's format.

TensorRT-LLM keeps a bounded buffer (``event_buffer_max_size``): when it is full the oldest events
are dropped, and whoever drains it sees a gap in the event ids (the KV relay then resyncs the
router from a dump). A mocked engine behaves the same, but it formats an event only when the buffer
is drained: a ``stored`` event lists every token of every block as a JSON object, and building
those for events nobody drains (engines publishing on NATS themselves) cost a third of an engine
process's CPU. What is kept per copse event is the event itself and its blocks' token arrays; the
buffer counts the TensorRT-LLM events each one becomes (one, or one per block for a tier change),
so ids and what is dropped are exactly what formatting every event at once would give.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from copse.workers.protocol.kv_events import KvEventData


@dataclass(slots=True)
class _Pending:
    """One copse event, not yet formatted: TensorRT-LLM events ``first_id + skip .. first_id + count - 1``."""

    first_id: int
    data: KvEventData | dict[str, Any]
    """The copse event (a plain dict: the ``created`` event, which copse has no model of)."""
    tokens: list[np.ndarray] | None
    count: int
    skip: int = 0
    """Leading events of this one dropped by the bound."""
    cleared: list[int] | None = None
    """For ``cleared``: the blocks cached before it (TensorRT-LLM announces a reset as their removal)."""
    lora_id: int | None = None
    """For ``stored``: the LoRA adapter the blocks were computed through (``None``: the base model)."""


class TrtllmEventBuffer:
    """At most ``maxlen`` TensorRT-LLM KV events, the oldest dropped first; formatted on read."""

    def __init__(self, *, maxlen: int, window_size: int, cache_levels: list[int]) -> None:
        if maxlen < 1:
            raise ValueError(f"the TensorRT-LLM event buffer needs room for one event (maxlen {maxlen})")
        self.maxlen = maxlen
        self.window_size = window_size
        self._pending: deque[_Pending] = deque()
        self._size = 0
        self._next_id = 0
        created = {"type": "created", "num_blocks_per_cache_level": cache_levels}
        self._push(created, None, 1)

    def __len__(self) -> int:
        return self._size

    def add(self, data: KvEventData, tokens: list[np.ndarray] | None, *, lora_id: int | None = None) -> None:
        """Keep a copse event (and its stored blocks' token ids, and for ``stored`` the adapter they
        were computed through) as the TensorRT-LLM events it becomes."""
        self._push(data, tokens, len(data.block_hashes) if data.type == "updated" else 1)
        if data.type == "stored" and lora_id is not None and self._pending:
            self._pending[-1].lora_id = lora_id

    def note_cleared(self, cached: list[int]) -> None:
        """The last event is a ``cleared`` that removed the blocks ``cached``."""
        last = self._pending[-1] if self._pending else None
        if last is None or isinstance(last.data, dict) or last.data.type != "cleared":
            raise ValueError("note_cleared follows the cleared event it describes")
        last.cleared = cached

    def _push(self, data: KvEventData | dict[str, Any], tokens: list[np.ndarray] | None, count: int) -> None:
        if count == 0:
            return
        self._pending.append(_Pending(self._next_id, data, tokens, count))
        self._next_id += count
        self._size += count
        pending = self._pending
        while self._size > self.maxlen:
            oldest = pending[0]
            over = self._size - self.maxlen
            left = oldest.count - oldest.skip
            if left <= over:
                pending.popleft()
                self._size -= left
            else:
                oldest.skip += over
                self._size -= over

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The events held, oldest first, as ``POST /kv_cache_events`` lists them (not drained)."""
        for entry in self._pending:
            for offset, body in enumerate(_bodies(entry)[entry.skip :], start=entry.skip):
                yield {"event_id": entry.first_id + offset, "data": body, "window_size": self.window_size}

    def drain(self) -> list[dict[str, Any]]:
        """Every event held, oldest first; the buffer is empty after."""
        events = list(self)
        self._pending.clear()
        self._size = 0
        return events


def _bodies(entry: _Pending) -> list[dict[str, Any]]:
    """The ``data`` of the events ``trtllm-serve`` drains for one copse event (mocked engines use copse
    hashes as engine hashes): one event, except a tier change, which TensorRT-LLM announces block by block."""
    data = entry.data
    if isinstance(data, dict):
        return [data]
    if data.type == "stored":
        tokens = entry.tokens or [np.empty(0, dtype=np.uint32)] * len(data.blocks)
        return [
            {
                "type": "stored",
                "parent_hash": data.parent_hash,
                "blocks": [
                    {
                        "type": "stored_block",
                        "block_hash": block.block_hash,
                        "tokens": [
                            {"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in ids.tolist()
                        ],
                        "cache_level": 0,
                        "priority": 35,
                        "lora_id": entry.lora_id,
                    }
                    for block, ids in zip(data.blocks, tokens, strict=True)
                ],
            }
        ]
    if data.type == "removed":
        return [{"type": "removed", "block_hashes": list(data.block_hashes)}]
    if data.type == "updated":
        return [
            {
                "type": "updated",
                "block_hash": block_hash,
                "cache_level": {
                    "type": "event_diff",
                    "new_value": data.tier,
                    "old_value": data.previous_tier,
                },
                "priority": None,
            }
            for block_hash in data.block_hashes
        ]
    # cleared: TensorRT-LLM has no such event; a reset shows as the removal of every block
    return [{"type": "removed", "block_hashes": list(entry.cleared or [])}]
