"""Speed of the router core on one core: routing decisions and prompt hashing.

* decisions: 64 workers whose caches hold 1M blocks in total (16,384 each, the mocker's default
  cache), filled with prefixes of Mooncake conversation requests (512-token blocks); then requests
  drawn from the same trace are routed with the ``kv`` policy while ~8 requests per worker are in
  flight (each routed request has its first token 64 decisions later and ends 512 decisions
  later). Decision latency = one ``Router.submit``.
* (KV events: ``benchmarks/kv_ingest.py``, decoding included, on an index that grows.)
* hashing: the chained XXH3 block hashes of a 12,288-token prompt at block size 32.

Decision times are on-CPU (``time.thread_time``: what this thread ran, leaving out waiting for a
core shared with other processes) and wall; the machine's load varies, so the decisions run in
several passes, each reported.

Usage: ``.venv/bin/python benchmarks/router_core.py [--trace FILE] [--requests N] [--passes P]``
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

import inputs
from copse.router.core import Role, Router, WorkerInfo
from copse.router.policies import RouteRequest, SelectionSettings
from copse.sim.trace import load_trace
from copse.workers.perf import PolynomialPerfModel
from copse.workers.protocol import block_hashes, chain_hashes

TRACE = inputs.CONVERSATION
WORKERS = 64
BLOCKS_PER_WORKER = 16384
IN_FLIGHT = 8 * WORKERS
PREFILLING = WORKERS


def _chains(trace_path: Path) -> list[list[int]]:
    """Each request's prompt as chained block hashes, one per trace block."""
    # Trace hash ids are prefix-chained already; chaining them gives well-spread 64-bit hashes.
    return [chain_hashes(list(r.hash_ids)) for r in load_trace(trace_path)]


def _filled_router(chains: list[list[int]]) -> Router:
    """64 workers whose caches hold 16,384 blocks each, filled with prefixes of trace requests."""
    router = Router(
        perf=PolynomialPerfModel(), settings=SelectionSettings(block_size=512), policy="kv", seed=0
    )
    rng = random.Random(0)
    assert router.radix is not None
    for w in range(WORKERS):
        worker_id = f"w{w}"
        router.add_worker(WorkerInfo(worker_id=worker_id, role=Role.WORKER), now=0.0)
        slot = router.slots.slot(worker_id)
        held = 0
        while held < BLOCKS_PER_WORKER:
            chain = chains[rng.randrange(len(chains))]
            router.radix.index.store(slot, chain)
            held = router.radix.index.blocks_held(slot)
    return router


def bench_decisions(chains: list[list[int]], requests: int, passes: int) -> dict[str, Any]:
    """Route ``passes`` x ``requests`` requests through one router (state carries over); per
    pass: on-CPU time (``time.thread_time``, what this thread ran, so waiting for a shared core is
    left out) and wall time of every ``Router.submit``, and the on-CPU time of the whole loop
    (``time.process_time``) including first-token and finish bookkeeping."""
    router = _filled_router(chains)
    assert router.radix is not None
    stored = sum(router.radix.index.blocks_held(router.slots.slot(f"w{w}")) for w in range(WORKERS))
    rng = random.Random(0)
    prefilling: deque[str] = deque()
    inflight: deque[str] = deque()
    runs: list[dict[str, float]] = []
    i = 0
    for _ in range(passes):
        queued = 0
        latencies = np.empty(requests)
        cpu = np.empty(requests)
        gc.collect()
        gc.disable()
        cpu_started = time.process_time()
        for k in range(requests):
            chain = chains[rng.randrange(len(chains))]
            request = RouteRequest(
                request_id=str(i), hashes=chain, prompt_tokens=len(chain) * 512 - 100, max_tokens=343
            )
            c0 = time.thread_time()
            t0 = time.perf_counter()
            route = router.submit(request, now=i * 1e-3)
            latencies[k] = time.perf_counter() - t0
            cpu[k] = time.thread_time() - c0
            queued += route is None
            prefilling.append(str(i))
            inflight.append(str(i))
            if len(prefilling) > PREFILLING:
                router.prefill_done(prefilling.popleft(), now=i * 1e-3)
            if len(inflight) > IN_FLIGHT:
                router.finish(inflight.popleft(), now=i * 1e-3)
            i += 1
        loop_cpu = time.process_time() - cpu_started
        gc.enable()
        assert queued == 0, f"{queued} requests queued: the benchmark must measure routing, not queueing"
        runs.append(
            {
                "cpu_decisions_per_s": requests / float(cpu.sum()),
                "cpu_p50_us": float(np.percentile(cpu, 50) * 1e6),
                "cpu_p99_us": float(np.percentile(cpu, 99) * 1e6),
                "decisions_per_s": requests / float(latencies.sum()),
                "p50_us": float(np.percentile(latencies, 50) * 1e6),
                "p99_us": float(np.percentile(latencies, 99) * 1e6),
                "cpu_with_lifecycle_per_s": requests / loop_cpu,
            }
        )
    return {"indexed_blocks": stored, "distinct_nodes": len(router.radix.index), "passes": runs}


def bench_hashing(repeats: int) -> dict[str, float]:
    tokens = np.random.default_rng(0).integers(256, 32000, 12288).astype(np.uint32)
    times: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block_hashes(tokens, block_size=32)
        times.append(time.perf_counter() - t0)
    return {"hash_12k_tokens_bs32_us_median": statistics.median(times) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=20000, help="decisions per pass")
    parser.add_argument(
        "--passes", type=int, default=3, help="passes of decisions (the machine's load varies)"
    )
    args = parser.parse_args()
    inputs.require(args.trace)
    chains = _chains(args.trace)
    decisions = bench_decisions(chains, args.requests, args.passes)
    print(
        f"decisions: {WORKERS} workers, {decisions['indexed_blocks']:,} indexed blocks "
        f"({decisions['distinct_nodes']:,} distinct), {IN_FLIGHT} in flight, "
        f"{args.passes} passes of {args.requests:,}"
    )
    for number, run in enumerate(decisions["passes"], 1):
        print(
            f"  pass {number}: on-CPU {run['cpu_decisions_per_s']:,.0f} decisions/s "
            f"({1e6 / run['cpu_decisions_per_s']:.0f} us each; target 20,000: "
            f"{run['cpu_decisions_per_s'] / 20000:.2f}x), p50 {run['cpu_p50_us']:.0f} us, "
            f"p99 {run['cpu_p99_us']:.0f} us (target 1000 us); "
            f"wall {run['decisions_per_s']:,.0f}/s, p50 {run['p50_us']:.0f} us, p99 {run['p99_us']:.0f} us; "
            f"on-CPU {run['cpu_with_lifecycle_per_s']:,.0f}/s including first-token and finish bookkeeping"
        )
    median = statistics.median(run["cpu_decisions_per_s"] for run in decisions["passes"])
    print(f"  median pass on-CPU: {median:,.0f} decisions/s (target 20,000: {median / 20000:.2f}x)")
    hashing = bench_hashing(200)
    print(
        f"hashing: 12,288-token prompt at block size 32: {hashing['hash_12k_tokens_bs32_us_median']:.0f} us"
    )


if __name__ == "__main__":
    main()
