"""Start, find and stop a local control plane (etcd, API server, controller-manager, scheduler, kwok).

Processes run in their own session so they outlive ``copse cluster up`` and are not hit by a
terminal's Ctrl-C; they are stopped by recorded PID (and start time) only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from copse.cluster import components as comp
from copse.cluster.build import ensure_binaries
from copse.cluster.errors import ClusterError, ComponentFailedError, PortInUseError
from copse.cluster.kubeconfig import dump_kubeconfig, render_kubeconfig
from copse.cluster.kubectl import Kubectl, KubectlError
from copse.cluster.logs import tail
from copse.cluster.pki import generate_pki
from copse.cluster.state import (
    ClusterState,
    ProcessRecord,
    is_alive,
    process_start_ticks,
    read_state,
    write_state,
)
from copse.cluster.versions import DEFAULT_VERSIONS, Binaries, Versions, cache_root
from copse.topology import fake

Reporter = Callable[[str], None]

POLL_SECONDS = 0.2
"""How often readiness endpoints are polled while a component starts."""
STOP_GRACE_SECONDS = 10.0
"""SIGTERM first; SIGKILL whatever has not exited after this long."""
_WIPED = ("etcd-data", "pki", "certs", "logs", "kubeconfig", "state.json")
"""The only paths a fresh start removes, so pointing --dir at a wrong directory cannot delete user files."""


def report_to_stderr(message: str) -> None:
    print(f"copse cluster: {message}", file=sys.stderr, flush=True)


def default_work_dir() -> Path:
    """``$COPSE_CLUSTER_DIR``, else ``<cache>/cluster`` (the one ``make cluster-up`` uses)."""
    explicit = os.environ.get("COPSE_CLUSTER_DIR")
    return Path(explicit) if explicit else cache_root() / "cluster"


@dataclass(frozen=True)
class FakeTopology:
    """The fake nodes a fresh cluster gets (the issue's default: 2 NVL72 racks of 18 x 4-GPU trays)."""

    racks: int = 2
    """NVL72 racks, each one NVLink domain; two let tests see cross-rack spreading."""
    trays_per_rack: int = 18
    """Compute trays per rack (GB200 NVL72: 18)."""
    gpus_per_tray: int = 4
    """Allocatable nvidia.com/gpu per tray (GB200: 4)."""
    cpu_nodes: int = 3
    """CPU-only nodes for the router, operator and other non-GPU pods."""

    def nodes(self) -> list[dict[str, Any]]:
        return [
            *fake.cpu_nodes(self.cpu_nodes),
            *fake.gpu_nodes(
                racks=self.racks, trays_per_rack=self.trays_per_rack, gpus_per_tray=self.gpus_per_tray
            ),
        ]


@dataclass(frozen=True)
class ClusterSettings:
    """How to start a local control plane."""

    work_dir: Path = field(default_factory=default_work_dir)
    """Holds PKI, etcd data, kubeconfig, state and logs; one running cluster per directory."""
    versions: Versions = DEFAULT_VERSIONS
    """Which upstream releases to build and run."""
    apiserver_port: int | None = None
    """Fixed API server port for a stable kubeconfig; ``None`` picks a free one."""
    topology: FakeTopology = field(default_factory=FakeTopology)
    """Fake nodes to create when no explicit node list is given."""
    ready_timeout: float = 120.0
    """Seconds each component gets to become ready; generous because two cores are shared."""
    cache_dir: Path | None = None
    """Binary cache root; ``None`` means ``$COPSE_CACHE_DIR`` or ``~/.cache/copse``."""
    admission_plugins: tuple[str, ...] = comp.DEFAULT_ADMISSION_PLUGINS
    """Added to the API server's default admission plugins (``--enable-admission-plugins``); the
    default makes ownerReferences need the RBAC strict clusters (OpenShift) demand."""


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((comp.LOOPBACK, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _check_port_free(*, component: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((comp.LOOPBACK, port))
        except OSError as error:
            raise PortInUseError(component=component, port=port) from error


def _choose_ports(apiserver_port: int | None) -> comp.Ports:
    etcd_client, etcd_peer, apiserver, controller_manager, scheduler = _free_ports(5)
    if apiserver_port is not None:
        apiserver = apiserver_port
    ports = comp.Ports(
        etcd_client=etcd_client,
        etcd_peer=etcd_peer,
        apiserver=apiserver,
        controller_manager=controller_manager,
        scheduler=scheduler,
    )
    for component, numbers in ports.by_component().items():
        for port in numbers:
            _check_port_free(component=component, port=port)
    return ports


@contextlib.contextmanager
def _locked(layout: comp.Layout) -> Iterator[None]:
    layout.work_dir.mkdir(parents=True, exist_ok=True)
    with layout.lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _stop_records(
    records: Mapping[str, ProcessRecord], *, popens: Mapping[str, subprocess.Popen[bytes]]
) -> list[str]:
    """Stop recorded processes in reverse start order; return the names that were running."""
    stopped = []
    for name in reversed(list(records)):
        record = records[name]
        if not is_alive(record):
            continue
        os.kill(record.pid, signal.SIGTERM)
        stopped.append(name)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while is_alive(record) and time.monotonic() < deadline:
            popen = popens.get(name)
            if popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=POLL_SECONDS)
            else:
                time.sleep(POLL_SECONDS)
        if is_alive(record):
            os.kill(record.pid, signal.SIGKILL)
        popen = popens.get(name)
        if popen is not None:
            popen.wait()
    return stopped


class LocalCluster:
    """A running local control plane: its files, processes and clients."""

    def __init__(
        self, *, layout: comp.Layout, state: ClusterState, popens: Mapping[str, subprocess.Popen[bytes]]
    ) -> None:
        self.layout = layout
        self.state = state
        self._popens = dict(popens)

    # -- accessors ----------------------------------------------------------------------------
    @property
    def work_dir(self) -> Path:
        return self.layout.work_dir

    @property
    def kubeconfig(self) -> Path:
        return self.state.kubeconfig

    @property
    def binaries(self) -> Binaries:
        return Binaries(directory=self.state.bin_dir)

    @property
    def kubectl(self) -> Kubectl:
        return Kubectl(executable=self.binaries.kubectl, kubeconfig=self.kubeconfig)

    @property
    def owned(self) -> bool:
        """True when this Python process started the cluster (and so should stop it)."""
        return bool(self._popens)

    def log_paths(self) -> dict[str, Path]:
        return {name: self.layout.log(name) for name in self.state.processes}

    def log_tails(self, *, lines: int = 30) -> str:
        """The last lines of every component's log, for failure reports."""
        return "\n".join(
            f"===== {name}: {path} =====\n{tail(path, lines=lines)}"
            for name, path in self.log_paths().items()
        )

    def dead_components(self) -> list[str]:
        return [name for name, record in self.state.processes.items() if not is_alive(record)]

    def is_ready(self) -> bool:
        """All processes alive and the API server answers /readyz."""
        return not self.dead_components() and _apiserver_ready(self.state.apiserver_url, self.layout)

    # -- lifecycle ----------------------------------------------------------------------------
    @classmethod
    def attach(cls, work_dir: Path) -> LocalCluster | None:
        """The cluster running from ``work_dir``, or ``None`` if none is (fully) running there."""
        layout = comp.Layout(work_dir)
        state = read_state(layout.state)
        if state is None:
            return None
        cluster = cls(layout=layout, state=state, popens={})
        return cluster if cluster.is_ready() else None

    def stop(self) -> list[str]:
        """Stop this cluster's processes (exactly the recorded PIDs); return the names stopped."""
        with _locked(self.layout):
            stopped = _stop_records(self.state.processes, popens=self._popens)
            self.layout.state.unlink(missing_ok=True)
        self._popens.clear()
        return stopped

    def add_nodes(self, nodes: Sequence[Mapping[str, Any]], *, timeout: float = 120.0) -> None:
        """Create fake nodes and wait until kwok reports each of them Ready."""
        if not nodes:
            return
        self.kubectl.apply(list(nodes))
        names = [f"node/{node['metadata']['name']}" for node in nodes]
        try:
            self.kubectl.wait("--for=condition=Ready", *names, timeout=timeout)
        except KubectlError as error:
            log = self.layout.log("kwok")
            raise ComponentFailedError(
                component="kwok", reason=f"did not make nodes Ready: {error}", log=log, tail=tail(log)
            ) from error


def _apiserver_ready(url: str, layout: comp.Layout) -> bool:
    return _http_ok(f"{url}/readyz", layout=layout, auth=True)


def _http_ok(url: str, *, layout: comp.Layout, auth: bool) -> bool:
    headers = {}
    verify: ssl.SSLContext | bool
    if url.startswith("https://"):
        if auth:
            token = _admin_token(layout)
            headers["Authorization"] = f"Bearer {token}"
            verify = ssl.create_default_context(cafile=layout.pki / "ca.crt")
        else:
            # controller-manager and scheduler serve /healthz with a self-signed cert they make at start.
            verify = False
    else:
        verify = True
    try:
        response = httpx.get(url, headers=headers, verify=verify, timeout=2.0)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def _admin_token(layout: comp.Layout) -> str:
    return (layout.pki / "tokens.csv").read_text().split(",", 1)[0]


class _Starter:
    """Start components one by one, recording each, cleaning up everything on failure."""

    def __init__(self, *, settings: ClusterSettings, binaries: Binaries, report: Reporter) -> None:
        self.settings = settings
        self.binaries = binaries
        self.report = report
        self.layout = comp.Layout(settings.work_dir)
        self.popens: dict[str, subprocess.Popen[bytes]] = {}
        self.records: dict[str, ProcessRecord] = {}

    def wipe(self) -> None:
        for name in _WIPED:
            path = self.layout.work_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)

    def state(self, ports: comp.Ports) -> ClusterState:
        return ClusterState(
            versions_key=self.settings.versions.key,
            bin_dir=self.binaries.directory,
            kubeconfig=self.layout.kubeconfig,
            apiserver_url=f"https://{comp.LOOPBACK}:{ports.apiserver}",
            ports=ports.by_component(),
            processes=dict(self.records),
        )

    def launch(self, component: comp.Component, ports: comp.Ports) -> subprocess.Popen[bytes]:
        log_path = self.layout.log(component.name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            log.write(f"$ {' '.join(component.argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                component.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.layout.work_dir,
                start_new_session=True,
            )
        self.popens[component.name] = popen
        ticks = process_start_ticks(popen.pid)
        # None: it already exited (a bad flag, say); wait_ready reports that with its log.
        if ticks is not None:
            self.records[component.name] = ProcessRecord(pid=popen.pid, start_ticks=ticks)
            write_state(self.layout.state, self.state(ports))
        return popen

    def wait_ready(
        self, component: comp.Component, popen: subprocess.Popen[bytes], ports: comp.Ports
    ) -> None:
        started = time.monotonic()
        deadline = started + self.settings.ready_timeout
        log_path = self.layout.log(component.name)
        while True:
            code = popen.poll()
            if code is not None:
                self._raise_exited(component.name, code, ports)
            if component.health_url is None:
                # kwok serves no health endpoint; it is ready once it has made the nodes Ready.
                self.report(f"{component.name} started (log: {log_path})")
                return
            if _http_ok(component.health_url, layout=self.layout, auth=component.name == "kube-apiserver"):
                self.report(f"{component.name} ready in {time.monotonic() - started:.1f}s (log: {log_path})")
                return
            if time.monotonic() > deadline:
                raise ComponentFailedError(
                    component=component.name,
                    reason=f"did not become ready within {self.settings.ready_timeout:.0f}s "
                    f"({component.health_url} never answered 200)",
                    log=log_path,
                    tail=tail(log_path),
                )
            time.sleep(POLL_SECONDS)

    def _raise_exited(self, name: str, code: int, ports: comp.Ports) -> None:
        log_path = self.layout.log(name)
        text = tail(log_path, lines=60)
        if "address already in use" in text:
            for port in ports.by_component()[name]:
                if f":{port}" in text:
                    raise PortInUseError(component=name, port=port)
        raise ComponentFailedError(component=name, reason=f"exited with code {code}", log=log_path, tail=text)

    def start(self) -> LocalCluster:
        ports = _choose_ports(self.settings.apiserver_port)
        generate_pki(self.layout.pki, service_ip=comp.SERVICE_IP)
        token = _admin_token(self.layout)
        self.layout.kubeconfig.write_text(
            dump_kubeconfig(
                render_kubeconfig(
                    server=f"https://{comp.LOOPBACK}:{ports.apiserver}",
                    ca_file=self.layout.pki / "ca.crt",
                    token=token,
                )
            )
        )
        self.layout.kubeconfig.chmod(0o600)
        for component in comp.components(
            binaries=self.binaries,
            layout=self.layout,
            ports=ports,
            admission_plugins=self.settings.admission_plugins,
        ):
            popen = self.launch(component, ports)
            self.wait_ready(component, popen, ports)
        cluster = LocalCluster(layout=self.layout, state=self.state(ports), popens=self.popens)
        self._wait_default_service_account(cluster)
        return cluster

    def _wait_default_service_account(self, cluster: LocalCluster) -> None:
        """The controller-manager creates it; pods cannot be admitted in a namespace without it."""
        try:
            cluster.kubectl.wait(
                "--for=create",
                "serviceaccount/default",
                namespace="default",
                timeout=self.settings.ready_timeout,
            )
        except KubectlError as error:
            log = self.layout.log("kube-controller-manager")
            raise ComponentFailedError(
                component="kube-controller-manager",
                reason=f"did not create the default ServiceAccount: {error}",
                log=log,
                tail=tail(log),
            ) from error


def start_cluster(
    settings: ClusterSettings | None = None,
    *,
    nodes: Sequence[Mapping[str, Any]] | None = None,
    report: Reporter = report_to_stderr,
) -> tuple[LocalCluster, bool]:
    """Bring a cluster up in ``settings.work_dir`` (building binaries first if needed).

    Returns ``(cluster, started)``: if a healthy cluster already runs there it is reused and
    ``started`` is False (the caller must then not stop it). ``nodes`` (default: those of
    ``settings.topology``) are created, or updated on a reused cluster; the call returns
    once every one of them is Ready.
    """
    settings = settings or ClusterSettings()
    if nodes is None:
        nodes = settings.topology.nodes()
    check_fake_nodes(nodes)
    layout = comp.Layout(settings.work_dir)
    with _locked(layout):
        existing = read_state(layout.state)
        if existing is not None:
            attached = LocalCluster(layout=layout, state=existing, popens={})
            if attached.is_ready() and existing.versions_key == settings.versions.key:
                report(f"reusing the cluster already running from {layout.work_dir}")
                attached.add_nodes(nodes)
                return attached, False
            report(f"stopping the leftovers of a previous cluster in {layout.work_dir}")
            _stop_records(existing.processes, popens={})
        binaries = ensure_binaries(settings.versions, root=settings.cache_dir)
        starter = _Starter(settings=settings, binaries=binaries, report=report)
        starter.wipe()
        started = time.monotonic()
        try:
            cluster = starter.start()
            nodes_started = time.monotonic()
            cluster.add_nodes(nodes)
            report(f"{len(nodes)} fake nodes Ready in {time.monotonic() - nodes_started:.1f}s")
        except BaseException:
            _stop_records(starter.records, popens=starter.popens)
            layout.state.unlink(missing_ok=True)
            raise
        report(f"cluster up in {time.monotonic() - started:.1f}s; KUBECONFIG={cluster.kubeconfig}")
        return cluster, True


def check_fake_nodes(nodes: Sequence[Mapping[str, Any]], *, source: str = "nodes") -> None:
    """Every node must be a kwok-managed Node, or it would never become Ready here."""
    for index, node in enumerate(nodes):
        metadata = node.get("metadata") or {}
        name = metadata.get("name", f"#{index}")
        if node.get("kind") != "Node":
            raise ValueError(f"{source}: item {name} has kind {node.get('kind')!r}, expected 'Node'")
        annotations = metadata.get("annotations") or {}
        if annotations.get(fake.FAKE_NODE_ANNOTATION) != fake.FAKE_NODE_VALUE:
            raise ValueError(
                f"{source}: node {name} lacks the annotation "
                f"{fake.FAKE_NODE_ANNOTATION}: {fake.FAKE_NODE_VALUE}, "
                "so kwok would not manage it and it would never become Ready"
            )


def stop_cluster(work_dir: Path | None = None) -> list[str]:
    """Stop the cluster recorded in ``work_dir`` (default: ``make cluster-up``'s), whoever started it."""
    layout = comp.Layout(work_dir or default_work_dir())
    with _locked(layout):
        state = read_state(layout.state)
        if state is None:
            return []
        stopped = _stop_records(state.processes, popens={})
        layout.state.unlink(missing_ok=True)
        return stopped


def require_cluster(work_dir: Path | None = None) -> LocalCluster:
    """The running cluster in ``work_dir``; a :class:`ClusterError` saying how to start one otherwise."""
    directory = work_dir or default_work_dir()
    cluster = LocalCluster.attach(directory)
    if cluster is None:
        raise ClusterError(f"no local cluster is running from {directory}; start one with 'make cluster-up'")
    return cluster
