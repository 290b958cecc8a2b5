"""Errors of the local control plane; each names the component and where its log is."""

from __future__ import annotations

from pathlib import Path


class ClusterError(RuntimeError):
    """Base class: something about the local control plane failed."""


class GoNotFoundError(ClusterError):
    def __init__(self) -> None:
        super().__init__(
            "go was not found on PATH; the local control plane is built from the Go module proxy "
            "(Go >= 1.24 needed). Install Go, or point $KUBECONFIG at an existing cluster "
            "(see 'Local control plane' in README.md)."
        )


class BuildError(ClusterError):
    def __init__(self, *, component: str, command: str, log: Path, tail: str) -> None:
        self.component = component
        self.log = log
        super().__init__(
            f"building {component} failed: {command}\nlog: {log}\n--- last lines ---\n{tail}".rstrip()
        )


class PortInUseError(ClusterError):
    def __init__(self, *, component: str, port: int) -> None:
        self.component = component
        self.port = port
        super().__init__(
            f"{component}: port 127.0.0.1:{port} is already in use; choose another or stop its owner"
        )


class ComponentFailedError(ClusterError):
    """A component exited or did not become ready in time."""

    def __init__(self, *, component: str, reason: str, log: Path, tail: str) -> None:
        self.component = component
        self.log = log
        super().__init__(f"{component} {reason}\nlog: {log}\n--- last lines ---\n{tail}".rstrip())


class ToolNotFoundError(ClusterError):
    def __init__(self, *, tool: str, purpose: str) -> None:
        super().__init__(f"{tool} was not found on PATH; it is needed to {purpose}")
