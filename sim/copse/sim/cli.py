"""``copse bench`` and ``copse synth``: the digital twin's commands."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import click
from tqdm import tqdm

from copse.router.core import Thresholds
from copse.router.policies import POLICIES, ROUTING_OBJECTIVES, RoutingObjective
from copse.sim import faults
from copse.sim.load import LOADS
from copse.sim.replay import (
    DEFAULT_ENGINE_NOISE,
    DEFAULT_KV_EVENT_LAG_MS,
    EngineConfigError,
    ReplayReport,
    ReplaySettings,
    RouterModel,
    load_engine_setup,
    replay,
)
from copse.sim.trace import TRACE_FORMATS, TraceError, TraceFormat, load_trace
from copse.workers.conventions import Failure, json_renamed, output_option, renamed, render
from copse.workers.files import OutputPath
from copse.workers.perf import PerfModel, ProfileError, load_profile

if TYPE_CHECKING:
    from copse.api import Role
    from copse.sim.frontier import Frontier
    from copse.sim.twin import TwinReport


@click.group()
def bench() -> None:
    """Simulations and benchmarks with no cluster: trace replays through the router (virtual clock
    or live processes), the closed-loop planner twin, the fault suite, and synthetic MoE workloads.

    \b
    Examples:
      copse bench replay --trace examples/traces/mooncake-conversation-first-20min.jsonl.gz --limit 300
      copse bench planner --metrics examples/planner/servegen-m-large-burst.jsonl \\
        --shapes examples/traces/mooncake-conversation-first-20min.jsonl.gz --ttft-ms 2000 --itl-ms 50
      copse bench faults --scenario engine-kill
    """


def _table(report: ReplayReport) -> str:
    def row(name: str, dist: object) -> str:
        values = [getattr(dist, key) for key in ("mean", "p50", "p90", "p99")]
        return f"{name:<10}" + "".join(f"{v:>12,.1f}" for v in values)

    lines = [
        f"policy {report.policy}, {report.workers} workers: {report.requests} requests completed, "
        f"{report.failed} refused, {report.preemptions} preemptions",
        f"{'ms':<10}{'mean':>12}{'p50':>12}{'p90':>12}{'p99':>12}",
        row("TTFT", report.ttft_ms),
        row("ITL", report.itl_ms),
        row("e2e", report.e2e_ms),
        f"cache hit rate {report.cache_hit_rate:.1%} of prompt tokens; "
        f"throughput {report.throughput_tok_s:,.0f} output tokens/s",
        f"simulated {report.simulated_s:,.0f} s in {report.wall_s:,.1f} s",
    ]
    if report.offload is not None:
        lines.insert(
            -1,
            f"offload tiers: {report.offload.host_hit_rate:.1%} of prompt tokens onboarded from host memory, "
            f"{report.offload.disk_hit_rate:.1%} from disk",
        )
    if report.moe is not None:
        lines.insert(
            -1,
            f"MoE: all-to-all {report.moe.all_to_all_bytes_per_token / 1e6:,.1f} MB per output token; "
            f"hottest EP rank {report.moe.imbalance:.3f}x the mean; MoE terms {report.moe.moe_share:.1%} "
            f"of step time; {report.moe.rebalances} expert re-placements",
        )
    return "\n".join(lines)


@bench.command("replay")
@click.option("--trace", "trace_path", required=True, type=click.Path(path_type=Path), help="Trace file.")
@click.option(
    "--trace-format", "fmt", type=click.Choice(TRACE_FORMATS), default="mooncake", show_default=True
)
@click.option(
    "--trace-block-size", type=int, default=512, show_default=True, help="Tokens per trace hash id."
)
@click.option("--workers", type=int, default=16, show_default=True, help="Mocked engines.")
@click.option("--policy", type=click.Choice(sorted(POLICIES)), default="kv", show_default=True)
@click.option("--speedup", type=float, default=1.0, show_default=True, help="Divide arrival times by this.")
@click.option(
    "--engine-config",
    type=click.Path(path_type=Path),
    default=None,
    help="YAML/JSON engine settings (EngineConfig fields and perf_profile).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="Router softmax temperature.")
@click.option(
    "--objective",
    type=click.Choice(ROUTING_OBJECTIVES),
    default="e2e",
    show_default=True,
    help="What kv minimises: e2e (end-to-end latency), ttft, or goodput (e2e meeting TTFT targets).",
)
@click.option(
    "--decode-weight",
    type=float,
    default=0.0,
    show_default=True,
    help="Weight of the request's predicted decode time in the kv cost (--objective ttft).",
)
@click.option(
    "--expert-weight",
    type=float,
    default=1.0,
    show_default=True,
    help="Weight of the predicted decode time with the MoE layers in the kv_expert cost.",
)
@click.option(
    "--no-expert-reports",
    is_flag=True,
    help="MoE engines report no per-request expert counts (ablation of kv_expert's expert knowledge).",
)
@click.option(
    "--router-profile",
    default="measured",
    show_default=True,
    help="The router's perf model: 'measured' (profiled from the noisy engines), 'exact' (the "
    "engines' own model: an oracle), or a profile file (NPZ/JSON).",
)
@click.option(
    "--router-prefill-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="The router believes prefill takes this times as long as its profile says (0.7: 30%% faster).",
)
@click.option(
    "--engine-noise",
    type=float,
    default=DEFAULT_ENGINE_NOISE,
    show_default=True,
    help="Coefficient of variation of every engine step's time (seeded).",
)
@click.option(
    "--kv-event-lag-ms",
    type=float,
    default=DEFAULT_KV_EVENT_LAG_MS,
    show_default=True,
    help="Delay from an engine step's end to its KV events reaching the router.",
)
@click.option("--queue-size", type=int, default=Thresholds().queue_size, show_default=True)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Replay only the first N requests.")
@click.option(
    "--live",
    is_flag=True,
    help="Real router HTTP server and mocked-engine processes, in wall time (use --limit).",
)
@output_option()
@json_renamed
@renamed("--format", new="--trace-format", dest="fmt", type=click.Choice(TRACE_FORMATS))
def replay_command(
    *,
    trace_path: Path,
    fmt: TraceFormat,
    trace_block_size: int,
    workers: int,
    policy: str,
    speedup: float,
    engine_config: Path | None,
    seed: int,
    temperature: float,
    objective: RoutingObjective,
    decode_weight: float,
    expert_weight: float,
    no_expert_reports: bool,
    router_profile: str,
    router_prefill_scale: float,
    engine_noise: float,
    kv_event_lag_ms: float,
    queue_size: int,
    limit: int | None,
    live: bool,
    output: str,
) -> None:
    """Replay a request trace through the router and mocked engines: a discrete-event simulation on
    a virtual clock, or with --live the real HTTP router and engine processes in wall time.

    \b
    Examples:
      copse bench replay --trace examples/traces/mooncake-conversation-first-20min.jsonl.gz \\
        --workers 8 --limit 600 --policy round_robin
      copse bench replay --trace examples/traces/mooncake-conversation-first-20min.jsonl.gz \\
        --limit 300 --speedup 3 --live -o json
    """
    for name, value in (
        ("--workers", workers),
        ("--trace-block-size", trace_block_size),
        ("--queue-size", queue_size),
    ):
        if value < 1:
            raise click.UsageError(f"{name} must be at least 1, got {value}")
    if not (speedup > 0 and math.isfinite(speedup)):
        raise click.UsageError(f"--speedup must be a positive number, got {speedup}")
    for name, number in (
        ("--temperature", temperature),
        ("--decode-weight", decode_weight),
        ("--expert-weight", expert_weight),
        ("--engine-noise", engine_noise),
        ("--kv-event-lag-ms", kv_event_lag_ms),
    ):
        if not (number >= 0 and math.isfinite(number)):
            raise click.UsageError(f"{name} must be a non-negative number, got {number}")
    if not (router_prefill_scale > 0 and math.isfinite(router_prefill_scale)):
        raise click.UsageError(
            f"--router-prefill-scale must be a positive number, got {router_prefill_scale}"
        )
    try:
        trace = load_trace(trace_path, fmt=fmt, trace_block_size=trace_block_size)
        engines = load_engine_setup(engine_config)
        source: Literal["measured", "exact"] | PerfModel
        if router_profile == "measured":
            source = "measured"
        elif router_profile == "exact":
            source = "exact"
        else:  # the engines' cache size is the router's configuration, whatever the file says
            source = load_profile(router_profile, kv_capacity_tokens=engines.perf.kv_capacity_tokens)
    except (TraceError, EngineConfigError, ProfileError) as exc:
        raise Failure(str(exc)) from exc
    if live and engines.config.moe is not None:
        raise click.UsageError(
            f"{engine_config}: MoE engines replay on the virtual clock only "
            "(mocked engines over HTTP report no expert counts to the router)"
        )
    if limit is not None:
        trace = trace[:limit]
    settings = ReplaySettings(
        policy=policy,
        workers=workers,
        speedup=speedup,
        seed=seed,
        trace_block_size=trace_block_size,
        temperature=temperature,
        objective=objective,
        decode_weight=decode_weight,
        expert_weight=expert_weight,
        expert_reports=not no_expert_reports,
        thresholds=Thresholds(queue_size=queue_size),
        engines=engines,
        engine_noise=engine_noise,
        kv_event_lag_ms=kv_event_lag_ms,
        router_model=RouterModel(source=source, prefill_scale=router_prefill_scale),
    )
    with tqdm(total=len(trace), unit="req", file=sys.stderr, disable=None, desc=policy) as bar:
        try:
            if live:
                # Imported here: the HTTP stack (aiohttp, the Kubernetes client) costs ~1 s of start-up.
                from copse.sim.live import run_live  # noqa: PLC0415

                report = run_live(trace, settings, progress=bar.update)
            else:
                report = replay(trace, settings, progress=bar.update)
        except ValueError as exc:
            raise Failure(str(exc)) from exc
    if output != "table":
        click.echo(render(report.as_json(), output=output, table=str))
        return
    if not live:
        click.echo(
            f"router model {settings.router_model.describe()}, KV events {kv_event_lag_ms:g} ms late, "
            f"engine step noise {engine_noise:g} (CV)"
        )
    click.echo(_table(report))


_FAULTS = faults.FaultSettings()


@bench.command("faults")
@click.option(
    "--scenario",
    "scenarios",
    multiple=True,
    type=click.Choice([name for name in faults.SCENARIOS if name != "none"]),
    help="Scenario to run after the no-fault one (repeatable; default: all).",
)
@click.option("--streams", type=int, default=_FAULTS.streams, show_default=True, help="Concurrent streams.")
@click.option("--engines", type=int, default=_FAULTS.engines, show_default=True, help="Mocked engines.")
@click.option("--max-tokens", type=int, default=_FAULTS.max_tokens, show_default=True)
@output_option()
@json_renamed
def faults_command(
    *, scenarios: tuple[str, ...], streams: int, engines: int, max_tokens: int, output: str
) -> None:
    """Fault suite on 127.0.0.1: streams through router processes to mocked-engine processes, one
    fault per scenario (engines killed or hung, NATS restarted, a router replica killed or
    drained); prints what the clients saw. Exits 1 when any stream failed.

    \b
    Examples:
      copse bench faults
      copse bench faults --scenario engine-kill --scenario nats-restart -o json
    """
    import asyncio  # noqa: PLC0415

    from copse.sim.fault_suite import run_suite  # noqa: PLC0415 (aiohttp and the router stack)

    try:
        settings = faults.FaultSettings(streams=streams, engines=engines, max_tokens=max_tokens)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    chosen = scenarios or tuple(name for name in faults.SCENARIOS if name != "none")

    def done(result: faults.ScenarioResult) -> None:
        click.echo(
            f"{result.scenario}: {result.completed}/{result.streams} completed, {result.failed} failed",
            err=True,
        )

    try:
        results = asyncio.run(run_suite(settings, chosen, progress=done))
    except RuntimeError as exc:
        raise Failure(str(exc)) from exc
    click.echo(render(faults.as_json(results), output=output, table=lambda: faults.table(results)))
    failed = {r.scenario: r.failed for r in results if r.failed}
    if failed:
        raise Failure(
            "streams failed: " + ", ".join(f"{count} in {scenario}" for scenario, count in failed.items())
        )


@bench.command("moe-workload")
@click.option("--out", "out", required=True, type=OutputPath(), help="Mooncake JSONL to write.")
@click.option("--requests", type=click.IntRange(min=1), default=4000, show_default=True)
@click.option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    default=20.0,
    show_default=True,
    help="Mean arrivals per second.",
)
@click.option(
    "--class-weights",
    default="0.4,0.3,0.2,0.1",
    show_default=True,
    help="Share of requests per class, comma-separated (one class each).",
)
@click.option(
    "--prefix-blocks",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="System-prompt blocks per class.",
)
@click.option(
    "--output-mean",
    type=click.FloatRange(min=1),
    default=300.0,
    show_default=True,
    help="Mean output tokens.",
)
@click.option("--seed", type=int, default=0, show_default=True)
def moe_workload(
    *,
    out: Path,
    requests: int,
    rate: float,
    class_weights: str,
    prefix_blocks: int,
    output_mean: float,
    seed: int,
) -> None:
    """Write a synthetic Mixture-of-Experts workload: request classes with their own system prompts
    (so, to the mocked model, their own expert preferences), Poisson arrivals, as Mooncake JSONL.

    \b
    Examples:
      copse bench moe-workload --out moe.jsonl --requests 2000 --rate 40
    """
    from copse.sim.moe import MoeWorkload, generate, write_jsonl  # noqa: PLC0415

    try:  # the other options are checked by their types: what is left to fail is the weights
        weights = tuple(float(part) for part in class_weights.split(","))
        workload = MoeWorkload(
            requests=requests,
            rate=rate,
            class_weights=weights,
            prefix_blocks=prefix_blocks,
            output_mean=output_mean,
            seed=seed,
        )
    except ValueError as exc:
        raise click.UsageError(f"--class-weights {class_weights!r}: {exc}") from exc
    with out.open("w") as handle:
        write_jsonl(generate(workload), handle)
    click.echo(f"wrote {requests} requests in {len(weights)} classes to {out}", err=True)


@click.command()
@click.option(
    "--trace", "trace_path", required=True, type=click.Path(path_type=Path), help="Mooncake JSONL trace."
)
@click.option("--out", type=OutputPath(), default=None, help="Output JSONL (default: stdout).")
@click.option("--block-size", type=int, default=512, show_default=True, help="Tokens per hash id.")
@click.option("--num-requests", type=int, default=1000, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--prefix-len-multiplier", type=float, default=1.0, show_default=True)
@click.option("--prefix-root-multiplier", type=int, default=1, show_default=True)
@click.option("--prompt-len-multiplier", type=float, default=1.0, show_default=True)
@click.option("--osl-multiplier", type=float, default=1.0, show_default=True)
@click.option("--speedup", type=float, default=1.0, show_default=True, help="Divide arrival times by this.")
@renamed("--output", new="--out", dest="out", type=OutputPath())
@renamed("--speedup-ratio", new="--speedup", dest="speedup", type=float)
def synth(
    *,
    trace_path: Path,
    out: Path | None,
    block_size: int,
    num_requests: int,
    seed: int,
    prefix_len_multiplier: float,
    prefix_root_multiplier: int,
    prompt_len_multiplier: float,
    osl_multiplier: float,
    speedup: float,
) -> None:
    """Learn a Mooncake trace's prefix tree and sample a new trace from it.

    \b
    Examples:
      copse synth --trace examples/traces/mooncake-conversation-first-20min.jsonl.gz \\
        --num-requests 2000 --prefix-len-multiplier 2 --out synthetic.jsonl
    """
    # Imported here: networkx is only needed to learn the prefix tree.
    from copse.sim.synth import PrefixModel, SynthKnobs, write_jsonl  # noqa: PLC0415

    try:
        knobs = SynthKnobs(
            num_requests=num_requests,
            seed=seed,
            prefix_len_multiplier=prefix_len_multiplier,
            prefix_root_multiplier=prefix_root_multiplier,
            prompt_len_multiplier=prompt_len_multiplier,
            osl_multiplier=osl_multiplier,
            speedup_ratio=speedup,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        trace = load_trace(trace_path, trace_block_size=block_size)
    except TraceError as exc:
        raise Failure(str(exc)) from exc
    requests = PrefixModel.learn(trace, block_size=block_size).sample(knobs)
    if out is None:
        write_jsonl(requests, sys.stdout)
    else:
        with out.open("w") as handle:
            write_jsonl(requests, handle)
        click.echo(f"wrote {len(requests)} requests to {out}", err=True)


def _twin_summary(report: TwinReport, *, ttft_ms: float, itl_ms: float) -> str:
    who = "static fleet" if report.predictor is None else f"planner ({report.predictor})"
    pools = ""
    if len(report.pools) > 1:
        pools = "; " + ", ".join(
            f"{role.value} {pool.gpu_hours:,.2f} GPU-h "
            f"(mean {pool.mean_replicas:.2f}, peak {pool.peak_replicas})"
            for role, pool in report.pools.items()
        )
    lines = [
        f"{who}, start-up delay {report.startup_delay_s:g} s: {report.requests:,} requests, "
        f"{report.failed} refused",
        f"SLO (TTFT <= {ttft_ms:g} ms and ITL <= {itl_ms:g} ms): {report.slo_attainment:.2%} of requests, "
        f"{report.interval_attainment:.2%} of intervals",
        f"GPU-hours {report.gpu_hours:,.2f} (mean {report.mean_replicas:.2f} replicas, peak "
        f"{report.peak_replicas}){pools}",
        f"{report.scaling_events} scaling events ({report.scaling_events / report.window_h:.1f} per hour), "
        f"{report.flaps} flaps (up-down-up within the {report.scale_down_delay_s:g} s scale-down delay)"
        + (
            "; scale-ups by trigger: "
            + ", ".join(f"{name} {count}" for name, count in report.scale_ups.items())
            if report.scale_ups
            else ""
        ),
        f"TTFT ms p50 {report.ttft_ms.p50:,.0f} p99 {report.ttft_ms.p99:,.0f}; "
        f"ITL ms p50 {report.itl_ms.p50:,.1f} p99 {report.itl_ms.p99:,.1f}",
        f"simulated {report.simulated_s:,.0f} s in {report.wall_s:,.1f} s",
    ]
    return "\n".join(lines)


def _interval_table(report: TwinReport) -> str:
    """One line per interval; a disaggregated fleet's serving count reads prefill+decode."""
    lines = [
        f"{'start s':>9}{'arrivals':>9}{'serving':>8}{'held':>6}{'TTFT p99':>10}{'ITL p99':>9}  ok  forecast"
    ]
    for row in report.intervals:
        forecast = "" if row.forecast is None else f"{row.forecast:,.0f}"
        pools = row.pools
        serving = f"{pools['prefill']}+{pools['decode']}" if "decode" in pools else str(row.serving)
        lines.append(
            f"{row.start_s:>9,.0f}{row.arrivals:>9}{serving:>8}{row.held:>6}{row.ttft_p99_ms:>10,.0f}"
            f"{row.itl_p99_ms:>9,.1f}  {'yes' if row.slo_ok else 'NO ':<4}{forecast}"
        )
    return "\n".join(lines)


def _frontier_summary(frontier: Frontier, planner: TwinReport) -> str:
    lines = [f"Static fleets on the same arrivals (goal {frontier.goal:.2%} of requests):"]
    lines.append(f"{'size':>5} {'pools':<22} {'requests ok':>11} {'GPU-hours':>10}")
    best = frontier.first_meeting_goal
    for point in frontier.static:
        pools = ", ".join(f"{role} {count}" for role, count in point.pools.items())
        mark = "  <- first meeting the goal" if point is best else ""
        lines.append(
            f"{point.replicas:>5} {pools:<22} {point.slo_attainment:>11.2%} {point.gpu_hours:>10,.2f}{mark}"
        )
    attainment, cost = planner.slo_attainment, planner.gpu_hours
    static_cost = frontier.static_gpu_hours_at(attainment)
    ratio = frontier.ratio_at_equal_attainment(attainment=attainment, gpu_hours=cost)
    if static_cost is None or ratio is None:
        lines.append(
            f"planner: {cost:,.2f} GPU-h at {attainment:.2%}; "
            "no static size simulated reaches that attainment"
        )
    else:
        lines.append(
            f"planner: {cost:,.2f} GPU-h at {attainment:.2%}; static at equal attainment {static_cost:,.2f} "
            f"GPU-h: ratio at equal attainment {ratio:.2f}"
        )
    at_cost = frontier.static_attainment_at(cost)
    lines.append(
        "at the planner's cost a static fleet reaches "
        + ("(outside the sizes simulated)" if at_cost is None else f"{at_cost:.2%}")
        + f", the planner {attainment:.2%}"
    )
    return "\n".join(lines)


def _static_option(value: str | None, *, disaggregated: bool) -> dict[Role, int] | None:
    """``--static``: ``N`` replicas (aggregated), ``P,D`` prefill and decode replicas."""
    from copse.api import Role  # noqa: PLC0415 (pydantic: only when a static fleet is asked for)

    if value is None:
        return None
    parts = value.split(",")
    try:
        counts = [int(part) for part in parts]
    except ValueError:
        counts = []
    if disaggregated and len(counts) == 2 and min(counts) >= 1:
        return {Role.PREFILL: counts[0], Role.DECODE: counts[1]}
    if not disaggregated and len(counts) == 1 and counts[0] >= 1:
        return {Role.WORKER: counts[0]}
    form = "P,D (prefill and decode replicas, each >= 1)" if disaggregated else "N (replicas, >= 1)"
    raise click.UsageError(f"--static {value!r}: expected {form}")


@bench.command("planner")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path), help="Serve this request trace.")
@click.option(
    "--trace-format", "fmt", type=click.Choice(TRACE_FORMATS), default="mooncake", show_default=True
)
@click.option(
    "--speedup", type=float, default=1.0, show_default=True, help="Divide the trace's arrival times."
)
@click.option(
    "--metrics",
    type=click.Path(path_type=Path),
    help="Or a load recording (the planner's metrics format): arrivals at its rates.",
)
@click.option(
    "--shapes",
    type=click.Path(path_type=Path),
    help="Mooncake trace whose requests (lengths, shared prefixes) the --metrics arrivals get, in order.",
)
@click.option(
    "--load",
    "load_name",
    type=click.Choice(sorted(LOADS)),
    help="Or a named load (ServeGen rates, trace shapes; read from --traces): "
    + "; ".join(f"{name}: {spec.description}" for name, spec in sorted(LOADS.items())),
)
@click.option(
    "--traces",
    type=click.Path(path_type=Path),
    envvar="COPSE_TRACES",
    help="Folder holding the whole public traces a --load reads (they are not in the repository; "
    "docs/guides/benchmarks.md, 'Inputs', says where to get them) [env: COPSE_TRACES].",
)
@click.option(
    "--hours",
    type=click.FloatRange(min=0, min_open=True),
    help="Only the first hours of the --load or --metrics.",
)
@click.option(
    "--peak-rate",
    type=float,
    help="Scale the --metrics or --load rates so the busiest interval has this req/s.",
)
@click.option("--max-isl", type=int, help="Leave out --shapes requests with longer prompts.")
@click.option("--ttft-ms", type=click.FloatRange(min=0, min_open=True), help="TTFT target, ms.")
@click.option("--itl-ms", type=click.FloatRange(min=0, min_open=True), help="ITL target (mean gap), ms.")
@click.option(
    "--deployment", type=click.Path(path_type=Path), help="Take targets and bounds from a manifest."
)
@click.option(
    "--disaggregated",
    is_flag=True,
    help="Prefill and decode pools (the router's P/D path, KV transfers) instead of aggregated workers.",
)
@click.option(
    "--interval", type=click.FloatRange(min=1), default=60.0, show_default=True, help="Seconds per decision."
)
@click.option(
    "--predictor", help="Load predictor by name, as copse planner takes it (default: the config's)."
)
@click.option(
    "--startup-delay",
    type=click.FloatRange(min=0),
    help="Seconds from adding a replica to it serving (default: the deployment's spec.coldStart, else 120).",
)
@click.option("--scale-down-delay", type=click.FloatRange(min=0), help="Seconds the need must stay lower.")
@click.option("--min-replicas", type=click.IntRange(min=1), help="Fewest replicas per pool (default 1).")
@click.option("--max-replicas", type=click.IntRange(min=1), help="Most replicas per pool (default 16).")
@click.option("--gpu-budget", type=click.IntRange(min=1), help="Most GPUs the pools may use.")
@click.option(
    "--initial-replicas", type=click.IntRange(min=1), help="Replicas per pool at the start (default: min)."
)
@click.option(
    "--static",
    "static_replicas",
    help="No planner: this many replicas throughout (a static deployment); P,D with --disaggregated.",
)
@click.option(
    "--frontier/--no-frontier",
    default=True,
    show_default=True,
    help="Also run the static fleet sizes around the planner on the same arrivals and compare.",
)
@click.option(
    "--goal",
    type=click.FloatRange(min=0, max=1, min_open=True),
    default=0.99,
    show_default=True,
    help="Share of requests within SLO the static walk goes up to.",
)
@click.option(
    "--jobs", type=click.IntRange(min=1), default=2, show_default=True, help="Static runs in parallel."
)
@click.option(
    "--warmup",
    type=click.FloatRange(min=0),
    help="Seconds before results count (default: the --load's, else 0).",
)
@click.option("--config", "config_path", type=click.Path(path_type=Path), help="Planner config YAML.")
@click.option("--policy", type=click.Choice(sorted(POLICIES)), default="kv", show_default=True)
@click.option("--engine-config", type=click.Path(path_type=Path), help="YAML/JSON engine settings.")
@click.option("--engine-noise", type=float, default=DEFAULT_ENGINE_NOISE, show_default=True)
@click.option("--kv-event-lag-ms", type=float, default=DEFAULT_KV_EVENT_LAG_MS, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--intervals", "show_intervals", is_flag=True, help="Also print every interval.")
@output_option()
@json_renamed
@renamed("--format", new="--trace-format", dest="fmt", type=click.Choice(TRACE_FORMATS))
def planner_command(
    *,
    trace_path: Path | None,
    fmt: TraceFormat,
    speedup: float,
    metrics: Path | None,
    shapes: Path | None,
    load_name: str | None,
    traces: Path | None,
    hours: float | None,
    peak_rate: float | None,
    max_isl: int | None,
    ttft_ms: float | None,
    itl_ms: float | None,
    deployment: Path | None,
    disaggregated: bool,
    interval: float,
    predictor: str | None,
    startup_delay: float | None,
    scale_down_delay: float | None,
    min_replicas: int | None,
    max_replicas: int | None,
    gpu_budget: int | None,
    initial_replicas: int | None,
    static_replicas: str | None,
    frontier: bool,
    goal: float,
    jobs: int,
    warmup: float | None,
    config_path: Path | None,
    policy: str,
    engine_config: Path | None,
    engine_noise: float,
    kv_event_lag_ms: float,
    seed: int,
    show_intervals: bool,
    output: str,
) -> None:
    """The planner in closed loop with a simulated fleet: every interval it sizes the fleet from the
    metrics it would read in a cluster; replicas start after the start-up delay and drain before
    they go; the router routes every request; TTFT and ITL are measured per request. Then, unless
    --no-frontier, every static fleet size around it on the same arrivals, from the largest that
    misses both the goal and the planner's attainment to the first that reaches both, and the
    planner's GPU-hours over the static ones interpolated at its attainment. With --static, a
    fixed fleet instead (what the planner is compared with).

    \b
    Examples:
      copse bench planner --metrics examples/planner/servegen-m-large-burst.jsonl \\
        --shapes examples/traces/mooncake-conversation-first-20min.jsonl.gz --max-isl 32768 \\
        --peak-rate 40 --ttft-ms 2000 --itl-ms 50 --startup-delay 120 --no-frontier
      copse bench planner --metrics examples/planner/servegen-m-large-burst.jsonl \\
        --shapes examples/traces/mooncake-conversation-first-20min.jsonl.gz --peak-rate 40 \\
        --ttft-ms 2000 --itl-ms 50 --static 8 -o json
      copse bench planner --load burst-4h --traces ~/traces --peak-rate 9 --startup-delay 420 -o json
    """
    from copse.planner.cli import config_from_options, limits_from_options  # noqa: PLC0415
    from copse.planner.predictors import PREDICTORS  # noqa: PLC0415
    from copse.planner.recording import RecordingError, read_metrics  # noqa: PLC0415
    from copse.sim.frontier import TwinPool, run_frontier  # noqa: PLC0415
    from copse.sim.load import LoadError, build_load, synthesize  # noqa: PLC0415
    from copse.sim.twin import TwinSettings, run_twin  # noqa: PLC0415

    if sum(source is not None for source in (trace_path, metrics, load_name)) != 1:
        raise click.UsageError(
            "give exactly one of --trace FILE, --metrics FILE (with --shapes FILE) or --load NAME"
        )
    if predictor is not None and predictor not in PREDICTORS:
        raise click.UsageError(f"unknown predictor {predictor!r}; known: {', '.join(sorted(PREDICTORS))}")
    if metrics is not None and shapes is None:
        raise click.UsageError("--metrics needs --shapes FILE: the trace whose requests the arrivals get")
    if load_name is not None and traces is None:
        raise click.UsageError(
            f"--load {load_name} reads whole public traces: give --traces DIR or set COPSE_TRACES"
        )
    if hours is not None and trace_path is not None:
        raise click.UsageError("--hours slices a --load or --metrics, not a --trace")
    for name, number in (("--engine-noise", engine_noise), ("--kv-event-lag-ms", kv_event_lag_ms)):
        if not (number >= 0 and math.isfinite(number)):
            raise click.UsageError(f"{name} must be a non-negative number, got {number}")
    for name, positive in (("--speedup", speedup), ("--peak-rate", peak_rate)):
        if positive is not None and not (positive > 0 and math.isfinite(positive)):
            raise click.UsageError(f"{name} must be a positive number, got {positive}")
    static = _static_option(static_replicas, disaggregated=disaggregated)
    config = config_from_options(config_path, predictor=predictor, startup_delay_s=startup_delay)
    limits = limits_from_options(
        deployment=deployment,
        aggregated=not disaggregated,
        ttft_ms=ttft_ms,
        itl_ms=itl_ms,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        gpu_budget=gpu_budget,
        gpus_per_replica=1,
        scale_down_delay=scale_down_delay,
    )
    try:
        engines = load_engine_setup(engine_config)
        end_s: float | None = None
        warmup_s = warmup or 0.0
        if load_name is not None:
            assert traces is not None
            load = build_load(load_name, seed=seed, peak_rate=peak_rate, traces=traces, hours=hours)
            trace, end_s = load.requests, load.end_s
            warmup_s = load.warmup_s if warmup is None else warmup
        elif metrics is not None:
            assert shapes is not None
            recording = read_metrics(metrics)
            if hours is not None:  # the intervals starting within the first hours
                recording = [
                    obs for obs in recording if obs.timestamp < recording[0].timestamp + hours * 3600
                ]
            peak = max(obs.rate for obs in recording)
            scale = 1.0 if peak_rate is None or peak <= 0 else peak_rate / peak
            trace = synthesize(
                recording, load_trace(shapes), seed=seed, scale=scale, max_input_length=max_isl
            )
            end_s = recording[-1].end - recording[0].timestamp
        else:
            assert trace_path is not None
            trace = load_trace(trace_path, fmt=fmt)
        start = initial_replicas or max(limits.min_replicas, 1)
        settings = TwinSettings(
            fleet=ReplaySettings(
                policy=policy,
                workers=start,
                speedup=speedup,
                seed=seed,
                engines=engines,
                engine_noise=engine_noise,
                kv_event_lag_ms=kv_event_lag_ms,
            ),
            limits=limits,
            planner=None if static else config,
            interval_s=interval,
            warmup_s=warmup_s,
            initial=static,
        )
    except (TraceError, EngineConfigError, RecordingError, LoadError, ValueError) as exc:
        raise Failure(str(exc)) from exc
    total = end_s if end_s is not None else trace[-1].timestamp_ms / 1000.0 / speedup
    with tqdm(total=round(total), unit="s", file=sys.stderr, disable=None, desc="simulated") as bar:
        try:
            report = run_twin(trace, settings, end_s=end_s, progress=bar.update)
        except ValueError as exc:
            raise Failure(str(exc)) from exc
    result = None
    if frontier and static is None:

        def done(size: int, static_report: TwinReport) -> None:
            click.echo(
                f"  static {size}: {static_report.slo_attainment:.2%} of requests, "
                f"{static_report.gpu_hours:,.2f} GPU-h ({static_report.wall_s:,.0f} s)",
                err=True,
            )

        with TwinPool(trace, settings, end_s=end_s, jobs=jobs) as pool:
            result, _ = run_frontier(pool, [report], goal=goal, on_static=done)
    if output != "table":
        document = report.as_json()
        if load_name is not None:
            document["load"] = load_name
        if result is not None:
            document["frontier"] = result.as_json(
                attainment=report.slo_attainment, gpu_hours=report.gpu_hours
            )
        click.echo(render(document, output=output, table=str))
        return
    if show_intervals:
        click.echo(_interval_table(report))
    click.echo(_twin_summary(report, ttft_ms=limits.ttft_ms, itl_ms=limits.itl_ms))
    if result is not None:
        click.echo(_frontier_summary(result, report))
