"""A small runner around the kubectl built with the cluster (same release as the API server)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from copse.cluster.errors import ClusterError

Manifest = Mapping[str, Any] | Sequence[Mapping[str, Any]]


class KubectlError(ClusterError):
    def __init__(self, *, argv: Sequence[str], returncode: int, stderr: str) -> None:
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(f"kubectl {' '.join(argv)} exited {returncode}:\n{stderr.strip()}")


def manifest_yaml(manifest: Manifest) -> str:
    """One YAML stream from one object or a list of objects."""
    documents = [manifest] if isinstance(manifest, Mapping) else list(manifest)
    return yaml.safe_dump_all([dict(doc) for doc in documents], sort_keys=False)


@dataclass(frozen=True)
class Kubectl:
    """``kubectl --kubeconfig=<kubeconfig> ...`` with errors that carry kubectl's stderr."""

    executable: Path
    """The kubectl binary (the cached one of the cluster's release, unless $COPSE_KUBECTL says otherwise)."""
    kubeconfig: Path
    """Which cluster to talk to."""
    request_timeout: float = 120.0
    """Upper bound for one kubectl call, so a hung API server fails a test instead of hanging it."""

    def run(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl; raise :class:`KubectlError` on a non-zero exit when ``check``."""
        argv = [str(self.executable), f"--kubeconfig={self.kubeconfig}", *args]
        completed = subprocess.run(
            argv,
            input=stdin,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout or self.request_timeout,
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
        )
        if check and completed.returncode != 0:
            raise KubectlError(argv=args, returncode=completed.returncode, stderr=completed.stderr)
        return completed

    def apply(
        self, manifest: Manifest | Path, *, namespace: str | None = None, server_side: bool = False
    ) -> str:
        """``kubectl apply`` a file, a directory or objects; returns kubectl's output."""
        args = ["apply"]
        if namespace is not None:
            args.append(f"--namespace={namespace}")
        if server_side:
            # Tests own what they apply; take over fields another manager (helm, a previous run) set.
            args.extend(["--server-side", "--force-conflicts"])
        if isinstance(manifest, Path):
            return self.run(*args, "-f", str(manifest)).stdout
        return self.run(*args, "-f", "-", stdin=manifest_yaml(manifest)).stdout

    def create(
        self, manifest: Manifest, *, namespace: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """``kubectl create`` objects (fails if they exist; use for tests that expect admission errors)."""
        args = ["create", "-f", "-"]
        if namespace is not None:
            args.append(f"--namespace={namespace}")
        return self.run(*args, stdin=manifest_yaml(manifest), check=check)

    def get(self, *args: str, namespace: str | None = None) -> dict[str, Any]:
        """``kubectl get ... -o json`` parsed (a single object or a ``List``)."""
        extra = [f"--namespace={namespace}"] if namespace is not None else []
        parsed = json.loads(self.run("get", *args, *extra, "-o", "json").stdout)
        if not isinstance(parsed, dict):
            raise ClusterError(
                f"kubectl get {' '.join(args)} returned {type(parsed).__name__}, not an object"
            )
        return parsed

    def items(self, *args: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """The ``items`` of ``kubectl get <kind> ... -o json``."""
        items = self.get(*args, namespace=namespace).get("items", [])
        return list(items)

    def wait(self, *args: str, timeout: float = 60.0, namespace: str | None = None) -> None:
        """``kubectl wait ... --timeout`` (server-side watch; no polling loop here)."""
        extra = [f"--namespace={namespace}"] if namespace is not None else []
        self.run("wait", *args, *extra, f"--timeout={int(timeout)}s", timeout=timeout + 30)

    def wait_established(self, *targets: str, timeout: float = 60.0) -> None:
        """Wait until the CRDs of ``targets`` (``-f PATH`` or ``crd/NAME``) are Established.

        ``kubectl wait`` fails at once instead of waiting when the API server has not yet written
        a new CRD's first status condition (".status.conditions accessor error"): that is retried
        until ``timeout``, every other error is raised."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.wait(
                    "--for=condition=Established", *targets, timeout=max(1.0, deadline - time.monotonic())
                )
                return
            except KubectlError as exc:
                if "status.conditions accessor error" not in exc.stderr or time.monotonic() >= deadline:
                    raise
            time.sleep(0.2)  # the CRD has no status yet; kubectl cannot watch for its first condition
