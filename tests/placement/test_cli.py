"""``copse placement plan``: output formats and exit statuses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result

from copse.cli import main
from copse.topology import fake

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SEED = REPO / "examples" / "seed-inferencedeployment.yaml"


def run(*args: str | Path) -> Result:
    return CliRunner().invoke(main, ["placement", "plan", *map(str, args)])


def write(path: Path, documents: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump_all(documents))
    return path


def deployment(tmp_path: Path, **spec: Any) -> Path:
    manifest = {
        "apiVersion": "copse.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "test"},
        "spec": {"model": {"name": "m", "tensorParallelism": 8}, **spec},
    }
    return write(tmp_path / "deployment.yaml", [manifest])


def test_seed_deployment_on_the_example_nodes() -> None:
    result = run("--nodes", EXAMPLES / "nodes-2-racks.yaml", "--deployment", SEED, "--output", "json")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert plan["feasible"] is True
    assert plan["score"] == 1.0
    assert plan["unplaced"] == []
    assert [(g["role"], g["replica"]) for g in plan["groups"]] == [("worker", 0), ("worker", 1)]
    assert len({g["domain"] for g in plan["groups"]}) == 2
    for group in plan["groups"]:
        assert isinstance(group["cost"], float)
        assert [pod["gpus"] for pod in group["pods"]] == [4, 4]


def test_table_is_the_default(tmp_path: Path) -> None:
    result = run("--nodes", EXAMPLES / "nodes-2-racks.yaml", "--deployment", SEED)
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0].split() == ["ROLE", "REPLICA", "DOMAIN", "RACK", "NODES", "COST(us)"]
    assert lines[-1] == "score 1.000: 2 of 2 groups placed"


def test_disaggregated_example_places_every_group() -> None:
    result = run(
        "--nodes", EXAMPLES / "nodes-8-racks.yaml",
        "--pods", EXAMPLES / "pods-8-racks-busy.yaml",
        "--deployment", EXAMPLES / "deployment-disaggregated.yaml",
        "--output", "json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    roles = sorted(group["role"] for group in json.loads(result.output)["groups"])
    assert roles == ["decode"] * 2 + ["prefill"] * 4


def test_some_groups_unplaced_exits_3_and_still_lists_the_placed_ones(tmp_path: Path) -> None:
    nodes = write(tmp_path / "nodes.yaml", fake.gpu_nodes(racks=1, trays_per_rack=5))  # multi-document
    result = run("--nodes", nodes, "--deployment", deployment(tmp_path, replicas=3), "--output", "json")
    assert result.exit_code == 3
    plan = json.loads(result.output)
    assert plan["feasible"] is False
    assert len(plan["groups"]) == 2
    [unplaced] = plan["unplaced"]
    assert unplaced["role"] == "worker"
    assert unplaced["replica"] == 2
    assert "needs 8 GPUs" in unplaced["reason"]


def test_pods_take_gpus_away(tmp_path: Path) -> None:
    node_list = fake.node_list(fake.gpu_nodes(racks=1, trays_per_rack=2))
    nodes = write(tmp_path / "nodes.yaml", [node_list])
    pods = write(tmp_path / "pods.yaml", fake.busy_pods(node_list["items"], fraction=1.0, seed=0))
    free = run("--nodes", nodes, "--deployment", deployment(tmp_path, replicas=1))
    busy = run("--nodes", nodes, "--pods", pods, "--deployment", deployment(tmp_path, replicas=1))
    assert (free.exit_code, busy.exit_code) == (0, 3)
    assert "unplaced worker 0: needs 8 GPUs" in busy.output


def test_topology_config_changes_link_costs(tmp_path: Path) -> None:
    nodes = EXAMPLES / "nodes-2-racks.yaml"
    config = tmp_path / "topology.yaml"
    config.write_text("links:\n  domain: {bandwidthGBps: 90}\n")
    default = json.loads(run("--nodes", nodes, "--deployment", SEED, "--output", "json").output)
    slower = run("--nodes", nodes, "--deployment", SEED, "--output", "json", "--topology-config", config)
    assert slower.exit_code == 0
    assert json.loads(slower.output)["groups"][0]["cost"] > default["groups"][0]["cost"]
    config.write_text("links:\n  spine: {}\n")
    bad = run("--nodes", nodes, "--deployment", SEED, "--topology-config", config)
    assert bad.exit_code == 1
    assert "topology.yaml: links: unknown tier 'spine'" in bad.output


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("bad-manifest", "deployment.yaml: invalid InferenceDeployment:\n  spec.model.tensorParallelism"),
        ("pod-in-nodes", "nodes.yaml: item 1: expected kind Node, got 'Pod'"),
        ("nameless-node", "nodes.yaml: nodes[0]: metadata.name is missing"),
        ("missing-file", "nodes.yaml: cannot read"),
        ("not-yaml", "nodes.yaml: not valid YAML/JSON"),
    ],
)
def test_invalid_input_exits_1_naming_file_and_field(tmp_path: Path, case: str, message: str) -> None:
    nodes = tmp_path / "nodes.yaml"
    manifest = deployment(tmp_path, replicas=1)
    if case == "bad-manifest":
        write(nodes, fake.gpu_nodes(racks=1))
        doc = yaml.safe_load(manifest.read_text())
        doc["spec"]["model"]["tensorParallelism"] = 0
        write(manifest, [doc])
    elif case == "pod-in-nodes":
        write(nodes, [{"kind": "Pod", "metadata": {"name": "p"}}])
    elif case == "nameless-node":
        write(nodes, [{"kind": "Node", "metadata": {}}])
    elif case == "not-yaml":
        nodes.write_text("items: [unclosed\n")
    result = run("--nodes", nodes, "--deployment", manifest)
    assert result.exit_code == 1, result.output
    assert message in result.output
