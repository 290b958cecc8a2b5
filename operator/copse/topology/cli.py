"""``copse cluster nodes``: print a NodeList of fake GB200 NVL72 trays (and CPU nodes).

The command object lives here; ``copse.cluster`` attaches it to its ``cluster`` group.
"""

from __future__ import annotations

import click

from copse.topology import fake
from copse.workers.conventions import output_option, render


@click.command("nodes")
@click.option("--racks", type=click.IntRange(0), required=True, help="NVL72 racks (NVLink domains).")
@click.option(
    "--trays-per-rack", type=click.IntRange(1), default=18, show_default=True, help="Compute trays per rack."
)
@click.option("--gpus-per-tray", type=click.IntRange(1), default=4, show_default=True, help="GPUs per tray.")
@click.option(
    "--cordoned",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Trays to cordon, spread over racks (top tray first).",
)
@click.option(
    "--product", default="NVIDIA-GB200", show_default=True, help="Value of the nvidia.com/gpu.product label."
)
@click.option(
    "--cpu-nodes", type=click.IntRange(0), default=0, show_default=True, help="CPU-only nodes to add."
)
@click.option(
    "--cliques-per-rack",
    type=click.IntRange(1),
    default=1,
    show_default=True,
    help="NVLink partitions per rack (2 = an x72 rack run as 2 x36).",
)
@output_option(choices=("yaml", "json"))
def nodes(
    *,
    racks: int,
    trays_per_rack: int,
    gpus_per_tray: int,
    cordoned: int,
    product: str,
    cpu_nodes: int,
    cliques_per_rack: int,
    output: str,
) -> None:
    """Print a NodeList (YAML) of GB200-style nodes with GPU Feature Discovery labels.

    \b
    Examples:
      copse cluster nodes --racks 8 --cpu-nodes 3 > nodes.yaml
      copse cluster nodes --racks 2 --cliques-per-rack 2 --cordoned 1
    """
    try:
        items = fake.gpu_nodes(
            racks=racks,
            trays_per_rack=trays_per_rack,
            gpus_per_tray=gpus_per_tray,
            cordoned=cordoned,
            product=product,
            cliques_per_rack=cliques_per_rack,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    items += fake.cpu_nodes(cpu_nodes)
    click.echo(render(fake.node_list(items), output=output, table=str))
