"""The engine core: timing against the perf model, chunked prefill, prefix reuse, preemption,
limits, aborts and disaggregated KV transfer."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import numpy as np
import pytest

from copse.workers.mocker import (
    Engine,
    EngineConfig,
    EngineOverloaded,
    RequestRejected,
    Simulator,
    StepOutput,
)
from copse.workers.perf import PolynomialPerfModel

PERF = PolynomialPerfModel()


def _engine(**config: object) -> Engine:
    return Engine(worker_id="w0", config=EngineConfig(**config), perf=PERF)  # type: ignore[arg-type]


def _prompt(n: int, *, salt: int = 0) -> list[int]:
    return [(i * 7919 + salt * 104729) % 30000 + 256 for i in range(n)]


def test_a_step_admits_only_requests_that_arrived_by_its_start() -> None:
    # An engine loop running behind the wall clock plans steps that started before a request came.
    engine = _engine()
    engine.add_request(request_id="later", tokens=_prompt(100), max_tokens=2, now_ms=100.0)
    assert engine.begin_step(50.0) is None
    assert engine.next_wake_ms() == 100.0
    assert engine.begin_step(100.0) == pytest.approx(100.0 + PERF.prefill_ms(new_tokens=100))


def test_single_request_ttft_and_itl_match_the_perf_model() -> None:
    engine = _engine()
    steps: list[StepOutput] = []
    sim = Simulator([engine], on_step=lambda _, out: steps.append(out))
    sim.submit(0, request_id="r", tokens=_prompt(1000), max_tokens=5)
    sim.run()
    (outcome,) = sim.outcomes
    assert outcome.ttft_ms == pytest.approx(PERF.prefill_ms(new_tokens=1000))
    gaps = [b.end_ms - a.end_ms for a, b in itertools.pairwise(steps)]
    # decode step k computes the KV of token 1000 + k over a context of 1001 + k tokens
    expected = [PERF.decode_itl_ms(active_kv_tokens=1001 + k, context_length=1001 + k) for k in range(4)]
    assert gaps == pytest.approx(expected)
    assert outcome.output_tokens == 5
    assert outcome.finish_ms == pytest.approx(outcome.first_token_ms + sum(expected))


def test_speedup_ratios_divide_step_times() -> None:
    engine = _engine(speedup_ratio=2.0, decode_speedup_ratio=4.0)
    sim = Simulator([engine])
    sim.submit(0, request_id="r", tokens=_prompt(1000), max_tokens=2)
    sim.run()
    (outcome,) = sim.outcomes
    assert outcome.ttft_ms == pytest.approx(PERF.prefill_ms(new_tokens=1000) / 2)
    itl = PERF.decode_itl_ms(active_kv_tokens=1001, context_length=1001) / 8
    assert outcome.finish_ms - outcome.first_token_ms == pytest.approx(itl)


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget() -> None:
    engine = _engine(max_num_batched_tokens=8192)
    steps: list[StepOutput] = []
    sim = Simulator([engine], on_step=lambda _, out: steps.append(out))
    sim.submit(0, request_id="r", tokens=_prompt(20000), max_tokens=1)
    sim.run()
    assert [s.prefill_tokens for s in steps] == [8192, 8192, 3616]
    expected = sum(
        PERF.prefill_ms(new_tokens=n, cached_tokens=c) for n, c in [(8192, 0), (8192, 8192), (3616, 16384)]
    )
    assert sim.outcomes[0].ttft_ms == pytest.approx(expected)


def test_decodes_continue_while_another_prompt_is_chunked() -> None:
    engine = _engine(max_num_batched_tokens=4096)
    steps: list[StepOutput] = []
    sim = Simulator([engine], on_step=lambda _, out: steps.append(out))
    sim.submit(0, request_id="short", tokens=_prompt(100), max_tokens=50)
    sim.run_until(sim.next_event_ms() or 0.0)  # the short prompt's prefill step
    sim.submit(0, request_id="long", tokens=_prompt(12000, salt=1), max_tokens=1)
    sim.run()
    mixed = [s for s in steps if s.prefill_tokens and s.decode_tokens]
    assert len(mixed) == 3  # the long prompt's three chunks each ride along with a decode
    assert all(s.prefill_tokens + s.decode_tokens <= 4096 for s in steps)
    assert {o.request_id: o.output_tokens for o in sim.outcomes} == {"short": 50, "long": 1}


def test_unchunked_engine_refuses_prompts_above_the_budget() -> None:
    engine = _engine(enable_chunked_prefill=False, max_num_batched_tokens=1024)
    with pytest.raises(RequestRejected, match="chunked prefill disabled") as info:
        engine.add_request(request_id="r", tokens=_prompt(2000), max_tokens=1, now_ms=0)
    assert info.value.param == "prompt"


def test_prefix_cache_hit_skips_cached_blocks() -> None:
    engine = _engine(block_size=32)
    sim = Simulator([engine])
    prompt = _prompt(1000)
    sim.submit(0, request_id="first", tokens=prompt, max_tokens=1)
    sim.run()
    sim.submit(0, request_id="second", tokens=[*prompt, 1, 2, 3], max_tokens=1)
    sim.run()
    second = sim.outcomes[1]
    assert second.cached_tokens == 992  # 31 full blocks of 32
    assert second.ttft_ms == pytest.approx(PERF.prefill_ms(new_tokens=11, cached_tokens=992))
    assert engine.cached_tokens_total == 992


@pytest.mark.parametrize("host_blocks", [0, 40])
def test_a_prefix_evicted_to_the_host_tier_is_onboarded_at_its_bandwidth(host_blocks: int) -> None:
    # 40 GPU blocks of 32 tokens, 1 MB each: one 1000-token prompt's 31 full blocks, then another
    # prompt's 31 push most of them out of the GPU (to host memory, when there is a host tier)
    engine = _engine(
        block_size=32,
        num_blocks=40,
        kv_bytes_per_token=32768,
        host_cache_bytes=host_blocks * 32 * 32768,
        host_bandwidth_gbps=20.0,
    )
    sim = Simulator([engine])
    prompt = _prompt(1000)
    sim.submit(0, request_id="first", tokens=prompt, max_tokens=1)
    sim.run()
    sim.submit(0, request_id="other", tokens=_prompt(1000, salt=1), max_tokens=1)
    sim.run()
    events = engine.drain_kv_events()
    offloaded = [h for e in events if e.data.type == "updated" for h in e.data.block_hashes]
    sim.submit(0, request_id="again", tokens=[*prompt, 1, 2, 3], max_tokens=1)
    sim.run()
    again = sim.outcomes[2]
    if not host_blocks:
        assert not offloaded
        # the 8 leading blocks left on the GPU are all it reuses
        assert again.cached_tokens == 8 * 32
        return
    # the second prompt needs 32 blocks (31 full, 1 partial) where 9 are free: 23 of the first's
    # leave, its last blocks first (released tail first, so the least recently used)
    assert len(offloaded) == 23
    assert again.cached_tokens == 992
    assert engine.onboarded_blocks_total == [23, 0]
    onboard_ms = 23 * 32 * 32768 / 20e9 * 1000.0
    assert again.ttft_ms == pytest.approx(PERF.prefill_ms(new_tokens=11, cached_tokens=992) + onboard_ms)
    back = [e.data for e in engine.drain_kv_events() if e.data.type == "updated" and e.data.tier == 0]
    assert [(len(d.block_hashes), d.previous_tier) for d in back] == [(23, 1)]


def test_a_block_evicted_from_a_full_host_tier_moves_to_disk_then_leaves() -> None:
    engine = _engine(
        block_size=4, num_blocks=4, kv_bytes_per_token=1, host_cache_bytes=2 * 4, disk_cache_bytes=3 * 4
    )
    sim = Simulator([engine])
    for k in range(4):  # four prompts of three blocks each, one at a time: each pushes the last down
        sim.submit(0, request_id=f"r{k}", tokens=_prompt(12, salt=k), max_tokens=1)
        sim.run()
    host, disk = engine.blocks.lower
    assert (len(host), len(disk)) == (2, 3)
    tiers: dict[int, int] = {}
    for e in engine.drain_kv_events():
        if e.data.type == "stored":
            tiers.update((b.block_hash, 0) for b in e.data.blocks)
        elif e.data.type == "updated":
            tiers.update(dict.fromkeys(e.data.block_hashes, e.data.tier))
        elif e.data.type == "removed":
            for h in e.data.block_hashes:
                del tiers[h]
    # 12 blocks: the GPU keeps 4, host memory 2, disk 3; the oldest 3 left the cache
    assert sorted(tiers.values()) == [0] * 4 + [1] * 2 + [2] * 3
    assert tiers == {h: engine.blocks.tier_of(h) for h in engine.blocks.cached_hashes()}


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    engine = _engine(block_size=10)
    sim = Simulator([engine])
    sim.submit(0, request_id="a", tokens=_prompt(100), max_tokens=1)
    sim.run()
    sim.submit(0, request_id="b", tokens=_prompt(100), max_tokens=1)
    sim.run()
    assert sim.outcomes[1].cached_tokens == 99
    assert sim.outcomes[1].ttft_ms == pytest.approx(PERF.prefill_ms(new_tokens=1, cached_tokens=99))


def test_preemption_is_lifo_and_every_request_still_completes() -> None:
    # 12 blocks of 16 tokens; two requests of 80 prompt tokens (5 blocks) growing by 40 tokens each
    engine = _engine(block_size=16, num_blocks=12)
    preempted: list[str] = []
    sim = Simulator([engine], on_step=lambda _, out: preempted.extend(r.request_id for r in out.preempted))
    sim.submit(0, request_id="old", tokens=_prompt(80), max_tokens=40)
    sim.submit(0, request_id="new", tokens=_prompt(80, salt=5), max_tokens=40)
    sim.run()
    assert preempted
    assert set(preempted) == {"new"}  # the most recently admitted one is the victim
    outcomes = {o.request_id: o for o in sim.outcomes}
    assert outcomes["new"].preemptions == len(preempted)
    assert outcomes["old"].preemptions == 0
    assert {o.output_tokens for o in outcomes.values()} == {40}
    assert engine.blocks.used_blocks == 0
    assert engine.blocks.free_blocks + len(engine.blocks.inactive) == 12


def test_max_num_seqs_bounds_the_running_batch() -> None:
    engine = _engine(max_num_seqs=2)
    sizes: list[int] = []
    sim = Simulator([engine], on_step=lambda _, __: sizes.append(len(engine.running)))
    for i in range(3):
        sim.submit(0, request_id=f"r{i}", tokens=_prompt(64, salt=i), max_tokens=3)
    sim.run()
    assert max(sizes) <= 2
    assert len(sim.outcomes) == 3


def test_bounded_queue_overloads() -> None:
    engine = _engine(max_waiting=2)
    engine.add_request(request_id="a", tokens=_prompt(10), max_tokens=1, now_ms=0)
    engine.add_request(request_id="b", tokens=_prompt(10), max_tokens=1, now_ms=0)
    with pytest.raises(EngineOverloaded):
        engine.add_request(request_id="c", tokens=_prompt(10), max_tokens=1, now_ms=0)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "param"),
    [(200_000, 1, "prompt"), (1000, 131_000, "max_tokens"), (10, 0, "max_tokens")],
)
def test_requests_that_can_never_fit_are_rejected(prompt: int, max_tokens: int, param: str) -> None:
    engine = _engine()
    with pytest.raises(RequestRejected) as info:
        engine.add_request(request_id="r", tokens=_prompt(prompt), max_tokens=max_tokens, now_ms=0)
    assert info.value.param == param


def test_abort_frees_blocks_even_mid_step() -> None:
    engine = _engine(block_size=16)
    engine.add_request(request_id="r", tokens=_prompt(100), max_tokens=10, now_ms=0)
    end = engine.begin_step(0.0)
    assert end is not None
    assert engine.blocks.used_blocks == 7
    assert engine.abort_request("r")
    assert engine.blocks.used_blocks == 0
    out = engine.end_step()
    assert out.advanced == []
    assert not engine.has_work()
    assert not engine.abort_request("r")


def test_decode_role_waits_for_the_kv_transfer_then_emits_the_given_token() -> None:
    config = EngineConfig(role="decode", kv_bytes_per_token=1_000_000, kv_transfer_bandwidth_gbps=10.0)
    engine = Engine(worker_id="d0", config=config, perf=PERF)
    steps: list[StepOutput] = []
    sim = Simulator([engine], on_step=lambda _, out: steps.append(out))
    request = sim.submit(0, request_id="r", tokens=_prompt(1000), max_tokens=3, transferred_first_token=4242)
    sim.run()
    transfer_ms = 1000 * 1_000_000 / 10e9 * 1000
    (outcome,) = sim.outcomes
    assert outcome.first_token_ms == pytest.approx(transfer_ms)
    assert request.output[0] == 4242
    assert outcome.output_tokens == 3
    assert [s.prefill_tokens for s in steps] == [0, 0, 0]  # the prompt's KV came over the wire
    assert outcome.finish_ms - outcome.first_token_ms == pytest.approx(
        PERF.decode_itl_ms(active_kv_tokens=1001, context_length=1001)
        + PERF.decode_itl_ms(active_kv_tokens=1002, context_length=1002)
    )


def test_a_kv_transfer_completing_within_a_decode_step_joins_the_step_after_it() -> None:
    """Fused decode steps stop at a transfer's completion; one completing within the first step
    (whose end is past it) must end the fused run after that step, not run it with no step at
    all for as long as the whole run would have taken (the decode engine then stalled, and the
    request waited seconds for its first token)."""

    step_ms = PERF.decode_itl_ms(active_kv_tokens=150, context_length=150)
    # a 10-token prompt's KV takes one decode step to arrive: it is still on its way when the step
    # in progress ends, and arrives during the next one
    gbps = 10 * 1_000_000 / (step_ms / 1000.0) / 1e9

    def run(fuse: bool) -> tuple[list[tuple[float, int, int]], list[tuple[object, ...]]]:
        config = EngineConfig(role="decode", kv_bytes_per_token=1_000_000, kv_transfer_bandwidth_gbps=gbps)
        engine = Engine(worker_id="d0", config=config, perf=PERF)
        steps: list[tuple[float, int, int]] = []
        sim = Simulator(
            [engine],
            fuse_decode=fuse,
            fuse_until_submit=fuse,
            on_step=lambda _, out: steps.append((out.end_ms, out.steps, len(out.advanced))),
        )
        sim.submit(0, request_id="a", tokens=_prompt(100), max_tokens=200, transferred_first_token=7)
        sim.run_until(50.0)  # "a" decodes
        sim.submit(0, request_id="b", tokens=_prompt(10, salt=1), max_tokens=5, transferred_first_token=8)
        sim.run()
        return steps, [dataclasses.astuple(o) for o in sorted(sim.outcomes, key=lambda o: o.request_id)]

    stepwise, fused = run(False), run(True)
    assert fused[1] == stepwise[1]
    assert all(count >= 1 for _, count, _ in fused[0])
    first_b = fused[1][1][2]
    assert isinstance(first_b, float)
    assert first_b - 50.0 < 3.5 * step_ms  # the step in progress, the one the KV arrives in, b's first


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_a_generation_only_request_emits_max_tokens_including_the_given_token(max_tokens: int) -> None:
    """The context engine's token counts: with max_tokens 1 (a migrated stream's continuation with
    one token left) the decode engine emits that token and finishes, decoding nothing more."""
    engine = Engine(worker_id="d0", config=EngineConfig(role="decode"), perf=PERF)
    sim = Simulator([engine])
    request = sim.submit(
        0, request_id="r", tokens=_prompt(300), max_tokens=max_tokens, transferred_first_token=7
    )
    sim.run()
    (outcome,) = sim.outcomes
    assert outcome.output_tokens == max_tokens
    assert request.output[0] == 7
    assert len(request.output) == max_tokens
    assert engine.blocks.used_blocks == 0
    assert not engine.has_work()


def test_same_arrivals_give_the_same_tokens_and_times() -> None:
    def run() -> tuple[list[object], list[list[int]]]:
        engine = _engine(seed=7, block_size=16, num_blocks=64)
        tokens: list[list[int]] = []
        sim = Simulator([engine], on_step=lambda _, out: tokens.extend(list(r.output) for r in out.finished))
        rng = np.random.default_rng(3)
        for i in range(20):
            sim.run_until(float(i * 5))
            sim.submit(0, request_id=f"r{i}", tokens=rng.integers(256, 1000, 150).tolist(), max_tokens=30)
        sim.run()
        return [dataclasses.astuple(o) for o in sim.outcomes], tokens

    assert run() == run()


def test_a_sequence_continued_on_another_engine_emits_the_same_ids() -> None:
    """Ids depend on the context only: a continuation (prompt + the ids so far) elsewhere, in
    another batch and fused or not, goes on exactly as the uninterrupted request would have."""

    def outputs(
        engine: Engine, requests: list[tuple[str, list[int], int]], *, fuse: bool
    ) -> dict[str, list[int]]:
        done: dict[str, list[int]] = {}
        sim = Simulator(
            [engine],
            fuse_decode=fuse,
            on_step=lambda _, out: done.update((r.request_id, r.output) for r in out.finished),
        )
        for request_id, tokens, max_tokens in requests:
            sim.submit(0, request_id=request_id, tokens=tokens, max_tokens=max_tokens)
        sim.run()
        return done

    prompt = _prompt(300, salt=3)
    whole = outputs(_engine(seed=9), [("r", prompt, 40)], fuse=True)["r"]
    assert len(set(whole)) > 20  # not a constant
    for fuse in (False, True):
        busy = [(f"other{i}", _prompt(100 + 37 * i, salt=i), 25) for i in range(5)]
        rest = outputs(_engine(seed=9), [*busy, ("r", prompt + whole[:13], 27)], fuse=fuse)["r"]
        assert rest == whole[13:]
    assert outputs(_engine(seed=10), [("r", prompt, 40)], fuse=True)["r"] != whole


def test_fused_decode_steps_give_exactly_the_step_by_step_result() -> None:
    def run(fuse: bool) -> tuple[list[tuple[object, ...]], list[int], int]:
        config = EngineConfig(block_size=16, num_blocks=120, max_num_batched_tokens=512, seed=3)
        engines = [Engine(worker_id=f"w{i}", config=config, perf=PERF) for i in range(2)]
        steps: list[int] = []
        sim = Simulator(engines, fuse_decode=fuse, on_step=lambda _, out: steps.append(out.steps))
        rng = np.random.default_rng(11)
        for i in range(60):
            sim.run_until(float(i * 40))
            tokens = rng.integers(256, 400, int(rng.integers(20, 600))).tolist()
            sim.submit(i % 2, request_id=f"r{i}", tokens=tokens, max_tokens=int(rng.integers(1, 120)))
        sim.run()
        events = [e.event_id for engine in engines for e in engine.drain_kv_events()]
        outcomes = [dataclasses.astuple(o) for o in sorted(sim.outcomes, key=lambda o: o.request_id)]
        return outcomes, events, sum(steps) - len(steps)

    stepwise, fused = run(False), run(True)
    assert fused[0] == stepwise[0]
    assert fused[1] == stepwise[1]
    assert any(o[-1] for o in stepwise[0])  # the workload preempts
    assert stepwise[2] == 0
    assert fused[2] > 0  # and fusion did fuse


def test_fusing_until_the_next_submit_gives_exactly_the_step_by_step_result() -> None:
    def run(*, fuse: bool, until_submit: bool) -> tuple[list[Any], list[Any], list[list[int]], int]:
        config = EngineConfig(block_size=16, num_blocks=150, max_num_batched_tokens=512, seed=5)
        engines = [Engine(worker_id=f"w{i}", config=config, perf=PERF) for i in range(3)]
        outputs: list[int] = []
        tokens: dict[str, list[int]] = {}

        def on_step(_: int, out: StepOutput) -> None:
            outputs.append(out.steps)
            tokens.update((r.request_id, list(r.output)) for r in out.finished)

        sim = Simulator(engines, fuse_decode=fuse, fuse_until_submit=until_submit, on_step=on_step)
        rng = np.random.default_rng(17)
        for i in range(90):
            sim.run_until(float(i * 25))
            prompt = rng.integers(256, 400, int(rng.integers(20, 500))).tolist()
            engine = int(rng.integers(0, 3))
            sim.submit(engine, request_id=f"r{i}", tokens=prompt, max_tokens=int(rng.integers(1, 150)))
        sim.run()
        events = [(e.event_id, e.data) for engine in engines for e in engine.drain_kv_events()]
        outcomes = [dataclasses.astuple(o) for o in sorted(sim.outcomes, key=lambda o: o.request_id)]
        return outcomes, events, [tokens[k] for k in sorted(tokens)], len(outputs)

    stepwise = run(fuse=False, until_submit=False)
    fused = run(fuse=True, until_submit=False)
    until_submit = run(fuse=True, until_submit=True)
    assert until_submit[:3] == stepwise[:3]
    assert fused[:3] == stepwise[:3]
    assert any(o[-1] for o in stepwise[0])  # the workload preempts
    assert stepwise[3] > fused[3] > until_submit[3]  # each mode fuses more steps into one output


def test_a_submit_cuts_fused_decode_steps_at_the_next_step_end() -> None:
    engine = _engine(block_size=64, seed=1)
    engine.add_request(request_id="a", tokens=_prompt(100), max_tokens=40, now_ms=0.0)
    first = engine.begin_step(0.0)
    assert first is not None
    engine.end_step()
    end = engine.begin_step(first, horizon_ms=math.inf)
    assert end is not None
    assert engine.cut_steps(end) is None  # nothing left to cut after the last step
    one = first + PERF.decode_itl_ms(active_kv_tokens=101, context_length=101)
    two = one + PERF.decode_itl_ms(active_kv_tokens=102, context_length=102)
    assert engine.cut_steps(one) == two  # a request arriving as step 1 ends is seen after step 2
    assert engine.cut_steps(one) is None
    out = engine.end_step()
    assert (out.steps, out.decode_tokens, out.end_ms) == (2, 2, two)
    assert engine.requests["a"].num_output == 3


def _noisy_run(*, cv: float, seed: int, fuse: bool) -> list[tuple[object, ...]]:
    config = EngineConfig(
        block_size=16, num_blocks=150, max_num_batched_tokens=512, seed=seed, step_time_cv=cv
    )
    engines = [Engine(worker_id=f"w{i}", config=config, perf=PERF) for i in range(2)]
    sim = Simulator(engines, fuse_decode=fuse, fuse_until_submit=fuse)
    rng = np.random.default_rng(5)
    for i in range(40):
        sim.run_until(float(i * 30))
        prompt = rng.integers(256, 400, int(rng.integers(20, 400))).tolist()
        sim.submit(i % 2, request_id=f"r{i}", tokens=prompt, max_tokens=int(rng.integers(1, 100)))
    sim.run()
    return [dataclasses.astuple(o) for o in sorted(sim.outcomes, key=lambda o: o.request_id)]


def test_fused_steps_take_the_noise_table_across_its_end_exactly() -> None:
    """A run of fused steps past the noise table's last factor starts over at its first."""

    def run(fuse: bool) -> list[tuple[object, ...]]:
        config = EngineConfig(block_size=512, seed=3, step_time_cv=0.1)
        engine = Engine(worker_id="w", config=config, perf=PERF)
        sim = Simulator([engine], fuse_decode=fuse, fuse_until_submit=fuse)
        sim.submit(0, request_id="r", tokens=_prompt(100), max_tokens=17000)
        sim.run()
        return [dataclasses.astuple(o) for o in sim.outcomes]

    assert run(True) == run(False)


def test_step_noise_is_seeded_and_fused_steps_keep_it_exact() -> None:
    exact = _noisy_run(cv=0.0, seed=1, fuse=True)
    noisy = _noisy_run(cv=0.1, seed=1, fuse=True)
    assert noisy == _noisy_run(cv=0.1, seed=1, fuse=True)  # deterministic
    assert noisy == _noisy_run(cv=0.1, seed=1, fuse=False)  # fusion draws the same factor per step
    assert noisy != exact
    assert noisy != _noisy_run(cv=0.1, seed=2, fuse=True)  # another seed, other factors


def test_step_noise_has_mean_one_and_the_given_spread() -> None:
    engine = _engine(step_time_cv=0.2, seed=4)
    engine.add_request(request_id="a", tokens=_prompt(100), max_tokens=3000, now_ms=0.0)
    durations, now = [], 0.0
    while engine.requests:
        end = engine.begin_step(now)
        assert end is not None
        durations.append(end - now)
        engine.end_step()
        now = end
    exact = [PERF.decode_itl_ms(active_kv_tokens=100 + k, context_length=100 + k) for k in range(1, 3000)]
    factors = np.array(durations[1:]) / np.array(exact)
    assert factors.mean() == pytest.approx(1.0, abs=0.02)
    assert factors.std() / factors.mean() == pytest.approx(0.2, rel=0.1)


def test_an_engine_added_later_serves_like_one_there_from_the_start() -> None:
    def run(*, late: bool) -> list[tuple[object, ...]]:
        config = EngineConfig(block_size=16, num_blocks=150, seed=2)
        first = Engine(worker_id="w0", config=config, perf=PERF)
        second = Engine(worker_id="w1", config=config, perf=PERF)
        sim = Simulator([first] if late else [first, second])
        sim.submit(0, request_id="a", tokens=_prompt(300), max_tokens=50)
        sim.run_until(100.0)
        index = sim.add_engine(second) if late else 1
        assert sim.engines[index] is second
        sim.submit(index, request_id="b", tokens=_prompt(300, salt=1), max_tokens=50)
        sim.run()
        return [dataclasses.astuple(o) for o in sorted(sim.outcomes, key=lambda o: o.request_id)]

    assert run(late=True) == run(late=False)
