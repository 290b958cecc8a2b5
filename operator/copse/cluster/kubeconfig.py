"""The kubeconfig of the local control plane (pure: builds the document, writes nothing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CONTEXT = "copse-local"
"""Cluster, user and context name, so merged kubeconfigs show where the entry came from."""


def render_kubeconfig(
    *, server: str, ca_file: Path, token: str, namespace: str = "default"
) -> dict[str, Any]:
    """A single-context kubeconfig authenticating with a bearer token against ``server``."""
    if not server.startswith("https://"):
        raise ValueError(f"server must be an https:// URL, got {server!r}")
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CONTEXT, "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
        "users": [{"name": CONTEXT, "user": {"token": token}}],
        "contexts": [
            {"name": CONTEXT, "context": {"cluster": CONTEXT, "user": CONTEXT, "namespace": namespace}}
        ],
        "current-context": CONTEXT,
        "preferences": {},
    }


def dump_kubeconfig(config: dict[str, Any]) -> str:
    return yaml.safe_dump(config, sort_keys=False)
