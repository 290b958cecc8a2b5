"""The routing loops, compiled (``_native.c``) and in Python (``_pyloops``), against brute-force
references and each other: the block table under churn (with blocks moving between cache tiers),
the prefix walk and the tiers of its blocks, the load table's
per-worker figures and block references, the TTFT arithmetic (to the bit), the pick, and hashes
whose ``__index__`` mutates the list being read (a use-after-free in the compiled reader once;
``make asan`` runs this file against an AddressSanitizer build)."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from copse.router import _pyloops, loops
from copse.router.indexer import BlockIndex
from copse.workers.protocol import chain_hashes

from .conftest import leading_blocks_reference

# The loops this process runs (the compiled ones unless COPSE_ROUTER_NATIVE says otherwise) and
# the Python ones.
IMPLEMENTATIONS = [pytest.param(loops.MODULE, id=loops.IMPLEMENTATION)]
if loops.MODULE is not _pyloops:
    IMPLEMENTATIONS.append(pytest.param(_pyloops, id="python"))


def _overlaps(index: Any, hashes: list[int]) -> dict[int, int]:
    depths = np.empty(index.slot_limit)
    index.leading_blocks(hashes, depths)
    return {slot: int(depth) for slot, depth in enumerate(depths) if depth}


_PATH = chain_hashes([1, 2, 3, 4])


def test_a_worker_counts_up_to_its_first_missing_block() -> None:
    index = BlockIndex()
    # slot 0 holds the whole path, slot 1 its first two blocks, slot 2 the first and third (a
    # gap), slot 3 all but the first (nothing usable), slot 9 the whole path but is not asked about
    index.store(0, _PATH)
    index.store(1, _PATH[:2])
    index.store(2, [_PATH[0], _PATH[2]])
    index.store(3, _PATH[1:])
    index.store(9, _PATH)
    assert index.overlap_array(_PATH, 4).tolist() == [4.0, 2.0, 1.0, 0.0]
    assert index.overlap_array(chain_hashes([9]), 4).tolist() == [0.0] * 4
    assert index.overlap_array([], 4).tolist() == [0.0] * 4
    assert index.overlap_array(_PATH, 0).tolist() == []
    assert index.overlaps(_PATH) == {0: 4, 1: 2, 2: 1, 9: 4}


# Keys: many small integers (their table positions collide often) and a few extremes.
_keys = st.one_of(st.integers(0, 3000), st.sampled_from([0, 2**63, 2**64 - 1]))
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 200), st.lists(_keys, max_size=40)),
        st.tuples(st.just("remove"), st.integers(0, 200), st.lists(_keys, max_size=40)),
        st.tuples(st.just("clear"), st.integers(0, 200), st.just([])),
        st.tuples(
            st.sampled_from(["tier0", "tier1", "tier2"]), st.integers(0, 200), st.lists(_keys, max_size=40)
        ),
    ),
    max_size=80,
)


def _tiered_reference(
    tiers: dict[int, dict[int, int]], hashes: list[int], size: int
) -> tuple[list[float], list[float], list[float]]:
    """Brute force: per slot below ``size``, its leading blocks of ``hashes`` and how many of them
    it keeps on tier 1 and on tier 2 (``tiers``: slot -> block -> tier)."""
    depth, host, disk = [0.0] * size, [0.0] * size, [0.0] * size
    for slot, blocks in tiers.items():
        if slot >= size:
            continue
        for block in hashes:
            if block not in blocks:
                break
            depth[slot] += 1
            host[slot] += blocks[block] == 1
            disk[slot] += blocks[block] == 2
    return depth, host, disk


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@settings(max_examples=300, deadline=None)
@given(ops=_ops, query=st.lists(_keys, max_size=12))
def test_block_table_under_churn_matches_sets(
    impl: ModuleType, ops: list[tuple[str, int, list[int]]], query: list[int]
) -> None:
    index = impl.BlockIndex()
    tiers: dict[int, dict[int, int]] = {}
    for kind, slot, keys in ops:
        blocks = tiers.setdefault(slot, {})
        if kind == "store":
            index.store(slot, keys)
            blocks.update(dict.fromkeys(keys, 0))
        elif kind == "remove":
            index.remove(slot, keys)
            for key in keys:
                blocks.pop(key, None)
        elif kind == "clear":
            index.clear(slot)
            blocks.clear()
        else:
            tier = int(kind[-1])
            moved = {key for key in keys if key in blocks and blocks[key] != tier}
            assert index.set_tier(slot, keys, tier) == len(moved)
            blocks.update(dict.fromkeys(moved, tier))
    held = {slot: set(blocks) for slot, blocks in tiers.items()}
    everything = set().union(*held.values())
    assert len(index) == len(everything)
    for slot, blocks in tiers.items():
        assert index.blocks_held(slot) == len(blocks)
        for key in list(blocks)[:20]:
            assert index.holds(slot, key)
            assert index.tier(slot, key) == blocks[key]
    for key in query:
        assert {slot for slot in held if index.holds(slot, key)} == {s for s, b in held.items() if key in b}
        assert all(index.tier(slot, key) == -1 for slot, b in held.items() if key not in b)
    assert _overlaps(index, query) == leading_blocks_reference(held, query)
    out = np.empty((3, 201))
    index.leading_tiers(query, out)
    assert tuple(out.tolist()) == _tiered_reference(tiers, query, 201)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_growing_past_64_slots_keeps_what_is_stored(impl: ModuleType) -> None:
    index = impl.BlockIndex()
    index.store(3, range(5000))
    index.store(130, range(100))
    assert index.slot_limit == 192
    assert _overlaps(index, [0, 1, 2, 5000]) == {3: 3, 130: 3}
    assert index.blocks_held(3) == 5000
    assert index.blocks_held(130) == 100
    assert index.remove(3, range(5000)) == 5000
    assert len(index) == 100
    assert _overlaps(index, [0, 1]) == {130: 2}
    # tiers recorded before the masks grow stay where they were
    index.store(5, [0, 1])
    assert index.set_tier(5, [1], 2) == 1
    assert index.set_tier(130, [0], 1) == 1
    index.store(200, [0])
    assert (index.tier(5, 1), index.tier(130, 0), index.tier(130, 1), index.tier(200, 0)) == (2, 1, 0, 0)
    out = np.empty((3, 256))
    index.leading_tiers([0, 1], out)
    assert out[:, [5, 130, 200]].tolist() == [[2.0, 2.0, 1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 70), st.lists(_keys, max_size=30)), max_size=60),
    query=st.lists(_keys, max_size=12),
)
def test_load_table_counts_blocks_in_use_per_worker(
    impl: ModuleType, ops: list[tuple[bool, int, list[int]]], query: list[int]
) -> None:
    load = impl.LoadTable(block_size=16)
    columns = np.zeros((len(impl.LOAD_ROWS), 71))
    load.bind(columns)
    rows = dict(zip(impl.LOAD_ROWS, columns, strict=True))
    counts: dict[tuple[int, int], int] = {}
    flights: list[tuple[int, list[int]]] = []
    for acquire, slot, keys in ops:
        if acquire or not flights:
            load.add(slot, keys, 100, 5.0, 7.0)
            flights.append((slot, keys))
            for key in keys:
                counts[slot, key] = counts.get((slot, key), 0) + 1
        else:
            done_slot, done_keys = flights.pop(0)
            load.free(done_slot, done_keys, 7.0)
            for key in done_keys:
                counts[done_slot, key] -= 1
    in_use: dict[int, set[int]] = {}
    for (slot, key), count in counts.items():
        if count:
            in_use.setdefault(slot, set()).add(key)
    assert len(load) == sum(len(blocks) for blocks in in_use.values())
    for slot in range(71):
        blocks = len(in_use.get(slot, ()))
        requests = sum(1 for s, _ in flights if s == slot)
        assert rows["active_blocks"][slot] == blocks
        assert rows["requests"][slot] == requests
        assert rows["kv"][slot] == blocks * 16 + 7.0 * requests
    depths = np.empty(71)
    load.leading_blocks(query, depths)
    assert {slot: int(depth) for slot, depth in enumerate(depths) if depth} == leading_blocks_reference(
        in_use, query
    )


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda index: index.store(0, [8, -1]), "block hash -1 is not an unsigned 64-bit integer"),
        (lambda index: index.store(0, [2**64]), "is not an unsigned 64-bit integer"),
        (lambda index: index.store(-1, [1]), "worker slot -1 is outside 0 .. 65535"),
        (lambda index: index.store(70000, [1]), "worker slot 70000 is outside"),
        (lambda index: index.set_tier(0, [7], 3), "cache tier 3 is outside 0 .. 2"),
        (lambda index: index.set_tier(0, [7], -1), "cache tier -1 is outside 0 .. 2"),
    ],
)
def test_bad_input_is_refused_by_name(impl: ModuleType, call: Any, message: str) -> None:
    index = impl.BlockIndex()
    index.store(0, [7])
    with pytest.raises(ValueError, match=message):
        call(index)
    assert _overlaps(index, [7]) == {0: 1}  # nothing already stored is lost
    assert len(index) == 1  # and nothing of the refused call was stored
    assert index.tier(0, 7) == 0


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_arrays_must_be_float64_of_the_right_shape(impl: ModuleType) -> None:
    with pytest.raises(TypeError, match="out must be a contiguous 1-d float64 array"):
        impl.BlockIndex().leading_blocks([1], np.zeros(4, dtype=np.int64))
    with pytest.raises(TypeError, match=r"out must be a writable C-contiguous float64 array of 3 rows"):
        impl.BlockIndex().leading_tiers([1], np.zeros((5, 4)))
    with pytest.raises(TypeError, match="costs must be a contiguous 1-d float64 array"):
        impl.lowest(np.zeros((2, 2)), None)
    load = impl.LoadTable(block_size=16)
    with pytest.raises(ValueError, match="no columns are bound"):
        load.add(0, [1], 1, 1.0, 1.0)
    with pytest.raises(TypeError, match="columns must be a writable C-contiguous float64 array of 11 rows"):
        load.bind(np.zeros((3, 4)))
    load.bind(np.zeros((len(impl.LOAD_ROWS), 4)))
    with pytest.raises(IndexError, match="worker slot 4 is beyond the 4 bound columns"):
        load.add(4, [1], 1, 1.0, 1.0)
    with pytest.raises(ValueError, match="block hash -2 is not an unsigned 64-bit integer"):
        load.add(1, [5, -2], 1, 1.0, 1.0)
    assert len(load) == 0  # nothing was charged by the refused calls


_PROMPT = list(range(1, 301))


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(1, 70),
    seed=st.integers(0, 2**32 - 1),
    prompt_tokens=st.integers(0, 200_000),
    block_size=st.sampled_from([16, 32, 512]),
)
def test_ttft_is_the_numpy_formulation_to_the_bit(
    size: int, seed: int, prompt_tokens: int, block_size: int
) -> None:
    """The loops this process runs compute what the numpy formulation (``_pyloops``) does, and the
    onboarding of the prefix blocks kept below the GPU adds their count x the tier's ms per block."""
    rng = np.random.default_rng(seed)
    held = {slot: set(_PROMPT[: int(rng.integers(1, 300))]) for slot in range(size) if rng.random() < 0.5}
    # some slots keep part of their prefix on the host or on disk
    moved = {
        slot: (tier, sorted(rng.choice(sorted(blocks), int(rng.integers(0, len(blocks) + 1)), replace=False)))
        for slot, blocks in held.items()
        for tier in [int(rng.integers(0, 3))]
        if tier
    }
    figures = {
        "prefill_tokens": rng.integers(0, 50_000, size),
        "step_ms": rng.random(size) * 40.0,
        "prefill_ms": rng.random(size) * 3000.0,
        "head_start": rng.random(size) * 10.0,
        "head_ms": rng.random(size) * 500.0,
    }
    xs = np.arange(0.0, 131073.0, 16.0)
    ys = 3.0 + 0.01 * xs + 1e-8 * xs**2
    now = float(rng.random() * 12.0)
    full = float(np.interp(prompt_tokens, xs, ys)) + 0.125
    outs = []
    for impl in (loops.MODULE, _pyloops):
        index = impl.BlockIndex()
        for slot, blocks in held.items():
            index.store(slot, sorted(blocks))
        for slot, (tier, chosen) in moved.items():
            index.set_tier(slot, chosen, tier)
        load = impl.LoadTable(block_size=block_size)
        columns = np.zeros((len(impl.LOAD_ROWS), size))
        load.bind(columns)
        rows = dict(zip(impl.LOAD_ROWS, columns, strict=True))
        for name, values in figures.items():
            rows[name][:] = values
        out = np.empty((5, size))
        curve = impl.Curve(xs, ys)
        load.ttft(index, _PROMPT, out, curve, prompt_tokens, block_size, 8192, now, full, 0.75, 6.5)
        outs.append(out)
        free = np.empty((5, size))
        load.ttft(index, _PROMPT, free, curve, prompt_tokens, block_size, 8192, now, full, 0.0, 0.0)
        onboard = free[3] + out[1] * 0.75 + out[2] * 6.5
        assert np.allclose(out[3], onboard, rtol=1e-12, atol=1e-9)
    tiers = {slot: dict.fromkeys(blocks, 0) for slot, blocks in held.items()}
    for slot, (tier, chosen) in moved.items():
        tiers[slot].update(dict.fromkeys(chosen, tier))
    depth, host, disk = _tiered_reference(tiers, _PROMPT, size)
    assert outs[0][:3].tolist() == [depth, host, disk]
    assert outs[0].tobytes() == outs[1].tobytes()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@settings(max_examples=300, deadline=None)
@given(
    costs=st.lists(
        st.sampled_from([0.0, 1.0, 1.0 + 1e-12, 2.5, -3.0, 1e12, 1e12 + 1.0]), min_size=1, max_size=70
    ),
    data=st.data(),
)
def test_lowest_is_the_first_minimum_or_all_near_ties(
    impl: ModuleType, costs: list[float], data: st.DataObject
) -> None:
    cost = np.array(costs)
    eligible = data.draw(st.lists(st.booleans(), min_size=len(costs), max_size=len(costs)))
    if not any(eligible):
        eligible[0] = True
    exclusion = np.where(eligible, 0.0, np.inf)
    for excl in (None, exclusion):
        masked = cost if excl is None else cost + excl
        low = float(masked.min())
        ties = np.flatnonzero(masked <= low + 1e-9 * max(1.0, math.fabs(low))).tolist()
        found = impl.lowest(cost, excl)
        assert found == (ties if len(ties) > 1 else int(masked.argmin()))


class _EmptiesItsList:
    """A block hash whose ``__index__`` empties the list it sits in: Python code run while the
    loops read that list (the compiled reader kept pointers into the freed item array)."""

    def __init__(self, victim: list[object], value: int) -> None:
        self.victim = victim
        self.value = value

    def __index__(self) -> int:
        self.victim.clear()
        return self.value


def _self_emptying(values: list[int], *, at: int = 3) -> list[object]:
    hashes: list[object] = [int(str(value)) for value in values]  # fresh objects, freed with the list
    hashes[at] = _EmptiesItsList(hashes, values[at])
    return hashes


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_hash_emptying_its_list_reads_the_list_as_it_was(impl: ModuleType) -> None:
    prompt = [2**40 + 7919 * k for k in range(300)]
    index = impl.BlockIndex()
    hashes = _self_emptying(prompt)
    assert index.store(0, hashes) == 300
    assert hashes == []
    assert index.remove(0, _self_emptying(prompt[:10])) == 10
    assert index.store(0, _self_emptying(prompt[:10])) == 10
    depth = np.empty(2)
    index.leading_blocks(_self_emptying(prompt, at=40), depth)
    assert depth.tolist() == [300.0, 0.0]
    load = impl.LoadTable(block_size=16)
    load.bind(np.zeros((len(impl.LOAD_ROWS), 2)))
    load.add(1, _self_emptying(prompt), 100, 5.0, 7.0)
    load.leading_blocks(_self_emptying(prompt), depth)
    assert depth.tolist() == [0.0, 300.0]
    out = np.empty((5, 2))
    curve = impl.Curve(np.array([0.0, 1e6]), np.array([1.0, 2.0]))
    index.set_tier(0, prompt[:5], 1)
    load.ttft(index, _self_emptying(prompt, at=70), out, curve, 300 * 16, 16, 8192, 0.0, 2.0, 1.0, 1.0)
    assert out[0].tolist() == [300.0, 0.0]
    assert out[1].tolist() == [5.0, 0.0]
    load.free(1, _self_emptying(prompt), 7.0)
    assert len(load) == 0
