"""Which Kubernetes cluster tests and the demo talk to: the user's, or a local one.

A user's cluster (kind, a real one) is used only when asked for explicitly with
``COPSE_E2E_USE_KUBECONFIG=1`` plus ``$KUBECONFIG``: a kubeconfig left over in the shell
must never make a test suite create and delete objects in somebody's production cluster.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from copse.cluster.build import ensure_binaries
from copse.cluster.errors import ClusterError
from copse.cluster.kubectl import Kubectl
from copse.cluster.local import (
    ClusterSettings,
    LocalCluster,
    Reporter,
    default_work_dir,
    report_to_stderr,
    start_cluster,
)
from copse.cluster.versions import binaries_for

USE_KUBECONFIG_ENV = "COPSE_E2E_USE_KUBECONFIG"
"""Set to 1 to run against $KUBECONFIG instead of the local control plane."""
KUBECTL_ENV = "COPSE_KUBECTL"
"""A kubectl to use instead of the one built with the local control plane (e.g. for kind users without Go)."""


@dataclass(frozen=True)
class KubeTarget:
    """A reachable cluster and how to talk to it."""

    kubeconfig: Path
    """Admin kubeconfig of the cluster."""
    kubectl: Kubectl
    """kubectl bound to that kubeconfig."""
    local: LocalCluster | None
    """The local control plane, or ``None`` when the user's cluster is used."""
    started: bool
    """True when this call started the local cluster, so the caller must stop it."""

    def describe(self) -> str:
        if self.local is None:
            return f"the cluster of $KUBECONFIG={self.kubeconfig}"
        how = "started for this session" if self.started else "already running"
        return f"the local control plane in {self.local.work_dir} ({how})"


def _kubectl_for_user_cluster(environ: Mapping[str, str], kubeconfig: Path) -> Kubectl:
    explicit = environ.get(KUBECTL_ENV)
    if explicit:
        executable = Path(explicit)
        if not executable.is_file():
            raise ClusterError(f"${KUBECTL_ENV}={explicit} is not a file")
    else:
        cached = binaries_for().kubectl
        executable = cached if cached.is_file() else ensure_binaries().kubectl
    return Kubectl(executable=executable, kubeconfig=kubeconfig)


def resolve_target(
    *,
    scratch_dir: Path,
    environ: Mapping[str, str] | None = None,
    settings: ClusterSettings | None = None,
    report: Reporter = report_to_stderr,
) -> KubeTarget:
    """Find the cluster to use, starting a local one in ``scratch_dir`` if none is running.

    Order: the user's ``$KUBECONFIG`` when ``COPSE_E2E_USE_KUBECONFIG=1``; else the cluster
    ``make cluster-up`` runs (``$COPSE_CLUSTER_DIR`` or ``~/.cache/copse/cluster``); else a new
    local cluster in ``scratch_dir`` (``started`` is then True: the caller stops it).
    """
    environ = os.environ if environ is None else environ
    if environ.get(USE_KUBECONFIG_ENV) == "1":
        value = environ.get("KUBECONFIG", "")
        if not value:
            raise ClusterError(f"{USE_KUBECONFIG_ENV}=1 but $KUBECONFIG is not set")
        kubeconfig = Path(value.split(os.pathsep)[0])
        if not kubeconfig.is_file():
            raise ClusterError(f"$KUBECONFIG points at {kubeconfig}, which does not exist")
        return KubeTarget(
            kubeconfig=kubeconfig,
            kubectl=_kubectl_for_user_cluster(environ, kubeconfig),
            local=None,
            started=False,
        )
    if environ.get("KUBECONFIG"):
        report(f"ignoring $KUBECONFIG (set {USE_KUBECONFIG_ENV}=1 to run against it)")
    running = LocalCluster.attach(Path(environ.get("COPSE_CLUSTER_DIR") or default_work_dir()))
    if running is not None:
        return KubeTarget(
            kubeconfig=running.kubeconfig, kubectl=running.kubectl, local=running, started=False
        )
    own = dataclasses.replace(settings or ClusterSettings(), work_dir=scratch_dir)
    local, started = start_cluster(own, report=report)
    return KubeTarget(kubeconfig=local.kubeconfig, kubectl=local.kubectl, local=local, started=started)
