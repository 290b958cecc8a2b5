"""Leader election over a ``coordination.k8s.io/v1`` Lease, as controller-runtime does it.

Several operator replicas run; each streams the watches into its cache, and only the holder of
the Lease runs the reconcile worker. A standby takes the Lease over once its record has not
changed for the lease duration *as the standby observed it* (its own clock: no clock-skew
assumption between pods), so a killed leader is replaced within ``lease_duration_s`` plus one
``retry_period_s``. A leader that cannot renew for ``renew_deadline_s`` (shorter than the lease
duration) stops reconciling before anyone else may start: two replicas never act at once.

Why a Lease rather than kopf's peering: peering needs its own CRDs, freezes every replica that
has the same priority (identical Deployment replicas all do), and pauses the standbys' watches,
so a takeover starts from a cold cache. A Lease is the Kubernetes-native lock every controller
uses, its holder is visible with ``kubectl get lease``, and the standby stays warm.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from copse.operator import metrics

logger = logging.getLogger("copse.operator.leader")


def _identity() -> str:
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeaseSettings:
    namespace: str
    """Where the Lease lives: the operator's own namespace (the chart's Role allows it there)."""
    name: str = "copse-operator"
    """One Lease per operator installation: replicas sharing it elect one leader."""
    identity: str = dataclasses.field(default_factory=_identity)
    """This replica's name in ``holderIdentity``: the pod name plus a random suffix, so a
    restarted container never mistakes its predecessor's record for its own."""
    lease_duration_s: float = 15.0
    """How long a standby waits on an unchanged record before taking over (controller-runtime's
    default): the upper bound of a leader's absence after it dies."""
    renew_deadline_s: float = 10.0
    """A leader that has not renewed for this long stops reconciling; shorter than the lease
    duration, so it has stopped before a standby may start."""
    retry_period_s: float = 2.0
    """Between attempts to renew (leader) or to acquire (standby)."""

    def __post_init__(self) -> None:
        if not 0 < self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError(
                "leader election needs 0 < retry period < renew deadline < lease duration, got "
                f"{self.retry_period_s:g}s, {self.renew_deadline_s:g}s, {self.lease_duration_s:g}s"
            )


def _micro_time(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Observation:
    """A Lease record as this replica last read it, and since when (monotonic s) it has not changed."""

    spec: Mapping[str, Any]
    resource_version: str | None
    since: float


def next_spec(
    *, observed: Observation | None, identity: str, settings: LeaseSettings, wall: datetime, now: float
) -> dict[str, Any] | None:
    """The Lease spec to write now (acquire or renew), or None to keep waiting (pure).

    ``observed`` is None when the Lease does not exist yet."""
    spec = dict(observed.spec) if observed is not None else {}
    holder = spec.get("holderIdentity") or ""
    stamp = _micro_time(wall)
    fresh = {
        "holderIdentity": identity,
        "leaseDurationSeconds": max(1, round(settings.lease_duration_s)),
        "renewTime": stamp,
    }
    if holder == identity:
        return {**spec, **fresh}
    duration = float(spec.get("leaseDurationSeconds") or settings.lease_duration_s)
    if holder and observed is not None and now - observed.since < duration:
        return None  # someone else holds it and has renewed within its duration
    transitions = int(spec.get("leaseTransitions") or 0) + (0 if observed is None else 1)
    return {**fresh, "acquireTime": stamp, "leaseTransitions": transitions}


class LeaseApi(Protocol):
    """Reads and optimistic writes of one Lease (tests use a fake)."""

    async def read(self, *, namespace: str, name: str) -> dict[str, Any] | None: ...
    async def create(self, *, namespace: str, name: str, spec: Mapping[str, Any]) -> bool: ...
    async def replace(
        self, *, namespace: str, name: str, spec: Mapping[str, Any], resource_version: str | None
    ) -> bool: ...


class LeaderElector:
    """Holds or waits for the Lease; calls ``on_started`` on winning it and ``on_stopped`` on
    losing it (a missed renew deadline), then keeps trying as a standby."""

    def __init__(
        self,
        *,
        api: LeaseApi,
        settings: LeaseSettings,
        on_started: Callable[[], Awaitable[None]],
        on_stopped: Callable[[], Awaitable[None]],
    ) -> None:
        self.api = api
        self.settings = settings
        self.on_started = on_started
        self.on_stopped = on_stopped
        self.leading = False
        self._observed: Observation | None = None
        self._renewed_at = 0.0

    @property
    def holder(self) -> str:
        """Who holds the Lease, as last read ("" when nobody or not read yet)."""
        return str((self._observed.spec if self._observed else {}).get("holderIdentity") or "")

    async def _attempt(self) -> bool:
        """One read and, when due, one write; True when this replica holds the Lease after it."""
        name, namespace = self.settings.name, self.settings.namespace
        lease = await self.api.read(namespace=namespace, name=name)
        now = time.monotonic()
        if lease is None:
            self._observed = None
        else:
            version = lease.get("metadata", {}).get("resourceVersion")
            spec = lease.get("spec") or {}
            if self._observed is None or self._observed.resource_version != version:
                self._observed = Observation(spec=spec, resource_version=version, since=now)
        wanted = next_spec(
            observed=self._observed,
            identity=self.settings.identity,
            settings=self.settings,
            wall=datetime.now(UTC),
            now=now,
        )
        if wanted is None:
            return False
        if lease is None:
            written = await self.api.create(namespace=namespace, name=name, spec=wanted)
        else:
            written = await self.api.replace(
                namespace=namespace,
                name=name,
                spec=wanted,
                resource_version=self._observed.resource_version if self._observed else None,
            )
        return written

    async def run(self) -> None:
        """Forever: acquire, renew every retry period, give up after the renew deadline."""
        while True:
            try:
                held = await self._attempt()
            except Exception:
                # The API server is unreachable or refused: a leader keeps trying until its deadline.
                logger.exception("leader election: the Lease could not be read or written")
                held = False
            now = time.monotonic()
            if held:
                self._renewed_at = now
                if not self.leading:
                    self.leading = True
                    metrics.LEADER.set(1)
                    metrics.LEADER_TRANSITIONS.inc()
                    logger.info(
                        "became the leader (Lease %s/%s, identity %s)",
                        self.settings.namespace,
                        self.settings.name,
                        self.settings.identity,
                    )
                    await self.on_started()
            elif self.leading and now - self._renewed_at >= self.settings.renew_deadline_s:
                await self._step_down(f"no renewal for {now - self._renewed_at:.1f}s")
            await asyncio.sleep(self.settings.retry_period_s)

    async def _step_down(self, why: str) -> None:
        self.leading = False
        metrics.LEADER.set(0)
        logger.warning("stopped leading (%s); standing by", why)
        await self.on_stopped()

    async def release(self) -> None:
        """On a clean shutdown: stop reconciling, then hand the Lease over at once (a standby
        takes it on its next attempt instead of waiting out the duration)."""
        if not self.leading:
            return
        await self._step_down("shutting down")
        observed = self._observed
        if observed is None or observed.spec.get("holderIdentity") != self.settings.identity:
            return
        lease = await self.api.read(namespace=self.settings.namespace, name=self.settings.name)
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.settings.identity:
            return
        spec = {**(lease.get("spec") or {}), "holderIdentity": "", "leaseDurationSeconds": 1}
        released = await self.api.replace(
            namespace=self.settings.namespace,
            name=self.settings.name,
            spec=spec,
            resource_version=lease.get("metadata", {}).get("resourceVersion"),
        )
        if not released:
            logger.warning("the Lease changed meanwhile: a standby takes it once it expires")
