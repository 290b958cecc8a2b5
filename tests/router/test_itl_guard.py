"""ITL-aware admission: an objective's ITL target keeps lower priorities' prefill off the workers
where its requests decode, while the latency model predicts that prefill would lengthen their
steps past the target; such requests go elsewhere or wait (and lower priorities wait first)."""

from __future__ import annotations

import numpy as np

from copse.router.config import parse_config
from copse.router.core import Role, Router, Thresholds, WorkerInfo
from copse.router.policies import RouteRequest, SelectionSettings
from copse.workers.perf import PolynomialPerfModel

BS = 16
ITL_MS = 60.0
LONG = 9000
"""A prompt whose prefill chunk alone makes a step far longer than ``ITL_MS``."""


def _router() -> Router:
    router = Router(
        perf=PolynomialPerfModel(),
        settings=SelectionSettings(block_size=BS),
        thresholds=Thresholds(busy_prefill_tokens=8000),
        seed=1,
    )
    for name in ("w0", "w1"):
        router.add_worker(WorkerInfo(worker_id=name, role=Role.WORKER), now=0.0)
    return router


def _request(rid: str, prompt: int, *, priority: int = 0, itl_ms: float | None = None) -> RouteRequest:
    # Distinct hashes per request: no cache hit anywhere.
    hashes = [hash((rid, i)) & 0xFFFF_FFFF_FFFF_FFFF for i in range(prompt // BS)]
    return RouteRequest(
        request_id=rid,
        hashes=hashes,
        prompt_tokens=prompt,
        max_tokens=50,
        priority=priority,
        itl_slo_ms=itl_ms,
    )


def test_lower_priorities_keep_their_long_prefill_off_the_premium_worker_or_wait() -> None:
    router = _router()
    premium = router.submit(_request("premium", 64, priority=100, itl_ms=ITL_MS), now=0.0)
    assert premium is not None
    router.prefill_done("premium", now=0.1)
    guarded = premium.worker_id
    other = "w1" if guarded == "w0" else "w0"
    slot = router.slots.get(guarded)
    assert slot is not None
    steps = router.steps_ms_with(_request("x", LONG), new_tokens=np.full(router.sequences.size, float(LONG)))
    assert steps[slot] > ITL_MS, "the test's long prompt must break the target"
    # A short prompt fits the premium worker's steps; a long one goes to the other worker.
    short = router.submit(_request("short", 64), now=0.2)
    assert short is not None
    # (A lower band while a higher one is routed: a prompt longer than a step waits for a worker
    # with no prefill queued.)
    router.prefill_done("short", now=0.2)
    long_one = router.submit(_request("long", LONG), now=0.2)
    assert long_one is not None
    assert long_one.worker_id == other
    # The other worker is busy now (9,000 prefill tokens > 8,000): the next long batch request waits
    # rather than join the premium worker, while a premium request of the same shape goes there.
    assert router.submit(_request("waits", LONG), now=0.3) is None
    assert router.queued == 1
    released = router.finish("premium", now=0.4)  # the guard leaves with the request: it goes
    assert [route.request_id for route in released] == ["waits"]
    assert released[0].worker_id == guarded


def test_an_equal_priority_is_not_held_back_and_a_guard_leaves_with_its_worker() -> None:
    router = _router()
    first = router.submit(_request("p1", 64, priority=100, itl_ms=ITL_MS), now=0.0)
    assert first is not None
    router.prefill_done("p1", now=0.1)
    other = "w1" if first.worker_id == "w0" else "w0"
    assert router.submit(_request("batch", LONG), now=0.2) is not None  # to the other worker
    # A premium request with a long prompt: the other worker is busy, the guarded one takes it
    # (a guard holds back lower priorities only; its own prefill is its own cost).
    second = router.submit(_request("p2", LONG, priority=100, itl_ms=ITL_MS), now=0.3)
    assert second is not None
    assert second.worker_id == first.worker_id
    # The guarded worker leaves: its guards go with it, and nothing holds back the rest.
    lost = router.remove_worker(first.worker_id)
    assert sorted(lost) == ["p1", "p2"]
    router.finish("batch", now=0.4)
    after = router.submit(_request("after", LONG), now=0.5)
    assert after is not None
    assert after.worker_id == other


def test_a_premium_request_prefers_workers_whose_steps_stay_within_its_target() -> None:
    router = _router()
    batch = router.submit(_request("batch", 7000), now=0.0)  # below the busy threshold
    assert batch is not None
    premium = router.submit(_request("premium", 64, priority=100, itl_ms=ITL_MS), now=0.1)
    assert premium is not None
    assert premium.worker_id != batch.worker_id


def test_the_objective_itl_target_reaches_the_route_request() -> None:
    config = parse_config(
        {
            "model": "m",
            "engine": "mock",
            "discovery": {"kind": "static", "workers": [{"url": "http://127.0.0.1:1"}]},
            "objectives": {"premium": {"priority": 100, "ttft_ms": 2000, "itl_ms": 50}},
        },
        source="test",
    )
    premium = config.classes().objective("premium")
    assert (premium.priority, premium.ttft_ms, premium.itl_ms) == (100, 2000, 50)
    classes = config.classes()
    classes.set_priorities({"premium": 7})
    assert classes.objective("premium").itl_ms == 50
