"""``copse api``: render the CRDs and validate manifests without a cluster."""

from __future__ import annotations

import difflib
from pathlib import Path

import click

from copse.api import crd
from copse.api.manifest import ManifestError, load_deployment
from copse.workers.conventions import EXIT_FAILURE


@click.group()
def api() -> None:
    """The InferenceDeployment contract: CRDs and manifest validation.

    \b
    Examples:
      copse api validate examples/*.yaml
      copse api crds --check
    """


@api.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("crds"), show_default=True)
@click.option("--check", is_flag=True, help="Exit 1 and show a diff when the files differ; write nothing.")
def crds(out: Path, check: bool) -> None:
    """Write the CRD YAML generated from the pydantic models (--out DIR, one file per CRD).

    \b
    Examples:
      copse api crds --out crds
      copse api crds --check
    """
    if not check:
        for path in crd.write(out):
            click.echo(f"wrote {path}")
        return
    drifted = False
    for name, text in crd.render().items():
        path = out / name
        current = path.read_text() if path.exists() else ""
        if current != text:
            drifted = True
            click.echo(
                "".join(difflib.unified_diff(current.splitlines(True), text.splitlines(True), str(path)))
            )
    if drifted:
        raise click.ClickException("crds/ is out of date with the models: run `make crds`")


@api.command()
@click.argument("manifests", nargs=-1, required=True, type=click.Path(path_type=Path))
def validate(manifests: tuple[Path, ...]) -> None:
    """Check InferenceDeployment manifests the way the API server will; exits 1 when one is invalid.

    \b
    Examples:
      copse api validate examples/deployment-llama-3.1-8b-trtllm.yaml
      copse api validate examples/*.yaml
    """
    failed = False
    for path in manifests:
        try:
            deployment = load_deployment(path)
        except ManifestError as exc:
            click.echo(str(exc), err=True)
            failed = True
            continue
        pools = ", ".join(
            f"{pool.role.value} {pool.replicas}x(TP{pool.tensor_parallelism}xPP{pool.pipeline_parallelism})"
            for pool in deployment.spec.pools()
        )
        click.echo(f"{path}: ok ({deployment.metadata.name}: {pools})")
    if failed:
        raise SystemExit(EXIT_FAILURE)
