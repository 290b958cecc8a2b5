"""The approximate indexer: learns from routing decisions and evicts like the worker's LRU cache."""

from __future__ import annotations

import pytest

from copse.router.approx import ApproximateIndexer
from copse.router.indexer import BlockIndex
from copse.workers.protocol import chain_hashes


def test_routed_prompts_are_matched_afterwards() -> None:
    indexer = ApproximateIndexer(default_capacity_blocks=100, index=BlockIndex())
    prompt = chain_hashes([1, 2, 3])
    indexer.on_routed(4, prompt, total_blocks=3)
    assert indexer.overlaps(prompt) == {4: 3}
    assert indexer.overlaps(chain_hashes([1, 2, 9])) == {4: 2}


def test_capacity_evicts_least_recent_blocks_and_keeps_shared_prefixes() -> None:
    indexer = ApproximateIndexer(default_capacity_blocks=100, index=BlockIndex())
    indexer.set_capacity(0, 4)
    first = chain_hashes([1, 2, 3])
    second = chain_hashes([1, 2, 7])
    indexer.on_routed(0, first, total_blocks=3)
    indexer.on_routed(0, second, total_blocks=3)
    # 4 blocks fit: [1], [1,2] shared, then the tails 3 and 7; touching the second prompt made the
    # first's tail the least recent, but the capacity is exactly met, so nothing is evicted yet.
    assert indexer.overlaps(first) == {0: 3}
    indexer.on_routed(0, chain_hashes([20]), total_blocks=1)
    assert indexer.overlaps(first) == {0: 2}  # first's tail went first
    assert indexer.overlaps(second) == {0: 3}
    assert indexer.blocks_held(0) == 4


def test_output_blocks_take_capacity_but_are_never_matched() -> None:
    indexer = ApproximateIndexer(default_capacity_blocks=5, index=BlockIndex())
    prompt = chain_hashes([1, 2, 3])
    indexer.on_routed(1, prompt, total_blocks=5)  # 2 output blocks
    indexer.on_routed(1, chain_hashes([8]), total_blocks=2)  # 1 more output block: 7 > 5
    # the oldest entries (the first request's output blocks) are evicted, the prompt stays
    assert indexer.overlaps(prompt) == {1: 3}
    indexer.on_routed(1, chain_hashes([9]), total_blocks=1)  # then the prompt's tail goes
    assert indexer.overlaps(prompt) == {1: 2}


def test_lowering_capacity_evicts_and_dropping_forgets() -> None:
    indexer = ApproximateIndexer(default_capacity_blocks=10, index=BlockIndex())
    prompt = chain_hashes([1, 2, 3, 4])
    indexer.on_routed(2, prompt, total_blocks=4)
    indexer.set_capacity(2, 2)
    assert indexer.overlaps(prompt) == {2: 2}
    assert indexer.capacity(2) == 2
    indexer.drop_worker(2)
    assert indexer.overlaps(prompt) == {}
    assert indexer.capacity(2) == 10
    with pytest.raises(ValueError, match="at least 1"):
        indexer.set_capacity(2, 0)
