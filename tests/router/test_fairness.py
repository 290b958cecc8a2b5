"""The router's wait queue: priority bands first, then fair shares of tokens between tenants."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from copse.router import fairness
from copse.router.fairness import MAX_IDLE_TAGS, FairQueue, HeardHeads, QueueHead, RoutedTokens


def _drain(queue: FairQueue[str]) -> list[str]:
    served = []
    while (head := queue.peek()) is not None:
        key, item = head
        assert queue.pop(key) == item
        served.append(item)
    return served


HOLD_S = 60.0
"""How long a peer's head holds this queue back after it was first sent (tests of the cap say)."""


def _held(queue: FairQueue[str], **request: Any) -> bool:
    """Whether peers' heads hold back ``queue``'s head (or the new request ``request`` names)."""
    return queue.held_until(max_hold_s=HOLD_S, **request) is not None


def test_a_higher_priority_band_is_served_first_whatever_the_arrival_order() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    queue.push("b1", "batch-1", priority=0, tenant="t", tokens=10, now=0.0)
    queue.push("p1", "premium-1", priority=100, tenant="t", tokens=10, now=0.0)
    queue.push("b2", "batch-2", priority=0, tenant="t", tokens=10, now=0.0)
    queue.push("p2", "premium-2", priority=100, tenant="u", tokens=10, now=0.0)
    assert _drain(queue) == ["premium-1", "premium-2", "batch-1", "batch-2"]


def test_a_tenant_sending_ten_times_the_requests_gets_the_same_tokens() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    for i in range(20):
        queue.push(f"heavy{i}", "heavy", priority=0, tenant="heavy", tokens=100, now=0.0)
    queue.push("light0", "light", priority=0, tenant="light", tokens=100, now=0.0)
    queue.push("light1", "light", priority=0, tenant="light", tokens=100, now=0.0)
    served = _drain(queue)
    assert served[:4].count("light") == 2, "the light tenant's requests alternate with the heavy one's"


def test_shares_are_in_tokens_not_requests() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    for i in range(10):
        queue.push(f"long{i}", "long", priority=0, tenant="long", tokens=1000, now=0.0)
        queue.push(f"short{i}", "short", priority=0, tenant="short", tokens=100, now=0.0)
    first = _drain(queue)[:11]
    assert first.count("short") == 10, "ten 100-token requests for one of 1,000 tokens"


def test_weights_scale_a_tenants_share() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda tenant: 3.0 if tenant == "gold" else 1.0)
    for i in range(30):
        queue.push(f"gold{i}", "gold", priority=0, tenant="gold", tokens=100, now=0.0)
        queue.push(f"std{i}", "std", priority=0, tenant="std", tokens=100, now=0.0)
    first = _drain(queue)[:20]
    assert first.count("gold") == 15


def test_an_idle_tenant_gets_no_credit_for_the_time_it_sent_nothing() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    for i in range(10):
        queue.push(f"a{i}", "a", priority=0, tenant="a", tokens=100, now=0.0)
    for _ in range(6):
        head = queue.peek()
        assert head is not None
        queue.pop(head[0])
    for i in range(5):
        queue.push(f"b{i}", "b", priority=0, tenant="b", tokens=100, now=0.0)
    assert _drain(queue)[:4] == ["b", "a", "b", "a"], "the newcomer alternates, no catching up"


def test_removed_requests_are_not_served_and_counts_go_by_priority_and_tenant() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    queue.push("p", "premium", priority=100, tenant="t", tokens=10, now=0.0)
    queue.push("b1", "batch-1", priority=0, tenant="t", tokens=10, now=0.0)
    queue.push("b2", "batch-2", priority=0, tenant="t", tokens=10, now=0.0)
    queue.push("u1", "other", priority=0, tenant="u", tokens=10, now=0.0)
    assert queue.count_at_or_above(100) == 1
    assert queue.count_at_or_above(0) == 4
    assert queue.holds_its_share(priority=0, tenant="t")
    assert not queue.holds_its_share(priority=0, tenant="u")
    assert not queue.holds_its_share(priority=0, tenant="new")
    assert queue.remove("u1") == "other"
    assert queue.remove("b1") == "batch-1"
    assert "b1" not in queue
    assert len(queue) == 2
    assert _drain(queue) == ["premium", "batch-2"]


def _ahead(queue: FairQueue[str], *, priority: int, tenant: str, tokens: float) -> float:
    """Tokens served before a new request is, with nobody else arriving meanwhile (a rate of 1)."""
    return queue.wait_s(priority=priority, tenant=tenant, tokens=tokens, rate=1.0, routed=None, window_s=1.0)


def _arriving(rates: dict[str, float], weight: Callable[[str], float] = lambda _: 1.0) -> RoutedTokens:
    """Tenants routed ``rates`` tokens over a window of 1 s."""
    routed = RoutedTokens()
    for tenant, rate in rates.items():
        routed.add(tenant, rate, weight=weight(tenant))
    return routed


def _wait(
    queue: FairQueue[str], *, tenant: str, tokens: float, rate: float, arriving: dict[str, float]
) -> float:
    return queue.wait_s(
        priority=0, tenant=tenant, tokens=tokens, rate=rate, routed=_arriving(arriving), window_s=1.0
    )


def test_the_tokens_ahead_of_a_new_request_count_other_tenants_only_up_to_their_share() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    for i in range(50):
        queue.push(f"heavy{i}", "heavy", priority=0, tenant="heavy", tokens=100, now=0.0)
    queue.push("p", "premium", priority=100, tenant="x", tokens=300, now=0.0)
    assert _ahead(queue, priority=0, tenant="light", tokens=100) == 300 + 100 + 100
    assert _ahead(queue, priority=0, tenant="heavy", tokens=100) == 300 + 5100
    assert _ahead(queue, priority=100, tenant="y", tokens=100) == 100 + 100, "x and y alternate"


def test_a_tenant_sending_below_its_share_meanwhile_lengthens_a_backlogged_tenants_wait() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    for i in range(10):
        queue.push(f"heavy{i}", "heavy", priority=0, tenant="heavy", tokens=100, now=0.0)
    # 1,100 tokens of heavy's at 100 tokens/s, 20 of which go to the light tenant as it sends:
    # 1,100 / (100 - 20) s, as light's 20 tokens a second stay under its share throughout
    wait = _wait(queue, tenant="heavy", tokens=100, rate=100.0, arriving={"light": 20.0})
    assert wait == pytest.approx(1100 / 80)
    # a tenant arriving faster than the rest of the fleet leaves is capped at its share: an even
    # split, after the 300 tokens it has waiting
    queue.push("l", "light", priority=0, tenant="light", tokens=300, now=0.0)
    wait = _wait(queue, tenant="heavy", tokens=100, rate=100.0, arriving={"light": 500.0})
    assert wait == pytest.approx((1100 + 1100) / 100)
    # the light tenant's wait: its own and as much of heavy's, however fast heavy sends
    wait = _wait(queue, tenant="light", tokens=100, rate=100.0, arriving={"heavy": 90.0})
    assert wait == pytest.approx((400 + 400) / 100)


_other = st.tuples(
    st.floats(0.0, 5000.0),  # waiting here
    st.floats(0.0, 5000.0),  # waiting at a peer
    st.floats(0.0, 400.0),  # arriving, tokens a second
    st.sampled_from([0.5, 1.0, 3.0]),  # weight
)


@pytest.mark.parametrize("loop_at_most", [fairness.LOOP_AT_MOST, 0], ids=["loop", "arrays"])
@settings(max_examples=300, deadline=None)
@given(
    others=st.lists(_other, max_size=12),
    own_waiting=st.floats(0.0, 3000.0),
    own_flow=st.floats(0.0, 400.0),
    tokens=st.floats(1.0, 3000.0),
    rate=st.floats(10.0, 2000.0),
    higher=st.floats(0.0, 5000.0),
)
def test_the_predicted_wait_is_where_what_the_fleet_serves_meets_what_is_ahead(
    *,
    loop_at_most: int,
    others: list[tuple[float, float, float, float]],
    own_waiting: float,
    own_flow: float,
    tokens: float,
    rate: float,
    higher: float,
) -> None:
    """Against the definition, root-found by bisection: ``rate * W`` equals the tokens ahead at
    ``W``: higher bands', the tenant's own, and each other tenant's waiting tokens plus its
    arrivals over ``W``, capped at its share (the tenant's tokens scaled by their weights); what
    the tenant itself keeps sending is not ahead. Solved in a loop for few tenants and in arrays
    for many: both."""
    weights = {f"o{i}": weight for i, (_, _, _, weight) in enumerate(others)}
    queue: FairQueue[str] = FairQueue(weight=lambda tenant: weights.get(tenant, 1.0))
    if higher:
        queue.push("premium", "premium", priority=100, tenant="p", tokens=higher, now=0.0)
    if own_waiting:
        queue.push("own", "own", priority=0, tenant="me", tokens=own_waiting, now=0.0)
    peer_heads = []
    for i, (here, there, _, _) in enumerate(others):
        if here:
            queue.push(f"o{i}", f"o{i}", priority=0, tenant=f"o{i}", tokens=here, now=0.0)
        if there:
            peer_heads.append(QueueHead(priority=0, start=0.0, tenant=f"o{i}", virtual=0.0, tokens=there))
    queue.observe_peer("b", peer_heads, now=0.0)
    arriving = {f"o{i}": flow for i, (_, _, flow, _) in enumerate(others) if flow}
    if own_flow:
        arriving["me"] = own_flow
        weights["me"] = 1.0
    with mock.patch.object(fairness, "LOOP_AT_MOST", loop_at_most):
        wait = queue.wait_s(
            priority=0,
            tenant="me",
            tokens=tokens,
            rate=rate,
            routed=_arriving(arriving, lambda tenant: weights[tenant]),
            window_s=1.0,
        )
    own = tokens + own_waiting

    def ahead(w: float) -> float:
        return (
            higher
            + own
            + sum(min(here + there + flow * w, own * weight) for here, there, flow, weight in others)
        )

    low, high = 0.0, (higher + own + sum(own * weight for *_, weight in others)) / rate
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if rate * middle < ahead(middle) else (low, middle)
    assert wait == pytest.approx(high, rel=1e-9, abs=1e-9)


def test_routed_tokens_hold_a_slot_per_tenant_in_the_window_and_free_it_with_its_last_tokens() -> None:
    routed = RoutedTokens()
    routed.add("a", 100.0, weight=2.0)
    routed.add("b", 50.0, weight=1.0)
    routed.add("a", 30.0, weight=2.0)
    assert routed.tokens("a") == 130.0
    assert routed.weighted("a") == 65.0
    routed.forget("a", 100.0)
    assert routed.tokens("a") == 30.0
    assert routed.total == 80.0
    routed.forget("a", 29.6)  # what is left is float residue: the tenant leaves the window
    assert "a" not in routed
    assert routed.tokens("a") == 0.0
    assert routed.total == 50.0
    tokens, _ = routed.arrays()
    assert tokens.sum() == 50.0, "a freed slot holds no tokens"
    routed.forget("c", 5.0)  # never routed, or left already: nothing to forget
    for i in range(20):  # past the arrays' first size: they grow, and a's slot is taken again
        routed.add(f"t{i}", 1.0 + i, weight=0.5)
    tokens, weights = routed.arrays()
    assert len(routed) == 21
    assert len(tokens) == 21
    assert tokens.sum() == routed.total == 50.0 + sum(1.0 + i for i in range(20))
    assert (tokens / weights)[routed.slots["t19"]] == 40.0
    assert routed.weighted("b") == 50.0


def test_service_a_peer_replica_gave_a_tenant_counts_against_its_share_here() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    queue.push("a0", "a", priority=0, tenant="a", tokens=100, now=0.0)
    queue.charge(priority=0, tenant="b", tokens=500)  # b was served 500 tokens by a peer
    for i in range(1, 6):
        queue.push(f"a{i}", "a", priority=0, tenant="a", tokens=100, now=0.0)
    queue.push("b0", "b", priority=0, tenant="b", tokens=100, now=0.0)
    assert _drain(queue) == ["a"] * 5 + ["b", "a"], "b waits until a has had the 500 tokens b got elsewhere"
    queue.charge(priority=0, tenant="idle", tokens=100)
    assert _ahead(queue, priority=0, tenant="idle", tokens=1) == 1, "an empty band keeps no state"


def test_a_peer_head_holds_this_one_back_by_band_then_start_tag_then_wait_for_the_same_workers() -> None:
    def held_by(
        theirs: QueueHead,
        *,
        priority: int = 0,
        start: float = 0.0,
        waited_s: float = 0.0,
        model: str = "",
        serves: Callable[[str], bool] = lambda _model: True,
    ) -> bool:
        """Whether ``theirs``, heard at 10 s, holds back a head of tenant "mine" here."""
        queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0, serves=serves)
        if start:
            queue.charge(priority=priority, tenant="mine", tokens=start)
        queue.push("m", "m", priority=priority, tenant="mine", tokens=1, now=10.0 - waited_s, model=model)
        queue.observe_peer("B", [theirs], now=10.0)
        return _held(queue, now=10.0)

    def head(priority: int, start: float, *, waited_s: float = 0.0, model: str = "") -> QueueHead:
        return QueueHead(
            priority=priority, start=start, tenant="a", virtual=0.0, waited_s=waited_s, model=model
        )

    assert held_by(head(100, 900.0), priority=0), "a higher band goes first whatever its tag"
    assert not held_by(head(0, 0.0), priority=100, start=900.0), "a lower band never overtakes"
    assert held_by(head(0, 100.0), start=200.0)
    assert not held_by(head(0, 200.0), start=100.0)
    assert held_by(head(0, 100.0, waited_s=5.0), start=100.0, waited_s=1.0), "one tag: the longer wait first"
    assert not held_by(head(0, 100.0, waited_s=1.0), start=100.0, waited_s=5.0)
    assert not held_by(head(0, 100.0, waited_s=2.0), start=100.0, waited_s=2.0), "a tie: neither waits"
    # only a request that may go to the same workers holds this one back
    assert not held_by(head(0, 0.0, model="x"), start=100.0, model="y"), "another model's workers"
    assert held_by(head(0, 0.0, model="x"), start=100.0, model="x")
    assert held_by(head(0, 0.0, model="x"), start=100.0), "this one may go to any worker"
    assert held_by(head(0, 0.0), start=100.0, model="y"), "that one may go to any worker"
    no_x = held_by(head(0, 0.0, model="x"), start=100.0, serves=lambda model: model != "x")
    assert not no_x, "no worker here serves its model"


def test_this_queue_holds_its_head_back_while_a_peer_head_comes_first() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    queue.charge(priority=0, tenant="heavy", tokens=500)  # heavy was served 500 tokens already
    queue.push("h", "heavy", priority=0, tenant="heavy", tokens=100, now=0.0)
    assert not _held(queue, now=3.0), "no peer: the head goes"
    # a peer has the light tenant waiting, served nothing yet: it comes first
    assert queue.observe_peer("B", [QueueHead(priority=0, start=0.0, tenant="light", virtual=0.0)], now=1.0)
    assert _held(queue, now=3.0)
    assert _held(queue, now=3.0, priority=0, tenant="heavy"), "so does a new heavy request"
    assert not _held(queue, now=3.0, priority=100, tenant="heavy"), "a higher band does not wait"
    assert not queue.observe_peer(
        "B", [QueueHead(priority=0, start=0.0, tenant="light", virtual=0.0)], now=1.5
    ), "heard again, unchanged"
    # the peer served it: the light tenant's virtual time moves past heavy's, and its next head is later
    queue.charge(priority=0, tenant="light", tokens=700)
    assert queue.observe_peer("B", [QueueHead(priority=0, start=700.0, tenant="light", virtual=0.0)], now=2.0)
    assert not _held(queue, now=3.0)
    assert queue.heads(now=3.0) == [
        QueueHead(priority=0, start=500.0, tenant="heavy", virtual=0.0, tokens=100.0)
    ]
    # a premium request waiting at the peer holds back every band below it
    queue.observe_peer("B", [QueueHead(priority=100, start=0.0, tenant="x", virtual=0.0)], now=2.5)
    assert _held(queue, now=3.0)
    queue.forget_peer("B")
    assert not _held(queue, now=3.0)


def test_a_silent_peers_heads_stop_holding_dispatch_back_after_the_timeout() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    queue.charge(priority=0, tenant="heavy", tokens=500)
    queue.push("h", "heavy", priority=0, tenant="heavy", tokens=100, now=0.0)
    queue.observe_peer("B", [QueueHead(priority=0, start=0.0, tenant="light", virtual=0.0)], now=10.0)
    queue.forget_stale_peers(now=12.9, max_age_s=3.0)
    assert _held(queue, now=12.9), "heard 2.9 s ago: still holds"
    queue.forget_stale_peers(now=13.1, max_age_s=3.0)
    assert not _held(queue, now=13.1), "silent for longer than the timeout: ignored"


def test_a_tenant_backlogged_at_a_peer_keeps_its_virtual_time_when_it_starts_waiting_here() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    queue.charge(priority=0, tenant="a", tokens=1000)  # V is now 0, a's virtual time 1,000
    queue.charge(priority=0, tenant="b", tokens=100)
    queue.charge(priority=0, tenant="a", tokens=100)  # V 1,000
    queue.observe_peer("B", [QueueHead(priority=0, start=100.0, tenant="b", virtual=1000.0)], now=0.0)
    queue.push("b", "b", priority=0, tenant="b", tokens=10, now=0.0)
    assert queue.heads(now=3.0)[0].start == 100.0, "b waits at the peer: not lifted to V here"
    queue.push("c", "c", priority=0, tenant="c", tokens=10, now=0.0)
    assert queue.heads(now=3.0)[1] == QueueHead(
        priority=0, start=1000.0, tenant="c", virtual=1000.0, tokens=10.0
    ), "c waits nowhere: it starts at V"


def test_a_tenant_waits_while_it_has_a_request_queued_here_or_at_a_peer() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    queue.push("a0", "a0", priority=0, tenant="a", tokens=10, now=0.0)
    queue.observe_peer("B", [QueueHead(priority=0, start=0.0, tenant="b", virtual=0.0)], now=0.0)
    assert queue.waits(priority=0, tenant="a")
    assert queue.waits(priority=0, tenant="b")
    assert not queue.waits(priority=100, tenant="a"), "by band"
    assert not queue.waits(priority=0, tenant="c")
    queue.pop("a0")
    queue.forget_peer("B")
    assert not queue.waits(priority=0, tenant="a")
    assert not queue.waits(priority=0, tenant="b")


def test_the_tokens_ahead_count_what_waits_at_peer_replicas_too() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    queue.push("h", "heavy", priority=0, tenant="heavy", tokens=100, now=0.0)
    peer = [
        QueueHead(priority=100, start=0.0, tenant="x", virtual=0.0, tokens=300.0),
        QueueHead(priority=0, start=0.0, tenant="heavy", virtual=0.0, tokens=5000.0),
        QueueHead(priority=0, start=0.0, tenant="light", virtual=0.0, tokens=50.0),
    ]
    queue.observe_peer("B", peer, now=0.0)
    # higher band at the peer, then heavy's tokens here and there up to the light tenant's own
    assert _ahead(queue, priority=0, tenant="light", tokens=100) == 300 + 150 + 150
    assert _ahead(queue, priority=0, tenant="heavy", tokens=100) == 300 + 50 + 5200


def test_of_one_tenants_requests_at_two_replicas_the_one_that_waited_longer_goes_first() -> None:
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    queue.push("h", "heavy", priority=0, tenant="heavy", tokens=100, now=10.0)
    # the peer's heavy request had waited 4 s when heard at 11 s: queued at 7 s, before ours
    queue.observe_peer(
        "B", [QueueHead(priority=0, start=0.0, tenant="heavy", virtual=0.0, waited_s=4.0)], now=11.0
    )
    assert _held(queue, now=12.0)
    assert _held(queue, now=12.0, priority=0, tenant="heavy"), "so does a new heavy request"
    # heard again: it had waited 1 s (a newer request), queued at 11.5 s, after ours
    assert not queue.observe_peer(
        "B", [QueueHead(priority=0, start=0.0, tenant="heavy", virtual=0.0, waited_s=1.0)], now=12.5
    ), "the same head, aged: no change"
    assert not _held(queue, now=13.0)


def test_two_replicas_never_hold_each_other_back() -> None:
    """The light tenant's virtual time differs between the replicas (it was lifted at one): once
    they exchange heads it is the same at both, and of the heavy tenant's two waiting requests
    the older goes first, so exactly one replica waits."""
    a: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    b: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    for queue in (a, b):
        queue.charge(priority=0, tenant="heavy", tokens=40)
    a.charge(priority=0, tenant="light", tokens=50)
    b.charge(priority=0, tenant="light", tokens=30)
    a.push("heavy-a", "heavy", priority=0, tenant="heavy", tokens=10, now=4.0)
    a.push("light-a", "light", priority=0, tenant="light", tokens=10, now=0.0)
    b.push("heavy-b", "heavy", priority=0, tenant="heavy", tokens=10, now=0.0)
    b.push("light-b", "light", priority=0, tenant="light", tokens=10, now=4.0)
    a.observe_peer("b", b.heads(now=5.0), now=5.0)
    b.observe_peer("a", a.heads(now=5.0), now=5.0)
    assert [head.start for head in b.heads(now=5.0) if head.tenant == "light"] == [50.0]
    assert _held(a, now=5.0), "b's heavy request has waited longer"
    assert not _held(b, now=5.0)


def test_the_virtual_times_of_tenants_waiting_nowhere_are_bounded() -> None:
    """Tenant names come from a request header: however many tenants are served while nothing
    waits, a band keeps the tags of at most MAX_IDLE_TAGS of them, those furthest past V."""
    queue: FairQueue[str] = FairQueue(weight=lambda tenant: 1.0)
    queue.charge(priority=0, tenant="heavy", tokens=100_000.0)
    for i in range(10 * MAX_IDLE_TAGS):
        queue.charge(priority=0, tenant=f"t{i}", tokens=100.0)
    served = queue._bands[0].served
    assert len(served) <= 2 * MAX_IDLE_TAGS + 1
    assert "heavy" in served, "the largest debt is kept"
    queue.push("h", "heavy", priority=0, tenant="heavy", tokens=100.0, now=0.0)
    queue.push("n", "new", priority=0, tenant="new", tokens=100.0, now=0.0)
    assert _drain(queue) == ["new", "heavy"]


def test_a_peer_head_sent_unchanged_for_longer_than_the_cap_holds_nothing_back() -> None:
    """A peer that keeps heartbeating a head it cannot route (no worker it may use takes it) holds
    this queue back only for max_hold_s, not for as long as the peer lives."""
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    queue.charge(priority=0, tenant="heavy", tokens=500)
    queue.push("h", "heavy", priority=0, tenant="heavy", tokens=100, now=0.0)
    for t in (10.0, 11.0, 12.0, 13.0):
        stuck = [QueueHead(priority=0, start=0.0, tenant="light", virtual=0.0, waited_s=t - 10.0)]
        queue.observe_peer("B", stuck, now=t)
    assert queue.held_until(now=12.9, max_hold_s=3.0) == 13.0, "first sent 2.9 s ago: holds until 13 s"
    assert queue.held_until(now=13.1, max_hold_s=3.0) is None, "the same head for longer: ignored"
    moved = [QueueHead(priority=0, start=0.0, tenant="other", virtual=0.0)]
    queue.observe_peer("B", moved, now=13.2)
    assert queue.held_until(now=13.3, max_hold_s=3.0) == 16.2, "a new head holds again"


def test_a_stuck_peer_head_holds_nothing_back_past_the_cap_though_its_tenant_is_served_meanwhile() -> None:
    """The cap runs from when the peer first sent its request, not its start tag: the tag moves
    each time the fleet serves the tenant, and the same stuck request would hold this queue back
    anew each time (for 3 s from 4.1 s here) were it a new head."""
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    queue.charge(priority=0, tenant="heavy", tokens=5000)
    queue.push("h", "heavy", priority=0, tenant="heavy", tokens=100, now=0.0)

    def b_sends(*, start: float, now: float) -> None:
        head = QueueHead(priority=0, start=start, tenant="light", virtual=0.0, waited_s=now)
        queue.observe_peer("B", [head], now=now)

    b_sends(start=0.0, now=0.0)
    b_sends(start=0.0, now=1.0)
    assert queue.held_until(now=2.9, max_hold_s=3.0) == 3.0
    b_sends(start=0.0, now=4.0)
    assert queue.held_until(now=4.0, max_hold_s=3.0) is None, "the same request for longer: ignored"
    queue.charge(priority=0, tenant="light", tokens=2000)  # this replica routed one of light's
    b_sends(start=2000.0, now=4.1)  # B still holds the same request, its tag moved on
    assert queue.held_until(now=4.2, max_hold_s=3.0) is None, "still the same request"
    head = QueueHead(priority=0, start=2000.0, tenant="light", virtual=0.0, waited_s=0.5)
    queue.observe_peer("B", [head], now=6.0)  # B routed it; light's next request, queued at 5.5 s
    assert queue.held_until(now=6.1, max_hold_s=3.0) == 9.0, "a new request holds again"


def test_heads_observed_late_keep_when_their_requests_were_first_heard() -> None:
    """A peer's heads that waited before they could be observed (its snapshot pending) are
    observed as heard: a stuck request the peer sent at 10 s and again at 11 s holds this queue
    back until 10 s plus the cap, though observed only at 11 s (with what was heard at 10 s)."""
    queue: FairQueue[str] = FairQueue(weight=lambda _: 1.0)
    queue.charge(priority=0, tenant="heavy", tokens=500)
    queue.push("h", "heavy", priority=0, tenant="heavy", tokens=100, now=9.0)
    stuck = QueueHead(priority=0, start=0.0, tenant="light", virtual=0.0)
    first = HeardHeads(heard=10.0, heads=[stuck])
    queue.observe_peer("B", [dataclasses.replace(stuck, waited_s=1.0)], now=11.0, earlier=[first])
    assert queue.held_until(now=11.5, max_hold_s=3.0) == 13.0
