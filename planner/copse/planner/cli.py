"""``copse planner``: dry-run against recordings or traces, write profiles, run against a cluster."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from copse.api import ManifestError, load_deployment
from copse.planner.capacity import capacity_for
from copse.planner.config import ConfigError, PlannerConfig, load_config
from copse.planner.core import Planner
from copse.planner.observations import Observation, resample
from copse.planner.policy import AGGREGATED, DISAGGREGATED, Limits
from copse.planner.predictors import PREDICTORS
from copse.planner.recording import RecordingError, read_metrics, read_trace
from copse.workers.conventions import Failure, json_renamed, output_option, renamed, render
from copse.workers.files import OutputPath
from copse.workers.perf import PerfModel, ProfileError, load_perf_model, load_profile, save_profile

#: Bucket size for traces when --interval is not given.
DEFAULT_TRACE_INTERVAL_S = 60.0


def config_from_options(path: Path | None, **overrides: object) -> PlannerConfig:
    """The planner config file (or the defaults) with the options given on the command line
    (exits 1 naming the file and field when it is invalid)."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        fail(str(exc))
    return config.model_copy(update={key: value for key, value in overrides.items() if value is not None})


def fail(message: str) -> NoReturn:
    """Invalid input or a failed run: say what and where, exit 1."""
    raise Failure(message)


def usage(message: str) -> NoReturn:
    """Options that do not go together: exit 2."""
    raise click.UsageError(message)


@click.group()
def planner() -> None:
    """The SLA planner: size prefill/decode pools to hold TTFT and ITL targets.

    \b
    Examples:
      copse planner dry-run --metrics examples/planner/servegen-m-large-3d.jsonl \\
        --perf-profile examples/planner/mock-profile.npz --ttft-ms 500 --itl-ms 50
      copse planner run llama-70b-disagg -n serving --observe-only
    """


def _observations(metrics: Path | None, trace: Path | None, interval: float | None) -> list[Observation]:
    if (metrics is None) == (trace is None):
        usage("give exactly one of --metrics FILE or --trace FILE")
    try:
        if trace is not None:
            return read_trace(trace, interval_s=interval or DEFAULT_TRACE_INTERVAL_S)
        assert metrics is not None
        observations = read_metrics(metrics, interval_s=interval)
        if interval is not None:
            observations = resample(observations, interval_s=interval, source=str(metrics))
    except (RecordingError, ValueError) as exc:
        fail(str(exc))
    return observations


def limits_from_options(
    *,
    deployment: Path | None,
    aggregated: bool,
    ttft_ms: float | None,
    itl_ms: float | None,
    min_replicas: int | None,
    max_replicas: int | None,
    gpu_budget: int | None,
    gpus_per_replica: int,
    scale_down_delay: float | None,
) -> Limits:
    """Targets and bounds from a deployment manifest or the command line, the options given
    overriding the manifest (exits 2 naming what is wrong)."""
    overrides: dict[str, object] = {}
    if deployment is not None:
        try:
            base = Limits.from_spec(load_deployment(deployment).spec)
        except (ManifestError, ValueError) as exc:
            fail(str(exc))
        overrides = {
            "roles": base.roles,
            "gpus_per_replica": base.gpus_per_replica,
            "ttft_ms": base.ttft_ms,
            "itl_ms": base.itl_ms,
            "min_replicas": base.min_replicas,
            "max_replicas": base.max_replicas,
            "gpu_budget": base.gpu_budget,
            "scale_down_delay_s": base.scale_down_delay_s,
            "queue_depth": base.queue_depth,
            "max_num_seqs": base.max_num_seqs,
            "startup_delay_s": base.startup_delay_s,
        }
    else:
        if ttft_ms is None or itl_ms is None:
            usage("--ttft-ms and --itl-ms are required (or take them from --deployment FILE)")
        roles = AGGREGATED if aggregated else DISAGGREGATED
        overrides = {"roles": roles, "gpus_per_replica": dict.fromkeys(roles, gpus_per_replica)}
    for key, value in (
        ("ttft_ms", ttft_ms),
        ("itl_ms", itl_ms),
        ("min_replicas", min_replicas),
        ("max_replicas", max_replicas),
        ("gpu_budget", gpu_budget),
        ("scale_down_delay_s", scale_down_delay),
    ):
        if value is not None:
            overrides[key] = value
    try:
        return Limits(**overrides)  # type: ignore[arg-type]
    except ValueError as exc:
        fail(str(exc))


@planner.command("dry-run")
@click.option(
    "--metrics", type=click.Path(path_type=Path), help="Recorded metrics: JSON Lines or a Prometheus export."
)
@click.option("--trace", type=click.Path(path_type=Path), help="A Mooncake JSONL or Azure CSV request trace.")
@click.option(
    "--perf-profile", "profile", type=click.Path(path_type=Path), help="Perf profile (NPZ or JSON); required."
)
@click.option("--ttft-ms", type=click.FloatRange(min=0, min_open=True), help="p99 TTFT target, ms.")
@click.option("--itl-ms", type=click.FloatRange(min=0, min_open=True), help="p99 ITL target, ms.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0, min_open=True),
    help=f"Seconds per decision: trace bucket size (default {DEFAULT_TRACE_INTERVAL_S:g}) or a whole "
    "multiple of the recording's interval.",
)
@click.option("--predictor", type=click.Choice(sorted(PREDICTORS)), help="Load predictor (default constant).")
@click.option("--gpu-budget", type=click.IntRange(min=1), help="Most GPUs both pools together may use.")
@click.option("--min-replicas", type=click.IntRange(min=0), help="Fewest replicas per pool (default 1).")
@click.option("--max-replicas", type=click.IntRange(min=1), help="Most replicas per pool (default 16).")
@click.option(
    "--gpus-per-replica", type=click.IntRange(min=1), help="GPUs of one replica (default: the profile's)."
)
@click.option(
    "--aggregated", is_flag=True, help="One pool doing prefill and decode (default: disaggregated)."
)
@click.option(
    "--deployment", type=click.Path(path_type=Path), help="Take targets and bounds from a manifest."
)
@click.option(
    "--startup-delay",
    type=click.FloatRange(min=0),
    help="Seconds from adding a replica to it serving (default: the deployment's spec.coldStart, else 120).",
)
@click.option("--scale-down-delay", type=click.FloatRange(min=0), help="Seconds the need must stay lower.")
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="Planner config YAML.")
@output_option()
@click.option("--plot", type=OutputPath(), help="Write a PNG of load, replicas and latency.")
@json_renamed
@renamed("--profile", new="--perf-profile", dest="profile", type=click.Path(path_type=Path))
def dry_run_command(
    *,
    metrics: Path | None,
    trace: Path | None,
    profile: Path,
    ttft_ms: float | None,
    itl_ms: float | None,
    interval: float | None,
    predictor: str | None,
    gpu_budget: int | None,
    min_replicas: int | None,
    max_replicas: int | None,
    gpus_per_replica: int | None,
    aggregated: bool,
    deployment: Path | None,
    startup_delay: float | None,
    scale_down_delay: float | None,
    config_path: Path | None,
    output: str,
    plot: Path | None,
) -> None:
    """Replay recorded load through the planner: a fast analytic estimate of what it would have done.

    Each interval's replicas are decided before the interval is seen; new replicas serve only
    after the start-up delay; the interval's actual load on those replicas gives the estimated
    TTFT/ITL (with queueing), so a burst the forecast missed is a miss. No request is simulated:
    the capacity model judges its own sizing. For measured figures, "copse bench planner" runs
    the planner against a simulated fleet, every request routed and served.

    \b
    Examples:
      copse planner dry-run --metrics examples/planner/servegen-m-large-3d.jsonl \\
        --perf-profile examples/planner/mock-profile.npz --ttft-ms 500 --itl-ms 50 --plot planner.png
      copse planner dry-run --trace examples/traces/mooncake-conversation-first-20min.jsonl.gz \\
        --perf-profile examples/planner/mock-profile.npz --deployment examples/planner/deployment.yaml -o json
    """
    from copse.planner.dryrun import dry_run, write_json  # noqa: PLC0415
    from copse.planner.report import format_summary, format_table  # noqa: PLC0415
    from copse.planner.report import plot as write_plot  # noqa: PLC0415

    if profile is None:
        usage("Missing option '--perf-profile'")
    config = config_from_options(config_path, predictor=predictor, startup_delay_s=startup_delay)
    try:
        perf = load_profile(profile, gpus_per_engine=gpus_per_replica)
    except ProfileError as exc:
        fail(str(exc))
    observations = _observations(metrics, trace, interval)
    limits = limits_from_options(
        deployment=deployment,
        aggregated=aggregated,
        ttft_ms=ttft_ms,
        itl_ms=itl_ms,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        gpu_budget=gpu_budget,
        gpus_per_replica=perf.gpus_per_engine,
        scale_down_delay=scale_down_delay,
    )
    step = observations[0].duration_s
    plan = Planner(
        config=config,
        limits=limits,
        capacity=capacity_for(perf, config=config, limits=limits),
        interval_s=step,
    )
    result = dry_run(
        observations,
        planner=plan,
        startup_delay_s=plan.startup_delay_s,
        progress=output == "table" and sys.stderr.isatty(),
    )
    if plot is not None:
        write_plot(result, plot)
    if output == "json":
        write_json(result, sys.stdout)
        return
    if output != "table":
        click.echo(render(result.as_json(), output=output, table=str))
        return
    click.echo(format_table(result))
    click.echo()
    click.echo(format_summary(result))
    if plot is not None:
        click.echo(f"plot: {plot}")


@planner.command()
@click.option(
    "--engine", type=click.Choice(["mock"]), required=True, help="mock: copse's engine mocker model."
)
@click.option(
    "--out",
    type=OutputPath(),
    default=Path("profile.npz"),
    show_default=True,
    help="Profile file to write (.json for JSON, NPZ otherwise).",
)
@click.option(
    "--gpus-per-engine",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Tensor parallelism the profile stands for.",
)
@click.option(
    "--points", type=click.IntRange(min=2), default=100, show_default=True, help="Grid points per axis."
)
def profile(*, engine: str, out: Path, gpus_per_engine: int, points: int) -> None:
    """Write a perf profile from the shared perf model, so the planner runs without GPUs.

    \b
    Examples:
      copse planner profile --engine mock --out mock-profile.npz
    """
    del engine  # "mock" is the only engine that can be profiled without GPUs
    model = load_perf_model(None, gpus_per_engine=gpus_per_engine)
    save_profile(model, out, points=points)
    loaded = load_profile(out)
    click.echo(
        f"wrote {out}: {len(loaded.prefill_isl)} prefill lengths up to {loaded.prefill_isl[-1]:,.0f} tokens, "
        f"{len(loaded.decode_active_kv_tokens)}x{len(loaded.decode_context_length)} decode grid, "
        f"{loaded.kv_capacity_tokens:,} KV tokens, {loaded.gpus_per_engine} GPU(s) per engine"
    )


@planner.command()
@click.argument("name", required=False)
@click.option(
    "--namespace",
    "-n",
    "namespaces",
    multiple=True,
    help="Namespace(s) to plan in (repeatable). Default: all namespaces, or 'default' with NAME.",
)
@click.option("--prometheus", help="Prometheus base URL (default: the config's prometheus.url).")
@click.option(
    "--metrics",
    type=click.Path(path_type=Path),
    help="Replay a recording for NAME instead of reading Prometheus: one decision per interval, at once.",
)
@click.option(
    "--perf-profile",
    "profile",
    type=click.Path(path_type=Path),
    help="Perf profile (default: the mocker's model).",
)
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="Planner config YAML.")
@click.option("--interval", type=click.FloatRange(min=1), help="Seconds between decisions (default: config).")
@click.option("--predictor", type=click.Choice(sorted(PREDICTORS)), help="Load predictor (default constant).")
@click.option(
    "--observe-only",
    "observe_only",
    is_flag=True,
    help="Log the decisions and post them as Events; patch nothing.",
)
@click.option(
    "--kubeconfig",
    type=click.Path(path_type=Path),
    help="Kubeconfig (default: in-cluster, then $KUBECONFIG).",
)
@click.option("--context", help="Kubeconfig context.")
@click.option("--metrics-port", type=click.IntRange(min=0, max=65535), help="Port of /metrics (0: off).")
@click.option("--max-intervals", type=click.IntRange(min=1), help="Stop after this many intervals.")
@renamed("--profile", new="--perf-profile", dest="profile", type=click.Path(path_type=Path))
@renamed("--dry-run", new="--observe-only", dest="observe_only", value=True, is_flag=True)
def run(
    *,
    name: str | None,
    namespaces: tuple[str, ...],
    prometheus: str | None,
    metrics: Path | None,
    profile: Path | None,
    config_path: Path | None,
    interval: float | None,
    predictor: str | None,
    observe_only: bool,
    kubeconfig: Path | None,
    context: str | None,
    metrics_port: int | None,
    max_intervals: int | None,
) -> None:
    """Plan InferenceDeployment NAME, or every one in the namespaces: forecast, size and patch their
    pools every interval.

    \b
    Examples:
      copse planner run -n serving
      copse planner run llama-70b-disagg -n serving --prometheus http://prometheus:9090 --observe-only
    """
    import asyncio  # noqa: PLC0415

    config = config_from_options(
        config_path, predictor=predictor, interval_s=interval, metrics_port=metrics_port
    )
    if prometheus is not None:
        config = config.model_copy(
            update={"prometheus": config.prometheus.model_copy(update={"url": prometheus})}
        )
    if name is not None and len(namespaces) > 1:
        usage("NAME takes one --namespace")
    if metrics is not None and name is None:
        usage("--metrics replays a recording for one deployment: give its NAME")
    try:
        perf = load_perf_model(profile)
    except ProfileError as exc:
        fail(str(exc))
    recording = _observations(metrics, None, interval) if metrics is not None else None
    scope = list(namespaces) or (["default"] if name is not None else [])
    try:
        steps = asyncio.run(
            _run(
                config=config,
                perf=perf,
                name=name,
                namespaces=scope,
                recording=recording,
                observe_only=observe_only,
                kubeconfig=kubeconfig,
                context=context,
                max_intervals=max_intervals,
            )
        )
    except KeyboardInterrupt:
        return
    click.echo(f"planner stopped after {steps} interval(s)", err=True)


async def _run(
    *,
    config: PlannerConfig,
    perf: PerfModel,
    name: str | None,
    namespaces: list[str],
    recording: list[Observation] | None,
    observe_only: bool,
    kubeconfig: Path | None,
    context: str | None,
    max_intervals: int | None,
) -> int:
    from prometheus_client import start_http_server  # noqa: PLC0415

    from copse.planner.actuator import Actuator, ActuatorError, KubernetesApi  # noqa: PLC0415
    from copse.planner.metrics import PlannerMetrics  # noqa: PLC0415
    from copse.planner.prometheus import PrometheusClient, PrometheusSource, Queries  # noqa: PLC0415
    from copse.planner.runner import Fleet, Planned, Runner, run_prometheus, run_recording  # noqa: PLC0415

    metrics = PlannerMetrics()
    if config.metrics_port:
        start_http_server(config.metrics_port, addr=config.metrics_host, registry=metrics.registry)
    api = await KubernetesApi.connect(kubeconfig=kubeconfig, context=context)
    step = recording[0].duration_s if recording else config.interval_s

    def runner_for(namespace: str, deployment: str) -> Runner:
        actuator = Actuator(api=api, namespace=namespace, name=deployment, observe_only=observe_only)
        return Runner(config=config, actuator=actuator, perf=perf, metrics=metrics, interval_s=step)

    try:
        if recording is not None:
            assert name is not None
            return await run_recording(
                runner_for(namespaces[0], name), recording, max_intervals=max_intervals
            )
        client = PrometheusClient(url=config.prometheus.url, timeout_s=config.prometheus.timeout_s)

        def build(namespace: str, deployment: str) -> Planned:
            queries = Queries(
                config.prometheus,
                namespace=namespace,
                name=deployment,
                interval_s=step,
                quantile=config.quantile,
            )
            return Planned(
                runner=runner_for(namespace, deployment),
                source=PrometheusSource(client=client, queries=queries, interval_s=step),
            )

        async def discover() -> list[tuple[str, str]]:
            if name is not None:
                return [(namespaces[0], name)]
            found: list[tuple[str, str]] = []
            scopes: list[str | None] = list(namespaces) or [None]
            for namespace in scopes:
                found.extend(await api.names(namespace=namespace))
            return found

        try:
            return await run_prometheus(
                Fleet(discover=discover, build=build),
                interval_s=step,
                poll_s=config.fast_path_poll_s,
                max_intervals=max_intervals,
            )
        finally:
            await client.aclose()
    except ActuatorError as exc:
        fail(str(exc))
    except ValueError as exc:
        fail(str(exc))
    finally:
        await api.close()


@planner.command()
@click.option("--trace", type=click.Path(path_type=Path), help="Bucket a Mooncake JSONL or Azure CSV trace.")
@click.argument("name", required=False)
@click.option("--prometheus", help="Export the series of InferenceDeployment NAME from this Prometheus.")
@click.option("-n", "--namespace", default="default", show_default=True, help="Namespace of NAME.")
@click.option(
    "--since", default="24h", show_default=True, help="How far back the export starts (Go duration)."
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    show_default=True,
    help="Seconds per interval (trace bucket, or query_range step).",
)
@click.option(
    "--config", "config_path", type=click.Path(path_type=Path), help="Planner config YAML (queries)."
)
@click.option("--out", type=OutputPath(), required=True, help="File to write.")
@renamed("--name", new="the argument NAME", dest="name")
def record(
    *,
    trace: Path | None,
    prometheus: str | None,
    name: str | None,
    namespace: str,
    since: str,
    interval: float,
    config_path: Path | None,
    out: Path,
) -> None:
    """Write a recording the dry run reads: a trace bucketed into metrics JSON Lines, or the series
    of InferenceDeployment NAME exported from Prometheus (query_range JSON).

    \b
    Examples:
      copse planner record --trace examples/traces/mooncake-conversation-first-20min.jsonl.gz \\
        --interval 60 --out metrics.jsonl
      copse planner record llama-70b-disagg -n serving --prometheus http://prometheus:9090 \\
        --since 24h --out recording.json
    """
    import asyncio  # noqa: PLC0415

    from copse.api import parse_duration  # noqa: PLC0415
    from copse.planner.recording import write_metrics_jsonl  # noqa: PLC0415

    if (trace is None) == (prometheus is None):
        usage("give exactly one of --trace FILE or --prometheus URL")
    if trace is not None and config_path is not None:
        usage("--config holds the Prometheus queries: it is read with --prometheus only, not with --trace")
    if trace is not None:
        observations = _observations(None, trace, interval)
        with out.open("w") as handle:
            write_metrics_jsonl(observations, handle)
        click.echo(f"wrote {out}: {len(observations)} intervals of {interval:g}s")
        return
    assert prometheus is not None
    if name is None:
        usage("--prometheus needs NAME (the InferenceDeployment whose series to export)")
    try:
        config = load_config(config_path)
        span = parse_duration(since)
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    export = asyncio.run(
        _export(
            config=config, url=prometheus, name=name, namespace=namespace, span_s=span, interval_s=interval
        )
    )
    out.write_text(json.dumps(export))
    samples = (
        len(export["num_requests"]["data"]["result"][0]["values"])
        if export["num_requests"]["data"]["result"]
        else 0
    )
    click.echo(f"wrote {out}: {len(export)} series, {samples} intervals of {interval:g}s")


async def _export(
    *, config: PlannerConfig, url: str, name: str, namespace: str, span_s: float, interval_s: float
) -> dict[str, Any]:
    import time  # noqa: PLC0415

    from copse.planner.prometheus import PrometheusClient, PrometheusError, PrometheusSource, Queries  # noqa: PLC0415

    queries = Queries(
        config.prometheus, namespace=namespace, name=name, interval_s=interval_s, quantile=config.quantile
    )
    client = PrometheusClient(url=url, timeout_s=config.prometheus.timeout_s)
    end = time.time()
    try:
        source = PrometheusSource(client=client, queries=queries, interval_s=interval_s)
        return await source.export(start=end - span_s, end=end)
    except PrometheusError as exc:
        fail(str(exc))
    finally:
        await client.aclose()
