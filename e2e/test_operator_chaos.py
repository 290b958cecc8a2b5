"""The control plane under chaos, with real traffic: mocked engines and the deployment's own router
processes serve streams on loopback pod IPs while the engine image of a disaggregated deployment
rolls, the operator leader is SIGKILLed mid-roll and a node under a decode gang is drained
(:mod:`copse.cluster.chaos`; ``benchmarks/operator_chaos.py`` runs it larger)."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e.operator_harness import LEASE, Operator, wait_until

from copse.cluster import Kubectl
from copse.cluster.chaos import ChaosSettings, run

pytestmark = pytest.mark.e2e


def test_a_disaggregated_roll_under_streams_survives_a_leader_kill_and_a_node_drain(
    kubectl: Kubectl, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    standby = Operator(
        log=tmp_path / "standby.log", kubeconfig=operator.kubeconfig, lease=LEASE, identity="standby"
    )
    standby.start()
    settings = ChaosSettings(prefill=2, decode=1, streams=24, max_tokens=32)
    try:
        wait_until(
            "both replicas healthy, one leading",
            lambda: operator.health() is not None and standby.health() is not None,
            operator=standby,
        )
        report = run(
            kubectl, namespace=namespace, operators=[operator, standby], settings=settings, logs=tmp_path
        )
    finally:
        if operator.process is None or operator.process.poll() is not None:
            operator.start()
        standby.stop()  # a clean stop hands the Lease to the session's operator at once
    wait_until("the session's operator to lead again", lambda: operator.leading, operator=operator)

    streams = report.streams
    print(
        f"{streams.started} streams, {streams.ok} ok; roll converged in {report.converge_s:.1f}s; "
        f"leader takeover {report.takeover_s:.1f}s; drain {report.drain['moved_s']:.1f}s; "
        f"routes {report.routes}; capacity {report.capacity}"
    )
    assert streams.failures == [], streams.failures[:5]
    assert streams.ok == streams.started > settings.streams
    # The routers paired prefill and decode only within a revision, and used both revisions.
    assert report.mixed_routes == 0, report.routes
    assert report.routes.get((report.old_revision, report.old_revision), 0) > 0, report.routes
    assert report.routes.get((report.new_revision, report.new_revision), 0) > 0, report.routes
    # Capacity never below desired - maxUnavailable (0), in the pods and in every router.
    capacity = report.capacity
    assert capacity.router_samples > 20
    assert capacity.pod_samples > 10
    assert (capacity.router_below_floor, capacity.pods_below_floor) == (0, 0), capacity
    assert capacity.router_min == {"prefill": 2, "decode": 1}, capacity
    assert capacity.pods_min == {"prefill": 2, "decode": 1}, capacity
    assert capacity.no_pair == 0, capacity
    assert capacity.most_groups == {"prefill": 2 + 1, "decode": 1 + 1}, "one group of surge per role"
    # The killed leader's standby finished the roll; no gang restarted for it or for the drain.
    assert report.takeover_s is not None
    assert report.gang_restarts == 0
    # The drain: the group's budget refused every eviction; the operator moved the gang whole.
    drain = report.drain
    assert drain["drain_ok"], drain["output"]
    assert drain["refused_by_budget"], drain["output"]
    assert len(drain["members"]) == 2
