"""The in-flight load tracker."""

from __future__ import annotations

import numpy as np
import pytest

from copse.router.core import Role, Router, WorkerInfo
from copse.router.policies import RouteRequest, SelectionSettings
from copse.router.sequences import ActiveSequences
from copse.workers.perf import PolynomialPerfModel
from copse.workers.protocol import chain_hashes


def _add(
    seq: ActiveSequences, rid: str, *, slot: int, blocks: list[int], now: float = 0.0, ms: float = 100.0
) -> None:
    hashes = chain_hashes(blocks)
    seq.add(rid, slot=slot, hashes=hashes, prefill_tokens=64, prefill_ms=ms, kv_tokens=10, now=now)


def test_blocks_are_deduplicated_per_worker_and_released_by_reference() -> None:
    seq = ActiveSequences(block_size=16, slots=2)
    _add(seq, "a", slot=0, blocks=[1, 2, 3])
    _add(seq, "b", slot=0, blocks=[1, 2, 4])
    _add(seq, "c", slot=1, blocks=[1, 2])
    assert seq.active_blocks[:2].tolist() == [4, 2]
    assert seq.kv_tokens()[:2].tolist() == [4 * 16 + 20, 2 * 16 + 10]
    seq.free("a")
    assert seq.active_blocks[0] == 3
    seq.free("b")
    assert seq.active_blocks[0] == 0
    assert seq.kv_tokens()[0] == 0
    assert seq.free("b") is None


def test_prefill_load_moves_to_decode_at_the_first_token() -> None:
    seq = ActiveSequences(block_size=16)
    _add(seq, "a", slot=3, blocks=[1])
    assert (seq.requests[3], seq.prefilling[3], seq.prefill_tokens[3]) == (1, 1, 64)
    assert seq.prefill_done("a", now=0.05) == 3
    assert (seq.requests[3], seq.prefilling[3], seq.prefill_tokens[3], seq.prefill_ms[3]) == (1, 0, 0, 0)
    assert seq.prefill_done("a", now=0.06) == 3  # a second report changes nothing
    assert seq.prefilling[3] == 0
    assert seq.prefill_done("missing", now=0.0) is None


def test_backlog_decays_with_the_oldest_prefill_and_passes_to_the_next() -> None:
    router = Router(perf=PolynomialPerfModel(), settings=SelectionSettings(block_size=16), seed=0)
    for worker_id in ("busy", "idle"):
        router.add_worker(WorkerInfo(worker_id=worker_id, role=Role.WORKER), now=0.0)
    busy, idle = router.slots.slot("busy"), router.slots.slot("idle")
    _add(router.sequences, "a", slot=busy, blocks=[1], now=10.0, ms=100.0)
    _add(router.sequences, "b", slot=busy, blocks=[2], now=10.02, ms=50.0)

    def backlog(now: float) -> float:
        # What the busy worker's predicted TTFT has on the idle one's beyond its slower step (the
        # prompt is the same and takes one step on either).
        router.costs.refresh()
        eligible = router._free(Role.WORKER, frozenset())
        assert eligible is not None
        request = RouteRequest(request_id="q", hashes=[], prompt_tokens=16, max_tokens=1)
        ttft = router._selection(request, eligible, now=now).ttft_ms()
        step = router.costs.step_ms
        return float(ttft[busy] - ttft[idle] - (step[busy] - step[idle]))

    assert backlog(10.0) == pytest.approx(150.0)
    assert backlog(10.06) == pytest.approx(90.0)
    assert backlog(11.0) == pytest.approx(50.0)  # the head's progress is capped at its prediction
    router.sequences.prefill_done("a", now=10.08)
    assert backlog(10.08) == pytest.approx(50.0)
    assert backlog(10.1) == pytest.approx(30.0)


def test_active_prefix_finds_the_leading_blocks_in_use() -> None:
    seq = ActiveSequences(block_size=16)
    _add(seq, "a", slot=0, blocks=[1, 2, 3])
    _add(seq, "b", slot=2, blocks=[1, 2, 9, 9])
    _add(seq, "c", slot=2, blocks=[1])
    prompt = chain_hashes([1, 2, 9, 9])
    assert seq.active_prefix(prompt) == {0: 2, 2: 4}
    seq.free("b")
    assert seq.active_prefix(prompt) == {0: 2, 2: 1}
    seq.free("c")
    assert seq.active_prefix(prompt) == {0: 2}


def test_expire_frees_only_old_requests_and_drop_worker_frees_its_own() -> None:
    seq = ActiveSequences(block_size=16)
    _add(seq, "old", slot=0, blocks=[1], now=0.0)
    _add(seq, "new", slot=1, blocks=[2], now=200.0)
    _add(seq, "other", slot=1, blocks=[3], now=250.0)
    assert seq.expire(now=310.0, max_age_s=300.0) == ["old"]
    assert seq.drop_worker(1) == ["new", "other"]
    assert len(seq) == 0
    assert np.all(seq.requests == 0)


def test_arrays_grow_for_high_slots() -> None:
    seq = ActiveSequences(block_size=16, slots=1)
    _add(seq, "a", slot=40, blocks=[1])
    assert seq.size >= 41
    assert seq.requests[40] == 1
