"""The planner against a real control plane: it patches a running InferenceDeployment and the
operator places the groups it asked for; observe-only mode only posts Events."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from e2e.operator_harness import Operator, seed, status, wait_running, wait_until

from copse.cluster import Kubectl

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "examples" / "planner" / "mock-profile.npz"
#: 20 req/s of 3000-token prompts and 150-token answers: three mocked engines at 500 ms / 50 ms.
BUSY = {"num_requests": 1200, "isl": 3000.0, "osl": 150.0}


def recording(path: Path, intervals: int) -> Path:
    path.write_text("".join(json.dumps({"timestamp": 60.0 * i, **BUSY}) + "\n" for i in range(intervals)))
    return path


def planned(name: str) -> dict[str, Any]:
    return seed(
        name,
        replicas=1,
        scaling={
            "minReplicas": 1,
            "maxReplicas": 4,
            "targetLatency": {"ttft_p99_ms": 500, "tbt_p99_ms": 50},
            "scaleDownDelay": "0s",
        },
    )


def run_planner(kubeconfig: Path, name: str, namespace: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``copse planner run`` as its own process, the way a user starts it."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "copse.cli",
            "planner",
            "run",
            name,
            f"--namespace={namespace}",
            f"--perf-profile={PROFILE}",
            "--predictor=constant",
            "--metrics-port=0",
            *args,
        ],
        env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def events(kubectl: Kubectl, name: str, namespace: str, reason: str) -> list[dict[str, Any]]:
    return [
        event
        for event in kubectl.items(
            "events", "--field-selector", f"involvedObject.name={name}", namespace=namespace
        )
        if event["reason"] == reason
    ]


def test_planner_patches_a_running_deployment_and_the_operator_adds_groups(
    kubectl: Kubectl, kubeconfig: Path, namespace: str, operator: Operator, tmp_path: Path
) -> None:
    kubectl.apply(planned("planned"), namespace=namespace)
    wait_running(kubectl, "planned", namespace, operator)
    assert status(kubectl, "planned", namespace)["ready"] == "worker 1/1"

    result = run_planner(
        kubeconfig,
        "planned",
        namespace,
        f"--metrics={recording(tmp_path / 'busy.jsonl', 3)}",
        "--max-intervals=2",
    )
    assert result.returncode == 0, result.stderr
    assert "planner stopped after 2 interval(s)" in result.stderr

    spec = kubectl.get("idep", "planned", namespace=namespace)["spec"]
    assert spec["replicas"] == 3
    (scaled,) = events(kubectl, "planned", namespace, "PlannerScaled")
    assert scaled["message"].startswith("scaled worker 1→3: forecast 20.00 req/s")
    assert scaled["source"]["component"] == "copse-planner"
    wait_until(
        "the operator to place the planner's two new groups",
        lambda: status(kubectl, "planned", namespace).get("ready") == "worker 3/3",
        operator=operator,
    )
    groups = status(kubectl, "planned", namespace)["groups"]
    assert sorted(group["replica"] for group in groups) == [0, 1, 2]


def test_observe_only_posts_a_recommendation_and_patches_nothing(
    kubectl: Kubectl, kubeconfig: Path, namespace: str, tmp_path: Path
) -> None:
    kubectl.apply(planned("watched"), namespace=namespace)
    before = kubectl.get("idep", "watched", namespace=namespace)
    result = run_planner(
        kubeconfig,
        "watched",
        namespace,
        f"--metrics={recording(tmp_path / 'busy.jsonl', 2)}",
        "--observe-only",
    )
    assert result.returncode == 0, result.stderr
    after = kubectl.get("idep", "watched", namespace=namespace)
    assert after["spec"] == before["spec"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    recommendations = events(kubectl, "watched", namespace, "PlannerRecommendation")
    assert recommendations
    assert recommendations[0]["message"].startswith("recommend worker 1→3")
    assert not events(kubectl, "watched", namespace, "PlannerScaled")
    assert "observe-only, not patching" in result.stderr


def test_a_missing_deployment_exits_1(kubeconfig: Path, namespace: str, tmp_path: Path) -> None:
    result = run_planner(kubeconfig, "absent", namespace, f"--metrics={recording(tmp_path / 'm.jsonl', 2)}")
    assert result.returncode == 1
    assert f"InferenceDeployment {namespace}/absent not found" in result.stderr
