"""Which upstream releases the local control plane is built from, and where they are cached."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

_KUBE_VERSION = re.compile(r"^v1\.(\d+)\.(\d+)$")


@dataclass(frozen=True)
class Versions:
    """Upstream release tags; each distinct set gets its own cache directory."""

    kubernetes: str = "v1.34.4"
    """kube-apiserver, -controller-manager, -scheduler and kubectl; 1.34 is what kwok 0.8 pairs with."""
    etcd: str = "v3.6.16"
    """3.6 is the etcd line upstream tests 1.34 against (3.4/3.5 from distros are below its minimum)."""
    kwok: str = "v0.8.0"
    """Fakes kubelets: keeps annotated nodes Ready and makes their pods Running."""
    helm: str = "v3.21.4"
    """For chart tests and the demo; v3 because the chart targets Helm 3."""

    def __post_init__(self) -> None:
        if not _KUBE_VERSION.match(self.kubernetes):
            raise ValueError(f"kubernetes version must look like v1.<minor>.<patch>, got {self.kubernetes!r}")

    @property
    def kube_minor(self) -> str:
        """The minor number of the Kubernetes release, e.g. ``"34"``."""
        match = _KUBE_VERSION.match(self.kubernetes)
        assert match is not None  # checked in __post_init__
        return match.group(1)

    @property
    def staging(self) -> str:
        """The tag staging modules (``k8s.io/api`` etc.) carry for this release: v1.34.4 -> v0.34.4."""
        return "v0." + self.kubernetes.removeprefix("v1.")

    @property
    def key(self) -> str:
        """Directory name under the binary cache; changes whenever any version changes."""
        return f"k8s-{self.kubernetes}.etcd-{self.etcd}.kwok-{self.kwok}.helm-{self.helm}"


DEFAULT_VERSIONS = Versions()


def cache_root() -> Path:
    """``$COPSE_CACHE_DIR``, else ``$XDG_CACHE_HOME/copse``, else ``~/.cache/copse``."""
    explicit = os.environ.get("COPSE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "copse"


@dataclass(frozen=True)
class Binaries:
    """Paths of the built executables of one :class:`Versions` set."""

    directory: Path
    """The cache directory holding them all (``<cache>/bin/<versions.key>``)."""
    names: tuple[str, ...] = field(
        default=(
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kubectl",
            "kwok",
            "helm",
        )
    )
    """Every executable the cluster and the tests need."""

    def path(self, name: str) -> Path:
        if name not in self.names:
            raise KeyError(f"unknown binary {name!r}; known: {', '.join(self.names)}")
        return self.directory / name

    @property
    def kubectl(self) -> Path:
        return self.path("kubectl")

    @property
    def helm(self) -> Path:
        return self.path("helm")

    @property
    def kwok_stages(self) -> Path:
        """kwok 0.8 refuses to start without stages; this file is assembled from its module at build time."""
        return self.directory / "kwok-stages.yaml"

    def missing(self) -> list[str]:
        """Names of artefacts not yet in the cache (the stages file counts as ``kwok-stages``)."""
        absent = [name for name in self.names if not self.path(name).is_file()]
        if not self.kwok_stages.is_file():
            absent.append("kwok-stages")
        return absent


def binaries_for(versions: Versions = DEFAULT_VERSIONS, *, root: Path | None = None) -> Binaries:
    """Where the binaries of ``versions`` live (whether built yet or not)."""
    return Binaries(directory=(root or cache_root()) / "bin" / versions.key)
