"""The router's wait queue: priority bands, and weighted fair queuing on tokens between tenants.

Requests wait here while every worker is saturated. The queue serves the highest priority band
that holds a request (the ``InferenceObjective``'s ``spec.priority``: higher is more important);
within a band it shares what it serves between tenants by start-time fair queuing on tokens
(prompt plus expected output), so that a tenant sending long prompts does not get more of the
fleet than one sending short ones, and one sending ten times as many requests gets no more than
its weight's share while the others have requests waiting.

Start-time fair queuing (Goyal et al., 1996): a band keeps a virtual time ``V``, the start tag of
the request it served last; a tenant keeps the finish tag ``F`` of its latest request. A request
of ``tokens`` from a tenant of weight ``w`` gets the start tag ``S = max(V, F)`` and moves the
tenant's finish tag to ``S + tokens / w``; the band serves the lowest start tag among its tenants'
oldest requests. A tenant that was idle starts again at ``V``: it gets no credit for the time it
sent nothing, and a backlogged tenant is never starved by one that returns.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(slots=True)
class _Waiting(Generic[T]):
    key: str
    item: T
    tenant: str
    start: float
    tokens: float


@dataclasses.dataclass(slots=True)
class _Band(Generic[T]):
    """One priority's requests, per tenant in arrival order."""

    virtual: float = 0.0
    finish: dict[str, float] = dataclasses.field(default_factory=dict)
    """Finish tag of each tenant's latest request (kept while the tenant has requests waiting)."""
    tenants: dict[str, deque[_Waiting[T]]] = dataclasses.field(default_factory=dict)
    heads: list[tuple[float, int, str]] = dataclasses.field(default_factory=list)
    """(start tag, order, tenant) of each tenant's oldest request; stale entries are skipped."""
    tokens: float = 0.0
    """Tokens of the requests waiting in the band."""


class FairQueue(Generic[T]):
    """Waiting requests by priority band, fair between tenants within a band (see the module)."""

    def __init__(self, *, weight: Callable[[str], float]) -> None:
        """``weight(tenant)``: the tenant's share weight (> 0)."""
        self._weight = weight
        self._bands: dict[int, _Band[T]] = {}
        self._where: dict[str, tuple[int, _Waiting[T]]] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def push(self, key: str, item: T, *, priority: int, tenant: str, tokens: float) -> None:
        """Queue ``item`` under the unique ``key``."""
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = _Band()
        start = max(band.virtual, band.finish.get(tenant, band.virtual))
        band.finish[tenant] = start + max(tokens, 1.0) / self._weight(tenant)
        waiting = _Waiting(key=key, item=item, tenant=tenant, start=start, tokens=tokens)
        fifo = band.tenants.get(tenant)
        if fifo is None:
            fifo = band.tenants[tenant] = deque()
        fifo.append(waiting)
        if len(fifo) == 1:
            heapq.heappush(band.heads, (start, next(self._order), tenant))
        band.tokens += tokens
        self._where[key] = (priority, waiting)

    def charge(self, *, priority: int, tenant: str, tokens: float) -> None:
        """``tenant`` was served ``tokens`` at ``priority`` elsewhere (by a peer router replica
        sharing the fleet): its next requests here start that much later, so that the fair share
        holds across replicas whatever share of a tenant's traffic each one gets. Ignored while
        the band has nothing waiting here (no order to correct; and no state per idle tenant)."""
        band = self._bands.get(priority)
        if band is None or not band.tenants:
            return
        start = max(band.virtual, band.finish.get(tenant, band.virtual))
        band.finish[tenant] = start + max(tokens, 1.0) / self._weight(tenant)

    def _head(self, band: _Band[T]) -> _Waiting[T] | None:
        heads = band.heads
        while heads:
            start, _, tenant = heads[0]
            fifo = band.tenants.get(tenant)
            if fifo and fifo[0].start == start:
                return fifo[0]
            heapq.heappop(heads)  # the tenant's head left (served or removed) since
        return None

    def peek(self) -> tuple[str, T] | None:
        """The request served next, as ``(key, item)``; ``None`` when the queue is empty."""
        for priority in sorted(self._bands, reverse=True):
            head = self._head(self._bands[priority])
            if head is not None:
                return head.key, head.item
        return None

    def pop(self, key: str) -> T:
        """Serve the request ``key`` (normally :meth:`peek`'s): advances its band's virtual time."""
        priority, waiting = self._where[key]
        band = self._bands[priority]
        band.virtual = max(band.virtual, waiting.start)
        return self.remove(key)

    def remove(self, key: str) -> T:
        """Take ``key`` out of the queue without serving it (cancelled, shed); ``KeyError`` if absent."""
        priority, waiting = self._where.pop(key)
        band = self._bands[priority]
        fifo = band.tenants[waiting.tenant]
        was_head = fifo[0] is waiting
        fifo.remove(waiting)
        band.tokens -= waiting.tokens
        if not fifo:
            del band.tenants[waiting.tenant]
            if band.finish.get(waiting.tenant, 0.0) <= band.virtual:
                band.finish.pop(waiting.tenant, None)
        elif was_head:
            heapq.heappush(band.heads, (fifo[0].start, next(self._order), waiting.tenant))
        if not band.tenants:
            band.heads.clear()
        return waiting.item

    def tokens_ahead(self, *, priority: int, tenant: str, tokens: float) -> float:
        """Tokens served before a new request of ``tokens`` from ``tenant`` at ``priority`` is
        done, as the queue would interleave them: every waiting token of higher bands and, of its
        band, each other tenant's waiting tokens up to that tenant's share of the time the new
        request's tenant needs for its own waiting tokens and this one."""
        ahead = sum(band.tokens for level, band in self._bands.items() if level > priority)
        band = self._bands.get(priority)
        own = tokens
        if band is None:
            return ahead + own
        fifo = band.tenants.get(tenant)
        own += sum(waiting.tokens for waiting in fifo) if fifo else 0.0
        weight = self._weight(tenant)
        for other, waiting in band.tenants.items():
            if other != tenant:
                ahead += min(sum(w.tokens for w in waiting), own * self._weight(other) / weight)
        return ahead + own

    def holds_its_share(self, *, priority: int, tenant: str) -> bool:
        """Whether ``tenant`` has at least its even share of the requests waiting in the band of
        ``priority`` (the band's waiting requests over the tenants waiting there)."""
        band = self._bands.get(priority)
        if band is None or not band.tenants:
            return False
        fifo = band.tenants.get(tenant)
        mine = len(fifo) if fifo else 0
        total = sum(len(waiting) for waiting in band.tenants.values())
        return mine * len(band.tenants) >= total

    def count_at_or_above(self, priority: int) -> int:
        """Requests waiting at ``priority`` or higher."""
        return sum(
            len(fifo)
            for level, band in self._bands.items()
            if level >= priority
            for fifo in band.tenants.values()
        )
