"""Expert-blind ``kv`` against expert-aware ``kv_expert`` routing on a synthetic Mixture-of-Experts
workload, with and without expert rebalancing, every row in one run on the same trace and seed.

Workload (``copse bench moe-workload``): four request classes (40/30/20/10 %), each with its own
four-block system prompt, so to the mocked DeepSeek-V3 (256 experts, top-8, hidden 7168, 58 MoE
layers, skewed popularity) its own expert preferences; 30 % follow-up turns; Poisson arrivals.
Engines (``examples/moe``): 8 DEP32 groups inside NVL72 domains (NVLink 5 all-to-all), experts in
contiguous blocks per rank (``static``) or with one redundant slot per rank and the online load
balancer re-placing them every 58 steps (``eplb``).

Rows: ``kv`` (time to first token only, the default), ``kv`` with ``--decode-weight 1`` (also the
request's dense decode time: what load-awareness alone gives), ``kv_expert`` (time to first token
plus the request's decode time with its expected experts' slowest-rank stretch and all-to-all),
and ``kv_expert`` without engine expert reports (the ablation: the same cost, every request
expected to use the experts alike). Every router gets the same KV events and engine reports; the
expert-blind ones ignore the expert reports.

By default the routers work as ``copse bench replay``'s do: with a profile measured from the engines
(for these engines it holds their MoE stretch and all-to-all; ``kv_expert`` stretches its balanced
twin, the same steps less the MoE terms the engines report), KV events 50 ms late, 5 % step noise;
``--oracle`` hands them the engines' exact model, events at the end of each step, no noise.

Usage: ``.venv/bin/python benchmarks/moe_routing.py [--requests 3000] [--rate 20] [--workers 8] [--oracle]``
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from copse.sim.moe import MoeWorkload, generate, write_jsonl
from copse.sim.replay import ReplayReport, ReplaySettings, RouterModel, load_engine_setup, replay
from copse.sim.trace import load_trace

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "moe"
ROWS = (
    ("kv", {"policy": "kv"}),
    ("kv --objective ttft --decode-weight 1", {"policy": "kv", "objective": "ttft", "decode_weight": 1.0}),
    ("kv_expert", {"policy": "kv_expert"}),
    ("kv_expert --no-expert-reports", {"policy": "kv_expert", "expert_reports": False}),
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--oracle", action="store_true", help="The engines' exact model, no event lag, no step noise."
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "moe.jsonl"
        with path.open("w") as handle:
            write_jsonl(generate(MoeWorkload(requests=args.requests, rate=args.rate, seed=args.seed)), handle)
        trace = load_trace(path)
    print(
        "| engines | policy | ITL mean ms | ITL p99 ms | TTFT mean ms | TTFT p99 ms | output tok/s | "
        "hit rate | all-to-all MB/token | hottest rank / mean | MoE share of step | re-placements |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    baseline: ReplayReport | None = None
    for engines in ("static", "eplb"):
        setup = load_engine_setup(EXAMPLES / f"engine-{engines}.yaml")
        for label, knobs in ROWS:
            base = ReplaySettings(workers=args.workers, seed=args.seed, engines=setup)
            if args.oracle:
                base = dataclasses.replace(
                    base, router_model=RouterModel(source="exact"), kv_event_lag_ms=0.0, engine_noise=0.0
                )
            settings = dataclasses.replace(base, **knobs)
            report = replay(trace, settings)
            baseline = baseline or report
            moe = report.moe
            assert moe is not None
            itl, ttft = report.itl_ms, report.ttft_ms
            cells = [
                engines,
                label,
                f"{itl.mean:.2f} ({itl.mean / baseline.itl_ms.mean:.2f}x)",
                f"{itl.p99:.2f}",
                f"{ttft.mean:.1f} ({ttft.mean / baseline.ttft_ms.mean:.2f}x)",
                f"{ttft.p99:.1f}",
                f"{report.throughput_tok_s:,.0f}",
                f"{report.cache_hit_rate:.1%}",
                f"{moe.all_to_all_bytes_per_token / 1e6:.1f}",
                f"{moe.imbalance:.3f}",
                f"{moe.moe_share:.1%}",
                str(moe.rebalances),
            ]
            print("| " + " | ".join(cells) + " |", flush=True)
    print(f"\n{args.requests} requests at {args.rate}/s, {args.workers} DEP32 engines; ratios to kv, static")


if __name__ == "__main__":
    main()
