"""Control-plane chaos: roll a disaggregated deployment's engine image under two operator replicas,
once undisturbed and once with the leader SIGKILLed mid-roll, then drain a node under a gang.

One local control plane (kwok GB200 trays), two ``copse operator run`` processes sharing the leader
Lease. Every 0.25 s a sampler reads the worker pods: ready groups per role and revision, whether
some revision has a ready prefill+decode pair (what the router can route), and whether a revision
serves prefill with no decode of its own. kwok reports pods Ready as soon as they run, so "ready"
here is the control plane's view; no engine serves tokens in this benchmark.

Side by side in one run: the roll's time to converge with and without the leader killed (ratio),
and the takeover time against the lease duration.

    .venv/bin/python benchmarks/operator_chaos.py --pool 2 --lease-duration 6
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from copse.cluster import ClusterSettings, Kubectl, start_cluster
from copse.topology import fake
from copse.workers.testing import free_port

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "chaos"
LEASE_NAMESPACE = "default"


def manifest(name: str, pool: int) -> dict[str, Any]:
    return {
        "apiVersion": "copse.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "chaos-model", "tensorParallelism": 4},
            "prefill": {"replicas": pool, "tensorParallelism": 4},
            "decode": {"replicas": pool, "tensorParallelism": 4},
            "scaling": {"maxReplicas": 16},
            "placement": {"affinityPolicy": "same-nvswitch-domain", "antiAffinityPolicy": "none"},
            "engine": {"backend": "mock"},
            # No router counts in-flight requests here: a retired group goes at once.
            "disruption": {"drainTimeout": "0s"},
        },
    }


class Replica:
    """One ``copse operator run`` process."""

    def __init__(self, *, kubeconfig: Path, log: Path, lease_duration: float, name: str) -> None:
        self.health_port = free_port()
        self.name = name
        argv = [
            sys.executable,
            "-m",
            "copse.cli",
            "operator",
            "run",
            "--metrics-port=0",
            f"--health-port={self.health_port}",
            f"--lease-namespace={LEASE_NAMESPACE}",
            f"--lease-duration={lease_duration:g}",
            f"--renew-deadline={lease_duration * 2 / 3:g}",
            f"--retry-period={max(0.5, lease_duration / 6):g}",
        ]
        with log.open("ab") as sink:
            self.process = subprocess.Popen(
                argv,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env={**os.environ, "KUBECONFIG": str(kubeconfig), "POD_NAME": name},
            )

    def leading(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=3) as answer:
                return bool(json.load(answer)["reconciler"]["leader"] == 1)
        except OSError:
            return False

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


def lease_holder(kubectl: Kubectl) -> str:
    found = kubectl.run(
        "get", "lease", "copse-operator", f"--namespace={LEASE_NAMESPACE}", "-o", "json", check=False
    )
    if found.returncode != 0:
        return ""
    return str(json.loads(found.stdout).get("spec", {}).get("holderIdentity") or "")


@dataclasses.dataclass
class Samples:
    count: int = 0
    min_ready: dict[str, int] = dataclasses.field(default_factory=dict)
    no_pair: int = 0
    """Samples with no revision holding a ready prefill and decode group."""
    prefill_alone: int = 0
    """Samples where a revision had ready prefill groups and no ready decode group."""
    max_groups: dict[str, int] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def sampling(kubectl: Kubectl, name: str) -> Iterator[Samples]:
    samples = Samples()
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            pods = kubectl.items(
                "pods", "-l", f"copse.dev/deployment={name},copse.dev/rank=0", namespace=NAMESPACE
            )
            ready: dict[tuple[str, str], int] = {}
            groups: dict[str, int] = {}
            for pod in pods:
                labels = pod["metadata"]["labels"]
                role = labels["copse.dev/role"]
                groups[role] = groups.get(role, 0) + 1
                conditions = pod.get("status", {}).get("conditions", [])
                alive = not pod["metadata"].get("deletionTimestamp") and "copse.dev/draining" not in labels
                if alive and any(c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                    key = (role, labels.get("copse.dev/revision", ""))
                    ready[key] = ready.get(key, 0) + 1
            samples.count += 1
            for role in ("prefill", "decode"):
                total = sum(n for (r, _), n in ready.items() if r == role)
                samples.min_ready[role] = min(samples.min_ready.get(role, total), total)
                samples.max_groups[role] = max(samples.max_groups.get(role, 0), groups.get(role, 0))
            revisions = {rev for _, rev in ready}
            if not any(("prefill", r) in ready and ("decode", r) in ready for r in revisions):
                samples.no_pair += 1
            if any(("prefill", r) in ready and ("decode", r) not in ready for r in revisions):
                samples.prefill_alone += 1
            stop.wait(0.25)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join(timeout=30)


def converged(kubectl: Kubectl, name: str, pool: int) -> bool:
    status = kubectl.get("idep", name, namespace=NAMESPACE).get("status", {})
    roles = status.get("roles", {})
    done = all(
        roles.get(role, {}).get("updatedReady") == pool and roles.get(role, {}).get("old") == 0
        for role in ("prefill", "decode")
    )
    pods = kubectl.items(
        "pods", "-l", f"copse.dev/deployment={name},app.kubernetes.io/component=worker", namespace=NAMESPACE
    )
    revisions = {p["metadata"]["labels"].get("copse.dev/revision") for p in pods}
    return (
        done
        and status.get("phase") == "Running"
        and revisions == {status.get("revision")}
        and len(pods) == 2 * pool
    )


def wait(what: str, check: Any, *, timeout: float = 600) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if check():
            return time.monotonic() - started
        time.sleep(0.25)
    raise SystemExit(f"timed out waiting for {what}")


def roll(kubectl: Kubectl, replicas: list[Replica], *, name: str, pool: int, kill: bool) -> dict[str, Any]:
    kubectl.apply(manifest(name, pool), namespace=NAMESPACE)
    wait(
        f"{name} Running",
        lambda: kubectl.get("idep", name, namespace=NAMESPACE).get("status", {}).get("phase") == "Running",
    )
    result: dict[str, Any] = {}
    with sampling(kubectl, name) as samples:
        started = time.monotonic()
        kubectl.run(
            "patch",
            f"idep/{name}",
            "--type=merge",
            f"--namespace={NAMESPACE}",
            "--patch",
            json.dumps({"spec": {"engine": {"image": f"copse:{name}-next"}}}),
        )
        if kill:
            wait(
                "the roll to start",
                lambda: (
                    kubectl.get("idep", name, namespace=NAMESPACE)
                    .get("status", {})
                    .get("roles", {})
                    .get("decode", {})
                    .get("updated", 0)
                    > 0
                ),
            )
            [leader] = [r for r in replicas if r.leading()] or [replicas[0]]
            held = lease_holder(kubectl)
            killed = time.monotonic()
            leader.kill()
            result["takeover_s"] = wait("a new leader", lambda: lease_holder(kubectl) not in ("", held))
            result["killed"] = leader.name
            result["killed_at_s"] = killed - started
        wait("the roll to converge", lambda: converged(kubectl, name, pool))
        result["converge_s"] = time.monotonic() - started
        time.sleep(0.5)
    result["samples"] = samples
    restarts = kubectl.items("events", "--field-selector", "reason=GangRestart", namespace=NAMESPACE)
    result["gang_restarts"] = sum(1 for e in restarts if e["involvedObject"]["name"] == name)
    return result


def drain(kubectl: Kubectl, *, name: str) -> dict[str, Any]:
    pods = kubectl.items(
        "pods", "-l", f"copse.dev/deployment={name},copse.dev/role=decode", namespace=NAMESPACE
    )
    node = pods[0]["spec"]["nodeName"]
    group = pods[0]["metadata"]["labels"]["copse.dev/group"]
    started = time.monotonic()
    done = kubectl.run(
        "drain",
        node,
        "--ignore-daemonsets",
        "--delete-emptydir-data",
        "--timeout=300s",
        check=False,
        timeout=320,
    )
    took = time.monotonic() - started
    kubectl.run("uncordon", node)
    moved = kubectl.items("pods", "-l", f"copse.dev/group={group}", namespace=NAMESPACE)
    return {
        "node": node,
        "group": group,
        "drain_s": took,
        "drain_ok": done.returncode == 0,
        "refused_by_budget": "disruption budget" in done.stdout + done.stderr,
        "group_left_on_node": sum(1 for p in moved if p["spec"].get("nodeName") == node),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=int, default=2, help="prefill and decode groups each (TP4)")
    parser.add_argument("--lease-duration", type=float, default=6.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="copse-chaos-") as scratch:
        work = Path(scratch)
        nodes = [*fake.cpu_nodes(2), *fake.gpu_nodes(racks=1)]
        cluster, _ = start_cluster(ClusterSettings(work_dir=work / "cluster"), nodes=nodes)
        kubectl = cluster.kubectl
        replicas: list[Replica] = []
        try:
            kubectl.apply(REPO / "crds", server_side=True)
            kubectl.wait_established("-f", str(REPO / "crds"), timeout=60)
            kubectl.run("create", "namespace", NAMESPACE)
            kubectl.wait("--for=create", "serviceaccount/default", namespace=NAMESPACE, timeout=60)
            replicas = [
                Replica(
                    kubeconfig=cluster.kubeconfig,
                    log=work / f"op-{i}.log",
                    lease_duration=args.lease_duration,
                    name=f"op-{i}",
                )
                for i in range(2)
            ]
            calm = roll(kubectl, replicas, name="calm", pool=args.pool, kill=False)
            chaos = roll(kubectl, replicas, name="chaos", pool=args.pool, kill=True)
            drained = drain(kubectl, name="chaos")
        finally:
            for replica in replicas:
                replica.stop()
            cluster.stop()
    print(
        f"prefill {args.pool} + decode {args.pool} groups (TP4, mock engines on kwok), maxSurge 1, "
        f"maxUnavailable 0; lease duration {args.lease_duration:g}s"
    )
    print(
        f"{'roll':<22} {'converge s':>10} {'samples':>7} {'min ready P/D':>13} {'max groups P/D':>14} "
        f"{'no pair':>7} {'P alone':>7} {'restarts':>8}"
    )
    for label, run in (("undisturbed", calm), ("leader SIGKILL mid-roll", chaos)):
        s: Samples = run["samples"]
        ready = f"{s.min_ready['prefill']}/{s.min_ready['decode']}"
        most = f"{s.max_groups['prefill']}/{s.max_groups['decode']}"
        print(
            f"{label:<22} {run['converge_s']:>10.1f} {s.count:>7} {ready:>13} {most:>14} "
            f"{s.no_pair:>7} {s.prefill_alone:>7} {run['gang_restarts']:>8}"
        )
    print(f"converge ratio (killed / undisturbed): {chaos['converge_s'] / calm['converge_s']:.2f}")
    print(
        f"leader takeover after SIGKILL: {chaos['takeover_s']:.1f}s "
        f"(ratio to the lease duration {chaos['takeover_s'] / args.lease_duration:.2f})"
    )
    print(
        f"drain of {drained['node']} under {drained['group']}: {drained['drain_s']:.1f}s, "
        f"ok={drained['drain_ok']}, "
        f"evictions refused by the group's budget={drained['refused_by_budget']}, "
        f"pods of the group left on the node={drained['group_left_on_node']}"
    )


if __name__ == "__main__":
    main()
