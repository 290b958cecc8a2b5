"""Leader election over a Lease: the pure decision and the elector against an in-memory Lease."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import pytest

from copse.operator.leader import LeaderElector, LeaseSettings, Observation, next_spec

SETTINGS = LeaseSettings(
    namespace="ops", identity="a", lease_duration_s=0.6, renew_deadline_s=0.4, retry_period_s=0.05
)
WALL = datetime(2026, 1, 1, tzinfo=UTC)


def observed(holder: str, *, since: float, transitions: int = 0) -> Observation:
    spec = {"holderIdentity": holder, "leaseDurationSeconds": 15, "leaseTransitions": transitions}
    return Observation(spec=spec, resource_version="1", since=since)


def test_a_missing_lease_is_acquired() -> None:
    spec = next_spec(observed=None, identity="a", settings=SETTINGS, wall=WALL, now=0.0)
    assert spec is not None
    assert spec["holderIdentity"] == "a"
    assert spec["leaseTransitions"] == 0
    assert spec["acquireTime"] == spec["renewTime"] == "2026-01-01T00:00:00.000000Z"


def test_the_holder_renews_without_a_transition() -> None:
    spec = next_spec(observed=observed("a", since=0.0, transitions=3), identity="a", settings=SETTINGS,
                     wall=WALL, now=100.0)  # fmt: skip
    assert spec is not None
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("a", 3)


def test_another_holder_is_waited_out_for_its_duration_on_the_local_clock() -> None:
    other = observed("b", since=10.0, transitions=1)
    assert next_spec(observed=other, identity="a", settings=SETTINGS, wall=WALL, now=24.9) is None
    spec = next_spec(observed=other, identity="a", settings=SETTINGS, wall=WALL, now=25.0)
    assert spec is not None
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("a", 2)


def test_a_released_lease_is_taken_at_once() -> None:
    spec = next_spec(observed=observed("", since=50.0), identity="a", settings=SETTINGS, wall=WALL, now=50.0)
    assert spec is not None
    assert spec["holderIdentity"] == "a"


def test_settings_must_order_retry_renew_and_duration() -> None:
    with pytest.raises(ValueError, match="retry period < renew deadline < lease duration"):
        LeaseSettings(namespace="ops", lease_duration_s=10, renew_deadline_s=10, retry_period_s=2)


class FakeLeases:
    """One Lease with resourceVersion checks, and a switch that makes the API server unreachable."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise ConnectionError("API server unreachable")

    async def read(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        self._check()
        return copy.deepcopy(self.lease)

    def _write(self, spec: Mapping[str, Any]) -> None:
        self.version += 1
        self.lease = {"metadata": {"resourceVersion": str(self.version)}, "spec": dict(spec)}

    async def create(self, *, namespace: str, name: str, spec: Mapping[str, Any]) -> bool:
        self._check()
        if self.lease is not None:
            return False
        self._write(spec)
        return True

    async def replace(
        self, *, namespace: str, name: str, spec: Mapping[str, Any], resource_version: str | None
    ) -> bool:
        self._check()
        if self.lease is None or self.lease["metadata"]["resourceVersion"] != resource_version:
            return False
        self._write(spec)
        return True

    @property
    def holder(self) -> str:
        return str((self.lease or {}).get("spec", {}).get("holderIdentity", ""))


class Replica:
    def __init__(self, leases: FakeLeases, identity: str) -> None:
        self.log: list[str] = []
        settings = LeaseSettings(
            namespace="ops",
            identity=identity,
            lease_duration_s=0.6,
            renew_deadline_s=0.4,
            retry_period_s=0.05,
        )
        self.elector = LeaderElector(
            api=leases, settings=settings, on_started=self._started, on_stopped=self._stopped
        )
        self.task = asyncio.create_task(self.elector.run())

    async def _started(self) -> None:
        self.log.append("started")

    async def _stopped(self) -> None:
        self.log.append("stopped")


async def until(check: Any, *, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


async def test_one_leader_a_dead_one_is_replaced_and_a_release_hands_over_at_once() -> None:
    leases = FakeLeases()
    a, b = Replica(leases, "a"), Replica(leases, "b")
    await until(lambda: a.elector.leading or b.elector.leading)
    await asyncio.sleep(0.3)
    assert [a.elector.leading, b.elector.leading].count(True) == 1, "exactly one leader"
    leader, standby = (a, b) if a.elector.leading else (b, a)
    assert standby.log == []

    leader.task.cancel()  # killed: no release
    await until(lambda: standby.elector.leading)
    assert leases.holder == standby.elector.settings.identity
    assert leases.lease is not None
    assert leases.lease["spec"]["leaseTransitions"] == 1

    revived = Replica(leases, "c")
    await asyncio.sleep(0.3)
    assert not revived.elector.leading, "a live leader keeps the Lease"
    standby.task.cancel()
    await standby.elector.release()
    assert standby.log == ["started", "stopped"]
    await until(lambda: revived.elector.leading, timeout=0.5)  # well before a lease duration
    revived.task.cancel()


async def test_a_leader_that_cannot_renew_stops_and_takes_the_lease_again_later() -> None:
    leases = FakeLeases()
    only = Replica(leases, "a")
    await until(lambda: only.elector.leading)
    leases.down = True
    await until(lambda: not only.elector.leading)
    assert only.log == ["started", "stopped"]
    leases.down = False
    await until(lambda: only.elector.leading)
    assert only.log == ["started", "stopped", "started"]
    only.task.cancel()
