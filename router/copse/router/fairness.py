"""The router's wait queue: priority bands, and weighted fair queuing on tokens between tenants,
across router replicas.

Requests wait here while every worker is saturated. The queue serves the highest priority band
that holds a request (the ``InferenceObjective``'s ``spec.priority``: higher is more important);
within a band it shares what it serves between tenants by start-time fair queuing on tokens
(prompt plus expected output), so that a tenant sending long prompts does not get more of the
fleet than one sending short ones, and one sending ten times as many requests gets no more than
its weight's share while the others have requests waiting.

Start-time fair queuing (Goyal et al., 1996), with the tags kept per tenant: a band keeps a
virtual time ``V``, the start tag of the request it served last; each tenant keeps a virtual
time ``T``, the weighted tokens it was served. A tenant's oldest waiting request starts at its
``T``; the band serves the lowest start, and serving ``tokens`` to a tenant of weight ``w`` moves
``V`` up to its start and its ``T`` on by ``tokens / w``. A tenant that starts waiting has its
``T`` lifted to ``V``: it gets no credit for the time it sent nothing, and a backlogged tenant is
never starved by one that returns. (On one queue this is the textbook algorithm: a backlogged
tenant's successive requests start where the previous one finished.)

Because ``T`` counts what a tenant was *served*, not what it queued, replicas sharing a fleet
keep the same ``T``: each counts what it serves itself and what its peers say they served
(:meth:`FairQueue.charge`), so start tags mean the same at every replica. On that ground the
replicas share their queues' heads (:class:`QueueHead`: per band and waiting tenant, its start
tag, its waiting tokens, how long its oldest request has waited and the model it asks for, and the
band's ``V``). A replica catches its ``V`` and its tenants' ``T`` up with what its peers send (a
tenant lifted where it started waiting is lifted everywhere), and holds back its head while a
peer's head that competes for the same workers comes first in one order shared by every replica
(:func:`_order`: a higher band, then the lower start tag, then the longer wait), so capacity a
finished request frees goes to the request first across all replicas, not to the replica that
dispatches first. Each replica serves its own part of that order in that order, so the replica
holding its first request never waits. A head holds others back for at most ``max_hold_s``
after its peer first sent its request, whatever its start tag became since
(:meth:`FairQueue.held_until` says when that hold lapses): a head a peer cannot route, or a dead
or cut-off peer, never holds dispatch back for longer (nor does a head that is merely slow to
go: the cap ends any hold). A head for
another model, or for a model no worker of this replica serves, holds nothing back here.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from copse.router.cost import FloatArray

T = TypeVar("T")

MAX_IDLE_TAGS = 256
"""Per band, at most this many virtual times of tenants waiting nowhere are kept (those served
furthest past ``V``): tenant names come from a request header, and while nothing waits ``V`` does
not move, so tags past it would otherwise pile up without limit. A tenant forgotten starts at
``V`` again: it loses the least debt of those kept."""


@dataclasses.dataclass(frozen=True, slots=True)
class QueueHead:
    """The request a replica's queue serves next in one band, as peers see it."""

    priority: int
    start: float
    """Its start tag: its tenant's virtual time (weighted tokens served, see the module)."""
    tenant: str
    virtual: float
    """The band's virtual time at the replica (peers catch up to the highest)."""
    tokens: float = 0.0
    """Tokens of the tenant's requests waiting in the band at the replica (what peers count
    ahead of a new request when they predict its wait)."""
    waited_s: float = dataclasses.field(default=0.0, compare=False)
    """How long the request had waited when the replica sent it (an age, not a time: replicas'
    clocks need not agree); a tenant's older request goes first, wherever it waits. Not part of
    equality: heads that only aged are the same heads."""
    model: str = ""
    """The base model the request asks for ("": any worker): a head competes only with requests
    that may go to the same workers."""


def _order(*, priority: int, start: float, waited_s: float) -> tuple[int, float, float]:
    """Where a request stands in the one order every replica serves in: a higher priority never
    waits for a lower one; within a band the lower start tag goes first, then the request that has
    waited longer (one tenant's requests at two replicas share its start tag). Each replica serves
    its own part of that order in that order, so no two replicas ever wait for each other; a tie
    holds neither back."""
    return (-priority, start, -waited_s)


def _competes(theirs: str, mine: str) -> bool:
    """Whether requests for the models ``theirs`` and ``mine`` may go to the same workers."""
    return not theirs or not mine or theirs == mine


@dataclasses.dataclass(slots=True)
class _Waiting(Generic[T]):
    key: str
    item: T
    tenant: str
    tokens: float
    queued: float
    """When it was queued (the caller's clock)."""
    model: str


@dataclasses.dataclass(slots=True)
class _Band(Generic[T]):
    """One priority's requests, per tenant in arrival order."""

    virtual: float = 0.0
    """Start tag of the request served last in this band (here or at a peer)."""
    served: dict[str, float] = dataclasses.field(default_factory=dict)
    """Each tenant's virtual time; a tenant at or below ``virtual`` that waits nowhere here is
    left out (it would start at ``virtual`` anyway)."""
    tenants: dict[str, deque[_Waiting[T]]] = dataclasses.field(default_factory=dict)
    heads: list[tuple[float, float, int, str]] = dataclasses.field(default_factory=list)
    """(start tag, when its oldest request was queued, order, tenant) of each waiting tenant:
    the band serves the lowest start, then the longest waiting; stale entries are skipped."""
    tokens: float = 0.0
    """Tokens of the requests waiting in the band."""
    tenant_tokens: dict[str, float] = dataclasses.field(default_factory=dict)
    """Per waiting tenant, the tokens of its requests waiting in the band."""
    count: int = 0
    """Requests waiting in the band."""


class RoutedTokens:
    """The tokens each tenant of one priority band was routed over a window, and its weight, in
    arrays with a slot per tenant: a shared fleet may see thousands of tenants at once, and the
    questions asked on every request then cost one pass in compiled code, not one in Python per
    tenant. A tenant that leaves the window frees its slot, which holds no tokens until reused
    (so it weighs nothing in a sum over the arrays)."""

    __slots__ = ("_free", "_tokens", "_used", "_weights", "slots", "total")

    def __init__(self) -> None:
        self.slots: dict[str, int] = {}
        """Tenant -> its slot in the arrays."""
        self.total = 0.0
        """The tokens of every tenant."""
        self._tokens: FloatArray = np.zeros(8)
        self._weights: FloatArray = np.ones(8)
        self._used = 0
        """Slots ever handed out (the arrays' live prefix)."""
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, tenant: object) -> bool:
        return tenant in self.slots

    def tokens(self, tenant: str) -> float:
        """The tokens ``tenant`` was routed over the window (0 when none)."""
        slot = self.slots.get(tenant)
        return 0.0 if slot is None else float(self._tokens[slot])

    def weight(self, tenant: str) -> float:
        """``tenant``'s weight (1 when not routed)."""
        slot = self.slots.get(tenant)
        return 1.0 if slot is None else float(self._weights[slot])

    def weighted(self, tenant: str) -> float:
        """The tokens ``tenant`` was routed over the window, over its weight (0 when none)."""
        slot = self.slots.get(tenant)
        return 0.0 if slot is None else float(self._tokens[slot] / self._weights[slot])

    def add(self, tenant: str, tokens: float, *, weight: float) -> None:
        """``tenant``, of weight ``weight``, was routed ``tokens`` more."""
        slot = self.slots.get(tenant)
        if slot is None:
            slot = self.slots[tenant] = self._take()
            self._weights[slot] = weight
        self._tokens[slot] += tokens
        self.total += tokens

    def forget(self, tenant: str, tokens: float) -> None:
        """``tokens`` of ``tenant``'s left the window; the tenant leaves with its last one (up to
        float residue and sub-token entries)."""
        slot = self.slots.get(tenant)
        if slot is None:
            return
        held = float(self._tokens[slot])
        left = held - tokens
        if left > 0.5:
            self._tokens[slot] = left
            self.total -= tokens
        else:
            self.total -= held
            self._tokens[slot], self._weights[slot] = 0.0, 1.0
            del self.slots[tenant]
            self._free.append(slot)

    def arrays(self) -> tuple[FloatArray, FloatArray]:
        """Every slot's tokens and weight (views: read, do not write)."""
        return self._tokens[: self._used], self._weights[: self._used]

    def outside(self, tenants: Iterable[str]) -> npt.NDArray[np.bool_]:
        """Per slot of :meth:`arrays`, whether its tenant is none of ``tenants``."""
        mask = np.ones(self._used, dtype=bool)
        mask[[self.slots[tenant] for tenant in tenants if tenant in self.slots]] = False
        return mask

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        if self._used == len(self._tokens):
            self._tokens = np.concatenate((self._tokens, np.zeros(self._used)))
            self._weights = np.concatenate((self._weights, np.ones(self._used)))
        self._used += 1
        return self._used - 1


SAME_REQUEST_S = 0.25
"""Two heads of one tenant and band a peer sent are its same request when their arrivals (when
heard less how long it had waited) differ by at most this much, s: what delivery delays vary by.
Its start tag is no mark of it, as it moves whenever the fleet serves the tenant."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Sent:
    arrived: float
    """When the request arrived at the peer, on this replica's clock (heard less waited)."""
    first: float
    """When the peer first sent it: it holds nothing back past that plus the cap."""


@dataclasses.dataclass(slots=True)
class _PeerHeads:
    heads: tuple[QueueHead, ...]
    heard: float
    since: dict[tuple[int, str], _Sent]
    """Per head (band, tenant), the request it names and when the peer first sent it: a request
    the peer keeps sending is stuck there (it cannot be routed), and holds nothing back for long,
    however often the fleet serves its tenant meanwhile."""


def _key(head: QueueHead) -> tuple[int, str]:
    return (head.priority, head.tenant)


class HeardHeads(NamedTuple):
    """A peer's queue heads as heard."""

    heard: float
    """When they were heard (the caller's clock)."""
    heads: Sequence[QueueHead]


def _sent(head: QueueHead, before: _Sent | None, *, now: float) -> _Sent:
    """``head`` heard at ``now``: the same request as ``before`` (its first sending kept), or a new one."""
    arrived = now - head.waited_s
    if before is not None and abs(before.arrived - arrived) <= SAME_REQUEST_S:
        return before
    return _Sent(arrived=arrived, first=now)


def _since(
    heads: Sequence[QueueHead], before: dict[tuple[int, str], _Sent], *, now: float
) -> dict[tuple[int, str], _Sent]:
    """Per head of ``heads`` heard at ``now``, its request and when the peer first sent it."""
    return {_key(head): _sent(head, before.get(_key(head)), now=now) for head in heads}


LOOP_AT_MOST = 48
"""Up to this many other tenants in a band, :meth:`FairQueue.wait_s` solves in a loop; past it,
in arrays (numpy's cost per call, tens of microseconds for the dozen arrays, is more than the
loop's below it)."""


def _water_level(*, fixed: float, rate: float, others: Iterable[tuple[float, float, float]]) -> float:
    """The wait ``W`` where ``rate * W`` meets what is served ahead: ``fixed`` tokens, and for each
    other tenant (its waiting tokens, its arrivals a second, its share) its waiting tokens plus its
    arrivals over ``W``, up to its share. What is ahead grows linearly between two tenants
    reaching their shares, so ``W`` is where the segment crossing ``rate * W`` does: one sort of
    the times they reach them. ``rate`` must be positive and ``fixed`` too (the request's own
    tokens): the crossing is then unique and finite."""
    growing: list[tuple[float, float, float, float]] = []  # (reaches its share at, waiting, arrivals, share)
    for theirs, flow, share in others:
        if theirs >= share:
            fixed += share
        elif flow <= 0.0 or math.isinf(reach_s := (share - theirs) / flow):
            fixed += theirs  # it never reaches its share (or too slowly for a float to tell)
        else:
            growing.append((reach_s, theirs, flow, share))
    growing.sort()
    shares_before, theirs_after, flow_after = 0.0, sum(g[1] for g in growing), sum(g[2] for g in growing)
    for reach_s, theirs, flow, share in growing:
        if rate * reach_s >= fixed + shares_before + theirs_after + flow_after * reach_s:
            break
        shares_before, theirs_after, flow_after = (
            shares_before + share,
            theirs_after - theirs,
            flow_after - flow,
        )
    else:
        theirs_after = flow_after = 0.0  # every one capped (no float residue left)
    return (fixed + shares_before + theirs_after) / (rate - flow_after)


def _water_level_of_arrays(
    *, fixed: float, rate: float, theirs: FloatArray, flow: FloatArray, share: FloatArray
) -> float:
    """:func:`_water_level` of many other tenants, their figures in arrays (cumulative sums in
    place of the loop)."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        reach_s = (share - theirs) / flow
    capped = theirs >= share
    steady = capped | ~np.isfinite(reach_s)
    fixed += float(np.where(capped, share, theirs)[steady].sum())
    order = np.argsort(reach_s[~steady], kind="stable")
    reach_s, theirs, flow, share = (values[~steady][order] for values in (reach_s, theirs, flow, share))
    # With the first k of them capped: their shares, and the others' waiting tokens and flow.
    shares_before = np.concatenate(([0.0], np.cumsum(share)))
    theirs_after = np.concatenate((np.cumsum(theirs[::-1])[::-1], [0.0]))
    flow_after = np.concatenate((np.cumsum(flow[::-1])[::-1], [0.0]))
    ahead = fixed + shares_before[:-1] + theirs_after[:-1] + flow_after[:-1] * reach_s
    crossed = np.flatnonzero(rate * reach_s >= ahead)
    k = int(crossed[0]) if len(crossed) else len(reach_s)
    return float((fixed + shares_before[k] + theirs_after[k]) / (rate - flow_after[k]))


class FairQueue(Generic[T]):
    """Waiting requests by priority band, fair between tenants within a band and across router
    replicas (see the module)."""

    def __init__(
        self, *, weight: Callable[[str], float], serves: Callable[[str], bool] = lambda _model: True
    ) -> None:
        """``weight(tenant)``: the tenant's share weight (> 0); ``serves(model)``: whether a worker
        this replica routes to serves ``model`` (a peer's head for another holds nothing back)."""
        self._weight = weight
        self._serves = serves
        self.version = 0
        """Moves whenever what :meth:`heads` returns may have changed (other than by ageing)."""
        self._bands: dict[int, _Band[T]] = {}
        self._where: dict[str, tuple[int, _Waiting[T]]] = {}
        self._order = itertools.count()
        self._peers: dict[str, _PeerHeads] = {}
        self._at_peers: dict[int, dict[str, float]] = {}
        """Per priority, the tenants waiting in a peer's queue and their tokens there."""
        self._at_peers_total: dict[int, float] = {}
        """Per priority, the tokens waiting in peers' queues."""

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def _band(self, priority: int) -> _Band[T]:
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = _Band()
        return band

    def push(
        self, key: str, item: T, *, priority: int, tenant: str, tokens: float, now: float, model: str = ""
    ) -> None:
        """Queue ``item`` (a request for ``model``, "": any worker) under the unique ``key`` at ``now``."""
        band = self._band(priority)
        waiting = _Waiting(key=key, item=item, tenant=tenant, tokens=tokens, queued=now, model=model)
        fifo = band.tenants.get(tenant)
        if fifo is None:
            fifo = band.tenants[tenant] = deque()
            start = band.served[tenant] = self._start(band, priority, tenant)
            heapq.heappush(band.heads, (start, now, next(self._order), tenant))
        fifo.append(waiting)
        band.count += 1
        band.tokens += tokens
        band.tenant_tokens[tenant] = band.tenant_tokens.get(tenant, 0.0) + tokens
        self._where[key] = (priority, waiting)
        self.version += 1

    def charge(self, *, priority: int, tenant: str, tokens: float) -> None:
        """``tenant`` was served ``tokens`` at ``priority``: by a peer router replica sharing the
        fleet, or by this router without waiting here. Its next requests here start that much
        later, so that the fair share holds across replicas whatever share of a tenant's traffic
        each one gets."""
        band = self._band(priority)
        start = self._start(band, priority, tenant)
        band.virtual = max(band.virtual, start)
        band.served[tenant] = start + max(tokens, 1.0) / self._weight(tenant)
        if band.tenants:  # the heads carry the band's V and the waiting tenants' tags
            self.version += 1
        self._requeue(band, tenant)
        self._prune(band, priority)

    def _requeue(self, band: _Band[T], tenant: str) -> None:
        """``tenant``'s start or oldest request changed: its place among the band's heads too."""
        fifo = band.tenants.get(tenant)
        if fifo:
            heapq.heappush(band.heads, (band.served[tenant], fifo[0].queued, next(self._order), tenant))

    def _start(self, band: _Band[T], priority: int, tenant: str) -> float:
        """Where ``tenant``'s next request starts: at its virtual time while it waits here or at a
        peer (it is backlogged), else at ``V`` at the earliest (no credit for idling)."""
        served = band.served.get(tenant, band.virtual)
        if self.waits(priority=priority, tenant=tenant):
            return served
        return max(band.virtual, served)

    def waits(self, *, priority: int, tenant: str) -> bool:
        """Whether ``tenant`` has a request waiting in the band of ``priority``, here or at a peer."""
        band = self._bands.get(priority)
        return (band is not None and tenant in band.tenants) or tenant in self._at_peers.get(priority, ())

    def waiting_tenants(self, priority: int) -> dict[str, None]:
        """The tenants with a request waiting in the band of ``priority``, here or at a peer."""
        band = self._bands.get(priority)
        return dict.fromkeys(itertools.chain(band.tenants if band else (), self._at_peers.get(priority, ())))

    def _prune(self, band: _Band[T], priority: int) -> None:
        """Forget the virtual times at or below ``V`` of tenants waiting nowhere, once they
        outnumber the waiting ones, and of those above ``V`` all but the :data:`MAX_IDLE_TAGS` / 2
        furthest past it (amortised: the sweep halves what it looks at)."""
        at_peers = self._at_peers.get(priority, {})
        if len(band.served) <= 2 * (len(band.tenants) + len(at_peers)) + MAX_IDLE_TAGS:
            return
        kept = {
            tenant: served
            for tenant, served in band.served.items()
            if tenant in band.tenants or tenant in at_peers
        }
        idle = [(served, tenant) for tenant, served in band.served.items() if tenant not in kept]
        for served, tenant in heapq.nlargest(MAX_IDLE_TAGS // 2, idle):
            if served > band.virtual:
                kept[tenant] = served
        band.served = kept

    def _head(self, band: _Band[T]) -> _Waiting[T] | None:
        heads = band.heads
        while heads:
            start, queued, _, tenant = heads[0]
            fifo = band.tenants.get(tenant)
            if fifo and band.served[tenant] == start and fifo[0].queued == queued:
                return fifo[0]
            heapq.heappop(heads)  # the tenant was served (here or at a peer) or left since
        return None

    def peek(self) -> tuple[str, T] | None:
        """The request served next, as ``(key, item)``; ``None`` when the queue is empty."""
        for priority in sorted(self._bands, reverse=True):
            head = self._head(self._bands[priority])
            if head is not None:
                return head.key, head.item
        return None

    def pop(self, key: str) -> T:
        """Serve the request ``key`` (normally :meth:`peek`'s): charges its tenant its tokens."""
        priority, waiting = self._where[key]
        item = self.remove(key)
        self.charge(priority=priority, tenant=waiting.tenant, tokens=waiting.tokens)
        return item

    def remove(self, key: str) -> T:
        """Take ``key`` out of the queue without charging its tenant (cancelled, shed, or served
        again after its tenant was charged for it once); ``KeyError`` if absent."""
        priority, waiting = self._where.pop(key)
        band = self._bands[priority]
        fifo = band.tenants[waiting.tenant]
        fifo.remove(waiting)
        band.count -= 1
        band.tokens -= waiting.tokens
        if not fifo:
            del band.tenants[waiting.tenant]
            del band.tenant_tokens[waiting.tenant]
        else:
            band.tenant_tokens[waiting.tenant] -= waiting.tokens
            self._requeue(band, waiting.tenant)
        if not band.tenants:
            band.heads.clear()
        self.version += 1
        return waiting.item

    # -- heads shared with peer replicas --------------------------------------------------------

    def heads(self, *, now: float) -> list[QueueHead]:
        """Per band, each waiting tenant's oldest request at ``now``: what peers hold back for."""
        return [
            QueueHead(
                priority=priority,
                start=band.served[tenant],
                tenant=tenant,
                virtual=band.virtual,
                tokens=band.tenant_tokens[tenant],
                waited_s=now - fifo[0].queued,
                model=fifo[0].model,
            )
            for priority in sorted(self._bands, reverse=True)
            for band in (self._bands[priority],)
            for tenant, fifo in band.tenants.items()
        ]

    def observe_peer(
        self, peer: str, heads: Sequence[QueueHead], *, now: float, earlier: Sequence[HeardHeads] = ()
    ) -> bool:
        """The heads of ``peer``'s queue (all of them: a tenant left out has nothing waiting
        there), heard at ``now``; catches the bands' virtual times, and the virtual times of the
        tenants waiting there, up with the peer's (a tenant that started waiting there was lifted
        there: so its start tag is the same at every replica). ``earlier``: the peer's heads heard
        before these and never observed (they waited for changes to be applied first), oldest
        first: a request they named keeps when it was first heard (their tags are behind these).
        Returns whether they changed since last heard (what this queue held back for may be gone)."""
        for head in heads:
            band = self._band(head.priority)
            if band.tenants and (
                head.virtual > band.virtual or head.start > band.served.get(head.tenant, band.virtual)
            ):
                self.version += 1  # the band's V or a waiting tenant's tag moves: so do the heads
            band.virtual = max(band.virtual, head.virtual)
            if head.start > band.served.get(head.tenant, band.virtual):
                band.served[head.tenant] = head.start
                self._requeue(band, head.tenant)
        known = self._peers.get(peer)
        fresh = tuple(heads)
        before = {} if known is None else known.since
        for older in earlier:
            before = _since(older.heads, before, now=older.heard)
        since = _since(fresh, before, now=now)
        self._peers[peer] = _PeerHeads(heads=fresh, heard=now, since=since)
        if known is not None and known.heads == fresh:
            return False
        self._count_at_peers()
        return True

    def _count_at_peers(self) -> None:
        """The peers' heads changed: who waits there, and how many tokens, per band."""
        at_peers: dict[int, dict[str, float]] = {}
        for state in self._peers.values():
            for head in state.heads:
                tenants = at_peers.setdefault(head.priority, {})
                tenants[head.tenant] = tenants.get(head.tenant, 0.0) + head.tokens
        self._at_peers = at_peers
        self._at_peers_total = {priority: sum(tenants.values()) for priority, tenants in at_peers.items()}

    def forget_peer(self, peer: str) -> None:
        """``peer`` stopped: its heads hold nothing back any more."""
        if self._peers.pop(peer, None) is not None:
            self._count_at_peers()

    def forget_stale_peers(self, *, now: float, max_age_s: float) -> None:
        """Forget the heads of peers not heard for ``max_age_s`` (dead, or cut off)."""
        for peer in [peer for peer, state in self._peers.items() if now - state.heard > max_age_s]:
            self.forget_peer(peer)

    def held_until(
        self, *, now: float, max_hold_s: float, priority: int | None = None, tenant: str = "", model: str = ""
    ) -> float | None:
        """When the hold that peers' heads put at ``now`` on this queue's head (or, given
        ``priority``, on a new request there of ``tenant`` for ``model``) lapses; ``None`` when
        nothing holds it back. A peer's head holds it back while it comes first in the order every
        replica serves in and competes for the same workers (its model is the same, or either asks
        for any worker, and a worker here serves it), for at most ``max_hold_s`` after the peer
        first sent its request (:data:`SAME_REQUEST_S`): a request a peer keeps sending is stuck
        there (no worker that peer may use takes it), and would otherwise hold this queue back for
        as long as the peer lives (with a new tag each time the fleet serves its tenant)."""
        if not self._peers:
            return None
        if priority is None:
            for level in sorted(self._bands, reverse=True):
                band = self._bands[level]
                head = self._head(band)
                if head is not None:
                    model = head.model
                    mine = _order(priority=level, start=band.served[head.tenant], waited_s=now - head.queued)
                    break
            else:
                return None
        else:
            band = self._band(priority)
            mine = _order(priority=priority, start=self._start(band, priority, tenant), waited_s=0.0)
        until: float | None = None
        for state in self._peers.values():
            aged_s = now - state.heard
            for theirs in state.heads:
                lapses = state.since[_key(theirs)].first + max_hold_s
                if (
                    lapses >= now
                    and (until is None or lapses > until)
                    and _order(
                        priority=theirs.priority, start=theirs.start, waited_s=theirs.waited_s + aged_s
                    )
                    < mine
                    and _competes(theirs.model, model)
                    and (not theirs.model or self._serves(theirs.model))
                ):
                    until = lapses
        return until

    # -- what admission asks ----------------------------------------------------------------------

    def wait_s(
        self,
        *,
        priority: int,
        tenant: str,
        tokens: float,
        rate: float,
        routed: RoutedTokens | None,
        window_s: float,
    ) -> float:
        """Seconds until a new request of ``tokens`` from ``tenant`` at ``priority`` is served, at
        ``rate`` tokens a second for its band and lower, as the queues of this replica and its peers
        would interleave it: every waiting token of higher bands, its tenant's waiting tokens and
        its own, and each other tenant of the band, which keeps arriving at the rate it was routed
        (``routed`` over the last ``window_s``) meanwhile: its waiting tokens and those arrivals,
        up to its share of the time the new request's tenant needs (an other tenant that sends
        below its share is served as it sends, ahead of a backlogged one: counting only what waits
        now predicts too short a wait for the backlogged tenant). ``rate`` must be positive; the
        wait is then finite, as every share is.

        Water-filling, solved exactly (:func:`_water_level`)."""
        fixed = sum(band.tokens for level, band in self._bands.items() if level > priority)
        fixed += sum(total for level, total in self._at_peers_total.items() if level > priority)
        band = self._bands.get(priority)
        here = band.tenant_tokens if band is not None else {}
        there = self._at_peers.get(priority, {})
        own = tokens + (here.get(tenant, 0.0) + there.get(tenant, 0.0))
        fixed += own
        weight = self._weight(tenant)
        # The other tenants waiting (here or at a peer), then those only routed.
        waiting = [name for name in self.waiting_tenants(priority) if name != tenant]
        sent = 0 if routed is None else len(routed)
        if len(waiting) + sent <= LOOP_AT_MOST:
            others = [
                (
                    here.get(name, 0.0) + there.get(name, 0.0),
                    0.0 if routed is None else routed.tokens(name) / window_s,
                    own * self._weight(name) / weight,
                )
                for name in waiting
            ]
            if routed is not None:
                others += [
                    (0.0, routed.tokens(name) / window_s, own * routed.weight(name) / weight)
                    for name in routed.slots
                    if name != tenant and name not in here and name not in there
                ]
            return _water_level(fixed=fixed, rate=rate, others=others)
        theirs = np.fromiter(
            (here.get(name, 0.0) + there.get(name, 0.0) for name in waiting), np.float64, len(waiting)
        )
        weights = np.fromiter((self._weight(name) for name in waiting), np.float64, len(waiting))
        flow = np.zeros(len(waiting))
        if routed is not None:
            flow = np.fromiter((routed.tokens(name) for name in waiting), np.float64, len(waiting))
            tokens_sent, weights_sent = routed.arrays()
            idle = routed.outside(itertools.chain(waiting, (tenant,)))  # the others waiting nowhere
            theirs = np.concatenate((theirs, np.zeros(int(idle.sum()))))
            flow = np.concatenate((flow, tokens_sent[idle]))
            weights = np.concatenate((weights, weights_sent[idle]))
            flow /= window_s
        return _water_level_of_arrays(
            fixed=fixed, rate=rate, theirs=theirs, flow=flow, share=own * weights / weight
        )

    def holds_its_share(self, *, priority: int, tenant: str) -> bool:
        """Whether ``tenant`` has at least its even share of the requests waiting in the band of
        ``priority`` (the band's waiting requests over the tenants waiting there)."""
        band = self._bands.get(priority)
        if band is None or not band.tenants:
            return False
        fifo = band.tenants.get(tenant)
        mine = len(fifo) if fifo else 0
        return mine * len(band.tenants) >= band.count

    def count_at_or_above(self, priority: int) -> int:
        """Requests waiting at ``priority`` or higher."""
        return sum(band.count for level, band in self._bands.items() if level >= priority)
