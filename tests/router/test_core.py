"""The routing core: policies, busy thresholds and queue, disaggregation, replica mirroring."""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from copse.router.core import (
    DisaggSettings,
    NoWorkers,
    PeerChange,
    QueueFull,
    RateLimited,
    Role,
    Route,
    Router,
    SloShed,
    Thresholds,
    WorkerInfo,
)
from copse.router.fairness import QueueHead
from copse.router.limits import TenantLimits
from copse.router.policies import POLICIES, RouteRequest, RoutingObjective, SelectionSettings
from copse.router.replica_sync import decode_changes, encode_changes
from copse.workers.perf import PolynomialPerfModel
from copse.workers.protocol import KvEvent, KvStored, KvUpdated, StoredBlock, block_hashes

BS = 16
PERF = PolynomialPerfModel()


def _router(
    policy: str = "kv",
    *,
    workers: int = 4,
    role: Role = Role.WORKER,
    settings: SelectionSettings | None = None,
    **kwargs: Any,
) -> Router:
    settings = settings or SelectionSettings(block_size=BS)
    router = Router(perf=PERF, settings=settings, policy=policy, seed=1, **kwargs)
    for i in range(workers):
        router.add_worker(WorkerInfo(worker_id=f"w{i}", role=role), now=0.0)
    return router


def _request(rid: str, tokens: list[int], max_tokens: int = 10) -> RouteRequest:
    return RouteRequest(
        request_id=rid,
        hashes=block_hashes(tokens, block_size=BS),
        prompt_tokens=len(tokens),
        max_tokens=max_tokens,
    )


def _cache(router: Router, worker: str, tokens: list[int]) -> None:
    """Worker ``worker`` reports (via KV events) that it holds the full blocks of ``tokens``."""
    assert router.radix is not None
    hashes = block_hashes(tokens, block_size=BS)
    blocks = tuple(StoredBlock(block_hash=h, tokens_hash=h) for h in hashes)
    next_id = (router.radix.last_event_id(worker) or 0) + 1
    router.radix.apply_events(
        worker, epoch=1, events=[KvEvent(event_id=next_id, data=KvStored(parent_hash=None, blocks=blocks))]
    )


def _offload(router: Router, worker: str, tokens: list[int], *, tier: int) -> None:
    """Worker ``worker`` reports (via KV events) that the full blocks of ``tokens`` moved to ``tier``."""
    assert router.radix is not None
    hashes = tuple(block_hashes(tokens, block_size=BS))
    next_id = (router.radix.last_event_id(worker) or 0) + 1
    moved = KvUpdated(block_hashes=hashes, tier=tier, previous_tier=0)
    router.radix.apply_events(worker, epoch=1, events=[KvEvent(event_id=next_id, data=moved)])


PROMPT = list(range(1000, 1000 + 4096))


def test_kv_prefers_the_worker_holding_the_prefix() -> None:
    router = _router()
    _cache(router, "w2", PROMPT[:4000])
    route = router.submit(_request("r", PROMPT), now=0.0)
    assert route is not None
    assert route.worker_id == "w2"
    assert route.cached_tokens == 4000
    assert route.predicted_ttft_ms < PERF.prefill_ms(new_tokens=4096)


def test_kv_leaves_a_cached_worker_whose_backlog_costs_more_than_the_hit_saves() -> None:
    router = _router(workers=2)
    _cache(router, "w0", PROMPT[:1024])
    # w0 is busy prefilling three long uncached prompts
    for i in range(3):
        other = list(range(50_000 * (i + 1), 50_000 * (i + 1) + 8000))
        router.sequences.add(
            f"busy{i}",
            slot=router.slots.slot("w0"),
            hashes=[],
            prefill_tokens=8000,
            prefill_ms=PERF.prefill_ms(new_tokens=len(other)),
            kv_tokens=8000,
            now=0.0,
        )
    route = router.submit(_request("r", PROMPT), now=0.0)
    assert route is not None
    assert route.worker_id == "w1"


def test_kv_counts_a_prefix_below_the_gpu_by_its_onboarding_time() -> None:
    # 256 blocks of 16 tokens: 0.1 ms each from host memory (26 ms, against 86 ms to prefill them)
    settings = SelectionSettings(block_size=BS, host_block_ms=0.1, disk_block_ms=200.0)
    router = _router(workers=3, settings=settings)
    _cache(router, "w1", PROMPT)  # on the GPU
    _cache(router, "w2", PROMPT)
    _offload(router, "w2", PROMPT, tier=1)  # the same blocks in host memory
    prefill = PERF.prefill_ms(new_tokens=1, cached_tokens=4095)
    eligible = router._free(Role.WORKER, frozenset())
    assert eligible is not None
    selection = router._selection(_request("probe", PROMPT), eligible, now=0.0)
    ttft = selection.ttft_ms()
    slots = [router.slots.slot(w) for w in ("w0", "w1", "w2")]
    assert ttft[slots[1]] == pytest.approx(prefill)
    assert ttft[slots[2]] == pytest.approx(prefill + 256 * 0.1)  # cached, plus the onboarding
    assert ttft[slots[0]] == pytest.approx(PERF.prefill_ms(new_tokens=4096) + 0.0, rel=1e-6)
    route = router.submit(_request("r", PROMPT), now=0.0)
    assert route is not None
    assert route.worker_id == "w1"  # the GPU copy beats the host copy
    # with the GPU copy gone, the host copy beats computing the prompt again
    assert router.radix is not None
    router.radix.forget("w1")
    route = router.submit(_request("r2", PROMPT), now=0.0)
    assert route is not None
    assert (route.worker_id, route.cached_tokens) == ("w2", 4095)
    # and the worker is charged the onboarding with the compute: the next request sees it
    assert router.sequences.prefill_ms[slots[2]] == pytest.approx(
        router.perf.compute_ms(new_tokens=1, cached_tokens=4095) + 256 * 0.1
    )


def test_kv_computes_a_prompt_again_rather_than_onboard_it_from_a_slow_disk() -> None:
    settings = SelectionSettings(block_size=BS, host_block_ms=0.1, disk_block_ms=2.0)
    router = _router(workers=2, settings=settings)
    _cache(router, "w1", PROMPT)
    _offload(router, "w1", PROMPT, tier=2)  # 256 blocks x 2 ms: slower than prefilling them
    route = router.submit(_request("r", PROMPT), now=0.0)
    assert route is not None
    assert (route.worker_id, route.cached_tokens) == ("w0", 0)


def test_tiers_weigh_as_the_baselines_real_counterparts_weigh_them() -> None:
    # w1 holds 10 leading blocks in host memory, w2 9 on the GPU
    for policy, winner in (("prefix_only", "w2"), ("dynamo", "w1")):
        router = _router(policy, workers=3)
        _cache(router, "w1", PROMPT[: 10 * BS])
        _offload(router, "w1", PROMPT[: 10 * BS], tier=1)
        _cache(router, "w2", PROMPT[: 9 * BS])
        route = router.submit(_request("r", PROMPT[: 40 * BS]), now=0.0)
        assert route is not None
        # llm-d's scorer: 10 x 0.8 < 9 x 1.0; Dynamo's router: host blocks are held like any other
        assert route.worker_id == winner, policy
    # twelve host blocks (9.6) outweigh nine on the GPU for llm-d too
    router = _router("prefix_only", workers=3)
    _cache(router, "w1", PROMPT[: 12 * BS])
    _offload(router, "w1", PROMPT[: 12 * BS], tier=1)
    _cache(router, "w2", PROMPT[: 9 * BS])
    route = router.submit(_request("r", PROMPT[: 40 * BS]), now=0.0)
    assert route is not None
    assert route.worker_id == "w1"


def test_idle_workers_tie_and_ties_are_spread() -> None:
    router = _router()
    chosen: collections.Counter[str] = collections.Counter()
    for i in range(40):
        route = router.submit(_request(f"r{i}", list(range(i * 100, i * 100 + 64))), now=0.0)
        assert route is not None
        chosen[route.worker_id] += 1
        router.finish(f"r{i}", now=0.0)
    assert set(chosen) == {"w0", "w1", "w2", "w3"}


def test_every_policy_is_registered_and_routes() -> None:
    assert set(POLICIES) == {
        "kv",
        "kv_expert",
        "round_robin",
        "random",
        "least_loaded",
        "prefix_only",
        "dynamo",
    }
    for name in POLICIES:
        router = _router(name)
        route = router.submit(_request("r", PROMPT), now=0.0)
        assert route is not None
        assert route.worker_id in router.workers
    with pytest.raises(ValueError, match="unknown routing policy 'nope'; known: dynamo, kv, kv_expert"):
        _router("nope")


def test_round_robin_cycles_in_worker_order() -> None:
    router = _router("round_robin", workers=3)
    order = [router.submit(_request(f"r{i}", PROMPT), now=0.0) for i in range(6)]
    assert [route.worker_id for route in order if route] == ["w0", "w1", "w2", "w0", "w1", "w2"]


def test_least_loaded_and_prefix_only() -> None:
    router = _router("least_loaded", workers=2)
    first = router.submit(_request("a", PROMPT), now=0.0)
    second = router.submit(_request("b", PROMPT), now=0.0)
    assert first
    assert second
    assert first.worker_id != second.worker_id

    router = _router("prefix_only", workers=3)
    _cache(router, "w1", PROMPT[:512])
    _cache(router, "w2", PROMPT[:2048])
    routes = [router.submit(_request(f"r{i}", PROMPT), now=0.0) for i in range(3)]
    assert [route.worker_id if route else None for route in routes] == ["w2"] * 3


def test_dynamo_cost_counts_prefill_and_decode_blocks() -> None:
    router = _router("dynamo", workers=2)
    _cache(router, "w0", PROMPT)
    # w0 holds the prompt: 1 prefill block (at least one token is computed... Dynamo counts 0) vs 256
    route = router.submit(_request("r", PROMPT), now=0.0)
    assert route is not None
    assert route.worker_id == "w0"
    # w0 now carries 256 decode blocks; an unrelated prompt of 64 blocks goes to w1
    route = router.submit(_request("s", list(range(90_000, 91_024))), now=0.0)
    assert route is not None
    assert route.worker_id == "w1"


def test_busy_workers_are_skipped_then_requests_queue_and_drain_in_order() -> None:
    router = _router(workers=2, thresholds=Thresholds(busy_prefill_tokens=5000, queue_size=2))
    long = list(range(8000))
    a = router.submit(_request("a", long), now=0.0)
    b = router.submit(_request("b", [t + 10_000 for t in long]), now=0.0)
    assert a
    assert b
    assert {a.worker_id, b.worker_id} == {"w0", "w1"}
    assert router.submit(_request("c", [t + 20_000 for t in long]), now=0.0) is None
    assert router.submit(_request("d", [t + 30_000 for t in long]), now=0.0) is None
    assert router.queued == 2
    with pytest.raises(QueueFull, match="2 requests are already waiting"):
        router.submit(_request("e", PROMPT), now=0.0)
    released = router.prefill_done("a", now=1.0)
    assert [route.request_id for route in released] == ["c"]  # d waits: c made a busy again
    assert released[0].worker_id == a.worker_id
    router.finish("d", now=1.0)  # a queued request can be withdrawn
    assert router.queued == 0


def test_no_workers_and_exclusion() -> None:
    with pytest.raises(NoWorkers):
        _router(workers=0).submit(_request("r", PROMPT), now=0.0)
    router = _router(workers=2)
    route = router.submit(_request("r", PROMPT), now=0.0, exclude=frozenset({"w0"}))
    assert route is not None
    assert route.worker_id == "w1"
    with pytest.raises(NoWorkers):
        router.submit(_request("s", PROMPT), now=0.0, exclude=frozenset({"w0", "w1"}))


def test_removing_a_worker_returns_its_requests_and_forgets_its_cache() -> None:
    router = _router(workers=2)
    _cache(router, "w1", PROMPT)
    route = router.submit(_request("r", PROMPT), now=0.0)
    assert route is not None
    assert route.worker_id == "w1"
    assert router.remove_worker("w1") == ["r"]
    assert router.route_of("r") is None
    assert router.indexer.overlaps(block_hashes(PROMPT, block_size=BS)) == {}
    assert router.remove_worker("w1") == []
    again = router.submit(_request("r", PROMPT), now=0.0)
    assert again is not None
    assert again.worker_id == "w0"


def test_approximate_mode_learns_from_its_own_decisions() -> None:
    router = _router(workers=4, use_kv_events=False)
    first = router.submit(_request("a", PROMPT), now=0.0)
    assert first is not None
    router.finish("a", now=1.0)
    second = router.submit(_request("b", PROMPT), now=1.0)
    assert second is not None
    assert second.worker_id == first.worker_id
    assert second.cached_tokens == 4096 - 1 - (4096 - 1) % BS or second.cached_tokens == 4095


def _disagg(**kwargs: Any) -> Router:
    router = Router(perf=PERF, settings=SelectionSettings(block_size=BS), seed=3, **kwargs)
    router.add_worker(WorkerInfo(worker_id="p0", role=Role.PREFILL, locality="rackA"), now=0.0)
    router.add_worker(WorkerInfo(worker_id="d0", role=Role.DECODE, locality="rackB"), now=0.0)
    router.add_worker(WorkerInfo(worker_id="d1", role=Role.DECODE, locality="rackA"), now=0.0)
    return router


def test_disaggregated_prefill_then_decode_close_to_it() -> None:
    router = _disagg()
    route = router.submit(_request("r", PROMPT), now=0.0)
    assert route is not None
    assert (route.prefill_worker_id, route.worker_id) == ("p0", "d1")
    assert router.sequences.prefilling[router.slots.slot("p0")] == 1
    router.prefill_done("r", now=0.5)
    assert router.sequences.requests[router.slots.slot("p0")] == 0  # the prefill side is released
    assert router.sequences.requests[router.slots.slot("d1")] == 1
    router.finish("r", now=1.0)
    assert router.sequences.requests.sum() == 0


def test_prefill_and_decode_pair_only_within_one_revision() -> None:
    router = Router(perf=PERF, settings=SelectionSettings(block_size=BS), seed=3)
    # Mid-rollout: the close decode worker runs the new revision, the old prefill worker the old.
    router.add_worker(WorkerInfo(worker_id="p-old", role=Role.PREFILL, locality="A", revision="r1"), now=0.0)
    router.add_worker(WorkerInfo(worker_id="d-new", role=Role.DECODE, locality="A", revision="r2"), now=0.0)
    router.add_worker(WorkerInfo(worker_id="d-old", role=Role.DECODE, locality="B", revision="r1"), now=0.0)
    pairs = set()
    for i in range(6):
        route = router.submit(_request(f"r{i}", PROMPT[: 3000 + i]), now=0.0)
        assert route is not None
        pairs.add((route.prefill_worker_id, route.worker_id))
    assert ("p-old", "d-old") in pairs
    assert pairs <= {("p-old", "d-old"), (None, "d-old"), (None, "d-new")}, "never p-old with d-new"
    # A revision without a decode worker gets no prefill: its prefill workers are skipped.
    router.add_worker(WorkerInfo(worker_id="p-new", role=Role.PREFILL, locality="A", revision="r3"), now=0.0)
    router.remove_worker("d-old")
    route = router.submit(_request("late", PROMPT), now=1.0)
    assert route is not None
    assert route.prefill_worker_id is None, "no prefill worker of d-new's revision: it serves whole"
    assert route.worker_id == "d-new"


def test_short_prompts_stay_on_the_decode_worker_when_transfer_costs_more() -> None:
    router = _disagg(disagg=DisaggSettings(overhead_ms=5.0))
    short = router.submit(_request("r", PROMPT[:256]), now=0.0)
    assert short is not None
    assert short.prefill_worker_id is None
    assert short.worker_id in {"d0", "d1"}
    slow_link = _disagg(disagg=DisaggSettings(overhead_ms=0.0, near_gbps=0.05, far_gbps=0.05))
    route = slow_link.submit(_request("r", PROMPT), now=0.0)
    assert route is not None
    assert route.prefill_worker_id is None


def test_without_prefill_workers_decode_workers_serve_whole_requests() -> None:
    router = _disagg()
    router.remove_worker("p0")
    route = router.submit(_request("r", PROMPT), now=0.0)
    assert route is not None
    assert route.prefill_worker_id is None
    assert route.worker_id in {"d0", "d1"}


def test_a_draining_worker_takes_nothing_new_and_keeps_counting_what_it_has() -> None:
    router = _router("round_robin", workers=2)
    first = router.submit(_request("a", PROMPT[:512]), now=0.0)
    assert first is not None
    busy = first.worker_id
    router.add_worker(WorkerInfo(worker_id=busy, role=Role.WORKER, draining=True), now=0.1)
    assert router.in_flight(busy) == 1
    assert router.sequences.requests[router.slots.slot(busy)] == 1, "its load still counts"
    for i in range(4):
        route = router.submit(_request(f"n{i}", PROMPT[: 256 + i]), now=0.2)
        assert route is not None
        assert route.worker_id != busy
    router.finish("a", now=1.0)
    assert router.in_flight(busy) == 0
    # Once the other worker is gone too, nothing can take a request: fail fast, do not queue.
    other = next(w for w in router.workers if w != busy)
    router.remove_worker(other)
    with pytest.raises(NoWorkers):
        router.submit(_request("late", PROMPT[:256]), now=2.0)
    # Removing the draining worker leaves the role counts consistent; a new one serves again.
    router.remove_worker(busy)
    router.add_worker(WorkerInfo(worker_id="w9", role=Role.WORKER), now=3.0)
    assert router.submit(_request("again", PROMPT[:256]), now=3.0) is not None


def test_a_draining_prefill_worker_counts_its_prefills_until_they_are_done() -> None:
    router = _disagg()
    route = router.submit(_request("r", PROMPT), now=0.0)
    assert route is not None
    assert route.prefill_worker_id == "p0"
    router.add_worker(WorkerInfo(worker_id="p0", role=Role.PREFILL, locality="rackA", draining=True), now=0.1)
    assert router.in_flight("p0") == 1
    later = router.submit(_request("s", PROMPT[:4000]), now=0.2)
    assert later is not None
    assert later.prefill_worker_id is None, "no prefill worker takes new requests: decode serves them whole"
    router.prefill_done("r", now=0.5)
    assert router.in_flight("p0") == 0, "its part of the request is over"
    assert router.in_flight("d1") == 1 + (later.worker_id == "d1")


def test_busy_prefill_workers_are_waited_for_not_replaced_by_decode_workers() -> None:
    router = _disagg(thresholds=Thresholds(busy_prefill_tokens=5000))
    first = router.submit(_request("a", list(range(8000))), now=0.0)
    assert first is not None
    assert first.prefill_worker_id == "p0"
    # p0 has 8000 tokens to prefill: busy. The decode workers are free, but a prompt prefilled on
    # one would stall the sequences it decodes: the request waits for p0.
    assert router.submit(_request("b", [t + 10_000 for t in range(8000)]), now=0.1) is None
    assert router.queued == 1
    assert router.in_flight("d0") + router.in_flight("d1") == 1, "only a's decode is charged"
    released = router.prefill_done("a", now=0.5)
    assert [(route.request_id, route.prefill_worker_id) for route in released] == [("b", "p0")]


def test_peer_changes_are_published_and_mirrored() -> None:
    origin = _router(workers=2, share_load=True)
    mirror = _router(workers=2)
    route = origin.submit(_request("r", PROMPT), now=0.0)
    assert route is not None
    origin.prefill_done("r", now=0.2)
    assert origin.outbox is not None
    changes = list(origin.outbox)
    assert [c.op for c in changes] == ["add", "prefilled"]
    mirror.apply_peer(changes[0], peer="A", now=0.0)
    slot = mirror.slots.slot(route.worker_id)
    assert mirror.sequences.requests[slot] == 1
    assert mirror.sequences.prefilling[slot] == 1
    mirror.apply_peer(changes[1], peer="A", now=0.2)
    assert mirror.sequences.prefilling[slot] == 0
    mirror.apply_peer(PeerChange(op="free", key="r"), peer="A", now=0.3)
    assert mirror.sequences.requests[slot] == 0
    mirror.apply_peer(changes[0], peer="B", now=0.4)
    mirror.forget_peer("B", now=0.5)
    assert mirror.sequences.requests[slot] == 0


def test_a_peers_snapshot_charges_no_tenant_and_counts_no_routed_tokens() -> None:
    """A snapshot is the peer's in-flight state, sent again at every sequence gap: its requests
    were charged and counted when their messages arrived (or before this replica started), so a
    reload moves no tenant's tag and adds nothing to the routed rate admission divides by."""
    peer = _router(workers=1, share_load=True)
    mirror = _router(workers=1)
    assert peer.submit(_classed("r", priority=0, tenant="t"), now=0.0) is not None
    assert peer.outbox is not None
    for change in peer.outbox:
        mirror.apply_peer(change, peer="A", now=0.0)
    later = mirror.thresholds.rate_window_s * 0.75  # a rate is known after half a window
    rate = mirror.routed_tokens_per_s(now=later)
    assert rate is not None
    tags = dict(mirror._queue._bands[0].served)
    for _ in range(2):
        mirror.load_peer_snapshot("A", peer.own_flights(), now=later)
    slot = mirror.slots.slot("w0")
    assert mirror.sequences.requests[slot] == 1
    assert mirror.routed_tokens_per_s(now=later) == rate
    assert mirror._queue._bands[0].served == tags


def _classed(rid: str, *, priority: int, tenant: str = "", ttft_slo_ms: float | None = None) -> RouteRequest:
    return dataclasses.replace(
        _request(rid, PROMPT[:1000], max_tokens=1000),
        priority=priority,
        tenant=tenant,
        ttft_slo_ms=ttft_slo_ms,
    )


def _saturated(**kwargs: Any) -> Router:
    """One worker that takes one request at a time, having routed 2,500 tokens a second over the
    last 4 s (a 2,000-token request each second, one of them now)."""
    router = _router(workers=1, thresholds=Thresholds(busy_prefill_tokens=500, rate_window_s=4.0), **kwargs)
    for second in range(5):
        route = router.submit(_classed(f"warm{second}", priority=0), now=float(second))
        assert route is not None
        router.finish(route.request_id, now=second + 0.5)
    assert router.submit(_classed("running", priority=0), now=5.0) is not None
    assert router.routed_tokens_per_s(now=5.0) == pytest.approx(2500.0)
    return router


def _finish_in_turn(router: Router, running: str, *, times: range) -> list[str]:
    """At each of ``times`` (s), ``running`` ends, then each request the queue released in its
    place; returns those, in order."""
    served: list[str] = []
    for t in times:
        served += [
            route.request_id for route in router.finish(served[-1] if served else running, now=float(t))
        ]
    return served


def test_the_queue_serves_the_higher_priority_first() -> None:
    router = _saturated()
    assert router.submit(_classed("batch", priority=0), now=5.0) is None
    assert router.submit(_classed("premium", priority=100), now=5.0) is None
    released = router.finish("running", now=6.0)
    assert [route.request_id for route in released] == ["premium"]


def _own(rid: str, *, start: int, tokens: int = 1000, priority: int = 0, tenant: str = "") -> RouteRequest:
    """A request of ``tokens`` prompt tokens sharing no block with any other."""
    prompt = list(range(start, start + tokens))
    return dataclasses.replace(_request(rid, prompt), priority=priority, tenant=tenant)


CONTENDED = Thresholds(busy_prefill_tokens=5000, contended_prefill_tokens=2500)


def test_a_tenant_alone_fills_a_worker_to_the_busy_threshold_a_second_one_to_a_step() -> None:
    router = _router(workers=1, thresholds=CONTENDED)
    for i in range(4):  # one tenant: first come, first served wherever it waits
        assert router.submit(_own(f"a{i}", start=10_000 * (i + 1), tenant="a"), now=0.0) is not None
    # 4,000 tokens to prefill, below the busy threshold: the other tenant's request waits in the
    # fair queue, not behind them at the worker, until it fits in a step beside what is left.
    assert router.submit(_own("b0", start=90_000, tenant="b"), now=0.1) is None
    assert router.prefill_done("a0", now=0.2) == []
    assert router.prefill_done("a1", now=0.3) == []
    assert [route.request_id for route in router.prefill_done("a2", now=0.4)] == ["b0"]


def test_a_contended_prompt_longer_than_a_step_waits_for_a_worker_with_none_queued() -> None:
    router = _router(workers=1, thresholds=CONTENDED)
    assert router.submit(_own("a0", start=10_000, tenant="a"), now=0.0) is not None
    assert router.submit(_own("long", start=20_000, tokens=3000, tenant="b"), now=0.1) is None
    assert [route.request_id for route in router.prefill_done("a0", now=0.2)] == ["long"]


def test_a_tenant_served_more_leaves_idle_workers_to_one_served_less_by_its_share() -> None:
    router = _router(workers=4, thresholds=CONTENDED)
    assert router.submit(_own("light0", start=10_000, tokens=2000, tenant="light"), now=0.0) is not None
    router.prefill_done("light0", now=0.1)
    for i, tokens in enumerate((2500, 100)):  # each takes an idle worker: it fits beside no other
        heavy = _own(f"heavy{i}", start=20_000 * (i + 1), tokens=tokens, tenant="heavy")
        assert router.submit(heavy, now=0.2 + i / 10) is not None
    # Light was routed 2,010 of the 4,630 tokens: 1.7 of the 4 workers, so heavy leaves two idle.
    assert router.submit(_own("heavy2", start=60_000, tokens=2500, tenant="heavy"), now=0.4) is None
    light = router.submit(_own("light1", start=80_000, tokens=2400, tenant="light"), now=0.5)
    assert light is not None, "light's next request finds an idle worker at once"
    assert router.sequences.prefill_tokens[router.slots.slot(light.worker_id)] == 2400


def test_a_tenant_with_a_request_waiting_is_left_no_idle_worker() -> None:
    router = _router(workers=2, share_load=True, thresholds=CONTENDED)
    assert router.submit(_own("light0", start=10_000, tenant="light"), now=0.0) is not None
    router.prefill_done("light0", now=0.1)
    assert router.submit(_own("heavy0", start=20_000, tokens=2000, tenant="heavy"), now=0.2) is not None
    # One idle worker, which light's share (1,010 of 3,020 tokens) would keep from heavy, but light
    # waits at replica b, which re-sends its head every heartbeat: the queues serve it first there.
    head = QueueHead(priority=0, start=0.0, tenant="light", virtual=0.0, tokens=3000.0)
    for t in (0.3, 1.3, 2.3, 3.3):
        router.apply_peer_queue("b", [dataclasses.replace(head, waited_s=t - 0.3)], now=t)
    # The head held heavy back for at most 3 s from when b first sent it (Thresholds.peer_queue_max_age_s).
    assert router.submit(_own("heavy1", start=30_000, tenant="heavy"), now=3.4) is not None


def _served_in_turn(router: Router, tenants: tuple[str, ...], *, model: str = "") -> None:
    """Each of ``tenants`` in turn routes a request and ends it, the last one 30 tokens more."""
    for i, tenant in enumerate(tenants):
        tokens = 100 if i < len(tenants) - 1 else 130
        request = dataclasses.replace(
            _own(f"{tenant}0", start=10_000 * (i + 1), tokens=tokens, tenant=tenant), model=model
        )
        assert router.submit(request, now=0.1 * i) is not None
        router.finish(request.request_id, now=0.1 * i + 0.05)


def test_a_fleet_of_one_is_never_left_to_others() -> None:
    # a and b were routed 220 of the 350 tokens: 0.63 of one worker. Leaving it to them held c
    # back with nothing in flight to try it again (the queue stalled until its timeout).
    router = _router(workers=1, thresholds=CONTENDED)
    _served_in_turn(router, ("a", "b", "c"))
    assert router.submit(_own("c1", start=90_000, tenant="c"), now=0.5) is not None


def test_the_workers_left_to_others_are_of_the_request_s_model() -> None:
    # Two workers, one per model: model x's request could take one, so it leaves it to nobody.
    router = _router(workers=0, thresholds=CONTENDED)
    for i, model in enumerate(("x", "y")):
        router.add_worker(WorkerInfo(worker_id=f"w{i}", role=Role.WORKER, model=model), now=0.0)
    _served_in_turn(router, ("a", "b", "c"), model="x")
    route = router.submit(dataclasses.replace(_own("c1", start=90_000, tenant="c"), model="x"), now=0.5)
    assert route is not None
    assert route.worker_id == "w0"


@settings(max_examples=40, deadline=None)
@given(
    tenants=st.integers(min_value=2, max_value=5),
    workers=st.integers(min_value=1, max_value=3),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_the_queue_never_holds_a_request_with_none_in_flight(tenants: int, workers: int, seed: int) -> None:
    """Tenants in closed loop (a request, its first token, its end, a pause, the next one) with
    jittered times: whenever a request waits, one is in flight, whose events try it again."""
    rng = random.Random(seed)
    router = _router(workers=workers)
    events: list[tuple[float, int, str, str]] = []
    order = itertools.count()
    tenant_of: dict[str, str] = {}

    def routed(route: Route | None, now: float) -> None:
        if route is not None:
            heapq.heappush(
                events, (now + rng.uniform(0.001, 0.01), next(order), "prefilled", route.request_id)
            )
            heapq.heappush(events, (now + rng.uniform(0.02, 0.08), next(order), "ended", route.request_id))

    for tenant in range(tenants):
        heapq.heappush(events, (rng.uniform(0.0, 0.01), next(order), "sent", f"t{tenant}"))
    for _ in range(3000):
        now, _, kind, name = heapq.heappop(events)
        if kind == "sent":
            request = _own(
                f"{name}-{next(order)}", start=rng.randrange(10**6), tokens=rng.randint(10, 30), tenant=name
            )
            tenant_of[request.request_id] = name
            routed(router.submit(request, now=now), now)
        else:
            released = (
                router.prefill_done(name, now=now) if kind == "prefilled" else router.finish(name, now=now)
            )
            for route in released:
                routed(route, now)
            if kind == "ended":
                heapq.heappush(
                    events, (now + rng.uniform(0.0005, 0.003), next(order), "sent", tenant_of[name])
                )
        in_flight = sum(router.in_flight(f"w{i}") for i in range(workers))
        assert not router.queued or in_flight, (
            f"{router.queued} requests wait at {now:.3f} s with none in flight"
        )


def test_a_lower_priority_keeps_a_step_queued_while_a_higher_one_is_routed() -> None:
    router = _router(workers=1, thresholds=CONTENDED)
    assert router.submit(_own("premium0", start=10_000, priority=100), now=0.0) is not None
    assert router.submit(_own("batch0", start=20_000, priority=0), now=0.1) is not None
    assert router.submit(_own("batch1", start=30_000, priority=0), now=0.2) is None
    # The higher band competes with nothing above it: it takes the worker up to the busy
    # threshold, at once, although a lower request waits for the worker (it comes first).
    assert router.submit(_own("premium1", start=40_000, priority=100), now=0.3) is not None
    assert router.queued == 1


def test_a_contended_request_waits_for_a_prefill_worker_with_room_for_its_prompt() -> None:
    router = _disagg(thresholds=CONTENDED)
    first = router.submit(_own("a0", start=10_000, tenant="a"), now=0.0)
    assert first is not None
    assert first.prefill_worker_id == "p0"
    assert router.submit(_own("b0", start=20_000, tokens=2000, tenant="b"), now=0.1) is None
    released = router.prefill_done("a0", now=0.2)
    assert [(route.request_id, route.prefill_worker_id) for route in released] == [("b0", "p0")]


def test_a_tenant_routed_by_a_peer_replica_contends_here_too() -> None:
    a, b = (_router(workers=1, share_load=True, thresholds=CONTENDED) for _ in range(2))
    assert b.submit(_own("b0", start=10_000, tenant="b"), now=0.0) is not None
    _exchange((a, b), now=0.0)
    assert a.submit(_own("a0", start=20_000, tenant="a"), now=0.1) is not None  # 1,000 queued before it
    assert a.submit(_own("a1", start=30_000, tenant="a"), now=0.2) is None


def test_a_request_predicted_to_miss_its_ttft_target_is_shed_lowest_priority_first() -> None:
    router = _saturated()
    for i in range(4):  # 8,000 tokens of batch work waiting: 3.2 s at the fleet's rate
        assert router.submit(_classed(f"queued{i}", priority=0), now=5.0) is None
    with pytest.raises(SloShed) as shed:
        router.submit(_classed("batch", priority=0, ttft_slo_ms=2000.0), now=5.0)
    assert shed.value.retry_after_s >= 1.0
    premium = _classed("premium", priority=100, ttft_slo_ms=2000.0)
    assert router.predicted_wait_s(premium, now=5.0) == pytest.approx(0.8), "it waits behind no batch work"
    assert router.submit(premium, now=5.0) is None, "admitted: it is served before the batch work"
    assert router.queued == 5
    released = router.finish("running", now=6.0)
    assert [route.request_id for route in released] == ["premium"]


def test_a_tenants_predicted_wait_counts_what_the_other_tenants_keep_sending() -> None:
    router = _saturated()  # tenant "" was routed the fleet's whole 2,500 tokens a second
    for i in range(4):
        assert router.submit(_classed(f"queued{i}", priority=0, tenant="b"), now=5.0) is None
    # b's 10,000 tokens, and as many of tenant ""'s, which keeps sending faster than b is served
    assert router.predicted_wait_s(_classed("b", priority=0, tenant="b"), now=5.0) == pytest.approx(8.0)
    # at priority 100 nobody else sends: only its own 2,000 tokens
    premium = _classed("p", priority=100, tenant="b")
    assert router.predicted_wait_s(premium, now=5.0) == pytest.approx(0.8)


def test_a_tenant_over_its_token_rate_is_refused_until_its_bucket_refills() -> None:
    router = _router(workers=1, limits=TenantLimits(tokens_per_minute={"a": 3000.0}))
    assert router.submit(_classed("a1", priority=0, tenant="a"), now=0.0) is not None
    with pytest.raises(RateLimited) as limited:
        router.submit(_classed("a2", priority=0, tenant="a"), now=1.0)
    assert limited.value.retry_after_s == pytest.approx(19.0), "2,000 tokens at 50 a second, 1,000 left"
    assert router.submit(_classed("b1", priority=0, tenant="b"), now=1.0) is not None, "b has no limit"
    assert router.submit(_classed("a3", priority=0, tenant="a"), now=20.0) is not None


def test_a_peer_replicas_service_to_a_tenant_moves_it_back_in_this_replicas_queue() -> None:
    peer = _router(workers=1, share_load=True)
    router = _saturated()
    assert router.submit(_classed("light", priority=0, tenant="light"), now=5.0) is None
    assert router.submit(_classed("heavy-here", priority=0, tenant="heavy"), now=5.0) is None
    assert router.submit(_classed("light-2", priority=0, tenant="light"), now=5.0) is None
    for i in range(3):  # the peer serves the heavy tenant 6,000 tokens meanwhile, on the same worker
        peer.submit(_classed(f"heavy-there{i}", priority=0, tenant="heavy"), now=5.0)
        peer.finish(f"heavy-there{i}", now=5.0)
    assert peer.outbox is not None
    for change in peer.outbox:
        router.apply_peer(change, peer="peer", now=5.0)
    assert router.submit(_classed("heavy-late", priority=0, tenant="heavy"), now=5.0) is None
    assert router.submit(_classed("light-late", priority=0, tenant="light"), now=5.0) is None
    served = _finish_in_turn(router, "running", times=range(6, 11))
    # The heavy tenant waiting here was served 6,000 tokens elsewhere meanwhile: the light one
    # catches up (three 2,000-token requests) before heavy-here goes.
    assert served == ["light", "light-2", "light-late", "heavy-here", "heavy-late"]


def _replicas() -> tuple[Router, Router]:
    """Two router replicas sharing one worker that takes one request at a time."""
    busy = Thresholds(busy_prefill_tokens=500)
    return (
        _router(workers=1, share_load=True, thresholds=busy),
        _router(workers=1, share_load=True, thresholds=busy),
    )


def _exchange(replicas: tuple[Router, Router], *, now: float) -> list[str]:
    """What replica sync carries: each replica's load changes and queue heads to the other, until
    nothing moves; returns the requests the exchange released."""
    released: list[str] = []
    a, b = replicas
    directions: tuple[tuple[str, Router, Router], ...] = (("a", a, b), ("b", b, a))
    moved = True
    while moved:
        moved = False
        for name, router, peer in directions:
            assert router.outbox is not None
            changes, router.outbox[:] = list(router.outbox), []
            moved = moved or bool(changes)
            for change in changes:
                released += [route.request_id for route in peer.apply_peer(change, peer=name, now=now)]
            routes = peer.apply_peer_queue(name, router.queue_heads(now=now), now=now)
            released += [route.request_id for route in routes]
            moved = moved or bool(routes)
    return released


def _held_back(at_a: RouteRequest, at_b: RouteRequest) -> tuple[Router, Router]:
    """Replicas a and b, both holding a queued request (``at_a``, ``at_b``) when b's heavy-0, on
    the only worker, ends at 1 s (b has not routed what waits since: its head comes after a's)."""
    a, b = _replicas()
    assert b.submit(_classed("heavy-0", priority=0, tenant="heavy"), now=0.0) is not None
    _exchange((a, b), now=0.0)
    assert a.submit(at_a, now=0.1) is None, "the worker is busy"
    assert b.submit(at_b, now=0.1) is None
    _exchange((a, b), now=0.1)
    assert b.finish("heavy-0", now=1.0) == [], "b holds its request back"
    assert b.queued == 1
    return a, b


def test_capacity_a_replica_frees_goes_to_the_peers_head_when_that_comes_first() -> None:
    # the light tenant, served nothing yet, waits at a; the heavy one was served heavy-0
    a, b = _held_back(
        _classed("light-0", priority=0, tenant="light"), _classed("heavy-1", priority=0, tenant="heavy")
    )
    assert _exchange((a, b), now=1.0) == ["light-0"], "a takes the capacity b freed"
    assert a.finish("light-0", now=2.0) == []
    assert _exchange((a, b), now=2.0) == ["heavy-1"]
    # a new heavy request at b while the light tenant waits at a, behind it in a's queue
    assert a.submit(_classed("light-1", priority=0, tenant="light"), now=2.1) is None
    _exchange((a, b), now=2.1)
    assert b.submit(_classed("heavy-2", priority=0, tenant="heavy"), now=2.1) is None
    assert b.finish("heavy-1", now=3.0) == []
    assert _exchange((a, b), now=3.0) == ["light-1"]


def test_a_peers_snapshot_keeps_its_queue_heads() -> None:
    """A snapshot (at a gap in the peer's messages) replaces the peer's load, not its queue heads,
    which it does not carry: b still holds its request back for a's light one."""
    a, b = _held_back(
        _classed("light-0", priority=0, tenant="light"), _classed("heavy-1", priority=0, tenant="heavy")
    )
    assert b.load_peer_snapshot("a", a.own_flights(), now=1.0) == []
    assert b.hold_ends(now=1.0) == 0.1 + b.thresholds.peer_queue_max_age_s, "a's head, first sent at 0.1 s"


def test_a_lower_band_at_one_replica_never_overtakes_a_higher_one_at_the_other() -> None:
    a, b = _held_back(
        _classed("premium", priority=100, tenant="t"), _classed("batch", priority=0, tenant="u")
    )
    assert _exchange((a, b), now=1.0) == ["premium"]


def test_a_silent_peers_queue_head_holds_dispatch_back_no_longer_than_the_timeout() -> None:
    # a dies with light-0 waiting (last heard at 0.1 s): b's heavy-1 waits for it only while fresh
    _a, b = _held_back(
        _classed("light-0", priority=0, tenant="light"), _classed("heavy-1", priority=0, tenant="heavy")
    )
    timeout = b.thresholds.peer_queue_max_age_s
    assert b.drain(now=0.1 + timeout - 0.01) == []
    assert [route.request_id for route in b.drain(now=0.1 + timeout + 0.01)] == ["heavy-1"]


def _loaded(objective: RoutingObjective) -> Router:
    """w0 prefills a long prompt; w1 decodes twelve long answers."""
    router = _router(workers=2, settings=SelectionSettings(block_size=BS, objective=objective))
    assert router.submit(_request("long", list(range(50_000, 66_000))), now=0.0, exclude=frozenset({"w1"}))
    for i in range(12):
        route = router.submit(
            _request(f"d{i}", [70_000 + i] * 64, max_tokens=2000), now=0.0, exclude=frozenset({"w0"})
        )
        assert route is not None
        router.prefill_done(route.request_id, now=0.0)
    return router


def test_the_goodput_objective_prefers_a_worker_that_meets_the_ttft_target() -> None:
    request = _request("new", PROMPT[:2048], max_tokens=2000)
    e2e = _loaded("e2e").submit(request, now=0.0)
    assert e2e is not None
    assert e2e.worker_id == "w0", "the decode crowd costs more end to end than the prefill backlog"
    target = e2e.predicted_ttft_ms / 2
    goodput = _loaded("goodput").submit(dataclasses.replace(request, ttft_slo_ms=target), now=0.0)
    assert goodput is not None
    assert goodput.worker_id == "w1"
    assert goodput.predicted_ttft_ms <= target
    unreachable = _loaded("goodput").submit(dataclasses.replace(request, ttft_slo_ms=0.001), now=0.0)
    assert unreachable is not None
    assert unreachable.worker_id == "w0", "no worker meets it: e2e decides"


def test_a_queue_full_of_lower_priority_requests_still_admits_a_higher_one() -> None:
    router = _router(workers=1, thresholds=Thresholds(busy_prefill_tokens=500, queue_size=2))
    assert router.submit(_classed("running", priority=0), now=0.0) is not None
    for i in range(2):
        assert router.submit(_classed(f"batch{i}", priority=0), now=0.0) is None
    with pytest.raises(QueueFull):
        router.submit(_classed("batch-more", priority=0), now=0.0)
    assert router.submit(_classed("premium", priority=100), now=0.0) is None
    assert router.queued == 3


def test_a_queue_one_tenant_filled_still_takes_another_tenants_request() -> None:
    router = _router(workers=1, thresholds=Thresholds(busy_prefill_tokens=500, queue_size=2))
    assert router.submit(_classed("running", priority=0), now=0.0) is not None
    for i in range(2):
        assert router.submit(_classed(f"heavy{i}", priority=0, tenant="heavy"), now=0.0) is None
    with pytest.raises(QueueFull):
        router.submit(_classed("heavy-more", priority=0, tenant="heavy"), now=0.0)
    assert router.submit(_classed("light", priority=0, tenant="light"), now=0.0) is None
    assert router.submit(_classed("other", priority=0, tenant="other"), now=0.0) is None
    with pytest.raises(QueueFull, match="4 requests"):
        router.submit(_classed("light-2", priority=0, tenant="third"), now=0.0)


def test_the_routed_token_log_keeps_only_the_rate_window_while_nothing_queues() -> None:
    """The routed rate is read only when a request queues: routing alone drops what falls out of
    the window, so the log does not grow with every request of a fleet that is never saturated."""
    router = _router(workers=1)
    window = router.thresholds.rate_window_s
    for i in range(100):
        assert router.submit(_classed(f"r{i}", priority=0), now=float(i)) is not None
        router.finish(f"r{i}", now=i + 0.5)
    assert len(router._routed_tokens) == window + 1, "one a second, over the window and its ends"
    assert router.routed_tokens_per_s(now=99.0) == 2000.0 * (window + 1) / window


def test_a_retry_on_another_worker_is_not_charged_to_the_tenant_again() -> None:
    router = _router(workers=2, limits=TenantLimits(tokens_per_minute={"a": 2000.0}))
    first = router.submit(_classed("a1", priority=0, tenant="a"), now=0.0)
    assert first is not None
    router.finish("a1", now=0.1)
    retried = router.submit(
        _classed("a1", priority=0, tenant="a"), now=0.1, exclude=frozenset({first.worker_id}), retry=True
    )
    assert retried is not None
    assert retried.worker_id != first.worker_id
    assert router._queue._bands[0].served["a"] == 2000.0, "charged once, for the first route"


def test_a_retry_is_charged_to_its_tenant_and_counted_once_at_the_peer_replica_too() -> None:
    """A peer mirrors a retry's load on its new worker but charges its tenant, and counts its
    tokens in the routed rate, only for the first route: both replicas hold the tenant at 2,000."""
    a = _router(workers=2, share_load=True)
    b = _router(workers=2)
    first = a.submit(_classed("a1", priority=0, tenant="a"), now=0.0)
    assert first is not None
    a.finish("a1", now=0.1)
    retried = a.submit(
        _classed("a1", priority=0, tenant="a"), now=0.1, exclude=frozenset({first.worker_id}), retry=True
    )
    assert retried is not None
    assert a.outbox is not None
    changes = list(a.outbox)
    assert [change.op for change in changes] == ["add", "free", "add"]
    for change in changes:
        b.apply_peer(change, peer="a", now=0.1)
    assert b.sequences.requests[b.slots.slot(retried.worker_id)] == 1, "the retry's load is mirrored"
    assert a._queue._bands[0].served["a"] == 2000.0
    assert b._queue._bands[0].served["a"] == 2000.0, "charged once, for the first route"
    later = a.thresholds.rate_window_s * 0.75  # a rate is known after half a window
    rate = 2000.0 / a.thresholds.rate_window_s
    assert a.routed_tokens_per_s(now=later) == b.routed_tokens_per_s(now=later) == rate


def test_a_first_route_with_workers_excluded_is_charged_and_rate_limited_here_and_at_the_peer() -> None:
    """A gateway's endpoint picker excludes the endpoints outside its subset on a request's first
    route: that request is no retry. Its tenant is charged here and at the peer replica (which
    hears it over the load messages, in their wire form), its tokens count in the routed rate of
    both, and it takes from its tenant's rate limit (the next one is refused)."""
    limits = TenantLimits(tokens_per_minute={"a": 3000.0})
    a = _router(workers=2, share_load=True, limits=limits)
    b = _router(workers=2)
    subset = frozenset({"w1"})  # the gateway offers w0 only
    routed = a.submit(_classed("a1", priority=0, tenant="a"), now=0.0, exclude=subset)
    assert routed is not None
    assert routed.worker_id == "w0"
    assert a._queue._bands[0].served["a"] == 2000.0, "charged here"
    assert a.outbox is not None
    _router_id, changes = decode_changes(encode_changes("a", list(a.outbox), seq=1))
    for change in changes:
        b.apply_peer(change, peer="a", now=0.0)
    assert b._queue._bands[0].served["a"] == 2000.0, "charged at the peer"
    later = a.thresholds.rate_window_s * 0.75  # a rate is known after half a window
    rate = 2000.0 / a.thresholds.rate_window_s
    assert a.routed_tokens_per_s(now=later) == b.routed_tokens_per_s(now=later) == rate
    with pytest.raises(RateLimited):
        a.submit(_classed("a2", priority=0, tenant="a"), now=0.1, exclude=subset)


def test_a_tenants_rate_limit_holds_across_replicas_not_once_per_replica() -> None:
    """What a peer replica let a tenant send takes from the tenant's bucket here too, though this
    replica knows none of the peer's workers: two replicas do not double a limit. A retry heard
    from the peer, and a snapshot of what it has in flight, take nothing (taken at the first route)."""
    a = _router(workers=2, share_load=True, limits=TenantLimits(tokens_per_minute={"a": 3000.0}))
    b = _router(workers=0, limits=TenantLimits(tokens_per_minute={"a": 3000.0}))
    b.add_worker(WorkerInfo(worker_id="elsewhere", role=Role.WORKER), now=0.0)
    first = a.submit(_classed("a1", priority=0, tenant="a"), now=0.0)
    assert first is not None
    a.finish("a1", now=0.1)
    assert a.submit(
        _classed("a1", priority=0, tenant="a"), now=0.1, exclude=frozenset({first.worker_id}), retry=True
    )
    assert a.outbox is not None
    changes = list(a.outbox)
    assert [change.op for change in changes] == ["add", "free", "add"]
    b.load_peer_snapshot("a", a.own_flights(), now=0.1)
    assert b.limits is not None
    assert b.limits.wait_s("a", 2000.0, now=0.1) == 0.0, "a snapshot takes nothing"
    for change in changes:
        b.apply_peer(change, peer="a", now=0.1)
    # taken when heard (0.1 s after a took it): 1,000 of 3,000 left, 20 s to the next 2,000
    assert b.limits.wait_s("a", 2000.0, now=0.1) == pytest.approx(20.0)
    with pytest.raises(RateLimited):
        b.submit(_classed("b1", priority=0, tenant="a"), now=0.1)
    assert b.submit(_classed("b2", priority=0, tenant="other"), now=0.1) is not None


def test_a_first_route_that_waits_with_workers_excluded_is_charged_when_the_queue_serves_it() -> None:
    """A gateway's request (endpoints outside its subset excluded) that has to wait is charged to
    its tenant when the queue serves it, as any first route is."""
    router = _router(workers=2, thresholds=Thresholds(busy_prefill_tokens=500))
    assert router.submit(_classed("b1", priority=0, tenant="b"), now=0.0) is not None
    assert router.submit(_classed("b2", priority=0, tenant="b"), now=0.0) is not None
    waiting = router.submit(_classed("a1", priority=0, tenant="a"), now=0.1, exclude=frozenset({"w1"}))
    assert waiting is None, "both workers are busy"
    on_w0 = next(rid for rid in ("b1", "b2") if (route := router.route_of(rid)) and route.worker_id == "w0")
    assert [route.request_id for route in router.finish(on_w0, now=0.2)] == ["a1"]
    band = router._queue._bands[0]
    assert band.virtual == 2000.0, "a1 started where b's second request had"
    assert band.served.get("a") == 4000.0, "charged its 2,000 tokens when the queue served it"


def test_a_retry_that_waits_in_the_queue_is_not_charged_to_the_tenant_again() -> None:
    """A retry (its first worker excluded) that has to wait is charged neither when it waits nor
    when the queue serves it: its tenant was charged when it was first routed."""
    router = _router(workers=2, thresholds=Thresholds(busy_prefill_tokens=500))
    first = router.submit(_classed("a1", priority=0, tenant="a"), now=0.0)
    assert first is not None
    assert router.submit(_classed("b1", priority=0, tenant="b"), now=0.0) is not None
    router.finish("a1", now=0.1)  # it failed before its first token: the service retries it
    retry = _classed("a1", priority=0, tenant="a")
    assert router.submit(retry, now=0.1, exclude=frozenset({first.worker_id}), retry=True) is None, (
        "b1 holds the other"
    )
    served = router._queue._bands[0].served
    assert served["a"] == 2000.0
    assert [route.request_id for route in router.finish("b1", now=0.2)] == ["a1"]
    assert served["a"] == 2000.0, "charged once, for the first route"


def test_one_router_charges_what_it_routes_at_once_so_the_queue_serves_the_tenant_served_least() -> None:
    """With one router, a request routed at once (a worker was free) counts against its tenant's
    share as much as one the queue served: a tenant that had the fleet to itself while the others
    sent nothing waits behind them once the fleet is saturated (until the others caught up), in
    whatever order they arrived."""
    router = _router(workers=1, thresholds=Thresholds(busy_prefill_tokens=500))
    for i in range(3):  # the heavy tenant alone: each request routed at once, 2,000 tokens
        assert router.submit(_classed(f"heavy-{i}", priority=0, tenant="heavy"), now=float(i)) is not None
        if i < 2:
            router.finish(f"heavy-{i}", now=i + 0.5)
    # the worker is busy with heavy-2: everything now waits, heavy's first
    assert router.submit(_classed("heavy-3", priority=0, tenant="heavy"), now=2.1) is None
    assert router.submit(_classed("light-0", priority=0, tenant="light"), now=2.2) is None
    assert router.submit(_classed("light-1", priority=0, tenant="light"), now=2.3) is None
    served = _finish_in_turn(router, "heavy-2", times=range(3, 6))
    # heavy's tag counts its 6,000 tokens, 2,000 past V (the start of heavy-2); light starts at
    # V, goes first and then ties with heavy at 6,000, where heavy-3, queued earlier, goes first
    # (were direct routes not charged, heavy-3 would tie with light-0 at 0 and go first)
    assert served == ["light-0", "heavy-3", "light-1"]


def test_a_peers_head_for_a_model_no_worker_here_serves_holds_nothing_back() -> None:
    router = _router(workers=1, thresholds=Thresholds(busy_prefill_tokens=500))
    assert router.submit(_classed("heavy-0", priority=0, tenant="heavy"), now=0.0) is not None
    router.finish("heavy-0", now=0.5)  # the heavy tenant was served 2,000 tokens: light comes first

    def light_waits_at_a(model: str, *, now: float) -> None:
        head = QueueHead(priority=0, start=0.0, tenant="light", virtual=0.0, model=model)
        router.apply_peer_queue("a", [head], now=now)

    light_waits_at_a("other", now=1.0)
    assert router.submit(_classed("heavy-1", priority=0, tenant="heavy"), now=1.0) is not None, (
        "no worker here serves 'other': that request will never take this capacity"
    )
    router.finish("heavy-1", now=1.5)
    light_waits_at_a("", now=2.0)
    assert router.submit(_classed("heavy-2", priority=0, tenant="heavy"), now=2.0) is None, "held back"
