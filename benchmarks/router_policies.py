"""Routing policies compared on the Mooncake conversation trace: 16 mocked engines, every policy
replaying the same trace at the same load in one run (discrete-event simulation, same seed).

Prints, per scenario and load (arrival speedup), each policy's TTFT (mean/p50/p90/p99), ITL p50,
e2e p50 and prefix-cache hit rate, the ratio of each policy's TTFT to the ``kv`` policy's (>1:
``kv`` is faster), and the hit rate against the trace's offline bound (one infinite cache seeing
every request in order: the first sight of a block always misses); then, per scenario, ``kv``'s
margin over the best other policy at p50 and p99.

Scenarios (what the router knows; every policy gets the same indexer and load tracker):

- ``oracle``: the engines' exact perf model, KV events at the end of the step that emitted them,
  no step-time noise (the simulator's own knowledge);
- ``measured``: a profile measured from the engines (``copse.sim.profiler``), KV events 50 ms
  late, 5 % step-time noise (``copse bench replay``'s defaults);
- ``fast30`` / ``slow30``: as ``measured``, but the router believes prefill takes 0.7x / 1.3x
  as long as its profile says (30 % faster / slower than it is).

``--decode-weights 0,0.03,0.1,1`` instead replays ``kv`` at each ``decode_weight`` (and
round-robin as the baseline) in the ``measured`` scenario.

Usage: ``.venv/bin/python benchmarks/router_policies.py [--speedups 4,6] [--scenarios oracle,measured]
[--workers 16] [--limit N] [--decode-weights W,...] [--json FILE]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import inputs
from copse.router.policies import POLICIES
from copse.sim.replay import ReplayReport, ReplaySettings, RouterModel, replay
from copse.sim.trace import load_trace, offline_bound

TRACE = inputs.CONVERSATION
ORDER = ["kv", "dynamo", "prefix_only", "least_loaded", "round_robin", "random"]


@dataclasses.dataclass(frozen=True)
class Scenario:
    """What the router knows about the engines, and how late it hears of their caches."""

    router_model: RouterModel
    kv_event_lag_ms: float
    engine_noise: float

    def apply(self, settings: ReplaySettings) -> ReplaySettings:
        return dataclasses.replace(
            settings,
            router_model=self.router_model,
            kv_event_lag_ms=self.kv_event_lag_ms,
            engine_noise=self.engine_noise,
        )


SCENARIOS = {
    "oracle": Scenario(router_model=RouterModel(source="exact"), kv_event_lag_ms=0.0, engine_noise=0.0),
    "measured": Scenario(router_model=RouterModel(), kv_event_lag_ms=50.0, engine_noise=0.05),
    "fast30": Scenario(router_model=RouterModel(prefill_scale=0.7), kv_event_lag_ms=50.0, engine_noise=0.05),
    "slow30": Scenario(router_model=RouterModel(prefill_scale=1.3), kv_event_lag_ms=50.0, engine_noise=0.05),
}


def table(reports: dict[str, ReplayReport], *, base: str, bound_tokens: float) -> None:
    print(
        f"{'run':<14}{'TTFT mean':>10}{'p50':>8}{'p90':>8}{'p99':>8}  {'p50/kv':>7}{'p99/kv':>7}"
        f"{'ITL p50':>9}{'e2e p50':>9}{'hit':>7}{'/bound':>7}{'wall s':>8}"
    )
    reference = reports[base].ttft_ms
    for name, report in reports.items():
        ttft = report.ttft_ms
        print(
            f"{name:<14}{ttft.mean:>10,.0f}{ttft.p50:>8,.0f}{ttft.p90:>8,.0f}{ttft.p99:>8,.0f}  "
            f"{ttft.p50 / reference.p50:>7.2f}{ttft.p99 / reference.p99:>7.2f}{report.itl_ms.p50:>9.1f}"
            f"{report.e2e_ms.p50:>9,.0f}{report.cache_hit_rate:>7.1%}"
            f"{report.cache_hit_rate / bound_tokens:>7.2f}{report.wall_s:>8.0f}"
        )


def margins(reports: dict[str, ReplayReport]) -> str:
    """``kv``'s TTFT margin over the best other policy, at p50 and p99 (>1: ``kv`` is faster)."""
    others = {name: r.ttft_ms for name, r in reports.items() if name != "kv"}
    kv = reports["kv"].ttft_ms
    best50 = min(others, key=lambda n: others[n].p50)
    best99 = min(others, key=lambda n: others[n].p99)
    return (
        f"p50 {others[best50].p50 / kv.p50:.2f}x (next best {best50}), "
        f"p99 {others[best99].p99 / kv.p99:.3f}x (next best {best99})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--speedups", default="6", help="Comma-separated arrival speedups.")
    parser.add_argument("--policies", default=",".join(ORDER))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="Comma-separated scenarios.")
    parser.add_argument("--decode-weights", default=None, help="Sweep kv's decode_weight instead.")
    parser.add_argument("--limit", type=int, default=None, help="Replay only the first N requests.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="Also write every report here.")
    args = parser.parse_args()
    inputs.require(args.trace)
    policies = args.policies.split(",")
    scenarios = args.scenarios.split(",")
    for names, known, what in ((policies, POLICIES, "policies"), (scenarios, SCENARIOS, "scenarios")):
        unknown = sorted(set(names) - set(known))
        if unknown:
            parser.error(f"unknown {what}: {', '.join(unknown)}")
    trace = load_trace(args.trace)[: args.limit]
    bound_blocks, bound_tokens = offline_bound(trace, trace_block_size=512)
    print(
        f"{args.trace.name}: {len(trace)} requests; offline bound: {bound_blocks:.1%} of blocks, "
        f"{bound_tokens:.1%} of prompt tokens"
    )
    everything: dict[str, list[dict[str, object]]] = {}
    summary: list[str] = []
    for speedup in (float(s) for s in args.speedups.split(",")):
        rate = len(trace) / (trace[-1].timestamp_ms / 1000 / speedup)
        base = ReplaySettings(workers=args.workers, speedup=speedup, seed=args.seed)
        if args.decode_weights is not None:
            measured = SCENARIOS["measured"].apply(base)
            runs = {
                f"kv w={weight}": dataclasses.replace(measured, decode_weight=float(weight))
                for weight in args.decode_weights.split(",")
            }
            runs["round_robin"] = dataclasses.replace(measured, policy="round_robin")
            reports = {}
            for name, settings in runs.items():
                reports[name] = replay(trace, settings)
                print(f"  x{speedup:g} {name}: {reports[name].wall_s:.0f} s", file=sys.stderr)
            print(f"\n{args.workers} workers, arrivals x{speedup:g} ({rate:.1f} req/s), decode_weight sweep")
            table(reports, base=next(iter(reports)), bound_tokens=bound_tokens)
            everything[f"{speedup:g}/decode_weight"] = [
                {"run": name, **report.as_json()} for name, report in reports.items()
            ]
            continue
        for scenario in scenarios:
            reports = {}
            for policy in policies:
                settings = SCENARIOS[scenario].apply(dataclasses.replace(base, policy=policy))
                reports[policy] = replay(trace, settings)
                print(
                    f"  x{speedup:g} {scenario}: {policy} in {reports[policy].wall_s:.0f} s", file=sys.stderr
                )
            print(f"\n{args.workers} workers, arrivals x{speedup:g} ({rate:.1f} req/s), scenario {scenario}")
            table(reports, base="kv" if "kv" in reports else policies[0], bound_tokens=bound_tokens)
            if "kv" in reports and len(reports) > 1:
                summary.append(
                    f"x{speedup:g} {scenario}: kv ahead of the best other policy by {margins(reports)}"
                )
            everything[f"{speedup:g}/{scenario}"] = [report.as_json() for report in reports.values()]
    if summary:
        print()
        print("\n".join(summary))
    if args.json is not None:
        args.json.write_text(json.dumps(everything, indent=2))


if __name__ == "__main__":
    main()
