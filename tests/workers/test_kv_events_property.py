"""The KV events an engine emits, replayed into an empty index, reproduce exactly what it holds and
on which tier of its cache (GPU, host memory, disk) -- under eviction, offload, onboarding,
preemption, aborts and resets -- and so do its dump and its TensorRT-LLM drain."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import event, given, settings
from hypothesis import strategies as st

from copse.workers.mocker import Engine, EngineConfig, Simulator, StepOutput
from copse.workers.mocker.blocks import trusted_model
from copse.workers.perf import PolynomialPerfModel
from copse.workers.protocol import KvEvent, KvRemoved, KvStored, StoredBlock, tokens_hashes

BLOCK = 4


class Index:
    """The simplest subscriber: block hash -> parent hash and tier, checked for consistency as it goes."""

    def __init__(self) -> None:
        self.blocks: dict[int, int | None] = {}
        self.tiers: dict[int, int] = {}

    def apply(self, events: list[KvEvent]) -> None:
        for ev in events:
            data = ev.data
            if data.type == "stored":
                parent = data.parent_hash
                assert parent is None or parent in self.blocks, "stored after an unknown parent"
                for block in data.blocks:
                    assert block.block_hash not in self.blocks, "stored twice without removal"
                    self.blocks[block.block_hash] = parent
                    self.tiers[block.block_hash] = 0
                    parent = block.block_hash
            elif data.type == "removed":
                for block_hash in data.block_hashes:
                    assert block_hash in self.blocks, "removed a block never stored"
                    del self.blocks[block_hash]
                    del self.tiers[block_hash]
            elif data.type == "updated":
                assert data.tier != data.previous_tier
                for block_hash in data.block_hashes:
                    assert self.tiers[block_hash] == data.previous_tier, "moved from a tier it was not on"
                    self.tiers[block_hash] = data.tier
            else:
                assert data.type == "cleared"
                self.blocks.clear()
                self.tiers.clear()


@dataclass
class Op:
    kind: str  # "add" | "abort" | "reset" | "wait"
    prefix: int = 0
    own: int = 0
    out: int = 1
    dt: float = 0.0


ops = st.lists(
    st.one_of(
        st.builds(
            Op,
            kind=st.just("add"),
            prefix=st.integers(0, 3),
            own=st.integers(1, 40),
            out=st.integers(1, 30),
            dt=st.floats(0, 30),
        ),
        st.builds(Op, kind=st.just("abort"), prefix=st.integers(0, 50)),
        st.builds(Op, kind=st.just("reset")),
        st.builds(Op, kind=st.just("wait"), dt=st.floats(0, 200)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    num_blocks=st.integers(12, 40),
    seed=st.integers(0, 2**32),
    tiers=st.sampled_from([(0, 0), (8, 0), (30, 0), (6, 10), (20, 40)]),
)
def test_events_replay_to_the_cache_contents(
    ops: list[Op], num_blocks: int, seed: int, tiers: tuple[int, int]
) -> None:
    host_blocks, disk_blocks = tiers
    engine = Engine(
        worker_id="w",
        config=EngineConfig(
            block_size=BLOCK,
            num_blocks=num_blocks,
            max_num_batched_tokens=48,
            seed=seed,
            kv_bytes_per_token=1,  # one block: BLOCK bytes
            host_cache_bytes=host_blocks * BLOCK,
            disk_cache_bytes=disk_blocks * BLOCK,
        ),
        perf=PolynomialPerfModel(),
        trtllm_event_buffer=100_000,
    )
    index = Index()
    trtllm: dict[int, int] = {}
    stats = {"preempted": 0, "evicted": 0, "offloaded": 0, "onboarded": 0}

    def matches(index: Index) -> None:
        blocks = engine.blocks
        assert set(index.blocks) == blocks.cached_hashes()
        assert index.tiers == {h: blocks.tier_of(h) for h in index.blocks}
        host, disk = blocks.lower
        assert len(host) <= host_blocks
        assert len(disk) <= disk_blocks

    def apply(events: list[KvEvent]) -> None:
        stats["evicted"] += sum(len(e.data.block_hashes) for e in events if e.data.type == "removed")
        for e in events:
            if e.data.type == "updated":
                stats["offloaded" if e.data.tier else "onboarded"] += len(e.data.block_hashes)
        index.apply(events)

    def check(_: int, out: StepOutput) -> None:
        stats["preempted"] += len(out.preempted)
        apply(engine.drain_kv_events())
        matches(index)
        for request in engine.running:
            assert all(engine.blocks.active[h] > 0 for h in request.blocks)
        assert engine.blocks.free_blocks >= 0

    sim = Simulator([engine], on_step=check)
    prefixes = [[1000 + 97 * p + i for i in range(12)] for p in range(4)]
    submitted = 0
    for op in ops:
        if op.kind == "add":
            tokens = prefixes[op.prefix] + [5000 + submitted * 50 + i for i in range(op.own)]
            if len(tokens) + op.out <= num_blocks * BLOCK:
                sim.submit(0, request_id=f"r{submitted}", tokens=tokens, max_tokens=op.out)
                submitted += 1
            sim.run_until(sim.now_ms + op.dt)
        elif op.kind == "abort":
            engine.abort_request(f"r{op.prefix}")
        elif op.kind == "reset":
            engine.reset_prefix_cache()
        else:
            sim.run_until(sim.now_ms + op.dt)
        apply(engine.drain_kv_events())
        matches(index)
    sim.run()
    apply(engine.drain_kv_events())
    held = engine.blocks.cached_hashes()
    matches(index)
    assert sum(engine.onboarded_blocks_total) == stats["onboarded"]

    # a dump replayed into an empty index gives the same blocks on the same tiers, parents first
    dump = engine.dump_kv()
    assert dump.last_event_id == engine.last_event_id
    seen: set[int] = set()
    for block in dump.blocks:
        assert block.parent_hash is None or block.parent_hash in seen or block.parent_hash not in held
        assert block.tier == index.tiers[block.block_hash]
        seen.add(block.block_hash)
    assert seen == held

    # the TensorRT-LLM drain tells the same story, and its tokens hash to the advertised blocks
    assert engine.trtllm_events is not None
    ids_seen = [raw["event_id"] for raw in engine.trtllm_events]
    assert ids_seen == list(range(len(ids_seen)))
    levels = next(iter(engine.trtllm_events))["data"]["num_blocks_per_cache_level"]
    assert levels[:2] == [num_blocks, host_blocks]
    assert levels[2:] == ([disk_blocks] if disk_blocks else [])
    for raw in list(engine.trtllm_events)[1:]:
        data = raw["data"]
        if data["type"] == "stored":
            for block in data["blocks"]:
                assert block["cache_level"] == 0
                trtllm[block["block_hash"]] = 0
                ids = [t["token_id"] for t in block["tokens"]]
                assert len(ids) == BLOCK
        elif data["type"] == "removed":
            for block_hash in data["block_hashes"]:
                del trtllm[block_hash]
        else:
            assert data["type"] == "updated"
            diff = data["cache_level"]
            assert diff["type"] == "event_diff"
            assert trtllm[data["block_hash"]] == diff["old_value"]
            trtllm[data["block_hash"]] = diff["new_value"]
    assert trtllm == index.tiers
    event("preempted" if stats["preempted"] else "no preemption")
    event("evicted" if stats["evicted"] else "no eviction")
    event("offloaded" if stats["offloaded"] else "no offload")
    event("onboarded" if stats["onboarded"] else "no onboarding")


def test_trtllm_stored_tokens_hash_to_the_copse_tokens_hash() -> None:
    engine = Engine(
        worker_id="w",
        config=EngineConfig(block_size=BLOCK, num_blocks=64),
        perf=PolynomialPerfModel(),
        trtllm_event_buffer=64,
    )
    sim = Simulator([engine])
    sim.submit(0, request_id="r", tokens=list(range(300, 330)), max_tokens=9)
    sim.run()
    copse = [e for e in engine.drain_kv_events() if e.data.type == "stored"]
    assert engine.trtllm_events is not None
    raw = [e for e in engine.trtllm_events if e["data"]["type"] == "stored"]
    assert [e["event_id"] for e in raw] == [e.event_id for e in copse]
    for ours, theirs in zip(copse, raw, strict=True):
        assert ours.data.type == "stored"
        for block, raw_block in zip(ours.data.blocks, theirs["data"]["blocks"], strict=True):
            ids = [t["token_id"] for t in raw_block["tokens"]]
            assert tokens_hashes(ids, block_size=BLOCK) == [block.tokens_hash]
    created = next(iter(engine.trtllm_events))["data"]
    assert created == {"type": "created", "num_blocks_per_cache_level": [64, 0]}


def test_trusted_events_are_what_model_construct_builds() -> None:
    stored_values = {"type": "stored", "parent_hash": 7, "blocks": (StoredBlock(1, 2), StoredBlock(3, 4))}
    data = KvStored.model_construct(**stored_values)  # type: ignore[arg-type]
    pairs = [
        (
            trusted_model(KvStored, dict(stored_values), frozenset(("type", "parent_hash", "blocks"))),
            data,
        ),
        (
            trusted_model(
                KvRemoved, {"type": "removed", "block_hashes": (5, 6)}, frozenset(("block_hashes",))
            ),
            KvRemoved.model_construct(block_hashes=(5, 6)),
        ),
    ]
    pairs.append(
        (
            trusted_model(KvEvent, {"event_id": 3, "data": data}, frozenset(("event_id", "data"))),
            KvEvent.model_construct(event_id=3, data=data),
        )
    )
    for ours, theirs in pairs:
        assert type(ours) is type(theirs)
        assert ours == theirs
        assert ours.__getstate__() == theirs.__getstate__()
        assert ours.model_dump_json() == theirs.model_dump_json()
        assert ours.model_dump(exclude_unset=True) == theirs.model_dump(exclude_unset=True)
