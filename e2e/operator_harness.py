"""Running and watching the operator in e2e tests: its process, its RBAC identity, waits."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from copse.cluster import Kubectl, KubectlError, binaries_for
from copse.operator import names
from copse.topology.fake import FAKE_NODE_ANNOTATION, FAKE_NODE_VALUE
from copse.workers.testing import free_port

REPO = Path(__file__).resolve().parents[1]
SEED = REPO / "examples" / "seed-inferencedeployment.yaml"
OPERATOR_NAMESPACE = "copse-system"
LEASE = "copse-operator"
#: Short leader-election timings (s), so a killed leader's Lease expires quickly in tests:
#: lease duration, renew deadline, retry period.
LEASE_TIMINGS = (6.0, 4.0, 1.0)


class Operator:
    """``copse operator run`` as its own process, the way a user starts it."""

    def __init__(
        self, *, log: Path, kubeconfig: Path, namespaces: tuple[str, ...] = (), identity: str = "operator"
    ) -> None:
        self.log = log
        self.kubeconfig = kubeconfig
        self.namespaces = namespaces
        """``--namespace`` of each (all namespaces when empty)."""
        self.identity = identity
        """Prefix of its ``holderIdentity`` in the leader Lease (what a pod's name is in a cluster)."""
        self.process: subprocess.Popen[bytes] | None = None
        self.health_port = free_port()
        """Port of the liveness endpoint (the same across restarts)."""

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.health_port}/healthz"

    def start(self) -> None:
        with self.log.open("ab") as sink:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "copse.cli",
                    "operator",
                    "run",
                    "--metrics-port=0",
                    f"--health-port={self.health_port}",
                    f"--lease-namespace={OPERATOR_NAMESPACE}",
                    f"--lease-name={LEASE}",
                    *(
                        f"--{flag}={value:g}"
                        for flag, value in zip(
                            ("lease-duration", "renew-deadline", "retry-period"), LEASE_TIMINGS, strict=True
                        )
                    ),
                    *(f"--namespace={namespace}" for namespace in self.namespaces),
                ],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env={**os.environ, "KUBECONFIG": str(self.kubeconfig), "POD_NAME": self.identity},
            )

    def health(self) -> dict[str, Any] | None:
        """The liveness endpoint's figures (``leader`` is 1 on the replica that reconciles);
        None while it does not answer 200."""
        try:
            with urllib.request.urlopen(self.health_url, timeout=5) as response:
                answer: dict[str, Any] = json.load(response)["reconciler"]
        except OSError:
            return None
        return answer

    @property
    def leading(self) -> bool:
        return (self.health() or {}).get("leader") == 1

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node dies under the operator."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


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


def lease_holder(kubectl: Kubectl) -> str:
    """Who holds the operators' leader Lease ("" when nobody or no Lease yet)."""
    lease = kubectl.run("get", "lease", LEASE, f"--namespace={OPERATOR_NAMESPACE}", "-o", "json", check=False)
    if lease.returncode != 0:
        return ""
    return str(json.loads(lease.stdout).get("spec", {}).get("holderIdentity") or "")


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


def loopback_cidr() -> tuple[str, str]:
    """Two random loopback /24s (``127.a.b.0/24``, ``127.a.b+1.0/24``) for nodes' ``spec.podCIDR``:
    kwok hands a node's pods IPs from its podCIDR, so processes of this machine can serve them."""
    a, b = random.randint(1, 254), random.randrange(0, 254, 2)
    return f"127.{a}.{b}.0/24", f"127.{a}.{b + 1}.0/24"


@dataclasses.dataclass
class _Process:
    pod: str
    process: subprocess.Popen[bytes]
    url: str
    """Where the process serves (its metrics are read just before it is killed)."""


class LocalKubelet:
    """Runs chosen kwok pods' containers as processes of this machine, bound to the pods' IPs
    (loopback addresses, see :func:`loopback_cidr`), and kills each one the moment its pod is
    deleted, with SIGKILL and no grace: anything the pod still served is cut, so a removal that
    did not wait shows. Just before the kill it reads the engine's ``/prometheus/metrics`` (its
    ``/metrics`` is TensorRT-LLM's JSON iteration stats)."""

    def __init__(self, kubectl: Kubectl, namespace: str, *, logs: Path) -> None:
        self.kubectl = kubectl
        self.namespace = namespace
        self.logs = logs
        self.processes: dict[str, _Process] = {}
        self.killed: dict[str, str] = {}
        """Pod name -> what its process's ``/prometheus/metrics`` said just before the kill."""
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="local-kubelet", daemon=True)

    def run(self, pod: str, argv: list[str], *, url: str, env: dict[str, str] | None = None) -> None:
        """Start ``argv`` for ``pod`` (``copse`` means this interpreter's ``copse.cli``)."""
        if argv[0] == "copse":
            argv = [sys.executable, "-m", "copse.cli", *argv[1:]]
        with (self.logs / f"{pod}.log").open("ab") as sink:
            process = subprocess.Popen(
                argv, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        self.processes[pod] = _Process(pod=pod, process=process, url=url)
        if not self._watcher.is_alive():
            self._watcher.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            running = [p for p in self.processes.values() if p.pod not in self.killed]
            if running:
                pods = self.kubectl.items("pods", namespace=self.namespace)
                alive = {p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")}
                for process in running:
                    if process.pod not in alive:
                        self._kill(process)
            self._stop.wait(0.2)

    def _kill(self, process: _Process) -> None:
        try:
            with urllib.request.urlopen(f"{process.url}/prometheus/metrics", timeout=5) as response:
                metrics = response.read().decode()
        except OSError as error:
            metrics = f"unreadable: {error}"
        process.process.kill()
        process.process.wait()
        self.killed[process.pod] = metrics

    def tail(self, pod: str, lines: int = 30) -> str:
        return "\n".join((self.logs / f"{pod}.log").read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        self._stop.set()
        if self._watcher.is_alive():
            self._watcher.join(timeout=10)
        for process in self.processes.values():
            if process.process.poll() is None:
                process.process.kill()
                process.process.wait()


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
