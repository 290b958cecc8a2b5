"""A profiler for mocked engines: what the router and planner would believe about engine speed.

A real deployment does not know its engines' perf model; it measures one (NVIDIA Dynamo's
pre-deployment profiler, then ``copse planner profile`` for the mocked engine) and interpolates
between the measured points. :func:`measure_profile` does that against a mocked engine, noise and
all: prefill as the TTFT of lone requests over a range of prompt lengths (chunked prefill and the
step overhead of each chunk included, as a profiler sees them), decode as the mean inter-token
latency of steady batches over a range of context lengths and batch sizes. The result is the
profile layout Dynamo's profiler writes, read back as an
:class:`~copse.workers.perf.InterpolatedPerfModel`: close to the engine's model, not equal to it.

Mixture-of-Experts engines: a profile times whole steps, so its decode points hold the all-to-all
and slowest-rank stretch of the expert load the profiler's own batches had (each of its prompts
prefers its own experts). ``balanced=True`` profiles the balanced step instead: each measured step
less the MoE terms its engine reports for it (what a profiler can do with the engine's per-rank
expert-load statistics), which the ``kv_expert`` router policy stretches for the expert load it
expects (:meth:`copse.router.experts.ExpertTracker.moe_ms`).

:class:`ScaledPerfModel` mis-specifies a model on purpose (a router that believes prefill is
30 % faster than it is), to see how routing degrades when the profile is wrong.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from copse.workers.mocker import Engine, EngineConfig, Simulator, StepOutput
from copse.workers.perf import InterpolatedPerfModel, PerfModel


@dataclasses.dataclass(frozen=True, slots=True)
class ProfileGrid:
    """Where and how long the profiler measures."""

    prefill_points: int = 16
    """Prompt lengths measured, geometrically spaced from ``min_isl`` to the longest prompt."""
    min_isl: int = 64
    """Shortest prompt measured (the step overhead is read from the shortest ones)."""
    repeats: int = 3
    """Lone requests measured per prompt length (their mean TTFT is the point)."""
    context_points: int = 8
    """Context lengths of decode batches, geometrically spaced from ``min_context``."""
    min_context: int = 256
    """Shortest context of a decode batch."""
    batch_points: int = 8
    """Batch sizes per context length, from 1 to the most that fit (``max_num_seqs``, KV cache)."""
    decode_steps: int = 32
    """Decode steps with the whole batch decoding that one point averages over."""

    def __post_init__(self) -> None:
        for name in ("prefill_points", "context_points", "batch_points"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 2")
        for name in ("min_isl", "repeats", "min_context", "decode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")


def _axis(low: int, high: int, points: int) -> list[int]:
    """Up to ``points`` distinct integers from ``low`` to ``high``, geometrically spaced."""
    return sorted({round(float(x)) for x in np.geomspace(low, high, points)})


class _Bench:
    """Fresh engines of one configuration, each fed distinct prompts (no prefix hits)."""

    def __init__(self, *, config: EngineConfig, perf: PerfModel) -> None:
        self.config = config
        self.perf = perf
        self._runs = itertools.count()
        self._prompts = itertools.count()

    def engine(self) -> Engine:
        # A new seed per run: the noise of one run is not the noise of the next, as on real hardware.
        run = next(self._runs)
        config = dataclasses.replace(self.config, seed=self.config.seed * 7919 + run)
        return Engine(worker_id=f"profile-{run}", config=config, perf=self.perf)

    def prompt(self, length: int) -> np.ndarray:
        start = next(self._prompts) * 131 + 256
        return ((np.arange(length, dtype=np.uint64) * 2654435761 + start) % 30000 + 256).astype(np.uint32)


def _prefill_ttft_ms(bench: _Bench, isl: int, repeats: int) -> float:
    ttfts = []
    for _ in range(repeats):
        sim = Simulator([bench.engine()])
        sim.submit(0, request_id="p", tokens=bench.prompt(isl), max_tokens=1)
        sim.run()
        (outcome,) = sim.outcomes
        ttfts.append(outcome.ttft_ms)
    return float(np.mean(ttfts))


def _prefill_steps(config: EngineConfig, *, context: int, batch: int) -> int:
    """Steps until a batch submitted together has all prefilled (sequences prefilled first decode
    meanwhile, one budget token each, so they must last past these steps)."""
    return -(-batch * context // max(config.max_num_batched_tokens - batch, 1)) + 1


def _largest_batch(config: EngineConfig, *, context: int, steps: int, num_blocks: int) -> int:
    """The most sequences of ``context`` tokens that decode ``steps`` steps together without preemption."""
    size = config.block_size
    for batch in range(config.max_num_seqs, 0, -1):
        tokens = context + _prefill_steps(config, context=context, batch=batch) + steps + 1
        if batch * -(-tokens // size) <= num_blocks:
            return batch
    return 0


def _decode_point(
    bench: _Bench, *, context: int, batch: int, steps: int, balanced: bool
) -> tuple[float, float]:
    """(mean active KV tokens, mean ITL ms) over the first ``steps`` decode steps in which the whole
    batch of ``batch`` sequences of ``context`` prompt tokens decodes together; with ``balanced``,
    less the MoE terms the engine reports for those steps."""
    prefill_steps = _prefill_steps(bench.config, context=context, batch=batch)
    step_ms: list[float] = []
    active: list[float] = []
    engine = bench.engine()
    moe = engine.moe if balanced else None
    # The engine's MoE totals at the previous output: what they grew by since is this output's share.
    seen = [0.0, 0.0]
    moe_ms = [0.0, 0.0]
    """MoE terms and whole step time of the measured steps, ms."""

    def on_step(_: int, out: StepOutput) -> None:
        if moe is not None:
            grown = (moe.moe_ms - seen[0], moe.step_ms - seen[1])
            seen[:] = moe.moe_ms, moe.step_ms
        if out.prefill_tokens or out.decode_tokens != batch * out.steps or len(step_ms) >= steps:
            return
        if moe is not None:
            moe_ms[0] += grown[0]
            moe_ms[1] += grown[1]
        # KV of the batch after the output's last step, less half the tokens its steps added
        after = sum(request.num_tokens for request in out.advanced)
        step_ms.extend([(out.end_ms - out.start_ms) / out.steps] * out.steps)
        active.extend([after - batch * (out.steps + 1) / 2] * out.steps)

    sim = Simulator([engine], on_step=on_step)
    for i in range(batch):
        sim.submit(0, request_id=str(i), tokens=bench.prompt(context), max_tokens=prefill_steps + steps + 1)
    sim.run()
    if not step_ms:
        raise RuntimeError(f"no steady decode steps for {batch} sequences of {context} tokens")
    moe_share = moe_ms[0] / moe_ms[1] if moe_ms[1] > 0 else 0.0
    return float(np.mean(active[:steps])), float(np.mean(step_ms[:steps])) * (1.0 - moe_share)


def measure_profile(
    *, config: EngineConfig, perf: PerfModel, grid: ProfileGrid | None = None, balanced: bool = False
) -> InterpolatedPerfModel:
    """Profile mocked engines of ``config`` timed by ``perf`` (noise from ``config.step_time_cv``,
    seeded by ``config.seed``) and interpolate the measured points, as a deployment's profile would.
    ``balanced``: decode steps without the MoE terms of an expert-parallel engine (see the module
    documentation; the same profile for a dense one)."""
    grid = grid or ProfileGrid()
    bench = _Bench(config=config, perf=perf)
    num_blocks = config.num_blocks or perf.kv_capacity_tokens // config.block_size
    capacity = num_blocks * config.block_size
    longest = min(config.max_model_len, capacity) - 1
    isl = _axis(grid.min_isl, longest, grid.prefill_points)
    ttft = [_prefill_ttft_ms(bench, length, grid.repeats) for length in isl]

    contexts = _axis(grid.min_context, longest // 2, grid.context_points)
    # One column per context: ITL against active KV tokens, interpolated onto a shared axis.
    columns: list[tuple[np.ndarray, np.ndarray]] = []
    measured_contexts: list[float] = []
    for context in contexts:
        most = _largest_batch(config, context=context, steps=grid.decode_steps, num_blocks=num_blocks)
        if most < 1:
            continue
        batches = _axis(1, most, grid.batch_points)
        points = [
            _decode_point(bench, context=context, batch=b, steps=grid.decode_steps, balanced=balanced)
            for b in batches
        ]
        active = np.array([kv for kv, _ in points])
        columns.append((active, np.array([itl for _, itl in points])))
        measured_contexts.append(float(np.mean(active / np.array(batches))))
    active_axis = np.unique(np.round(np.linspace(1.0, float(capacity), 4 * grid.batch_points)))
    # Beyond the largest batch measured at a context the engine cannot go (max_num_seqs or the
    # cache): the edge value stands there.
    itl_grid = np.column_stack([np.interp(active_axis, active, itl) for active, itl in columns])
    return InterpolatedPerfModel(
        prefill_isl=tuple(float(x) for x in isl),
        prefill_ttft_ms=tuple(ttft),
        decode_active_kv_tokens=tuple(active_axis.tolist()),
        decode_context_length=tuple(measured_contexts),
        decode_itl=tuple(tuple(row) for row in itl_grid.tolist()),
        kv_capacity_tokens=capacity,
        gpus_per_engine=perf.gpus_per_engine,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ScaledPerfModel(PerfModel):
    """``base`` with its prefill curve multiplied by ``prefill_scale`` (0.7: prefill believed 30 %
    faster than ``base``) and its decode steps by ``decode_scale``."""

    base: PerfModel
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    kv_capacity_tokens: int = dataclasses.field(init=False)
    gpus_per_engine: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        for name in ("prefill_scale", "decode_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        object.__setattr__(self, "kv_capacity_tokens", self.base.kv_capacity_tokens)
        object.__setattr__(self, "gpus_per_engine", self.base.gpus_per_engine)

    def prefill_curve_ms(self, isl: float) -> float:
        return self.base.prefill_curve_ms(isl) * self.prefill_scale

    def decode_itl_ms(self, *, active_kv_tokens: float, context_length: float) -> float:
        return self.base.decode_itl_ms(active_kv_tokens=active_kv_tokens, context_length=context_length) * (
            self.decode_scale
        )
