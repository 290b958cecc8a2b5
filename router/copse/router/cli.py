"""``copse router``: the KV-aware router's own commands."""

from __future__ import annotations

import logging
from pathlib import Path

import click
import uvloop

from copse.router.policies import POLICIES
from copse.workers.conventions import Failure, renamed


@click.group()
def router() -> None:
    """The KV-aware router.

    \b
    Examples:
      copse router run --worker http://127.0.0.1:8000 --worker http://127.0.0.1:8001 --engine mock
    """


@router.command("run")
@click.option(
    "--config",
    "config_path",
    type=click.Path(path_type=Path),
    default=None,
    help="Router YAML (what the operator mounts); flags below override its values.",
)
@click.option(
    "--worker", "workers", multiple=True, help="Static worker URL (repeatable); implies static discovery."
)
@click.option("--model", default=None, help="Model name served.")
@click.option(
    "--engine",
    type=click.Choice(["trtllm", "mock"]),
    default=None,
    help="What serves behind the router: trtllm-serve or copse's mocked engines (decides tokenization).",
)
@click.option(
    "--tokenizer",
    type=click.Path(path_type=Path),
    default=None,
    help="Model directory with tokenizer.json and tokenizer_config.json (required with --engine trtllm).",
)
@click.option("--kv-capacity-tokens", type=int, default=None, help="KV cache size of one engine, tokens.")
@click.option(
    "--perf-profile", type=click.Path(path_type=Path), default=None, help="Engines' perf profile (NPZ/JSON)."
)
@click.option("--host", default=None, help="Listen address (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Listen port (default 8080; 0 = any free port).")
@click.option("--policy", type=click.Choice(sorted(POLICIES)), default=None)
@click.option("--block-size", type=int, default=None, help="Engines' KV block size in tokens.")
@click.option("--nats", "nats_url", default=None, help="NATS server for KV events and replica load sharing.")
@click.option("--deployment", default=None, help="Deployment name (NATS subjects).")
@click.option(
    "--epp",
    is_flag=True,
    default=False,
    help="Serve as a gateway's endpoint picker (Envoy ext_proc over gRPC, Gateway API Inference Extension)"
    " instead of the OpenAI HTTP server.",
)
@click.option("--grpc-port", type=int, default=None, help="Endpoint picker's ext_proc port (default 9002).")
@click.option(
    "--fallback-endpoints",
    type=int,
    default=None,
    help="Endpoint picker: other workers listed after the chosen one for the gateway's retries (default 0).",
)
@click.option(
    "--pool-name", default=None, help="Discover the pods of this InferencePool (with --pool-namespace)."
)
@click.option("--pool-namespace", default=None, help="Namespace of --pool-name (default: default).")
@click.option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default=None,
    help="The router's log level (as `copse --log-level`, which it overrides).",
)
@renamed("--nats-url", new="--nats", dest="nats_url")
def run_command(
    *,
    config_path: Path | None,
    workers: tuple[str, ...],
    model: str | None,
    engine: str | None,
    tokenizer: Path | None,
    kv_capacity_tokens: int | None,
    perf_profile: Path | None,
    host: str | None,
    port: int | None,
    policy: str | None,
    block_size: int | None,
    nats_url: str | None,
    deployment: str | None,
    epp: bool,
    grpc_port: int | None,
    fallback_endpoints: int | None,
    pool_name: str | None,
    pool_namespace: str | None,
    log_level: str | None,
) -> None:
    """Serve the OpenAI API in front of the workers, or (--epp) pick endpoints for a gateway.

    \b
    Examples:
      copse router run --worker http://127.0.0.1:8000 --worker http://127.0.0.1:8001 --engine mock
      copse router run --config router.yaml --nats nats://127.0.0.1:4222 --port 8080
      copse router run --epp --pool-name llama --pool-namespace serving --engine mock
    """
    # Imported here: the HTTP stack (aiohttp, the Kubernetes client) costs ~1 s of start-up.
    from copse.router.config import ConfigError, parse_config, read_config  # noqa: PLC0415
    from copse.router.server import serve  # noqa: PLC0415

    if log_level is not None:
        root = logging.getLogger()
        if not root.handlers:  # run without the copse group, which sets the handler and format
            logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        root.setLevel(log_level.upper())
    raw: dict[str, object] = {}
    source = "command line"
    if config_path is not None:
        try:
            raw, source = read_config(config_path), str(config_path)
        except ConfigError as exc:
            raise Failure(str(exc)) from exc
    overrides = {
        "model": model,
        "engine": engine,
        "tokenizer": tokenizer,
        "kv_capacity_tokens": kv_capacity_tokens,
        "perf_profile": perf_profile,
        "host": host,
        "port": port,
        "policy": policy,
        "block_size": block_size,
        "nats_url": nats_url,
        "deployment": deployment,
    }
    raw.update({key: value for key, value in overrides.items() if value is not None})
    if workers and pool_name:
        raise click.UsageError("--worker and --pool-name are two discoveries: give one")
    if workers:
        raw["discovery"] = {"kind": "static", "workers": [{"url": url.rstrip("/")} for url in workers]}
    if pool_name:
        raw["discovery"] = {
            "kind": "inferencepool",
            "namespace": pool_namespace or "default",
            "name": pool_name,
        }
    picker = {"grpc_port": grpc_port, "fallback_endpoints": fallback_endpoints}
    if epp or any(value is not None for value in picker.values()):
        settings = raw.get("epp")
        settings = dict(settings) if isinstance(settings, dict) else {}
        settings.update({key: value for key, value in picker.items() if value is not None})
        raw["epp"] = settings
    try:
        config = parse_config(raw, source=source)
    except ConfigError as exc:
        raise Failure(str(exc)) from exc
    try:
        uvloop.run(serve(config))
    except ValueError as exc:
        raise Failure(str(exc)) from exc
    except KeyboardInterrupt:
        pass
