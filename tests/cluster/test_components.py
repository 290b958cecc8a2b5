"""Component command lines: loopback only, wired to each other and to the cluster's files."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from copse.cluster import components as comp
from copse.cluster.errors import PortInUseError
from copse.cluster.local import _choose_ports
from copse.cluster.versions import Binaries

PORTS = comp.Ports(
    etcd_client=41001, etcd_peer=41002, apiserver=41003, controller_manager=41004, scheduler=41005
)
NETWORK_FLAG = re.compile(r"^--(listen-[a-z-]+|advertise-[a-z-]+|bind-address|etcd-servers|node-ip)$")


@pytest.fixture
def commands(tmp_path: Path) -> dict[str, comp.Component]:
    built = comp.components(
        binaries=Binaries(directory=tmp_path / "bin"), layout=comp.Layout(tmp_path / "work"), ports=PORTS
    )
    return {component.name: component for component in built}


def test_components_start_in_dependency_order(commands: dict[str, comp.Component]) -> None:
    assert tuple(commands) == comp.START_ORDER


def test_every_listening_address_is_loopback(commands: dict[str, comp.Component]) -> None:
    for component in commands.values():
        text = " ".join(component.argv)
        assert "0.0.0.0" not in text
        for flag, _, value in (arg.partition("=") for arg in component.argv[1:]):
            if NETWORK_FLAG.match(flag):
                hosts = [re.sub(r"^\w+://", "", url).split(":")[0] for url in value.split(",")]
                assert set(hosts) == {"127.0.0.1"}, (component.name, flag, value)
        if component.health_url is not None:
            assert component.health_url.split("/")[2].startswith("127.0.0.1:")


def test_apiserver_uses_etcd_port_tls_token_auth_and_rbac(
    commands: dict[str, comp.Component], tmp_path: Path
) -> None:
    argv = commands["kube-apiserver"].argv
    pki = tmp_path / "work" / "pki"
    assert f"--etcd-servers=http://127.0.0.1:{PORTS.etcd_client}" in argv
    assert f"--secure-port={PORTS.apiserver}" in argv
    assert f"--token-auth-file={pki / 'tokens.csv'}" in argv
    assert f"--client-ca-file={pki / 'ca.crt'}" in argv
    assert "--authorization-mode=RBAC" in argv
    assert f"--service-account-signing-key-file={pki / 'sa.key'}" in argv


def test_kwok_manages_only_annotated_nodes_with_the_stages_file(
    commands: dict[str, comp.Component], tmp_path: Path
) -> None:
    argv = commands["kwok"].argv
    assert "--manage-all-nodes=false" in argv
    assert "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake" in argv
    assert f"--config={tmp_path / 'bin' / 'kwok-stages.yaml'}" in argv


def test_a_taken_apiserver_port_is_reported_with_the_component_name() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            PortInUseError, match=rf"kube-apiserver: port 127\.0\.0\.1:{port} is already in use"
        ):
            _choose_ports(port)


def test_chosen_ports_are_distinct() -> None:
    ports = _choose_ports(None)
    numbers = [port for numbers in ports.by_component().values() for port in numbers]
    assert len(set(numbers)) == len(numbers) == 5


def test_apiserver_enforces_owner_reference_permissions_like_strict_clusters(
    commands: dict[str, comp.Component], tmp_path: Path
) -> None:
    assert (
        "--enable-admission-plugins=OwnerReferencesPermissionEnforcement" in commands["kube-apiserver"].argv
    )
    layout, binaries = comp.Layout(tmp_path / "work"), Binaries(directory=tmp_path / "bin")
    chosen = comp.kube_apiserver(
        binaries=binaries, layout=layout, ports=PORTS, admission_plugins=("A", "B")
    ).argv
    assert [arg for arg in chosen if arg.startswith("--enable-admission-plugins")] == [
        "--enable-admission-plugins=A,B"
    ]
    none = comp.kube_apiserver(binaries=binaries, layout=layout, ports=PORTS, admission_plugins=()).argv
    assert not [arg for arg in none if arg.startswith("--enable-admission-plugins")]
