"""LoRA adapters in the twin: adapter-aware, adapter-blind and round-robin routing, 16 mocked engines.

The router core and mocked engines on the virtual clock (``copse.sim.replay.Fleet``, the core the
HTTP router and the endpoint picker run; profile measured from the noisy engines, KV events 50 ms
late). Requests are the shipped 20-minute Mooncake conversation slice's, the first ``--minutes``,
arrivals sped up ``--speedup`` times. Every conversation (the requests sharing their first two
prefix blocks) goes through one of 8 adapters, drawn with Zipf(``--zipf``) popularity, seeded. Each engine
holds ``--max-loras`` adapters at once and takes ``--lora-load-ms`` to load one it does not hold
(the request waits, and so do those queued behind it); the router is told the same load time and
learns ``max_loras`` from each engine as it registers.

Three runs on the same arrivals:

- **aware**: ``kv`` with its defaults; a worker that does not hold the adapter costs the load time
  on top of its predicted time to first token (and one running ``max_loras`` other adapters is
  left out while another can start it);
- **blind**: ``kv`` with its defaults, the adapter counting only through the block hashes (an
  adapter's KV is its own) and the adapters-at-once limit;
- **round-robin**: the ``round_robin`` policy (the baseline ``kv`` must never be behind), with
  the same busy thresholds and adapters-at-once limit.

Printed side by side: the prefix cache hit rate (prompt tokens the engines found cached), TTFT
p50/p99/mean, ITL p50, end-to-end p50/p99, the adapter loads the engines did and loads per hour of simulated
time (live, also the engines' mean step lag behind their own timeline: whether the box kept up).

Then two router replicas (each request reaches one of them at random, seeded, as a Service spreads
connections), both adapter-aware, sharing their in-flight load: in the twin ``Fleet(replica_of=...)``,
its messages delivered at once; live (``--live``), two ``copse router run`` processes over the real
NATS server. They differ only in ``share_adapters`` (``AdapterRouting.shared``):

- **shared**: each replica mirrors the adapters its peer's requests load (the requests it shares
  carry their adapter), so both see every engine's adapter cache;
- **unshared**: each knows only the loads its own requests caused (what replicas did before
  adapter state was shared).

Usage: ``nice -n 10 .venv/bin/python benchmarks/lora_routing.py [--minutes 5] [--speedup 4] [--live]``
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import uvloop

from copse.router.adapters import AdapterRouting
from copse.router.metrics import ADAPTER_LOADS
from copse.sim.live import Answer, drive, live_fleet, mean_lag_ms, metric_total
from copse.sim.replay import EngineSetup, Fleet, ReplaySettings, RequestClass
from copse.sim.trace import TokenSynth, TraceRequest, load_trace
from copse.workers.metrics import MOCK_LORA_LOADS
from copse.workers.mocker import EngineConfig
from copse.workers.mocker.adapters import AdapterSettings
from inputs import SLICE, require

ADAPTERS = tuple(f"adapter-{k}" for k in range(8))


def zipf_classes(trace: Sequence[TraceRequest], *, exponent: float, seed: int) -> list[RequestClass]:
    """Each request's adapter: one per conversation (keyed by its first two prefix blocks: every
    request of the trace starts with the same block), drawn with probability proportional to
    ``1 / rank ** exponent``."""
    weights = 1.0 / np.arange(1, len(ADAPTERS) + 1) ** exponent
    weights /= weights.sum()
    chosen: dict[tuple[int, ...], str] = {}
    out = []
    for request in trace:
        key = request.hash_ids[:2]
        if key not in chosen:
            rng = np.random.default_rng([seed, *(h & 0xFFFF_FFFF for h in key)])
            chosen[key] = ADAPTERS[int(rng.choice(len(ADAPTERS), p=weights))]
        out.append(RequestClass(adapter=chosen[key]))
    return out


def run(
    trace: Sequence[TraceRequest],
    classes: Sequence[RequestClass],
    *,
    policy: str,
    aware: bool,
    seed: int,
    max_loras: int,
    load_ms: float,
    engines: int,
    shared: bool = True,
    replica_of: Sequence[int] | None = None,
) -> dict[str, float]:
    setup = EngineSetup(config=EngineConfig(adapters=AdapterSettings(max_loras=max_loras, load_ms=load_ms)))
    settings = ReplaySettings(
        policy=policy,
        workers=engines,
        seed=seed,
        engines=setup,
        # max_loras: each engine reports it
        adapters=AdapterRouting(load_ms=load_ms, aware=aware, shared=shared),
    )
    started = time.perf_counter()
    fleet = Fleet(trace, settings, engines=engines, classes=classes, replica_of=replica_of)
    for index in range(len(trace)):
        fleet.run_until(float(fleet.arrival_ms[index]))
        fleet.arrive(index)
    fleet.run()
    report = fleet.report(started=started, workers=engines)
    loads = sum(engine.adapters.loads_total for engine in fleet.engines)
    span_h = (float(np.nanmax(fleet.finish_ms)) - float(fleet.arrival_ms.min())) / 3_600_000.0
    return {
        "requests": float(report.requests),
        "failed": float(report.failed),
        "hit_rate": report.cache_hit_rate,
        "ttft_p50_ms": report.ttft_ms.p50,
        "ttft_p99_ms": report.ttft_ms.p99,
        "ttft_mean_ms": report.ttft_ms.mean,
        "itl_p50_ms": report.itl_ms.p50,
        "e2e_p50_ms": report.e2e_ms.p50,
        "e2e_p99_ms": report.e2e_ms.p99,
        "adapter_loads": float(loads),
        "loads_per_hour": loads / span_h,
        "router_predicted_loads": float(sum(router.adapters.loads for router in fleet.routers)),
        "simulated_s": span_h * 3600.0,
    }


def run_live(
    trace: Sequence[TraceRequest],
    classes: Sequence[RequestClass],
    *,
    policy: str,
    aware: bool,
    seed: int,
    max_loras: int,
    load_ms: float,
    engines: int,
    shared: bool = True,
    replica_of: Sequence[int] | None = None,
) -> dict[str, float]:
    """The same through real processes (``copse.sim.live``): ``engines`` mocked engines serving
    the adapters, ``copse router run`` told them (with ``replica_of``, two router replicas sharing
    their load over the real NATS server, the ``i``-th request sent to replica ``replica_of[i]``);
    each request streamed for its adapter."""
    settings = ReplaySettings(policy=policy, workers=engines, seed=seed)
    engine_args = [
        *(f"--lora={adapter}" for adapter in ADAPTERS),
        f"--max-loras={max_loras}",
        f"--lora-load-ms={load_ms}",
    ]
    router = {
        "loras": [{"name": adapter} for adapter in ADAPTERS],
        "max_loras": max_loras,
        "lora_load_ms": load_ms,
        "adapter_aware": aware,
        "share_adapters": shared,
    }
    synth = TokenSynth(seed=seed, trace_block_size=settings.trace_block_size)
    replicas = 1 if replica_of is None else 2

    async def go() -> tuple[list[Answer], float, float, float]:
        async with live_fleet(settings, router=router, engine_args=engine_args, replicas=replicas) as fleet:
            models = [kind.adapter for kind in classes]
            answers = await drive(fleet.targets(replica_of), trace, speedup=1.0, synth=synth, models=models)
            pages = [f"{url}/prometheus/metrics" for url in fleet.engine_urls]
            loads = await metric_total(pages, f"{MOCK_LORA_LOADS}_total")
            admin = [f"{url}/metrics" for url in fleet.admin_urls]
            predicted = await metric_total(admin, f"{ADAPTER_LOADS}_total")
            lag_ms = await mean_lag_ms(fleet.engine_urls)
        return answers, loads, predicted, lag_ms

    answers, loads, predicted, lag_ms = uvloop.run(go())
    arrival = np.array([request.timestamp_ms for request in trace])
    prompts = np.array([float(request.input_length) for request in trace])
    ttft, itl, e2e = (
        np.array([getattr(a, key) for a in answers]) * 1000.0 for key in ("ttft_s", "itl_s", "e2e_s")
    )
    cached = np.array([float(a.cached) for a in answers])
    done = ~np.isnan(e2e)
    span_h = (float(np.nanmax(arrival + e2e)) - float(arrival.min())) / 3_600_000.0
    return {
        "requests": float(done.sum()),
        "failed": float((~done).sum()),
        "hit_rate": float(cached[done].sum() / prompts[done].sum()),
        "ttft_p50_ms": float(np.percentile(ttft[done], 50)),
        "ttft_p99_ms": float(np.percentile(ttft[done], 99)),
        "ttft_mean_ms": float(ttft[done].mean()),
        "itl_p50_ms": float(np.nanpercentile(itl[done], 50)),
        "e2e_p50_ms": float(np.percentile(e2e[done], 50)),
        "e2e_p99_ms": float(np.percentile(e2e[done], 99)),
        "adapter_loads": loads,
        "loads_per_hour": loads / span_h,
        "router_predicted_loads": predicted,
        "simulated_s": span_h * 3600.0,
        "engine_lag_ms": lag_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="Minutes of the slice replayed.")
    parser.add_argument("--speedup", type=float, default=4.0, help="Arrivals come this many times faster.")
    parser.add_argument("--zipf", type=float, default=1.1, help="Exponent of the adapters' popularity.")
    parser.add_argument("--max-loras", type=int, default=2, help="Adapters an engine holds at once.")
    parser.add_argument("--lora-load-ms", type=float, default=200.0, help="Time to load an adapter.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--live",
        action="store_true",
        help="Through real processes: mocked engines and the router in HTTP mode, in wall time.",
    )
    parser.add_argument("--engines", type=int, default=None, help="Mocked engines (16; live: 4).")
    args = parser.parse_args()
    engines = args.engines or (4 if args.live else 16)
    whole = load_trace(require(SLICE))
    trace = [
        dataclasses.replace(r, timestamp_ms=r.timestamp_ms / args.speedup)
        for r in whole
        if r.timestamp_ms < args.minutes * 60_000.0
    ]
    classes = zipf_classes(trace, exponent=args.zipf, seed=args.seed)
    shares = {name: sum(c.adapter == name for c in classes) / len(classes) for name in ADAPTERS}
    print(
        f"{len(trace)} requests over {args.minutes:g} min / {args.speedup:g} "
        f"({len(trace) / (args.minutes * 60.0 / args.speedup):.1f} req/s), {engines} engines "
        f"({'live' if args.live else 'twin'}), max_loras "
        f"{args.max_loras}, load {args.lora_load_ms:g} ms, seed {args.seed}; adapter shares "
        + " ".join(f"{share:.2f}" for share in shares.values())
    )
    modes = {"aware": ("kv", True), "blind": ("kv", False), "round-robin": ("round_robin", False)}
    runner = (
        functools.partial(run_live, engines=engines) if args.live else functools.partial(run, engines=engines)
    )
    results: dict[str, dict[str, float]] = {}
    for mode, (policy, adapter_aware) in modes.items():
        load = os.getloadavg()[0]
        results[mode] = runner(
            trace,
            classes,
            policy=policy,
            aware=adapter_aware,
            seed=args.seed,
            max_loras=args.max_loras,
            load_ms=args.lora_load_ms,
        )
        print(f"  {mode}: load average {load:.2f} before, {os.getloadavg()[0]:.2f} after", file=sys.stderr)
    aware, blind, rr = results["aware"], results["blind"], results["round-robin"]
    print(f"{'measure':<24}{'aware':>14}{'blind':>14}{'round-robin':>14}{'aware/blind':>14}{'aware/rr':>14}")
    for key in aware:
        ratios = [aware[key] / other[key] if other[key] else float("nan") for other in (blind, rr)]
        print(
            f"{key:<24}{aware[key]:>14,.3f}{blind[key]:>14,.3f}{rr[key]:>14,.3f}"
            f"{ratios[0]:>14.3f}{ratios[1]:>14.3f}"
        )
    replica_of = np.random.default_rng([args.seed, 2]).integers(0, 2, size=len(trace)).tolist()
    two = {
        mode: runner(
            trace,
            classes,
            policy="kv",
            aware=True,
            shared=mode == "shared",
            replica_of=replica_of,
            seed=args.seed,
            max_loras=args.max_loras,
            load_ms=args.lora_load_ms,
        )
        for mode in ("shared", "unshared")
    }
    print(f"two replicas, adapter-aware; requests per replica {replica_of.count(0)} / {replica_of.count(1)}")
    shared, unshared = two["shared"], two["unshared"]
    print(f"{'two replicas':<24}{'shared':>14}{'unshared':>14}{'shared/unshared':>18}")
    for key, value in shared.items():
        ratio = value / unshared[key] if unshared[key] else float("nan")
        print(f"{key:<24}{value:>14,.3f}{unshared[key]:>14,.3f}{ratio:>18.3f}")


if __name__ == "__main__":
    main()
