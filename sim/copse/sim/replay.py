"""Trace replay: the router and N mocked engines on one virtual clock (a discrete-event simulation).

Every arrival of the trace (timestamps divided by ``speedup``) is routed by the real routing core
with the chosen policy and submitted to a mocked engine (:mod:`copse.workers.mocker`); first
tokens and finishes reach its load tracker as they happen on the virtual clock. The same trace,
settings and seed give the same report.

The router is not the simulator's oracle. It predicts with its own perf model
(:class:`RouterModel`: by default a profile measured from noisy engines, :mod:`copse.sim.profiler`,
optionally mis-specified), the engines' step times vary around their model (``engine_noise``),
and KV events reach the router's indexer the way NATS delivers them: each engine publishes the
events of a step as one batch when the step ends, and the batch is applied ``kv_event_lag_ms``
later. Every policy sees the same indexer and the same load tracker.

Engines use the trace's block size (one trace hash id = one KV block) unless the engine config
sets ``block_size``, which must then divide it so that prefixes shared in the trace are shared
by the engines.

Latencies are measured from the trace arrival (so time spent in the router's queue counts):
TTFT to the first token, e2e to the last, ITL as each request's mean gap between output tokens.
The cache hit rate is the share of prompt tokens the engines found in their prefix caches (on any
tier: engines with offload tiers, ``host_cache_bytes`` in the engine config, also find prefixes in
host memory or on disk, and onboard them; the router is told the tiers' bandwidths, as a deployed
router is by its config).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from copse.router.adapters import AdapterRouting
from copse.router.core import (
    DisaggSettings,
    NoWorkers,
    Role,
    Route,
    Router,
    Shed,
    Thresholds,
    WorkerInfo,
)
from copse.router.fairness import QueueHead
from copse.router.policies import RouteRequest, RoutingObjective, SelectionSettings
from copse.sim.profiler import ScaledPerfModel, measure_profile
from copse.sim.trace import TokenSynth, TraceRequest
from copse.workers.files import read_yaml_mapping
from copse.workers.mocker import (
    Engine,
    EngineConfig,
    EngineOverloaded,
    Request,
    RequestRejected,
    Simulator,
    StepOutput,
)
from copse.workers.mocker import Role as EngineRole
from copse.workers.moe import MoeConfig
from copse.workers.perf import PerfModel, load_perf_model
from copse.workers.protocol.hashing import hash_blocks, lora_int_id
from copse.workers.protocol.kv_events import KvEvent


class EngineConfigError(ValueError):
    """An engine config file that cannot be used; the message names the file and the key."""


@dataclasses.dataclass(frozen=True, slots=True)
class EngineSetup:
    """The mocked engines of a replay: scheduler settings and the perf model timing them."""

    config: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    perf: PerfModel = dataclasses.field(default_factory=lambda: load_perf_model(None))
    block_size_set: bool = False
    """Whether the block size was chosen explicitly; otherwise a replay uses the trace's."""


def load_engine_setup(path: str | Path | None) -> EngineSetup:
    """Engines from a YAML/JSON mapping of :class:`EngineConfig` fields plus ``perf_profile`` (a
    profile file for :func:`copse.workers.perf.load_perf_model`, relative to the config file);
    defaults when ``path`` is ``None``. Raises :class:`EngineConfigError`."""
    if path is None:
        return EngineSetup()
    path = Path(path)
    raw = read_yaml_mapping(path, what="engine settings", error=EngineConfigError)
    profile = raw.pop("perf_profile", None)
    known = {field.name for field in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise EngineConfigError(
            f"{path}: unknown key(s) {', '.join(unknown)}; known: perf_profile, {', '.join(sorted(known))}"
        )
    moe = raw.pop("moe", None)
    if moe is not None:
        moe_known = {field.name for field in dataclasses.fields(MoeConfig)}
        if not isinstance(moe, dict) or set(moe) - moe_known:
            unknown_moe = sorted(set(moe) - moe_known) if isinstance(moe, dict) else [repr(moe)]
            raise EngineConfigError(
                f"{path}: moe: unknown key(s) {', '.join(unknown_moe)}; known: {', '.join(sorted(moe_known))}"
            )
        try:
            raw["moe"] = MoeConfig(**moe)
        except (TypeError, ValueError) as exc:
            raise EngineConfigError(f"{path}: {exc}") from exc
    try:
        config = EngineConfig(**raw)
    except (TypeError, ValueError) as exc:
        raise EngineConfigError(f"{path}: {exc}") from exc
    block_size_set = "block_size" in raw
    profile_path = None if profile is None else (path.parent / str(profile))
    try:
        capacity = None if config.num_blocks is None else config.num_blocks * config.block_size
        perf = load_perf_model(profile_path, kv_capacity_tokens=capacity)
    except ValueError as exc:
        raise EngineConfigError(f"{path}: perf_profile: {exc}") from exc
    return EngineSetup(config=config, perf=perf, block_size_set=block_size_set)


#: Step-time variation of the engines of a replay, unless told otherwise.
DEFAULT_ENGINE_NOISE = 0.05
#: KV event delay of a replay, unless told otherwise: half the KV relay's 100 ms poll of
#: ``trtllm-serve`` (an event waits for the next poll), NATS delivery on a LAN adding little.
DEFAULT_KV_EVENT_LAG_MS = 50.0


@functools.lru_cache(maxsize=8)
def _measured(config: EngineConfig, perf: PerfModel, *, balanced: bool = False) -> PerfModel:
    """The profile of engines of ``config`` (once per config: replays of several policies share it);
    ``balanced``: of their steps without MoE terms."""
    return measure_profile(config=config, perf=perf, balanced=balanced)


@dataclasses.dataclass(frozen=True, slots=True)
class RouterModel:
    """The perf model the router predicts with."""

    source: Literal["measured", "exact"] | PerfModel = "measured"
    """``measured``: profiled from the replay's engines, noise and all (what a deployment has);
    ``exact``: the engines' own model (an oracle no deployment has); or a given model."""
    prefill_scale: float = 1.0
    """The router believes prefill takes this times as long as ``source`` says (0.7: 30 % faster)."""

    def __post_init__(self) -> None:
        if not (self.prefill_scale > 0 and math.isfinite(self.prefill_scale)):
            raise ValueError(f"prefill_scale must be a positive number, got {self.prefill_scale}")

    def resolve(self, *, config: EngineConfig, perf: PerfModel) -> PerfModel:
        """The router's model for engines of ``config`` timed by ``perf``."""
        if self.source == "measured":
            base: PerfModel = _measured(config, perf)
        elif self.source == "exact":
            base = perf
        else:
            assert not isinstance(self.source, str)
            base = self.source
        return (
            base
            if self.prefill_scale == 1.0
            else ScaledPerfModel(base=base, prefill_scale=self.prefill_scale)
        )

    def balanced(self, *, config: EngineConfig, perf: PerfModel) -> PerfModel | None:
        """The balanced step of expert-parallel engines of ``config`` (without the MoE terms the
        :meth:`resolve` model's steps hold, see :meth:`copse.router.experts.ExpertTracker.moe_ms`):
        ``measured``, the same profile less the MoE terms its engines report; ``exact``, the engines'
        own model (they stretch it and add the all-to-all); ``None`` for a given model (what its
        steps hold is not known) and for dense engines."""
        if config.moe is None or not isinstance(self.source, str):
            return None
        base = _measured(config, perf, balanced=True) if self.source == "measured" else perf
        return (
            base
            if self.prefill_scale == 1.0
            else ScaledPerfModel(base=base, prefill_scale=self.prefill_scale)
        )

    def describe(self) -> str:
        name = self.source if isinstance(self.source, str) else "given"
        if self.prefill_scale == 1.0:
            return name
        return f"{name}, prefill x{self.prefill_scale:g}"


@dataclasses.dataclass(frozen=True, slots=True)
class ReplaySettings:
    """One replay."""

    policy: str = "kv"
    workers: int = 16
    """Mocked engines serving whole requests."""
    speedup: float = 1.0
    """Arrival timestamps are divided by this (more load from the same trace)."""
    seed: int = 0
    """Seeds token synthesis, tie-breaking and the engines' generated tokens."""
    trace_block_size: int = 512
    """Tokens per trace hash id (512 for Mooncake traces)."""
    temperature: float = 0.0
    """Softmax temperature of the router's selection."""
    objective: RoutingObjective = "e2e"
    """What ``kv`` minimises (``SelectionSettings.objective``)."""
    decode_weight: float = 0.0
    """Weight of predicted decode time in the ``kv`` cost under the ``ttft`` objective."""
    expert_weight: float = 1.0
    """Weight of the predicted decode time with the MoE layers in the ``kv_expert`` cost."""
    expert_reports: bool = True
    """MoE engines report each finished request's routed-expert counts to the router (off: the
    router expects every request to use the experts alike; an ablation of ``kv_expert``)."""
    thresholds: Thresholds = dataclasses.field(default_factory=Thresholds)
    engines: EngineSetup = dataclasses.field(default_factory=EngineSetup)
    engine_noise: float = DEFAULT_ENGINE_NOISE
    """Coefficient of variation of the engines' step times (replaces the engine config's
    ``step_time_cv``, as ``seed`` replaces its seed)."""
    kv_event_lag_ms: float = DEFAULT_KV_EVENT_LAG_MS
    """Delay from the end of an engine step to its KV events reaching the router's indexer."""
    router_model: RouterModel = dataclasses.field(default_factory=RouterModel)
    """What the router believes about the engines' speed."""
    adapters: AdapterRouting = dataclasses.field(default_factory=AdapterRouting)
    """How the router weighs LoRA adapters (requests name theirs in :attr:`RequestClass.adapter`;
    the engines' adapter cache is the engine config's ``adapters``)."""

    def engine_config(self) -> EngineConfig:
        """The engines' config as replayed: the trace's block size unless set, this noise."""
        config = self.engines.config
        if not self.engines.block_size_set:
            config = dataclasses.replace(config, block_size=self.trace_block_size)
        return dataclasses.replace(config, step_time_cv=self.engine_noise, seed=self.seed)


@dataclasses.dataclass(frozen=True, slots=True)
class Distribution:
    """Summary of a latency distribution, ms."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: npt.NDArray[np.float64]) -> Distribution:
        values = values[~np.isnan(values)]
        if not len(values):
            return cls(mean=math.nan, p50=math.nan, p90=math.nan, p99=math.nan)
        p50, p90, p99 = np.percentile(values, [50, 90, 99]).tolist()
        return cls(mean=float(values.mean()), p50=p50, p90=p90, p99=p99)

    def as_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "p50": self.p50, "p90": self.p90, "p99": self.p99}


@dataclasses.dataclass(frozen=True, slots=True)
class MoeReport:
    """What the expert-parallel engines of a replay did (Mixture-of-Experts engines only)."""

    all_to_all_bytes_per_token: float
    """Bytes the EP ranks sent each other (every MoE layer, dispatch and combine) per output token:
    prompt tokens prefilled count too, cached ones do not."""
    imbalance: float
    """Activations on the most loaded EP rank over the mean rank's, over every step (1: balanced)."""
    moe_share: float
    """Share of the engines' step time the MoE terms took (slowest rank's stretch and all-to-all)."""
    rebalances: int
    """Expert placements the engines' online load balancers made."""

    def as_json(self) -> dict[str, float]:
        return {
            "all_to_all_bytes_per_token": self.all_to_all_bytes_per_token,
            "imbalance": self.imbalance,
            "moe_share": self.moe_share,
            "rebalances": self.rebalances,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class OffloadReport:
    """Where the engines found cached prefixes (engines with offload tiers only)."""

    host_hit_rate: float
    """Prompt tokens onboarded from host memory / all prompt tokens."""
    disk_hit_rate: float
    """Prompt tokens onboarded from disk / all prompt tokens."""

    def as_json(self) -> dict[str, float]:
        return {"host_hit_rate": self.host_hit_rate, "disk_hit_rate": self.disk_hit_rate}


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayReport:
    """What a replay measured."""

    policy: str
    workers: int
    requests: int
    """Requests that completed."""
    ttft_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    cache_hit_rate: float
    """Prompt tokens found in the engines' prefix caches / all prompt tokens."""
    throughput_tok_s: float
    """Output tokens per second of virtual time, first arrival to last finish."""
    failed: int
    """Requests refused (by the router's full queue, or by an engine)."""
    preemptions: int
    simulated_s: float
    wall_s: float
    moe: MoeReport | None = None
    offload: OffloadReport | None = None
    engine_lag_ms: float | None = None
    """Live replays: the mean delay between an engine step's end on its own timeline and its output
    leaving the engines' process (how far the host fell behind the engines it simulates)."""

    def as_json(self) -> dict[str, Any]:
        """The report in the documented ``-o json`` shape (``moe`` only for MoE engines, ``offload``
        only for engines with offload tiers, ``engine_lag_ms`` only for live replays)."""
        extra: dict[str, Any] = {} if self.moe is None else {"moe": self.moe.as_json()}
        if self.offload is not None:
            extra["offload"] = self.offload.as_json()
        if self.engine_lag_ms is not None:
            extra["engine_lag_ms"] = self.engine_lag_ms
        return {
            **extra,
            "policy": self.policy,
            "workers": self.workers,
            "requests": self.requests,
            "ttft_ms": self.ttft_ms.as_dict(),
            "itl_ms": self.itl_ms.as_dict(),
            "e2e_ms": self.e2e_ms.as_dict(),
            "cache_hit_rate": self.cache_hit_rate,
            "throughput_tok_s": self.throughput_tok_s,
        }


class KvEventChannel:
    """KV event batches on their way from the engines to the router, as NATS delivers them: a batch
    published at ``t`` is applied whole at ``t + lag_ms``, batches in publishing order."""

    def __init__(self, *, lag_ms: float, apply: Callable[[int, list[KvEvent]], None]) -> None:
        """``apply(source, events)`` hands one batch to the router's indexer."""
        if not (lag_ms >= 0 and math.isfinite(lag_ms)):
            raise ValueError(f"the KV event lag must be a non-negative number of ms, got {lag_ms}")
        self.lag_ms = lag_ms
        self._apply = apply
        self._in_flight: deque[tuple[float, int, list[KvEvent]]] = deque()

    def publish(self, *, at_ms: float, source: int, events: list[KvEvent]) -> None:
        """Send a batch at ``at_ms`` (times never decrease from one call to the next)."""
        self._in_flight.append((at_ms + self.lag_ms, source, events))

    def deliver(self, now_ms: float) -> int:
        """Apply every batch that has arrived by ``now_ms``; returns how many."""
        in_flight, delivered = self._in_flight, 0
        while in_flight and in_flight[0][0] <= now_ms:
            _, source, events = in_flight.popleft()
            self._apply(source, events)
            delivered += 1
        return delivered

    def __len__(self) -> int:
        """Batches still on their way."""
        return len(self._in_flight)


@dataclasses.dataclass(frozen=True, slots=True)
class RequestClass:
    """Who sent a trace request and how it must be served (shared-fleet replays)."""

    objective: str = ""
    priority: int = 0
    tenant: str = ""
    ttft_slo_ms: float | None = None
    itl_slo_ms: float | None = None
    adapter: str = ""
    """The LoRA adapter it is served through ("": the base model)."""


@dataclasses.dataclass(slots=True)
class _Pending:
    index: int
    tokens: npt.NDArray[np.uint32]
    hashes: list[int]
    local: list[int]
    max_tokens: int
    adapter: str | None = None


_ENGINE_ROLES: dict[Role, EngineRole] = {
    Role.WORKER: "aggregated",
    Role.PREFILL: "prefill",
    Role.DECODE: "decode",
}


class Fleet:
    """Mocked engines behind the real router on one virtual clock, serving the requests of a trace.

    The caller moves the clock (:meth:`run_until`), makes trace requests arrive (:meth:`arrive`),
    and may add engines and drain them; per-request times land in the arrays (ms, NaN until they
    happen; indexed like the trace). An engine being drained takes no new requests (the router has
    forgotten it) and finishes those it has; :attr:`retired_ms` says when it had none left.

    Disaggregated fleets have prefill and decode engines: the router's P/D path picks both; the
    prefill engine computes the prompt and its first token (a context-only request, ``max_tokens``
    1), then the decode engine receives the KV (the transfer takes ``prompt tokens x
    kv_bytes_per_token / kv_transfer_bandwidth_gbps``, as the mocker times it; the router is told
    the same bandwidth) and streams the output from that first token on. TTFT is the decode
    engine's first token, as the client sees it. A prompt the router keeps on the decode engine
    (too short to be worth moving) is served there whole.
    """

    def __init__(
        self,
        trace: Sequence[TraceRequest],
        settings: ReplaySettings,
        *,
        engines: int | Mapping[Role, int],
        classes: Sequence[RequestClass] | None = None,
        replica_of: Sequence[int] | None = None,
    ) -> None:
        """``engines`` serve from the start: a number of aggregated workers, or engines per role
        (prefill and decode for a disaggregated fleet); ``classes``: each request's objective and
        tenant (all of the default class when not given); ``replica_of``: the router replica each
        request arrives at (one router when not given). Replicas share their in-flight load, the
        tokens they served each tenant and their queues' heads as the real ones do over NATS
        (their :class:`~copse.router.core.PeerChange` s and
        :class:`~copse.router.fairness.QueueHead` s), delivered at once; each learns the engines'
        caches from the same KV events. Raises ``ValueError`` for unusable settings."""
        pools = {Role.WORKER: engines} if isinstance(engines, int) else dict(engines)
        if set(pools) not in ({Role.WORKER}, {Role.PREFILL, Role.DECODE}):
            raise ValueError(f"a fleet has workers, or prefill and decode engines; got {sorted(pools)}")
        self.front = Role.PREFILL if Role.PREFILL in pools else Role.WORKER
        """The pool requests queue in front of: aggregated workers, or prefill engines."""
        self.settings = settings
        self.trace = trace
        config = settings.engine_config()
        block_size = config.block_size
        if settings.trace_block_size % block_size:
            raise ValueError(
                f"engine block_size {block_size} must divide the trace block size "
                f"{settings.trace_block_size}, or prefixes shared in the trace would not be shared by "
                "the engines"
            )
        if not settings.speedup > 0:
            raise ValueError(f"speedup must be positive, got {settings.speedup}")
        self._config = config
        self._perf = settings.engines.perf
        self.router_perf = settings.router_model.resolve(config=config, perf=self._perf)
        """The perf model the router predicts with (and a planner would size with)."""
        host_block_ms, disk_block_ms = config.offload.block_ms(block_bytes=config.block_bytes)
        self.replica_of = None if replica_of is None else list(replica_of)
        replicas = 1 if not self.replica_of else max(self.replica_of) + 1
        self.routers = [
            self._make_router(settings, config, host_block_ms, disk_block_ms, share_load=replicas > 1)
            for _ in range(replicas)
        ]
        """The router replicas (one unless ``replica_of`` names more)."""
        self.router = self.routers[0]
        """The first replica (the only one by default)."""
        self._heads_sent: list[list[QueueHead]] = [[] for _ in self.routers]
        """Each replica's queue heads as its peers last heard them."""
        self._owner: dict[str, int] = {}
        """Request id -> the replica that routes it."""
        self.simulator = Simulator([], on_step=self._on_step, fuse_until_submit=True)
        self.channel = KvEventChannel(lag_ms=settings.kv_event_lag_ms, apply=self._apply_events)
        self._synth = TokenSynth(seed=settings.seed, trace_block_size=settings.trace_block_size)
        self._index_of: dict[str, int] = {}
        n = len(trace)
        self.arrival_ms = np.array([r.timestamp_ms / settings.speedup for r in trace])
        self.routed_ms = np.full(n, np.nan)
        self.first_ms = np.full(n, np.nan)
        self.finish_ms = np.full(n, np.nan)
        self.failed_ms = np.full(n, np.nan)
        """When a request was refused (router queue full, or the engine refused it)."""
        self.classes = classes
        self.shed_ms = np.full(n, np.nan)
        """When the router shed a request (what a client sees as a 429): also in ``failed_ms``."""
        self.outputs = np.zeros(n)
        self.prompts = np.array([r.input_length for r in trace], dtype=np.float64)
        self.cached = np.zeros(n)
        """Prompt tokens the engine found cached."""
        self.predicted_cached = np.zeros(n)
        """Prompt tokens the router predicted the chosen engine held."""
        self.predicted_onboard_ms = np.zeros(n)
        """Time the router predicted the chosen engine would spend onboarding cached blocks, ms."""
        self._pending: dict[str, _Pending] = {}
        self._placements: list[int] = []
        """Expert placement version each MoE engine last reported to the router."""
        self.draining: set[int] = set()
        self.retired_ms: dict[int, float] = {}
        self.roles: list[Role] = []
        """Each engine's role."""
        self._handoff: dict[str, tuple[int, _Pending]] = {}
        """Requests being prefilled remotely: their decode engine and what it will be sent."""
        self._incoming: Counter[int] = Counter()
        """Per decode engine, requests on their way to it (it is not drained before they arrive)."""
        for role, count in pools.items():
            for _ in range(count):
                self.add_engine(role)

    def _make_router(
        self,
        settings: ReplaySettings,
        config: EngineConfig,
        host_block_ms: float,
        disk_block_ms: float,
        *,
        share_load: bool,
    ) -> Router:
        block_size = config.block_size
        return Router(
            perf=self.router_perf,
            settings=SelectionSettings(
                block_size=block_size,
                max_num_batched_tokens=config.max_num_batched_tokens,
                temperature=settings.temperature,
                objective=settings.objective,
                decode_weight=settings.decode_weight,
                expert_weight=settings.expert_weight,
                host_block_ms=host_block_ms,
                disk_block_ms=disk_block_ms,
            ),
            adapters=settings.adapters,
            policy=settings.policy,
            thresholds=settings.thresholds,
            seed=settings.seed,
            moe=config.moe,
            moe_perf=settings.router_model.balanced(config=config, perf=self._perf),
            # the twin has no localities: every transfer runs at the engines' bandwidth
            disagg=DisaggSettings(
                kv_bytes_per_token=float(config.kv_bytes_per_token),
                far_gbps=config.kv_transfer_bandwidth_gbps,
            ),
            share_load=share_load,
        )

    @property
    def now_ms(self) -> float:
        return self.simulator.now_ms

    @property
    def engines(self) -> list[Engine]:
        return self.simulator.engines

    @property
    def failed(self) -> int:
        return int(np.count_nonzero(~np.isnan(self.failed_ms)))

    def add_engine(self, role: Role = Role.WORKER) -> int:
        """A new engine of ``role`` serving from now; returns its index."""
        index = len(self.simulator.engines)
        config = dataclasses.replace(
            self._config,
            seed=self._config.seed * 1_000_003 + index,
            role=_ENGINE_ROLES[role],
        )
        engine = Engine(worker_id=f"{role.value}-{index}", config=config, perf=self._perf)
        self.simulator.add_engine(engine)
        self._index_of[engine.worker_id] = index
        self._placements.append(-1)
        self.roles.append(role)
        info = self._info(index)
        for router in self.routers:
            routes = router.add_worker(info, now=self.now_ms / 1000.0)
            if engine.moe is not None:  # a new engine reports its expert placement at once
                self._placements[index] = engine.moe.version
                router.set_expert_placement(engine.worker_id, engine.moe.placement)
            self._dispatch(routes)
        self._sync()
        return index

    def _info(self, index: int, *, draining: bool = False) -> WorkerInfo:
        """What engine ``index`` tells the routers when it registers (as ``/worker_info`` does):
        its role and the adapters it holds at once."""
        engine = self.simulator.engines[index]
        return WorkerInfo(
            worker_id=engine.worker_id,
            role=self.roles[index],
            draining=draining,
            max_loras=engine.adapters.settings.max_loras,
        )

    def drain(self, index: int) -> None:
        """Take engine ``index`` out of routing (as the router does for a pod labelled
        ``copse.dev/draining``: no new requests, its load and cache still known); it finishes the
        requests it has, then retires and the router forgets it."""
        info = self._info(index, draining=True)
        for router in self.routers:
            self._dispatch(router.add_worker(info, now=self.now_ms / 1000.0))
        self._sync()
        self.draining.add(index)
        self._retire_if_drained(index, self.now_ms)

    def _retire(self, index: int, at_ms: float) -> None:
        for router in self.routers:
            router.remove_worker(self.simulator.engines[index].worker_id)
        self.retired_ms[index] = at_ms

    def run_until(self, t_ms: float) -> None:
        self.simulator.run_until(t_ms)
        self.channel.deliver(t_ms)

    def run(self) -> None:
        """Run until every engine is idle."""
        self.simulator.run()

    def arrive(self, index: int) -> None:
        """Request ``index`` of the trace arrives now."""
        request = self.trace[index]
        tokens = self._synth.tokens(request.hash_ids, request.input_length)
        adapter = self.classes[index].adapter if self.classes is not None else ""
        lora_id = lora_int_id(adapter) if adapter else None
        hashes, local = hash_blocks(tokens, block_size=self._config.block_size, lora_id=lora_id)
        request_id = str(index)
        self._pending[request_id] = _Pending(
            index=index,
            tokens=tokens,
            hashes=hashes,
            local=local,
            max_tokens=request.output_length,
            adapter=adapter or None,
        )
        route_request = RouteRequest(
            request_id=request_id,
            hashes=hashes,
            prompt_tokens=request.input_length,
            max_tokens=request.output_length,
        )
        if self.classes is not None:
            kind = self.classes[index]
            route_request = dataclasses.replace(
                route_request,
                objective=kind.objective,
                priority=kind.priority,
                tenant=kind.tenant,
                ttft_slo_ms=kind.ttft_slo_ms,
                itl_slo_ms=kind.itl_slo_ms,
                adapter=kind.adapter,
            )
        replica = 0 if self.replica_of is None else self.replica_of[index]
        self._owner[request_id] = replica
        try:
            route = self.routers[replica].submit(route_request, now=self.now_ms / 1000.0)
        except (Shed, NoWorkers) as exc:
            self._sync()
            self._pending.pop(request_id)
            self.failed_ms[index] = self.now_ms
            if isinstance(exc, Shed):
                self.shed_ms[index] = self.now_ms
            return
        if route is not None:
            self._dispatch([route])
        self._sync()

    def _of(self, request_id: str) -> Router:
        """The replica that routed ``request_id``."""
        return self.routers[self._owner.get(request_id, 0)]

    def _sync(self) -> None:
        """Hand every replica's load changes and queue heads to the others (and route what they
        let through), until nothing changes."""
        if len(self.routers) == 1:
            return
        now = self.now_ms / 1000.0
        moved = True
        while moved:
            moved = False
            for source, router in enumerate(self.routers):
                assert router.outbox is not None
                changes = list(router.outbox)
                router.outbox.clear()
                heads = router.queue_heads(now=now)
                moved = moved or bool(changes) or heads != self._heads_sent[source]
                self._heads_sent[source] = heads
                for peer in self.routers:
                    if peer is not router:
                        for change in changes:
                            self._dispatch(peer.apply_peer(change, peer=str(source), now=now))
                        self._dispatch(peer.apply_peer_queue(str(source), heads, now=now))

    def _apply_events(self, index: int, events: list[KvEvent]) -> None:
        engine = self.simulator.engines[index]
        if engine.worker_id in self.router.workers:  # a retired engine's events find nobody listening
            for router in self.routers:
                assert router.radix is not None
                router.radix.apply_events(engine.worker_id, epoch=engine.epoch, events=events)

    def _dispatch(self, routes: list[Route]) -> None:
        for route in routes:
            item = self._pending.pop(route.request_id)
            now = self.now_ms
            remote = route.prefill_worker_id
            try:
                self.simulator.submit(
                    self._index_of[route.worker_id if remote is None else remote],
                    request_id=route.request_id,
                    tokens=item.tokens,
                    max_tokens=item.max_tokens if remote is None else 1,
                    block_hashes=(item.hashes, item.local),
                    adapter=item.adapter,
                )
            except (RequestRejected, EngineOverloaded):
                self.failed_ms[item.index] = now
                self._dispatch(self._of(route.request_id).finish(route.request_id, now=now / 1000.0))
                continue
            self.routed_ms[item.index] = now
            self.predicted_cached[item.index] = route.cached_tokens
            self.predicted_onboard_ms[item.index] = route.onboard_ms
            if remote is not None:
                decode = self._index_of[route.worker_id]
                self._handoff[route.request_id] = (decode, item)
                self._incoming[decode] += 1

    def _hand_over(self, request: Request) -> None:
        """A context-only request finished on its prefill engine: its decode engine gets the KV
        and the first token."""
        decode, item = self._handoff.pop(request.request_id)
        self._incoming[decode] -= 1
        self.cached[item.index] = max(request.cached_tokens, 0)
        now = self.now_ms
        if item.max_tokens <= 1:  # the first token was the whole output
            self.first_ms[item.index] = self.finish_ms[item.index] = now
            self.outputs[item.index] = 1
            router = self._of(request.request_id)
            released = router.prefill_done(request.request_id, now=now / 1000.0)
            self._dispatch(released + router.finish(request.request_id, now=now / 1000.0))
            self._retire_if_drained(decode, now)
            return
        try:
            self.simulator.submit(
                decode,
                request_id=request.request_id,
                tokens=item.tokens,
                max_tokens=item.max_tokens,
                block_hashes=(item.hashes, item.local),
                transferred_first_token=int(request.output[0]),
                adapter=item.adapter,
            )
        except (RequestRejected, EngineOverloaded):
            self.failed_ms[item.index] = now
            self._dispatch(self._of(request.request_id).finish(request.request_id, now=now / 1000.0))
            self._retire_if_drained(decode, now)

    def _retire_if_drained(self, index: int, at_ms: float) -> None:
        busy = self.simulator.engines[index].has_work() or self._incoming[index]
        if index in self.draining and not busy:
            self.draining.discard(index)
            self._retire(index, at_ms)

    def _on_step(self, index: int, output: StepOutput) -> None:
        engine = self.simulator.engines[index]
        events = engine.drain_kv_events()
        if events:  # the step's events, published as one batch when it ends
            self.channel.publish(at_ms=output.end_ms, source=index, events=events)
        moe = engine.moe
        # An MoE engine reports its expert placement when its load balancer moves experts.
        known = engine.worker_id in self.router.workers
        if moe is not None and moe.version != self._placements[index] and known:
            self._placements[index] = moe.version
            for router in self.routers:
                router.set_expert_placement(engine.worker_id, moe.placement)
        now = output.end_ms / 1000.0
        released: list[Route] = []
        if self.roles[index] is Role.PREFILL:
            for request in output.finished:  # context-only: done at its first token
                self._hand_over(request)
        else:
            for request in output.advanced:
                if request.num_output == 1:
                    i = int(request.request_id)
                    self.first_ms[i] = output.end_ms
                    if math.isnan(request.ready_ms):  # prefilled here, not received from a prefill engine
                        self.cached[i] = max(request.cached_tokens, 0)
                    released += self._of(request.request_id).prefill_done(request.request_id, now=now)
            released += self._finished(index, output)
        if released:
            self.channel.deliver(output.end_ms)
            self._dispatch(released)
        self._sync()
        self._retire_if_drained(index, output.end_ms)

    def _finished(self, index: int, output: StepOutput) -> list[Route]:
        """Record the requests that finished on engine ``index``; returns the routes they free."""
        moe = self.simulator.engines[index].moe
        now = output.end_ms / 1000.0
        released: list[Route] = []
        for request in output.finished:
            i = int(request.request_id)
            router = self._of(request.request_id)
            self.finish_ms[i] = output.end_ms
            self.outputs[i] = request.num_output
            if moe is not None and self.settings.expert_reports:
                # The engine's routed-expert counts of the tokens it computed for the request.
                computed = request.prompt_len - max(request.cached_tokens, 0) + request.num_output
                router.report_experts(request.request_id, moe.activations(request.expert_row, computed))
            released += router.finish(request.request_id, now=now)
        return released

    def report(
        self, *, started: float, workers: int, window: npt.NDArray[np.bool_] | None = None
    ) -> ReplayReport:
        """What the requests (those in ``window``, else all) measured; ``started`` is the
        ``time.perf_counter()`` the run began at."""
        done = ~np.isnan(self.finish_ms)
        if window is not None:
            done &= window
        arrival, first, finish, outputs = self.arrival_ms, self.first_ms, self.finish_ms, self.outputs
        ttft = first - arrival
        e2e = finish - arrival
        with np.errstate(invalid="ignore", divide="ignore"):
            itl = np.where(outputs > 1, (finish - first) / (outputs - 1), np.nan)
        span_s = (
            (float(np.nanmax(finish[done])) - float(arrival[done].min())) / 1000.0 if done.any() else math.nan
        )
        failed = ~np.isnan(self.failed_ms)
        return ReplayReport(
            policy=self.settings.policy,
            workers=workers,
            requests=int(done.sum()),
            ttft_ms=Distribution.of(ttft[done]),
            itl_ms=Distribution.of(itl[done]),
            e2e_ms=Distribution.of(e2e[done]),
            cache_hit_rate=float(self.cached[done].sum() / self.prompts[done].sum()) if done.any() else 0.0,
            throughput_tok_s=float(outputs[done].sum() / span_s) if done.any() and span_s > 0 else 0.0,
            failed=int((failed & window).sum()) if window is not None else int(failed.sum()),
            preemptions=sum(engine.preemptions_total for engine in self.simulator.engines),
            simulated_s=self.now_ms / 1000.0,
            wall_s=time.perf_counter() - started,
            moe=_moe_report(self.simulator.engines, output_tokens=float(outputs[done].sum())),
            offload=self._offload_report(),
        )

    def _offload_report(self) -> OffloadReport | None:
        """Over the whole run (not a window): tokens onboarded from each tier / prompt tokens."""
        if not self._config.offload.enabled:
            return None
        engines = self.simulator.engines
        prompts = sum(engine.prompt_tokens_total for engine in engines)
        host = sum(engine.onboarded_blocks_total[0] for engine in engines) * self._config.block_size
        disk = sum(engine.onboarded_blocks_total[1] for engine in engines) * self._config.block_size
        return OffloadReport(
            host_hit_rate=host / prompts if prompts else 0.0,
            disk_hit_rate=disk / prompts if prompts else 0.0,
        )


def replay(
    trace: Sequence[TraceRequest],
    settings: ReplaySettings,
    *,
    progress: Callable[[int], object] | None = None,
) -> ReplayReport:
    """Replay ``trace`` through the router and ``settings.workers`` mocked engines.

    ``progress`` is called with the number of requests just routed (for a progress bar).
    Raises ``ValueError`` when the engine block size does not divide the trace block size.
    """
    started = time.perf_counter()
    if settings.workers < 1:
        raise ValueError(f"workers must be at least 1, got {settings.workers}")
    fleet = Fleet(trace, settings, engines=settings.workers)
    arrival = fleet.arrival_ms
    for index in range(len(trace)):
        fleet.run_until(float(arrival[index]))
        fleet.arrive(index)
        if progress is not None:
            progress(1)
    fleet.run()
    return fleet.report(started=started, workers=settings.workers)


def _moe_report(engines: Sequence[Engine], *, output_tokens: float) -> MoeReport | None:
    states = [engine.moe for engine in engines if engine.moe is not None]
    if not states or output_tokens <= 0:
        return None
    mean = sum(state.mean_total for state in states)
    step_ms = sum(state.step_ms for state in states)
    return MoeReport(
        all_to_all_bytes_per_token=sum(state.all_to_all_bytes for state in states) / output_tokens,
        imbalance=sum(state.hot_total for state in states) / mean if mean > 0 else math.nan,
        moe_share=sum(state.moe_ms for state in states) / step_ms if step_ms > 0 else 0.0,
        rebalances=sum(state.version for state in states),
    )
