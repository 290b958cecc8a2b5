"""The operator's liveness figures: the reconcile queue, and a stuck loop reported as such."""

from __future__ import annotations

import asyncio

import pytest

from copse.operator.controller import Controller, Stalled

from .fake_cluster import FakeKube


def test_health_counts_the_queue_and_fails_when_due_work_waits_too_long() -> None:
    controller = Controller(kube=FakeKube(), stalled_after_s=30.0)
    assert controller.health() == {"queued": 0.0, "oldest_due_s": 0.0, "pass_running_s": 0.0}
    controller.mark(("serving", "later"), after_s=600.0)  # a backoff: not due, not late
    controller.mark(("serving", "llama"), after_s=-2.0)  # due two seconds ago
    health = controller.health()
    assert health["queued"] == 2.0
    assert 2.0 <= health["oldest_due_s"] < 30.0
    controller.mark(("serving", "stuck"), after_s=-31.0)
    with pytest.raises(Stalled, match=r"waited 31 s for its reconcile pass \(more than 30 s\)"):
        controller.health()


async def test_health_fails_when_one_pass_hangs() -> None:
    kube = FakeKube()
    controller = Controller(kube=kube, stalled_after_s=0.05)
    hang = asyncio.Event()

    async def hung_pass(key: tuple[str, str]) -> float | None:
        await hang.wait()  # an API call that never returns
        return None

    controller.reconcile_once = hung_pass  # type: ignore[method-assign]
    task = asyncio.create_task(controller._reconcile_safely(("serving", "llama")))

    async def stalled() -> str:
        while True:
            try:
                controller.health()
            except Stalled as exc:
                return str(exc)
            await asyncio.sleep(0.01)

    assert "a reconcile pass has run for" in await asyncio.wait_for(stalled(), timeout=5.0)
    hang.set()
    await task
    assert controller.health()["pass_running_s"] == 0.0


async def test_the_reconcile_loop_ends_when_it_is_cancelled_as_work_arrives() -> None:
    """Losing the lease cancels the loop; a deployment marked at that moment must not keep it
    running (Python 3.11's wait_for returned normally then, and the loop went on forever)."""
    controller = Controller(kube=FakeKube(), stalled_after_s=30.0)
    controller.mark(("serving", "later"), after_s=600.0)  # the loop waits for it, or a wake-up
    task = asyncio.create_task(controller.run())
    async with asyncio.timeout(60.0):
        while not controller._wakeup._waiters:  # the loop reaches its wait
            await asyncio.sleep(0)
    controller.mark(("serving", "llama"), after_s=600.0)
    task.cancel()
    await asyncio.wait({task}, timeout=60.0)
    assert task.cancelled()
