"""``copse placement plan``: where a deployment's TP groups would go on a given node list.

Exit status: 0 when every group is placed, 3 when some are not (the output still lists what
was placed and why the rest was not), 2 for invalid input (the message names file and field).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import click
import yaml

from copse.api.manifest import ManifestError, load_deployment, read_documents
from copse.placement.model import Plan, Pod
from copse.placement.scheduler import plan as place
from copse.placement.spec import request_from_spec
from copse.topology.config import TopologyConfig
from copse.topology.graph import TopologyError, build_topology
from copse.workers.conventions import EXIT_FAILURE, json_renamed, output_option, render

EXIT_UNPLACED = 3
EXIT_INVALID = EXIT_FAILURE


def _objects(path: Path, kind: str) -> list[dict[str, Any]]:
    """The ``kind`` objects of a file: a ``*List``, several documents or one object."""
    objects = read_documents(path)
    for index, obj in enumerate(objects):
        if obj.get("kind", kind) != kind:
            raise ManifestError(f"{path}: item {index + 1}: expected kind {kind}, got {obj.get('kind')!r}")
    return objects


def _config(path: Path | None) -> TopologyConfig:
    if path is None:
        return TopologyConfig()
    try:
        return TopologyConfig.from_dict(yaml.safe_load(path.read_text()))
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: not valid YAML/JSON: {exc}") from exc
    except ValueError as exc:
        raise ManifestError(f"{path}: {exc}") from exc


def _pods_cell(pods: Sequence[Pod]) -> str:
    """``node:gpus`` per pod; long gangs as first..last with the count, to keep rows readable."""
    if len(pods) <= 4:
        return ",".join(f"{pod.node}:{pod.gpus}" for pod in pods)
    sizes = {pod.gpus for pod in pods}
    shape = f"{len(pods)} pods x {sizes.pop()} GPUs" if len(sizes) == 1 else f"{len(pods)} pods"
    return f"{pods[0].node}..{pods[-1].node} ({shape})"


def _table(result: Plan) -> str:
    header = ("ROLE", "REPLICA", "DOMAIN", "RACK", "NODES", "COST(us)")
    rows = [
        (
            group.role,
            str(group.replica),
            group.domain or "(spans domains)",
            group.rack or "-",
            _pods_cell(group.pods),
            f"{group.cost.total:.1f}",
        )
        for group in result.groups
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    placed, total = len(result.groups), len(result.groups) + len(result.unplaced)
    lines.append(f"score {result.score:.3f}: {placed} of {total} groups placed")
    lines.extend(f"unplaced {item.role} {item.replica}: {item.reason}" for item in result.unplaced)
    return "\n".join(lines)


def _fail(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_INVALID)


@click.group("placement")
def placement() -> None:
    """Gang placement of TP groups onto NVLink domains, without a cluster.

    \b
    Examples:
      copse placement plan --nodes examples/nodes-2-racks.yaml \\
        --deployment examples/seed-inferencedeployment.yaml
    """


@placement.command("plan")
@click.option("--nodes", "nodes_path", type=Path, required=True, help="NodeList/List or Node documents.")
@click.option(
    "--deployment", "deployment_path", type=Path, required=True, help="InferenceDeployment manifest."
)
@click.option("--pods", "pods_path", type=Path, help="Pods already holding GPUs (PodList or documents).")
@output_option()
@click.option(
    "--topology-config",
    "config_path",
    type=Path,
    help="YAML with label keys (labels:) and link tier costs (links:) overriding the defaults.",
)
@json_renamed
def plan_command(
    nodes_path: Path, deployment_path: Path, pods_path: Path | None, output: str, config_path: Path | None
) -> None:
    """Place the --deployment's TP groups on the --nodes and print the plan. Exits 3 when the
    deployment cannot be placed whole (the plan says why).

    \b
    Examples:
      copse placement plan --nodes examples/nodes-8-racks.yaml \\
        --deployment examples/deployment-disaggregated.yaml
      copse placement plan --nodes examples/nodes-8-racks.yaml --pods examples/pods-8-racks-busy.yaml \\
        --deployment examples/deployment-tp64.yaml -o json
    """
    try:
        nodes = _objects(nodes_path, "Node")
        pods: Sequence[dict[str, Any]] = _objects(pods_path, "Pod") if pods_path else []
        deployment = load_deployment(deployment_path)
        config = _config(config_path)
    except ManifestError as exc:
        _fail(str(exc))
    try:
        topology = build_topology(nodes, pods=pods, label_keys=config.labels, links=config.links)
    except TopologyError as exc:
        _fail(f"{nodes_path}: {exc}")
    result = place(topology, request_from_spec(deployment.spec))
    for warning in result.warnings:
        click.echo(f"warning: {warning}", err=True)
    click.echo(render(result.to_json(), output=output, table=lambda: _table(result)))
    if not result.feasible:
        sys.exit(EXIT_UNPLACED)
