"""Choosing the cluster: the user's $KUBECONFIG only when explicitly asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

from copse.cluster.errors import ClusterError
from copse.cluster.target import resolve_target


def test_user_kubeconfig_is_used_when_opted_in(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kind.yaml"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    kubectl = tmp_path / "kubectl"
    kubectl.write_text("")
    environ = {
        "COPSE_E2E_USE_KUBECONFIG": "1",
        "KUBECONFIG": f"{kubeconfig}:{tmp_path / 'other.yaml'}",
        "COPSE_KUBECTL": str(kubectl),
    }
    target = resolve_target(scratch_dir=tmp_path / "unused", environ=environ)
    assert target.kubeconfig == kubeconfig
    assert target.kubectl.executable == kubectl
    assert target.kubectl.kubeconfig == kubeconfig
    assert target.local is None
    assert not target.started
    assert "$KUBECONFIG" in target.describe()
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize(
    ("kubeconfig", "message"),
    [(None, r"\$KUBECONFIG is not set"), ("missing.yaml", r"missing\.yaml, which does not exist")],
)
def test_opting_in_without_a_usable_kubeconfig_fails(
    tmp_path: Path, kubeconfig: str | None, message: str
) -> None:
    environ = {"COPSE_E2E_USE_KUBECONFIG": "1"}
    if kubeconfig is not None:
        environ["KUBECONFIG"] = str(tmp_path / kubeconfig)
    with pytest.raises(ClusterError, match=message):
        resolve_target(scratch_dir=tmp_path, environ=environ)


def test_a_missing_explicit_kubectl_is_named(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("")
    environ = {
        "COPSE_E2E_USE_KUBECONFIG": "1",
        "KUBECONFIG": str(kubeconfig),
        "COPSE_KUBECTL": "/nope/kubectl",
    }
    with pytest.raises(ClusterError, match=r"\$COPSE_KUBECTL=/nope/kubectl is not a file"):
        resolve_target(scratch_dir=tmp_path, environ=environ)
