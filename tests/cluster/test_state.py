"""The cluster state file and the PID checks that keep `cluster down` from signalling a stranger."""

from __future__ import annotations

import os
from pathlib import Path

from copse.cluster.state import (
    ClusterState,
    ProcessRecord,
    is_alive,
    parse_start_ticks,
    read_state,
    record_for,
    write_state,
)


def test_start_ticks_parse_survives_spaces_and_parens_in_the_command_name() -> None:
    fields = " ".join(str(n) for n in range(3, 53)).replace("3 ", "S ", 1)
    stat = f"1234 (kube) (api server) {fields}"
    # Field 22 is the 20th field after the command name (fields 3..52 here).
    assert parse_start_ticks(stat) == 22


def test_own_process_is_alive_and_a_reused_pid_is_not() -> None:
    record = record_for(os.getpid())
    assert is_alive(record)
    assert not is_alive(ProcessRecord(pid=os.getpid(), start_ticks=record.start_ticks + 1))


def test_state_round_trips_through_the_file(tmp_path: Path) -> None:
    state = ClusterState(
        versions_key="k8s-v1.34.4.etcd-v3.6.16.kwok-v0.8.0.helm-v3.21.4",
        bin_dir=tmp_path / "bin",
        kubeconfig=tmp_path / "kubeconfig",
        apiserver_url="https://127.0.0.1:40000",
        ports={"etcd": [40001, 40002], "kube-apiserver": [40000]},
        processes={"etcd": ProcessRecord(pid=10, start_ticks=99)},
    )
    path = tmp_path / "state.json"
    assert read_state(path) is None
    write_state(path, state)
    assert read_state(path) == state
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
