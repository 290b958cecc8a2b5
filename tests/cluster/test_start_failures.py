"""A component that exits, cannot bind or never gets ready is named, with its log; stop is by PID."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from copse.cluster import components as comp
from copse.cluster.errors import ComponentFailedError, PortInUseError
from copse.cluster.local import ClusterSettings, _Starter, _stop_records
from copse.cluster.state import is_alive
from copse.cluster.versions import Binaries

PORTS = comp.Ports(
    etcd_client=41001, etcd_peer=41002, apiserver=41003, controller_manager=41004, scheduler=41005
)


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def starter(tmp_path: Path) -> _Starter:
    settings = ClusterSettings(work_dir=tmp_path / "work", ready_timeout=1.0)
    return _Starter(settings=settings, binaries=Binaries(directory=tmp_path / "bin"), report=lambda _: None)


def fake(name: str, script: str) -> comp.Component:
    return comp.Component(
        name=name, argv=("/bin/sh", "-c", script), health_url=f"http://127.0.0.1:{closed_port()}/health"
    )


def test_a_bind_failure_names_the_component_and_port(starter: _Starter) -> None:
    component = fake(
        "kube-apiserver", "echo 'listen tcp 127.0.0.1:41003: bind: address already in use'; exit 1"
    )
    popen = starter.launch(component, PORTS)
    with pytest.raises(PortInUseError, match=r"kube-apiserver: port 127\.0\.0\.1:41003 is already in use"):
        starter.wait_ready(component, popen, PORTS)


def test_an_exiting_component_reports_its_code_log_and_last_lines(starter: _Starter) -> None:
    component = fake("etcd", "echo 'etcd: bad flag --frobnicate'; exit 3")
    popen = starter.launch(component, PORTS)
    with pytest.raises(ComponentFailedError) as caught:
        starter.wait_ready(component, popen, PORTS)
    message = str(caught.value)
    assert message.startswith("etcd exited with code 3")
    assert f"log: {starter.layout.log('etcd')}" in message
    assert "bad flag --frobnicate" in message


def test_a_component_that_never_gets_ready_is_named_and_stopped_by_pid(starter: _Starter) -> None:
    component = fake("kube-scheduler", "echo starting; exec sleep 60")
    popen = starter.launch(component, PORTS)
    with pytest.raises(ComponentFailedError, match="kube-scheduler did not become ready within 1s"):
        starter.wait_ready(component, popen, PORTS)
    record = starter.records["kube-scheduler"]
    assert is_alive(record)
    assert _stop_records(starter.records, popens=starter.popens) == ["kube-scheduler"]
    assert not is_alive(record)
    assert popen.returncode is not None
