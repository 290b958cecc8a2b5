"""``copse worker``: mocked engines, the KV relay, and perf profiles."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import socket
from pathlib import Path

import click
import uvloop
from prometheus_client import CollectorRegistry, start_http_server

from copse.workers.conventions import renamed
from copse.workers.files import OutputPath
from copse.workers.mocker.adapters import AdapterSettings
from copse.workers.mocker.config import ROLES, EngineConfig
from copse.workers.mocker.server import MockFleetSettings, start_fleet
from copse.workers.moe import MoeConfig
from copse.workers.nats_io import KvEventPublisher, close_connection, connect
from copse.workers.perf import KvOffload, PerfModel, ProfileError, load_perf_model, save_profile
from copse.workers.protocol.subjects import subject_token
from copse.workers.relay import run_relay
from copse.workers.serving import tune_collector


def _perf(profile: Path | None, gpus: int | None, capacity: int | None) -> PerfModel:
    try:
        return load_perf_model(profile, gpus_per_engine=gpus, kv_capacity_tokens=capacity)
    except ProfileError as exc:
        raise click.BadParameter(str(exc), param_hint="--perf-profile") from exc
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc


def _check_token(value: str, option: str) -> str:
    try:
        subject_token(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from exc
    return value


_MOE_EXAMPLE = '{"experts": 256, "experts_per_token": 8, "expert_parallelism": 32}'


def _moe_config(text: str | None) -> MoeConfig | None:
    if text is None:
        return None
    try:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON ({exc}); expected an object (e.g. {_MOE_EXAMPLE})") from exc
        if not isinstance(fields, dict):
            raise TypeError(
                f"expected a JSON object of MoeConfig fields, got {type(fields).__name__}"
                f" (e.g. {_MOE_EXAMPLE})"
            )
        known = {field.name for field in dataclasses.fields(MoeConfig)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise TypeError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return MoeConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="--moe") from exc


async def _until_signalled(stop: asyncio.Event) -> signal.Signals:
    """Wait for SIGINT or SIGTERM (or ``stop``); returns the signal (SIGINT when stopped)."""
    loop = asyncio.get_running_loop()
    received = signal.SIGINT

    def on(sig: signal.Signals) -> None:
        nonlocal received
        received = sig
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on, sig)
    await stop.wait()
    return received


@click.group()
def worker() -> None:
    """GPU-free engines, the KV event relay for trtllm-serve, and perf profiles.

    \b
    Examples:
      copse worker mock --engines 4 --port-base 8000
      copse worker save-profile --out profile.npz
    """


_PERF_OPTIONS = [
    click.option(
        "--perf-profile",
        type=click.Path(path_type=Path),
        default=None,
        help="Profile (NPZ or JSON) to interpolate; default: the polynomial model.",
    ),
    click.option("--gpus-per-engine", type=click.IntRange(min=1), default=None, help="Tensor parallelism."),
    click.option(
        "--kv-capacity-tokens", type=click.IntRange(min=1), default=None, help="KV cache size in tokens."
    ),
]


@worker.command("mock")
@click.option(
    "--engines", type=click.IntRange(min=1), default=1, show_default=True, help="Engines in this process."
)
@click.option(
    "--port-base", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port of engine 0."
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--model", "model_name", default="mock-model", show_default=True, help="Served model name.")
@click.option("--worker-prefix", default="mock", show_default=True, help="Worker ids are <prefix>-<port>.")
@click.option(
    "--lora",
    "loras",
    multiple=True,
    help="A LoRA adapter the engines serve and list (repeat); requests name it in `model` or lora_request.",
)
@click.option(
    "--max-loras",
    type=click.IntRange(min=1),
    default=AdapterSettings().max_loras,
    show_default=True,
    help="LoRA adapters an engine holds at once (TensorRT-LLM's lora_config.max_loras); more evict the LRU.",
)
@click.option(
    "--lora-load-ms",
    type=click.FloatRange(min=0),
    default=AdapterSettings().load_ms,
    show_default=True,
    help="Time to load an adapter an engine does not hold (requests behind the load wait).",
)
@click.option("--role", type=click.Choice(ROLES), default="aggregated", show_default=True)
@click.option("--block-size", type=click.IntRange(min=1), default=32, show_default=True)
@click.option(
    "--num-blocks", type=click.IntRange(min=1), default=None, help="Default: KV capacity / block size."
)
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=8192, show_default=True)
@click.option("--no-chunked-prefill", is_flag=True, help="Never split a prompt across steps.")
@click.option("--max-model-len", type=click.IntRange(min=1), default=131072, show_default=True)
@click.option(
    "--max-waiting", type=click.IntRange(min=1), default=4096, show_default=True, help="Queue bound (503)."
)
@click.option(
    "--speedup",
    "speedup_ratio",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Engine steps take 1/this of the perf model's time.",
)
@click.option(
    "--decode-speedup",
    "decode_speedup_ratio",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Decode steps additionally take 1/this (below 1 stretches streams out).",
)
@click.option("--kv-bytes-per-token", type=click.IntRange(min=0), default=131072, show_default=True)
@click.option(
    "--kv-bandwidth-gbps", type=click.FloatRange(min=0, min_open=True), default=64.0, show_default=True
)
@click.option(
    "--host-cache-bytes",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Host memory for KV blocks evicted from the GPU (TensorRT-LLM's host_cache_size); 0: none.",
)
@click.option(
    "--disk-cache-bytes",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Disk for KV blocks evicted from host memory; 0: none.",
)
@click.option(
    "--host-bandwidth-gbps",
    type=click.FloatRange(min=0, min_open=True),
    default=KvOffload().host_gbps,
    show_default=True,
    help="Host-to-GPU bandwidth blocks are onboarded at.",
)
@click.option(
    "--disk-bandwidth-gbps",
    type=click.FloatRange(min=0, min_open=True),
    default=KvOffload().disk_gbps,
    show_default=True,
    help="Disk-to-GPU bandwidth blocks are onboarded at.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds generated token ids.")
@click.option(
    "--moe",
    "moe_json",
    default=None,
    help="Make every engine an expert-parallel MoE group: a JSON object of MoeConfig fields "
    f"(e.g. '{_MOE_EXAMPLE}').",
)
@click.option(
    "--virtual-clock", is_flag=True, help="Steps take no wall time (each engine keeps its own time)."
)
@click.option(
    "--nats", "nats_url", default=None, help="Publish KV events to this NATS server (nats://host:port)."
)
@click.option(
    "-n", "--namespace", default="default", show_default=True, help="Kubernetes namespace (NATS subject)."
)
@click.option("--deployment", default="mock", show_default=True, help="Deployment name (NATS subject).")
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=300.0,
    show_default=True,
    help="On SIGTERM, stop listening and wait this long (s) for the requests in flight to finish.",
)
@_PERF_OPTIONS[0]
@_PERF_OPTIONS[1]
@_PERF_OPTIONS[2]
@renamed(
    "--speedup-ratio", new="--speedup", dest="speedup_ratio", type=click.FloatRange(min=0, min_open=True)
)
@renamed(
    "--decode-speedup-ratio",
    new="--decode-speedup",
    dest="decode_speedup_ratio",
    type=click.FloatRange(min=0, min_open=True),
)
def mock(
    *,
    engines: int,
    port_base: int,
    host: str,
    model_name: str,
    worker_prefix: str,
    loras: tuple[str, ...],
    max_loras: int,
    lora_load_ms: float,
    role: str,
    block_size: int,
    num_blocks: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    no_chunked_prefill: bool,
    max_model_len: int,
    max_waiting: int,
    speedup_ratio: float,
    decode_speedup_ratio: float,
    kv_bytes_per_token: int,
    kv_bandwidth_gbps: float,
    host_cache_bytes: int,
    disk_cache_bytes: int,
    host_bandwidth_gbps: float,
    disk_bandwidth_gbps: float,
    seed: int,
    moe_json: str | None,
    virtual_clock: bool,
    nats_url: str | None,
    namespace: str,
    deployment: str,
    drain_timeout: float,
    perf_profile: Path | None,
    gpus_per_engine: int | None,
    kv_capacity_tokens: int | None,
) -> None:
    """Serve ENGINES mocked TensorRT-LLM engines on ports PORT_BASE.. (one process).

    \b
    Examples:
      copse worker mock --engines 4 --port-base 8000
      copse worker mock --engines 2 --port-base 8000 --nats nats://127.0.0.1:4222 -n serving \\
        --deployment llama --decode-speedup 0.25
    """
    if port_base and port_base + engines - 1 > 65535:
        raise click.BadParameter(
            f"{engines} engines from port {port_base} run past 65535", param_hint="--engines"
        )
    _check_token(namespace, "--namespace")
    _check_token(deployment, "--deployment")
    _check_token(worker_prefix, "--worker-prefix")
    perf = _perf(perf_profile, gpus_per_engine, kv_capacity_tokens)
    try:
        config = EngineConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=not no_chunked_prefill,
            max_model_len=max_model_len,
            max_waiting=max_waiting,
            speedup_ratio=speedup_ratio,
            decode_speedup_ratio=decode_speedup_ratio,
            role=role,  # type: ignore[arg-type]  # click.Choice(ROLES) guarantees a Role
            kv_bytes_per_token=kv_bytes_per_token,
            kv_transfer_bandwidth_gbps=kv_bandwidth_gbps,
            seed=seed,
            moe=_moe_config(moe_json),
            host_cache_bytes=host_cache_bytes,
            disk_cache_bytes=disk_cache_bytes,
            host_bandwidth_gbps=host_bandwidth_gbps,
            disk_bandwidth_gbps=disk_bandwidth_gbps,
            adapters=AdapterSettings(max_loras=max_loras, load_ms=lora_load_ms),
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if model_name in loras:
        raise click.BadParameter(f"adapter {model_name!r} has the base model's name", param_hint="--lora")
    settings = MockFleetSettings(
        engines=engines,
        port_base=port_base,
        host=host,
        model_name=model_name,
        loras=tuple(dict.fromkeys(loras)),
        worker_prefix=worker_prefix,
        virtual_clock=virtual_clock,
        drain_timeout_s=drain_timeout,
    )

    async def serve() -> None:
        connection = await connect(nats_url) if nats_url else None
        publisher = (
            KvEventPublisher(connection, namespace=namespace, deployment=deployment) if connection else None
        )
        try:
            fleet = await start_fleet(settings, config=config, perf=perf, publisher=publisher)
        except OSError as exc:
            raise click.UsageError(f"cannot listen on {host} from port {port_base}: {exc}") from exc
        tune_collector()
        click.echo(f"{engines} engine(s) on {fleet.urls[0]} .. {fleet.urls[-1]}")
        try:
            if await _until_signalled(asyncio.Event()) is signal.SIGTERM:
                # How a pod stops: finish what is in flight, take nothing new (Ctrl-C stops at once).
                click.echo(f"SIGTERM: finishing requests in flight (at most {drain_timeout:g} s)")
                await fleet.drain()
        finally:
            await fleet.close()
            if connection is not None:
                await close_connection(connection)

    uvloop.run(serve())


@worker.command("kv-relay")
@click.option(
    "--engine", "engine_url", required=True, help="Base URL of trtllm-serve (http://127.0.0.1:8000)."
)
@click.option("--nats", "nats_url", required=True, help="NATS server (nats://host:port).")
@click.option("--deployment", required=True, help="Deployment name (NATS subject).")
@click.option(
    "-n",
    "--namespace",
    default=lambda: os.environ.get("POD_NAMESPACE", "default"),
    show_default="$POD_NAMESPACE or default",
)
@click.option(
    "--worker-id",
    default=lambda: os.environ.get("POD_NAME", socket.gethostname()),
    show_default="$POD_NAME or the host name",
)
@click.option(
    "--block-size", type=click.IntRange(min=1), default=32, show_default=True, help="Engine tokens_per_block."
)
@click.option(
    "--kv-capacity-blocks",
    type=click.IntRange(min=1),
    default=None,
    help="The engine's KV cache size in blocks, every cache level (lets a relay started after the engine"
    " prove when it knows every block again; the engine's created events say it otherwise).",
)
@click.option(
    "--interval", type=click.FloatRange(min=0, min_open=True), default=0.1, show_default=True, help="Seconds."
)
@click.option(
    "--metrics-port", type=click.IntRange(0, 65535), default=None, help="Serve Prometheus metrics here."
)
@click.option("--metrics-host", default="127.0.0.1", show_default=True)
def kv_relay(
    *,
    engine_url: str,
    nats_url: str,
    deployment: str,
    namespace: str,
    worker_id: str,
    block_size: int,
    kv_capacity_blocks: int | None,
    interval: float,
    metrics_port: int | None,
    metrics_host: str,
) -> None:
    """Drain a trtllm-serve's /kv_cache_events and publish copse KV events on NATS.

    \b
    Examples:
      copse worker kv-relay --engine http://127.0.0.1:8000 --nats nats://127.0.0.1:4222 \\
        -n serving --deployment llama --worker-id llama-worker-0-0
    """
    _check_token(namespace, "--namespace")
    _check_token(deployment, "--deployment")
    _check_token(worker_id, "--worker-id")
    registry = CollectorRegistry()
    if metrics_port is not None:
        start_http_server(metrics_port, addr=metrics_host, registry=registry)

    async def relay() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(
            run_relay(
                engine_url=engine_url,
                nats_url=nats_url,
                worker_id=worker_id,
                namespace=namespace,
                deployment=deployment,
                block_size=block_size,
                capacity_blocks=kv_capacity_blocks,
                interval_s=interval,
                registry=registry,
                stop=stop,
            )
        )
        signalled = asyncio.create_task(_until_signalled(stop))
        await asyncio.wait({task, signalled}, return_when=asyncio.FIRST_COMPLETED)
        stop.set()
        signalled.cancel()
        await task

    asyncio.run(relay())


@worker.command("save-profile")
@click.option("--out", type=OutputPath(), required=True, help=".npz or .json")
@click.option("--points", type=click.IntRange(min=2), default=100, show_default=True)
@click.option("--max-context-length", type=click.IntRange(min=1), default=131072, show_default=True)
@_PERF_OPTIONS[0]
@_PERF_OPTIONS[1]
@_PERF_OPTIONS[2]
def save_profile_command(
    *,
    out: Path,
    points: int,
    max_context_length: int,
    perf_profile: Path | None,
    gpus_per_engine: int | None,
    kv_capacity_tokens: int | None,
) -> None:
    """Write the perf model (default: the polynomial) as a profile file others can load.

    \b
    Examples:
      copse worker save-profile --out profile.npz
      copse worker save-profile --out profile-tp8.json --gpus-per-engine 8 --kv-capacity-tokens 1000000
    """
    perf = _perf(perf_profile, gpus_per_engine, kv_capacity_tokens)
    try:
        save_profile(perf, out, max_context_length=max_context_length, points=points)
    except OSError as exc:
        raise click.BadParameter(f"cannot write {out}: {exc}", param_hint="--out") from exc
    click.echo(f"wrote {out}")
