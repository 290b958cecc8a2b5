"""Per-tenant rate limits in tokens per minute (token buckets), pure: the caller gives the clock.

A tenant's bucket holds up to one minute of its rate and refills continuously. A request is let
through when its tokens (prompt plus ``max_tokens``) are in the bucket, or when the bucket is full
(a request larger than a minute's allowance still passes once a minute instead of never); it then
takes them, possibly leaving a debt that delays the tenant's next requests.

Tenant names come from clients, so buckets are bounded: a full bucket is the same as none, and
full buckets are forgotten whenever more than ``max_tracked`` are held.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping


@dataclasses.dataclass(slots=True)
class _Bucket:
    level: float
    updated: float


class TenantLimits:
    """Token buckets per tenant; see the module documentation."""

    def __init__(
        self,
        *,
        tokens_per_minute: Mapping[str, float],
        default_tokens_per_minute: float | None = None,
        max_tracked: int = 10_000,
    ) -> None:
        """``tokens_per_minute``: limits of named tenants; ``default_tokens_per_minute``: of every
        other tenant (``None``: unlimited)."""
        self._limits = dict(tokens_per_minute)
        self._default = default_tokens_per_minute
        self._max_tracked = max_tracked
        self._buckets: dict[str, _Bucket] = {}

    def limit(self, tenant: str) -> float | None:
        """Tokens per minute ``tenant`` may send (``None``: unlimited)."""
        return self._limits.get(tenant, self._default)

    def _level(self, tenant: str, per_minute: float, now: float) -> float:
        bucket = self._buckets.get(tenant)
        if bucket is None:
            return per_minute
        return min(per_minute, bucket.level + (now - bucket.updated) * per_minute / 60.0)

    def wait_s(self, tenant: str, tokens: float, *, now: float) -> float:
        """Seconds until ``tenant`` may send a request of ``tokens`` tokens (0: now)."""
        per_minute = self.limit(tenant)
        if per_minute is None:
            return 0.0
        level = self._level(tenant, per_minute, now)
        needed = min(tokens, per_minute)
        if level >= needed:
            return 0.0
        return (needed - level) * 60.0 / per_minute

    def take(self, tenant: str, tokens: float, *, now: float) -> None:
        """Charge ``tenant`` for a request of ``tokens`` tokens let through at ``now``."""
        per_minute = self.limit(tenant)
        if per_minute is None:
            return
        level = self._level(tenant, per_minute, now) - tokens
        if len(self._buckets) >= self._max_tracked and tenant not in self._buckets:
            self._forget_full(now)
        self._buckets[tenant] = _Bucket(level=level, updated=now)

    def _forget_full(self, now: float) -> None:
        for tenant in list(self._buckets):
            per_minute = self.limit(tenant)
            if per_minute is None or math.isclose(self._level(tenant, per_minute, now), per_minute):
                del self._buckets[tenant]

    def __len__(self) -> int:
        """Buckets held (tenants that sent within the last minute or so)."""
        return len(self._buckets)
