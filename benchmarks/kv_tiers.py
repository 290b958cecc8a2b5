"""KV cache tiers on the Mooncake conversation trace: 16 mocked engines with and without a host-memory
tier 4x their GPU KV cache (``examples/engine-host-tier.yaml``), each routing policy replaying the
same trace at the same load (discrete-event simulation, same seed, ``copse bench replay``'s
measured setting: a profile measured from the noisy engines, KV events 50 ms late).

Prints per policy and engine setup the TTFT p50/p99, the prefix-cache hit rate (prompt tokens the
engines found cached on any tier), that hit rate as a share of the trace's offline bound (one
infinite cache), and the share of prompt tokens onboarded from host memory; then each policy's
gain from the host tier and each policy's ratio to ``kv`` with it.

Usage: ``.venv/bin/python benchmarks/kv_tiers.py [--speedup 6] [--workers 16] [--limit N]
[--policies kv,dynamo,prefix_only,round_robin] [--json FILE]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import inputs
from copse.sim.replay import ReplayReport, ReplaySettings, load_engine_setup, replay
from copse.sim.trace import load_trace, offline_bound

TRACE = inputs.CONVERSATION
HOST_TIER = Path(__file__).resolve().parents[1] / "examples/engine-host-tier.yaml"
SETUPS = {"GPU only": None, "host tier 4x": HOST_TIER}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--speedup", type=float, default=6.0)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--policies", default="kv,dynamo,prefix_only,round_robin")
    parser.add_argument("--json", type=Path, default=None, help="Write every report here.")
    args = parser.parse_args()
    inputs.require(args.trace)
    trace = load_trace(args.trace, fmt="mooncake")
    if args.limit:
        trace = trace[: args.limit]
    _, bound = offline_bound(trace, trace_block_size=512)
    print(
        f"{args.trace.name}: {len(trace)} requests, x{args.speedup:g}, {args.workers} engines; "
        f"offline bound {bound:.1%} of prompt tokens"
    )
    reports: dict[tuple[str, str], ReplayReport] = {}
    for setup, path in SETUPS.items():
        engines = load_engine_setup(path)
        for policy in args.policies.split(","):
            settings = ReplaySettings(
                policy=policy, workers=args.workers, speedup=args.speedup, engines=engines
            )
            report = replay(trace, settings)
            reports[policy, setup] = report
            print(f"  {policy:<12} {setup:<13} done in {report.wall_s:.0f} s", file=sys.stderr)
    print()
    print("| policy | engines | TTFT p50 ms | TTFT p99 ms | hit | hit / bound | from host |")
    print("|---|---|---|---|---|---|---|")
    for (policy, setup), report in reports.items():
        host = report.offload.host_hit_rate if report.offload is not None else 0.0
        print(
            f"| {policy} | {setup} | {report.ttft_ms.p50:,.0f} | {report.ttft_ms.p99:,.0f} | "
            f"{report.cache_hit_rate:.1%} | {report.cache_hit_rate / bound:.2f} | {host:.1%} |"
        )
    print()
    print(
        "| policy | hit gain from the host tier | TTFT p50 with / without | TTFT p99 with / without | "
        "p50 / kv (host tier) | p99 / kv (host tier) |"
    )
    print("|---|---|---|---|---|---|")
    policies = args.policies.split(",")
    kv = reports.get(("kv", "host tier 4x"))
    for policy in policies:
        without, with_tier = reports[policy, "GPU only"], reports[policy, "host tier 4x"]
        vs_kv = (
            f"{with_tier.ttft_ms.p50 / kv.ttft_ms.p50:.2f} | {with_tier.ttft_ms.p99 / kv.ttft_ms.p99:.3f}"
            if kv is not None
            else "- | -"
        )
        p50 = with_tier.ttft_ms.p50 / without.ttft_ms.p50
        p99 = with_tier.ttft_ms.p99 / without.ttft_ms.p99
        gain = with_tier.cache_hit_rate - without.cache_hit_rate
        print(f"| {policy} | {gain:+.1%} | {p50:.2f} | {p99:.3f} | {vs_kv} |")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    f"{policy}/{setup}": dataclasses.asdict(report)
                    for (policy, setup), report in reports.items()
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
