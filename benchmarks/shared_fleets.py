"""Shared fleets in the twin: priorities and tenant fairness on 16 mocked engines above capacity.

The router core and mocked engines on the virtual clock (``copse.sim.replay.Fleet``, the same
core the HTTP router and the endpoint picker run; profile measured from the noisy engines, KV
events 50 ms late). Request shapes (prompt, output, prefix hash ids) are the Mooncake conversation
trace's, in order, leaving out prompts over ``--max-prompt`` tokens (their prefill alone takes
most of a TTFT target); arrivals are Poisson at the rate asked. A request meets its SLO when its
time to first token and its mean inter-token gap are within its class's targets; goodput is the
output tokens per second of the requests that meet it; a shed request (the router's 429) and a
refused one count as misses.

1. Capacity: the fleet's completions per second while a 3x-overloaded queue never empties.
2. Priorities, ``--minutes`` at ``--load`` x capacity, the same arrivals twice: 20 % premium
   (priority 100, TTFT target ``--premium-ttft-ms``) and 80 % batch (priority 0, ``--batch-ttft-ms``);
   once with no objectives (one class, no TTFT target: the router only queues, and refuses when
   its queue is full), once with them. Prints per class attainment, shed and goodput.
3. Fairness: two tenants of equal weight, the heavy one sending 10x the light one's rate, together
   ``--fair-load`` x capacity for ``--fair-minutes``, every request of the default objective with
   the batch TTFT target: the light tenant's TTFT p99 against its solo run at its own rate, and
   Jain's index of the tenants' token throughput (prompt + output tokens completed per second).
   With ``--fair-light-share`` >= 0.5 both tenants are backlogged. With ``--fair-replicas``, the
   shared run again through two router replicas, 80 % of the light tenant's requests at the first
   and 80 % of the heavy tenant's at the second.

Usage: ``.venv/bin/python benchmarks/shared_fleets.py [--minutes 10] [--load 1.5] [--seed 0]``
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from copse.router.core import Thresholds
from copse.sim.replay import Fleet, ReplaySettings, RequestClass
from copse.sim.trace import TraceRequest, load_trace

TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake_fast25_conversation_trace.jsonl.gz"
ITL_TARGET_MS = 100.0
"""Mean inter-token gap every class must meet."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One replay's per-request times (ms, NaN where it did not happen) and classes."""

    fleet: Fleet
    classes: Sequence[RequestClass]
    duration_s: float

    def of(self, mask: npt.NDArray[np.bool_], *, ttft_target_ms: float) -> dict[str, float]:
        fleet = self.fleet
        ttft = fleet.first_ms - fleet.arrival_ms
        outputs = fleet.outputs
        with np.errstate(invalid="ignore", divide="ignore"):
            itl = np.where(outputs > 1, (fleet.finish_ms - fleet.first_ms) / (outputs - 1), 0.0)
        done = ~np.isnan(fleet.finish_ms)
        met = done & (ttft <= ttft_target_ms) & (itl <= ITL_TARGET_MS)
        shed = ~np.isnan(fleet.shed_ms)
        refused = ~np.isnan(fleet.failed_ms) & ~shed
        tokens = fleet.prompts + outputs
        completed_ttft = ttft[mask & done]
        return {
            "requests": float(mask.sum()),
            "attainment": float((met & mask).sum() / max(mask.sum(), 1)),
            "ttft_attainment": float((done & (ttft <= ttft_target_ms) & mask).sum() / max(mask.sum(), 1)),
            "shed": float((shed & mask).sum()),
            "refused_not_429": float((refused & mask).sum()),
            "admitted_not_finished": float((mask & ~done & ~shed & ~refused).sum()),
            "goodput_tok_s": float(outputs[met & mask].sum() / self.duration_s),
            "throughput_tok_s": float(tokens[done & mask].sum() / self.duration_s),
            "ttft_p50_ms": float(np.percentile(completed_ttft, 50)) if len(completed_ttft) else float("nan"),
            "ttft_p99_ms": float(np.percentile(completed_ttft, 99)) if len(completed_ttft) else float("nan"),
        }


def shapes(limit_tokens: int) -> list[TraceRequest]:
    return [request for request in load_trace(TRACE) if request.input_length <= limit_tokens]


def arrivals(
    pool: Sequence[TraceRequest], *, rate: float, seconds: float, seed: int, offset: int = 0
) -> list[TraceRequest]:
    """Poisson arrivals at ``rate`` for ``seconds``, shapes taken from ``pool`` in order from
    ``offset`` (another pass over the pool gets hash ids of its own: no reuse across passes)."""
    rng = np.random.default_rng(seed)
    out: list[TraceRequest] = []
    t = 0.0
    i = offset
    while True:
        t += float(rng.exponential(1000.0 / rate))
        if t > seconds * 1000.0:
            return out
        shape = pool[i % len(pool)]
        shift = (i // len(pool)) << 40
        out.append(
            dataclasses.replace(shape, timestamp_ms=t, hash_ids=tuple(h + shift for h in shape.hash_ids))
        )
        i += 1


def run(
    trace: Sequence[TraceRequest],
    classes: Sequence[RequestClass] | None,
    *,
    seed: int,
    seconds: float,
    thresholds: Thresholds | None = None,
    replica_of: Sequence[int] | None = None,
) -> Outcome:
    settings = ReplaySettings(workers=16, seed=seed, thresholds=thresholds or Thresholds())
    fleet = Fleet(trace, settings, engines=16, classes=classes, replica_of=replica_of)
    for index in range(len(trace)):
        fleet.run_until(float(fleet.arrival_ms[index]))
        fleet.arrive(index)
    fleet.run()
    default = [RequestClass()] * len(trace)
    return Outcome(fleet=fleet, classes=classes or default, duration_s=seconds)


def capacity(pool: Sequence[TraceRequest], *, seed: int, start: float, step: float) -> float:
    """The highest arrival rate (``start``, ``start + step``, ...) the fleet keeps up with for
    120 s: it completes at least 95 % of the arrival rate between 30 s and 120 s and the median
    TTFT stays below 1 s (offered more, the fleet falls behind and its throughput even drops:
    the queue fills and KV pressure grows, so the rate a saturated fleet completes is no measure)."""
    rate, best = start, 0.0
    while True:
        trace = arrivals(pool, rate=rate, seconds=120.0, seed=seed)
        fleet = run(trace, None, seed=seed, seconds=120.0).fleet
        finish = fleet.finish_ms
        completed = float(((finish >= 30_000) & (finish < 120_000)).sum() / 90.0)
        ttft_p50 = float(np.nanpercentile(fleet.first_ms - fleet.arrival_ms, 50))
        print(
            f"  probe {rate:.0f} req/s: completes {completed:.1f} req/s, TTFT p50 {ttft_p50:,.0f} ms",
            file=sys.stderr,
        )
        if completed < 0.95 * rate or ttft_p50 > 1000.0:
            return best
        best, rate = rate, rate + step


def merge(
    parts: Sequence[tuple[list[TraceRequest], RequestClass]],
) -> tuple[list[TraceRequest], list[RequestClass]]:
    tagged = sorted(
        ((request, kind) for trace, kind in parts for request in trace), key=lambda pair: pair[0].timestamp_ms
    )
    return [request for request, _ in tagged], [kind for _, kind in tagged]


def jain(values: Sequence[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def show(name: str, figures: dict[str, float]) -> None:
    print(
        f"  {name:<10} n={figures['requests']:>7,.0f} within SLO {figures['attainment']:6.1%} "
        f"(TTFT alone {figures['ttft_attainment']:6.1%})  "
        f"shed(429) {figures['shed']:>6,.0f}  refused(other) {figures['refused_not_429']:>3,.0f}  "
        f"admitted-not-finished {figures['admitted_not_finished']:>2,.0f}  "
        f"goodput {figures['goodput_tok_s']:>8,.0f} tok/s  "
        f"TTFT p50 {figures['ttft_p50_ms']:>8,.0f} p99 {figures['ttft_p99_ms']:>8,.0f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--load", type=float, default=1.5)
    parser.add_argument("--premium-ttft-ms", type=float, default=3000.0)
    parser.add_argument("--batch-ttft-ms", type=float, default=30000.0)
    parser.add_argument("--max-prompt", type=int, default=32768)
    parser.add_argument("--fair-minutes", type=float, default=3.0)
    parser.add_argument("--fair-load", type=float, default=1.5)
    parser.add_argument(
        "--fair-light-share", type=float, default=1 / 11, help="Light tenant's share of --fair-load."
    )
    parser.add_argument("--capacity", type=float, default=None, help="Skip the probe: requests/s.")
    parser.add_argument("--skip", default="", help="Comma-separated: priorities, fairness.")
    parser.add_argument(
        "--fair-busy-prefill-tokens",
        type=float,
        default=Thresholds().busy_prefill_tokens,
        help="Router busy threshold of the fairness runs (lower: the router's queue orders more).",
    )
    parser.add_argument(
        "--premium-itl-guard",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Give the premium objective the ITL target (itl_ms): lower priorities stay off the "
        "workers where premium decodes while they would lengthen its steps past it.",
    )
    parser.add_argument(
        "--fair-busy-kv-fraction",
        type=float,
        default=Thresholds().busy_kv_fraction,
        help="Router KV busy threshold of the fairness runs (lower: smaller decode batches, more "
        "waiting in the router's fair queue).",
    )
    parser.add_argument(
        "--fair-replicas",
        action="store_true",
        help="Fairness also through two router replicas sharing load, each tenant's traffic split 80/20.",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    pool = shapes(args.max_prompt)
    seed = args.seed
    cap = args.capacity or capacity(pool, seed=seed, start=30.0, step=5.0)
    print(
        f"capacity of 16 engines on conversation shapes <= {args.max_prompt} tokens: "
        f"{cap:.1f} req/s (seed {seed})"
    )
    skip = set(args.skip.split(","))
    if "priorities" not in skip:
        seconds = args.minutes * 60.0
        rate = args.load * cap
        premium = RequestClass(
            objective="premium",
            priority=100,
            ttft_slo_ms=args.premium_ttft_ms,
            itl_slo_ms=ITL_TARGET_MS if args.premium_itl_guard else None,
        )
        batch = RequestClass(objective="batch", priority=0, ttft_slo_ms=args.batch_ttft_ms)
        trace = arrivals(pool, rate=rate, seconds=seconds, seed=seed)
        rng = np.random.default_rng(seed + 1)
        kinds = [premium if p else batch for p in rng.random(len(trace)) < 0.2]
        print(
            f"\npriorities: {len(trace):,} requests in {seconds:.0f} s at {rate:.1f} req/s "
            f"({args.load:g}x capacity)"
        )
        plain = run(trace, [RequestClass()] * len(trace), seed=seed, seconds=seconds)
        classed = run(trace, kinds, seed=seed, seconds=seconds)
        is_premium = np.array([kind is premium for kind in kinds])
        totals = {}
        for name, outcome in (("no objectives", plain), ("premium/batch objectives", classed)):
            print(f" {name}:")
            premium_figures = outcome.of(is_premium, ttft_target_ms=args.premium_ttft_ms)
            batch_figures = outcome.of(~is_premium, ttft_target_ms=args.batch_ttft_ms)
            show("premium", premium_figures)
            show("batch", batch_figures)
            totals[name] = premium_figures["goodput_tok_s"] + batch_figures["goodput_tok_s"]
            print(f"  total goodput {totals[name]:,.0f} tok/s")
        ratio = totals["premium/batch objectives"] / totals["no objectives"]
        print(f" goodput with objectives / without: {ratio:.3f}")
    if "fairness" not in skip:
        seconds = args.fair_minutes * 60.0
        light_rate = args.fair_load * cap * args.fair_light_share
        heavy_rate = 10 * light_rate
        target = RequestClass(ttft_slo_ms=args.batch_ttft_ms)
        light = dataclasses.replace(target, tenant="light")
        heavy = dataclasses.replace(target, tenant="heavy")
        light_trace = arrivals(pool, rate=light_rate, seconds=seconds, seed=seed)
        heavy_trace = arrivals(pool, rate=heavy_rate, seconds=seconds, seed=seed + 7, offset=len(pool) // 2)
        print(
            f"\nfairness: light {light_rate:.1f} req/s, heavy {heavy_rate:.1f} req/s "
            f"({(light_rate + heavy_rate) / cap:.2f}x capacity) for {seconds:.0f} s"
        )
        busy = Thresholds(
            busy_prefill_tokens=args.fair_busy_prefill_tokens, busy_kv_fraction=args.fair_busy_kv_fraction
        )
        print(
            f" router busy thresholds {busy.busy_prefill_tokens:,.0f} prefill tokens per engine, "
            f"{busy.busy_kv_fraction:g} of its KV"
        )
        solo = run(light_trace, [light] * len(light_trace), seed=seed, seconds=seconds, thresholds=busy)
        trace, kinds = merge([(light_trace, light), (heavy_trace, heavy)])
        shared = run(trace, kinds, seed=seed, seconds=seconds, thresholds=busy)
        is_light = np.array([kind is light for kind in kinds])
        solo_figures = solo.of(np.ones(len(light_trace), dtype=bool), ttft_target_ms=args.batch_ttft_ms)
        light_figures = shared.of(is_light, ttft_target_ms=args.batch_ttft_ms)
        heavy_figures = shared.of(~is_light, ttft_target_ms=args.batch_ttft_ms)
        show("light alone", solo_figures)
        runs = [("one router", light_figures, heavy_figures)]
        if args.fair_replicas:
            # Two router replicas: 80 % of the light tenant's requests reach the first, 80 % of the
            # heavy tenant's the second (Dynamo #15187's uneven split).
            rng = np.random.default_rng(seed + 3)
            first = rng.random(len(trace)) < np.where(is_light, 0.8, 0.2)
            replica_of = (~first).astype(int).tolist()
            split = run(trace, kinds, seed=seed, seconds=seconds, thresholds=busy, replica_of=replica_of)
            light_split = split.of(is_light, ttft_target_ms=args.batch_ttft_ms)
            heavy_split = split.of(~is_light, ttft_target_ms=args.batch_ttft_ms)
            runs.append(("two replicas 80/20", light_split, heavy_split))
        for name, light_shared, heavy_shared in runs:
            print(f" {name}:")
            show("light, shared", light_shared)
            show("heavy, shared", heavy_shared)
            ratio = light_shared["ttft_p99_ms"] / solo_figures["ttft_p99_ms"]
            print(f"  light TTFT p99 shared / solo: {ratio:.3f}")
            throughputs = [light_shared["throughput_tok_s"], heavy_shared["throughput_tok_s"]]
            print(
                f"  token throughput light {throughputs[0]:,.0f}, heavy {throughputs[1]:,.0f} tok/s; "
                f"Jain's index {jain(throughputs):.3f} (meaningful when both are backlogged)"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
