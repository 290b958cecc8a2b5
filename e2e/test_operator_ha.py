"""Operator high availability on a real control plane: two replicas share the leader Lease;
SIGKILL of the leader mid-reconcile hands over to the warm standby, which finishes the work
without duplicates, orphans or gang restarts."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from e2e.operator_harness import (
    LEASE,
    Operator,
    seed,
    status,
    unresponsive,
    wait_running,
    wait_until,
    worker_pods,
)

from copse.cluster import Kubectl
from copse.operator import names
from copse.operator.testing import lease_holder

pytestmark = pytest.mark.e2e


def test_killing_the_leader_mid_reconcile_hands_over_to_the_standby(
    kubectl: Kubectl, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    standby = Operator(
        log=tmp_path / "standby.log", kubeconfig=operator.kubeconfig, lease=LEASE, identity="standby"
    )
    standby.start()
    replicas = {"session": operator, "standby": standby}
    try:
        # Both answer their probe (a standby is ready too); exactly one of them leads.
        wait_until(
            "both replicas healthy and one of them holding the Lease",
            lambda: (
                all(replica.health() is not None for replica in replicas.values())
                and [replica.leading for replica in replicas.values()].count(True) == 1
                and lease_holder(kubectl, LEASE) != ""
            ),
            operator=standby,
        )
        [(leader_name, leader)] = [(name, r) for name, r in replicas.items() if r.leading]
        survivor = next(r for r in replicas.values() if r is not leader)
        held_by = lease_holder(kubectl, LEASE)
        assert held_by.startswith(leader.identity), held_by

        kubectl.apply(seed("handover", replicas=4), namespace=namespace)
        wait_until(
            "the leader to start creating pods",
            lambda: len(worker_pods(kubectl, "handover", namespace)) > 0,
            operator=leader,
            timeout=60,
        )
        before = {
            pod["metadata"]["name"]: pod["metadata"]["uid"]
            for pod in worker_pods(kubectl, "handover", namespace)
        }
        # Usually mid-pass: some gangs exist, some are gated, some have no pod yet.
        print(f"killed the leader with {len(before)} of 8 worker pods made")
        killed_at = time.monotonic()
        leader.kill()
        # The standby waits out the Lease (it cannot know the leader is dead), then takes over.
        wait_until(
            "the standby to take the Lease over",
            lambda: lease_holder(kubectl, LEASE).startswith(survivor.identity),
            operator=survivor,
            timeout=10 * LEASE.lease_duration_s,
        )
        takeover_s = time.monotonic() - killed_at
        print(f"leader takeover after SIGKILL: {takeover_s:.1f}s (lease {LEASE.lease_duration_s:g}s)")
        # Its probe says so too (kopf caches probe answers for up to 10 s).
        wait_until("the standby to report itself the leader", lambda: survivor.leading, operator=survivor)
        wait_running(kubectl, "handover", namespace, survivor)

        pods = worker_pods(kubectl, "handover", namespace)
        assert sorted(pod["metadata"]["name"] for pod in pods) == sorted(
            f"handover-worker-{replica}-{rank}" for replica in range(4) for rank in range(2)
        ), "no duplicate and no missing pod"
        now = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in pods}
        assert {name: now[name] for name in before} == before, "the dead leader's pods were kept, not re-made"
        services = kubectl.items("services", "-l", names.LABEL_GROUP, namespace=namespace)
        assert sorted(s["metadata"]["name"] for s in services) == [f"handover-worker-{i}" for i in range(4)]
        assert all(
            s["metadata"].get("annotations", {}).get(names.ANNOTATION_RESTARTS, "0") == "0" for s in services
        ), "no gang was restarted for the takeover"
        events = kubectl.items("events", "--field-selector", "reason=GangRestart", namespace=namespace)
        assert events == []
        assert "became the leader" in survivor.log.read_text()

        # The killed replica comes back as a standby: the survivor keeps the Lease.
        leader.start()
        wait_until("the restarted replica to answer as a standby", lambda: leader.health() is not None,
                   operator=leader)  # fmt: skip
        assert not leader.leading
        held = lease_holder(kubectl, LEASE)
        assert held.startswith(survivor.identity), f"{leader_name} took the Lease back"
    finally:
        if operator.process is None or operator.process.poll() is not None:
            operator.start()
        standby.stop()  # a clean stop hands the Lease to the session's operator at once
    wait_until("the session's operator to lead again", lambda: operator.leading, operator=operator)


def _gang(kubectl: Kubectl, name: str, namespace: str) -> dict[str, tuple[str, str]]:
    """Worker pod name -> (uid, node)."""
    return {
        pod["metadata"]["name"]: (pod["metadata"]["uid"], pod["spec"].get("nodeName", ""))
        for pod in worker_pods(kubectl, name, namespace)
        if not pod["metadata"].get("deletionTimestamp")
    }


def test_a_drain_moves_the_gang_whole_through_its_disruption_budget(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    # No router to count in-flight requests here: a retired group goes at once.
    kubectl.apply(seed("drained", replicas=2, disruption={"drainTimeout": "0s"}), namespace=namespace)
    wait_running(kubectl, "drained", namespace, operator)
    budgets = {b["metadata"]["name"]: b for b in kubectl.items("pdb", namespace=namespace)}
    assert budgets["drained-worker-0"]["spec"]["minAvailable"] == 2, "TP=8 on 4-GPU trays: 2 pods"
    assert budgets["drained-worker-0"]["metadata"]["ownerReferences"][0]["kind"] == "Service"
    assert budgets["drained-router"]["spec"]["maxUnavailable"] == 1
    assert kubectl.get("deployment", "drained-router", namespace=namespace)["spec"]["replicas"] == 2
    before = _gang(kubectl, "drained", namespace)
    node = before["drained-worker-0-0"][1]
    moving = {pod for pod in before if pod.startswith("drained-worker-0-")}
    # The kubelet's and the disruption controller's view: the budget allows no eviction.
    wait_until(
        "the disruption controller to count the gang",
        lambda: (
            kubectl.get("pdb", "drained-worker-0", namespace=namespace)
            .get("status", {})
            .get("currentHealthy")
            == 2
        ),
        operator=operator,
    )
    drain = subprocess.Popen(
        [str(kubectl.executable), f"--kubeconfig={kubectl.kubeconfig}", "drain", node, "--ignore-daemonsets",
         "--delete-emptydir-data", "--timeout=180s"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:

        def moved() -> bool:
            gang = _gang(kubectl, "drained", namespace)
            return (
                drain.poll() is not None
                and status(kubectl, "drained", namespace).get("phase") == "Running"
                and node not in {where for _, where in gang.values()}
            )

        wait_until("the drain to finish and the gang to run elsewhere", moved, operator=operator, timeout=200)
        output = drain.stdout.read() if drain.stdout else ""
        assert drain.returncode == 0, output
        # The budget refused every eviction of the gang's pods: only the operator removed them, whole.
        assert "disruption budget" in output, output
        after = _gang(kubectl, "drained", namespace)
        others = {pod: where for pod, where in before.items() if pod not in moving}
        assert {pod: after[pod] for pod in others} == others, "the other gang kept its pods"
        assert _restarts(kubectl, namespace) == [], "moved by a roll to a successor, not restarted"
        events = kubectl.items("events", "--field-selector", "reason=Moved", namespace=namespace)
        assert [event["message"] for event in events] == [
            "group drained-worker-0 leaves its cordoned node: its successor serves"
        ]
    finally:
        if drain.poll() is None:
            drain.kill()
        kubectl.run("uncordon", node)


def _restarts(kubectl: Kubectl, namespace: str) -> list[str]:
    events = kubectl.items("events", "--field-selector", "reason=GangRestart", namespace=namespace)
    return [event["message"] for event in events]


def test_a_gang_with_a_pod_stuck_terminating_on_a_dead_node_is_replaced_elsewhere(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    """kwok force-deletes a terminating pod on its nodes itself (grace 0), which no kubelet of a
    dead node does; a finalizer of the test's holds the pod Terminating. The operator's own
    force-delete of a pod whose grace is still running is unit-tested
    (test_pods_stuck_terminating_on_a_dead_node_are_force_deleted_after_the_grace): here it must
    leave a pod already deleted with grace 0 alone, and the deployment serves again elsewhere."""
    kubectl.apply(seed("stuck", replicas=1, disruption={"notReadyGrace": "15s"}), namespace=namespace)
    wait_running(kubectl, "stuck", namespace, operator)
    node = _gang(kubectl, "stuck", namespace)["stuck-worker-0-1"][1]
    hold = [{"op": "add", "path": "/metadata/finalizers", "value": ["e2e.copse.dev/hold"]}]
    kubectl.run("patch", "pod", "stuck-worker-0-1", f"--namespace={namespace}", "--type=json",
                "--patch", json.dumps(hold))  # fmt: skip
    try:
        with unresponsive(kubectl, node):
            kubectl.run("delete", "pod", "stuck-worker-0-1", f"--namespace={namespace}", "--wait=false")
            wait_until(
                "a replacement gang Running off the dead node",
                lambda: (
                    status(kubectl, "stuck", namespace).get("ready") == "worker 1/1"
                    and any(
                        group["ready"] and node not in {pod["node"] for pod in group["pods"]}
                        for group in status(kubectl, "stuck", namespace).get("groups", [])
                    )
                ),
                operator=operator,
                timeout=120,
            )
            pod = kubectl.get("pod", "stuck-worker-0-1", namespace=namespace)
            assert pod["metadata"]["deletionTimestamp"], "still held Terminating"
    finally:
        release = json.dumps([{"op": "remove", "path": "/metadata/finalizers"}])
        kubectl.run("patch", "pod", "stuck-worker-0-1", f"--namespace={namespace}", "--type=json",
                    "--patch", release, check=False)  # fmt: skip
    events = kubectl.items("events", "--field-selector", "reason=ForceDeleted", namespace=namespace)
    assert events == [], "a pod already deleted with grace 0 is not deleted again"


def test_a_scale_up_during_a_drain_takes_the_draining_group_back(
    kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    # No router answers for the draining group's requests: it would wait out the whole timeout.
    kubectl.apply(seed("regrow", replicas=2, disruption={"drainTimeout": "600s"}), namespace=namespace)
    wait_running(kubectl, "regrow", namespace, operator)
    before = _gang(kubectl, "regrow", namespace)
    kubectl.run("scale", "idep/regrow", "--replicas=1", f"--namespace={namespace}")

    def draining() -> list[str]:
        pods = kubectl.items("pods", "-l", f"{names.LABEL_DRAINING}=true", namespace=namespace)
        return [pod["metadata"]["name"] for pod in pods]

    wait_until("a group to drain", lambda: bool(draining()), operator=operator)
    kubectl.run("scale", "idep/regrow", "--replicas=2", f"--namespace={namespace}")
    wait_until(
        "the draining group taken back",
        lambda: not draining() and status(kubectl, "regrow", namespace).get("ready") == "worker 2/2",
        operator=operator,
    )
    assert _gang(kubectl, "regrow", namespace) == before, "the same pods serve again: nothing was placed"
    events = kubectl.items("events", "--field-selector", "reason=DrainCancelled", namespace=namespace)
    assert len(events) == 1
    placed = kubectl.items("events", "--field-selector", "reason=Placed", namespace=namespace)
    assert len(placed) == 2, "only the two first placements"
