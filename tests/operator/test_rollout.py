"""Rollouts within spec.rollout, pass by pass against the in-memory cluster: surge and
unavailability bounds, canary partition, pause, a revert mid-roll, and P/D revision coherence."""

from __future__ import annotations

from collections import Counter
from typing import Any

from copse.operator import names
from copse.operator.children import TRTLLM_IMAGE

from .test_reconcile import KEY, Harness


def leaders(harness: Harness) -> list[dict[str, Any]]:
    return [p for p in harness.pods() if p["metadata"]["labels"][names.LABEL_RANK] == "0"]


def running(pod: dict[str, Any]) -> bool:
    return bool(
        pod.get("status", {}).get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")
    )


def image(pod: dict[str, Any]) -> str:
    return str(pod["spec"]["containers"][0]["image"])


async def passes(harness: Harness, *, limit: int = 40) -> list[list[dict[str, Any]]]:
    """Reconcile pass by pass until nothing changes; the rank-0 pods after each pass."""
    seen = []
    for _ in range(limit):
        before = harness.snapshot()
        harness.kube.sync(harness.controller)
        await harness.controller.reconcile_once(KEY)
        harness.kube.kubelet()
        seen.append(leaders(harness))
        if harness.snapshot() == before:
            return seen
    raise AssertionError(f"no steady state after {limit} passes")


async def test_surge_and_unavailability_bound_every_pass() -> None:
    harness = Harness(racks=3, replicas=4, rollout={"maxSurge": 2, "maxUnavailable": 1})
    await harness.settle()
    harness.update_spec(engine={"image": "trtllm:next"})
    seen = await passes(harness)
    assert max(len(pods) for pods in seen) <= 4 + 2, "at most maxSurge groups above the replicas"
    assert min(sum(running(p) for p in pods) for pods in seen) >= 4 - 1, "at most maxUnavailable fewer"
    assert max(len(pods) for pods in seen) > 5, "the surge room is used: two new groups at once"
    assert Counter(image(p) for p in seen[-1]) == {"trtllm:next": 4}
    worker = harness.status["roles"]["worker"]
    assert (worker["updated"], worker["updatedReady"], worker["old"]) == (4, 4, 0)


async def test_no_surge_replaces_in_place_one_unavailable_group_at_a_time() -> None:
    harness = Harness(racks=3, replicas=3, rollout={"maxSurge": 0, "maxUnavailable": 1})
    await harness.settle()
    harness.update_spec(engine={"image": "trtllm:next"})
    seen = await passes(harness)
    assert max(len(pods) for pods in seen) <= 3, "never a group above the replicas"
    assert min(sum(running(p) for p in pods) for pods in seen) >= 2
    assert Counter(image(p) for p in seen[-1]) == {"trtllm:next": 3}


async def test_a_partition_keeps_a_canary_and_a_pause_holds_the_roll() -> None:
    harness = Harness(racks=3, replicas=3, rollout={"partition": 2})
    await harness.settle()
    harness.update_spec(engine={"image": "trtllm:canary"})
    seen = await passes(harness)
    assert Counter(image(p) for p in seen[-1]) == {"trtllm:canary": 1, TRTLLM_IMAGE: 2}
    worker = harness.status["roles"]["worker"]
    assert (worker["updated"], worker["old"], worker["ready"]) == (1, 2, 3)

    harness.update_spec(rollout={"partition": 0, "paused": True})
    await passes(harness)
    assert Counter(image(p) for p in leaders(harness))["trtllm:canary"] == 1, "paused: nothing moves"

    harness.update_spec(rollout={"partition": 0, "paused": False})
    seen = await passes(harness)
    assert Counter(image(p) for p in seen[-1]) == {"trtllm:canary": 3}


async def test_a_revert_mid_roll_converges_within_the_bounds() -> None:
    harness = Harness(racks=3, replicas=3)
    await harness.settle()
    original = image(leaders(harness)[0])
    harness.update_spec(engine={"image": "trtllm:bad"})
    seen = []
    for _ in range(3):  # the roll gets under way: a surge group, maybe an old one draining
        harness.kube.sync(harness.controller)
        await harness.controller.reconcile_once(KEY)
        harness.kube.kubelet()
        seen.append(leaders(harness))
    assert any(image(p) == "trtllm:bad" for p in seen[-1])
    harness.update_spec(engine={})  # the revert
    seen += await passes(harness)
    assert max(len(pods) for pods in seen) <= 3 + 1
    assert min(sum(running(p) for p in pods) for pods in seen) >= 3, "maxUnavailable 0 holds through it"
    assert Counter(image(p) for p in seen[-1]) == {original: 3}


async def test_prefill_and_decode_roll_so_each_revision_keeps_a_routable_pair() -> None:
    harness = Harness(racks=3, prefill={"replicas": 2, "tensorParallelism": 4}, decode={"replicas": 2})
    await harness.settle()
    old_revision = harness.status["revision"]
    harness.update_spec(engine={"image": "trtllm:next"})
    seen = await passes(harness)
    mixed = [pods for pods in seen if len({p["metadata"]["labels"][names.LABEL_REVISION] for p in pods}) > 1]
    assert len(mixed) >= 3, "the roll went through several passes with both revisions"
    for pods in seen:
        serving = {
            (p["metadata"]["labels"][names.LABEL_ROLE], p["metadata"]["labels"][names.LABEL_REVISION])
            for p in pods
            if running(p)
        }
        revisions = {revision for _, revision in serving}
        paired = {r for r in revisions if {("prefill", r), ("decode", r)} <= serving}
        assert paired, f"no routable P/D pair in {serving}"
        assert all(r in paired for r in revisions if ("prefill", r) in serving), (
            f"a revision serves prefill without decode: {serving}"
        )
    new_revision = harness.status["revision"]
    assert new_revision != old_revision
    assert {p["metadata"]["labels"][names.LABEL_REVISION] for p in seen[-1]} == {new_revision}
