"""Pure text work for building Kubernetes from the Go module proxy.

``k8s.io/kubernetes`` requires its staging modules at ``v0.0.0`` and maps them to
``./staging/...`` with ``replace``; replaces only apply in the main module, so a
wrapper module must pin every staging module to its published tag itself. The list
is read from the release's own go.mod so that it stays right for other minors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

_STAGING_REPLACE = re.compile(
    r"^\s*(?:replace\s+)?(k8s\.io/[A-Za-z0-9._-]+)\s+=>\s+\./staging/", re.MULTILINE
)
_GO_DIRECTIVE = re.compile(r"^go\s+(\S+)\s*$", re.MULTILINE)
_GODEBUG_LINE = re.compile(r"^godebug\s+(\S.*?)\s*$", re.MULTILINE)
_GODEBUG_BLOCK = re.compile(r"^godebug\s*\(\s*\n(.*?)^\)", re.MULTILINE | re.DOTALL)

VERSION_PACKAGES = ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
"""Packages whose ``gitVersion`` etc. ``/version`` and ``kubectl version`` report (hack/lib/version.sh)."""


@dataclass(frozen=True)
class ReleaseGoMod:
    """What the wrapper module must copy from ``k8s.io/kubernetes``'s go.mod."""

    go: str
    """The ``go`` directive: the language version the release is written against."""
    godebug: tuple[str, ...]
    """``godebug`` settings; only the main module's count, so the wrapper repeats them."""
    staging: tuple[str, ...]
    """Staging module paths (``k8s.io/api`` ...) that must be pinned to ``v0.<minor>.<patch>``."""


def parse_release_gomod(text: str, *, source: str = "go.mod") -> ReleaseGoMod:
    """Read the go directive, godebug settings and staging modules of a Kubernetes release go.mod."""
    go_match = _GO_DIRECTIVE.search(text)
    if go_match is None:
        raise ValueError(f"{source}: no 'go' directive; is this the go.mod of k8s.io/kubernetes?")
    staging = tuple(dict.fromkeys(_STAGING_REPLACE.findall(text)))
    if not staging:
        raise ValueError(
            f"{source}: no 'k8s.io/... => ./staging/...' replace lines; is this k8s.io/kubernetes?"
        )
    godebug = list(_GODEBUG_LINE.findall(text))
    godebug = [line for line in godebug if line != "("]
    for block in _GODEBUG_BLOCK.findall(text):
        godebug.extend(line.strip() for line in block.splitlines() if line.strip())
    return ReleaseGoMod(go=go_match.group(1), godebug=tuple(godebug), staging=staging)


def render_wrapper_gomod(
    *,
    module: str,
    release: ReleaseGoMod,
    requires: Mapping[str, str],
    staging_version: str,
) -> str:
    """The go.mod of a throwaway main module that builds ``requires`` with staging pinned."""
    lines = [f"module {module}", "", f"go {release.go}", ""]
    lines.extend(f"godebug {setting}" for setting in release.godebug)
    if release.godebug:
        lines.append("")
    lines.append("require (")
    lines.extend(f"\t{path} {version}" for path, version in sorted(requires.items()))
    lines.extend([")", "", "replace ("])
    lines.extend(f"\t{path} => {path} {staging_version}" for path in sorted(release.staging))
    lines.append(")")
    return "\n".join(lines) + "\n"


def render_simple_gomod(*, module: str, go: str) -> str:
    """The go.mod of a wrapper module with no pins (``go get`` fills in the requirements)."""
    return f"module {module}\n\ngo {go}\n"


def kube_version_ldflags(*, version: str, minor: str, build_date: str) -> str:
    """Linker flags that make binaries report the real release instead of ``v0.0.0-master``."""
    flags = ["-s", "-w"]
    for package in VERSION_PACKAGES:
        for name, value in (
            ("gitVersion", version),
            ("gitMajor", "1"),
            ("gitMinor", minor),
            ("gitTreeState", "clean"),
            ("buildDate", build_date),
        ):
            flags.append(f"-X {package}.{name}={value}")
    return " ".join(flags)


KWOK_STAGES = (
    "node/fast/node-initialize",
    "node/heartbeat-with-lease/node-heartbeat-with-lease",
    "pod/fast/pod-ready",
    "pod/fast/pod-complete",
    "pod/fast/pod-delete",
)
"""Stages kwokctl installs by default: nodes become Ready and keep a lease; pods run, finish, delete."""


def join_yaml_documents(documents: Iterable[str]) -> str:
    """Concatenate YAML texts into one multi-document stream."""
    parts = [doc.strip("\n") for doc in documents]
    if any(not part.strip() for part in parts):
        raise ValueError("empty YAML document")
    return "\n---\n".join(parts) + "\n"
