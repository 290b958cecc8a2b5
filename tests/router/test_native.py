"""The compiled routing loops (``copse.router._native``) against plain-Python references: the
block table under churn, the prefix walk, the load table's per-worker figures and block
references, the TTFT arithmetic (to the bit) and the pick."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from copse.router import _native
from copse.router.indexer import BlockIndex
from copse.workers.protocol import chain_hashes

from .conftest import leading_blocks_reference

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
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=_ops, query=st.lists(_keys, max_size=12))
def test_block_table_under_churn_matches_sets(
    ops: list[tuple[str, int, list[int]]], query: list[int]
) -> None:
    index = BlockIndex()
    held: dict[int, set[int]] = {}
    for kind, slot, keys in ops:
        blocks = held.setdefault(slot, set())
        if kind == "store":
            index.store(slot, keys)
            blocks.update(keys)
        elif kind == "remove":
            index.remove(slot, keys)
            blocks.difference_update(keys)
        else:
            index.clear(slot)
            blocks.clear()
    everything = set().union(*held.values())
    assert len(index) == len(everything)
    for slot, blocks in held.items():
        assert index.blocks_held(slot) == len(blocks)
        for key in list(blocks)[:20]:
            assert index.holds(slot, key)
    for key in query:
        assert {slot for slot in held if index.holds(slot, key)} == {s for s, b in held.items() if key in b}
    assert index.overlaps(query) == leading_blocks_reference(held, query)


def test_growing_past_64_slots_keeps_what_is_stored() -> None:
    index = BlockIndex()
    index.store(3, range(5000))
    index.store(130, range(100))
    assert index.slot_limit == 192
    assert index.overlaps([0, 1, 2, 5000]) == {3: 3, 130: 3}
    assert index.blocks_held(3) == 5000
    assert index.blocks_held(130) == 100
    assert index.remove(3, range(5000)) == 5000
    assert len(index) == 100
    assert index.overlaps([0, 1]) == {130: 2}


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 70), st.lists(_keys, max_size=30)), max_size=60),
    query=st.lists(_keys, max_size=12),
)
def test_load_table_counts_blocks_in_use_per_worker(
    ops: list[tuple[bool, int, list[int]]], query: list[int]
) -> None:
    load = _native.LoadTable(block_size=16)
    columns = np.zeros((len(_native.LOAD_ROWS), 71))
    load.bind(columns)
    rows = dict(zip(_native.LOAD_ROWS, columns, strict=True))
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


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda index: index.store(0, [8, -1]), "block hash -1 is not an unsigned 64-bit integer"),
        (lambda index: index.store(0, [2**64]), "is not an unsigned 64-bit integer"),
        (lambda index: index.store(-1, [1]), "worker slot -1 is outside 0 .. 65535"),
        (lambda index: index.store(70000, [1]), "worker slot 70000 is outside"),
    ],
)
def test_bad_input_is_refused_by_name(call: Any, message: str) -> None:
    index = BlockIndex()
    index.store(0, [7])
    with pytest.raises(ValueError, match=message):
        call(index)
    assert index.overlaps([7]) == {0: 1}  # nothing already stored is lost
    assert len(index) == 1  # and nothing of the refused call was stored


def test_arrays_must_be_float64_of_the_right_shape() -> None:
    with pytest.raises(TypeError, match="out must be a contiguous 1-d float64 array"):
        BlockIndex().leading_blocks([1], np.zeros(4, dtype=np.int64))
    with pytest.raises(TypeError, match="costs must be a contiguous 1-d float64 array"):
        _native.lowest(np.zeros((2, 2)), None)
    load = _native.LoadTable(block_size=16)
    with pytest.raises(ValueError, match="no columns are bound"):
        load.add(0, [1], 1, 1.0, 1.0)
    with pytest.raises(TypeError, match="columns must be a writable C-contiguous float64 array of 11 rows"):
        load.bind(np.zeros((3, 4)))
    load.bind(np.zeros((len(_native.LOAD_ROWS), 4)))
    with pytest.raises(IndexError, match="worker slot 4 is beyond the 4 bound columns"):
        load.add(4, [1], 1, 1.0, 1.0)
    with pytest.raises(ValueError, match="block hash -2 is not an unsigned 64-bit integer"):
        load.add(1, [5, -2], 1, 1.0, 1.0)
    assert len(load) == 0  # nothing was charged by the refused calls


def _reference_ttft(args: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The numpy formulation the compiled loop replaced (policies.Selection.ttft_ms)."""
    xs, ys = args["curve_points"]
    isl, bs = float(args["prompt_tokens"]), float(args["block_size"])
    limit = max(isl - 1.0, 0.0)
    cached = np.array([min(d * bs, limit) for d in args["depths"]])
    own = np.array([args["full"] - float(np.interp(c, xs, ys)) for c in cached])
    uncached = isl - cached
    steps = np.add(args["prefill_tokens"], uncached)
    steps /= args["budget"]
    np.ceil(steps, out=steps)
    steps *= args["step_ms"]
    progress = np.subtract(args["now"], args["head_start"])
    progress *= 1000.0
    np.maximum(progress, 0.0, out=progress)
    np.minimum(progress, args["head_ms"], out=progress)
    backlog = np.maximum(np.subtract(args["prefill_ms"], progress), 0.0)
    backlog += own
    backlog += steps
    return backlog, uncached


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
    rng = np.random.default_rng(seed)
    index = BlockIndex()
    for slot in range(size):
        if rng.random() < 0.5:
            index.store(slot, _PROMPT[: int(rng.integers(1, 300))])
    load = _native.LoadTable(block_size=block_size)
    columns = np.zeros((len(_native.LOAD_ROWS), size))
    load.bind(columns)
    rows = dict(zip(_native.LOAD_ROWS, columns, strict=True))
    rows["prefill_tokens"][:] = rng.integers(0, 50_000, size)
    rows["step_ms"][:] = rng.random(size) * 40.0
    rows["prefill_ms"][:] = rng.random(size) * 3000.0
    rows["head_start"][:] = rng.random(size) * 10.0
    rows["head_ms"][:] = rng.random(size) * 500.0
    xs = np.arange(0.0, 131073.0, 16.0)
    ys = 3.0 + 0.01 * xs + 1e-8 * xs**2
    curve = _native.Curve(xs, ys)
    now = float(rng.random() * 12.0)
    full = float(np.interp(prompt_tokens, xs, ys)) + 0.125
    out = np.empty((3, size))
    load.ttft(index, _PROMPT, out, curve, prompt_tokens, block_size, 8192, now, full)
    want_ttft, want_uncached = _reference_ttft(
        {
            **rows,
            "depths": index.overlap_array(_PROMPT, size),
            "curve_points": (xs, ys),
            "prompt_tokens": prompt_tokens,
            "block_size": block_size,
            "budget": 8192,
            "now": now,
            "full": full,
        }
    )
    assert out[0].tolist() == index.overlap_array(_PROMPT, size).tolist()
    assert out[1].tobytes() == want_ttft.tobytes()
    assert out[2].tobytes() == want_uncached.tobytes()


@settings(max_examples=300, deadline=None)
@given(
    costs=st.lists(
        st.sampled_from([0.0, 1.0, 1.0 + 1e-12, 2.5, -3.0, 1e12, 1e12 + 1.0]), min_size=1, max_size=70
    ),
    data=st.data(),
)
def test_lowest_is_the_first_minimum_or_all_near_ties(costs: list[float], data: st.DataObject) -> None:
    cost = np.array(costs)
    eligible = data.draw(st.lists(st.booleans(), min_size=len(costs), max_size=len(costs)))
    if not any(eligible):
        eligible[0] = True
    exclusion = np.where(eligible, 0.0, np.inf)
    for excl in (None, exclusion):
        masked = cost if excl is None else cost + excl
        low = float(masked.min())
        ties = np.flatnonzero(masked <= low + 1e-9 * max(1.0, math.fabs(low))).tolist()
        found = _native.lowest(cost, excl)
        assert found == (ties if len(ties) > 1 else int(masked.argmin()))
