"""Running and watching the operator in e2e tests: its RBAC identity, waits, node faults (its
process and the local kubelet are :mod:`copse.operator.testing`'s)."""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from copse.cluster import Kubectl, KubectlError, binaries_for
from copse.operator import names
from copse.operator.leader import LeaseSettings
from copse.operator.testing import OperatorProcess
from copse.topology.fake import FAKE_NODE_ANNOTATION, FAKE_NODE_VALUE

REPO = Path(__file__).resolve().parents[1]
SEED = REPO / "examples" / "seed-inferencedeployment.yaml"
OPERATOR_NAMESPACE = "copse-system"
LEASE = LeaseSettings(
    namespace=OPERATOR_NAMESPACE, lease_duration_s=6.0, renew_deadline_s=4.0, retry_period_s=1.0
)
"""The operators' leader Lease, with short timings so a killed leader's Lease expires quickly."""
Operator = OperatorProcess
"""``copse operator run`` as its own process (the tests' name for it)."""


def operator_kubeconfig(
    kubectl: Kubectl, directory: Path, *, release: str = "copse", helm_args: tuple[str, ...] = ()
) -> Path:
    """A kubeconfig holding only the chart's operator ServiceAccount token (release ``release``,
    values from ``helm_args``): the operator runs with exactly the RBAC the chart grants it, so a
    missing verb fails these tests."""
    rendered = subprocess.run(
        [
            str(binaries_for().path("helm")),
            "template",
            release,
            str(REPO / "charts" / "copse"),
            f"--namespace={OPERATOR_NAMESPACE}",
            "--show-only=templates/operator-rbac.yaml",
            *helm_args,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    kubectl.run("create", "namespace", OPERATOR_NAMESPACE, check=False)
    kubectl.apply(list(yaml.safe_load_all(rendered)))
    token = kubectl.run(
        "create", "token", f"{release}-copse-operator", f"--namespace={OPERATOR_NAMESPACE}", "--duration=4h"
    ).stdout.strip()
    admin = yaml.safe_load(kubectl.kubeconfig.read_text())
    context = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    admin["users"] = [{"name": "copse-operator", "user": {"token": token}}]
    context["user"] = "copse-operator"
    admin["contexts"] = [{"name": admin["current-context"], "context": context}]
    path = directory / f"{release}-operator.kubeconfig"
    path.write_text(yaml.safe_dump(admin))
    return path


def seed(name: str, **spec: Any) -> dict[str, Any]:
    manifest = yaml.safe_load(SEED.read_text())
    manifest["metadata"]["name"] = name
    manifest["spec"].update(copy.deepcopy(spec))
    return dict(manifest)


def wait_until(what: str, check: Callable[[], bool], *, timeout: float = 90, operator: Operator) -> None:
    """Poll ``check`` (reads of cluster state) until true; on timeout say what and show the operator log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}\n--- operator log ---\n{operator.tail()}")


def wait_gpus_released(kubectl: Kubectl, *, operator: Operator, timeout: float = 300) -> None:
    """Wait until no namespace is terminating: an earlier test's namespace is deleted without
    waiting, and its pods hold their GPUs until it is gone (a large example needs most of the
    cluster). A namespace is Terminating from the moment its deletion is asked, unlike its pods."""
    wait_until(
        "earlier tests' namespaces to be deleted (their pods hold GPUs)",
        lambda: (
            not any(
                item.get("status", {}).get("phase") == "Terminating" for item in kubectl.items("namespaces")
            )
        ),
        operator=operator,
        timeout=timeout,
    )


def status(kubectl: Kubectl, name: str, namespace: str) -> dict[str, Any]:
    result: dict[str, Any] = kubectl.get("idep", name, namespace=namespace).get("status", {})
    return result


def worker_pods(kubectl: Kubectl, name: str, namespace: str) -> list[dict[str, Any]]:
    selector = names.selector_string(names.worker_selector(name))
    return kubectl.items("pods", "-l", selector, namespace=namespace)


def wait_running(
    kubectl: Kubectl, name: str, namespace: str, operator: Operator, *, timeout: float = 120
) -> None:
    try:
        kubectl.wait(
            "--for=jsonpath={.status.phase}=Running", f"idep/{name}", namespace=namespace, timeout=timeout
        )
    except KubectlError as error:
        raise AssertionError(
            f"{name} not Running: {status(kubectl, name, namespace)}\n{operator.tail()}"
        ) from error


@contextlib.contextmanager
def unresponsive(kubectl: Kubectl, node: str) -> Iterator[None]:
    """The node's kubelet stops answering: kwok lets go of the node (its annotation goes, so no
    more heartbeats and no kwok stage resets the condition) and its Ready condition turns False
    now. On exit kwok takes it back (its node-initialize stage makes it Ready), and, as the
    kubelet of a node that returns would, its running pods report Ready again (the node
    controller marked them NotReady; kwok only readies Pending pods)."""
    kubectl.run("annotate", "node", node, f"{FAKE_NODE_ANNOTATION}-")
    now = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    ready = {"type": "Ready", "status": "False", "reason": "KubeletStopped",
             "message": "e2e: the kubelet stopped posting node status",
             "lastTransitionTime": now, "lastHeartbeatTime": now}  # fmt: skip
    kubectl.run(
        "patch", "node", node, "--subresource=status", "--type=strategic",
        "--patch", json.dumps({"status": {"conditions": [ready]}}),
    )  # fmt: skip
    try:
        yield
    finally:
        kubectl.run("annotate", "node", node, f"{FAKE_NODE_ANNOTATION}={FAKE_NODE_VALUE}")
        kubectl.wait("--for=condition=Ready", f"node/{node}", timeout=60)
        for pod in kubectl.items("pods", "--all-namespaces", "--field-selector", f"spec.nodeName={node}"):
            meta = pod["metadata"]
            conditions = pod.get("status", {}).get("conditions", [])
            if meta.get("deletionTimestamp") or any(
                c["type"] == "Ready" and c["status"] == "True" for c in conditions
            ):
                continue
            kubectl.run(
                "patch", "pod", meta["name"], f"--namespace={meta['namespace']}", "--subresource=status",
                "--type=strategic", "--patch", json.dumps({"status": {"conditions": [
                    {"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}]}}),
            )  # fmt: skip


@contextlib.contextmanager
def model_cache(kubectl: Kubectl, namespace: str) -> Iterator[None]:
    """The ReadWriteMany PVC ``model-cache`` the examples mount, bound to a PV of its own (no
    storage class: the controller-manager's binder pairs them), as a cluster's storage would."""
    volume = f"{namespace}-model-cache"
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                "capacity": {"storage": "2Ti"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": f"/tmp/{volume}"},
                "claimRef": {"namespace": namespace, "name": "model-cache"},
            },
        }
    )
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "model-cache"},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": volume,
                "resources": {"requests": {"storage": "2Ti"}},
            },
        },
        namespace=namespace,
    )
    try:
        yield
    finally:
        kubectl.run("delete", "persistentvolume", volume, "--wait=false", check=False)
