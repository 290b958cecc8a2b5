"""Which fake nodes a cluster gets, and how a user-supplied node list is checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from copse.cli import main
from copse.cluster.local import FakeTopology, check_fake_nodes


def test_default_topology_is_two_nvl72_racks_of_18_four_gpu_trays_plus_cpu_nodes() -> None:
    nodes = FakeTopology().nodes()
    gpus = [int(node["status"]["allocatable"].get("nvidia.com/gpu", "0")) for node in nodes]
    assert sum(1 for count in gpus if count == 4) == 36
    assert sum(1 for count in gpus if count == 0) == 3
    cliques = {node["metadata"]["labels"].get("nvidia.com/gpu.clique") for node in nodes} - {None}
    assert len(cliques) == 2
    check_fake_nodes(nodes)


def test_a_node_kwok_would_ignore_is_rejected_by_name() -> None:
    node = FakeTopology(racks=0, cpu_nodes=1).nodes()[0]
    node["metadata"]["annotations"] = {}
    with pytest.raises(ValueError, match=r"nodes.yaml: node cpu-0 lacks the annotation kwok\.x-k8s\.io/node"):
        check_fake_nodes([node], source="nodes.yaml")
    with pytest.raises(ValueError, match="item #0 has kind 'Pod'"):
        check_fake_nodes([{"kind": "Pod"}])


def test_cluster_nodes_output_is_accepted_by_up_and_a_bad_file_exits_1(tmp_path: Path) -> None:
    runner = CliRunner()
    listed = runner.invoke(
        main, ["cluster", "nodes", "--racks", "1", "--trays-per-rack", "2", "--cpu-nodes", "1"]
    )
    assert listed.exit_code == 0, listed.output
    node_list = yaml.safe_load(listed.output)
    check_fake_nodes(node_list["items"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump({"kind": "NodeList", "items": [{"kind": "Node", "metadata": {"name": "n1"}}]})
    )
    result = runner.invoke(main, ["cluster", "up", "--dir", str(tmp_path / "c"), "--nodes", str(bad)])
    assert result.exit_code == 1  # invalid input
    assert f"--nodes: {bad}: node n1 lacks the annotation" in result.output
    assert not (tmp_path / "c").exists()
