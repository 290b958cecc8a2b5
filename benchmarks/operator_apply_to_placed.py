"""Time from ``kubectl apply`` to every group placed (and Running) for a 64-group deployment.

For each cluster size (NVL72 racks of 18 trays x 4 GPUs, fake nodes under kwok) a fresh local
control plane runs the operator, and the same run measures a baseline on the same cluster:
a plain Deployment asking for the same GPUs, scheduled by kube-scheduler alone (no gangs,
no topology). The ratio is copse's apply-to-Running over the baseline's.

    .venv/bin/python benchmarks/operator_apply_to_placed.py --racks 2 5 10 20
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from copse.cluster import ClusterSettings, Kubectl, start_cluster
from copse.topology import fake

REPO = Path(__file__).resolve().parents[1]
GROUPS = 64
TP = 2  # 64 x TP2 = 128 GPUs: fits the smallest cluster (2 racks = 144 GPUs)


def deployment() -> dict[str, Any]:
    return {
        "apiVersion": "copse.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "bench"},
        "spec": {
            "model": {"name": "bench-model", "tensorParallelism": TP},
            "replicas": GROUPS,
            "scaling": {"maxReplicas": GROUPS},
            "placement": {
                "affinityPolicy": "same-nvswitch-domain",
                "antiAffinityPolicy": "spread-across-racks",
            },
            "engine": {"backend": "mock"},
        },
    }


def baseline() -> dict[str, Any]:
    pod_spec = {
        "containers": [
            {"name": "engine", "image": "bench", "resources": {"limits": {"nvidia.com/gpu": str(TP)}}}
        ]
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "baseline"},
        "spec": {
            "replicas": GROUPS,
            "selector": {"matchLabels": {"app": "baseline"}},
            "template": {"metadata": {"labels": {"app": "baseline"}}, "spec": pod_spec},
        },
    }


def timed(
    kubectl: Kubectl, manifest: dict[str, Any], namespace: str, *conditions: tuple[str, str]
) -> list[float]:
    """Apply ``manifest`` and return the seconds until each ``(--for, resource)`` holds."""
    started = time.monotonic()
    kubectl.apply(manifest, namespace=namespace)
    marks = []
    for condition, resource in conditions:
        kubectl.wait(f"--for={condition}", resource, namespace=namespace, timeout=600)
        marks.append(time.monotonic() - started)
    return marks


def measure(racks: int, work: Path) -> dict[str, float]:
    nodes = [*fake.cpu_nodes(3), *fake.gpu_nodes(racks=racks)]
    cluster, _ = start_cluster(ClusterSettings(work_dir=work / f"racks-{racks}"), nodes=nodes)
    kubectl = cluster.kubectl
    operator = None
    try:
        kubectl.apply(REPO / "crds", server_side=True)
        kubectl.wait_established("-f", str(REPO / "crds"), timeout=60)
        log = (work / f"operator-{racks}.log").open("wb")
        operator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "copse.cli",
                "operator",
                "run",
                "--metrics-port",
                "0",
                "--health-port",
                "0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
        )
        kubectl.run("create", "namespace", "bench")
        kubectl.wait("--for=create", "serviceaccount/default", namespace="bench", timeout=60)
        placed, running = timed(
            kubectl,
            deployment(),
            "bench",
            (f"jsonpath={{.status.roles.worker.placed}}={GROUPS}", "idep/bench"),
            ("jsonpath={.status.phase}=Running", "idep/bench"),
        )
        kubectl.run("delete", "idep", "bench", "--namespace=bench", "--wait=true", timeout=600)
        kubectl.wait(
            "--for=delete", "pods", "-l", "copse.dev/deployment=bench", namespace="bench", timeout=600
        )
        [plain] = timed(kubectl, baseline(), "bench", ("condition=Available", "deployment/baseline"))
        return {"placed_s": placed, "running_s": running, "baseline_s": plain}
    finally:
        if operator is not None:
            operator.terminate()
            operator.wait(timeout=30)
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--racks", type=int, nargs="+", default=[2, 5, 10, 20])
    args = parser.parse_args()
    print(
        f"{GROUPS} groups x TP{TP}; baseline: a Deployment of {GROUPS} pods x {TP} GPUs, kube-scheduler only"
    )
    header = ("racks", "GPUs", "apply->placed s", "apply->Running s", "baseline s", "ratio")
    widths = (5, 6, 16, 17, 11, 6)
    print(" ".join(f"{title:>{width}}" for title, width in zip(header, widths, strict=True)))
    with tempfile.TemporaryDirectory(prefix="copse-bench-") as scratch:
        for racks in args.racks:
            result = measure(racks, Path(scratch))
            ratio = result["running_s"] / result["baseline_s"]
            print(
                f"{racks:>5} {racks * 72:>6} {result['placed_s']:>16.2f} {result['running_s']:>17.2f}"
                f" {result['baseline_s']:>11.2f} {ratio:>6.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
