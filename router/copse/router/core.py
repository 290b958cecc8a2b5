"""The routing core: workers, indexer, in-flight load, policy, busy thresholds, the wait queue and
disaggregated prefill -> decode routing. Pure: the caller supplies the clock and does the I/O.

Lifecycle of a request: :meth:`Router.submit` routes it (or queues it while every worker is
busy); the caller sends it, then reports :meth:`Router.prefill_done` at its first token and
:meth:`Router.finish` at its end (or failure). Those two free capacity, so they return the queued
requests that can now be routed.

Roles: ``worker`` engines serve whole requests. With ``prefill`` and ``decode`` engines, a request
is prefilled on a prefill worker and decoded on a decode worker close to it (same locality, e.g.
NVLink domain, when the policy finds one as good), with the KV moved between them. A prompt whose
uncached part is so short that moving its KV would take longer than prefilling it where it is
decoded stays on the decode worker, and so does everything when there is no prefill worker for it
(busy prefill workers are waited for, in the queue).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import random
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from copse.router.adapters import AdapterRouting, AdapterTracker
from copse.router.approx import ApproximateIndexer
from copse.router.cost import FloatArray, PerfTable, WorkerCosts
from copse.router.experts import ExpertTracker
from copse.router.fairness import FairQueue, HeardHeads, QueueHead, RoutedTokens
from copse.router.indexer import BlockIndex, Indexer, RadixIndexer
from copse.router.limits import TenantLimits
from copse.router.policies import (
    KvPolicy,
    Policy,
    RouteRequest,
    Selection,
    SelectionSettings,
    make_policy,
    pick_lowest,
)
from copse.router.sequences import ActiveSequences
from copse.router.slots import WorkerSlots
from copse.workers.moe import ExpertPlacement, MoeConfig
from copse.workers.perf import PerfModel

BoolArray = npt.NDArray[np.bool_]


class _Eligible(NamedTuple):
    """Workers that may take a request, as a mask and as the matching ``Selection.exclusion``."""

    mask: BoolArray
    exclusion: FloatArray | None

    @classmethod
    def of(cls, mask: BoolArray) -> _Eligible:
        return cls(mask, None if mask.all() else np.where(mask, 0.0, np.inf))


class Role(enum.StrEnum):
    """What an engine does (the pod label ``copse.dev/role``)."""

    WORKER = "worker"
    PREFILL = "prefill"
    DECODE = "decode"


class Shed(RuntimeError):
    """The router does not take the request now (an HTTP 429): it would not be served in time, or
    its tenant is over its rate limit. Nothing of it was admitted."""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        """When trying again may succeed, seconds."""


class QueueFull(Shed):
    """Every worker is busy and the wait queue is full: the request cannot be accepted now."""


class SloShed(Shed):
    """The latency model predicts that the request would wait past its objective's TTFT target."""


class RateLimited(Shed):
    """The request's tenant sent more tokens than its rate limit allows."""


class NoWorkers(RuntimeError):
    """No worker can serve the request at all (none registered, or all excluded for it)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Thresholds:
    """When a worker counts as saturated, and how many requests may wait for one."""

    busy_prefill_tokens: float = 4 * 8192
    """A worker with more uncached prompt tokens than this still to prefill takes no new request
    (Dynamo's default: 4 x the engine's 8192-token step budget)."""
    busy_kv_fraction: float = 0.95
    """A worker whose predicted KV use exceeds this fraction of its cache takes no new request
    (beyond it the engine would preempt running sequences)."""
    contended_prefill_tokens: float = 8192
    """While the queue's order is not first come, first served (another tenant of a request's
    priority, or any of a higher one, was routed over ``rate_window_s``), the request goes only to
    a worker where its uncached prompt fits in this beside the prefill the worker already holds,
    or that holds none (a longer prompt waits for an empty queue). One engine step is what the
    worker's next step takes; prefill queued at a worker beyond it is served there in arrival
    order, outside the fair queue and the priority bands, so a light tenant's or a higher band's
    request would start behind up to ``busy_prefill_tokens`` of others' prompts. Of the workers
    holding none, a request leaves as many idle as the tenants of its band served less than its
    own, with nothing waiting, take of the fleet, never all of it (``Router._left_to_others``): a
    request held back must have a worker busy or prefilling, whose next event tries it again. A
    fleet serving one tenant at one priority never meets this rule (its queue is first come, first
    served wherever it waits)."""
    queue_size: int = 1024
    """Requests that may wait while every worker is busy, counting those of the new request's
    priority or higher (a full queue of low-priority requests does not refuse a higher one; the
    priorities are the objectives', so the queue holds at most this times their number). A tenant
    holding less than its share of its band's waiting requests may still queue, up to twice this:
    a full queue is not one tenant's to refuse the others with."""
    rate_window_s: float = 10.0
    """Window over which the router measures the tokens per second it routes, which is how fast
    its queue drains while the fleet is saturated (what admission predicts waits with)."""
    peer_queue_max_age_s: float = 3.0
    """How long a peer replica's queue head holds this replica's dispatch back at most, from when
    the peer first sent its request (whatever its start tag became since:
    :mod:`copse.router.fairness`); a peer's heads not heard for this long are forgotten. Replicas
    re-send their heads with every heartbeat (1 s), so three missed heartbeats mean the peer is
    gone or cut off, and a request sent as a head for this long is stuck there: a dead replica, or
    a head its replica cannot route, must never stall dispatch, and holds capacity idle at most
    this long (a head merely slow to go is let past too). Shorter than the 5 s after which a
    peer's load is forgotten, so its heads stop counting first."""


@dataclasses.dataclass(frozen=True, slots=True)
class DisaggSettings:
    """What moving KV from a prefill to a decode worker costs."""

    kv_bytes_per_token: float = 131072.0
    """KV bytes per token of the model (Llama-3-8B in fp16: 32 layers x 8 KV heads x 128 x 2 x 2)."""
    near_gbps: float = 400.0
    """Transfer bandwidth between workers of the same locality (NVLink domain), GB/s."""
    far_gbps: float = 25.0
    """Transfer bandwidth between workers of different localities (RDMA NIC), GB/s."""
    overhead_ms: float = 5.0
    """Fixed cost of handing a request over (a second request, transfer set-up): what keeps short
    prompts on the decode worker."""

    def transfer_ms(self, tokens: float, *, near: bool) -> float:
        """Time to hand over a request and move the KV of ``tokens`` tokens, ms."""
        gbps = self.near_gbps if near else self.far_gbps
        return self.overhead_ms + tokens * self.kv_bytes_per_token / (gbps * 1e9) * 1000.0


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A worker the router may send requests to."""

    worker_id: str
    """Identity of the engine; KV events carry the same id."""
    role: Role
    locality: str | None = None
    """Workers with the same locality exchange KV cheaply (e.g. the NVLink domain)."""
    draining: bool = False
    """Being removed: it takes no new requests and finishes those it has."""
    revision: str | None = None
    """The deployment revision it runs: a prefill worker hands KV over only to a decode worker of
    the same revision (two engine versions need not share a KV layout)."""
    model: str = ""
    """The base model it serves ("": the router's one model); requests for another go elsewhere."""
    max_loras: int | None = None
    """LoRA adapters its engine holds at once (``None``: the router's configured figure)."""
    loras: tuple[str, ...] | None = None
    """LoRA adapters its engine said it holds when it registered, least recently used first
    (``None``: its engine does not say; ``()``: it holds none, which a peer's view does not
    override)."""


class Route(NamedTuple):
    """Where a request goes (a tuple: one is made per request, and tuples are made fastest)."""

    request_id: str
    worker_id: str
    """The worker that streams the output (aggregated, or the decode worker)."""
    prefill_worker_id: str | None
    """The worker that prefills first (disaggregated); ``None`` when ``worker_id`` prefills."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens the prefilling worker is predicted to hold already."""
    predicted_ttft_ms: float
    """Predicted time to first token at the moment of routing."""
    onboard_ms: float = 0.0
    """Of it, the time predicted to bring cached blocks the prefilling worker keeps in host memory
    or on disk back to its GPU."""


@dataclasses.dataclass(frozen=True, slots=True)
class FlightRecord:
    """What one worker was charged for a request (shared with peer routers)."""

    worker_id: str
    hashes: Sequence[int]
    prefill_tokens: int
    prefill_ms: float
    kv_tokens: float
    output_tokens: int = 0
    """Output tokens expected (0: a prefill-only charge, or a peer that does not say)."""
    tenant: str = ""
    """Tenant of the request (for the fair share across replicas)."""
    priority: int = 0
    """Priority of the request's objective."""
    adapter: str = ""
    """LoRA adapter the request runs through (peers mirror the worker's adapter cache)."""
    retry: bool = False
    """The request was routed before (a retry on another worker, or a gateway's fallback): peers
    mirror the worker's load but charge its tenant and count its tokens only at its first route."""


@dataclasses.dataclass(frozen=True, slots=True)
class PeerChange:
    """A change of in-flight load that other router replicas must mirror."""

    op: Literal["add", "prefilled", "free"]
    key: str
    """Names one charge of one request on one worker, unique within the router that made it."""
    record: FlightRecord | None = None
    """What was charged (``add`` only)."""


MAX_PEER_HELD = 4096
"""Workers whose adapters a router keeps from peers' snapshots before they register (a peer names
at most the workers it knows; the bound keeps a misbehaving one from growing the router)."""


def _prefill_key(request_id: str) -> str:
    return request_id + "\x00prefill"


@dataclasses.dataclass(frozen=True, slots=True)
class _Queued:
    """A request waiting in the router's queue."""

    request: RouteRequest
    exclude: frozenset[str]
    """Workers it may not go to (those that failed it, or outside a gateway's subset)."""
    retry: bool
    """It was routed before: its tenant was charged then, so the queue serves it uncharged."""


class Router:
    """Routes requests to workers; see the module documentation for the lifecycle."""

    def __init__(
        self,
        *,
        perf: PerfModel,
        settings: SelectionSettings,
        policy: str = "kv",
        thresholds: Thresholds | None = None,
        disagg: DisaggSettings | None = None,
        use_kv_events: bool = True,
        share_load: bool = False,
        seed: int | None = None,
        moe: MoeConfig | None = None,
        moe_perf: PerfModel | None = None,
        tenant_weight: Callable[[str], float] | None = None,
        limits: TenantLimits | None = None,
        adapters: AdapterRouting | None = None,
    ) -> None:
        """``tenant_weight(tenant)``: a tenant's share of the fleet while requests wait, against
        the others' of the same priority (1 for every tenant when not given); ``limits``: rate
        limits per tenant (none when not given); ``adapters``: how LoRA adapters weigh in worker
        choice (defaults when not given)."""
        self.settings = settings
        self.thresholds = thresholds or Thresholds()
        self.disagg = disagg or DisaggSettings()
        self.perf = PerfTable(perf)
        self.policy_name = policy
        self.policy: Policy = make_policy(policy)
        self._kv = KvPolicy()
        self.slots = WorkerSlots()
        self.indexer: Indexer
        # A worker's cache size until its engine says (guesses are evicted beyond it).
        capacity = max(1, perf.kv_capacity_tokens // settings.block_size)
        if use_kv_events:
            self.radix: RadixIndexer | None = RadixIndexer(self.slots, default_capacity_blocks=capacity)
            self.indexer = self.radix
        else:
            self.radix = None
            self.indexer = ApproximateIndexer(default_capacity_blocks=capacity, index=BlockIndex())
        self.sequences = ActiveSequences(block_size=settings.block_size)
        self.costs = WorkerCosts(
            self.sequences,
            self.perf,
            busy_prefill_tokens=self.thresholds.busy_prefill_tokens,
            busy_kv_tokens=self.thresholds.busy_kv_fraction * self.perf.kv_capacity_tokens,
        )
        self.rng = random.Random(seed)
        self.experts = None if moe is None else ExpertTracker(moe)
        """Expert placement and in-flight expert load per worker (Mixture-of-Experts models)."""
        self.moe_perf = None if moe is None or moe_perf is None else PerfTable(moe_perf)
        """The expert-parallel engines' balanced step, without the MoE terms ``perf``'s profile
        holds (``kv_expert`` adds them for the expert load it expects; :attr:`Selection.moe_perf`)."""
        self.workers: dict[str, WorkerInfo] = {}
        self._roles = {role: np.zeros(0, dtype=bool) for role in Role}
        self._role_count = dict.fromkeys(Role, 0)
        self._roles_version = 0
        # Role -> (versions it was built at, its free workers or None): valid until a worker joins,
        # leaves or crosses a busy threshold.
        self._free_cache: dict[Role, tuple[tuple[int, int], _Eligible | None]] = {}
        self.adapters = AdapterTracker(adapters)
        """Each worker's model and the LoRA adapters it holds (:mod:`copse.router.adapters`)."""
        self._tenant_weight = tenant_weight or (lambda _tenant: 1.0)
        self._queue: FairQueue[_Queued] = FairQueue(weight=self._tenant_weight, serves=self.adapters.serves)
        self._routes: dict[str, Route] = {}
        self._guards: dict[int, Counter[tuple[int, float]]] = {}
        """Per worker slot, (priority, ITL target) of its in-flight requests with an ITL target:
        what keeps lower priorities' prefill off the workers where those requests decode."""
        self._guarded: dict[str, tuple[int, tuple[int, float]]] = {}
        """Request id -> (slot, guard) of every entry of :attr:`_guards`."""
        self.limits = limits
        self._routed_tokens: deque[tuple[float, float, int, str]] = deque()
        """(time, tokens, priority, tenant) of every request routed within the last ``rate_window_s``."""
        self._routed_sum = 0.0
        self._routed_in_band: dict[int, RoutedTokens] = {}
        """Of ``_routed_sum``, per priority, the tokens of each tenant routed in the window (a band
        leaves when its last tenant does)."""
        self.outbox: list[PeerChange] | None = [] if share_load else None
        """Changes for peer routers since the caller last emptied it (``None``: not sharing)."""
        self.prompt_tokens_routed = 0
        """Prompt tokens of every routed request (for the predicted hit rate)."""
        self.cached_tokens_routed = 0
        """Prompt tokens the chosen workers were predicted to hold."""
        self._peer_held: dict[str, tuple[str, list[str]]] = {}
        """Worker id -> (the peer, the adapters its snapshot said the worker holds), for workers
        this router has not registered yet: taken when they register, unless their engine reports
        its own; gone with the peer, or when the worker leaves."""

    # -- workers ------------------------------------------------------------------------------

    def add_worker(self, info: WorkerInfo, *, now: float) -> list[Route]:
        """Register (or update) a worker; returns queued requests it lets through."""
        slot = self.slots.slot(info.worker_id)
        self._grow(slot + 1)
        previous = self.workers.get(info.worker_id)
        if previous is not None and not previous.draining:
            self._role_count[previous.role] -= 1
        self.workers[info.worker_id] = info
        self.adapters.set_worker(slot, model=info.model, max_loras=info.max_loras, held=info.loras or ())
        pending = self._peer_held.pop(info.worker_id, None)
        if previous is None and pending is not None and info.loras is None:
            self.adapters.merge(slot, pending[1])
        if not info.draining:
            self._role_count[info.role] += 1
        for role, mask in self._roles.items():
            mask[slot] = role is info.role and not info.draining
        self._roles_version += 1
        return self._drain(now=now)

    def remove_worker(self, worker_id: str) -> list[str]:
        """Forget a worker that left; returns the ids of the requests that were in flight on it
        (they are freed here; the caller retries or fails them)."""
        self._peer_held.pop(worker_id, None)
        info = self.workers.pop(worker_id, None)
        if info is None:
            return []
        if not info.draining:
            self._role_count[info.role] -= 1
        slot = self.slots.get(worker_id)
        if slot is None:
            return []
        for mask in self._roles.values():
            mask[slot] = False
        self._roles_version += 1
        self.adapters.drop_worker(slot)
        lost = {key.removesuffix("\x00prefill") for key in self.sequences.drop_worker(slot)}
        for request_id in lost:
            self._routes.pop(request_id, None)
            self.adapters.finished(request_id)
            self._unguard(request_id)
        if self.experts is not None:
            self.experts.reset_worker(slot)
        if self.radix is not None:
            self.radix.forget(worker_id)
        else:
            self.indexer.drop_worker(slot)
        self.slots.release(worker_id)
        return sorted(lost)

    def _grow(self, size: int) -> None:
        self.sequences.ensure(size)
        size = self.sequences.size
        for role, mask in self._roles.items():
            if len(mask) < size:
                grown = np.zeros(size, dtype=bool)
                grown[: len(mask)] = mask
                self._roles[role] = grown
                self._roles_version += 1

    # -- routing ------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Requests waiting for a worker."""
        return len(self._queue)

    def route_of(self, request_id: str) -> Route | None:
        """The route of an in-flight request."""
        return self._routes.get(request_id)

    def submit(
        self,
        request: RouteRequest,
        *,
        now: float,
        exclude: frozenset[str] = frozenset(),
        retry: bool = False,
    ) -> Route | None:
        """Route ``request`` to a worker not in ``exclude``; ``None`` when it waits in the queue (it
        comes back from :meth:`prefill_done`, :meth:`finish` or :meth:`add_worker`). Raises
        :class:`NoWorkers` when no registered worker could ever take it, and a :class:`Shed` when it
        is not admitted: its tenant is over its rate limit (:class:`RateLimited`), it would wait
        past its TTFT target (:class:`SloShed`) or the queue is full (:class:`QueueFull`). An
        admitted request is routed now or waits in the queue until it is (or is cancelled by
        :meth:`finish`). A ``retry`` (the request was routed before and failed there) is neither
        rate limited nor charged to its tenant, here or at the peers: its first route was. An
        ``exclude`` alone does not make a retry (a gateway's endpoint picker excludes the endpoints
        outside its subset on a request's first route)."""
        if not self._servable(exclude):
            raise NoWorkers("no worker is available for this request")
        if request.model and not self.adapters.serves(request.model):
            raise NoWorkers(f"no worker of model {request.model!r} is available")
        tokens = float(request.prompt_tokens + request.max_tokens)
        # A retry is the router's doing: its tenant was charged the first time.
        limits = self.limits if not retry else None
        if limits is not None:
            wait_s = limits.wait_s(request.tenant, tokens, now=now)
            if wait_s > 0.0:
                raise RateLimited(
                    f"tenant {request.tenant or '(default)'} is over its limit of "
                    f"{limits.limit(request.tenant):g} tokens per minute",
                    retry_after_s=wait_s,
                )
        held = self._queue or self._peer_ahead(request, now=now)
        route = None if held else self._try_route(request, now=now, exclude=exclude, retry=retry)
        if route is not None and not retry:
            self._queue.charge(priority=request.priority, tenant=request.tenant, tokens=tokens)
        if route is None:
            self._admit(request, now=now)
            self._enqueue(_Queued(request=request, exclude=exclude, retry=retry), now=now)
            if held and self._serves_first(request.request_id, now=now):
                # It comes before what waits (a higher band, a tenant below its share), which may
                # wait only for workers it may not take: it is tried now, not at the next change.
                route = self._try_route(request, now=now, exclude=exclude, retry=retry)
                if route is not None:
                    self._dequeue(request.request_id, retry=retry)
        if limits is not None:
            limits.take(request.tenant, tokens, now=now)
        return route

    def routed_tokens_per_s(self, *, now: float, at_or_below: int | None = None) -> float | None:
        """Tokens (prompt plus expected output) per second this router and its peer replicas
        routed over the last ``rate_window_s`` (of priority ``at_or_below`` or lower, when given):
        how fast the queues, its own and its peers', drain while the fleet is saturated; ``None``
        before a window's worth of history."""
        window = self.thresholds.rate_window_s
        self._forget_routed(now=now)
        recent = self._routed_tokens
        if not recent or now - recent[0][0] < window / 2:
            return None
        if at_or_below is None:
            return self._routed_sum / window
        return (
            sum(routed.total for priority, routed in self._routed_in_band.items() if priority <= at_or_below)
            / window
        )

    def _forget_routed(self, *, now: float) -> None:
        """Drop the routed tokens older than ``rate_window_s`` at ``now``."""
        recent = self._routed_tokens
        in_band = self._routed_in_band
        while recent and recent[0][0] < now - self.thresholds.rate_window_s:
            _, tokens, priority, tenant = recent.popleft()
            self._routed_sum -= tokens
            routed = in_band.get(priority)
            if routed is not None:
                routed.forget(tenant, tokens)
                if not routed:
                    del in_band[priority]

    def _count_routed(self, tokens: float, *, priority: int, tenant: str, now: float) -> None:
        """``tokens`` of ``tenant`` at ``priority`` were routed at ``now``, here or by a peer
        replica (and those older than the window are dropped: the rate is read only while requests
        queue)."""
        self._forget_routed(now=now)
        self._routed_tokens.append((now, tokens, priority, tenant))
        self._routed_sum += tokens
        routed = self._routed_in_band.get(priority)
        if routed is None:
            routed = self._routed_in_band[priority] = RoutedTokens()
        routed.add(tenant, tokens, weight=self._tenant_weight(tenant))

    def _contended(self, request: RouteRequest, *, now: float) -> bool:
        """Whether another tenant of ``request``'s priority, or any of a higher one, was routed over
        the window, here or by a peer: the queue's order is then not first come, first served, so
        the request goes only where its prompt fits in a step (:meth:`_within_step`)."""
        self._forget_routed(now=now)
        band = request.priority
        in_band = self._routed_in_band
        routed = sum(len(tenants) for priority, tenants in in_band.items() if priority >= band)
        return routed > (band in in_band and request.tenant in in_band[band])

    def predicted_wait_s(self, request: RouteRequest, *, now: float) -> float | None:
        """Predicted wait of ``request`` in the queue before it is routed, s: the tokens the queues
        of this replica and its peers serve before it is done (higher priorities; of its own band
        its tenant's waiting tokens, and the other tenants' waiting tokens and what they keep
        sending, each up to its fair share: :meth:`FairQueue.wait_s`), at the rate the fleet took
        tokens of its priority and lower (what higher priorities leave it, and what ITL guards let
        through), else of every priority when none of those were routed; the other tenants send
        at the rate they were routed, here and by peers. ``None`` when no rate is known yet."""
        rate = self.routed_tokens_per_s(now=now, at_or_below=request.priority)
        if not rate:
            rate = self.routed_tokens_per_s(now=now)
        if rate is None or rate <= 0.0:
            return None
        return self._queue.wait_s(
            priority=request.priority,
            tenant=request.tenant,
            tokens=float(request.prompt_tokens + request.max_tokens),
            rate=rate,
            routed=self._routed_in_band.get(request.priority),
            window_s=self.thresholds.rate_window_s,
        )

    def _admit(self, request: RouteRequest, *, now: float) -> None:
        """Refuse (:class:`SloShed`) a request that must wait and is predicted to miss its TTFT
        target: its predicted wait plus the compute of its prompt on an idle worker."""
        target_ms = request.ttft_slo_ms
        if target_ms is None:
            return
        wait_s = self.predicted_wait_s(request, now=now)
        if wait_s is None:
            return
        prefill_ms = self.perf.compute_ms(new_tokens=request.prompt_tokens, cached_tokens=0)
        predicted_ms = wait_s * 1000.0 + prefill_ms
        if predicted_ms > target_ms:
            raise SloShed(
                f"the fleet is saturated: predicted time to first token {predicted_ms:,.0f} ms is past "
                f"the objective's {target_ms:,.0f} ms",
                retry_after_s=max(1.0, (predicted_ms - target_ms) / 1000.0),
            )

    def _enqueue(self, queued: _Queued, *, now: float) -> None:
        request = queued.request
        waiting = self._queue.count_at_or_above(request.priority)
        limit = self.thresholds.queue_size
        # A full queue still takes a tenant that holds less than its share of the band (another
        # tenant filled it), up to twice its size.
        fair = not self._queue.holds_its_share(priority=request.priority, tenant=request.tenant)
        if waiting >= (2 * limit if fair else limit):
            wait_s = self.predicted_wait_s(request, now=now)
            raise QueueFull(
                f"all workers are busy and {waiting} requests are already waiting",
                retry_after_s=max(1.0, wait_s or 1.0),
            )
        self._queue.push(
            request.request_id,
            queued,
            priority=request.priority,
            tenant=request.tenant,
            tokens=float(request.prompt_tokens + request.max_tokens),
            now=now,
            model=request.model,
        )

    def prefill_done(self, request_id: str, *, now: float) -> list[Route]:
        """The first token of ``request_id`` arrived; returns queued requests now routed."""
        route = self._routes.get(request_id)
        if route is None:
            return []
        self.sequences.prefill_done(request_id, now=now)
        self._share(PeerChange(op="prefilled", key=request_id))
        if route.prefill_worker_id is not None:
            self.sequences.free(_prefill_key(request_id), now=now)
            self._share(PeerChange(op="free", key=_prefill_key(request_id)))
        return self._drain(now=now)

    def finish(self, request_id: str, *, now: float) -> list[Route]:
        """``request_id`` ended, failed or was cancelled; returns queued requests now routed."""
        if request_id in self._queue:
            self._queue.remove(request_id)
            return []
        route = self._routes.pop(request_id, None)
        if route is None:
            return []
        self._unguard(request_id)
        self.adapters.finished(request_id)
        if self.experts is not None:
            self.experts.remove(request_id)
        self.sequences.free(request_id, now=now)
        self._share(PeerChange(op="free", key=request_id))
        prefill_key = _prefill_key(request_id)
        if route.prefill_worker_id is not None and self.sequences.free(prefill_key, now=now) is not None:
            self._share(PeerChange(op="free", key=prefill_key))
        return self._drain(now=now)

    def report_experts(self, request_id: str, counts: Sequence[int] | npt.NDArray[np.int64]) -> None:
        """The routed-expert counts an engine reports for ``request_id`` as it ends (call before
        :meth:`finish`); ignored for a dense model."""
        if self.experts is not None:
            self.experts.report(request_id, counts)

    def set_expert_placement(self, worker_id: str, placement: ExpertPlacement) -> None:
        """The expert placement worker ``worker_id`` reports (ignored for a dense model)."""
        slot = self.slots.get(worker_id)
        if self.experts is not None and slot is not None:
            self.experts.set_placement(slot, placement)

    def _share(self, change: PeerChange) -> None:
        if self.outbox is not None:
            self.outbox.append(change)

    def _servable(self, exclude: frozenset[str]) -> bool:
        if not exclude:
            return any(self._role_count.values())
        return any(worker_id not in exclude and not info.draining for worker_id, info in self.workers.items())

    def in_flight(self, worker_id: str) -> int:
        """This router's own requests on ``worker_id``: those it streams, and those it still
        prefills for another worker (what a peer router sent there is the peer's to report)."""
        return sum(
            1
            for route in self._routes.values()
            if route.worker_id == worker_id
            or (route.prefill_worker_id == worker_id and _prefill_key(route.request_id) in self.sequences)
        )

    def _peer_ahead(self, request: RouteRequest, *, now: float) -> bool:
        """Whether a peer replica's queue head comes before a new ``request`` (it then waits)."""
        max_age_s = self.thresholds.peer_queue_max_age_s
        self._queue.forget_stale_peers(now=now, max_age_s=max_age_s)
        held = self._queue.held_until(
            now=now,
            max_hold_s=max_age_s,
            priority=request.priority,
            tenant=request.tenant,
            model=request.model,
        )
        return held is not None

    def hold_ends(self, *, now: float) -> float | None:
        """When the hold peer replicas' queue heads put on this router's queue lapses (it may then
        route what waits: :meth:`drain`); ``None`` when nothing holds it back."""
        max_age_s = self.thresholds.peer_queue_max_age_s
        self._queue.forget_stale_peers(now=now, max_age_s=max_age_s)
        return self._queue.held_until(now=now, max_hold_s=max_age_s)

    def drain(self, *, now: float) -> list[Route]:
        """Route what the queue may route now; returns the routes (what a replica calls when the
        hold of its peers' queue heads lapsed)."""
        return self._drain(now=now)

    def _drain(self, *, now: float) -> list[Route]:
        # Whatever changed the load (a first token, an end, a peer) updates the cost terms now,
        # so that a decision only pays for its own change.
        self.costs.refresh()
        routed: list[Route] = []
        max_age_s = self.thresholds.peer_queue_max_age_s
        self._queue.forget_stale_peers(now=now, max_age_s=max_age_s)
        while (head := self._queue.peek()) is not None:
            if self._queue.held_until(now=now, max_hold_s=max_age_s) is not None:
                break  # a peer replica's head comes first: the capacity is its to take
            key, queued = head
            route = self._try_route(queued.request, now=now, exclude=queued.exclude, retry=queued.retry)
            if route is None:
                break
            self._dequeue(key, retry=queued.retry)
            routed.append(route)
        return routed

    def _serves_first(self, key: str, *, now: float) -> bool:
        """Whether the queue serves ``key`` next, no peer replica's head coming first."""
        head = self._queue.peek()
        if head is None or head[0] != key:
            return False
        return self._queue.held_until(now=now, max_hold_s=self.thresholds.peer_queue_max_age_s) is None

    def _dequeue(self, key: str, *, retry: bool) -> None:
        """Take the routed ``key`` out of the queue, charging its tenant unless it is a retry (its
        tenant was charged when it was first routed)."""
        if retry:
            self._queue.remove(key)
        else:
            self._queue.pop(key)

    def _free(self, role: Role, exclude: frozenset[str]) -> _Eligible | None:
        """Workers of ``role``, not excluded and not busy, over every slot; ``None`` when there are
        none. Needs :meth:`WorkerCosts.refresh` first."""
        if not self._role_count[role]:
            return None
        versions = (self.costs.version, self._roles_version)
        if not exclude:
            cached = self._free_cache.get(role)
            if cached is not None and cached[0] == versions:
                return cached[1]
        free = self._present(role, exclude) & self.costs.free
        found = _Eligible.of(free) if free.any() else None
        if not exclude:
            self._free_cache[role] = (versions, found)
        return found

    def _present(self, role: Role, exclude: frozenset[str]) -> BoolArray:
        """Workers of ``role`` taking requests (not draining), not excluded, busy or not."""
        present = self._roles[role]
        if exclude:
            present = present.copy()
            for worker_id in exclude:
                slot = self.slots.get(worker_id)
                if slot is not None:
                    present[slot] = False
        return present

    def _narrow(self, request: RouteRequest, eligible: _Eligible | None) -> _Eligible | None:
        """Of ``eligible``, the workers of the request's model that can start its adapter now."""
        if eligible is None or not (request.model or request.adapter):
            return eligible
        mask = self.adapters.narrow(request, eligible.mask)
        if not mask.any():
            return None
        return eligible if np.array_equal(mask, eligible.mask) else _Eligible.of(mask)

    def _selection(self, request: RouteRequest, eligible: _Eligible, *, now: float) -> Selection:
        return Selection(
            request=request,
            eligible=eligible.mask,
            exclusion=eligible.exclusion,
            sequences=self.sequences,
            costs=self.costs,
            indexer=self.indexer,
            perf=self.perf,
            settings=self.settings,
            rng=self.rng,
            now=now,
            experts=self.experts,
            moe_perf=self.moe_perf,
            adapter_ms=self.adapters.load_ms(request, self.sequences.size),
        )

    def _try_route(
        self, request: RouteRequest, *, now: float, exclude: frozenset[str], retry: bool
    ) -> Route | None:
        self.costs.refresh()
        worker_free = self._narrow(request, self._free(Role.WORKER, exclude))
        decode_free = self._narrow(request, self._free(Role.DECODE, exclude))
        if decode_free is not None:
            prefill_free = self._narrow(request, self._free(Role.PREFILL, exclude))
            if prefill_free is not None:
                # Only prefill workers of a revision that has a free decode worker.
                prefill_free = self._of_revisions(prefill_free, self._revisions(decode_free))
            if prefill_free is not None:
                return self._route_disaggregated(
                    request, prefill_free, decode_free, exclude=exclude, retry=retry, now=now
                )
            if not self._prefill_serves(request, exclude, decode_free):
                # No prefill worker for it at all: decode workers serve whole requests. Prefill
                # workers that are only busy are waited for (as Dynamo's prefill router queues):
                # a prompt prefilled on a decode worker stalls every sequence it decodes and holds
                # its KV the longer, which is how one decode engine too few collapses.
                worker_free = (
                    decode_free if worker_free is None else _Eligible.of(worker_free.mask | decode_free.mask)
                )
        if worker_free is None:
            return None
        selection = self._within_step(self._selection(request, worker_free, now=now), exclude=exclude)
        guarded = None if selection is None else self._within_guards(selection)
        if guarded is None:
            return None
        return self._commit_aggregated(guarded, self.policy.choose(guarded), retry=retry, now=now)

    def steps_ms_with(self, request: RouteRequest, *, new_tokens: FloatArray) -> FloatArray:
        """Predicted step time of each worker once it holds ``request`` too, whose prompt has
        ``new_tokens`` uncached there (one figure per worker): its decode batch (one more sequence,
        the prompt's KV more) plus the fixed step cost and the compute of one chunk (at most
        ``max_num_batched_tokens``) of the prefill it then has outstanding (what the engine's
        chunked prefill puts in each step while that prefill lasts), ms."""
        seq = self.sequences
        size = seq.size
        decode = self.perf.itl_ms(seq.kv_tokens()[:size] + request.prompt_tokens, seq.requests[:size] + 1.0)
        chunk = np.minimum(seq.prefill_tokens[:size] + new_tokens, self.settings.max_num_batched_tokens)
        out: FloatArray = (
            decode + self.perf.f0 + self.perf.compute_ms_array(new_tokens=chunk, total_tokens=chunk)
        )
        return out

    def _within_step(self, selection: Selection, *, exclude: frozenset[str]) -> Selection | None:
        """Of ``selection``, while its request is contended (:meth:`_contended`), the workers where
        its uncached prompt fits in ``contended_prefill_tokens`` beside the prefill they hold, or
        that hold none, less those of the latter it leaves to the tenants its band serves first
        (:meth:`_left_to_others`); ``None`` when none is left (it waits)."""
        request = selection.request
        if not self._contended(request, now=selection.now):
            return selection
        pending = self.sequences.prefill_tokens
        step = self.thresholds.contended_prefill_tokens
        fits = pending + selection.uncached_tokens()[: len(pending)] <= step
        idle = pending <= 0.0
        mask = selection.eligible & (fits | idle)
        idle &= mask
        if idle.any() and int(idle.sum()) <= self._left_to_others(
            request, eligible=selection.eligible, exclude=exclude
        ):
            mask &= ~idle
        if not mask.any():
            return None
        if np.array_equal(mask, selection.eligible):
            return selection
        narrowed = _Eligible.of(mask)
        return dataclasses.replace(selection, eligible=narrowed.mask, exclusion=narrowed.exclusion)

    def _left_to_others(self, request: RouteRequest, *, eligible: BoolArray, exclude: frozenset[str]) -> int:
        """How many of the workers with no prefill queued ``request`` leaves idle while contended
        (:meth:`_within_step`): what the tenants of its band that were routed less than its tenant
        per unit of weight over ``rate_window_s`` (here and by peers) and have nothing waiting take
        of the workers that could take it (of its model, not excluded, busy or not), by their share
        of the tokens routed over the window, to the nearest, and never all of them (a guard, as
        trunk reservation keeps some circuits, never every one, for a protected class). The fair
        queue serves such a tenant's next request first, but its prompt, when longer than a step,
        needs a worker with none queued: had a tenant served more just taken the last one, it would
        wait for another's prefill to end. Those workers keep decoding; a tenant with requests
        waiting needs none left, the queue gives it the next worker anyway.

        Leaving one worker unreserved is what keeps the queue live: a request held back here has a
        worker that could take it that is busy or prefilling, whose next first token or end drains
        the queue again. Reserving all of them held requests back with nothing in flight to drain
        it (a fleet of one with three tenants in turn stalled until the queue timeout)."""
        routed = self._routed_in_band.get(request.priority)
        if routed is None or request.tenant not in routed:
            return 0  # a tenant routed nothing was routed less than nobody
        mine = routed.weighted(request.tenant)
        tokens, weights = routed.arrays()
        below = (tokens / weights < mine) & routed.outside(self._queue.waiting_tenants(request.priority))
        ahead = float(tokens[below].sum())
        if ahead <= 0.0:
            return 0
        present = np.zeros(len(eligible), dtype=bool)
        for role in self._role_count:
            if (self._roles[role] & eligible).any():
                present |= self._present(role, exclude)
        could_take = self._narrow(request, _Eligible.of(present))
        workers = 0 if could_take is None else int(could_take.mask.sum())
        return min(int(workers * ahead / self._routed_sum + 0.5), workers - 1)

    def _within_guards(self, selection: Selection) -> Selection | None:
        """Keep decode steps within the ITL targets of the objectives that have one:

        - ``selection`` loses the workers where a request of higher priority with an ITL target
          decodes and this request would make the predicted step longer than that target (``None``
          when none is left: the request waits, and lower priorities wait first);
        - a request with an ITL target goes, when there are such workers, only to those whose
          steps with the prefill they already hold stay within its target (its own prefill's steps
          are its own cost), and among them to those already guarded at its priority or above
          when there are any: the guarded workers stay few, the others serve lower priorities."""
        request = selection.request
        eligible = selection.eligible
        own = request.itl_slo_ms
        if not self._guards and own is None:
            return selection
        steps = self.steps_ms_with(request, new_tokens=selection.uncached_tokens()[: len(eligible)])
        mask = eligible.copy()
        for slot, guards in self._guards.items():
            target = min((itl for priority, itl in guards if priority > request.priority), default=None)
            if target is not None and slot < len(mask) and steps[slot] > target:
                mask[slot] = False
        if own is not None:
            calm = mask & (self.steps_ms_with(request, new_tokens=np.zeros(len(eligible))) <= own)
            if calm.any():
                # Pack: the calm workers already guarded at this priority or above first, so that the
                # guarded workers stay few and the others serve lower priorities at full speed.
                packed = calm.copy()
                for slot in np.flatnonzero(calm).tolist():
                    held = self._guards.get(slot, ())
                    packed[slot] = any(priority >= request.priority for priority, _ in held)
                mask = packed if packed.any() else calm
        if not mask.any():
            return None
        if np.array_equal(mask, eligible):
            return selection
        narrowed = _Eligible.of(mask)
        return dataclasses.replace(selection, eligible=narrowed.mask, exclusion=narrowed.exclusion)

    def _guard(self, request: RouteRequest, slot: int) -> None:
        """``request`` decodes on ``slot``: its ITL target (if any) guards that worker."""
        if request.itl_slo_ms is None:
            return
        guard = (request.priority, request.itl_slo_ms)
        self._guards.setdefault(slot, Counter())[guard] += 1
        self._guarded[request.request_id] = (slot, guard)

    def _unguard(self, request_id: str) -> None:
        entry = self._guarded.pop(request_id, None)
        if entry is None:
            return
        slot, guard = entry
        guards = self._guards[slot]
        guards[guard] -= 1
        if guards[guard] <= 0:
            del guards[guard]
        if not guards:
            del self._guards[slot]

    def fallbacks(
        self, request: RouteRequest, *, primary: str, exclude: frozenset[str], count: int, now: float
    ) -> list[str]:
        """Up to ``count`` other workers the policy would pick next for ``request`` (routed to
        ``primary``), best first, charged nothing: where a gateway retries when ``primary`` fails
        before answering. Only workers that serve whole requests and are not busy qualify."""
        chosen: list[str] = []
        skip = set(exclude) | {primary}
        self.costs.refresh()
        while len(chosen) < count:
            masks = [
                self._narrow(request, self._free(role, frozenset(skip)))
                for role in (Role.WORKER, Role.DECODE)
            ]
            found = [mask.mask for mask in masks if mask is not None]
            if not found:
                break
            eligible = _Eligible.of(np.logical_or.reduce(found))
            worker_id = self.slots.worker_id(self.policy.choose(self._selection(request, eligible, now=now)))
            chosen.append(worker_id)
            skip.add(worker_id)
        return chosen

    def assign(self, request: RouteRequest, worker_id: str, *, now: float) -> Route:
        """Charge ``request`` to ``worker_id`` whatever the policy and the busy thresholds say: a
        gateway already sent it there (a fallback, after the chosen worker failed). Raises
        :class:`NoWorkers` for a worker that is not registered."""
        slot = self.slots.get(worker_id)
        if slot is None or worker_id not in self.workers:
            raise NoWorkers(f"worker {worker_id} is not registered")
        self.costs.refresh()
        only = np.zeros(self.sequences.size, dtype=bool)
        only[slot] = True
        selection = self._selection(request, _Eligible.of(only), now=now)
        # a move, not a new request: its tenant was charged where it was first routed
        return self._commit_aggregated(selection, slot, retry=True, now=now)

    def _commit_aggregated(self, selection: Selection, slot: int, *, retry: bool, now: float) -> Route:
        request = selection.request
        cached = selection.cached_tokens(slot)
        ttft = selection.ttft_ms().item(slot)  # before charging changes the load
        onboard_ms = selection.onboard_ms(slot)
        self._charge(
            request,
            slot=slot,
            cached_tokens=cached,
            onboard_ms=onboard_ms,
            output=True,
            key=request.request_id,
            retry=retry,
            now=now,
        )
        self._guard(request, slot)
        return self._commit(
            Route(
                request_id=request.request_id,
                worker_id=self.slots.worker_id(slot),
                prefill_worker_id=None,
                prompt_tokens=request.prompt_tokens,
                cached_tokens=cached,
                predicted_ttft_ms=ttft,
                onboard_ms=onboard_ms,
            ),
            request,
        )

    def _prefill_serves(self, request: RouteRequest, exclude: frozenset[str], decode_free: _Eligible) -> bool:
        """Whether a prefill worker of the revision of one of ``decode_free`` could prefill
        ``request`` once it is no longer busy."""
        present = self._present(Role.PREFILL, exclude)
        if not present.any():
            return False
        eligible = self._narrow(request, _Eligible.of(present))
        return eligible is not None and self._of_revisions(eligible, self._revisions(decode_free)) is not None

    def _revisions(self, eligible: _Eligible) -> set[str | None]:
        slots = np.flatnonzero(eligible.mask).tolist()
        return {self.workers[self.slots.worker_id(slot)].revision for slot in slots}

    def _of_revisions(self, eligible: _Eligible, revisions: set[str | None]) -> _Eligible | None:
        """The workers of ``eligible`` running one of ``revisions`` (None when there is none)."""
        mask = eligible.mask.copy()
        for slot in np.flatnonzero(mask).tolist():
            mask[slot] = self.workers[self.slots.worker_id(slot)].revision in revisions
        if not mask.any():
            return None
        return eligible if np.array_equal(mask, eligible.mask) else _Eligible.of(mask)

    def _route_disaggregated(
        self,
        request: RouteRequest,
        prefill_free: _Eligible,
        decode_free: _Eligible,
        *,
        exclude: frozenset[str],
        retry: bool,
        now: float,
    ) -> Route | None:
        prefill = self._within_step(self._selection(request, prefill_free, now=now), exclude=exclude)
        if prefill is None:
            return None
        p_slot = self.policy.choose(prefill)
        p_worker = self.workers[self.slots.worker_id(p_slot)]
        p_locality = p_worker.locality
        paired = self._of_revisions(decode_free, {p_worker.revision})
        assert paired is not None, "the prefill candidates were those with a free decode worker"
        decode_free = paired

        decode = dataclasses.replace(prefill, eligible=decode_free.mask, exclusion=decode_free.exclusion)
        near = np.zeros(len(decode_free.mask), dtype=bool)
        if p_locality is not None:
            for slot in np.flatnonzero(decode_free.mask).tolist():
                near[slot] = self.workers[self.slots.worker_id(slot)].locality == p_locality
        transfer: FloatArray = np.where(
            near,
            self.disagg.transfer_ms(request.prompt_tokens, near=True),
            self.disagg.transfer_ms(request.prompt_tokens, near=False),
        )
        if self.policy_name == "kv" or (self.policy_name == "kv_expert" and self.experts is None):
            d_slot = pick_lowest(
                decode.decode_ms() + transfer, decode_free.exclusion, temperature=0.0, rng=self.rng
            )
        elif self.policy_name == "kv_expert":
            # The decode worker by its decode time with the MoE layers: where the expert load in
            # flight leaves this request's experts on cold ranks.
            d_slot = pick_lowest(
                decode.moe_decode_ms() + transfer, decode_free.exclusion, temperature=0.0, rng=self.rng
            )
        else:
            d_slot = self.policy.choose(decode)
        local_cached = decode.cached_tokens(d_slot)
        local_compute = self.perf.compute_ms(
            new_tokens=request.prompt_tokens - local_cached, cached_tokens=local_cached
        )
        if local_compute <= transfer[d_slot]:
            # Moving the KV would cost more than computing it within the decode worker's next step.
            return self._commit_aggregated(decode, d_slot, retry=retry, now=now)
        remote_ttft = float(prefill.ttft_ms()[p_slot] + transfer[d_slot])

        cached = prefill.cached_tokens(p_slot)
        prefill_key = _prefill_key(request.request_id)
        onboard_ms = prefill.onboard_ms(p_slot)
        self._charge(
            request,
            slot=p_slot,
            cached_tokens=cached,
            onboard_ms=onboard_ms,
            output=False,
            key=prefill_key,
            retry=retry,
            now=now,
        )
        self._charge(
            request,
            slot=d_slot,
            cached_tokens=request.prompt_tokens,
            onboard_ms=0.0,
            output=True,
            key=request.request_id,
            retry=retry,
            now=now,
        )
        self._guard(request, d_slot)
        return self._commit(
            Route(
                request_id=request.request_id,
                worker_id=self.slots.worker_id(d_slot),
                prefill_worker_id=self.slots.worker_id(p_slot),
                prompt_tokens=request.prompt_tokens,
                cached_tokens=cached,
                predicted_ttft_ms=remote_ttft,
                onboard_ms=onboard_ms,
            ),
            request,
        )

    def _commit(self, route: Route, request: RouteRequest) -> Route:
        self._routes[route.request_id] = route
        if request.adapter:
            workers = (
                (route.worker_id,)
                if route.prefill_worker_id is None
                else (route.prefill_worker_id, route.worker_id)
            )
            slots = tuple(self.slots.slot(worker_id) for worker_id in workers)
            self.adapters.routed(route.request_id, slots=slots, adapter=request.adapter)
        self.prompt_tokens_routed += route.prompt_tokens
        self.cached_tokens_routed += route.cached_tokens
        return route

    def _charge(
        self,
        request: RouteRequest,
        *,
        slot: int,
        cached_tokens: int,
        onboard_ms: float,
        output: bool,
        key: str,
        retry: bool,
        now: float,
    ) -> None:
        """Account ``request`` on ``slot`` under ``key``: prefill the uncached tokens after onboarding
        the cached blocks kept below the GPU (``onboard_ms``), hold the prompt's KV (and the output's,
        where it decodes); tell peer routers. A ``retry`` (routed before) adds nothing to the routed
        rate, here or at the peers: its tokens were counted at its first route."""
        bs = self.settings.block_size
        new_tokens = request.prompt_tokens - cached_tokens
        prefill_ms = onboard_ms
        if new_tokens:
            prefill_ms += self.perf.compute_ms(new_tokens=new_tokens, cached_tokens=cached_tokens)
        tail = request.prompt_tokens - len(request.hashes) * bs
        kv_extra = float(tail + (request.max_tokens if output else 0))
        self.sequences.add(
            key,
            slot=slot,
            hashes=request.hashes,
            prefill_tokens=new_tokens,
            prefill_ms=prefill_ms,
            kv_tokens=kv_extra,
            now=now,
            output_tokens=request.max_tokens if output else 0,
        )
        if output and not retry:
            self._count_routed(
                float(request.prompt_tokens + request.max_tokens),
                priority=request.priority,
                tenant=request.tenant,
                now=now,
            )
        if output and self.experts is not None:
            self.experts.add(key, slot=slot, key=request.hashes[0] if request.hashes else None)
        self.costs.refresh()
        total_blocks = math.ceil((request.prompt_tokens + (request.max_tokens if output else 0)) / bs)
        self.indexer.on_routed(slot, request.hashes, total_blocks=total_blocks)
        if self.outbox is not None:
            record = FlightRecord(
                worker_id=self.slots.worker_id(slot),
                hashes=request.hashes,
                prefill_tokens=new_tokens,
                prefill_ms=prefill_ms,
                kv_tokens=kv_extra,
                output_tokens=request.max_tokens if output else 0,
                tenant=request.tenant,
                priority=request.priority,
                adapter=request.adapter,
                retry=retry,
            )
            self.outbox.append(PeerChange(op="add", key=key, record=record))

    # -- peers (replica sync) -----------------------------------------------------------------

    def apply_peer(self, change: PeerChange, *, peer: str, now: float) -> list[Route]:
        """Mirror a change made by the router replica ``peer``; returns queued requests it lets
        through. Charges on workers this router does not know are ignored."""
        key = f"{peer}/{change.key}"
        if change.op == "add":
            record = change.record
            if record is None:
                return []
            mirrored = self._mirror_add(key, record, now=now)
            if record.output_tokens and not record.retry:
                # the request's main charge, at its first route: what the peer served it
                served = len(record.hashes) * self.settings.block_size + record.kv_tokens
                if self.limits is not None:
                    # A tenant's limit holds across replicas, not once per replica: what the peer
                    # let through takes from the bucket here too (whatever workers this one knows).
                    self.limits.take(record.tenant, served, now=now)
                if mirrored:
                    self._queue.charge(priority=record.priority, tenant=record.tenant, tokens=served)
                    self._count_routed(served, priority=record.priority, tenant=record.tenant, now=now)
            return []
        if change.op == "prefilled":
            self.sequences.prefill_done(key, now=now)
        else:
            self.sequences.free(key, now=now)
            self.adapters.finished(key)
        return self._drain(now=now)

    def _mirror_add(self, key: str, record: FlightRecord, *, now: float) -> bool:
        """Charge ``record`` (a peer's) under ``key`` to its worker; ``False`` when this router
        does not know the worker."""
        if record.worker_id not in self.workers:
            return False
        slot = self.slots.get(record.worker_id)
        if slot is None:
            return False
        self.sequences.add(
            key,
            slot=slot,
            hashes=record.hashes,
            prefill_tokens=record.prefill_tokens,
            prefill_ms=record.prefill_ms,
            kv_tokens=record.kv_tokens,
            now=now,
            output_tokens=record.output_tokens,
        )
        if record.adapter and self.adapters.settings.shared:
            self.adapters.routed(key, slots=(slot,), adapter=record.adapter, peer=True)
        return True

    @property
    def queue_version(self) -> int:
        """Moves whenever :meth:`queue_heads` may have changed (other than by ageing)."""
        return self._queue.version

    def queue_heads(self, *, now: float) -> list[QueueHead]:
        """Per priority band and waiting tenant, the request this replica's queue serves next, at
        ``now`` (for its peers)."""
        return self._queue.heads(now=now)

    def apply_peer_queue(
        self,
        peer: str,
        heads: Sequence[QueueHead],
        *,
        now: float,
        heard: float | None = None,
        earlier: Sequence[HeardHeads] = (),
    ) -> list[Route]:
        """The queue heads of the router replica ``peer`` (every band it has requests waiting in),
        heard at ``heard`` (``now`` when not given; earlier when they had to wait for the changes
        sent before them, as had the heads ``peer`` sent ``earlier``) and applied at ``now``: this
        replica holds its own head back while one of them comes first, for at most
        ``peer_queue_max_age_s`` after the peer's request was first heard
        (:mod:`copse.router.fairness`). Returns queued requests it lets through."""
        seen = now if heard is None else heard
        if not self._queue.observe_peer(peer, heads, now=seen, earlier=earlier):
            return []
        return self._drain(now=now) if self._queue else []

    def own_flights(self) -> list[tuple[str, FlightRecord, bool]]:
        """What this router itself has charged workers, for a peer replica's snapshot: per charge
        its key, what was charged and whether it is still prefilling."""
        flights = []
        for request_id, route in self._routes.items():
            keys = (
                (request_id,) if route.prefill_worker_id is None else (request_id, _prefill_key(request_id))
            )
            for key in keys:
                flight = self.sequences.get(key)
                if flight is None:
                    continue
                record = FlightRecord(
                    worker_id=self.slots.worker_id(flight.slot),
                    hashes=flight.hashes,
                    prefill_tokens=flight.prefill_tokens,
                    prefill_ms=flight.prefill_ms,
                    kv_tokens=flight.kv_tokens,
                    output_tokens=flight.output_tokens,
                    adapter=self.adapters.adapter_of(request_id),
                )
                flights.append((key, record, flight.prefilling))
        return flights

    def held_adapters(self) -> dict[str, list[str]]:
        """The adapters each worker is believed to hold, least recently used first (for a peer
        replica's snapshot; workers holding none are left out)."""
        held = {
            worker_id: self.adapters.held(slot)
            for worker_id in self.workers
            if (slot := self.slots.get(worker_id)) is not None
        }
        return {worker_id: adapters for worker_id, adapters in held.items() if adapters}

    def load_peer_snapshot(
        self,
        peer: str,
        flights: Sequence[tuple[str, FlightRecord, bool]],
        *,
        now: float,
        adapters: Mapping[str, Sequence[str]] | None = None,
    ) -> list[Route]:
        """Replace what is known of ``peer``'s load with its snapshot (:meth:`own_flights` there)
        and, unless adapter sharing is off, take its view of the adapters each worker holds
        (``adapters``, :meth:`held_adapters` there); returns queued requests it lets through."""
        self._forget_peer_load(peer, now=now)  # its queue heads stay: they are not in a snapshot
        for key, record, prefilling in flights:
            # In flight, not new: its tenant was charged and its tokens counted when it was routed
            # (a snapshot comes again at every gap in the peer's messages).
            if not self._mirror_add(f"{peer}/{key}", record, now=now):
                continue
            if not prefilling:
                self.sequences.prefill_done(f"{peer}/{key}", now=now)
        if adapters and self.adapters.settings.shared:
            for worker_id, held in adapters.items():
                slot = self.slots.get(worker_id)
                if slot is not None and worker_id in self.workers:
                    self.adapters.merge(slot, list(held))
                elif len(self._peer_held) < MAX_PEER_HELD:
                    self._peer_held[worker_id] = (peer, list(held))
        return self._drain(now=now)

    def forget_peer(self, peer: str, *, now: float) -> list[Route]:
        """Drop every charge made by ``peer`` and its queue heads (it stopped or restarted)."""
        self._queue.forget_peer(peer)
        self._forget_peer_load(peer, now=now)
        return self._drain(now=now)

    def _forget_peer_load(self, peer: str, *, now: float) -> None:
        prefix = f"{peer}/"
        self._peer_held = {worker: held for worker, held in self._peer_held.items() if held[0] != peer}
        for key in self.sequences.keys_with_prefix(prefix):
            self.sequences.free(key, now=now)
            self.adapters.finished(key)

    def expire(self, *, now: float, max_age_s: float) -> list[str]:
        """Free in-flight entries older than ``max_age_s`` whose end was never reported (lost peer
        messages, or a caller that never reported); returns their keys."""
        expired = self.sequences.expire(now=now, max_age_s=max_age_s)
        for key in expired:
            self._routes.pop(key, None)
            self.adapters.finished(key)
        return expired
