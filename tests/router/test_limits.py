"""Per-tenant token buckets."""

from __future__ import annotations

import pytest

from copse.router.limits import TenantLimits


def test_a_bucket_refills_at_the_tenants_rate_and_unlisted_tenants_get_the_default() -> None:
    limits = TenantLimits(tokens_per_minute={"a": 600.0}, default_tokens_per_minute=60.0)
    assert limits.wait_s("a", 600, now=0.0) == 0.0
    limits.take("a", 600, now=0.0)
    assert limits.wait_s("a", 100, now=0.0) == pytest.approx(10.0), "600 a minute: 10 tokens a second"
    assert limits.wait_s("a", 100, now=10.0) == 0.0
    assert limits.limit("b") == 60.0
    assert TenantLimits(tokens_per_minute={}).limit("b") is None


def test_a_request_larger_than_a_minutes_allowance_passes_once_the_bucket_is_full() -> None:
    limits = TenantLimits(tokens_per_minute={"a": 100.0})
    assert limits.wait_s("a", 1000, now=0.0) == 0.0
    limits.take("a", 1000, now=0.0)
    assert limits.wait_s("a", 1000, now=60.0) == pytest.approx(540.0), "the debt of 900 tokens first"


def test_full_buckets_are_forgotten_when_too_many_are_held() -> None:
    limits = TenantLimits(tokens_per_minute={}, default_tokens_per_minute=60.0, max_tracked=2)
    limits.take("t1", 60, now=0.0)
    limits.take("t2", 60, now=0.0)
    limits.take("t3", 60, now=120.0)  # t1 and t2 refilled long ago: a full bucket is no bucket
    assert len(limits) == 1
    assert limits.wait_s("t1", 60, now=120.0) == 0.0
