"""``copse bench`` and ``copse synth``: the digital twin's commands."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import click
from tqdm import tqdm

from copse.router.core import Thresholds
from copse.router.policies import POLICIES
from copse.sim.replay import EngineConfigError, ReplayReport, ReplaySettings, load_engine_setup, replay
from copse.sim.trace import TRACE_FORMATS, TraceError, TraceFormat, load_trace


def _fail(message: str) -> SystemExit:
    click.echo(f"error: {message}", err=True)
    return SystemExit(2)


@click.group()
def bench() -> None:
    """Benchmarks of routing policies."""


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
@click.option("--format", "fmt", type=click.Choice(TRACE_FORMATS), default="mooncake", show_default=True)
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
    "--decode-weight",
    type=float,
    default=0.0,
    show_default=True,
    help="Weight of the request's predicted decode time in the kv cost.",
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
@click.option("--queue-size", type=int, default=Thresholds().queue_size, show_default=True)
@click.option("--limit", type=int, default=None, help="Replay only the first N requests.")
@click.option(
    "--live",
    is_flag=True,
    help="Real router HTTP server and mocked-engine processes, in wall time (use --limit).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
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
    decode_weight: float,
    expert_weight: float,
    no_expert_reports: bool,
    queue_size: int,
    limit: int | None,
    live: bool,
    as_json: bool,
) -> None:
    """Replay a request trace through the router and mocked engines: a discrete-event simulation on
    a virtual clock, or with --live the real HTTP router and engine processes in wall time."""
    for name, value in (
        ("--workers", workers),
        ("--trace-block-size", trace_block_size),
        ("--queue-size", queue_size),
    ):
        if value < 1:
            raise _fail(f"{name} must be at least 1, got {value}")
    if not (speedup > 0 and math.isfinite(speedup)):
        raise _fail(f"--speedup must be a positive number, got {speedup}")
    for option, weight in (
        ("--temperature", temperature),
        ("--decode-weight", decode_weight),
        ("--expert-weight", expert_weight),
    ):
        if not (weight >= 0 and math.isfinite(weight)):
            raise _fail(f"{option} must be a non-negative number, got {weight}")
    try:
        trace = load_trace(trace_path, fmt=fmt, trace_block_size=trace_block_size)
        engines = load_engine_setup(engine_config)
    except (TraceError, EngineConfigError) as exc:
        raise _fail(str(exc)) from exc
    if live and engines.config.moe is not None:
        raise _fail(
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
        decode_weight=decode_weight,
        expert_weight=expert_weight,
        expert_reports=not no_expert_reports,
        thresholds=Thresholds(queue_size=queue_size),
        engines=engines,
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
            raise _fail(str(exc)) from exc
    click.echo(json.dumps(report.as_json()) if as_json else _table(report))


@bench.command("moe-workload")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Mooncake JSONL to write.")
@click.option("--requests", type=int, default=4000, show_default=True)
@click.option("--rate", type=float, default=20.0, show_default=True, help="Mean arrivals per second.")
@click.option(
    "--class-weights",
    default="0.4,0.3,0.2,0.1",
    show_default=True,
    help="Share of requests per class, comma-separated (one class each).",
)
@click.option(
    "--prefix-blocks", type=int, default=4, show_default=True, help="System-prompt blocks per class."
)
@click.option("--output-mean", type=float, default=300.0, show_default=True, help="Mean output tokens.")
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
    (so, to the mocked model, their own expert preferences), Poisson arrivals, as Mooncake JSONL."""
    from copse.sim.moe import MoeWorkload, generate, write_jsonl  # noqa: PLC0415

    try:
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
        raise _fail(f"--class-weights/--requests/--rate: {exc}") from exc
    with out.open("w") as handle:
        write_jsonl(generate(workload), handle)
    click.echo(f"wrote {requests} requests in {len(weights)} classes to {out}", err=True)


@click.command()
@click.option(
    "--trace", "trace_path", required=True, type=click.Path(path_type=Path), help="Mooncake JSONL trace."
)
@click.option(
    "--output", type=click.Path(path_type=Path), default=None, help="Output JSONL (default: stdout)."
)
@click.option("--block-size", type=int, default=512, show_default=True, help="Tokens per hash id.")
@click.option("--num-requests", type=int, default=1000, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--prefix-len-multiplier", type=float, default=1.0, show_default=True)
@click.option("--prefix-root-multiplier", type=int, default=1, show_default=True)
@click.option("--prompt-len-multiplier", type=float, default=1.0, show_default=True)
@click.option("--osl-multiplier", type=float, default=1.0, show_default=True)
@click.option("--speedup-ratio", type=float, default=1.0, show_default=True)
def synth(
    *,
    trace_path: Path,
    output: Path | None,
    block_size: int,
    num_requests: int,
    seed: int,
    prefix_len_multiplier: float,
    prefix_root_multiplier: int,
    prompt_len_multiplier: float,
    osl_multiplier: float,
    speedup_ratio: float,
) -> None:
    """Learn a Mooncake trace's prefix tree and sample a new trace from it."""
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
            speedup_ratio=speedup_ratio,
        )
        trace = load_trace(trace_path, trace_block_size=block_size)
    except (ValueError, TraceError) as exc:
        raise _fail(str(exc)) from exc
    requests = PrefixModel.learn(trace, block_size=block_size).sample(knobs)
    if output is None:
        write_jsonl(requests, sys.stdout)
    else:
        with output.open("w") as handle:
            write_jsonl(requests, handle)
        click.echo(f"wrote {len(requests)} requests to {output}", err=True)
