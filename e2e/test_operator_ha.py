"""Operator high availability on a real control plane: two replicas share the leader Lease;
SIGKILL of the leader mid-reconcile hands over to the warm standby, which finishes the work
without duplicates, orphans or gang restarts."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2e.operator_harness import (
    LEASE_TIMINGS,
    Operator,
    lease_holder,
    seed,
    wait_running,
    wait_until,
    worker_pods,
)

from copse.cluster import Kubectl
from copse.operator import names

pytestmark = pytest.mark.e2e


def test_killing_the_leader_mid_reconcile_hands_over_to_the_standby(
    kubectl: Kubectl, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    standby = Operator(log=tmp_path / "standby.log", kubeconfig=operator.kubeconfig, identity="standby")
    standby.start()
    replicas = {"session": operator, "standby": standby}
    try:
        # Both answer their probe (a standby is ready too); exactly one of them leads.
        wait_until(
            "both replicas healthy and one of them holding the Lease",
            lambda: (
                all(replica.health() is not None for replica in replicas.values())
                and [replica.leading for replica in replicas.values()].count(True) == 1
                and lease_holder(kubectl) != ""
            ),
            operator=standby,
        )
        [(leader_name, leader)] = [(name, r) for name, r in replicas.items() if r.leading]
        survivor = next(r for r in replicas.values() if r is not leader)
        held_by = lease_holder(kubectl)
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
        assert len(before) < 8, "killed mid-reconcile: the gangs are not all there yet"
        killed_at = time.monotonic()
        leader.kill()
        # The standby waits out the Lease (it cannot know the leader is dead), then takes over.
        wait_until(
            "the standby to take the Lease over",
            lambda: lease_holder(kubectl).startswith(survivor.identity) and survivor.leading,
            operator=survivor,
            timeout=4 * LEASE_TIMINGS[0],
        )
        takeover_s = time.monotonic() - killed_at
        print(f"leader takeover after SIGKILL: {takeover_s:.1f}s (lease duration {LEASE_TIMINGS[0]:g}s)")
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
        assert lease_holder(kubectl).startswith(survivor.identity), f"{leader_name} took the Lease back"
    finally:
        if operator.process is None or operator.process.poll() is not None:
            operator.start()
        standby.stop()  # a clean stop hands the Lease to the session's operator at once
    wait_until("the session's operator to lead again", lambda: operator.leading, operator=operator)
