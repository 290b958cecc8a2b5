"""Rollouts on the real control plane: a canary partition, then the rest of a disaggregated roll
with surge, sampled from the API all along (capacity, group count, P/D pairs per revision); a
replica patch in between rolls nothing."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from e2e.operator_harness import Operator, seed, status, wait_running, wait_until, worker_pods

from copse.cluster import Kubectl
from copse.operator import names

pytestmark = pytest.mark.e2e


def _serving(pods: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(role, revision) of every ready, non-draining rank-0 pod (one per serving group)."""
    found = []
    for pod in pods:
        labels = pod["metadata"]["labels"]
        ready = any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in pod.get("status", {}).get("conditions", [])
        )
        leaving = pod["metadata"].get("deletionTimestamp") or names.LABEL_DRAINING in labels
        if labels[names.LABEL_RANK] == "0" and ready and not leaving:
            found.append((labels[names.LABEL_ROLE], labels[names.LABEL_REVISION]))
    return found


def _ready(kubectl: Kubectl, namespace: str) -> str:
    return str(status(kubectl, "roll", namespace).get("ready"))


def _patch(kubectl: Kubectl, namespace: str, spec: dict[str, Any], name: str = "roll") -> None:
    kubectl.run("patch", f"idep/{name}", "--type=merge", "--patch", json.dumps({"spec": spec}),
                f"--namespace={namespace}")  # fmt: skip


def test_a_canary_then_the_rest_of_a_disaggregated_roll_keeps_pairs_and_capacity(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    pools = {
        "prefill": {"replicas": 2, "tensorParallelism": 4},
        "decode": {"replicas": 2, "tensorParallelism": 4},
    }
    manifest = seed(
        "roll", **pools, rollout={"partition": 1, "maxSurge": 1}, disruption={"drainTimeout": "0s"}
    )
    kubectl.apply(manifest, namespace=namespace)
    wait_running(kubectl, "roll", namespace, operator)
    old = status(kubectl, "roll", namespace)["revision"]
    before = {
        pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in worker_pods(kubectl, "roll", namespace)
    }

    # A replica patch (what the planner sends) rolls nothing.
    _patch(kubectl, namespace, {"decode": {"replicas": 3, "tensorParallelism": 4}})
    wait_until(
        "decode to grow", lambda: _ready(kubectl, namespace) == "prefill 2/2, decode 3/3", operator=operator
    )
    _patch(kubectl, namespace, {"decode": {"replicas": 2, "tensorParallelism": 4}})
    wait_until(
        "decode to shrink", lambda: _ready(kubectl, namespace) == "prefill 2/2, decode 2/2", operator=operator
    )
    events = kubectl.items("events", "--field-selector", "reason=RollingUpdate", namespace=namespace)
    assert events == []
    now = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in worker_pods(kubectl, "roll", namespace)}
    kept = {name: uid for name, uid in now.items() if name in before}
    assert len(kept) == len(before) - 2 or kept == before, "only a scaled-down group's pods may go"
    assert all(before[name] == uid for name, uid in kept.items()), "no pod re-made"

    samples: list[list[tuple[str, str]]] = []
    counts: list[dict[str, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            pods = worker_pods(kubectl, "roll", namespace)
            samples.append(_serving(pods))
            leaders = [p for p in pods if p["metadata"]["labels"][names.LABEL_RANK] == "0"]
            counts.append({role: sum(p["metadata"]["labels"][names.LABEL_ROLE] == role for p in leaders)
                           for role in ("prefill", "decode")})  # fmt: skip
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        _patch(kubectl, namespace, {"engine": {"args": ["--log_level=debug"]}})

        def canary() -> bool:
            roles = status(kubectl, "roll", namespace).get("roles", {})
            return all(roles.get(r, {}).get("updatedReady") == 1 and roles[r].get("old") == 1 for r in pools)

        wait_until("the canary: one new group per role, one old kept", canary, operator=operator, timeout=120)
        current = status(kubectl, "roll", namespace)
        assert current["revision"] != old
        assert {revision for _, revision in _serving(worker_pods(kubectl, "roll", namespace))} == {
            old,
            current["revision"],
        }

        _patch(kubectl, namespace, {"rollout": {"partition": 0, "maxSurge": 1}})

        def done() -> bool:
            roles = status(kubectl, "roll", namespace).get("roles", {})
            return all(
                roles.get(r, {}).get("updatedReady") == 2 and roles[r].get("old") == 0 for r in pools
            ) and {revision for _, revision in _serving(worker_pods(kubectl, "roll", namespace))} == {
                current["revision"]
            }

        wait_until("the rest of the roll", done, operator=operator, timeout=180)
        # one sample of the rolled deployment, however fast the roll went
        taken = len(samples)
        wait_until("a sample after the roll", lambda: len(samples) > taken, operator=operator, timeout=60)
    finally:
        stop.set()
        sampler.join(timeout=30)
    paired: set[str] = set()
    """Revisions seen with a ready prefill and decode group."""
    for seen in samples:
        pairs = {r for _, r in seen if ("prefill", r) in seen and ("decode", r) in seen}
        assert pairs, f"no P/D pair: {seen}"
        # A new revision's prefill may be ready before its decode (the router sends it nothing
        # until then), but a revision that had a pair never keeps prefill without decode.
        alone = {r for role, r in seen if role == "prefill" and ("decode", r) not in seen}
        assert not alone & paired, f"a revision lost its pair but kept prefill: {seen}"
        paired |= pairs
        serving = {role: sum(1 for r, _ in seen if r == role) for role in pools}
        assert min(serving.values()) >= 2, f"capacity below desired - maxUnavailable: {seen}"
    assert {old, current["revision"]} <= paired, "the samples span the roll: both revisions seen paired"
    assert max(max(c.values()) for c in counts) <= 2 + 1, "at most one group of surge per role"


def _images(kubectl: Kubectl, name: str, namespace: str) -> dict[str, tuple[str, str]]:
    """Worker pod name -> (uid, engine image)."""
    return {
        pod["metadata"]["name"]: (pod["metadata"]["uid"], pod["spec"]["containers"][0]["image"])
        for pod in worker_pods(kubectl, name, namespace)
    }


def test_an_operator_upgrade_with_a_new_image_rolls_nothing_until_the_spec_changes(
    kubectl: Kubectl, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    manifest = seed(
        "upgraded",
        replicas=1,
        model={"name": "mock-model", "tensorParallelism": 4},
        engine={"backend": "mock"},
        disruption={"drainTimeout": "0s"},
    )
    kubectl.apply(manifest, namespace=namespace)
    wait_running(kubectl, "upgraded", namespace, operator)
    before = _images(kubectl, "upgraded", namespace)
    [(_, old_image)] = before.values()
    # The chart's new release: the same operator, a new default image (``copse operator run --image``).
    operator.stop()
    upgraded = Operator(
        log=tmp_path / "upgraded.log", kubeconfig=operator.kubeconfig, lease=operator.lease,
        flags=("--image=copse:upgraded",),
    )  # fmt: skip
    upgraded.start()
    try:
        wait_until("the upgraded operator to lead", lambda: upgraded.leading, operator=upgraded)
        # A scale-up places a group of the same revision: it runs its peers' image, not the new default.
        kubectl.run("scale", "idep/upgraded", "--replicas=2", f"--namespace={namespace}")
        wait_until(
            "the second group", lambda: status(kubectl, "upgraded", namespace).get("ready") == "worker 2/2",
            operator=upgraded,
        )  # fmt: skip
        now = _images(kubectl, "upgraded", namespace)
        assert {pod: now[pod] for pod in before} == before, "no pod re-made"
        assert {image for _, image in now.values()} == {old_image}, "one revision, one image"
        assert kubectl.items("events", "--field-selector", "reason=RollingUpdate", namespace=namespace) == []
        [kept] = kubectl.items("events", "--field-selector", "reason=RevisionImage", namespace=namespace)
        assert f"run {old_image}, the image of revision" in kept["message"]
        assert "not the operator's default copse:upgraded" in kept["message"]
        # The next spec change is a new revision: it rolls, onto the new default.
        _patch(
            kubectl, namespace, {"engine": {"backend": "mock", "args": ["--decode-speedup", "2"]}}, "upgraded"
        )
        wait_until(
            "the roll onto the new image",
            lambda: (
                {image for _, image in _images(kubectl, "upgraded", namespace).values()} == {"copse:upgraded"}
                and status(kubectl, "upgraded", namespace).get("ready") == "worker 2/2"
            ),
            operator=upgraded,
            timeout=180,
        )
    finally:
        upgraded.stop()
        operator.start()
    wait_until("the session's operator to lead again", lambda: operator.leading, operator=operator)
