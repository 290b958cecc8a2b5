"""The operator's liveness figures: the reconcile queue, and a stuck loop reported as such."""

from __future__ import annotations

import pytest

from copse.operator.controller import Controller, Stalled

from .fake_cluster import FakeKube


def test_health_counts_the_queue_and_fails_when_due_work_waits_too_long() -> None:
    controller = Controller(kube=FakeKube(), stalled_after_s=30.0)
    assert controller.health() == {"queued": 0.0, "oldest_due_s": 0.0}
    controller.mark(("serving", "later"), after_s=600.0)  # a backoff: not due, not late
    controller.mark(("serving", "llama"), after_s=-2.0)  # due two seconds ago
    health = controller.health()
    assert health["queued"] == 2.0
    assert 2.0 <= health["oldest_due_s"] < 30.0
    controller.mark(("serving", "stuck"), after_s=-31.0)
    with pytest.raises(Stalled, match=r"waited 31 s for its reconcile pass \(more than 30 s\)"):
        controller.health()
