"""Routing policies compared on the Mooncake conversation trace: 16 mocked engines, every policy
replaying the same trace at the same load in one run (discrete-event simulation, same seed).

Prints, per load (arrival speedup), each policy's TTFT (mean/p50/p90/p99), ITL p50, e2e p50 and
prefix-cache hit rate, the ratio of each policy's TTFT to the ``kv`` policy's (>1: ``kv`` is
faster), and the hit rate against the trace's offline bound (one infinite cache seeing every
request in order: the first sight of a block always misses).

Usage: ``.venv/bin/python benchmarks/router_policies.py [--speedups 4,6] [--workers 16] [--json FILE]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from copse.router.policies import POLICIES
from copse.sim.replay import ReplayReport, ReplaySettings, replay
from copse.sim.trace import TraceRequest, load_trace

TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake_fast25_conversation_trace.jsonl.gz"
ORDER = ["kv", "dynamo", "prefix_only", "least_loaded", "round_robin", "random"]


def offline_bound(trace: list[TraceRequest], block_size: int) -> tuple[float, float]:
    """(block hit rate, token hit rate) of one infinite prefix cache over the whole trace."""
    seen: set[int] = set()
    blocks = hit_blocks = tokens = hit_tokens = 0
    for request in trace:
        for position, block in enumerate(request.hash_ids):
            size = min(block_size, request.input_length - position * block_size)
            blocks += 1
            tokens += size
            if block in seen:
                hit_blocks += 1
                hit_tokens += size
            seen.add(block)
    return hit_blocks / blocks, hit_tokens / tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--speedups", default="6", help="Comma-separated arrival speedups.")
    parser.add_argument("--policies", default=",".join(ORDER))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="Also write every report here.")
    args = parser.parse_args()
    policies = args.policies.split(",")
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        parser.error(f"unknown policies: {', '.join(unknown)}")
    trace = load_trace(args.trace)
    bound_blocks, bound_tokens = offline_bound(trace, 512)
    print(
        f"{args.trace.name}: {len(trace)} requests; offline bound: {bound_blocks:.1%} of blocks, "
        f"{bound_tokens:.1%} of prompt tokens"
    )
    everything: dict[str, list[dict[str, object]]] = {}
    for speedup in (float(s) for s in args.speedups.split(",")):
        reports: dict[str, ReplayReport] = {}
        for policy in policies:
            settings = ReplaySettings(policy=policy, workers=args.workers, speedup=speedup, seed=args.seed)
            reports[policy] = replay(trace, settings)
            print(f"  speedup {speedup:g}: {policy} done in {reports[policy].wall_s:.0f} s", file=sys.stderr)
        base = reports.get("kv")
        rate = len(trace) / (trace[-1].timestamp_ms / 1000 / speedup)
        print(f"\n{args.workers} workers, arrivals x{speedup:g} ({rate:.1f} req/s)")
        print(
            f"{'policy':<13}{'TTFT mean':>10}{'p50':>8}{'p90':>8}{'p99':>8}  {'p50/kv':>7}{'p99/kv':>7}"
            f"{'ITL p50':>9}{'e2e p50':>9}{'hit':>7}{'/bound':>7}{'wall s':>8}"
        )
        for policy, report in reports.items():
            ttft = report.ttft_ms
            ratio50 = ttft.p50 / base.ttft_ms.p50 if base else float("nan")
            ratio99 = ttft.p99 / base.ttft_ms.p99 if base else float("nan")
            print(
                f"{policy:<13}{ttft.mean:>10,.0f}{ttft.p50:>8,.0f}{ttft.p90:>8,.0f}{ttft.p99:>8,.0f}  "
                f"{ratio50:>7.2f}{ratio99:>7.2f}{report.itl_ms.p50:>9.1f}{report.e2e_ms.p50:>9,.0f}"
                f"{report.cache_hit_rate:>7.1%}{report.cache_hit_rate / bound_tokens:>7.2f}"
                f"{report.wall_s:>8.0f}"
            )
        everything[f"{speedup:g}"] = [report.as_json() for report in reports.values()]
    if args.json is not None:
        args.json.write_text(json.dumps(everything, indent=2))


if __name__ == "__main__":
    main()
