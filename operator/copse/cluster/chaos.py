"""The control plane's chaos run, shared by ``e2e/test_operator_chaos.py`` (which asserts on it) and
``benchmarks/operator_chaos.py`` (which records it): a disaggregated deployment of mocked engines
serves streams through its own router processes on loopback addresses while its engine image
rolls, the operator leader is SIGKILLed mid-roll, and a node under a running decode gang is drained.

What runs: kwok nodes whose ``podCIDR`` is a loopback range, and a :class:`LocalKubelet` that runs
every worker leader and router pod as a process bound to its pod IP (its readiness follows the
process's probe). Clients keep ``streams`` completions in flight, each through one of the router
pods (as their Service would spread them). Samplers read, every ``sample_s``, each router's
``/workers`` (the groups it may send new requests to: healthy, not draining, per role and revision)
and the pods (the operator's view: Ready, not leaving). The routers count each prefill/decode pair
they use by the revisions of both (``copse_router_disaggregated_routes_total``).

A tool of the local control plane, like the rest of :mod:`copse.cluster`: it drives the operator
and the router from outside, so it may import both (neither imports it)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from copse.cluster import Kubectl
from copse.operator import names
from copse.operator.state import pod_ready
from copse.operator.testing import (
    LOCAL_RESOURCE,
    Launched,
    LocalKubelet,
    OperatorProcess,
    lease_holder,
    loopback_cidrs,
    wait_for,
    watching,
)
from copse.router.metrics import DISAGGREGATED_ROUTES
from copse.topology.fake import cpu_nodes, gpu_nodes

ROLES = ("prefill", "decode")
POOL_LABEL = "copse.dev/chaos-pool"
"""Nodes of one run (the deployment's pods and routers select them)."""
ROUTERS_LABEL = "copse.dev/chaos-routers"
"""The run's CPU node, where its router pods go (a drained GPU node never takes a router along)."""
MODEL = "chaos-model"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChaosSettings:
    name: str = "chaos"
    """The InferenceDeployment's name (its namespace is the caller's)."""
    prefill: int = 2
    """Prefill groups (TP4: one 4-GPU tray each)."""
    decode: int = 2
    """Decode groups (TP8: two trays each, so a drained node takes half a gang: it must move whole)."""
    streams: int = 200
    """Streams kept in flight from before the roll to after the drain."""
    prompt_tokens: int = 2048
    """Long enough that the router prefers a remote prefill to a local one (a P/D pair)."""
    max_tokens: int = 48
    """Tokens per stream; a stream succeeds when all of them and ``[DONE]`` arrive."""
    decode_speedup: float = 0.5
    """The mocked engines' decode speed (below 1: slower than the perf model), so streams last."""
    drain_timeout_s: float = 180.0
    """``spec.disruption.drainTimeout``: longer than any stream, so none is cut by a removal."""
    kill_leader: bool = True
    """SIGKILL the operator leader once the roll has started."""
    drain_node: bool = True
    """After the roll, drain a node under a decode gang while the streams go on."""
    sample_s: float = 0.1
    """Between two samples of the routers' views (and of the pods', each on its own thread)."""
    seed: int = 0
    """Of the prompts."""
    timeout_s: float = 600.0
    """For each wait of the run (a roll, a drain)."""

    @property
    def trays(self) -> int:
        """Every group, one group of surge per role, and a decode gang's room to move to."""
        return (self.prefill + 1) + 2 * (self.decode + 1)


def manifest(settings: ChaosSettings, *, pool: str, image: str) -> dict[str, Any]:
    return {
        "apiVersion": "copse.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": settings.name},
        "spec": {
            "model": {"name": MODEL, "tensorParallelism": 4},
            "prefill": {"replicas": settings.prefill, "tensorParallelism": 4},
            "decode": {"replicas": settings.decode, "tensorParallelism": 8},
            "scaling": {"maxReplicas": 32},
            "placement": {"affinityPolicy": "same-nvswitch-domain", "antiAffinityPolicy": "none"},
            "engine": {
                "backend": "mock",
                "image": image,
                "args": ["--decode-speedup", f"{settings.decode_speedup:g}"],
            },
            "router": {"replicas": 2, "nodeSelector": {ROUTERS_LABEL: pool}},
            # Bound by the local kubelet, Running and NotReady until its engine answers.
            "pod": {
                "nodeSelector": {POOL_LABEL: pool},
                "resources": {"requests": {LOCAL_RESOURCE: "1"}, "limits": {LOCAL_RESOURCE: "1"}},
            },
            "rollout": {"maxSurge": 1, "maxUnavailable": 0},
            "disruption": {"drainTimeout": f"{settings.drain_timeout_s:g}s"},
        },
    }


def nodes(settings: ChaosSettings, *, pool: str) -> list[dict[str, Any]]:
    """The run's GPU trays (one rack) and one CPU node for the routers, on loopback pod CIDRs."""
    made = [
        *gpu_nodes(racks=1, trays_per_rack=settings.trays, prefix=pool),
        *cpu_nodes(1, prefix=f"{pool}-cpu"),
    ]
    for node, cidr in zip(made, loopback_cidrs(len(made)), strict=True):
        node["spec"]["podCIDR"] = cidr
        node["metadata"]["labels"][POOL_LABEL if node is not made[-1] else ROUTERS_LABEL] = pool
    return made


@dataclasses.dataclass
class Streams:
    """What the clients saw."""

    started: int = 0
    ok: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)
    """One line per failed stream: where it went and what broke."""
    tokens: int = 0


class Load:
    """``count`` streams kept in flight (a new one starts as one ends) on a thread of its own."""

    def __init__(self, settings: ChaosSettings, routers: Sequence[str]) -> None:
        self.settings = settings
        self.routers = list(routers)
        self.streams = Streams()
        self._rng = random.Random(settings.seed)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, *, timeout_s: float) -> Streams:
        """Start no more streams; wait for those in flight to end."""
        self._stopping.set()
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            self.streams.failures.append(f"streams still running {timeout_s:g}s after the load stopped")
        return self.streams

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
        # Idle connections expire before the router's header_timeout_s (10 s) closes them, as the
        # router's clients settings ask (httpx, under the openai client, keeps them 5 s); aiohttp's
        # default of 15 s sends on connections the router is closing (ServerDisconnectedError).
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=5)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            await asyncio.gather(*(self._client(http, index) for index in range(self.settings.streams)))

    async def _client(self, http: aiohttp.ClientSession, index: int) -> None:
        while not self._stopping.is_set():
            router = self.routers[(self.streams.started + index) % len(self.routers)]
            self.streams.started += 1
            failure = await self._stream(http, router)
            if failure is None:
                self.streams.ok += 1
            else:
                self.streams.failures.append(f"{router}: {failure}")

    async def _stream(self, http: aiohttp.ClientSession, router: str) -> str | None:
        prompt = [self._rng.randrange(1, 30000) for _ in range(self.settings.prompt_tokens)]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": self.settings.max_tokens, "stream": True}
        tokens = 0
        last = ""
        try:
            async with http.post(f"{router}/v1/completions", json=body) as response:
                if response.status != 200:
                    return f"HTTP {response.status}: {(await response.text())[:200]}"
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    last = line[5:].strip()
                    if last == "[DONE]":
                        break
                    event = json.loads(last)
                    if "error" in event:
                        return f"error event after {tokens} tokens: {event['error']}"
                    if event.get("choices") and event["choices"][0].get("text"):
                        tokens += 1
        except (aiohttp.ClientError, TimeoutError) as error:
            return f"{type(error).__name__} after {tokens} tokens: {error}"
        self.streams.tokens += tokens
        if last != "[DONE]" or tokens != self.settings.max_tokens:
            done = "with [DONE]" if last == "[DONE]" else "without [DONE]"
            return f"ended after {tokens} of {self.settings.max_tokens} tokens, {done}"
        return None


@dataclasses.dataclass
class Capacity:
    """Minimum per role of the groups new requests may go to, over the samples."""

    router_samples: int = 0
    """Samples of every router's ``/workers``."""
    router_min: dict[str, int] = dataclasses.field(default_factory=dict)
    """What a router could use (healthy, not draining), the lowest over routers and samples."""
    router_below_floor: int = 0
    """Router samples with fewer than ``desired - maxUnavailable`` usable groups in a role."""
    no_pair: int = 0
    """Router samples with no revision holding both a prefill and a decode group."""
    errors: int = 0
    """Router answers that failed (not counted as samples)."""
    pod_samples: int = 0
    """Samples of the worker leader pods (the operator's view)."""
    pods_min: dict[str, int] = dataclasses.field(default_factory=dict)
    """Ready worker leader pods of groups not leaving, the lowest over samples."""
    pods_below_floor: int = 0
    """Pod samples with fewer than ``desired - maxUnavailable`` such groups in a role."""
    most_groups: dict[str, int] = dataclasses.field(default_factory=dict)
    """Most worker groups of a role that existed at once (surge and draining ones included)."""


@dataclasses.dataclass
class Report:
    streams: Streams
    capacity: Capacity
    routes: dict[tuple[str, str], float]
    """(prefill revision, decode revision) -> requests the routers sent that pair, all routers."""
    old_revision: str
    new_revision: str
    converge_s: float
    """From the image patch to every group of the new revision ready and every old one gone."""
    takeover_s: float | None = None
    """From the leader's SIGKILL to another replica holding the Lease."""
    killed: str | None = None
    """Identity of the killed leader."""
    killed_after_s: float | None = None
    """When into the roll the leader was killed."""
    drain: dict[str, Any] = dataclasses.field(default_factory=dict)
    gang_restarts: int = 0

    @property
    def mixed_routes(self) -> float:
        return sum(count for (prefill, decode), count in self.routes.items() if prefill != decode)


class _Views:
    """The samplers' state, and the router URLs to ask."""

    def __init__(
        self, kubectl: Kubectl, namespace: str, settings: ChaosSettings, routers: Sequence[str]
    ) -> None:
        self.kubectl = kubectl
        self.namespace = namespace
        self.settings = settings
        self.routers = list(routers)
        self.capacity = Capacity()
        self.desired = {"prefill": settings.prefill, "decode": settings.decode}
        self.http = httpx.Client(timeout=3)

    def router_workers(self, router: str) -> list[dict[str, Any]]:
        answer = self.http.get(f"{router}/workers")
        workers: list[dict[str, Any]] = answer.json()["workers"]
        return workers

    def sample_routers(self) -> None:
        """What each router may send new requests to (healthy, not draining), per role."""
        capacity = self.capacity
        for router in self.routers:
            try:
                workers = self.router_workers(router)
            except (httpx.HTTPError, ValueError, KeyError):
                capacity.errors += 1
                continue
            capacity.router_samples += 1
            usable = [(w["role"], w["revision"]) for w in workers if not w["draining"]]
            low = False
            for role in ROLES:
                count = sum(1 for r, _ in usable if r == role)
                capacity.router_min[role] = min(capacity.router_min.get(role, count), count)
                low = low or count < self.desired[role]
            capacity.router_below_floor += low
            if not any(("prefill", rev) in usable and ("decode", rev) in usable for _, rev in usable):
                capacity.no_pair += 1

    def sample_pods(self) -> None:
        """Ready worker leader pods of groups not leaving, per role (what the operator counts)."""
        capacity = self.capacity
        selector = names.selector_string({**names.worker_selector(self.settings.name), names.LABEL_RANK: "0"})
        leaders = self.kubectl.items("pods", "-l", selector, namespace=self.namespace)
        capacity.pod_samples += 1
        low = False
        for role in ROLES:
            mine = [p for p in leaders if p["metadata"]["labels"][names.LABEL_ROLE] == role]
            serving = sum(
                1
                for p in mine
                if pod_ready(p)
                and not p["metadata"].get("deletionTimestamp")
                and names.LABEL_DRAINING not in p["metadata"]["labels"]
            )
            capacity.pods_min[role] = min(capacity.pods_min.get(role, serving), serving)
            capacity.most_groups[role] = max(capacity.most_groups.get(role, 0), len(mine))
            low = low or serving < self.desired[role]
        capacity.pods_below_floor += low


def _launcher(kubectl: Kubectl, namespace: str, logs: Path) -> Any:
    def launch(pod: Mapping[str, Any]) -> Launched | None:
        labels = pod["metadata"]["labels"]
        ip = pod["status"]["podIP"]
        component = labels.get(names.LABEL_COMPONENT)
        if component == names.COMPONENT_WORKER and labels.get(names.LABEL_RANK) == "0":
            argv = list(pod["spec"]["containers"][0]["command"])
            argv[argv.index("--host") + 1] = ip
            return Launched(argv=argv, url=f"http://{ip}:8000", ready_path="/health")
        if component == names.COMPONENT_ROUTER:
            deployment = labels[names.LABEL_DEPLOYMENT]
            config_map = kubectl.get("configmap", f"{deployment}-router", namespace=namespace)
            config = yaml.safe_load(config_map["data"]["router.yaml"])
            config["host"] = ip
            path = logs / f"{pod['metadata']['name']}.yaml"
            path.write_text(yaml.safe_dump(config))
            return Launched(
                argv=["copse", "router", "run", "--config", str(path)],
                url=f"http://{ip}:8080",
                ready_path="/ready",
                env={"KUBECONFIG": str(kubectl.kubeconfig)},
            )
        return None

    return launch


def _status(kubectl: Kubectl, name: str, namespace: str) -> dict[str, Any]:
    found: dict[str, Any] = kubectl.get("idep", name, namespace=namespace).get("status", {})
    return found


def _rolled(kubectl: Kubectl, views: _Views, *, namespace: str, old: str) -> bool:
    """A revision other than ``old`` current, every group of it ready, no old one left, and every
    router sees exactly that."""
    name = views.settings.name
    status = _status(kubectl, name, namespace)
    roles = status.get("roles", {})
    if (
        status.get("revision") in (None, old)
        or status.get("phase") != "Running"
        or any(
            roles.get(role, {}).get("updatedReady") != views.desired[role] or roles[role].get("old") != 0
            for role in ROLES
        )
    ):
        return False
    pods = kubectl.items(
        "pods", "-l", names.selector_string(names.worker_selector(name)), namespace=namespace
    )
    if {p["metadata"]["labels"][names.LABEL_REVISION] for p in pods} != {status["revision"]}:
        return False
    for router in views.routers:
        try:
            workers = views.router_workers(router)
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        seen = sorted((w["role"], w["revision"]) for w in workers if not w["draining"])
        wanted = sorted((role, status["revision"]) for role in ROLES for _ in range(views.desired[role]))
        if seen != wanted:
            return False
    return True


def _routes(routers: Sequence[str]) -> dict[tuple[str, str], float]:
    routes: dict[tuple[str, str], float] = {}
    for router in routers:
        text = httpx.get(f"{router}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == f"{DISAGGREGATED_ROUTES}_total":
                    pair = (sample.labels["prefill_revision"], sample.labels["decode_revision"])
                    routes[pair] = routes.get(pair, 0.0) + sample.value
    return routes


def _kill_leader(
    kubectl: Kubectl,
    operators: Sequence[OperatorProcess],
    report: Report,
    *,
    started: float,
    timeout_s: float,
) -> None:
    lease = operators[0].lease
    held = lease_holder(kubectl, lease)
    # holderIdentity is the replica's POD_NAME, "_" and a random suffix.
    [leader] = [op for op in operators if held.rsplit("_", 1)[0] == op.identity]
    killed = time.monotonic()
    leader.kill()
    report.killed = leader.identity
    report.killed_after_s = killed - started
    report.takeover_s = wait_for(
        "another operator replica to take the Lease over",
        lambda: lease_holder(kubectl, lease) not in ("", held),
        timeout_s=timeout_s,
        poll_s=0.1,
    )


def _drain(kubectl: Kubectl, *, namespace: str, settings: ChaosSettings) -> dict[str, Any]:
    """Drain the node of a decode gang's rank 1 while streams run; the gang must move whole."""
    name = settings.name
    selector = names.selector_string({**names.worker_selector(name), names.LABEL_ROLE: "decode"})
    pods = kubectl.items("pods", "-l", selector, namespace=namespace)
    [pod] = [p for p in pods if p["metadata"]["labels"][names.LABEL_RANK] == "1"][:1]
    node = pod["spec"]["nodeName"]
    group = pod["metadata"]["labels"][names.LABEL_GROUP]
    members = {
        p["metadata"]["name"]: p["spec"]["nodeName"]
        for p in pods
        if p["metadata"]["labels"][names.LABEL_GROUP] == group
    }
    started = time.monotonic()
    drained = subprocess.run(
        [str(kubectl.executable), f"--kubeconfig={kubectl.kubeconfig}", "drain", node, "--ignore-daemonsets",
         "--delete-emptydir-data", f"--timeout={settings.timeout_s:g}s"],
        capture_output=True, text=True, timeout=settings.timeout_s + 30, check=False,
    )  # fmt: skip
    took = time.monotonic() - started
    output = drained.stdout + drained.stderr

    def moved() -> bool:
        status = _status(kubectl, name, namespace)
        decode = status.get("roles", {}).get("decode", {})
        gone = not kubectl.items("pods", "-l", f"{names.LABEL_GROUP}={group}", namespace=namespace)
        return gone and status.get("phase") == "Running" and decode.get("updatedReady") == settings.decode

    try:
        moved_s = took + wait_for("the drained gang to be replaced", moved, timeout_s=settings.timeout_s)
    finally:
        kubectl.run("uncordon", node)
    return {
        "node": node,
        "group": group,
        "members": members,
        "drain_s": took,
        "moved_s": moved_s,
        "drain_ok": drained.returncode == 0,
        "output": output,
        "refused_by_budget": "disruption budget" in output,
    }


def run(
    kubectl: Kubectl,
    *,
    namespace: str,
    operators: Sequence[OperatorProcess],
    settings: ChaosSettings,
    logs: Path,
) -> Report:
    """The whole run in ``namespace`` (which exists) with ``operators`` running (one leads)."""
    pool = f"chaos-{random.Random().randrange(16**6):06x}"
    made = nodes(settings, pool=pool)
    kubectl.apply(made)
    kubelet = LocalKubelet(kubectl, namespace, logs=logs)
    try:
        kubelet.adopt(_launcher(kubectl, namespace, logs))
        kubectl.apply(manifest(settings, pool=pool, image="copse:chaos-before"), namespace=namespace)
        routers = _serving(kubectl, namespace=namespace, settings=settings)
        return _roll_and_drain(kubectl, routers, namespace=namespace, operators=operators, settings=settings)
    finally:
        kubelet.stop()
        kubectl.run("delete", "idep", settings.name, f"--namespace={namespace}", "--wait=false", check=False)
        kubectl.run(
            "delete", "nodes", *(node["metadata"]["name"] for node in made), "--wait=false", check=False
        )


def _serving(kubectl: Kubectl, *, namespace: str, settings: ChaosSettings) -> list[str]:
    """The router URLs once both routers are ready and see every group."""
    selector = names.selector_string(
        {names.LABEL_DEPLOYMENT: settings.name, names.LABEL_COMPONENT: names.COMPONENT_ROUTER}
    )

    def routers() -> list[str]:
        pods = kubectl.items("pods", "-l", selector, namespace=namespace)
        return sorted(
            f"http://{p['status']['podIP']}:8080"
            for p in pods
            if pod_ready(p) and p.get("status", {}).get("podIP")
        )

    views = _Views(kubectl, namespace, settings, [])

    def ready() -> bool:
        views.routers = routers()
        if len(views.routers) != 2:
            return False
        try:
            return all(
                sorted(w["role"] for w in views.router_workers(router))
                == sorted(role for role in ROLES for _ in range(views.desired[role]))
                for router in views.routers
            )
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    try:
        wait_for("two routers serving every group", ready, timeout_s=settings.timeout_s)
    finally:
        views.http.close()
    return views.routers


def _roll_and_drain(
    kubectl: Kubectl,
    routers: list[str],
    *,
    namespace: str,
    operators: Sequence[OperatorProcess],
    settings: ChaosSettings,
) -> Report:
    name = settings.name
    views = _Views(kubectl, namespace, settings, routers)
    old = _status(kubectl, name, namespace)["revision"]
    load = Load(settings, routers)
    load.start()
    report = Report(
        streams=load.streams,
        capacity=views.capacity,
        routes={},
        old_revision=old,
        new_revision="",
        converge_s=0.0,
    )
    try:
        with (
            watching(views.sample_routers, every_s=settings.sample_s),
            watching(views.sample_pods, every_s=settings.sample_s),
        ):
            wait_for("every stream started", lambda: load.streams.started >= settings.streams, timeout_s=60)
            started = time.monotonic()
            kubectl.run(
                "patch", f"idep/{name}", "--type=merge", f"--namespace={namespace}",
                "--patch", json.dumps({"spec": {"engine": {"image": "copse:chaos-after"}}}),
            )  # fmt: skip
            if settings.kill_leader:
                wait_for(
                    "the roll to start",
                    lambda: any(
                        _status(kubectl, name, namespace).get("roles", {}).get(r, {}).get("updated", 0)
                        for r in ROLES
                    ),
                    timeout_s=settings.timeout_s,
                    poll_s=0.1,
                )
                _kill_leader(kubectl, operators, report, started=started, timeout_s=settings.timeout_s)
            wait_for(
                "the roll to converge",
                lambda: _rolled(kubectl, views, namespace=namespace, old=old),
                timeout_s=settings.timeout_s,
            )
            report.converge_s = time.monotonic() - started
            report.new_revision = _status(kubectl, name, namespace)["revision"]
            if settings.drain_node:
                report.drain = _drain(kubectl, namespace=namespace, settings=settings)
    finally:
        load.stop(timeout_s=settings.timeout_s)
        views.http.close()
    report.routes = _routes(routers)
    restarts = kubectl.items("events", "--field-selector", "reason=GangRestart", namespace=namespace)
    report.gang_restarts = sum(1 for e in restarts if e["involvedObject"]["name"] == name)
    return report
