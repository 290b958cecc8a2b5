"""The mocked engine's TensorRT-LLM event buffer formats events only when drained, yet keeps, drops
and numbers them exactly as a buffer of formatted events bounded the same way: the ids a drain
lists, and the gaps a KV relay sees after an overflow, are the same."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from copse.workers.mocker.blocks import trusted_model
from copse.workers.mocker.trtllm_events import TrtllmEventBuffer, _bodies, _Pending
from copse.workers.protocol import KvRemoved, KvStored, StoredBlock
from copse.workers.protocol.kv_events import KvCleared, KvEventData, KvUpdated

WINDOW = 4096


def _stored(n: int, seed: int) -> tuple[KvEventData, list[np.ndarray]]:
    blocks = tuple(StoredBlock(seed * 100 + i, seed * 100 + i + 50) for i in range(n))
    data = trusted_model(
        KvStored,
        {"type": "stored", "parent_hash": None, "blocks": blocks},
        frozenset(("type", "parent_hash", "blocks")),
    )
    return data, [np.arange(seed, seed + 4, dtype=np.uint32) for _ in range(n)]


_events = st.lists(
    st.one_of(
        st.tuples(st.just("stored"), st.integers(1, 3)),
        st.tuples(st.just("removed"), st.integers(1, 3)),
        st.tuples(st.just("updated"), st.integers(0, 5)),
        st.tuples(st.just("cleared"), st.just(0)),
        st.tuples(st.just("drain"), st.just(0)),
    ),
    max_size=60,
)


@given(events=_events, maxlen=st.integers(1, 8))
@settings(max_examples=300, deadline=None)
def test_lazy_buffer_keeps_drops_and_numbers_like_an_eager_one(
    events: list[tuple[str, int]], maxlen: int
) -> None:
    lazy = TrtllmEventBuffer(maxlen=maxlen, window_size=WINDOW, cache_levels=[64, 8])
    eager: deque[dict[str, Any]] = deque(maxlen=maxlen)
    next_id = 0

    def push(data: KvEventData | dict[str, Any], tokens: list[np.ndarray] | None, cleared: list[int]) -> None:
        nonlocal next_id
        for body in _bodies(_Pending(0, data, tokens, 0, cleared=cleared)):
            eager.append({"event_id": next_id, "data": body, "window_size": WINDOW})
            next_id += 1

    push({"type": "created", "num_blocks_per_cache_level": [64, 8]}, None, [])
    drained_lazy: list[dict[str, Any]] = []
    drained_eager: list[dict[str, Any]] = []
    for seed, (kind, n) in enumerate(events):
        if kind == "drain":
            drained_lazy += lazy.drain()
            drained_eager += list(eager)
            eager.clear()
            continue
        tokens: list[np.ndarray] | None = None
        cleared: list[int] = []
        if kind == "stored":
            data, tokens = _stored(n, seed)
        elif kind == "removed":
            data = KvRemoved(block_hashes=tuple(range(seed, seed + n)))
        elif kind == "updated":
            data = KvUpdated(block_hashes=tuple(range(seed, seed + n)), tier=1, previous_tier=0)
        else:
            data = KvCleared()
            cleared = [seed, seed + 1]
        lazy.add(data, tokens)
        if kind == "cleared":
            lazy.note_cleared(cleared)
        push(data, tokens, cleared)
        assert len(lazy) == len(eager)
        assert list(lazy) == list(eager)
    drained_lazy += lazy.drain()
    drained_eager += list(eager)
    assert drained_lazy == drained_eager
    assert len(lazy) == 0
    assert list(lazy) == []


def test_an_overflow_shows_as_a_gap_in_the_ids() -> None:
    buffer = TrtllmEventBuffer(maxlen=3, window_size=WINDOW, cache_levels=[8, 0])
    buffer.add(KvUpdated(block_hashes=(1, 2, 3, 4), tier=1, previous_tier=0), None)  # ids 1..4
    buffer.add(KvRemoved(block_hashes=(9,)), None)  # id 5
    drained = buffer.drain()
    assert [e["event_id"] for e in drained] == [3, 4, 5]
    assert [e["data"].get("block_hash") for e in drained[:2]] == [3, 4]  # the oldest blocks' events went
    buffer.add(KvRemoved(block_hashes=(7,)), None)
    assert [e["event_id"] for e in buffer.drain()] == [6]


def test_a_clear_note_needs_its_cleared_event() -> None:
    buffer = TrtllmEventBuffer(maxlen=4, window_size=WINDOW, cache_levels=[8, 0])
    with pytest.raises(ValueError, match="follows the cleared event"):
        buffer.note_cleared([1])
    with pytest.raises(ValueError, match="room for one event"):
        TrtllmEventBuffer(maxlen=0, window_size=WINDOW, cache_levels=[8, 0])
