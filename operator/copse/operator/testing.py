"""The operator and the pods it makes as processes of this machine, for end-to-end tests and
benchmarks on a local control plane (kwok nodes): ``copse operator run`` as its own process, and a
local kubelet that runs chosen pods' containers bound to the pods' loopback IPs, with readiness
the way a kubelet's probe reports it."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from copse.cluster import Kubectl
from copse.operator.leader import LeaseSettings
from copse.operator.state import pod_ready
from copse.workers.testing import free_port


class OperatorProcess:
    """``copse operator run`` as its own process, the way a user starts it."""

    def __init__(
        self,
        *,
        log: Path,
        kubeconfig: Path,
        lease: LeaseSettings,
        namespaces: tuple[str, ...] = (),
        identity: str = "operator",
        flags: tuple[str, ...] = (),
    ) -> None:
        self.log = log
        self.kubeconfig = kubeconfig
        self.lease = lease
        """Where its leader Lease lives and how fast a standby takes it over."""
        self.namespaces = namespaces
        """``--namespace`` of each (all namespaces when empty)."""
        self.identity = identity
        """Prefix of its ``holderIdentity`` in the leader Lease (what a pod's name is in a cluster)."""
        self.flags = flags
        """Further flags of ``copse operator run`` (``--image=...``: what a chart upgrade changes)."""
        self.process: subprocess.Popen[bytes] | None = None
        self.health_port = free_port()
        """Port of the liveness endpoint (the same across restarts)."""

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.health_port}/healthz"

    def argv(self) -> list[str]:
        lease = self.lease
        return [
            sys.executable, "-m", "copse.cli", "operator", "run",
            "--metrics-port=0",
            f"--health-port={self.health_port}",
            f"--lease-namespace={lease.namespace}",
            f"--lease-name={lease.name}",
            f"--lease-duration={lease.lease_duration_s:g}",
            f"--renew-deadline={lease.renew_deadline_s:g}",
            f"--retry-period={lease.retry_period_s:g}",
            *(f"--namespace={namespace}" for namespace in self.namespaces),
            *self.flags,
        ]  # fmt: skip

    def start(self) -> None:
        with self.log.open("ab") as sink:
            self.process = subprocess.Popen(
                self.argv(),
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


def lease_holder(kubectl: Kubectl, lease: LeaseSettings) -> str:
    """Who holds the operators' leader Lease ("" when nobody or no Lease yet)."""
    found = kubectl.run(
        "get", "lease", lease.name, f"--namespace={lease.namespace}", "-o", "json", check=False
    )  # fmt: skip
    if found.returncode != 0:
        return ""
    return str(json.loads(found.stdout).get("spec", {}).get("holderIdentity") or "")


def loopback_cidrs(count: int) -> list[str]:
    """``count`` consecutive random loopback /24s (``127.a.b.0/24``, ``127.a.b+1.0/24``, ...) for
    nodes' ``spec.podCIDR``: kwok hands a node's pods IPs from its podCIDR, so processes of this
    machine can serve them."""
    if not 0 < count <= 64:
        raise ValueError(f"between 1 and 64 loopback /24s, got {count}")
    a, b = random.randint(1, 254), random.randrange(0, 256 - count)
    return [f"127.{a}.{b + i}.0/24" for i in range(count)]


LOCAL_RESOURCE = "copse.dev/local-kubelet"
"""An extended resource no node advertises: a pod requesting it is left unbound by kube-scheduler
and bound by :class:`LocalKubelet` (``spec.pod.resources`` puts it on a deployment's workers)."""


def _bound_here(pod: Mapping[str, Any]) -> bool:
    """An unbound, ungated, live pod that only the local kubelet binds."""
    spec = pod["spec"]
    requests = {k for c in spec.get("containers", []) for k in c.get("resources", {}).get("requests", {})}
    return (
        LOCAL_RESOURCE in requests
        and not spec.get("nodeName")
        and not spec.get("schedulingGates")
        and not pod["metadata"].get("deletionTimestamp")
    )


@dataclasses.dataclass
class _Process:
    pod: str
    process: subprocess.Popen[bytes]
    url: str
    """Where the process serves (its metrics are read just before it is killed)."""
    uid: str | None = None
    """The pod's uid, when known: a pod re-made under the same name is another pod."""
    killed: bool = False


Launch = Callable[[Mapping[str, Any]], "Launched | None"]
"""What to run for a pod that got its IP (None: the pod is not this kubelet's)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launched:
    """A pod's process, as a :data:`Launch` function describes it."""

    argv: list[str]
    """``copse`` as the first word means this interpreter's ``copse.cli``."""
    url: str
    """Where it serves."""
    ready_path: str
    """What its readiness probe asks (``GET``; ready on 200)."""
    env: dict[str, str] = dataclasses.field(default_factory=dict)


class LocalKubelet:
    """Runs chosen kwok pods' containers as processes of this machine, bound to the pods' IPs
    (loopback addresses, see :func:`loopback_cidrs`), and kills each one the moment its pod is
    deleted, with SIGKILL and no grace: anything the pod still served is cut, so a removal that
    did not wait shows. Just before the kill it reads the engine's ``/prometheus/metrics`` (its
    ``/metrics`` is TensorRT-LLM's JSON iteration stats).

    With :meth:`adopt`, every pod that gets an IP is launched as it appears, and its Ready
    condition follows its readiness probe as a kubelet's would. kwok marks a pod Ready the moment
    it is bound, before any process could answer, and a controller watching may act on that first;
    so pods that request :data:`LOCAL_RESOURCE` (which no node advertises: kube-scheduler leaves
    them unbound) are bound by this kubelet itself, to the node their required affinity names,
    already Running with an IP of the node's ``podCIDR`` and NotReady, which kwok leaves alone
    (it readies only Pending pods). Other pods (a Deployment's, bound by kube-scheduler) are set
    NotReady as soon as they are seen, a moment after kwok readied them."""

    def __init__(self, kubectl: Kubectl, namespace: str, *, logs: Path, poll_s: float = 0.2) -> None:
        self.kubectl = kubectl
        self.namespace = namespace
        self.logs = logs
        self.poll_s = poll_s
        self.processes: dict[str, _Process] = {}
        """Pod name -> its latest process."""
        self.killed: dict[str, str] = {}
        """Pod name -> what its (latest killed) process's ``/prometheus/metrics`` said just before
        the kill."""
        self.launch: Launch | None = None
        self._cidrs: dict[str, str] = {}
        """Node name -> its ``spec.podCIDR``."""
        self._probing: dict[str, str] = {}
        """Adopted pods not ready yet -> their readiness URL."""
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="local-kubelet", daemon=True)

    def run(
        self,
        pod: str,
        argv: list[str],
        *,
        url: str,
        env: dict[str, str] | None = None,
        uid: str | None = None,
    ) -> None:
        """Start ``argv`` for ``pod`` (``copse`` means this interpreter's ``copse.cli``)."""
        if argv[0] == "copse":
            argv = [sys.executable, "-m", "copse.cli", *argv[1:]]
        with (self.logs / f"{pod}.log").open("ab") as sink:
            process = subprocess.Popen(
                argv, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        self.processes[pod] = _Process(pod=pod, process=process, url=url, uid=uid)
        if not self._watcher.is_alive():
            self._watcher.start()

    def adopt(self, launch: Launch) -> None:
        """From now on launch every pod of the namespace ``launch`` describes, once it has an IP."""
        self.launch = launch
        if not self._watcher.is_alive():
            self._watcher.start()

    def _set_ready(self, pod: str, ready: bool) -> None:
        value = "True" if ready else "False"
        conditions = [{"type": kind, "status": value} for kind in ("Ready", "ContainersReady")]
        self.kubectl.run(
            "patch", "pod", pod, f"--namespace={self.namespace}", "--subresource=status",
            "--type=strategic", "--patch", json.dumps({"status": {"conditions": conditions}}), check=False,
        )  # fmt: skip

    def _bind(self, pod: Mapping[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
        """Bind an unbound pod of :data:`LOCAL_RESOURCE` to its planned node, Running, NotReady
        (Ready at once when nothing of it runs here); returns it as bound."""
        meta = pod["metadata"]
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        [node] = [
            v for term in terms["nodeSelectorTerms"] for f in term.get("matchFields", []) for v in f["values"]
        ]
        if node not in self._cidrs:
            self._cidrs[node] = self.kubectl.get("node", node)["spec"]["podCIDR"]
        used = {p.get("status", {}).get("podIP") for p in pods}
        network = ipaddress.ip_network(self._cidrs[node])
        ip = next(str(a) for a in list(network.hosts())[100:] if str(a) not in used)
        serving = self.launch is not None and self.launch({**pod, "status": {"podIP": ip}}) is not None
        ready = "False" if serving else "True"
        status = {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1",
            "conditions": [
                {"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
                {"type": "Ready", "status": ready}, {"type": "ContainersReady", "status": ready},
            ],
        }  # fmt: skip
        patched = self.kubectl.run(
            "patch", "pod", meta["name"], f"--namespace={self.namespace}", "--subresource=status",
            "--type=merge", "--patch", json.dumps({"status": status}), check=False,
        )  # fmt: skip
        if patched.returncode != 0:
            return dict(pod)  # deleted meanwhile: the next look tells
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"]},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": node}}  # fmt: skip
        bound = self.kubectl.run(
            "create", "--raw", f"/api/v1/namespaces/{self.namespace}/pods/{meta['name']}/binding",
            "-f", "-", stdin=json.dumps(binding), check=False,
        )  # fmt: skip
        if bound.returncode != 0:
            return dict(pod)
        return {**pod, "spec": {**pod["spec"], "nodeName": node}, "status": status}

    def _adopt(self, pods: list[dict[str, Any]]) -> None:
        assert self.launch is not None
        for index, pod in enumerate(pods):
            if _bound_here(pod):
                pods[index] = self._bind(pod, pods)
        for pod in pods:
            name, uid = pod["metadata"]["name"], pod["metadata"]["uid"]
            known = self.processes.get(name)
            if (known is not None and known.uid == uid) or pod["metadata"].get("deletionTimestamp"):
                continue
            if not pod.get("status", {}).get("podIP"):
                continue
            launched = self.launch(pod)
            if launched is None:
                continue
            if pod_ready(pod):
                self._set_ready(name, False)
            self.run(name, launched.argv, url=launched.url, env=launched.env, uid=uid)
            self._probing[name] = f"{launched.url}{launched.ready_path}"
        for name, url in list(self._probing.items()):
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    answered = response.status == 200
            except OSError:
                answered = False
            if answered:
                self._set_ready(name, True)
                del self._probing[name]

    def _watch(self) -> None:
        while not self._stop.is_set():
            running = [p for p in self.processes.values() if not p.killed]
            if running or self.launch is not None:
                pods = self.kubectl.items("pods", namespace=self.namespace)
                alive = {
                    p["metadata"]["name"]: p["metadata"]["uid"]
                    for p in pods
                    if not p["metadata"].get("deletionTimestamp")
                }
                for process in running:
                    if process.pod not in alive or process.uid not in (None, alive[process.pod]):
                        self._probing.pop(process.pod, None)
                        self._kill(process)
                if self.launch is not None:
                    self._adopt(pods)
            self._stop.wait(self.poll_s)

    def _kill(self, process: _Process) -> None:
        try:
            with urllib.request.urlopen(f"{process.url}/prometheus/metrics", timeout=5) as response:
                metrics = response.read().decode()
        except OSError as error:
            metrics = f"unreadable: {error}"
        process.process.kill()
        process.process.wait()
        process.killed = True
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
def watching(check: Callable[[], None], *, every_s: float) -> Iterator[None]:
    """Call ``check`` every ``every_s`` on a thread while the block runs (a sampler)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            check()
            stop.wait(every_s)

    thread = threading.Thread(target=run, name="sampler", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)


def wait_for(what: str, check: Callable[[], bool], *, timeout_s: float, poll_s: float = 0.25) -> float:
    """Seconds until ``check()`` held; TimeoutError naming ``what`` after ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if check():
            return time.monotonic() - started
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:g}s waiting for {what}")
