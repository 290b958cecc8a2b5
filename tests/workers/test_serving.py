"""The cycle collector's settings of a serving process."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from copse.workers.serving import YOUNG_COLLECTION_ALLOCATIONS, tune_collector


@pytest.fixture
def collector() -> Iterator[None]:
    """Put the test process's collector back as it was."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("collector")
def test_a_serving_process_freezes_its_start_up_and_collects_young_objects_less_often() -> None:
    built_at_start_up = [[index] for index in range(1000)]
    tune_collector()
    assert gc.get_freeze_count() >= len(built_at_start_up)
    assert gc.get_threshold()[0] == YOUNG_COLLECTION_ALLOCATIONS
    # what start-up built is out of the generations a full collection walks
    assert not any(item is built_at_start_up for item in gc.get_objects(generation=2))
