"""The radix indexer: prefix matching against a brute-force reference, event ordering, resync,
cache tiers."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from copse.router.indexer import BlockIndex, RadixIndexer
from copse.router.slots import WorkerSlots
from copse.workers.protocol import (
    DumpBlock,
    KvCleared,
    KvDump,
    KvEvent,
    KvEventBatch,
    KvRemoved,
    KvStored,
    KvUpdated,
    StoredBlock,
    block_hashes,
    chain_hashes,
)

from .conftest import leading_blocks_reference

# A small universe of prompts sharing prefixes: each path is a chain of block hashes.
_PATHS = [chain_hashes(list(p)) for p in ([1, 2, 3, 4], [1, 2, 5], [1, 6, 7, 8, 9], [10, 11], [1, 2, 3, 12])]
_BLOCKS = sorted({h for path in _PATHS for h in path})


_op = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 5), st.sampled_from(_PATHS), st.integers(0, 4)),
    st.tuples(st.just("remove"), st.integers(0, 5), st.lists(st.sampled_from(_BLOCKS), max_size=4)),
    st.tuples(st.just("clear"), st.integers(0, 5)),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, max_size=60), query=st.sampled_from(_PATHS))
def test_block_index_matches_brute_force_reference(ops: list[tuple[Any, ...]], query: list[int]) -> None:
    index = BlockIndex()
    held: dict[int, set[int]] = {}
    for op in ops:
        kind, slot = op[0], op[1]
        if kind == "store":
            path, start = op[2], op[3]
            index.store(slot, path[start:])
            held.setdefault(slot, set()).update(path[start:])
        elif kind == "remove":
            index.remove(slot, op[2])
            held.setdefault(slot, set()).difference_update(op[2])
        else:
            index.clear(slot)
            held[slot] = set()
    assert index.overlaps(query) == leading_blocks_reference(held, query)
    for slot, blocks in held.items():
        assert index.blocks_held(slot) == len(blocks)
    assert len(index) == len(set().union(*held.values())) if held else len(index) == 0


def test_a_worker_counts_only_up_to_its_first_missing_block() -> None:
    index = BlockIndex()
    path = _PATHS[0]
    index.store(0, path)
    index.store(1, [path[0], path[2], path[3]])  # holds later blocks but not block 1
    index.store(2, path[:2])
    assert index.overlaps(path) == {0: 4, 1: 1, 2: 2}
    assert index.overlaps([]) == {}
    assert index.overlaps(chain_hashes([99])) == {}


def test_prompt_hashes_match_the_engines_hashes() -> None:
    tokens = list(range(100, 164))
    index = BlockIndex()
    index.store(3, block_hashes(tokens[:48], block_size=16))
    assert index.overlaps(block_hashes(tokens, block_size=16)) == {3: 3}


def _stored(event_id: int, parent: int | None, hashes: list[int]) -> KvEvent:
    blocks = tuple(StoredBlock(block_hash=h, tokens_hash=h) for h in hashes)
    return KvEvent(event_id=event_id, data=KvStored(parent_hash=parent, blocks=blocks))


def _batch(worker: str, epoch: int, *events: KvEvent) -> KvEventBatch:
    return KvEventBatch(worker_id=worker, epoch=epoch, events=events)


def test_events_in_order_are_applied() -> None:
    indexer = RadixIndexer(WorkerSlots(), default_capacity_blocks=1024)
    path = _PATHS[2]
    assert indexer.apply(_batch("w", 7, _stored(1, None, path[:2]), _stored(2, path[1], path[2:]))) is None
    slot = indexer.slots.slot("w")
    assert indexer.overlaps(path) == {slot: 5}
    assert indexer.apply(_batch("w", 7, KvEvent(event_id=3, data=KvRemoved(block_hashes=(path[3],))))) is None
    assert indexer.overlaps(path) == {slot: 3}
    assert indexer.apply(_batch("w", 7, KvEvent(event_id=4, data=KvCleared()))) is None
    assert indexer.overlaps(path) == {}
    assert indexer.last_event_id("w") == 4


def test_updated_events_move_blocks_between_tiers_and_dumps_carry_the_tiers() -> None:
    indexer = RadixIndexer(WorkerSlots(), default_capacity_blocks=1024)
    path = _PATHS[2]
    indexer.apply(_batch("w", 7, _stored(1, None, path)))
    slot = indexer.slots.slot("w")
    down = KvUpdated(block_hashes=tuple(path[2:]), tier=1, previous_tier=0)
    deeper = KvUpdated(block_hashes=(path[4],), tier=2, previous_tier=1)
    indexer.apply(_batch("w", 7, KvEvent(event_id=2, data=down), KvEvent(event_id=3, data=deeper)))
    assert [indexer.index.tier(slot, h) for h in path] == [0, 0, 1, 1, 2]
    assert indexer.overlaps(path) == {slot: 5}  # a block below the GPU is still held
    out = np.empty((3, slot + 1))
    indexer.index.leading_tiers(path, out)
    assert out[:, slot].tolist() == [5.0, 2.0, 1.0]
    back = KvUpdated(block_hashes=(path[2],), tier=0, previous_tier=1)
    indexer.apply(_batch("w", 7, KvEvent(event_id=4, data=back)))
    assert [indexer.index.tier(slot, h) for h in path] == [0, 0, 0, 1, 2]
    # a dump replaces the tiers with its own
    dump = KvDump(
        worker_id="w",
        epoch=7,
        block_size=16,
        last_event_id=9,
        blocks=tuple(DumpBlock(h, None, 1, tier) for h, tier in zip(path[:3], [0, 1, 2], strict=True)),
    )
    indexer.load_dump(dump)
    assert [indexer.index.tier(slot, h) for h in path] == [0, 1, 2, -1, -1]


def test_duplicates_are_skipped_and_a_gap_asks_for_a_dump_then_buffers() -> None:
    indexer = RadixIndexer(WorkerSlots(), default_capacity_blocks=1024)
    path = _PATHS[0]
    indexer.apply(_batch("w", 1, _stored(1, None, path[:1])))
    assert indexer.apply(_batch("w", 1, _stored(1, None, path[:1]))) is None
    assert indexer.stats["duplicates"] == 1
    resync = indexer.apply(_batch("w", 1, _stored(3, path[1], path[2:3])))
    assert resync is not None
    assert (resync.worker_id, resync.epoch, resync.reason) == ("w", 1, "gap")
    assert indexer.awaiting_dump("w")
    assert indexer.overlaps(path) == {}  # what was known is dropped, not trusted
    indexer.apply(_batch("w", 1, _stored(4, path[2], path[3:4])))  # buffered meanwhile
    dump = KvDump(
        worker_id="w",
        epoch=1,
        block_size=16,
        last_event_id=2,
        blocks=(
            DumpBlock(block_hash=path[0], parent_hash=None, tokens_hash=1),
            DumpBlock(block_hash=path[1], parent_hash=path[0], tokens_hash=2),
        ),
    )
    assert indexer.load_dump(dump) is None
    assert not indexer.awaiting_dump("w")
    assert indexer.overlaps(path) == {indexer.slots.slot("w"): 4}  # dump + buffered events 3 and 4
    assert indexer.last_event_id("w") == 4


def test_a_worker_first_seen_mid_stream_needs_a_dump() -> None:
    indexer = RadixIndexer(WorkerSlots(), default_capacity_blocks=1024)
    resync = indexer.apply(_batch("late", 5, _stored(40, None, _PATHS[3][:1])))
    assert resync is not None
    assert resync.reason == "new-worker"
    assert indexer.overlaps(_PATHS[3]) == {}


def test_a_new_epoch_starting_at_one_replaces_the_old_state_and_stale_epochs_are_ignored() -> None:
    indexer = RadixIndexer(WorkerSlots(), default_capacity_blocks=1024)
    indexer.apply(_batch("w", 1, _stored(1, None, _PATHS[0])))
    assert indexer.apply(_batch("w", 2, _stored(1, None, _PATHS[3]))) is None
    slot = indexer.slots.slot("w")
    assert indexer.overlaps(_PATHS[0]) == {}
    assert indexer.overlaps(_PATHS[3]) == {slot: 2}
    assert indexer.apply(_batch("w", 1, _stored(2, None, _PATHS[0]))) is None
    assert indexer.overlaps(_PATHS[0]) == {}
    resync = indexer.apply(_batch("w", 3, _stored(9, None, _PATHS[0])))
    assert resync is not None
    assert resync.reason == "new-epoch"


def test_an_old_dump_does_not_roll_back_newer_events() -> None:
    indexer = RadixIndexer(WorkerSlots(), default_capacity_blocks=1024)
    indexer.apply(_batch("w", 1, _stored(1, None, _PATHS[0][:1]), _stored(2, _PATHS[0][0], _PATHS[0][1:2])))
    old = KvDump(worker_id="w", epoch=1, block_size=16, last_event_id=1, blocks=())
    assert indexer.load_dump(old) is None
    assert indexer.overlaps(_PATHS[0]) == {indexer.slots.slot("w"): 2}


def test_forgetting_a_worker_frees_its_blocks() -> None:
    slots = WorkerSlots()
    indexer = RadixIndexer(slots, default_capacity_blocks=1024)
    indexer.apply(_batch("a", 1, _stored(1, None, _PATHS[0])))
    indexer.apply(_batch("b", 1, _stored(1, None, _PATHS[0][:2])))
    indexer.forget("a")
    assert indexer.overlaps(_PATHS[0]) == {slots.slot("b"): 2}
    assert indexer.last_event_id("a") is None


@settings(max_examples=200, deadline=None)
@given(
    holdings=st.lists(st.tuples(st.integers(0, 70), st.sampled_from(_PATHS), st.integers(1, 5)), max_size=80),
    query=st.sampled_from(_PATHS),
)
def test_overlap_array_equals_the_mapping(
    holdings: list[tuple[int, list[int], int]], query: list[int]
) -> None:
    index = BlockIndex()
    for slot, path, length in holdings:
        index.store(slot, path[:length])
    array = index.overlap_array(query, 71)
    mapping = index.overlaps(query)
    assert {slot: int(depth) for slot, depth in enumerate(array) if depth} == mapping
