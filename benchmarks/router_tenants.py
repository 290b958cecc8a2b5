"""Cost of the router's work per request as the tenants sharing a fleet grow.

A shared fleet names a tenant per request (an API key, a fairness id), so a router may see
thousands of them at once. This script keeps one router (16 workers, ``kv``, default thresholds)
saturated and contended: every request carries a TTFT target (so admission predicts its wait),
its tenant is drawn from ``N`` by a Zipf(1.1) law (a few heavy tenants and a long tail, as API
keys go), its prompt is 1k, 4k or 12k tokens, and the fleet ends prefills at nine tenths of the
pace requests arrive, so the fair queue holds requests and tenants contend for idle workers. Per
request it measures the on-CPU time (``time.thread_time``) of its ``Router.submit`` plus the
first-token and finish bookkeeping of that step (which routes queued requests), and prints it for
each ``N`` against ``N = 1`` measured in the same run: the ratio is the figure (this machine's
speed drifts).

With ``--replicas R``, R router replicas share the fleet, requests taken by each in turn; after
every step each hands the others its load changes and its queue heads, as the twin does (a live
replica sends them over NATS with each batch of changes); the time is that of all of them.

Usage: ``.venv/bin/python benchmarks/router_tenants.py [--tenants 1,100,1000,5000] [--requests 3000]
[--replicas 2]``
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections import deque

import numpy as np

from copse.router.core import QueueFull, Role, Route, Router, SloShed, WorkerInfo
from copse.router.policies import RouteRequest, SelectionSettings
from copse.workers.perf import PolynomialPerfModel

WORKERS = 16
BLOCK = 512
PROMPTS = (1000, 4000, 12000)
STEP_S = 2e-3
"""Time between arrivals (the router's clock): the fleet saturates within the warm-up."""


def _tenants(count: int, rng: random.Random) -> list[str]:
    """Tenant names drawn with probability proportional to ``1 / rank ** 1.1``."""
    weights = 1.0 / np.arange(1, count + 1) ** 1.1
    return [f"tenant-{k}" for k in rng.choices(range(count), weights=weights.tolist(), k=1 << 16)]


def _sync(routers: list[Router], *, now: float) -> list[Route]:
    """Each replica's load changes and queue heads handed to the others, until nothing changes;
    returns the queued requests that lets through."""
    released: list[Route] = []
    moved = len(routers) > 1
    while moved:
        moved = False
        for source, router in enumerate(routers):
            assert router.outbox is not None
            changes = list(router.outbox)
            router.outbox.clear()
            heads = router.queue_heads(now=now)
            moved = moved or bool(changes)
            for peer in routers:
                if peer is not router:
                    for change in changes:
                        released += peer.apply_peer(change, peer=str(source), now=now)
                    released += peer.apply_peer_queue(str(source), heads, now=now)
    return released


def run(tenants: int, *, requests: int, warmup: int, replicas: int = 1) -> dict[str, float]:
    """Per-request on-CPU microseconds (median and 99th percentile of ``requests``, after
    ``warmup``) with ``tenants`` tenants through ``replicas`` router replicas, and what they held
    at the end."""
    routers = [
        Router(
            perf=PolynomialPerfModel(),
            settings=SelectionSettings(block_size=BLOCK),
            policy="kv",
            seed=0,
            share_load=replicas > 1,
        )
        for _ in range(replicas)
    ]
    for router in routers:
        for w in range(WORKERS):
            router.add_worker(WorkerInfo(worker_id=f"w{w}", role=Role.WORKER), now=0.0)
    owner: dict[str, Router] = {}
    rng = random.Random(0)
    names = _tenants(tenants, rng)
    prefilling: deque[str] = deque()
    inflight: deque[str] = deque()
    shed = 0
    cpu = np.empty(requests)
    seen: list[str] = []

    def started(routes: list[Route]) -> None:
        ids = [route.request_id for route in routes]
        prefilling.extend(ids)
        inflight.extend(ids)

    gc.collect()
    gc.disable()
    for i in range(warmup + requests):
        now = i * STEP_S
        prompt = rng.choice(PROMPTS)
        request = RouteRequest(
            request_id=str(i),
            hashes=[rng.getrandbits(63) for _ in range(prompt // BLOCK + 1)],
            prompt_tokens=prompt,
            max_tokens=200,
            tenant=names[i % len(names)],
            ttft_slo_ms=5000.0,
        )
        router = owner[request.request_id] = routers[i % replicas]
        c0 = time.thread_time()
        try:
            route = router.submit(request, now=now)
        except (SloShed, QueueFull):
            route = None
            shed += 1
        if route is not None:
            started([route])
        # The fleet finishes nine prefills per ten arrivals (it saturates, and admission sheds what
        # would miss the target), and keeps 8 sequences a worker decoding.
        if prefilling and i % 10:
            key = prefilling.popleft()
            started(owner[key].prefill_done(key, now=now))
        while len(inflight) > 8 * WORKERS:
            key = inflight.popleft()
            started(owner[key].finish(key, now=now))
        started(_sync(routers, now=now))
        if i >= warmup:
            cpu[i - warmup] = time.thread_time() - c0
            seen.append(request.tenant)
    gc.enable()
    return {
        "p50_us": float(np.percentile(cpu, 50) * 1e6),
        "p99_us": float(np.percentile(cpu, 99) * 1e6),
        "mean_us": float(cpu.mean() * 1e6),
        "queued": float(sum(router.queued for router in routers)),
        "shed": float(shed),
        "distinct": float(len(set(seen))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tenants", default="1,100,1000,5000", help="Tenant counts to run (1 is the baseline)."
    )
    parser.add_argument("--requests", type=int, default=3000, help="Requests measured per count.")
    parser.add_argument("--warmup", type=int, default=3000, help="Requests before measuring.")
    parser.add_argument("--replicas", type=int, default=1, help="Router replicas sharing the fleet.")
    args = parser.parse_args()
    counts = sorted({1, *(int(n) for n in args.tenants.split(","))})
    print(
        f"{WORKERS} workers, {args.replicas} router replica(s), kv, default thresholds, TTFT target 5 s, "
        f"{args.warmup:,} requests of warm-up "
        f"then {args.requests:,} measured per tenant count (on-CPU per request: submit and bookkeeping)"
    )
    print(
        f"{'tenants':>8} {'seen':>7} {'queued':>7} {'shed':>6} {'p50 us':>8} {'p99 us':>8} {'mean us':>8}"
        f" {'mean / 1 tenant':>16}"
    )
    base: float | None = None
    for count in counts:
        figures = run(count, requests=args.requests, warmup=args.warmup, replicas=args.replicas)
        base = base or figures["mean_us"]
        print(
            f"{count:>8,} {figures['distinct']:>7,.0f} {figures['queued']:>7,.0f} "
            f"{figures['shed']:>6,.0f} {figures['p50_us']:>8,.0f} {figures['p99_us']:>8,.0f} "
            f"{figures['mean_us']:>8,.0f} {figures['mean_us'] / base:>16.2f}"
        )


if __name__ == "__main__":
    main()
