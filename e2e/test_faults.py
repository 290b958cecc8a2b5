"""The fault suite, short (``copse bench faults`` runs it in full; benchmarks/RESULTS.md has the
table): streams through router processes to mocked-engine processes on 127.0.0.1, with an
engine killed, NATS restarted, a router replica killed and an engine hung mid-stream."""

from __future__ import annotations

import pytest

from copse.sim.fault_suite import run_suite
from copse.sim.faults import FaultSettings

pytestmark = pytest.mark.e2e


async def test_streams_survive_dying_engines_nats_restarts_and_router_replicas() -> None:
    settings = FaultSettings(streams=32, engines=4, max_tokens=48)
    results = {
        result.scenario: result
        for result in await run_suite(settings, ["engine-kill", "nats-restart", "router-kill", "engine-hang"])
    }
    for result in results.values():
        assert result.failed == 0, result
        assert result.token_exact == result.streams, result  # migrations change no token
    # (a) the dead engine's streams moved: the connection broke, or the probe that found the
    # engine gone abandoned them first
    assert sum(results["engine-kill"].migrations.values()) >= 1
    assert set(results["engine-kill"].migrations) <= {"disconnected", "worker_lost"}
    # (c) NATS is not on the data path; the router came back to exact mode and resynced
    assert "exact again" in results["nats-restart"].note
    # (d) the killed replica's streams broke at the TCP level; their clients retried them whole
    assert results["router-kill"].broken >= 1
    # (e) the hung engine was caught by its health probes, not by the 30 s silence timeout
    assert results["engine-hang"].migrations.get("worker_lost", 0) >= 1
    assert "timeout" not in results["engine-hang"].migrations
