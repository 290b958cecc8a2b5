"""LoRA adapters in the twin: adapter-aware against adapter-blind routing, 16 mocked engines.

The router core and mocked engines on the virtual clock (``copse.sim.replay.Fleet``, the core the
HTTP router and the endpoint picker run; profile measured from the noisy engines, KV events 50 ms
late). Requests are the shipped 20-minute Mooncake conversation slice's, the first ``--minutes``,
arrivals sped up ``--speedup`` times. Every conversation (the requests sharing their first two
prefix blocks) goes through one of 8 adapters, drawn with Zipf(``--zipf``) popularity, seeded. Each engine
holds ``--max-loras`` adapters at once and takes ``--lora-load-ms`` to load one it does not hold
(the request waits, and so do those queued behind it); the router is told the same load time and
learns ``max_loras`` from each engine as it registers.

Both runs use ``kv`` with its defaults on the same arrivals; they differ only in
``AdapterRouting.aware``:

- **aware**: a worker that does not hold the adapter costs the load time on top of its predicted
  time to first token (and one running ``max_loras`` other adapters is left out while another can
  start it);
- **blind**: the adapter counts only through the block hashes (an adapter's KV is its own) and the
  adapters-at-once limit.

Printed side by side: the prefix cache hit rate (prompt tokens the engines found cached), TTFT
p50/p99/mean, end-to-end p50, the adapter loads the engines did and loads per hour of simulated
time.

Then two router replicas (``Fleet(replica_of=...)``: each request reaches one of them at random,
seeded, as a Service spreads connections), both adapter-aware, sharing their in-flight load as
over NATS; they differ only in ``AdapterRouting.shared``:

- **shared**: each replica mirrors the adapters its peer's requests load (the requests it shares
  carry their adapter), so both see every engine's adapter cache;
- **unshared**: each knows only the loads its own requests caused (what replicas did before
  adapter state was shared).

Usage: ``nice -n 10 .venv/bin/python benchmarks/lora_routing.py [--minutes 5] [--speedup 4]``
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

from copse.router.adapters import AdapterRouting
from copse.sim.replay import EngineSetup, Fleet, ReplaySettings, RequestClass
from copse.sim.trace import TraceRequest, load_trace
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
    aware: bool,
    seed: int,
    max_loras: int,
    load_ms: float,
    shared: bool = True,
    replica_of: Sequence[int] | None = None,
) -> dict[str, float]:
    engines = EngineSetup(config=EngineConfig(adapters=AdapterSettings(max_loras=max_loras, load_ms=load_ms)))
    settings = ReplaySettings(
        workers=16,
        seed=seed,
        engines=engines,
        # max_loras: each engine reports it
        adapters=AdapterRouting(load_ms=load_ms, aware=aware, shared=shared),
    )
    started = time.perf_counter()
    fleet = Fleet(trace, settings, engines=16, classes=classes, replica_of=replica_of)
    for index in range(len(trace)):
        fleet.run_until(float(fleet.arrival_ms[index]))
        fleet.arrive(index)
    fleet.run()
    report = fleet.report(started=started, workers=16)
    loads = sum(engine.adapters.loads_total for engine in fleet.engines)
    span_h = (float(np.nanmax(fleet.finish_ms)) - float(fleet.arrival_ms.min())) / 3_600_000.0
    return {
        "requests": float(report.requests),
        "failed": float(report.failed),
        "hit_rate": report.cache_hit_rate,
        "ttft_p50_ms": report.ttft_ms.p50,
        "ttft_p99_ms": report.ttft_ms.p99,
        "ttft_mean_ms": report.ttft_ms.mean,
        "e2e_p50_ms": report.e2e_ms.p50,
        "adapter_loads": float(loads),
        "loads_per_hour": loads / span_h,
        "router_predicted_loads": float(sum(router.adapters.loads for router in fleet.routers)),
        "simulated_s": span_h * 3600.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="Minutes of the slice replayed.")
    parser.add_argument("--speedup", type=float, default=4.0, help="Arrivals come this many times faster.")
    parser.add_argument("--zipf", type=float, default=1.1, help="Exponent of the adapters' popularity.")
    parser.add_argument("--max-loras", type=int, default=2, help="Adapters an engine holds at once.")
    parser.add_argument("--lora-load-ms", type=float, default=200.0, help="Time to load an adapter.")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
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
        f"({len(trace) / (args.minutes * 60.0 / args.speedup):.1f} req/s), 16 engines, max_loras "
        f"{args.max_loras}, load {args.lora_load_ms:g} ms, seed {args.seed}; adapter shares "
        + " ".join(f"{share:.2f}" for share in shares.values())
    )
    common = {"seed": args.seed, "max_loras": args.max_loras, "load_ms": args.lora_load_ms}
    one = {mode: run(trace, classes, aware=mode == "aware", **common) for mode in ("aware", "blind")}
    print_table("one router", one["aware"], one["blind"], names=("aware", "blind"))
    replica_of = np.random.default_rng([args.seed, 2]).integers(0, 2, size=len(trace)).tolist()
    two = {
        mode: run(trace, classes, aware=True, shared=mode == "shared", replica_of=replica_of, **common)
        for mode in ("shared", "unshared")
    }
    print(f"two replicas, adapter-aware; requests per replica {replica_of.count(0)} / {replica_of.count(1)}")
    print_table("two replicas", two["shared"], two["unshared"], names=("shared", "unshared"))


def print_table(
    title: str, first: dict[str, float], second: dict[str, float], *, names: tuple[str, str]
) -> None:
    """The two runs' figures side by side, with their ratio."""
    a, b = names
    print(f"{title:<24}{a:>14}{b:>14}{a + '/' + b:>18}")
    for key, value in first.items():
        ratio = value / second[key] if second[key] else float("nan")
        print(f"{key:<24}{value:>14,.3f}{second[key]:>14,.3f}{ratio:>18.3f}")


if __name__ == "__main__":
    main()
