"""Expert-aware routing: learned class profiles, in-flight expert load per worker, placements
engines report, the kv_expert policy, and the rebalancer's proposal."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from copse.router.core import Role, Router, WorkerInfo
from copse.router.experts import ExpertTracker
from copse.router.policies import RouteRequest, SelectionSettings
from copse.workers.moe import ExpertPlacement, MoeConfig, moe_terms, static_placement
from copse.workers.perf import PerfModel, PolynomialPerfModel
from copse.workers.protocol import block_hashes

BS = 16
PERF = PolynomialPerfModel()
# 16 experts over 4 ranks (4 each), top-2: small enough to reason about.
SMALL = MoeConfig(experts=16, experts_per_token=2, hidden_size=1024, layers=4, expert_parallelism=4)


def counts(*experts: int, total: int = 1000) -> np.ndarray:
    """Activation counts spread evenly over ``experts``."""
    values = np.zeros(16)
    values[list(experts)] = total / len(experts)
    return values


def prompt(cls: int, salt: int) -> list[int]:
    """A class's shared first block (16 tokens), then tokens of the request's own."""
    return [1000 + cls] * BS + [(salt * 31 + i) % 997 + 2000 for i in range(BS)]


def request(rid: str, tokens: list[int], max_tokens: int = 100) -> RouteRequest:
    return RouteRequest(
        request_id=rid,
        hashes=block_hashes(tokens, block_size=BS),
        prompt_tokens=len(tokens),
        max_tokens=max_tokens,
    )


def key(cls: int) -> int:
    return block_hashes(prompt(cls, 0), block_size=BS)[0]


def test_expected_experts_are_learned_per_class_from_engine_reports() -> None:
    tracker = ExpertTracker(SMALL)
    assert np.allclose(tracker.expected(None), 1 / 16), "nothing reported: every expert alike"
    tracker.add("a", slot=0, key=key(0))
    tracker.report("a", counts(0, 1))
    tracker.remove("a")
    assert np.allclose(tracker.expected(key(0)), counts(0, 1) / 1000)
    # An unseen class gets the activations of everything reported so far.
    tracker.add("b", slot=0, key=key(1))
    tracker.report("b", counts(4, 5))
    assert np.allclose(tracker.expected(key(7)), (counts(0, 1) + counts(4, 5)) / 2000)


def test_in_flight_load_follows_the_placement_engines_report() -> None:
    tracker = ExpertTracker(SMALL)
    tracker.add("a", slot=0, key=None)
    tracker.report("a", counts(0, 1))  # teaches the model-wide shares; "a" was charged uniform
    tracker.add("b", slot=1, key=None)  # now expected on experts 0 and 1: rank 0 of the default placement
    assert np.allclose(tracker.loads()[1], [2, 0, 0, 0])
    # The engine moved expert 1 to rank 3 (and 12 to rank 0): the load in flight moves with it.
    slots = [list(rank) for rank in static_placement(experts=16, ranks=4).slots]
    slots[0][1], slots[3][0] = 12, 1
    tracker.set_placement(1, ExpertPlacement(slots=tuple(map(tuple, slots)), experts=16))
    assert np.allclose(tracker.loads()[1], [1, 0, 0, 1])
    tracker.remove("b")
    assert np.allclose(tracker.loads()[1], 0)
    with pytest.raises(ValueError, match="does not match"):
        tracker.set_placement(0, static_placement(experts=16, ranks=2))


def _router(policy: str) -> Router:
    router = Router(perf=PERF, settings=SelectionSettings(block_size=BS), policy=policy, seed=1, moe=SMALL)
    for name in ("w0", "w1"):
        router.add_worker(WorkerInfo(worker_id=name, role=Role.WORKER), now=0.0)
    return router


def _teach(router: Router) -> None:
    """Class 0 uses experts 0-1 (rank 0), class 1 experts 4-5 (rank 1)."""
    for cls, experts in ((0, (0, 1)), (1, (4, 5))):
        route = router.submit(request(f"teach{cls}", prompt(cls, 99)), now=0.0)
        assert route is not None
        router.report_experts(route.request_id, counts(*experts))
        router.finish(route.request_id, now=0.0)


@pytest.mark.parametrize("cls", [0, 1])
def test_kv_expert_sends_a_class_where_its_ranks_are_cold(cls: int) -> None:
    router = _router("kv_expert")
    _teach(router)
    tracker = router.experts
    assert tracker is not None
    slots = {name: router.slots.get(name) for name in ("w0", "w1")}
    # w0 decodes class 0 (its rank 0 hot), w1 class 1 (its rank 1 hot), as the tracker sees it.
    for i in range(4):
        tracker.add(f"busy0-{i}", slot=slots["w0"] or 0, key=key(0))
        tracker.add(f"busy1-{i}", slot=slots["w1"] or 0, key=key(1))
    route = router.submit(request("new", prompt(cls, 500)), now=0.0)
    assert route is not None
    assert route.worker_id == ("w1" if cls == 0 else "w0"), "where the class's own rank is cold"


def test_expert_blind_kv_ignores_the_expert_load() -> None:
    blind = _router("kv")
    _teach(blind)
    assert blind.experts is not None, "the tracker follows the load for every policy"
    for i in range(3):
        blind.submit(request(f"a{i}", prompt(0, i)), now=0.0)
    assert blind.experts.loads().sum() == pytest.approx(3 * 2)


def test_dense_routers_have_no_tracker_and_kv_expert_is_kv() -> None:
    router = Router(perf=PERF, settings=SelectionSettings(block_size=BS), policy="kv_expert", seed=1)
    router.add_worker(WorkerInfo(worker_id="w0", role=Role.WORKER), now=0.0)
    assert router.experts is None
    route = router.submit(request("r", prompt(0, 1)), now=0.0)
    assert route is not None
    router.report_experts("r", counts(0))  # ignored
    router.set_expert_placement("w0", static_placement(experts=16, ranks=4))  # ignored


def test_a_worker_that_leaves_forgets_its_expert_load() -> None:
    router = _router("kv_expert")
    route = router.submit(request("r", prompt(0, 1)), now=0.0)
    assert route is not None
    assert router.experts is not None
    assert router.experts.loads().sum() > 0
    router.remove_worker(route.worker_id)
    assert router.experts.loads().sum() == 0


def test_the_rebalancer_proposes_replicas_of_what_a_worker_served() -> None:
    tracker = ExpertTracker(SMALL)
    tracker.add("r", slot=0, key=None)
    tracker.report("r", counts(0, total=900) + counts(*range(16), total=100))
    proposal = tracker.proposal(0, slots=20)
    assert proposal.slots_per_rank == 5
    assert proposal.replicas()[0] == 4, "the hot expert on every rank, never twice on one"
    assert all(len(set(rank)) == 5 for rank in proposal.slots)
    assert len(proposal.global_assignments()) == 20


@pytest.mark.parametrize("cls", [0, 1])
def test_kv_expert_picks_the_decode_worker_where_the_class_is_cold(cls: int) -> None:
    router = Router(
        perf=PERF, settings=SelectionSettings(block_size=BS), policy="kv_expert", seed=1, moe=SMALL
    )
    for name, role in (("p0", Role.PREFILL), ("d0", Role.DECODE), ("d1", Role.DECODE)):
        router.add_worker(WorkerInfo(worker_id=name, role=role, locality="rack"), now=0.0)
    tracker = router.experts
    assert tracker is not None
    for c, experts in ((0, (0, 1)), (1, (4, 5))):
        tracker.add(f"teach{c}", slot=0, key=key(c))
        tracker.report(f"teach{c}", counts(*experts))
        tracker.remove(f"teach{c}")
    for i in range(4):
        tracker.add(f"busy0-{i}", slot=router.slots.get("d0") or 0, key=key(0))
        tracker.add(f"busy1-{i}", slot=router.slots.get("d1") or 0, key=key(1))
    long_prompt = prompt(cls, 7) + [(i * 13) % 997 + 3000 for i in range(4000)]
    route = router.submit(request("new", long_prompt), now=0.0)
    assert route is not None
    assert route.prefill_worker_id == "p0"
    assert route.worker_id == ("d1" if cls == 0 else "d0")


# A slow expert-parallel link (0.5 GB/s): the all-to-all is a large part of the step.
SLOW_LINK = dataclasses.replace(SMALL, link_bandwidth_gbps=0.5)


@dataclasses.dataclass(frozen=True)
class ProfiledMoe(PerfModel):
    """What a profiler measures of ``SLOW_LINK`` engines of balanced ``base`` steps: each decode
    step holds the all-to-all of its batch (requests alike, so no stretch)."""

    base: PerfModel

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_capacity_tokens", self.base.kv_capacity_tokens)
        object.__setattr__(self, "gpus_per_engine", self.base.gpus_per_engine)

    def prefill_curve_ms(self, isl: float) -> float:
        return self.base.prefill_curve_ms(isl)

    def decode_itl_ms(self, *, active_kv_tokens: float, context_length: float) -> float:
        requests = active_kv_tokens / max(context_length, 1.0)
        loads = np.full(4, requests * SLOW_LINK.experts_per_token / 4)
        _, all_to_all_ms = moe_terms(SLOW_LINK, loads)
        base = self.base.decode_itl_ms(active_kv_tokens=active_kv_tokens, context_length=context_length)
        return base + float(all_to_all_ms)


def _choice(*, perf: PerfModel, moe_perf: PerfModel | None) -> str:
    """Where ``kv_expert`` sends a request when w0 is prefilling a long prompt (its time to first
    token is longer) and w1 decodes 8 requests (its all-to-all carries more)."""
    router = Router(
        perf=perf,
        settings=SelectionSettings(block_size=BS),
        policy="kv_expert",
        seed=1,
        moe=SLOW_LINK,
        moe_perf=moe_perf,
    )
    for name in ("w0", "w1"):
        router.add_worker(WorkerInfo(worker_id=name, role=Role.WORKER), now=0.0)
    for i in range(8):
        route = router.submit(request(f"d{i}", [3000 + i] * 4 * BS, 200), now=0.0, exclude=frozenset({"w0"}))
        assert route is not None
        assert route.worker_id == "w1"
        router.prefill_done(route.request_id, now=0.0)
    route = router.submit(request("long", [2000] * 2048), now=0.0, exclude=frozenset({"w1"}))
    assert route is not None
    assert route.worker_id == "w0"
    route = router.submit(request("new", [4000] * 4 * BS, 200), now=0.0)
    assert route is not None
    return route.worker_id


def test_on_a_measured_profile_kv_expert_does_not_count_the_all_to_all_twice() -> None:
    profiled = ProfiledMoe(base=PERF)
    # The oracle: the engines' balanced step, the all-to-all added once. w1's 8 decodes cost the
    # new request less than waiting behind w0's prefill.
    assert _choice(perf=PERF, moe_perf=PERF) == "w1"
    # The profile (its steps hold the all-to-all) with the balanced step beside it, and the
    # profile alone (only the deviation from an average load added: none here): w1 too.
    assert _choice(perf=profiled, moe_perf=PERF) == "w1"
    assert _choice(perf=profiled, moe_perf=None) == "w1"
    # Adding the all-to-all to the profile's steps again charges w1's large batch twice: w0.
    assert _choice(perf=profiled, moe_perf=profiled) == "w0"


def test_without_a_balanced_step_only_the_deviation_from_an_average_load_is_added() -> None:
    tracker = ExpertTracker(SMALL)
    for cls, experts in ((0, (0, 1)), (1, (4, 5))):  # class 0 on rank 0, class 1 on rank 1
        tracker.add(f"teach{cls}", slot=0, key=key(cls))
        tracker.report(f"teach{cls}", counts(*experts))
        tracker.remove(f"teach{cls}")
    for i in range(3):
        tracker.add(f"busy{i}", slot=0, key=key(0))  # w0: class 0 in flight, its rank 0 hot
    tracker.add("other", slot=1, key=key(1))  # w1: one of class 1
    balanced = np.array([5.0, 7.0])
    # What a profile of these engines measured: the average load of as many requests on each
    # (the new request included), half on rank 0 and half on rank 1.
    average = np.array([4.0, 2.0])[:, None] * SMALL.experts_per_token * np.array([0.5, 0.5, 0.0, 0.0])
    factor, all_to_all_ms = moe_terms(SMALL, average)
    profiled = balanced * factor + all_to_all_ms
    predicted = profiled + tracker.moe_ms(key(0), profiled, balanced=False)
    # The balanced step with the whole terms for the real load, whichever step the router has.
    assert predicted == pytest.approx(balanced + tracker.moe_ms(key(0), balanced, balanced=True))
    assert predicted[0] > profiled[0], "class 0 joining class 0: more skewed than the average"
    assert predicted[1] == pytest.approx(profiled[1]), "class 0 joining class 1: the average"
    # Nothing reported: every request alike, as the profile's average; nothing to add.
    blind = ExpertTracker(SMALL)
    blind.add("x", slot=0, key=key(0))
    assert blind.moe_ms(key(1), profiled, balanced=False) == pytest.approx(np.zeros(2))
