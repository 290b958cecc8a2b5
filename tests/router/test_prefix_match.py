"""Prefix matches grouped by depth, and spread over worker slots."""

from __future__ import annotations

from copse.router.indexer import BlockIndex, prefix_groups
from copse.workers.protocol import chain_hashes

_PATH = chain_hashes([1, 2, 3, 4])


def test_groups_are_disjoint_by_depth_and_stop_at_the_first_gap() -> None:
    # slot 0 holds the whole path, slot 1 its first two blocks, slot 2 the first and third (a
    # gap), slot 3 all but the first (nothing usable)
    masks = {_PATH[0]: 0b0111, _PATH[1]: 0b1011, _PATH[2]: 0b1101, _PATH[3]: 0b1001}
    assert prefix_groups(masks, _PATH) == ([1, 2, 4], [0b0100, 0b0010, 0b0001])
    assert prefix_groups(masks, chain_hashes([9])) == ([], [])
    assert prefix_groups(masks, []) == ([], [])


def test_spread_gives_every_slot_its_groups_value() -> None:
    index = BlockIndex()
    index.store(0, _PATH)
    index.store(2, _PATH[:1])
    index.store(9, _PATH)  # beyond the slots asked for
    match = index.match(_PATH, 4)
    assert (match.depths, match.masks) == ([1, 4], [0b0100, 0b0001])
    rows = match.spread([[10.0, 40.0, -1.0], [0.5, 0.25, 7.0]])
    assert rows.tolist() == [[40.0, -1.0, 10.0, -1.0], [0.25, 7.0, 0.5, 7.0]]
    assert match.array().tolist() == [4.0, 0.0, 1.0, 0.0]
