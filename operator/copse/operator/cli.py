"""``copse operator run``: reconcile InferenceDeployments against the current kubeconfig."""

from __future__ import annotations

import click
import prometheus_client

from copse.operator.children import COPSE_IMAGE, TRTLLM_IMAGE, Images
from copse.operator.reconcile import ReconcileSettings


def reconcile_settings(*, image: str, image_pull_policy: str | None, trtllm_image: str) -> ReconcileSettings:
    """The operator's settings from ``copse operator run``'s options."""
    return ReconcileSettings(images=Images(copse=image, trtllm=trtllm_image, pull_policy=image_pull_policy))


@click.group()
def operator() -> None:
    """The Kubernetes operator.

    \b
    Examples:
      copse operator run -n serving
    """


@operator.command()
@click.option(
    "-n",
    "--namespace",
    "namespaces",
    multiple=True,
    help="Watch only these namespaces (repeatable); all namespaces by default.",
)
@click.option(
    "--metrics-port", type=int, default=9090, show_default=True, help="Prometheus port; 0 disables."
)
@click.option(
    "--health-port",
    type=int,
    default=8080,
    show_default=True,
    help="Liveness endpoint (/healthz: 500 when the reconcile loop is stuck or gone); 0 disables.",
)
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address of both endpoints.")
@click.option("--verbose", "-v", is_flag=True, help="Also log kopf's own activity.")
@click.option(
    "--image",
    envvar="COPSE_IMAGE",
    default=COPSE_IMAGE,
    show_default=True,
    help="Image of the routers, KV relays and mocked workers the operator creates (the chart passes "
    "its own image); a manifest's spec.router.image / spec.engine.image wins.",
)
@click.option(
    "--image-pull-policy",
    envvar="COPSE_IMAGE_PULL_POLICY",
    type=click.Choice(["Always", "IfNotPresent", "Never"]),
    default=None,
    help="imagePullPolicy of the containers running --image (default: Kubernetes').",
)
@click.option(
    "--trtllm-image",
    envvar="COPSE_TRTLLM_IMAGE",
    default=TRTLLM_IMAGE,
    show_default=True,
    help="Image of TensorRT-LLM workers whose manifest names none.",
)
def run(
    *,
    namespaces: tuple[str, ...],
    metrics_port: int,
    health_port: int,
    metrics_host: str,
    verbose: bool,
    image: str,
    image_pull_policy: str | None,
    trtllm_image: str,
) -> None:
    """Run the operator (in-cluster config inside a pod, else the current kubeconfig).

    \b
    Examples:
      copse operator run
      copse operator run -n serving -n staging --metrics-port 0 --health-port 0
    """
    # Imported here: registering kopf handlers is a side effect only `operator run` wants.
    import kopf  # noqa: PLC0415

    from copse.operator import handlers  # noqa: PLC0415

    if not verbose:
        handlers.quiet_kopf()
    if metrics_port:
        prometheus_client.start_http_server(metrics_port, addr=metrics_host)
    kopf.run(
        standalone=True,
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        memo=kopf.Memo(
            namespaces=list(namespaces),
            settings=reconcile_settings(
                image=image, image_pull_policy=image_pull_policy, trtllm_image=trtllm_image
            ),
        ),
        liveness_endpoint=f"http://{metrics_host}:{health_port}/healthz" if health_port else None,
    )
