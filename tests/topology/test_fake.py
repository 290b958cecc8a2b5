"""Fake GB200 nodes, CPU nodes, busy pods and ``copse cluster nodes``."""

from __future__ import annotations

from collections import Counter
from typing import Any

import click
import pytest
import yaml
from click.testing import CliRunner

from copse.topology import build_topology, fake
from copse.topology.cli import nodes as nodes_command


def test_gb200_nodes_look_like_gfd_labelled_kwok_trays() -> None:
    nodes = fake.gpu_nodes(racks=2, trays_per_rack=18)
    assert len(nodes) == 36
    node = nodes[0]
    assert node["apiVersion"] == "v1"
    assert node["kind"] == "Node"
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    labels = node["metadata"]["labels"]
    assert labels["kubernetes.io/hostname"] == node["metadata"]["name"]
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-GB200"
    assert labels["nvidia.com/gpu.count"] == "4"
    cluster_uuid, _, clique_id = labels["nvidia.com/gpu.clique"].rpartition(".")
    assert cluster_uuid == fake.rack_uuid(0)
    assert clique_id == "0"
    status = node["status"]
    assert status["allocatable"]["nvidia.com/gpu"] == "4"
    assert {"cpu", "memory", "pods"} <= set(status["capacity"])
    ready = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert ready == [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]
    assert fake.gpu_nodes(racks=2) == fake.gpu_nodes(racks=2)  # deterministic


def test_cordoned_trays_spread_over_racks_from_the_top() -> None:
    nodes = fake.gpu_nodes(racks=3, trays_per_rack=4, cordoned=4, not_ready=2)
    cordoned = [n["metadata"]["name"] for n in nodes if n["spec"].get("unschedulable")]
    assert cordoned == ["gb200-r000-t02", "gb200-r000-t03", "gb200-r001-t03", "gb200-r002-t03"]
    topology = build_topology(nodes)
    not_ready = sorted(name for name, node in topology.nodes.items() if not node.ready)
    assert not_ready == ["gb200-r000-t00", "gb200-r001-t00"]
    assert all(topology.nodes[name].cordoned for name in cordoned)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"racks": 1, "trays_per_rack": 2, "cordoned": 3}, "cannot cordon 3"),
        ({"racks": -1}, "racks must be >= 0"),
        ({"racks": 1, "gpus_per_tray": 0}, "GPUs per tray must be >= 1"),
        ({"racks": 1, "trays_per_rack": 2, "cliques_per_rack": 3}, "cliques per rack"),
    ],
)
def test_impossible_clusters_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fake.gpu_nodes(**kwargs)


def test_cpu_nodes_have_no_gpus() -> None:
    nodes = fake.cpu_nodes(2)
    assert [n["metadata"]["name"] for n in nodes] == ["cpu-0", "cpu-1"]
    assert all("nvidia.com/gpu" not in n["status"]["allocatable"] for n in nodes)
    assert all(n["metadata"]["labels"]["copse.dev/node-pool"] == "cpu" for n in nodes)
    assert build_topology(nodes).gpu_nodes == []


def test_busy_pods_take_between_one_gpu_and_a_whole_tray() -> None:
    nodes = fake.gpu_nodes(racks=4)
    pods = fake.busy_pods(nodes, fraction=0.5, seed=7)
    assert pods == fake.busy_pods(nodes, fraction=0.5, seed=7)
    assert 0.3 * len(nodes) < len(pods) < 0.7 * len(nodes)
    topology = build_topology(nodes, pods=pods)
    free = Counter(node.free for node in topology.gpu_nodes)
    assert set(free) == {0, 1, 2, 3, 4}
    assert free[4] == len(nodes) - len(pods)


def test_nodes_command_prints_a_node_list() -> None:
    result = CliRunner().invoke(
        nodes_command,
        [
            "--racks",
            "2",
            "--trays-per-rack",
            "3",
            "--gpus-per-tray",
            "8",
            "--cordoned",
            "1",
            "--cpu-nodes",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    listing = yaml.safe_load(result.output)
    assert listing["kind"] == "NodeList"
    assert len(listing["items"]) == 7
    topology = build_topology(listing["items"])
    assert sum(node.gpus for node in topology.gpu_nodes) == 48
    assert sum(node.cordoned for node in topology.gpu_nodes) == 1


def test_nodes_command_rejects_impossible_input_with_exit_2() -> None:
    result = CliRunner().invoke(nodes_command, ["--racks", "1", "--trays-per-rack", "2", "--cordoned", "5"])
    assert result.exit_code == 2
    assert "cannot cordon 5" in result.output
    assert isinstance(nodes_command, click.Command)
