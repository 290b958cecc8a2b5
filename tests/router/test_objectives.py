"""A request's objective and tenant from its headers."""

from __future__ import annotations

import hashlib

from copse.router.clients import tenant_of
from copse.router.objectives import Classes, Objective


def test_the_api_key_names_the_tenant_before_the_fairness_id_and_is_never_kept() -> None:
    digest = hashlib.sha256(b"sk-secret").hexdigest()[:16]
    both = {"authorization": "Bearer sk-secret", "x-gateway-inference-fairness-id": "team-a"}
    assert tenant_of(both) == f"key-{digest}"
    assert tenant_of({"x-gateway-inference-fairness-id": " team-a "}) == "team-a"
    long_id = hashlib.sha256(b"x" * 500).hexdigest()[:16]
    assert tenant_of({"x-gateway-inference-fairness-id": "x" * 500}) == f"id-{long_id}"
    assert tenant_of({"authorization": "Basic abc"}) == ""
    assert tenant_of({}) == ""


def test_objectives_come_by_name_and_unknown_names_get_the_default() -> None:
    classes = Classes(
        objectives={"premium": Objective(name="premium", priority=100, ttft_ms=2000)},
        default=Objective(name="", priority=5),
        weights={"team-a": 2.0},
    )
    premium, tenant = classes.of(
        {"x-gateway-inference-objective": "premium", "x-gateway-inference-fairness-id": "t"}
    )
    assert (premium.priority, premium.ttft_ms, tenant) == (100, 2000, "t")
    assert classes.objective("nope") is classes.default
    assert classes.objective(None) is classes.default
    assert classes.default.priority == 5
    assert (classes.weight("team-a"), classes.weight("team-b")) == (2.0, 1.0)
