"""Trace replay: the router and N mocked engines on one virtual clock (a discrete-event simulation).

Every arrival of the trace (timestamps divided by ``speedup``) is routed by the real routing core
with the chosen policy and submitted to a mocked engine (:mod:`copse.workers.mocker`); the engines'
KV events reach the router's indexer before each decision; first tokens and finishes reach its load
tracker as they happen on the virtual clock. The same trace, settings and seed give the same report.

Engines use the trace's block size (one trace hash id = one KV block) unless the engine config
sets ``block_size``, which must then divide it so that prefixes shared in the trace are shared
by the engines.

Latencies are measured from the trace arrival (so time spent in the router's queue counts):
TTFT to the first token, e2e to the last, ITL as each request's mean gap between output tokens.
The cache hit rate is the share of prompt tokens the engines found in their prefix caches.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import yaml

from copse.router.core import NoWorkers, QueueFull, Role, Route, Router, Thresholds, WorkerInfo
from copse.router.policies import RouteRequest, SelectionSettings
from copse.sim.trace import TokenSynth, TraceRequest
from copse.workers.mocker import (
    Engine,
    EngineConfig,
    EngineOverloaded,
    RequestRejected,
    Simulator,
    StepOutput,
)
from copse.workers.moe import MoeConfig
from copse.workers.perf import PerfModel, load_perf_model
from copse.workers.protocol.hashing import hash_blocks


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
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise EngineConfigError(f"{path}: cannot read ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        raise EngineConfigError(f"{path}: not valid YAML ({exc})") from exc
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise EngineConfigError(f"{path}: expected a mapping of engine settings")
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
    decode_weight: float = 0.0
    """Weight of predicted decode time in the ``kv`` cost."""
    expert_weight: float = 1.0
    """Weight of the predicted decode time with the MoE layers in the ``kv_expert`` cost."""
    expert_reports: bool = True
    """MoE engines report each finished request's routed-expert counts to the router (off: the
    router expects every request to use the experts alike; an ablation of ``kv_expert``)."""
    thresholds: Thresholds = dataclasses.field(default_factory=Thresholds)
    engines: EngineSetup = dataclasses.field(default_factory=EngineSetup)


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

    def as_json(self) -> dict[str, Any]:
        """The report in the documented ``--json`` shape (``moe`` only for MoE engines)."""
        extra = {} if self.moe is None else {"moe": self.moe.as_json()}
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


@dataclasses.dataclass(slots=True)
class _Pending:
    index: int
    tokens: npt.NDArray[np.uint32]
    hashes: list[int]
    local: list[int]
    max_tokens: int


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
    engine_config = settings.engines.config
    if not settings.engines.block_size_set:
        engine_config = dataclasses.replace(engine_config, block_size=settings.trace_block_size)
    perf = settings.engines.perf
    block_size = engine_config.block_size
    if settings.trace_block_size % block_size:
        raise ValueError(
            f"engine block_size {block_size} must divide the trace block size {settings.trace_block_size}, "
            "or prefixes shared in the trace would not be shared by the engines"
        )
    if settings.workers < 1:
        raise ValueError(f"workers must be at least 1, got {settings.workers}")
    if not settings.speedup > 0:
        raise ValueError(f"speedup must be positive, got {settings.speedup}")
    engines = [
        Engine(
            worker_id=f"worker-{i}",
            config=dataclasses.replace(engine_config, seed=settings.seed * 1_000_003 + i),
            perf=perf,
        )
        for i in range(settings.workers)
    ]
    index_of = {engine.worker_id: i for i, engine in enumerate(engines)}
    router = Router(
        perf=perf,
        settings=SelectionSettings(
            block_size=block_size,
            max_num_batched_tokens=engine_config.max_num_batched_tokens,
            temperature=settings.temperature,
            decode_weight=settings.decode_weight,
            expert_weight=settings.expert_weight,
        ),
        policy=settings.policy,
        thresholds=settings.thresholds,
        seed=settings.seed,
        moe=engine_config.moe,
    )
    radix = router.radix
    assert radix is not None
    for engine in engines:
        router.add_worker(WorkerInfo(worker_id=engine.worker_id, role=Role.WORKER), now=0.0)

    n = len(trace)
    arrival = np.array([r.timestamp_ms / settings.speedup for r in trace])
    first = np.full(n, np.nan)
    finish = np.full(n, np.nan)
    outputs = np.zeros(n)
    prompts = np.array([r.input_length for r in trace], dtype=np.float64)
    cached = np.zeros(n)
    pending: dict[str, _Pending] = {}
    failed = 0

    placements = [-1] * len(engines)

    def sync_events() -> None:
        for index, engine in enumerate(engines):
            events = engine.drain_kv_events()
            if events:
                radix.apply_events(engine.worker_id, epoch=engine.epoch, events=events)
            # An MoE engine reports its expert placement when its load balancer moves experts.
            if engine.moe is not None and engine.moe.version != placements[index]:
                placements[index] = engine.moe.version
                router.set_expert_placement(engine.worker_id, engine.moe.placement)

    def dispatch(routes: list[Route]) -> None:
        nonlocal failed
        for route in routes:
            item = pending.pop(route.request_id)
            try:
                simulator.submit(
                    index_of[route.worker_id],
                    request_id=route.request_id,
                    tokens=item.tokens,
                    max_tokens=item.max_tokens,
                    block_hashes=(item.hashes, item.local),
                )
            except (RequestRejected, EngineOverloaded):
                failed += 1
                dispatch(router.finish(route.request_id, now=simulator.now_ms / 1000.0))

    def on_step(engine_index: int, output: StepOutput) -> None:
        now = output.end_ms / 1000.0
        moe = engines[engine_index].moe
        released: list[Route] = []
        for request in output.advanced:
            if request.num_output == 1:
                index = int(request.request_id)
                first[index] = output.end_ms
                cached[index] = max(request.cached_tokens, 0)
                released += router.prefill_done(request.request_id, now=now)
        for request in output.finished:
            index = int(request.request_id)
            finish[index] = output.end_ms
            outputs[index] = request.num_output
            if moe is not None and settings.expert_reports:
                # The engine's routed-expert counts of the tokens it computed for the request.
                computed = request.prompt_len - max(request.cached_tokens, 0) + request.num_output
                router.report_experts(request.request_id, moe.activations(request.expert_row, computed))
            released += router.finish(request.request_id, now=now)
        if released:
            sync_events()
            dispatch(released)

    simulator = Simulator(engines, on_step=on_step, fuse_until_submit=True)
    synth = TokenSynth(seed=settings.seed, trace_block_size=settings.trace_block_size)
    for index, request in enumerate(trace):
        simulator.run_until(float(arrival[index]))
        sync_events()
        tokens = synth.tokens(request.hash_ids, request.input_length)
        hashes, local = hash_blocks(tokens, block_size=block_size)
        request_id = str(index)
        pending[request_id] = _Pending(
            index=index, tokens=tokens, hashes=hashes, local=local, max_tokens=request.output_length
        )
        route_request = RouteRequest(
            request_id=request_id,
            hashes=hashes,
            prompt_tokens=request.input_length,
            max_tokens=request.output_length,
        )
        try:
            route = router.submit(route_request, now=simulator.now_ms / 1000.0)
        except (QueueFull, NoWorkers):
            pending.pop(request_id)
            failed += 1
            route = None
        if route is not None:
            dispatch([route])
        if progress is not None:
            progress(1)
    simulator.run()

    done = ~np.isnan(finish)
    ttft = first - arrival
    e2e = finish - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        itl = np.where(outputs > 1, (finish - first) / (outputs - 1), np.nan)
    span_s = (float(np.nanmax(finish)) - float(arrival[0])) / 1000.0 if done.any() else math.nan
    return ReplayReport(
        policy=settings.policy,
        workers=settings.workers,
        requests=int(done.sum()),
        ttft_ms=Distribution.of(ttft[done]),
        itl_ms=Distribution.of(itl[done]),
        e2e_ms=Distribution.of(e2e[done]),
        cache_hit_rate=float(cached[done].sum() / prompts[done].sum()) if done.any() else 0.0,
        throughput_tok_s=float(outputs[done].sum() / span_s) if done.any() and span_s > 0 else 0.0,
        failed=failed,
        preemptions=sum(engine.preemptions_total for engine in engines),
        simulated_s=simulator.now_ms / 1000.0,
        wall_s=time.perf_counter() - started,
        moe=_moe_report(engines, output_tokens=float(outputs[done].sum())),
    )


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
