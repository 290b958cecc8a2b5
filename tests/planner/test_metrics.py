"""The planner's own metrics: correction factors and their clamp hits are exported, never silent."""

from __future__ import annotations

import dataclasses

from copse.api import Role
from copse.planner.capacity import CapacityModel, Corrections
from copse.planner.core import Decision
from copse.planner.metrics import CORRECTION_CLAMPED, CORRECTION_FACTOR, SCALE_UPS, SIZED_GOAL, PlannerMetrics


def test_correction_factors_and_clamp_hits_are_exported(linear: CapacityModel) -> None:
    metrics = PlannerMetrics()
    decision = Decision(
        time=0.0,
        current={Role.WORKER: 2},
        target={Role.WORKER: 2},
        sized={},
        forecast=None,
        next_forecast=None,
        corrections=Corrections(prefill=2.0, decode=1.1),
        reasons=(),
        margin=1.0,
        goal=0.98,
        clamped=("prefill",),
    )
    metrics.record(decision, namespace="ns", deployment="llm", now=1.0)
    metrics.record(dataclasses.replace(decision, clamped=()), namespace="ns", deployment="llm", now=2.0)

    def value(name: str, phase: str) -> float | None:
        labels = {"namespace": "ns", "deployment": "llm", "phase": phase}
        return metrics.registry.get_sample_value(name, labels)

    assert value(CORRECTION_FACTOR, "prefill") == 2.0
    assert value(CORRECTION_FACTOR, "decode") == 1.1
    assert value(f"{CORRECTION_CLAMPED}_total", "prefill") == 1.0
    assert value(f"{CORRECTION_CLAMPED}_total", "decode") == 0.0
    assert metrics.registry.get_sample_value(SIZED_GOAL, {"namespace": "ns", "deployment": "llm"}) == 0.98


def test_scale_ups_are_counted_by_what_set_them() -> None:
    metrics = PlannerMetrics()
    base = Decision(
        time=0.0,
        current={Role.PREFILL: 2, Role.DECODE: 2},
        target={Role.PREFILL: 3, Role.DECODE: 3},
        sized={},
        forecast=None,
        next_forecast=None,
        corrections=Corrections(prefill=1.0, decode=1.0),
        reasons=(),
        margin=1.0,
        goal=0.99,
        raised_by={Role.PREFILL: "backlog"},
    )
    metrics.record(base, namespace="ns", deployment="llm", now=1.0)
    held = dataclasses.replace(base, target={Role.PREFILL: 2, Role.DECODE: 1})
    metrics.record(held, namespace="ns", deployment="llm", now=2.0)  # no increase: nothing counted

    def ups(role: str, trigger: str) -> float | None:
        labels = {"namespace": "ns", "deployment": "llm", "role": role, "trigger": trigger}
        return metrics.registry.get_sample_value(f"{SCALE_UPS}_total", labels)

    assert ups("prefill", "backlog") == 1.0
    assert ups("decode", "forecast") == 1.0
    assert ups("prefill", "forecast") is None
