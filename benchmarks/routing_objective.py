"""``kv`` with its defaults against round-robin end to end, on every trace, load and seed asked.

For each trace (Mooncake conversation, Mooncake synthetic, the generated agentic workload
below), arrival speedup and seed, replays the trace through the routing core
and mocked engines on the virtual clock (``copse bench replay``'s defaults: a profile measured
from the noisy engines, KV events 50 ms late, 5 % step-time noise) once with ``kv`` at its
defaults and once per other run asked (round-robin always; ``--objectives`` adds ``kv`` with
each named routing objective, ``--decode-weights`` ``kv`` with the ``ttft`` objective and that
decode weight). Prints per run TTFT p50/p99, ITL p50, end-to-end p50/p99, hit rate, and the
ratio of each run's figures to ``kv``'s defaults (> 1: ``kv`` is faster), then, per trace, in how
many of the load/seed cells ``kv`` (defaults) is behind round-robin on each figure.

The agentic workload (``generate``):
No public agentic trace is available offline here (Mooncake's ``toolagent_trace.jsonl`` is not in
``../shared/traces``), so this builds one with the structure such traces have:

- agent sessions start as a Poisson process; each session uses one of ``agents`` system prompts
  with tool definitions (popularity Zipf(1.1), 4k-16k tokens each), shared by every session of
  that agent;
- a session runs 2-15 turns; each turn's prompt is the previous turn's prompt plus the previous
  output plus a tool result (100-4,000 tokens, log-uniform), so consecutive turns share all but
  their last block;
- outputs are short tool calls or answers (lognormal, median 120 tokens, capped at 1,024);
- the next turn arrives after the previous one would have finished on an idle engine (output x
  10 ms) plus the tool's latency (0.2-3 s): arrivals are open-loop, as a trace's are.

Hash ids follow Mooncake's rules: one id per 512 tokens, prefix-chained (equal ids mean equal
prefixes); a turn's partial last block is new content in the next turn, so it gets a new id.

Usage: ``.venv/bin/python benchmarks/routing_objective.py [--traces conversation,synthetic,agentic]
[--speedups ...] [--seeds 0,1] [--workers 8] [--limit N] [--objectives ttft,e2e]
[--decode-weights 1] [--json FILE]``
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

from copse.router.policies import ROUTING_OBJECTIVES, RoutingObjective
from copse.sim.replay import ReplayReport, ReplaySettings, replay
from copse.sim.trace import TraceRequest, load_trace
from inputs import CONVERSATION, SYNTHETIC, require

BLOCK = 512


@dataclasses.dataclass(frozen=True, slots=True)
class AgenticKnobs:
    """What the generated workload looks like."""

    sessions: int = 600
    """Agent sessions (each several requests)."""
    session_rate_per_s: float = 1.0
    """Sessions starting per second (Poisson)."""
    agents: int = 12
    """Distinct system prompts with tool definitions."""
    seed: int = 0


def generate(knobs: AgenticKnobs) -> list[TraceRequest]:
    """The requests of ``knobs.sessions`` sessions, sorted by arrival."""
    rng = np.random.default_rng(knobs.seed)
    ids = itertools.count()
    agent_blocks = []
    for _ in range(knobs.agents):
        blocks = int(rng.integers(8, 33))  # 4k-16k tokens of system prompt and tools
        agent_blocks.append([next(ids) for _ in range(blocks)])
    popularity = 1.0 / np.arange(1, knobs.agents + 1) ** 1.1
    popularity /= popularity.sum()
    requests: list[TraceRequest] = []
    start_ms = 0.0
    for _ in range(knobs.sessions):
        start_ms += float(rng.exponential(1000.0 / knobs.session_rate_per_s))
        agent = int(rng.choice(knobs.agents, p=popularity))
        full = list(agent_blocks[agent])  # ids of the context's full blocks
        tail = int(rng.integers(200, 2000))  # the task: tokens past the full blocks
        at_ms = start_ms
        for _turn in range(int(rng.integers(2, 16))):
            length = len(full) * BLOCK + tail
            output = int(min(1024, max(8, rng.lognormal(math.log(120.0), 0.8))))
            partial = [next(ids)] if tail else []
            requests.append(
                TraceRequest(
                    timestamp_ms=at_ms,
                    input_length=length,
                    output_length=output,
                    hash_ids=(*full, *partial),
                )
            )
            tool = int(math.exp(rng.uniform(math.log(100.0), math.log(4000.0))))
            tail += output + tool
            while tail >= BLOCK:
                full.append(next(ids))
                tail -= BLOCK
            at_ms += output * 10.0 + float(rng.uniform(200.0, 3000.0))
    requests.sort(key=lambda r: r.timestamp_ms)
    return requests


FIGURES = ("TTFT p50", "TTFT p99", "ITL p50", "e2e p50", "e2e p99")


def _trace(name: str, *, limit: int | None) -> list[TraceRequest]:
    if name == "agentic":
        generated: list[TraceRequest] = generate(AgenticKnobs())
        return generated[:limit]
    files = {"conversation": CONVERSATION, "synthetic": SYNTHETIC}
    return load_trace(require(files[name]))[:limit]


def figures(report: ReplayReport) -> tuple[float, ...]:
    """The five latency figures the comparison is about, ms."""
    return (
        report.ttft_ms.p50,
        report.ttft_ms.p99,
        report.itl_ms.p50,
        report.e2e_ms.p50,
        report.e2e_ms.p99,
    )


def runs_for(base: ReplaySettings, *, objectives: list[str], weights: list[str]) -> dict[str, ReplaySettings]:
    """``kv`` at its defaults, round-robin, and ``kv`` with each objective and decode weight asked."""
    runs = {"kv": base, "round_robin": dataclasses.replace(base, policy="round_robin")}
    for objective in objectives:
        runs[f"kv {objective}"] = dataclasses.replace(base, objective=cast(RoutingObjective, objective))
    for weight in weights:
        runs[f"kv ttft w={weight}"] = dataclasses.replace(base, objective="ttft", decode_weight=float(weight))
    return runs


def print_table(title: str, reports: dict[str, ReplayReport]) -> None:
    print(f"\n{title}")
    header = "".join(f"{figure:>10}" for figure in FIGURES)
    print(f"{'run':<16}{header}{'hit':>7}   ratios to kv (>1: kv faster)")
    reference = figures(reports["kv"])
    for name, report in reports.items():
        values = figures(report)
        cells = "".join(f"{value:>10,.1f}" for value in values)
        ratios = " ".join(f"{value / ref:5.2f}" for value, ref in zip(values, reference, strict=True))
        print(f"{name:<16}{cells}{report.cache_hit_rate:>7.1%}   {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traces", default="conversation,synthetic,agentic")
    parser.add_argument("--speedups", default=None, help="Comma-separated; default per trace.")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--limit", type=int, default=None, help="Replay only the first N requests.")
    parser.add_argument("--objectives", default="", help="Also run kv with these routing objectives.")
    parser.add_argument("--decode-weights", default="", help="Also run kv (ttft objective) at these weights.")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    default_speedups = {"conversation": "2,3,4", "synthetic": "1,1.5,2", "agentic": "1,1.5,2"}
    objectives = [name for name in args.objectives.split(",") if name]
    unknown = sorted(set(objectives) - set(ROUTING_OBJECTIVES)) + sorted(
        set(args.traces.split(",")) - set(default_speedups)
    )
    if unknown:
        parser.error(f"unknown objective(s) or trace(s): {', '.join(unknown)}")
    weights = [weight for weight in args.decode_weights.split(",") if weight]
    everything: list[dict[str, object]] = []
    verdicts: list[str] = []
    for trace_name in args.traces.split(","):
        trace = _trace(trace_name, limit=args.limit)
        behind = dict.fromkeys(FIGURES, 0)
        cells = 0
        for speedup in (float(s) for s in (args.speedups or default_speedups[trace_name]).split(",")):
            for seed in (int(s) for s in args.seeds.split(",")):
                base = ReplaySettings(workers=args.workers, speedup=speedup, seed=seed)
                reports = {}
                for name, settings in runs_for(base, objectives=objectives, weights=weights).items():
                    reports[name] = report = replay(trace, settings)
                    print(
                        f"  {trace_name} x{speedup:g} seed {seed}: {name} {report.wall_s:.0f} s",
                        file=sys.stderr,
                    )
                    cell = {"trace": trace_name, "speedup": speedup, "seed": seed, "run": name}
                    everything.append({**cell, **report.as_json()})
                rate = len(trace) / (trace[-1].timestamp_ms / 1000 / speedup)
                print_table(
                    f"{trace_name}, {len(trace)} requests, {args.workers} engines, x{speedup:g} "
                    f"({rate:.1f} req/s), seed {seed}",
                    reports,
                )
                cells += 1
                kv, rr = figures(reports["kv"]), figures(reports["round_robin"])
                for figure, kv_value, rr_value in zip(FIGURES, kv, rr, strict=True):
                    behind[figure] += kv_value > rr_value
        counts = ", ".join(f"{figure} {count}/{cells}" for figure, count in behind.items())
        verdicts.append(f"{trace_name}: kv (defaults) behind round-robin in {counts}")
    print()
    print("\n".join(verdicts))
    if args.json is not None:
        args.json.write_text(json.dumps(everything, indent=1))


if __name__ == "__main__":
    main()
