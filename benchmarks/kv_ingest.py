"""KV-event ingestion as the router does it, on an index that grows to millions of blocks: each NATS
message's bytes (a ``KvEventBatch`` in the engines' JSON, as ``KvEventPublisher`` sends it) are
decoded (``KvEventBatch.model_validate_json``) and applied to the radix indexer
(``RadixIndexer.apply``): exactly ``KvEventSync.on_message`` without NATS's own socket.

Fleet: ``--workers`` engines of ``--capacity`` blocks each (64 x 65,536 = 4.2 M blocks at block size
32: 2.1 M tokens per engine, an 80 GB GPU's worth for an 8B model). Each engine's step publishes one
message with ``--events-per-batch`` stored events, one per request: a system prompt from a pool of
``--prefixes`` shared by every engine (8 blocks), then 8-24 blocks of its own, chained; once an
engine is full it also evicts its oldest unshared blocks (a removed event in the same message). The
run fills every engine (the index grows from 0 to ``workers x capacity`` blocks), then runs
``--steady`` more stored blocks per engine in steady state (each stored block evicts one).

Per phase (every million indexed blocks, then the steady state): block events per second (stored
and removed blocks; on-CPU of this thread, and wall), the same with only the apply (decoding left
out, measured in the same pass: ``time.thread_time`` around each call), and decoding's share.
Messages are encoded ahead of each phase's timing (that is the engines' cost, not the router's).

Usage: ``.venv/bin/python benchmarks/kv_ingest.py [--workers 64] [--capacity 65536]
[--events-per-batch 4] [--prefixes 256] [--steady 16384]``
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections import deque
from pathlib import Path

from copse.router.indexer import RadixIndexer
from copse.router.slots import WorkerSlots
from copse.workers.protocol import KvEvent, KvRemoved, KvStored, StoredBlock
from copse.workers.protocol.kv_events import KvEventBatch

PREFIX_BLOCKS = 8


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class _Engine:
    """One engine's cache as its events describe it: what it publishes next."""

    def __init__(self, name: str, *, capacity: int, rng: random.Random, prefixes: list[list[int]]) -> None:
        self.name = name
        self.capacity = capacity
        self.rng = rng
        self.prefixes = prefixes
        self.held: set[int] = set()
        self.own: deque[int] = deque()  # unshared blocks, oldest first (evicted first)
        self.next_id = 1

    def batch(self, events_per_batch: int) -> tuple[bytes, int, int]:
        """One step's message: (bytes, stored blocks, removed blocks)."""
        rng = self.rng
        events: list[KvEvent] = []
        stored = removed = 0
        for _ in range(events_per_batch):
            prefix = self.prefixes[rng.randrange(len(self.prefixes))]
            unique = [rng.getrandbits(64) for _ in range(rng.randint(8, 24))]
            # shared prefixes are never evicted: an engine holds all of one or none of it
            known = prefix[0] in self.held
            new = unique if known else prefix + unique
            self.held.update(new)
            self.own.extend(unique)
            events.append(
                KvEvent.model_construct(
                    event_id=self.next_id,
                    data=KvStored.model_construct(
                        type="stored",
                        parent_hash=prefix[-1] if known else None,
                        blocks=tuple(StoredBlock(h, h ^ 0x5BD1E995) for h in new),
                    ),
                )
            )
            self.next_id += 1
            stored += len(new)
        excess = len(self.held) - self.capacity
        if excess > 0:
            victims = [self.own.popleft() for _ in range(min(excess, len(self.own)))]
            self.held.difference_update(victims)
            events.append(
                KvEvent.model_construct(
                    event_id=self.next_id,
                    data=KvRemoved.model_construct(type="removed", block_hashes=tuple(victims)),
                )
            )
            self.next_id += 1
            removed += len(victims)
        message = KvEventBatch.model_construct(worker_id=self.name, epoch=1, events=tuple(events))
        return message.model_dump_json().encode(), stored, removed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=65536, help="Blocks per engine.")
    parser.add_argument("--events-per-batch", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=256, help="Shared system prompts (8 blocks each).")
    parser.add_argument("--steady", type=int, default=16384, help="Stored blocks per engine once full.")
    parser.add_argument(
        "--phase-blocks", type=int, default=1_000_000, help="Indexed blocks per reported phase."
    )
    args = parser.parse_args()

    rng = random.Random(0)
    prefixes = [[rng.getrandbits(64) for _ in range(PREFIX_BLOCKS)] for _ in range(args.prefixes)]
    engines = [
        _Engine(f"engine-{i}", capacity=args.capacity, rng=random.Random(i), prefixes=prefixes)
        for i in range(args.workers)
    ]
    indexer = RadixIndexer(WorkerSlots(), default_capacity_blocks=args.capacity)
    rss = _rss_mib()
    full = args.workers * args.capacity
    print(
        f"{args.workers} engines x {args.capacity:,} blocks = {full:,} blocks at capacity; "
        f"{args.events_per_batch} stored events per message, {args.prefixes} shared 8-block prefixes"
    )
    print(
        f"{'phase':<24}{'messages':>9}{'block events':>13}{'decode+apply /s (CPU)':>23}{'wall /s':>12}"
        f"{'apply only /s':>15}{'decode share':>13}{'index blocks':>14}"
    )
    indexed = 0
    steady_left = args.steady * args.workers
    while True:
        steady = indexed >= full
        # encode the next phase's messages first (the engines' work), then time the router's part
        target = min(indexed + args.phase_blocks, full)
        messages: list[bytes] = []
        events = stored_in_phase = 0
        while (stored_in_phase < steady_left) if steady else (indexed < target):
            for engine in engines:
                data, stored, removed = engine.batch(args.events_per_batch)
                messages.append(data)
                events += stored + removed
                stored_in_phase += stored
                indexed += stored - removed
        gc.collect()
        decode = apply = 0.0
        wall = time.perf_counter()
        cpu = time.thread_time()
        for data in messages:
            t0 = time.thread_time()
            batch = KvEventBatch.model_validate_json(data)
            t1 = time.thread_time()
            assert indexer.apply(batch) is None
            apply += time.thread_time() - t1
            decode += t1 - t0
        cpu = time.thread_time() - cpu
        wall = time.perf_counter() - wall
        label = "steady (full, evicting)" if steady else f"grow to {indexed / 1e6:.1f} M"
        print(
            f"{label:<24}{len(messages):>9,}{events:>13,}{events / cpu:>23,.0f}{events / wall:>12,.0f}"
            f"{events / apply:>15,.0f}{decode / (decode + apply):>13.0%}{indexed:>14,}",
            flush=True,
        )
        if steady:
            break
    print(
        f"index of {indexed:,} blocks held by the router: RSS +{_rss_mib() - rss:,.0f} MiB "
        f"(with this script's own record of the engines' caches)"
    )


if __name__ == "__main__":
    main()
