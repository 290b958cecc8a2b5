"""Command lines of the control-plane components (pure: no processes started here).

Flags follow envtest's and kwokctl's defaults, trimmed to what a single-node-less
control plane needs; everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from copse.cluster.versions import Binaries
from copse.topology.fake import FAKE_NODE_ANNOTATION, FAKE_NODE_VALUE

LOOPBACK = "127.0.0.1"
SERVICE_CIDR = "10.96.0.0/16"
"""ClusterIP range; its first address is the ``kubernetes`` Service and goes into the serving cert."""
SERVICE_IP = "10.96.0.1"
POD_CIDR = "10.244.0.0/16"
"""kwok hands fake pod IPs out of this range."""


@dataclass(frozen=True)
class Ports:
    """Loopback ports of one cluster; chosen free at start so several clusters can coexist."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int

    def by_component(self) -> dict[str, list[int]]:
        return {
            "etcd": [self.etcd_client, self.etcd_peer],
            "kube-apiserver": [self.apiserver],
            "kube-controller-manager": [self.controller_manager],
            "kube-scheduler": [self.scheduler],
            "kwok": [],
        }


@dataclass(frozen=True)
class Layout:
    """Where a cluster keeps its files; everything lives under one work dir."""

    work_dir: Path

    @property
    def pki(self) -> Path:
        return self.work_dir / "pki"

    @property
    def etcd_data(self) -> Path:
        return self.work_dir / "etcd-data"

    @property
    def logs(self) -> Path:
        return self.work_dir / "logs"

    @property
    def kubeconfig(self) -> Path:
        return self.work_dir / "kubeconfig"

    @property
    def state(self) -> Path:
        return self.work_dir / "state.json"

    @property
    def lock(self) -> Path:
        return self.work_dir / ".lock"

    def cert_dir(self, component: str) -> Path:
        """Self-signed serving certs the controller-manager and scheduler generate for /healthz."""
        return self.work_dir / "certs" / component

    def log(self, component: str) -> Path:
        return self.logs / f"{component}.log"


@dataclass(frozen=True)
class Component:
    """One process of the control plane and how to tell it is ready."""

    name: str
    argv: tuple[str, ...]
    health_url: str | None
    """Polled until it answers 200; ``None`` when readiness is checked another way (kwok: nodes Ready)."""


START_ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


def etcd(*, binaries: Binaries, layout: Layout, ports: Ports) -> Component:
    client = f"http://{LOOPBACK}:{ports.etcd_client}"
    peer = f"http://{LOOPBACK}:{ports.etcd_peer}"
    return Component(
        name="etcd",
        argv=(
            str(binaries.path("etcd")),
            "--name=copse",
            f"--data-dir={layout.etcd_data}",
            # A throwaway test store: durability is not worth the fsync latency.
            "--unsafe-no-fsync",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=copse={peer}",
            "--log-level=warn",
        ),
        health_url=f"{client}/health",
    )


#: Admission plugins the local API server adds to its defaults. OwnerReferencesPermissionEnforcement
#: (on in OpenShift) refuses an ownerReference on an object its creator cannot delete, and
#: blockOwnerDeletion without update on the owner's finalizers: with it on here, an RBAC gap of the
#: chart fails the e2e suite instead of a strict production cluster.
DEFAULT_ADMISSION_PLUGINS = ("OwnerReferencesPermissionEnforcement",)


def kube_apiserver(
    *,
    binaries: Binaries,
    layout: Layout,
    ports: Ports,
    admission_plugins: tuple[str, ...] = DEFAULT_ADMISSION_PLUGINS,
) -> Component:
    pki = layout.pki
    plugins = (f"--enable-admission-plugins={','.join(admission_plugins)}",) if admission_plugins else ()
    return Component(
        name="kube-apiserver",
        argv=(
            str(binaries.path("kube-apiserver")),
            f"--etcd-servers=http://{LOOPBACK}:{ports.etcd_client}",
            f"--bind-address={LOOPBACK}",
            f"--advertise-address={LOOPBACK}",
            f"--secure-port={ports.apiserver}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={pki / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.key'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--allow-privileged=true",
            # No real endpoints behind the loopback address; do not publish it in the kubernetes Service.
            "--endpoint-reconciler-type=none",
            "--enable-priority-and-fairness=false",
            *plugins,
        ),
        health_url=f"https://{LOOPBACK}:{ports.apiserver}/readyz",
    )


def kube_controller_manager(*, binaries: Binaries, layout: Layout, ports: Ports) -> Component:
    return Component(
        name="kube-controller-manager",
        argv=(
            str(binaries.path("kube-controller-manager")),
            f"--kubeconfig={layout.kubeconfig}",
            "--leader-elect=false",
            f"--bind-address={LOOPBACK}",
            f"--secure-port={ports.controller_manager}",
            f"--cert-dir={layout.cert_dir('kube-controller-manager')}",
            f"--root-ca-file={layout.pki / 'ca.crt'}",
            f"--service-account-private-key-file={layout.pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
        ),
        health_url=f"https://{LOOPBACK}:{ports.controller_manager}/healthz",
    )


def kube_scheduler(*, binaries: Binaries, layout: Layout, ports: Ports) -> Component:
    return Component(
        name="kube-scheduler",
        argv=(
            str(binaries.path("kube-scheduler")),
            f"--kubeconfig={layout.kubeconfig}",
            "--leader-elect=false",
            f"--bind-address={LOOPBACK}",
            f"--secure-port={ports.scheduler}",
            f"--cert-dir={layout.cert_dir('kube-scheduler')}",
        ),
        health_url=f"https://{LOOPBACK}:{ports.scheduler}/healthz",
    )


def kwok(*, binaries: Binaries, layout: Layout) -> Component:
    return Component(
        name="kwok",
        argv=(
            str(binaries.path("kwok")),
            f"--kubeconfig={layout.kubeconfig}",
            f"--config={binaries.kwok_stages}",
            # Only annotated nodes, so a real kubelet's node would never be touched.
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}={FAKE_NODE_VALUE}",
            "--node-lease-duration-seconds=40",
            f"--cidr={POD_CIDR}",
            f"--node-ip={LOOPBACK}",
        ),
        health_url=None,
    )


def components(
    *,
    binaries: Binaries,
    layout: Layout,
    ports: Ports,
    admission_plugins: tuple[str, ...] = DEFAULT_ADMISSION_PLUGINS,
) -> list[Component]:
    """Every component in start order (stop in reverse)."""
    return [
        etcd(binaries=binaries, layout=layout, ports=ports),
        kube_apiserver(binaries=binaries, layout=layout, ports=ports, admission_plugins=admission_plugins),
        kube_controller_manager(binaries=binaries, layout=layout, ports=ports),
        kube_scheduler(binaries=binaries, layout=layout, ports=ports),
        kwok(binaries=binaries, layout=layout),
    ]
