"""``copse cluster``: build, start, inspect and stop the local control plane."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import click

from copse.api.manifest import read_documents
from copse.cluster.build import ensure_binaries
from copse.cluster.components import DEFAULT_ADMISSION_PLUGINS, Layout
from copse.cluster.errors import ClusterError
from copse.cluster.local import (
    ClusterSettings,
    FakeTopology,
    LocalCluster,
    check_fake_nodes,
    default_work_dir,
    start_cluster,
    stop_cluster,
)
from copse.cluster.state import is_alive, read_state
from copse.topology.cli import nodes as fake_nodes
from copse.workers.conventions import Failure

_DIR_OPTION = click.option(
    "--dir",
    "work_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Cluster work dir (PKI, etcd data, kubeconfig, logs). "
    "Default: $COPSE_CLUSTER_DIR or ~/.cache/copse/cluster.",
)


def _env_lines(cluster: LocalCluster) -> str:
    return "\n".join(
        [
            f"export KUBECONFIG={shlex.quote(str(cluster.kubeconfig))}",
            f'export PATH={shlex.quote(str(cluster.binaries.directory))}:"$PATH"',
        ]
    )


@click.group()
def cluster() -> None:
    """A real local Kubernetes control plane with fake (kwok) GPU nodes.

    \b
    Examples:
      eval "$(copse cluster up)" && kubectl get nodes
      copse cluster down
    """


@cluster.command()
def build() -> None:
    """Build etcd, kube-apiserver, -controller-manager, -scheduler, kubectl, kwok and helm (cached).

    \b
    Examples:
      copse cluster build
    """
    try:
        binaries = ensure_binaries()
    except ClusterError as error:
        raise click.ClickException(str(error)) from error
    click.echo(str(binaries.directory))


@cluster.command()
@_DIR_OPTION
@click.option("--port", type=click.IntRange(1, 65535), default=None, help="API server port (default: free).")
@click.option("--racks", type=click.IntRange(0), default=2, show_default=True, help="Fake NVL72 racks.")
@click.option("--trays-per-rack", type=click.IntRange(1), default=18, show_default=True)
@click.option("--gpus-per-tray", type=click.IntRange(1), default=4, show_default=True)
@click.option(
    "--cpu-nodes", type=click.IntRange(0), default=3, show_default=True, help="CPU-only fake nodes."
)
@click.option(
    "--admission-plugin",
    "admission_plugins",
    multiple=True,
    help="Admission plugin to add to the API server's defaults (repeatable); "
    "default: OwnerReferencesPermissionEnforcement, as strict clusters (OpenShift) run.",
)
@click.option(
    "--nodes",
    "nodes_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Create these nodes instead (a NodeList, e.g. from 'copse cluster nodes').",
)
def up(
    *,
    work_dir: Path | None,
    port: int | None,
    racks: int,
    trays_per_rack: int,
    gpus_per_tray: int,
    cpu_nodes: int,
    admission_plugins: tuple[str, ...],
    nodes_file: Path | None,
) -> None:
    """Start the cluster (or reuse the one running there) and print shell exports for it.

    \b
    Examples:
      eval "$(copse cluster up)"
      copse cluster up --nodes examples/nodes-8-racks.yaml --dir /tmp/copse-8-racks
    """
    settings = ClusterSettings(
        work_dir=work_dir or default_work_dir(),
        apiserver_port=port,
        topology=FakeTopology(
            racks=racks, trays_per_rack=trays_per_rack, gpus_per_tray=gpus_per_tray, cpu_nodes=cpu_nodes
        ),
        admission_plugins=admission_plugins or DEFAULT_ADMISSION_PLUGINS,
    )
    nodes = None if nodes_file is None else _read_nodes(nodes_file)
    try:
        local, _ = start_cluster(settings, nodes=nodes)
    except ClusterError as error:
        raise click.ClickException(str(error)) from error
    click.echo(_env_lines(local))


def _read_nodes(path: Path) -> list[dict[str, Any]]:
    """Nodes from a NodeList/List document or a stream of Node documents; exit 1 if invalid."""
    try:
        nodes = read_documents(path)
        check_fake_nodes(nodes, source=str(path))
    except ValueError as error:  # a ManifestError, or a node the fake cluster cannot use
        raise Failure(f"--nodes: {error}") from error
    return nodes


@cluster.command()
@_DIR_OPTION
def down(work_dir: Path | None) -> None:
    """Stop exactly the processes the cluster in --dir recorded.

    \b
    Examples:
      copse cluster down
    """
    stopped = stop_cluster(work_dir)
    click.echo(f"stopped {', '.join(stopped)}" if stopped else "no cluster was running")


@cluster.command()
@_DIR_OPTION
def status(work_dir: Path | None) -> None:
    """Show each component's PID and liveness; exit 1 unless the cluster is up and ready.

    \b
    Examples:
      copse cluster status
    """
    layout = Layout(work_dir or default_work_dir())
    state = read_state(layout.state)
    if state is None:
        click.echo(f"no cluster recorded in {layout.work_dir}")
        raise SystemExit(1)
    for name, record in state.processes.items():
        ports = ",".join(str(port) for port in state.ports.get(name, []))
        alive = "running" if is_alive(record) else "DEAD"
        click.echo(
            f"{name:<24} pid {record.pid:<8} {alive:<8} ports {ports or '-':<12} log {layout.log(name)}"
        )
    click.echo(f"kubeconfig  {state.kubeconfig}")
    click.echo(f"kubectl     {state.bin_dir / 'kubectl'}")
    ready = LocalCluster(layout=layout, state=state, popens={}).is_ready()
    click.echo(f"apiserver   {state.apiserver_url} ({'ready' if ready else 'NOT ready'})")
    if not ready:
        raise SystemExit(1)


@cluster.command()
@_DIR_OPTION
def env(work_dir: Path | None) -> None:
    """Print exports (KUBECONFIG, PATH with kubectl/helm) of the running cluster.

    \b
    Examples:
      eval "$(copse cluster env)"
    """
    directory = work_dir or default_work_dir()
    local = LocalCluster.attach(directory)
    if local is None:
        raise click.ClickException(
            f"no local cluster is running from {directory}; start one with 'make cluster-up'"
        )
    click.echo(_env_lines(local))


cluster.add_command(fake_nodes)
