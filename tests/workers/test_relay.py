"""The KV relay against TensorRT-LLM's event JSON (the shape ``KVCacheEventSerializer`` writes and
``POST /kv_cache_events`` returns, built from its source: no engine was run): translation, lost
events (gaps, a relay started late, unreadable events), unknown types, cascading removals, the
proof that it knows every block again, and a brute-force engine under random faults that it never
publishes a block the engine does not hold."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from copse.api import Role, parse_deployment
from copse.operator import children
from copse.operator.children import GroupLayout
from copse.router.indexer import RadixIndexer
from copse.router.slots import WorkerSlots
from copse.workers.cli import kv_relay
from copse.workers.protocol import (
    KvEvent,
    KvEventBatch,
    KvRemoved,
    KvStored,
    KvUpdated,
    chain_hash,
    chain_hashes,
    tokens_hashes,
)
from copse.workers.relay import KvRelay

BLOCK = 4
WINDOW = 4096


def _tokens(first: int) -> list[dict[str, Any]]:
    return [{"type": "unique_token", "token_id": first + k, "token_extra_id": 0} for k in range(BLOCK)]


def _block(engine_hash: int, first_token: int) -> dict[str, Any]:
    return {
        "type": "stored_block",
        "block_hash": engine_hash,
        "tokens": _tokens(first_token),
        "cache_level": 0,
        "priority": 35,
    }


def _event(event_id: int, data: dict[str, Any]) -> dict[str, Any]:
    return {"event_id": event_id, "data": data, "window_size": WINDOW}


def _created(event_id: int = 0, blocks: int = 64) -> dict[str, Any]:
    return _event(event_id, {"type": "created", "num_blocks_per_cache_level": [blocks, 0]})


def _stored(event_id: int, parent: int | None, *blocks: tuple[int, int]) -> dict[str, Any]:
    data = {"type": "stored", "parent_hash": parent, "blocks": [_block(h, t) for h, t in blocks]}
    return _event(event_id, data)


def _removed(event_id: int, *hashes: int) -> dict[str, Any]:
    return _event(event_id, {"type": "removed", "block_hashes": list(hashes)})


def _updated(event_id: int, engine_hash: int) -> dict[str, Any]:
    diff = {"type": "event_diff", "new_value": 1, "old_value": 0}
    return _event(
        event_id, {"type": "updated", "block_hash": engine_hash, "cache_level": diff, "priority": None}
    )


def _local(first: int) -> int:
    """The copse tokens hash of the block of tokens ``first .. first + BLOCK - 1``."""
    (local,) = tokens_hashes(list(range(first, first + BLOCK)), block_size=BLOCK)
    return local


def _copse(*firsts: int) -> list[int]:
    """Chained copse hashes of consecutive blocks starting at these first tokens."""
    return chain_hashes([_local(first) for first in firsts])


def _relay(**extra: Any) -> tuple[KvRelay, CollectorRegistry]:
    registry = CollectorRegistry()
    return KvRelay(worker_id="pod-0", block_size=BLOCK, epoch=1, registry=registry, **extra), registry


def _types(events: list[KvEvent]) -> list[str]:
    return [e.data.type for e in events]


def _stored_data(event: KvEvent) -> KvStored:
    assert isinstance(event.data, KvStored)
    return event.data


def _removed_hashes(event: KvEvent) -> tuple[int, ...]:
    assert isinstance(event.data, KvRemoved)
    return event.data.block_hashes


def _held(relay: KvRelay) -> set[int]:
    return {block.block_hash for block in relay.dump().blocks}


def _count(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_a_recorded_stream_translates_to_copse_events_and_a_dump() -> None:
    relay, registry = _relay()
    a, b, c = _copse(100, 200, 300)  # one sequence of three blocks
    events = relay.ingest(
        [
            _created(),
            _stored(1, None, (9001, 100), (9002, 200)),
            _stored(2, 9002, (9003, 300)),  # the parent is an engine hash
            _updated(3, 9001),  # offloaded to host memory: still held, on tier 1
            _removed(4, 9003),
        ]
    )
    assert _types(events) == ["reset", "cleared", "stored", "stored", "updated", "removed"]
    assert [e.event_id for e in events] == [1, 2, 3, 4, 5, 6]
    stored = _stored_data(events[3])
    assert stored.parent_hash == b
    assert [blk.block_hash for blk in stored.blocks] == [c]
    assert events[4].data == KvUpdated(block_hashes=(a,), tier=1, previous_tier=0)
    assert _removed_hashes(events[5]) == (c,)
    dump = relay.dump()
    assert dump.exact
    assert dump.last_event_id == 6
    assert [(blk.block_hash, blk.parent_hash, blk.tier) for blk in dump.blocks] == [(a, None, 1), (b, a, 0)]
    assert _count(registry, "copse_kv_relay_engine_events_total", type="updated") == 1
    assert _count(registry, "copse_kv_relay_exact") == 1


def test_a_gap_resets_and_the_relay_never_names_a_block_it_may_have_lost() -> None:
    relay, registry = _relay()
    a, b, c = _copse(100, 200, 300)
    d = _copse(100, 200, 400)[2]  # a branch after b
    relay.ingest([_created(), _stored(1, None, (9001, 100), (9002, 200), (9003, 300))])
    # events 2..4 were dropped by the engine's full buffer (one of them may have removed 9003)
    events = relay.ingest([_stored(5, None, (9010, 700))])
    assert _types(events) == ["reset", "stored"]
    assert not relay.exact
    dump = relay.dump()
    assert not dump.exact
    assert _held(relay) == set(_copse(700))
    assert _count(registry, "copse_kv_relay_resets_total", reason="gap") == 1
    # a stored block below a forgotten one: the engine holds its ancestors, they are named again
    events = relay.ingest([_stored(6, 9002, (9004, 400))])
    assert _types(events) == ["stored", "stored"]
    assert [blk.block_hash for blk in _stored_data(events[0]).blocks] == [a, b]
    assert _stored_data(events[1]).parent_hash == b
    assert _held(relay) == {a, b, d, *_copse(700)}
    # the removal of a forgotten block is still translated (a router may have guessed it)
    events = relay.ingest([_removed(7, 9003)])
    assert _types(events) == ["removed"]
    assert _removed_hashes(events[0]) == (c,)


def test_unknown_event_types_are_skipped_alone_and_their_ids_count() -> None:
    relay, registry = _relay()
    future = _event(2, {"type": "migrated", "block_hash": 9001, "to": "cpu"})
    events = relay.ingest([_created(), _stored(1, None, (9001, 100)), future, _removed(3, 9001)])
    assert _types(events) == ["reset", "cleared", "stored", "removed"]  # no reset for the skipped one
    assert relay.exact
    assert _count(registry, "copse_kv_relay_engine_events_total", type="unknown") == 1


def test_an_unreadable_event_of_a_known_type_counts_as_lost() -> None:
    relay, registry = _relay()
    broken = _event(2, {"type": "removed", "block_hashes": "all"})
    events = relay.ingest([_created(), _stored(1, None, (9001, 100)), broken, {"data": {}}])
    assert _types(events) == ["reset", "cleared", "stored", "reset"]
    assert _held(relay) == set()
    assert _count(registry, "copse_kv_relay_resets_total", reason="malformed") == 2


def test_a_removal_takes_the_blocks_below_with_it() -> None:
    # Recent engines send one event for a block whose descendants they free with it.
    relay, _ = _relay()
    relay.ingest([_created(), _stored(1, None, (9001, 100), (9002, 200)), _stored(2, 9001, (9005, 500))])
    events = relay.ingest([_removed(3, 9001)])
    assert sorted(_removed_hashes(events[0])) == sorted([*_copse(100, 200), *_copse(100, 500)[1:]])
    assert _held(relay) == set()
    # a later store of the same first block must not bring the old descendants back
    relay.ingest([_stored(4, None, (9001, 100))])
    assert _held(relay) == set(_copse(100))


def test_a_relay_started_late_proves_it_knows_everything_once_enough_blocks_left() -> None:
    relay, _ = _relay(capacity_blocks=3)  # the engine holds at most 3 blocks
    events = relay.ingest([_stored(40, None, (9001, 100))])
    assert _types(events) == ["reset", "stored"]  # ids did not start at 0: started after the engine
    relay.ingest([_removed(41, 7001), _removed(42, 7002)])
    assert not relay.exact
    events = relay.ingest([_removed(43, 7003)])  # 3 unknown blocks gone: nothing unknown is left
    assert _types(events) == ["exact"]
    assert relay.exact
    assert relay.dump().exact


def test_a_relay_restarted_mid_run_knows_every_block_again_from_the_operators_capacity() -> None:
    """The relay the operator runs next to an engine with a host tier: restarted mid-run, it proves
    it knows every block once as many unknown blocks left as the engine's GPU *and* host pools
    hold (a block offloaded to host memory is still held; its eviction there is a removal)."""
    body = {
        "apiVersion": "copse.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "llama", "namespace": "serving", "uid": "u", "generation": 1},
        "spec": {
            "model": {"name": "m", "kvBytesPerToken": 64},
            "engine": {"blockSize": BLOCK, "kvCacheOffload": {"hostMemory": "2Ki"}},
            "router": {"natsUrl": "nats://nats:4222", "kvCapacityTokens": 16 * BLOCK},
        },
    }
    deployment = parse_deployment(body, source="test")
    layout = GroupLayout(role=Role.WORKER, replica=0, pods=(("gpu-a", 1),), domain=None, rack=None, cost=0.0)
    [pod] = children.worker_pods(deployment, layout, cold_start_source=None)
    [sidecar] = pod["spec"]["initContainers"]
    params = kv_relay.make_context("kv-relay", sidecar["command"][3:]).params
    gpu, host = 16, 2048 // (BLOCK * 64)  # hostMemory over a block's bytes
    assert params["kv_capacity_blocks"] == gpu + host
    # the engine holds 24 blocks the relay never saw stored: 8 of them went to host memory, then
    # the engine evicts them all, with consecutive event ids
    held = list(range(9001, 9001 + gpu + host))
    offloads = [_updated(500 + k, engine_hash) for k, engine_hash in enumerate(held[:host])]
    removals = [_removed(500 + host + k, engine_hash) for k, engine_hash in enumerate(held)]
    relay, _ = _relay(capacity_blocks=params["kv_capacity_blocks"])
    relay.ingest(offloads)
    assert not relay.exact
    assert "exact" not in _types(relay.ingest(removals[:-1]))
    assert _types(relay.ingest(removals[-1:])) == ["exact"]
    assert relay.dump().exact
    # a bound of the GPU pool alone would claim it with 8 blocks still held in host memory
    gpu_only, _ = _relay(capacity_blocks=gpu)
    gpu_only.ingest(offloads)
    assert "exact" in _types(gpu_only.ingest(removals[:gpu]))
    assert relay.dump().exact


def test_an_engine_restart_whose_created_event_was_dropped_is_lost_track() -> None:
    relay, registry = _relay()
    relay.ingest([_created(), _stored(1, None, (9001, 100))])
    relay.engine_unreachable()  # the engine restarted; its buffer overflowed before the next poll
    events = relay.ingest([_stored(2, None, (9002, 200))])  # ids that happen to follow on
    assert _types(events) == ["reset", "stored"]
    assert _held(relay) == set(_copse(200))
    assert _count(registry, "copse_kv_relay_resets_total", reason="restart") == 1


def test_an_engine_restart_clears_everything_and_is_exact() -> None:
    relay, _ = _relay()
    relay.ingest([_created(), _stored(1, None, (9001, 100))])
    relay.ingest([_stored(9, None, (9002, 200))])  # a gap
    assert not relay.exact
    events = relay.ingest([_created(), _stored(1, None, (9003, 300))])
    assert _types(events) == ["cleared", "stored"]
    assert relay.exact
    assert _held(relay) == set(_copse(300))


# -- a brute-force engine under random faults ------------------------------------------------------


@dataclasses.dataclass
class _EngineBlock:
    parent: int | None
    first_token: int
    copse: int


class _Engine:
    """What TensorRT-LLM's block manager does, as far as its events go: a radix tree of blocks of
    at most ``capacity``, numbered events (``created`` 0 first) into a buffer that drops its oldest
    beyond ``buffer`` events, removal events for the freed block only (recent engines) or for every
    descendant too (older ones)."""

    def __init__(self, *, capacity: int, buffer: int, cascade_in_one_event: bool) -> None:
        self.capacity = capacity
        self.cascade_in_one_event = cascade_in_one_event
        self.buffer: deque[dict[str, Any]] = deque(maxlen=buffer)
        self.blocks: dict[int, _EngineBlock] = {}
        self.next_id = 0
        self.next_token = 1000
        self._emit({"type": "created", "num_blocks_per_cache_level": [capacity, 0]})

    def held(self) -> set[int]:
        return {block.copse for block in self.blocks.values()}

    def _emit(self, data: dict[str, Any]) -> None:
        self.buffer.append(_event(self.next_id, data))
        self.next_id += 1

    def _subtree(self, engine_hash: int) -> list[int]:
        order, stack = [], [engine_hash]
        while stack:
            current = stack.pop()
            order.append(current)
            stack.extend(h for h, b in self.blocks.items() if b.parent == current)
        return order[::-1]  # descendants first

    def path(self, engine_hash: int) -> list[int]:
        """Copse hashes of the blocks from the first to ``engine_hash``."""
        out: list[int] = []
        cursor: int | None = engine_hash
        while cursor is not None:
            out.append(self.blocks[cursor].copse)
            cursor = self.blocks[cursor].parent
        return out[::-1]

    def store(self, parent_pick: int, length: int) -> None:
        """``length`` new blocks after a held block (or a new sequence), evicting leaves for room."""
        length = min(length, self.capacity)
        while len(self.blocks) + length > self.capacity:
            leaves = [h for h in self.blocks if not any(b.parent == h for b in self.blocks.values())]
            self.evict(min(leaves))
        parents = [None, *sorted(self.blocks)]
        parent = parents[parent_pick % len(parents)]
        previous = parent
        copse_parent = None if parent is None else self.blocks[parent].copse
        stored = []
        for _ in range(length):
            first = self.next_token
            self.next_token += BLOCK
            copse = chain_hash(copse_parent, _local(first))
            engine_hash = (hash((previous, first)) & (2**63 - 1)) | 1  # opaque to copse
            self.blocks[engine_hash] = _EngineBlock(previous, first, copse)
            stored.append(_block(engine_hash, first))
            previous, copse_parent = engine_hash, copse
        self._emit({"type": "stored", "parent_hash": parent, "blocks": stored})

    def evict(self, engine_hash: int) -> None:
        gone = self._subtree(engine_hash)
        for h in gone:
            del self.blocks[h]
        self._emit({"type": "removed", "block_hashes": [engine_hash] if self.cascade_in_one_event else gone})

    def update(self, pick: int) -> None:
        if self.blocks:
            engine_hash = sorted(self.blocks)[pick % len(self.blocks)]
            diff = {"type": "event_diff", "new_value": 1, "old_value": 0}
            self._emit({"type": "updated", "block_hash": engine_hash, "cache_level": diff, "priority": None})

    def unknown(self) -> None:
        self._emit({"type": "some_future_kind"})

    def restart(self) -> None:
        self.buffer.clear()  # undrained events die with the old process
        self.blocks.clear()
        self.next_id = 0
        self._emit({"type": "created", "num_blocks_per_cache_level": [self.capacity, 0]})

    def drain(self) -> list[dict[str, Any]]:
        events = list(self.buffer)
        self.buffer.clear()
        return events


# Engine activity is the common case; faults are rarer (but every example has tens of operations).
_KINDS = ["store"] * 4 + ["evict"] * 3 + ["drain"] * 3 + ["route"] * 2
_KINDS += ["update", "unknown", "dump", "relay_restart", "engine_restart"]
_ops = st.lists(
    st.tuples(st.sampled_from(_KINDS), st.integers(0, 50), st.integers(1, 4)), min_size=10, max_size=80
)


@settings(max_examples=300, deadline=None)
@given(
    ops=_ops,
    capacity=st.integers(4, 24),
    buffer=st.integers(2, 40),
    cascade_in_one_event=st.booleans(),
    capacity_known=st.booleans(),
)
def test_no_phantom_blocks_under_lost_events_restarts_and_unknown_types(
    ops: list[tuple[str, int, int]],
    capacity: int,
    buffer: int,
    cascade_in_one_event: bool,
    capacity_known: bool,
) -> None:
    """Against the engine's own blocks as of the last drain: the relay names only blocks the engine
    holds (all of them while exact), and the router reports exactly what the relay names, plus,
    while it is approximate, only guesses of blocks routed to the worker."""
    engine = _Engine(capacity=capacity, buffer=buffer, cascade_in_one_event=cascade_in_one_event)
    slots = WorkerSlots()
    router = RadixIndexer(slots, default_capacity_blocks=capacity)
    epochs = iter(range(1, 1000))
    universe: set[int] = set()
    routed: set[int] = set()  # blocks routed to the worker since the router last dropped its guesses
    drained: set[int] = set()  # what the engine held at the last drain

    def new_relay() -> KvRelay:
        return KvRelay(
            worker_id="w",
            block_size=BLOCK,
            epoch=next(epochs),
            capacity_blocks=capacity if capacity_known else None,
        )

    def deliver(relay: KvRelay, events: list[KvEvent]) -> None:
        if any(e.data.type in ("reset", "cleared", "exact") for e in events):
            routed.clear()
        if events:
            assert router.apply(KvEventBatch(worker_id="w", epoch=relay.epoch, events=tuple(events))) is None

    relay = new_relay()
    deliver(relay, relay.ingest([]))
    slot = slots.slot("w")
    for kind, pick, length in ops:
        if kind == "store":
            engine.store(pick, length)
        elif kind == "evict" and engine.blocks:
            engine.evict(sorted(engine.blocks)[pick % len(engine.blocks)])
        elif kind == "update":
            engine.update(pick)
        elif kind == "unknown":
            engine.unknown()
        elif kind == "drain":
            drained = engine.held()
            deliver(relay, relay.ingest(engine.drain()))
        elif kind == "route" and engine.blocks:
            path = engine.path(sorted(engine.blocks)[pick % len(engine.blocks)])
            router.on_routed(slot, path, total_blocks=len(path))
            routed.update(path)
        elif kind == "dump":
            assert router.load_dump(relay.dump()) is None
            routed.clear()
        elif kind == "relay_restart":
            relay = new_relay()
            deliver(relay, relay.ingest([]))
        elif kind == "engine_restart":
            engine.restart()
            relay.engine_unreachable()  # what its polls meanwhile find: nothing listening
        known = _held(relay)
        universe |= engine.held() | known | routed
        reported = {h for h in universe if router.index.holds(slot, h)}
        assert known <= drained
        if relay.exact:
            assert known == drained
        assert router.approximate(slot) == (not relay.exact)
        if router.approximate(slot):
            assert known <= reported <= known | routed
        else:
            assert reported == known
    event("ended exact" if relay.exact else "ended approximate")
