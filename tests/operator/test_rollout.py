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


def overcommitted(harness: Harness) -> dict[str, int]:
    """Nodes whose GPUs the live (not terminating) pods ask more of than the node has."""
    asked: Counter[str] = Counter()
    for pod in harness.pods():
        if pod["metadata"].get("deletionTimestamp"):
            continue
        terms = pod["spec"].get("affinity", {}).get("nodeAffinity", {})
        terms = terms.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])
        nodes = {
            value
            for term in terms
            for field in term.get("matchFields", [])
            for value in field.get("values", [])
        }
        node = pod["spec"].get("nodeName") or (nodes.pop() if len(nodes) == 1 else None)
        if node is not None:
            limits = pod["spec"]["containers"][0].get("resources", {}).get("limits", {})
            asked[node] += int(limits.get("nvidia.com/gpu", 0))
    capacity = {
        name: int(node["status"]["allocatable"].get("nvidia.com/gpu", 0))
        for name, node in harness.kube.nodes.items()
    }
    return {node: gpus for node, gpus in asked.items() if gpus > capacity.get(node, 0)}


async def test_a_group_retired_in_a_pass_keeps_its_gpus_from_the_groups_placed_in_it() -> None:
    """A roll drains an old group and places a new one in the same pass: the new group must not
    land on the GPUs the old one still holds (it would be restarted by the next pass, as the chaos
    run saw right after a leader takeover)."""
    harness = Harness(racks=1, replicas=3, rollout={"maxSurge": 1, "maxUnavailable": 1})
    await harness.settle()
    harness.update_spec(engine={"image": "trtllm:next"})
    for _ in range(40):
        before = harness.snapshot()
        harness.kube.sync(harness.controller)
        await harness.controller.reconcile_once(KEY)
        assert overcommitted(harness) == {}
        harness.kube.kubelet()
        if harness.snapshot() == before:
            break
    assert "GangRestart" not in [reason for _, reason, _ in harness.kube.events]
