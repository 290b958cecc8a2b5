"""Queueing formulas and replica math against hand-computed cases."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from copse.api import Role
from copse.planner.capacity import (
    Backlog,
    CapacityModel,
    Corrections,
    Workload,
    _compound_poisson_tail,
    capacity_for,
)
from copse.planner.config import PlannerConfig
from copse.planner.policy import Limits
from copse.planner.queueing import (
    erlang_c,
    gamma_points,
    lognormal_scv,
    mean_wait_s,
    quantile_points,
    wait_quantile_s,
)
from copse.workers.perf import PolynomialPerfModel

from .conftest import LinearPerf

PD = (Role.PREFILL, Role.DECODE)


# --- queueing ------------------------------------------------------------------------------


def test_mean_wait_of_an_m_m_1_queue() -> None:
    # M/M/1, rho = 0.5, service 1 s: W = rho / (mu - lambda) = 0.5 / 0.5 = 1 s
    assert mean_wait_s(servers=1, arrival_rate=0.5, service_s=1.0) == pytest.approx(1.0)
    assert mean_wait_s(servers=1, arrival_rate=1.0, service_s=1.0) == math.inf


def test_gamma_points_have_the_mean_and_the_p90() -> None:
    # no p90: the squared CV sets the shape (1.0: exponential, whose p90 is ln(10) x the mean)
    points = gamma_points(mean=1000.0, scv=1.0, count=2000)
    assert points.mean() == pytest.approx(1000.0, rel=0.01)
    assert points.var() / points.mean() ** 2 == pytest.approx(1.0, rel=0.05)
    assert np.quantile(points, 0.9) == pytest.approx(1000.0 * math.log(10), rel=0.01)
    assert list(points) == sorted(points)
    # a p90 beyond what any lognormal with this mean has (2.28 x): matched, with a light tail
    fitted = gamma_points(mean=8667.0, p90=20380.0, count=2000)
    assert np.quantile(fitted, 0.9) == pytest.approx(20380.0, rel=0.01)
    assert fitted.mean() == pytest.approx(8667.0, rel=0.01)
    assert set(gamma_points(mean=5.0, scv=0.0, count=3)) == {5.0}
    assert set(gamma_points(mean=5.0, p90=4.0, count=3)) == {5.0}


def test_gamma_points_can_match_the_p10_instead() -> None:
    # Mooncake's conversation answers: mean 338 tokens, 10 % shorter than 25 (many short answers)
    short = gamma_points(mean=338.0, p10=25.0, count=2000)
    assert np.quantile(short, 0.1) == pytest.approx(25.0, rel=0.02)
    assert short.mean() == pytest.approx(338.0, rel=0.01)
    assert np.mean(short < 32) == pytest.approx(0.122, abs=0.01)  # the trace has 12.2 % below 32
    assert set(gamma_points(mean=5.0, p10=6.0, count=3)) == {5.0}
    with pytest.raises(ValueError, match="p90 or p10"):
        gamma_points(mean=5.0, p10=1.0, p90=9.0, count=3)


def test_quantile_points_follow_the_quantiles_and_keep_the_mean() -> None:
    # levels 1/8, 3/8, 5/8, 7/8; above the median 100 -> 300 (points 150, 250, mean 200 over that
    # half); below it the line starts where the mean comes out: from 60 (mean 80 over that half)
    points = quantile_points(levels=(0.5, 1.0), values=(100.0, 300.0), mean=140.0, count=4)
    assert list(points) == pytest.approx([70.0, 90.0, 150.0, 250.0])
    # a mean no start in [0, 100] reaches: every value scales (from 0: 25, 75, 150, 250, mean 125)
    scaled = quantile_points(levels=(0.5, 1.0), values=(100.0, 300.0), mean=100.0, count=4)
    assert list(scaled) == pytest.approx([20.0, 60.0, 120.0, 200.0])
    with pytest.raises(ValueError, match="must end at 1"):
        quantile_points(levels=(0.5, 0.9), values=(1.0, 2.0), mean=1.0, count=4)
    with pytest.raises(ValueError, match="non-decreasing"):
        quantile_points(levels=(0.5, 1.0), values=(3.0, 2.0), mean=1.0, count=4)
    with pytest.raises(ValueError, match="increase"):
        quantile_points(levels=(0.5, 0.5, 1.0), values=(1.0, 2.0, 3.0), mean=1.0, count=4)


def test_erlang_c_hand_values() -> None:
    assert erlang_c(1, 0.5) == pytest.approx(0.5)  # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(2, 1.5) == pytest.approx(9 / 14)
    assert erlang_c(3, 0.0) == 0.0
    assert erlang_c(3, 3.0) == 1.0  # unstable


def test_erlang_c_large_pool_does_not_underflow() -> None:
    assert 0.0 <= erlang_c(5000, 4900.0) < 1.0
    assert erlang_c(100_000, 1.0) == 0.0


def test_wait_quantile_mm1() -> None:
    # P(W > t) = rho * exp(-(mu - lambda) t) with lambda 0.5, mu 1.
    expected = math.log(0.5 / 0.01) / 0.5
    assert wait_quantile_s(servers=1, arrival_rate=0.5, service_s=1.0, quantile=0.99) == pytest.approx(
        expected
    )
    # Fixed service times wait half as long (Allen-Cunneen).
    fixed = wait_quantile_s(servers=1, arrival_rate=0.5, service_s=1.0, quantile=0.99, service_scv=0.0)
    assert fixed == pytest.approx(expected / 2)
    assert wait_quantile_s(servers=1, arrival_rate=1.0, service_s=1.0, quantile=0.99) == math.inf
    assert wait_quantile_s(servers=4, arrival_rate=0.1, service_s=1.0, quantile=0.99) == 0.0


def test_lognormal_scv_recovers_sigma() -> None:
    sigma = 0.5
    mean, p90 = math.exp(sigma**2 / 2), math.exp(1.2815515655446004 * sigma)
    assert lognormal_scv(mean=mean, p90=p90) == pytest.approx(math.expm1(sigma**2))
    assert lognormal_scv(mean=100.0, p90=90.0) == 0.0
    assert lognormal_scv(mean=100.0, p90=1000.0) == pytest.approx(math.expm1(1.2815515655446004**2))


# --- prefill ------------------------------------------------------------------------------


def test_prefill_service_counts_only_uncached_tokens(linear: CapacityModel) -> None:
    # 1000 tokens, half cached: overhead 10 + 500 new tokens x 0.01.
    assert linear.prefill_service_ms(1000, hit_rate=0.5) == pytest.approx(15.0)
    assert linear.prefill_service_ms(1000, hit_rate=0.0) == pytest.approx(20.0)
    assert linear.prefill_service_ms(1000, hit_rate=0.5, scale=2.0) == pytest.approx(30.0)


def test_prefill_ttft_hand_computed(linear: CapacityModel) -> None:
    load = Workload(rate=100.0, isl=1000, osl=100, kv_hit_rate=0.5)
    estimate = linear.estimate(replicas={Role.PREFILL: 2, Role.DECODE: 5}, load=load, duration_s=60.0)
    # M/M/2 with a = 1.5: C = 9/14; wait p99 = ln(C / 0.01) / (2/0.015 - 100) s; plus the 15 ms prefill.
    wait_ms = math.log((9 / 14) / 0.01) / (2 / 0.015 - 100.0) * 1000.0
    assert estimate.ttft_ms == pytest.approx(wait_ms + 15.0)
    assert estimate.backlog == Backlog()


def test_prefill_replicas_start_from_the_token_throughput_bound() -> None:
    fixed = CapacityModel(LinearPerf(), max_num_seqs=64, isl_scv=0.0)  # every prompt 1,000 tokens
    load = Workload(rate=100.0, isl=1000, osl=100, kv_hit_rate=0.5)
    # 100 req/s x 15 ms of prefill (500 new tokens) = 1.5 engines busy: the bound is 2.
    sizing = fixed.prefill_replicas(load, ttft_ms=150.0)
    assert sizing.throughput_replicas == 2
    assert sizing.feasible
    assert sizing.replicas == 2  # at 75 % busy hardly any prompt waits 135 ms
    # A tight target (15 ms of prefill, a first decode step of 10.1 ms: 10 ms of waiting allowed):
    # the fewest engines serving 99 % within it.
    tight = fixed.prefill_replicas(load, ttft_ms=35.0)

    def share(engines: int) -> float:
        return fixed.attainment(
            replicas={Role.PREFILL: engines, Role.DECODE: 64}, load=load, ttft_ms=35.0, itl_ms=math.inf
        ).ttft

    assert tight.replicas > 2
    assert share(tight.replicas - 1) < 0.99 <= share(tight.replicas)


def test_the_ttft_tail_is_the_prompts_own_prefill() -> None:
    """Long prompts whose prefill alone exceeds the target are lost on any fleet: the share that can
    meet it is the share of prompts short enough, and sizing aims at the goal among those."""
    model = CapacityModel(LinearPerf(), max_num_seqs=64, isl_scv=1.0)
    load = Workload(rate=20.0, isl=2000, osl=100)
    # prefill = 10 + 0.01 x isl ms and a first decode step of 10.1 ms: a 60 ms target fits prompts
    # of up to 3,990 tokens
    points = model.prompt_prefill_ms(load)
    reachable = float(np.mean(points + 10.1 <= 60.0))
    assert 0.8 < reachable < 0.95
    many = model.attainment(replicas={Role.PREFILL: 64, Role.DECODE: 64}, load=load, ttft_ms=60.0, itl_ms=1e9)
    assert many.reachable == pytest.approx(reachable)
    assert many.ttft == pytest.approx(reachable, abs=1e-6)  # no waiting with 64 engines
    sizing = model.prefill_replicas(load, ttft_ms=60.0, goal=0.99)
    assert not sizing.feasible  # the goal is above the reachable share...
    assert sizing.replicas < 64  # ...which does not make the fleet grow without end
    fewest = model.attainment(
        replicas={Role.PREFILL: sizing.replicas, Role.DECODE: 64}, load=load, ttft_ms=60.0, itl_ms=1e9
    )
    assert fewest.ttft >= 0.99 * reachable


def test_a_correction_factor_scales_the_prompts_prefill_times_of_one_table() -> None:
    """Solving a correction factor tries thirty factors on one interval's load: the prompts' prefill
    times are worked out once per load (the perf model asked once per prompt point) and scaled."""

    class Counted(LinearPerf):
        calls = 0

        def prefill_curve_ms(self, isl: float) -> float:
            Counted.calls += 1
            return super().prefill_curve_ms(isl)

    model = CapacityModel(Counted(), max_num_seqs=64)
    load = Workload(rate=20.0, isl=2000, isl_p90=4500, osl=100)
    base = model.prompt_prefill_ms(load)
    asked = Counted.calls
    for scale in (0.5, 1.3, 2.0):
        assert np.array_equal(model.prompt_prefill_ms(load, scale=scale), base * scale)
    assert Counted.calls == asked
    model.prompt_prefill_ms(dataclasses.replace(load, isl=2100))  # another load: another table
    assert Counted.calls > asked


def test_the_prompts_spread_as_their_uncached_quantiles_say() -> None:
    """With the router's quantiles of the uncached tokens the prompts are read off them, not fitted:
    a context limit cuts the tail that a gamma through the same mean and p90 runs on past, so no
    prompt is lost to the TTFT target that a gamma would give up on."""
    model = CapacityModel(LinearPerf(), max_num_seqs=64)
    fitted = Workload(rate=20.0, isl=2000, isl_p90=4500, osl=100)
    # uncached tokens at p50/p90/p99/max; the longest stays below the 3,990 a 60 ms target fits
    # (with the first decode step's 10.1 ms)
    read = dataclasses.replace(fitted, uncached_quantiles=(1500.0, 3600.0, 3900.0, 3950.0))
    lengths = (model.prompt_prefill_ms(read) - 10.0) / 0.01  # LinearPerf: 10 + 0.01 x tokens ms
    assert lengths.mean() == pytest.approx(2000.0, rel=1e-4)  # the mean prompt (in whole tokens)
    assert lengths.max() < 3950.0
    assert np.quantile(lengths, 0.5) < np.quantile(lengths, 0.9) < lengths.max()

    def reachable(load: Workload) -> float:
        return model.reachable(load, ttft_ms=60.0, corrections=Corrections())

    assert reachable(read) == 1.0
    assert reachable(fitted) < 0.95
    # fewer engines hold the goal once the lost share is not there to chase
    read_sizing = model.prefill_replicas(read, ttft_ms=60.0, goal=0.99)
    assert read_sizing.feasible
    assert not model.prefill_replicas(fitted, ttft_ms=60.0, goal=0.99).feasible
    with pytest.raises(ValueError, match="one value per level"):
        dataclasses.replace(fitted, uncached_quantiles=(1.0, 2.0))


def test_a_higher_goal_needs_at_least_as_many_replicas(linear: CapacityModel) -> None:
    load = Workload(rate=200.0, isl=3000, isl_p90=6000, osl=200)
    counts = [
        linear.aggregated_replicas(load, ttft_ms=500.0, itl_ms=40.0, goal=goal).replicas
        for goal in (0.5, 0.9, 0.99, 0.999)
    ]
    assert counts == sorted(counts)
    assert counts[0] < counts[-1]


def test_prefill_chunks_stretch_the_mean_gap_of_aggregated_engines(linear: CapacityModel) -> None:
    """Aggregated engines spend a share of their time prefilling; decode steps that share it wait."""
    short = Workload(rate=50.0, isl=100, osl=100)
    long = Workload(rate=50.0, isl=20000, osl=100)
    replicas = {Role.WORKER: 20}
    assert (
        linear.means(replicas=replicas, load=long, duration_s=60.0).itl_ms
        > linear.means(replicas=replicas, load=short, duration_s=60.0).itl_ms
    )
    assert (
        linear.attainment(replicas=replicas, load=long, ttft_ms=1e9, itl_ms=15.0).itl
        < linear.attainment(replicas=replicas, load=short, ttft_ms=1e9, itl_ms=15.0).itl
    )


def test_short_answers_set_the_itl_tail_of_aggregated_engines() -> None:
    """A request with few gaps misses when one long prompt's chunk shares one of its steps: the more
    short answers (a lower p10 at the same mean), the fewer requests within the target, and the more
    engines the same goal needs; a decode pool (no chunks) does not care."""
    model = CapacityModel(PolynomialPerfModel())
    even = Workload(rate=12.0, isl=8000, isl_p90=20000, osl=300, osl_p10=200, kv_hit_rate=0.3)
    short = dataclasses.replace(even, osl_p10=20)
    replicas = {Role.WORKER: 8}
    assert (
        model.attainment(replicas=replicas, load=short, ttft_ms=2000, itl_ms=50).itl
        < model.attainment(replicas=replicas, load=even, ttft_ms=2000, itl_ms=50).itl - 0.002
    )
    assert (
        model.aggregated_replicas(short, ttft_ms=2000, itl_ms=50).replicas
        > model.aggregated_replicas(even, ttft_ms=2000, itl_ms=50).replicas
    )
    pools = {Role.PREFILL: 20, Role.DECODE: 2}
    assert model.attainment(replicas=pools, load=short, ttft_ms=2000, itl_ms=50).itl == pytest.approx(
        model.attainment(replicas=pools, load=even, ttft_ms=2000, itl_ms=50).itl
    )


def test_chunks_that_fit_in_a_gap_spoil_fewer_short_answers() -> None:
    """The step's token budget bounds a chunk: 1,024-token chunks add less to a step than the ITL
    target leaves over the decode step, so a short answer sharing steps with a long prompt stays
    within it, where one 8,192-token chunk puts it over."""
    load = Workload(rate=12.0, isl=8000, isl_p90=20000, osl=300, osl_p10=20, kv_hit_rate=0.3)
    replicas = {Role.WORKER: 8}
    wide = CapacityModel(PolynomialPerfModel(), max_batch_tokens=8192)
    narrow = CapacityModel(PolynomialPerfModel(), max_batch_tokens=1024)
    assert (
        narrow.attainment(replicas=replicas, load=load, ttft_ms=2000, itl_ms=50).itl
        > wide.attainment(replicas=replicas, load=load, ttft_ms=2000, itl_ms=50).itl + 0.003
    )


def test_compound_poisson_tail_hand_values() -> None:
    def tail(threshold: float, m: float, values: list[float], weights: list[float]) -> float:
        return float(
            _compound_poisson_tail(
                np.array([threshold]),
                mean_count=np.array([m]),
                values=np.array([values]),
                weights=np.array([weights]),
                spread=np.zeros(1),
            )[0]
        )

    # every count of one or more passes 5 (and none passes 25 below three)
    assert tail(5.0, 0.3, [10.0], [1.0]) == pytest.approx(1.0 - math.exp(-0.3))
    assert tail(25.0, 0.3, [10.0], [1.0]) == pytest.approx(1.0 - math.exp(-0.3) * (1.0 + 0.3 + 0.3**2 / 2.0))
    # two values, half the weight each: one draw never passes 25, two draws 3/4 of the time, three
    # always (the normal terms: nearly always)
    m = 0.1
    expected = math.exp(-m) * m * m / 2.0 * 0.75 + (1.0 - math.exp(-m) * (1 + m + m * m / 2))
    assert tail(25.0, m, [10.0, 20.0], [0.5, 0.5]) == pytest.approx(expected, rel=1e-3)


def test_a_backlog_adds_to_the_mean_ttft(linear: CapacityModel) -> None:
    load = Workload(rate=50.0, isl=1000, osl=100)
    replicas = {Role.WORKER: 4}
    calm = linear.means(replicas=replicas, load=load, duration_s=60.0)
    behind = linear.means(replicas=replicas, load=load, duration_s=60.0, backlog=200.0)
    assert behind.ttft_ms > calm.ttft_ms
    assert behind.queue_ms - calm.queue_ms == pytest.approx(behind.ttft_ms - calm.ttft_ms)


def test_prefix_hits_reduce_prefill_replicas(linear: CapacityModel) -> None:
    cold = Workload(rate=300.0, isl=4000, osl=100)
    warm = dataclasses.replace(cold, kv_hit_rate=0.6)
    assert (
        linear.prefill_replicas(warm, ttft_ms=500).replicas
        < linear.prefill_replicas(cold, ttft_ms=500).replicas
    )


def test_onboarding_from_the_offload_tier_is_part_of_the_prefill(linear: CapacityModel) -> None:
    # 1000 tokens, 80 % cached of which part in host memory: 10 + 200 x 0.01 ms, plus 3 ms of copies
    assert linear.prefill_service_ms(1000, hit_rate=0.8, onboard_ms=3.0) == pytest.approx(15.0)
    load = Workload(rate=100.0, isl=1000, osl=100, kv_hit_rate=0.8, onboard_ms=3.0)
    estimate = linear.estimate(replicas={Role.PREFILL: 10, Role.DECODE: 5}, load=load, duration_s=60.0)
    assert estimate.ttft_ms == pytest.approx(15.0)  # nobody waits: the prefill of one prompt
    # 100 req/s x 15 ms = 1.5 engines busy: the throughput bound is 2
    assert linear.prefill_replicas(load, ttft_ms=150.0).throughput_replicas == 2
    # the fleet's hit rate with the host tier (80 %, 3 ms of copies) against the GPU's alone (50 %):
    # 4000-token prompts cost 30 ms, 21 ms, and 48 ms when the copies take 30 ms
    gpu_only = Workload(rate=300.0, isl=4000, osl=100, kv_hit_rate=0.5)
    with_tier = dataclasses.replace(gpu_only, kv_hit_rate=0.8, onboard_ms=3.0)
    slow_copies = dataclasses.replace(with_tier, onboard_ms=30.0)
    replicas = [
        linear.prefill_replicas(load, ttft_ms=200.0).replicas for load in (gpu_only, with_tier, slow_copies)
    ]
    assert replicas[1] < replicas[0] < replicas[2]
    with pytest.raises(ValueError, match="onboard_ms=-1"):
        Workload(rate=1.0, isl=10, osl=1, onboard_ms=-1.0)


def test_p90_isl_sets_the_ttft_tail(linear: CapacityModel) -> None:
    mean_only = Workload(rate=100.0, isl=1000, osl=100)
    long_tail = dataclasses.replace(mean_only, isl_p90=2000)
    # With 10 engines for 2 Erlangs nobody waits at p99: TTFT is the prefill of the tail prompt.
    replicas = {Role.PREFILL: 10, Role.DECODE: 5}
    a = linear.estimate(replicas=replicas, load=mean_only, duration_s=60.0)
    b = linear.estimate(replicas=replicas, load=long_tail, duration_s=60.0)
    assert (a.ttft_ms, b.ttft_ms) == pytest.approx((20.0, 30.0))


def test_unreachable_ttft_is_reported() -> None:
    fixed = CapacityModel(LinearPerf(), max_num_seqs=64, isl_scv=0.0)
    load = Workload(rate=10.0, isl=1000, osl=100)
    sizing = fixed.prefill_replicas(load, ttft_ms=15.0)  # one prompt alone takes 20 ms
    assert not sizing.feasible
    assert sizing.replicas == sizing.throughput_replicas == 1


def test_no_load_needs_no_replicas(linear: CapacityModel) -> None:
    load = Workload(rate=0.0, isl=1000, osl=100)
    assert linear.prefill_replicas(load, ttft_ms=100).replicas == 0
    assert linear.decode_replicas(load, itl_ms=20).replicas == 0
    assert linear.aggregated_replicas(load, ttft_ms=100, itl_ms=20).replicas == 0


# --- decode -------------------------------------------------------------------------------


def test_decode_itl_from_littles_law_fixed_point(linear: CapacityModel) -> None:
    # 10 req/s x 100 tokens on one engine: n = 1000 x (10 + 0.1 n) / 1000 -> n = 100/9.
    load = Workload(rate=10.0, isl=1000, osl=100)
    estimate = linear.estimate(replicas={Role.PREFILL: 5, Role.DECODE: 1}, load=load, duration_s=60.0)
    n = 100 / 9
    tail = n + 2.3263478740408408 * math.sqrt(n)
    assert estimate.decoding == pytest.approx(n, rel=1e-6)
    assert estimate.itl_ms == pytest.approx(10.0 + 0.1 * tail, rel=1e-6)


def test_decode_replicas_from_the_best_batch_under_the_itl_target(linear: CapacityModel) -> None:
    load = Workload(rate=100.0, isl=1000, osl=100)
    # KV holds 100000 // 1050 = 95 sequences, max_num_seqs 64 -> best batch 64 at 16.4 ms:
    # 64 / 16.4 ms = 3902 tokens/s; 10000 tokens/s needs 3 engines.
    sizing = linear.decode_replicas(load, itl_ms=20.0)
    assert sizing.throughput_replicas == 3
    assert sizing.feasible
    itl = linear.estimate(
        replicas={Role.PREFILL: 50, Role.DECODE: sizing.replicas}, load=load, duration_s=60.0
    ).itl_ms
    assert itl <= 20.0
    fewer = linear.estimate(
        replicas={Role.PREFILL: 50, Role.DECODE: sizing.replicas - 1}, load=load, duration_s=60.0
    ).itl_ms
    assert fewer > 20.0


def test_a_decode_pool_is_sized_for_room_in_its_cache_as_well_as_its_step() -> None:
    """Mooncake conversation shapes (mean prompt 8,670, p90 20,396): at 9 req/s one decode engine
    still steps within 50 ms, but the long prompts fill its cache often, and a request handed over
    then waits for its first token."""
    capacity = CapacityModel(PolynomialPerfModel())
    load = Workload(rate=9.0, isl=8670.0, osl=338.0, isl_p90=20396.0, osl_p10=25.0)
    one, two = (
        capacity.attainment(
            replicas={Role.PREFILL: 1 << 16, Role.DECODE: n}, load=load, ttft_ms=math.inf, itl_ms=50.0
        )
        for n in (1, 2)
    )
    assert one.itl == two.itl == 1.0  # the step is fast enough either way
    assert one.ttft < 0.95  # about 10 % of the handed-over requests find the cache full
    assert two.ttft > 0.9999
    sizing = capacity.decode_replicas(load, itl_ms=50.0, goal=0.995)
    assert (sizing.throughput_replicas, sizing.replicas) == (1, 2)
    # at 5 req/s the cache has room: one engine
    assert (
        capacity.decode_replicas(dataclasses.replace(load, rate=5.0), itl_ms=50.0, goal=0.995).replicas == 1
    )


def test_a_decode_engine_is_full_when_the_routers_charges_reach_its_busy_fraction() -> None:
    """The router charges each request its prompt and whole output and skips a decode worker whose
    charges pass its busy fraction: the lower that fraction, the sooner requests wait for room."""
    load = Workload(rate=8.0, isl=8670.0, osl=338.0, isl_p90=20396.0, osl_p10=25.0)

    def ttft(fraction: float, rate: float, engines: int = 1) -> float:
        capacity = capacity_for(
            PolynomialPerfModel(),
            config=PlannerConfig(router_busy_kv_fraction=fraction),
            limits=Limits(roles=PD, gpus_per_replica=dict.fromkeys(PD, 1), ttft_ms=math.inf, itl_ms=50.0),
        )
        return capacity.attainment(
            replicas={Role.PREFILL: 1 << 16, Role.DECODE: engines},
            load=dataclasses.replace(load, rate=rate),
            ttft_ms=math.inf,
            itl_ms=50.0,
        ).ttft

    assert ttft(0.8, 8.0) < ttft(0.95, 8.0) < ttft(1.0, 8.0) < 0.99
    assert ttft(0.8, 8.0) < 0.7  # a fifth of the cache held back: one engine serves far less
    assert ttft(0.8, 5.0) > 0.9999  # a light load never fills it
    # A request waits only when every engine is full: two engines at twice the load wait less.
    assert ttft(0.95, 8.0) < ttft(0.95, 16.0, engines=2) < 0.99


def test_disaggregated_pools_share_the_misses_where_they_cost_fewest_gpus() -> None:
    """Mooncake conversation shapes at 21 req/s: half the error budget in each pool (99.5 % each)
    takes a fifth prefill engine; judged together, 4 + 3 serve 99 % of the requests."""
    capacity = CapacityModel(PolynomialPerfModel())
    load = Workload(rate=21.0, isl=8400.0, osl=340.0, isl_p90=20000.0, osl_p10=60.0, kv_hit_rate=0.3)
    halves = (
        capacity.prefill_replicas(load, ttft_ms=2000.0, goal=0.995).replicas,
        capacity.decode_replicas(load, itl_ms=50.0, goal=0.995).replicas,
    )
    joint = capacity.disaggregated_replicas(
        load, ttft_ms=2000.0, itl_ms=50.0, gpus_per_replica={Role.PREFILL: 1, Role.DECODE: 1}, goal=0.99
    )
    assert halves == (5, 3)
    assert (joint[Role.PREFILL].replicas, joint[Role.DECODE].replicas) == (4, 3)
    served = capacity.attainment(
        replicas={Role.PREFILL: 4, Role.DECODE: 3}, load=load, ttft_ms=2000.0, itl_ms=50.0
    )
    assert served.both >= 0.99 * served.reachable


@settings(max_examples=25, deadline=None)
@given(
    rate=st.floats(0.5, 40.0),
    isl=st.floats(500.0, 12000.0),
    osl=st.floats(20.0, 600.0),
    gpus_p=st.integers(1, 4),
    gpus_d=st.integers(1, 4),
)
def test_joint_disaggregated_sizing_is_the_cheapest_pair_meeting_the_goal(
    rate: float, isl: float, osl: float, gpus_p: int, gpus_d: int
) -> None:
    capacity = CapacityModel(PolynomialPerfModel())
    load = Workload(rate=rate, isl=isl, osl=osl, isl_p90=2.2 * isl, osl_p10=osl / 6.0, kv_hit_rate=0.3)
    goal = 0.99
    sized = capacity.disaggregated_replicas(
        load,
        ttft_ms=2000.0,
        itl_ms=50.0,
        gpus_per_replica={Role.PREFILL: gpus_p, Role.DECODE: gpus_d},
        goal=goal,
    )
    each = 1.0 - (1.0 - goal) / 2.0
    halves = (
        capacity.prefill_replicas(load, ttft_ms=2000.0, goal=each).replicas,
        capacity.decode_replicas(load, itl_ms=50.0, goal=each).replicas,
    )

    def meets(prefill: int, decode: int) -> bool:
        served = capacity.attainment(
            replicas={Role.PREFILL: prefill, Role.DECODE: decode}, load=load, ttft_ms=2000.0, itl_ms=50.0
        )
        return served.both >= goal * served.reachable

    def gpus(prefill: int, decode: int) -> int:
        return prefill * gpus_p + decode * gpus_d

    chosen = (sized[Role.PREFILL].replicas, sized[Role.DECODE].replicas)
    assert meets(*chosen)
    assert gpus(*chosen) <= gpus(*halves)
    assert not any(
        meets(prefill, decode)
        for prefill in range(1, chosen[0] + 1)
        for decode in range(1, chosen[1] + 2)
        if gpus(prefill, decode) < gpus(*chosen)
    )


def test_unreachable_itl_is_reported(linear: CapacityModel) -> None:
    load = Workload(rate=10.0, isl=1000, osl=100)
    sizing = linear.decode_replicas(load, itl_ms=9.0)  # an idle step takes 10 ms
    assert not sizing.feasible
    assert sizing.replicas >= 1


# --- overload -----------------------------------------------------------------------------


def test_overload_builds_a_backlog_that_carries_over(linear: CapacityModel) -> None:
    load = Workload(rate=200.0, isl=1000, osl=100)  # 20 ms prompts: 50 req/s per engine
    replicas = {Role.PREFILL: 2, Role.DECODE: 5}
    first = linear.estimate(replicas=replicas, load=load, duration_s=10.0)
    assert first.backlog.prefill == pytest.approx(1000.0)  # (200 - 100) x 10 s
    # The last arrival waits for the backlog plus z = 2.33 standard deviations of the
    # arrivals-minus-completions count over the segment (variance (200 + 100) x 10).
    spread = 2.3263478740408408 * math.sqrt(300.0 * 10.0)
    assert first.ttft_ms == pytest.approx((1000.0 + spread) / 100.0 * 1000.0 + 20.0)
    # The next segment, with enough replicas, drains it -- but its early requests still wait.
    calm = dataclasses.replace(load, rate=50.0)
    second = linear.estimate(
        replicas={Role.PREFILL: 8, Role.DECODE: 5}, load=calm, duration_s=10.0, backlog=first.backlog
    )
    assert second.backlog.prefill == 0.0
    assert second.ttft_ms > 2000.0


def test_decode_overload_shows_as_an_itl_stall(linear: CapacityModel) -> None:
    load = Workload(rate=100.0, isl=1000, osl=1000)  # 100k tokens/s of output
    estimate = linear.estimate(replicas={Role.PREFILL: 10, Role.DECODE: 1}, load=load, duration_s=60.0)
    assert estimate.backlog.decode > 0
    assert estimate.itl_ms > 1000.0


def test_no_replicas_means_everything_waits(linear: CapacityModel) -> None:
    load = Workload(rate=1.0, isl=1000, osl=100)
    estimate = linear.estimate(replicas={Role.PREFILL: 0, Role.DECODE: 0}, load=load, duration_s=60.0)
    assert estimate.ttft_ms >= 60_000.0
    assert estimate.backlog.prefill == pytest.approx(60.0)


# --- aggregated ---------------------------------------------------------------------------


def test_aggregated_engines_share_time_between_prefill_and_decode(linear: CapacityModel) -> None:
    load = Workload(rate=20.0, isl=1000, osl=100)

    # Prefill takes 20 req/s x 20 ms = 40 % of one engine; decode steps stretch by 1/0.6.
    one = linear.estimate(replicas={Role.WORKER: 1}, load=load, duration_s=60.0)
    disagg = linear.estimate(replicas={Role.PREFILL: 1, Role.DECODE: 1}, load=load, duration_s=60.0)
    assert one.itl_ms > disagg.itl_ms * 1.5
    sizing = linear.aggregated_replicas(load, ttft_ms=200.0, itl_ms=20.0)
    assert sizing.feasible
    result = linear.estimate(replicas={Role.WORKER: sizing.replicas}, load=load, duration_s=60.0)
    assert result.ttft_ms <= 200.0
    assert result.itl_ms <= 20.0
    # Sized per request: one engine fewer serves less than 99 % of the requests within both targets.
    smaller = linear.attainment(
        replicas={Role.WORKER: sizing.replicas - 1}, load=load, ttft_ms=200.0, itl_ms=20.0
    )
    assert smaller.ttft * smaller.itl < 0.99


def test_corrections_slow_the_model_down(linear: CapacityModel) -> None:
    load = Workload(rate=50.0, isl=2000, osl=200)
    replicas = {Role.PREFILL: 4, Role.DECODE: 2}
    base = linear.estimate(replicas=replicas, load=load, duration_s=60.0)
    slow = linear.estimate(
        replicas=replicas, load=load, duration_s=60.0, corrections=Corrections(prefill=1.5, decode=1.5)
    )
    assert slow.ttft_ms > base.ttft_ms
    assert slow.itl_ms > base.itl_ms


@settings(max_examples=60, deadline=None)
@given(
    rate=st.floats(0.1, 400.0),
    isl=st.floats(10.0, 20000.0),
    osl=st.floats(1.0, 2000.0),
    hit=st.floats(0.0, 0.95),
    prefill=st.integers(1, 40),
    decode=st.integers(1, 40),
)
def test_more_replicas_never_make_latency_worse(
    *, rate: float, isl: float, osl: float, hit: float, prefill: int, decode: int
) -> None:
    capacity = CapacityModel(PolynomialPerfModel())
    load = Workload(rate=rate, isl=isl, osl=osl, kv_hit_rate=hit)
    base = capacity.estimate(replicas={Role.PREFILL: prefill, Role.DECODE: decode}, load=load, duration_s=60)
    more_prefill = capacity.estimate(
        replicas={Role.PREFILL: prefill + 1, Role.DECODE: decode}, load=load, duration_s=60
    )
    more_decode = capacity.estimate(
        replicas={Role.PREFILL: prefill, Role.DECODE: decode + 1}, load=load, duration_s=60
    )
    assert more_prefill.ttft_ms <= base.ttft_ms + 1e-9
    assert more_decode.itl_ms <= base.itl_ms + 1e-9
    worker = capacity.estimate(replicas={Role.WORKER: prefill}, load=load, duration_s=60)
    more_workers = capacity.estimate(replicas={Role.WORKER: prefill + 1}, load=load, duration_s=60)
    assert more_workers.ttft_ms <= worker.ttft_ms + 1e-9
    assert more_workers.itl_ms <= worker.itl_ms + 1e-9


@settings(max_examples=40, deadline=None)
@given(rate=st.floats(0.5, 300.0), isl=st.floats(100.0, 8000.0), osl=st.floats(10.0, 500.0))
def test_sized_pools_meet_the_goal(rate: float, isl: float, osl: float) -> None:
    capacity = CapacityModel(PolynomialPerfModel())
    load = Workload(rate=rate, isl=isl, osl=osl)
    decode = capacity.decode_replicas(load, itl_ms=30.0, goal=0.99)
    # the first token is a step of the decode pool the prompts are handed to
    prefill = capacity.prefill_replicas(load, ttft_ms=800.0, goal=0.99, decode=decode.replicas)
    sized = capacity.attainment(
        replicas={Role.PREFILL: prefill.replicas, Role.DECODE: decode.replicas},
        load=load,
        ttft_ms=800.0,
        itl_ms=30.0,
    )
    assert prefill.replicas >= prefill.throughput_replicas
    assert sized.ttft >= 0.99 * sized.reachable
    if decode.feasible:
        assert decode.replicas >= decode.throughput_replicas
        assert sized.itl >= 0.99
