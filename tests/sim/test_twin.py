"""The closed-loop twin: what the planner observes, replicas starting late and draining before
they go, and the planner and static fleets end to end."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from copse.api import Role
from copse.planner.config import PlannerConfig
from copse.planner.observations import Observation
from copse.planner.policy import AGGREGATED, Limits
from copse.planner.recording import write_metrics_jsonl
from copse.router.core import Role as EngineRole
from copse.router.core import Thresholds
from copse.sim.cli import bench
from copse.sim.load import arrival_times_s, shapes_in_order, synthesize
from copse.sim.replay import Fleet, ReplaySettings, RouterModel
from copse.sim.trace import TraceRequest
from copse.sim.twin import Replicas, TwinSettings, histogram_quantile, observe, pulse, run_twin, slo_counts

EXACT = ReplaySettings(
    workers=1, engine_noise=0.0, kv_event_lag_ms=0.0, router_model=RouterModel(source="exact")
)
LIMITS = Limits(
    roles=AGGREGATED, gpus_per_replica={Role.WORKER: 1}, ttft_ms=2000.0, itl_ms=50.0, max_replicas=8
)
DISAGGREGATED = Limits(
    roles=(Role.PREFILL, Role.DECODE),
    gpus_per_replica={Role.PREFILL: 1, Role.DECODE: 2},
    ttft_ms=2000.0,
    itl_ms=50.0,
    max_replicas=8,
)


def _requests(times_s: list[float], *, isl: int = 1500, osl: int = 50) -> list[TraceRequest]:
    return [
        TraceRequest(
            timestamp_ms=t * 1000.0,
            input_length=isl,
            output_length=osl,
            hash_ids=tuple(100 * i + k for k in range(-(-isl // 512))),
        )
        for i, t in enumerate(times_s)
    ]


def _held_s(replicas: Replicas, *, end_ms: float) -> float:
    """Replica-seconds held from 0 to ``end_ms``."""
    return sum(end - begin for begin, end in replicas.spans(start_ms=0.0, end_ms=end_ms)) / 1000.0


def _four_served() -> Fleet:
    """Two engines that served four requests within the first minute."""
    trace = _requests([0.0, 0.5, 1.0, 1.5], osl=20)
    fleet = Fleet(trace, EXACT, engines=2)
    for i in range(len(trace)):
        fleet.run_until(float(fleet.arrival_ms[i]))
        fleet.arrive(i)
    fleet.run_until(60_000.0)
    return fleet


def test_histogram_quantile_is_prometheus_linear_interpolation() -> None:
    buckets = (1.0, 2.0, 4.0)
    values = np.array([0.5, 1.5, 1.5, 3.0])
    # rank 0.5 x 4 = 2 falls in (1, 2], which holds ranks 1..3: 1 + (2 - 1) x (2 - 1) / 2
    assert histogram_quantile(0.5, values, buckets=buckets) == pytest.approx(1.5)
    assert histogram_quantile(0.25, values, buckets=buckets) == pytest.approx(1.0)  # first bucket starts at 0
    assert histogram_quantile(0.99, np.array([0.5, 9.0]), buckets=buckets) == 4.0  # +Inf: highest bound
    assert histogram_quantile(0.9, np.array([]), buckets=buckets) is None
    # q = 0: the lower bound of the first bucket holding anything (the first one is empty here)
    assert histogram_quantile(0.0, np.array([1.5, 3.0]), buckets=buckets) == 1.0
    with pytest.raises(ValueError, match=r"quantile 1\.5 is not in"):
        histogram_quantile(1.5, values, buckets=buckets)


def test_the_planner_observes_what_the_routers_series_would_say() -> None:
    fleet = _four_served()
    obs = observe(fleet, start_ms=0.0, end_ms=60_000.0, quantile=0.99)
    assert obs.num_requests == 4
    assert obs.isl == 1500
    assert obs.osl == 20
    assert obs.isl_p90 is not None
    assert 1024 < obs.isl_p90 <= 2048  # read from the 1024-2048 bucket
    uncached = fleet.prompts - fleet.predicted_cached
    assert obs.uncached_quantiles is not None
    assert obs.uncached_max is not None
    assert uncached.max() <= obs.uncached_max <= uncached.max() * 2**0.5  # a half-octave bucket's bound
    assert list(obs.uncached_quantiles) == sorted(obs.uncached_quantiles)
    assert obs.osl_p10 is not None
    assert 16 < obs.osl_p10 <= 32  # every answer has 20 tokens: the (16, 32] bucket
    ttft = fleet.first_ms - fleet.arrival_ms
    assert obs.ttft_ms is not None
    assert obs.ttft_ms >= float(ttft.max())  # the bucket's bound, not the value
    assert obs.queue_depth == 0
    assert obs.inflight == 0
    empty = observe(fleet, start_ms=60_000.0, end_ms=120_000.0, quantile=0.99)
    assert (empty.num_requests, empty.isl, empty.ttft_ms) == (0, None, None)


def test_the_load_observed_is_the_requests_arriving_not_those_ending() -> None:
    """Requests ending in a window lag the load by their service (and while a backlog drains count
    it on top of the load): the planner forecasts what arrives."""
    fleet = _four_served()
    first_end = float(np.nanmin(fleet.finish_ms))
    before = int(np.count_nonzero(fleet.arrival_ms < first_end))
    opening = observe(fleet, start_ms=0.0, end_ms=first_end, quantile=0.99, limits=LIMITS)
    assert before >= 1
    assert opening.num_requests == before
    assert (opening.slo_met, opening.ttft_missed, opening.itl_missed) == (0, 0, 0)  # none ended yet
    assert opening.isl == 1500  # of the requests routed in it
    assert opening.osl is None  # no answer yet
    rest = observe(fleet, start_ms=first_end, end_ms=60_000.0, quantile=0.99, limits=LIMITS)
    assert rest.num_requests == 4 - before
    assert rest.slo_met == 4


def test_the_planner_reads_the_routers_slo_counts_and_its_pulse() -> None:
    """Judged as the router judges them: when each request ends, against the targets; a tight TTFT
    target makes every one late, and the fast loop's pulse counts those that ended in its window."""
    fleet = _four_served()
    obs = observe(fleet, start_ms=0.0, end_ms=60_000.0, quantile=0.99, limits=LIMITS)
    assert (obs.slo_met, obs.ttft_missed, obs.itl_missed, obs.refused) == (4, 0, 0, 0)
    assert obs.attainment == 1.0
    strict = dataclasses.replace(LIMITS, ttft_ms=1e-3)
    late = slo_counts(fleet, start_ms=0.0, end_ms=60_000.0, limits=strict)
    assert (late.met, late.ttft_missed) == (0, 4)
    last_end = float(np.nanmax(fleet.finish_ms))
    signals = pulse(
        fleet, now_ms=last_end + 1.0, window_s=(last_end - float(fleet.finish_ms[0])) / 1000.0, limits=LIMITS
    )
    assert signals.judged == 3  # the first one ended just before the window opened
    assert (signals.queue_depth, signals.router_queue, signals.prefill_tokens) == (0, 0, 0)
    assert signals.serving == 2
    # the arrivals: in the window, whenever they end
    assert pulse(fleet, now_ms=60_000.0, window_s=60.0, limits=LIMITS).arrived == 4
    assert pulse(fleet, now_ms=60_000.0, window_s=1.0, limits=LIMITS).arrived == 0
    assert observe(fleet, start_ms=0.0, end_ms=60_000.0, quantile=0.99).slo_met is None  # no targets


def test_a_replica_serves_only_after_the_startup_delay() -> None:
    fleet = Fleet(_requests([0.0]), EXACT, engines=1)
    replicas = Replicas(fleet, initial=1)
    replicas.apply(3, now_ms=10_000.0, startup_delay_s=120.0)
    assert (replicas.held(), replicas.serving(), len(fleet.engines)) == (3, 1, 1)
    assert replicas.next_ready_ms() == 130_000.0
    fleet.run_until(129_999.0)
    replicas.start_ready(129_999.0)
    assert replicas.serving() == 1
    fleet.run_until(130_000.0)
    replicas.start_ready(130_000.0)
    assert (replicas.serving(), len(fleet.engines), len(fleet.router.workers)) == (3, 3, 3)
    # GPUs were held from the decision on, starting time included
    assert _held_s(replicas, end_ms=130_000.0) == pytest.approx(130.0 + 2 * 120.0)
    # scaling down cancels a replica still starting before it drains a serving one
    replicas.apply(5, now_ms=130_000.0, startup_delay_s=60.0)
    replicas.apply(4, now_ms=131_000.0, startup_delay_s=60.0)
    assert (replicas.held(), replicas.serving()) == (4, 3)


def test_a_removed_replica_drains_before_its_gpus_are_released() -> None:
    trace = _requests([0.0, 0.1, 5.0], osl=400)
    fleet = Fleet(trace, EXACT, engines=2)
    replicas = Replicas(fleet, initial=2)
    fleet.arrive(0)
    fleet.run_until(100.0)
    fleet.arrive(1)
    engine_of = {}
    for i in (0, 1):
        route = fleet.router.route_of(str(i))
        assert route is not None
        engine_of[i] = int(route.worker_id.removeprefix("worker-"))
    assert set(engine_of.values()) == {0, 1}  # one request on each engine
    on_1 = next(i for i, engine in engine_of.items() if engine == 1)
    fleet.run_until(1000.0)
    replicas.apply(1, now_ms=1000.0, startup_delay_s=0.0)  # drains the newest: engine 1
    assert fleet.router.workers["worker-1"].draining  # no new requests, its load still counted
    assert fleet.router.in_flight("worker-1") == 1
    assert 1 in fleet.draining
    assert replicas.held() == 1
    fleet.run_until(5000.0)
    fleet.arrive(2)  # only engine 0 takes new requests now
    fleet.run()
    replicas.settle()
    assert fleet.engines[1].requests_finished_total == 1  # engine 0 took the late request
    assert fleet.engines[0].requests_finished_total == 2
    finished_on_1 = fleet.finish_ms[on_1]
    assert not np.isnan(finished_on_1)  # the drained engine finished what it had
    assert fleet.retired_ms[1] == finished_on_1 > 1000.0  # and released its GPUs only then
    assert "worker-1" not in fleet.router.workers  # then the router forgot it
    seconds = _held_s(replicas, end_ms=60_000.0)
    assert seconds == pytest.approx(60.0 + finished_on_1 / 1000.0)


def test_arrivals_follow_the_recorded_rate_and_shapes_repeat_with_fresh_ids() -> None:
    observations = [
        Observation(timestamp=100.0 + 600.0 * i, duration_s=600.0, num_requests=n, isl=1.0, osl=1.0)
        for i, n in enumerate((600.0, 3000.0, 600.0))
    ]
    times = arrival_times_s(observations, seed=1)
    assert np.array_equal(times, arrival_times_s(observations, seed=1))
    counts = np.histogram(times, bins=[0, 600, 1200, 1800])[0]
    # a ramp between the interval midpoints, not a step: the middle interval lends to its neighbours
    # (900, 2400, 900 expected; the total is kept)
    assert 700 < counts[0] < 1300
    assert 2000 < counts[1] < 2900
    assert 700 < counts[2] < 1300
    assert len(times) == pytest.approx(4200, rel=0.05)
    shapes = _requests([0.0, 1.0], isl=600)
    picked = shapes_in_order(shapes, 5)
    assert [r.hash_ids[0] for r in picked] == [0, 100, 102, 202, 204]  # ids 0..101, each pass 102 higher
    with pytest.raises(ValueError, match="at most 100 prompt tokens"):
        shapes_in_order(shapes, 1, max_input_length=100)
    trace = synthesize(observations, shapes, seed=1, scale=0.1)
    assert len(trace) == pytest.approx(420, rel=0.15)


def test_the_planner_scales_the_fleet_with_the_load_and_a_static_fleet_does_not() -> None:
    # 2 req/s for 10 minutes, then 12 req/s: one engine cannot hold it
    times = list(np.arange(0.0, 600.0, 0.5)) + list(np.arange(600.0, 1200.0, 1 / 12))
    trace = _requests([float(t) for t in times], isl=6000, osl=100)
    planner = PlannerConfig(predictor="constant", startup_delay_s=120.0)
    settings = TwinSettings(fleet=EXACT, limits=LIMITS, planner=planner, interval_s=60.0)
    report = run_twin(trace, settings)
    assert report.peak_replicas > 1
    grown = [row for row in report.intervals if row.held > row.serving]
    assert grown  # replicas held while starting
    first = grown[0]
    later = [row for row in report.intervals if row.start_s >= first.start_s + 120.0]
    assert later[0].serving > first.serving  # serving once the start-up delay has passed
    static = run_twin(trace, TwinSettings(fleet=EXACT, limits=LIMITS, planner=None, interval_s=60.0))
    assert (static.peak_replicas, static.scaling_events) == (1, 0)
    assert static.gpu_hours == pytest.approx(1200.0 / 3600.0, rel=0.01)
    increases = [change for change in report.changes if change.after > change.before]
    assert set(report.scale_ups) == {"forecast", "backlog", "burn"}
    assert sum(report.scale_ups.values()) == len(increases) > 0  # each increase has one trigger
    assert static.scale_ups == {}
    assert report.slo_attainment > static.slo_attainment
    assert report.gpu_hours > static.gpu_hours
    assert report.as_json() == run_twin(trace, settings).as_json()  # deterministic


def test_bench_planner_cli(tmp_path: Path) -> None:
    recording = tmp_path / "load.jsonl"
    observations = [
        Observation(timestamp=60.0 * i, duration_s=60.0, num_requests=n, isl=2000.0, osl=50.0)
        for i, n in enumerate((60.0, 120.0, 240.0, 120.0))
    ]
    with recording.open("w") as handle:
        write_metrics_jsonl(observations, handle)
    shapes = tmp_path / "shapes.jsonl"
    shapes.write_text(
        "".join(
            json.dumps(
                {"timestamp": i, "input_length": 1200, "output_length": 30, "hash_ids": [0, 1, 100 + i]}
            )
            + "\n"
            for i in range(50)
        )
    )
    runner = CliRunner()
    args = [
        "planner",
        "--metrics",
        str(recording),
        "--shapes",
        str(shapes),
        "--ttft-ms",
        "1000",
        "--itl-ms",
        "50",
    ]
    planner = [*args, "--predictor", "constant", "--startup-delay", "60"]
    result = runner.invoke(bench, [*planner, "--intervals", "--jobs", "1"])
    assert result.exit_code == 0, result.output
    assert "planner (constant), start-up delay 60 s" in result.stdout
    assert "SLO (TTFT <= 1000 ms and ITL <= 50 ms)" in result.stdout
    assert "scale-ups by trigger: forecast " in result.stdout
    assert "Static fleets on the same arrivals" in result.stdout
    framed = runner.invoke(bench, [*planner, "-o", "json", "--jobs", "1"])
    document = json.loads(framed.stdout)
    frontier = document["frontier"]
    sizes = [point["replicas"] for point in frontier["static"]]
    assert sizes == list(range(sizes[0], sizes[-1] + 1))  # contiguous sizes
    # from a size below both the goal and the planner's attainment (or 1) to one above both
    first, last = frontier["static"][0], frontier["static"][-1]
    bar_low = min(0.99, document["slo_attainment"])
    assert first["replicas"] == 1 or first["slo_attainment"] < bar_low
    best = max(point["slo_attainment"] for point in frontier["static"])
    assert (
        last["slo_attainment"] >= max(0.99, document["slo_attainment"])
        or last["replicas"] == 16
        or last["slo_attainment"] < best  # larger fleets stopped helping
    )
    if frontier["ratio_at_equal_attainment"] is not None:
        static_cost = frontier["static_gpu_hours_at_equal_attainment"]
        assert frontier["ratio_at_equal_attainment"] == pytest.approx(document["gpu_hours"] / static_cost)
    for key in ("slo_attainment", "gpu_hours", "mean_replicas", "peak_replicas", "flaps"):
        assert key in document
    static = runner.invoke(bench, [*args, "--static", "2", "-o", "json"])
    assert static.exit_code == 0, static.output
    report = json.loads(static.stdout)
    assert report["predictor"] is None
    assert report["gpu_hours"] == pytest.approx(2 * 240 / 3600)
    split = runner.invoke(bench, [*args, "--disaggregated", "--static", "1,2", "-o", "json"])
    assert split.exit_code == 0, split.output
    pools = json.loads(split.stdout)["pools"]
    assert {role: pool["mean_replicas"] for role, pool in pools.items()} == {"prefill": 1.0, "decode": 2.0}
    # each interval says which pool served it, and the table reads prefill+decode
    assert {row["pools"]["decode"] for row in json.loads(split.stdout)["intervals"]} == {2}
    table = runner.invoke(bench, [*args, "--disaggregated", "--static", "1,2", "--intervals"])
    assert table.exit_code == 0, table.output
    assert any(" 1+2 " in line for line in table.stdout.splitlines()), table.stdout
    for bad, message, code in (
        ([], "give exactly one of --trace FILE, --metrics FILE (with --shapes FILE) or --load NAME", 2),
        ([*args[1:], "--static", "2,3"], "--static '2,3': expected N (replicas, >= 1)", 2),
        (
            ["--load", "burst-4h", "--traces", str(tmp_path), *args[5:]],
            f"reads {tmp_path / 'mooncake_fast25_conversation'}",
            1,
        ),
        (["--metrics", str(recording)], "--metrics needs --shapes FILE", 2),
        (["--trace", str(shapes), "--hours", "1"], "--hours slices a --load or --metrics, not a --trace", 2),
        ([*args[1:], "--predictor", "oracle"], "unknown predictor 'oracle'", 2),
        ([*args[1:], "--warmup", "1000"], "covers the whole load", 1),  # given the recording's length
    ):
        failed = runner.invoke(bench, ["planner", *bad])
        assert failed.exit_code == code, failed.output
        assert message in failed.stderr


def test_a_disaggregated_fleet_prefills_on_one_pool_and_decodes_on_the_other() -> None:
    trace = _requests([0.0, 0.2, 0.4, 0.6], isl=6000, osl=30)
    fleet = Fleet(trace, EXACT, engines={EngineRole.PREFILL: 1, EngineRole.DECODE: 1})
    for i in range(len(trace)):
        fleet.run_until(float(fleet.arrival_ms[i]))
        fleet.arrive(i)
    fleet.run()
    prefill, decode = fleet.engines
    assert fleet.roles == [EngineRole.PREFILL, EngineRole.DECODE]
    # the prefill engine computed every prompt and one token each; the decode engine the rest
    assert prefill.requests_finished_total == decode.requests_finished_total == 4
    assert prefill.prompt_tokens_total == decode.prompt_tokens_total == 4 * 6000
    assert fleet.outputs.tolist() == [30.0] * 4
    # the client's first token comes from the decode engine after the KV transfer
    transfer_ms = (
        6000 * decode.config.kv_bytes_per_token / (decode.config.kv_transfer_bandwidth_gbps * 1e9) * 1e3
    )
    ttft = fleet.first_ms - fleet.arrival_ms
    assert float(ttft.min()) > transfer_ms
    assert not fleet.router.workers[prefill.worker_id].draining


def test_the_planner_sizes_both_pools_of_a_disaggregated_deployment() -> None:
    # 1 req/s, then 12 req/s of 12000-token prompts: one prefill engine cannot keep up
    times = list(np.arange(0.0, 600.0, 1.0)) + list(np.arange(600.0, 1200.0, 1 / 12))
    trace = _requests([float(t) for t in times], isl=12000, osl=100)
    planner = PlannerConfig(predictor="constant", startup_delay_s=60.0)
    report = run_twin(
        trace, TwinSettings(fleet=EXACT, limits=DISAGGREGATED, planner=planner, interval_s=60.0)
    )
    assert set(report.pools) == {Role.PREFILL, Role.DECODE}
    assert report.pools[Role.PREFILL].peak_replicas > 1  # the prefill pool grew with the load
    # the JSON keeps the total serving count beside the pools' (scripts read it)
    assert all(row.as_json()["serving"] == sum(row.pools.values()) <= row.held for row in report.intervals)
    assert max(row.pools["prefill"] for row in report.intervals) > 1, "each interval names its pools"
    assert {change.role for change in report.changes} >= {"prefill"}
    # GPU-hours per pool at its GPUs per replica; the total is their sum
    decode = report.pools[Role.DECODE]
    assert decode.gpu_hours == pytest.approx(decode.mean_replicas * 2 * report.window_h)
    assert report.gpu_hours == pytest.approx(sum(pool.gpu_hours for pool in report.pools.values()))
    static = run_twin(
        trace,
        TwinSettings(
            fleet=EXACT, limits=DISAGGREGATED, planner=None, initial={Role.PREFILL: 1, Role.DECODE: 1}
        ),
    )
    assert static.gpu_hours == pytest.approx(3 * 1200.0 / 3600.0, rel=0.01)
    assert report.slo_attainment > static.slo_attainment


def test_the_twins_planner_sizes_decode_for_its_routers_busy_fraction() -> None:
    """A router that stops sending to a decode worker early (its charges past 3 % of the cache)
    needs more decode engines for the same load, and the twin's planner knows its router."""
    trace = _requests([float(t) for t in np.arange(0.0, 900.0, 1 / 4)], isl=6000, osl=100)
    planner = PlannerConfig(predictor="constant", startup_delay_s=60.0)

    def decode_peak(fraction: float) -> int:
        fleet = dataclasses.replace(EXACT, thresholds=Thresholds(busy_kv_fraction=fraction))
        settings = TwinSettings(fleet=fleet, limits=DISAGGREGATED, planner=planner, interval_s=60.0)
        report = run_twin(trace, settings)
        return report.pools[Role.DECODE].peak_replicas

    assert decode_peak(0.03) > decode_peak(0.95) == 1
