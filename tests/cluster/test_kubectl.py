"""The kubectl runner: waiting for CRDs across kubectl's first-condition race."""

from __future__ import annotations

from pathlib import Path

import pytest

from copse.cluster.kubectl import Kubectl, KubectlError

RACE = "error: .status.conditions accessor error: <nil> is of the type <nil>, expected []interface{}"


def _kubectl(tmp_path: Path, *, failures: int, stderr: str) -> tuple[Kubectl, Path]:
    """A stand-in kubectl whose first ``failures`` calls fail with ``stderr``; it logs its arguments."""
    calls = tmp_path / "calls"
    script = tmp_path / "kubectl"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {calls}\n'
        f'if [ "$(wc -l < {calls})" -le {failures} ]; then echo {stderr!r} >&2; exit 1; fi\n'
    )
    script.chmod(0o755)
    return Kubectl(executable=script, kubeconfig=tmp_path / "kubeconfig"), calls


def test_a_crd_without_conditions_yet_is_waited_for(tmp_path: Path) -> None:
    kubectl, calls = _kubectl(tmp_path, failures=2, stderr=RACE)
    kubectl.wait_established("-f", "crds", timeout=30)
    lines = calls.read_text().splitlines()
    assert len(lines) == 3
    assert all("wait --for=condition=Established -f crds --timeout=" in line for line in lines)


def test_other_kubectl_errors_are_not_retried(tmp_path: Path) -> None:
    missing = 'error: the server does not have resource type "crds"'
    kubectl, calls = _kubectl(tmp_path, failures=5, stderr=missing)
    with pytest.raises(KubectlError, match="does not have resource type"):
        kubectl.wait_established("crd/x.example.com", timeout=30)
    assert len(calls.read_text().splitlines()) == 1


def test_the_race_is_retried_only_until_the_timeout(tmp_path: Path) -> None:
    kubectl, calls = _kubectl(tmp_path, failures=1_000_000, stderr=RACE)
    with pytest.raises(KubectlError, match="accessor error"):
        kubectl.wait_established("-f", "crds", timeout=1)
    assert len(calls.read_text().splitlines()) >= 2
