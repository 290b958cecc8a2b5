"""Live replay: real ``copse router run`` and ``copse worker mock`` processes, a real NATS server."""

from __future__ import annotations

from copse.sim.live import run_live
from copse.sim.replay import ReplaySettings
from copse.sim.trace import TraceRequest


def test_a_live_replay_routes_every_request_and_reuses_shared_prefixes() -> None:
    # Three conversations of four turns each, every turn extending its conversation's prompt.
    trace = [
        TraceRequest(
            timestamp_ms=400.0 * (turn * 3 + conversation),
            input_length=512 * (turn + 2),
            output_length=4,
            hash_ids=tuple(1000 * conversation + block for block in range(turn + 2)),
        )
        for turn in range(4)
        for conversation in range(3)
    ]
    report = run_live(trace, ReplaySettings(policy="kv", workers=2, seed=3))
    assert (report.requests, report.failed) == (12, 0)
    # the KV-aware router keeps each conversation where its prefix is cached: from the second turn
    # on, every prompt but its newest block is a hit (and the router learns of the blocks over NATS)
    prompt = sum(r.input_length for r in trace)
    reusable = sum(r.input_length - 512 for r in trace if r.input_length > 1024)
    assert report.cache_hit_rate >= 0.8 * reusable / prompt
    assert report.engine_lag_ms is not None
    assert report.engine_lag_ms >= 0
    assert report.ttft_ms.p50 > 0
