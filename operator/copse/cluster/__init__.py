"""A real local Kubernetes control plane (etcd, kube-apiserver, -controller-manager, -scheduler, kwok)
built from the Go module proxy, for e2e tests, the demo and users without a cluster."""

from copse.cluster.build import ensure_binaries
from copse.cluster.errors import (
    BuildError,
    ClusterError,
    ComponentFailedError,
    GoNotFoundError,
    PortInUseError,
)
from copse.cluster.kubectl import Kubectl, KubectlError
from copse.cluster.local import (
    ClusterSettings,
    FakeTopology,
    LocalCluster,
    default_work_dir,
    require_cluster,
    start_cluster,
    stop_cluster,
)
from copse.cluster.target import KubeTarget, resolve_target
from copse.cluster.versions import DEFAULT_VERSIONS, Binaries, Versions, binaries_for, cache_root

__all__ = [
    "DEFAULT_VERSIONS",
    "Binaries",
    "BuildError",
    "ClusterError",
    "ClusterSettings",
    "ComponentFailedError",
    "FakeTopology",
    "GoNotFoundError",
    "KubeTarget",
    "Kubectl",
    "KubectlError",
    "LocalCluster",
    "PortInUseError",
    "Versions",
    "binaries_for",
    "cache_root",
    "default_work_dir",
    "ensure_binaries",
    "require_cluster",
    "resolve_target",
    "start_cluster",
    "stop_cluster",
]
