"""Simulated tokens per wall-second of the mocker's virtual clock: 16 engines replaying the Mooncake
conversation trace (round-robin routing), step by step, with decode steps fused up to the next
arrival, and fused up to the next arrival at the same engine (``fuse_until_submit``), side by side.

    .venv/bin/python benchmarks/workers_replay.py [--trace PATH] [--engines 16] [--limit N]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import inputs
from copse.workers.mocker import Engine, EngineConfig, Simulator
from copse.workers.perf import PolynomialPerfModel
from copse.workers.protocol.tokenizer import RESERVED_IDS, VOCAB_SIZE

TRACE = inputs.CONVERSATION
TRACE_BLOCK = 512


def trace_tokens(hash_ids: list[int], input_length: int) -> np.ndarray:
    """Token ids for a Mooncake request: each hash id stands for the same 512 tokens everywhere."""
    ids = np.asarray(hash_ids, dtype=np.int64)[:, None]
    offsets = np.arange(TRACE_BLOCK, dtype=np.int64)[None, :]
    tokens = RESERVED_IDS + (ids * 2654435761 + offsets * 40503) % (VOCAB_SIZE - RESERVED_IDS)
    return tokens.reshape(-1)[:input_length].astype(np.uint32)


@dataclass(frozen=True)
class Row:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def load(path: Path, limit: int | None) -> list[Row]:
    rows: list[Row] = []
    with gzip.open(path, "rt") as handle:
        for line in handle:
            raw = json.loads(line)
            rows.append(
                Row(float(raw["timestamp"]), raw["input_length"], raw["output_length"], raw["hash_ids"])
            )
            if limit is not None and len(rows) == limit:
                break
    return rows


#: Mode -> (fuse_decode, fuse_until_submit) of the simulator.
MODES = {"step-by-step": (False, False), "fused": (True, False), "until submit": (True, True)}


def replay(rows: list[Row], *, engines: int, mode: str) -> tuple[float, float, Simulator]:
    """Replay ``rows`` round-robin; returns wall seconds, CPU seconds of this process, the simulator."""
    perf = PolynomialPerfModel()
    sim = Simulator(
        [Engine(worker_id=f"w{i}", config=EngineConfig(), perf=perf) for i in range(engines)],
        fuse_decode=MODES[mode][0],
        fuse_until_submit=MODES[mode][1],
    )
    started, cpu = time.perf_counter(), time.process_time()
    for n, row in enumerate(rows):
        sim.run_until(row.timestamp_ms)
        for engine in sim.engines:
            engine.drain_kv_events()
        tokens = trace_tokens(row.hash_ids, row.input_length)
        sim.submit(n % engines, request_id=str(n), tokens=tokens, max_tokens=row.output_length)
    sim.run()
    return time.perf_counter() - started, time.process_time() - cpu, sim


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--engines", type=int, default=16)
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    args = parser.parse_args()
    inputs.require(args.trace)
    rows = load(args.trace, args.limit)
    results = {}
    for mode in MODES:
        wall, cpu, sim = replay(rows, engines=args.engines, mode=mode)
        outcomes = sim.outcomes
        tokens = sum(o.prompt_tokens + o.output_tokens for o in outcomes)
        generated = sum(o.output_tokens for o in outcomes)
        ttft = sorted(o.ttft_ms for o in outcomes)
        results[mode] = (wall, [(o.request_id, o.first_token_ms, o.finish_ms) for o in outcomes])
        print(
            f"{mode:>12}: {len(outcomes)} requests,"
            f" {sim.now_ms / 1000:.0f} s simulated"
            f" in {wall:.1f} s wall, {cpu:.1f} s CPU ({sim.now_ms / 1000 / wall:.0f}x real time);"
            f" {tokens / wall:,.0f} tokens/s (prompt+output), {generated / wall:,.0f} generated tokens/s;"
            f" TTFT p50 {statistics.median(ttft):.0f} ms, p99 {ttft[int(0.99 * (len(ttft) - 1))]:.0f} ms"
        )
    stepwise = results["step-by-step"]
    for mode in ("fused", "until submit"):
        print(
            f"{mode} / step-by-step speed: {stepwise[0] / results[mode][0]:.2f}x;"
            f" identical outcomes: {results[mode][1] == stepwise[1]}"
        )


if __name__ == "__main__":
    main()
