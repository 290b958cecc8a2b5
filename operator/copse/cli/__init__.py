"""The umbrella ``copse`` command.

Each component keeps its own CLI inside its package; this module only maps a
subcommand name to where that CLI lives and imports it on first use, so that
``copse bench replay`` never pays for importing kopf, and nothing here imports
``copse.operator`` unless ``copse operator`` is what was asked for.
"""

from __future__ import annotations

import importlib

import click

from copse.cli import logs

#: subcommand name -> "module:attribute" of a click command or group.
SUBCOMMANDS: dict[str, str] = {
    "api": "copse.api.cli:api",
    "cluster": "copse.cluster.cli:cluster",
    "demo": "copse.cli.demo:demo",
    "bench": "copse.sim.cli:bench",
    "router": "copse.router.cli:router",
    "synth": "copse.sim.cli:synth",
    "operator": "copse.operator.cli:operator",
    "placement": "copse.placement.cli:placement",
    "planner": "copse.planner.cli:planner",
    "worker": "copse.workers.cli:worker",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = SUBCOMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, _, attribute = target.partition(":")
        command = getattr(importlib.import_module(module_name), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{target} is not a click command")
        return command


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="copse", prog_name="copse", message="%(prog)s %(version)s")
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    envvar="COPSE_LOG_FORMAT",
    help="json: one object per line with deployment/role/group fields, for log pipelines.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    envvar="COPSE_LOG_LEVEL",
)
def main(log_format: str, log_level: str) -> None:
    """copse: LLM inference on Kubernetes GPU clusters (placement, routing, planning).

    Exit codes: 0 success, 1 a failed run or invalid input, 2 a usage error
    (docs/reference/conventions.md).

    \b
    Examples:
      copse demo
      copse api validate examples/deployment-llama-3.1-8b-trtllm.yaml
      copse placement plan --nodes examples/nodes-2-racks.yaml \\
        --deployment examples/seed-inferencedeployment.yaml
    """
    logs.configure(fmt=log_format, level=log_level)
