"""Fixtures for end-to-end tests against a real Kubernetes API server.

The session runs against, in order: ``$KUBECONFIG`` when ``COPSE_E2E_USE_KUBECONFIG=1``
(kind, a real cluster); the local control plane ``make cluster-up`` started; or a local
control plane started for this session (and stopped at its end). ``crds/`` is applied
first. Every test under e2e/ is marked ``e2e``. When a test fails, the tails of the local
components' logs are attached to its report.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from e2e.operator_harness import LEASE, Operator, operator_kubeconfig

from copse.cluster import Kubectl, KubeTarget, LocalCluster, resolve_target
from copse.workers.testing import nats_server

REPO = Path(__file__).resolve().parents[1]
CRDS = REPO / "crds"
_LOCAL_CLUSTER = pytest.StashKey[LocalCluster]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.e2e)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report: pytest.TestReport = yield
    local = item.config.stash.get(_LOCAL_CLUSTER, None)
    if report.failed and local is not None:
        report.sections.append(("copse local control plane logs (tails)", local.log_tails(lines=25)))
    return report


@pytest.fixture(scope="session")
def kube(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeTarget]:
    """The cluster of this session, with ``crds/`` applied and established."""
    target = resolve_target(scratch_dir=tmp_path_factory.mktemp("cluster"))
    if target.local is not None:
        request.config.stash[_LOCAL_CLUSTER] = target.local
    try:
        with pytest.MonkeyPatch.context() as patch:
            # Clients built inside tests (kopf, kubernetes, helm) find the same cluster.
            patch.setenv("KUBECONFIG", str(target.kubeconfig))
            if any(CRDS.glob("*.yaml")):
                target.kubectl.apply(CRDS, server_side=True)
                target.kubectl.wait_established("-f", str(CRDS), timeout=60)
            yield target
    finally:
        if target.started and target.local is not None:
            target.local.stop()


@pytest.fixture(scope="session")
def kubeconfig(kube: KubeTarget) -> Path:
    """Path of the admin kubeconfig (also exported as $KUBECONFIG for the session)."""
    return kube.kubeconfig


@pytest.fixture(scope="session")
def kubectl(kube: KubeTarget) -> Kubectl:
    """kubectl of the cluster's release, bound to the session's kubeconfig."""
    return kube.kubectl


@pytest.fixture
def namespace(request: pytest.FixtureRequest, kubectl: Kubectl) -> Iterator[str]:
    """A fresh namespace for one test (its default ServiceAccount exists); deleted afterwards."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].rstrip("-")
    name = f"e2e-{slug}-{uuid.uuid4().hex[:6]}"
    kubectl.run("create", "namespace", name)
    # Pods are refused until the controller-manager has created the namespace's default ServiceAccount.
    kubectl.wait("--for=create", "serviceaccount/default", namespace=name, timeout=60)
    yield name
    if request.node.get_closest_marker("fills_cluster") is None:
        kubectl.run("delete", "namespace", name, "--wait=false")
    else:
        # Its pods hold most GPUs until they are gone; the next test may need some of them.
        kubectl.run("delete", "namespace", name, "--wait=true", "--timeout=300s")


@pytest.fixture(scope="session")
def operator(kubectl: Kubectl, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    """``copse operator run`` as its own process, with only the chart's operator RBAC."""
    directory = tmp_path_factory.mktemp("operator")
    running = Operator(
        log=directory / "operator.log", kubeconfig=operator_kubeconfig(kubectl, directory), lease=LEASE
    )
    running.start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """A throwaway NATS server for the module's tests (routers and mocked engines share it)."""
    with nats_server() as url:
        yield url
