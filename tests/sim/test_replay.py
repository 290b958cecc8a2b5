"""Trace loading, token synthesis and the discrete-event replay."""

from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from copse.router.adapters import AdapterRouting
from copse.router.core import Thresholds
from copse.sim.cli import bench
from copse.sim.replay import (
    EngineConfigError,
    EngineSetup,
    Fleet,
    KvEventChannel,
    ReplaySettings,
    RequestClass,
    RouterModel,
    load_engine_setup,
    replay,
)
from copse.sim.trace import TokenSynth, TraceError, TraceRequest, load_trace
from copse.workers.mocker import EngineConfig
from copse.workers.mocker.adapters import AdapterSettings
from copse.workers.perf import PolynomialPerfModel, save_profile
from copse.workers.protocol.kv_events import KvCleared, KvEvent

MOONCAKE = Path(__file__).resolve().parents[2] / "examples/traces/mooncake-conversation-first-20min.jsonl.gz"


def _write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _shared_prefix_trace(n: int) -> list[TraceRequest]:
    """``n`` requests, 1 s apart, all sharing their first three 512-token blocks."""
    return [
        TraceRequest(
            timestamp_ms=1000.0 * i, input_length=1800, output_length=20, hash_ids=(0, 1, 2, 100 + i)
        )
        for i in range(n)
    ]


def test_mooncake_trace_loads_sorted_and_gzip_or_plain(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 50, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]},
        {"timestamp": 10, "input_length": 512, "output_length": 1, "hash_ids": [0]},
    ]
    plain = _write_trace(tmp_path / "t.jsonl", rows)
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, gz):
        trace = load_trace(path)
        assert [r.timestamp_ms for r in trace] == [10.0, 50.0]
        assert trace[1].hash_ids == (0, 1)


def test_load_trace_checks_hash_ids_against_the_trace_block_size(tmp_path: Path) -> None:
    row = {"timestamp": 0, "input_length": 600, "output_length": 0, "hash_ids": [0, 1]}
    path = _write_trace(tmp_path / "t.jsonl", [row])
    assert load_trace(path)[0].output_length == 1  # a request generates at least one token
    with pytest.raises(TraceError, match=r"t\.jsonl:1: 2 hash_ids for input_length 600; with 256 tokens"):
        load_trace(path, trace_block_size=256)


def test_azure_trace_gets_private_blocks(tmp_path: Path) -> None:
    path = tmp_path / "az.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,1000,44\n"
        "2023-11-16 18:15:47.1805900,10,0\n"
    )
    trace = load_trace(path, fmt="azure")
    assert [r.timestamp_ms for r in trace] == pytest.approx([0.0, 500.0])
    assert len(trace[0].hash_ids) == 2
    assert not set(trace[0].hash_ids) & set(trace[1].hash_ids)
    assert trace[1].output_length == 1


def test_token_synth_shares_prefixes_exactly_where_hash_ids_do() -> None:
    synth = TokenSynth(seed=7, trace_block_size=512)
    a = synth.tokens([0, 1, 2], 1500)
    b = synth.tokens([0, 1, 9], 1100)
    assert len(a) == 1500
    assert len(b) == 1100
    assert np.array_equal(a[:1024], b[:1024])
    assert not np.array_equal(a[1024:1100], b[1024:1100])
    assert np.array_equal(TokenSynth(seed=7, trace_block_size=512).tokens([0], 512), a[:512])
    assert not np.array_equal(TokenSynth(seed=8, trace_block_size=512).tokens([0], 512), a[:512])
    assert a.min() >= 256
    assert a.max() < 32000


def test_replay_is_deterministic_and_reuses_shared_prefixes() -> None:
    trace = _shared_prefix_trace(12)
    settings = ReplaySettings(policy="kv", workers=3, seed=3)
    first = replay(trace, settings)
    again = replay(trace, settings)
    assert first.as_json() == again.as_json()
    assert first.requests == 12
    assert first.failed == 0
    # After the first request, the 1536 shared tokens hit on the worker that holds them.
    assert first.cache_hit_rate == pytest.approx(11 * 1536 / (12 * 1800), rel=0.02)
    rr = replay(trace, ReplaySettings(policy="round_robin", workers=3, seed=3))
    assert rr.cache_hit_rate < first.cache_hit_rate  # round robin pays the prefix once per worker
    assert set(first.as_json()) == {
        "policy",
        "workers",
        "requests",
        "ttft_ms",
        "itl_ms",
        "e2e_ms",
        "cache_hit_rate",
        "throughput_tok_s",
    }


def test_replay_refuses_an_engine_block_size_that_splits_trace_blocks(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("block_size: 48\n")
    with pytest.raises(ValueError, match="must divide the trace block size 512"):
        replay(_shared_prefix_trace(1), ReplaySettings(engines=load_engine_setup(config)))


def test_engine_config_errors_name_the_file_and_key(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("block_sise: 32\n")
    with pytest.raises(EngineConfigError, match=r"engine.yaml: unknown key\(s\) block_sise"):
        load_engine_setup(config)
    config.write_text("max_num_seqs: 0\n")
    with pytest.raises(EngineConfigError, match=r"engine\.yaml: max_num_seqs=0 must be at least 1"):
        load_engine_setup(config)
    config.write_text("num_blocks: 1000\nblock_size: 16\n")
    assert load_engine_setup(config).perf.kv_capacity_tokens == 16000


def test_bench_replay_cli_prints_json_and_a_table() -> None:
    runner = CliRunner()
    args = ["replay", "--trace", str(MOONCAKE), "--workers", "2", "--limit", "20", "--speedup", "50"]
    result = runner.invoke(bench, [*args, "-o", "json", "--policy", "least_loaded"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["policy"] == "least_loaded"
    assert report["workers"] == 2
    assert report["requests"] == 20
    assert set(report["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    table = runner.invoke(bench, args)
    assert table.exit_code == 0
    assert "TTFT" in table.stdout
    assert "cache hit rate" in table.stdout


def test_bench_replay_cli_rejects_bad_input_with_exit_1_and_bad_options_with_2(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(bench, ["replay", "--trace", str(tmp_path / "none.jsonl")])
    assert missing.exit_code == 1
    assert "none.jsonl: no such trace file" in missing.stderr
    bad = runner.invoke(bench, ["replay", "--trace", str(MOONCAKE), "--speedup", "0"])
    assert bad.exit_code == 2
    assert "--speedup must be a positive number" in bad.stderr


def test_kv_event_channel_applies_whole_batches_in_order_after_the_lag() -> None:
    applied: list[tuple[int, list[KvEvent]]] = []
    channel = KvEventChannel(lag_ms=50.0, apply=lambda source, events: applied.append((source, events)))
    first = [KvEvent(event_id=1, data=KvCleared()), KvEvent(event_id=2, data=KvCleared())]
    second = [KvEvent(event_id=1, data=KvCleared())]
    channel.publish(at_ms=10.0, source=0, events=first)
    channel.publish(at_ms=30.0, source=1, events=second)
    assert channel.deliver(59.9) == 0
    assert applied == []
    assert channel.deliver(60.0) == 1  # published at 10 ms, here at 60 ms: the whole batch at once
    assert applied == [(0, first)]
    assert len(channel) == 1
    assert channel.deliver(1000.0) == 1
    assert applied == [(0, first), (1, second)]
    with pytest.raises(ValueError, match="non-negative"):
        KvEventChannel(lag_ms=-1.0, apply=lambda source, events: None)


def _follow_up_trace(gap_ms: float) -> list[TraceRequest]:
    """A long request, then one sharing its first three blocks ``gap_ms`` later."""
    return [
        TraceRequest(timestamp_ms=0.0, input_length=1800, output_length=400, hash_ids=(0, 1, 2, 3)),
        TraceRequest(timestamp_ms=gap_ms, input_length=1800, output_length=20, hash_ids=(0, 1, 2, 4)),
    ]


def test_the_router_only_sees_a_cache_once_its_events_arrive() -> None:
    exact = ReplaySettings(workers=2, engine_noise=0.0, router_model=RouterModel(source="exact"))
    # The follow-up arrives 300 ms after the first: its prefix is cached on worker 0 by then.
    heard = replay(_follow_up_trace(300.0), dataclasses.replace(exact, kv_event_lag_ms=0.0))
    late = replay(_follow_up_trace(300.0), dataclasses.replace(exact, kv_event_lag_ms=1000.0))
    assert heard.cache_hit_rate == pytest.approx(1536 / 3600)  # routed to the cache
    assert late.cache_hit_rate == 0.0  # not heard of yet: the idle worker looks best


def test_replays_with_noise_and_a_measured_router_model_are_deterministic() -> None:
    trace = _shared_prefix_trace(20)
    settings = ReplaySettings(workers=3, seed=5, engine_noise=0.2)
    first = replay(trace, settings)
    assert first.as_json() == replay(trace, settings).as_json()
    quiet = replay(trace, dataclasses.replace(settings, engine_noise=0.0))
    assert quiet.ttft_ms != first.ttft_ms
    oracle = replay(trace, dataclasses.replace(settings, router_model=RouterModel(source="exact")))
    assert oracle.requests == first.requests == 20


def test_bench_replay_cli_takes_the_router_model_lag_noise_and_decode_weight(tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["replay", "--trace", str(MOONCAKE), "--workers", "2", "--limit", "20", "--speedup", "50"]
    extra = ["--router-profile", "exact", "--router-prefill-scale", "0.7", "--kv-event-lag-ms", "20"]
    result = runner.invoke(
        bench, [*args, *extra, "--engine-noise", "0.1", "--objective", "ttft", "--decode-weight", "0.1"]
    )
    assert result.exit_code == 0, result.output
    unknown = runner.invoke(bench, [*args, "--objective", "fastest"])
    assert unknown.exit_code == 2
    assert "--objective" in unknown.stderr
    assert "router model exact, prefill x0.7, KV events 20 ms late, engine step noise 0.1" in result.stdout
    profile = tmp_path / "p.npz"
    save_profile(PolynomialPerfModel(), profile, points=8)
    from_file = runner.invoke(bench, [*args, "--router-profile", str(profile)])
    assert from_file.exit_code == 0, from_file.output
    assert "router model given" in from_file.stdout
    missing = runner.invoke(bench, [*args, "--router-profile", str(tmp_path / "none.npz")])
    assert missing.exit_code == 1
    assert "none.npz: no such profile file" in missing.stderr
    for flag, value in (
        ("--kv-event-lag-ms", "-1"),
        ("--router-prefill-scale", "0"),
        ("--engine-noise", "nan"),
    ):
        bad = runner.invoke(bench, [*args, flag, value])
        assert bad.exit_code == 2
        assert flag in bad.stderr


def test_two_router_replicas_share_their_load_in_the_twin() -> None:
    """Each replica routes the requests that reach it and sees the other's in flight (what NATS
    carries between real replicas), until they end."""
    trace = [
        TraceRequest(
            timestamp_ms=0.0, input_length=2000, output_length=50, hash_ids=tuple(range(4 * i, 4 * i + 4))
        )
        for i in range(8)
    ]
    fleet = Fleet(trace, ReplaySettings(workers=2, seed=1), engines=2, replica_of=[i % 2 for i in range(8)])
    assert len(fleet.routers) == 2
    for index in range(len(trace)):
        fleet.arrive(index)
    for router in fleet.routers:
        assert float(router.sequences.requests.sum()) == 8  # its own four and its peer's four
    fleet.run()
    assert not np.isnan(fleet.finish_ms).any()
    for router in fleet.routers:
        assert float(router.sequences.requests.sum()) == 0


def _light_wait_ms(replica_of: Callable[[bool], int] | None) -> tuple[float, Fleet]:
    """Two engines taking one prefill at a time, for 3 s: the heavy tenant sends a request every
    10 ms (backlogged), the light one every 100 ms (under its share); ``replica_of(light)``: the
    replica a request reaches (one router when not given). Returns the light tenant's mean wait
    in the queue, ms."""
    light, heavy = RequestClass(tenant="light"), RequestClass(tenant="heavy")
    kinds: list[RequestClass] = []
    times: list[float] = []
    for t in range(3000):
        for kind, every_ms, offset_ms in ((light, 100, 0), (heavy, 10, 3)):
            if t % every_ms == offset_ms:
                kinds.append(kind)
                times.append(float(t))
    trace = [
        TraceRequest(
            timestamp_ms=t, input_length=2000, output_length=20, hash_ids=tuple(range(4 * i, 4 * i + 4))
        )
        for i, t in enumerate(times)
    ]
    settings = ReplaySettings(workers=2, seed=1, thresholds=Thresholds(busy_prefill_tokens=2000))
    replicas = None if replica_of is None else [replica_of(kind is light) for kind in kinds]
    fleet = Fleet(trace, settings, engines=2, classes=kinds, replica_of=replicas)
    for index in range(len(trace)):
        fleet.run_until(float(fleet.arrival_ms[index]))
        fleet.arrive(index)
    fleet.run()
    assert not np.isnan(fleet.finish_ms).any(), "every request is served"
    is_light = np.array([kind is light for kind in kinds])
    return float((fleet.routed_ms - fleet.arrival_ms)[is_light].mean()), fleet


def test_two_replicas_with_an_80_20_split_serve_the_light_tenant_as_one_router_does() -> None:
    """80 % of the light tenant's requests reach replica 0, 80 % of the heavy tenant's replica 1:
    capacity a finished request frees goes to the request that comes first across both replicas'
    queues (the light tenant's, mostly at replica 0), not to the replica whose request finished
    (mostly replica 1, which would hand it to the heavy tenant)."""
    one, _ = _light_wait_ms(None)
    rng = np.random.default_rng(3)
    two, fleet = _light_wait_ms(lambda light: int(rng.random() >= (0.8 if light else 0.2)))
    assert one > 0.0, "the light tenant waits behind requests in progress"
    # (without sharing their queue heads the two replicas make it wait 65 ms on average, 2.2x the
    # one router's 30 ms; sharing them, as long as one router)
    assert two <= 1.1 * one
    for router in fleet.routers:
        assert router.queued == 0
        assert float(router.sequences.requests.sum()) == 0


def _adapter_loads(*, shared: bool, seed: int) -> int:
    """Adapter loads the engines did for 240 requests through 6 adapters, each reaching one of two
    replicas at random, 6 engines holding 2 adapters at once."""
    rng = np.random.default_rng(seed)
    n = 240
    trace = [
        TraceRequest(
            timestamp_ms=i * 40.0, input_length=1024, output_length=32, hash_ids=(10_000 + i, 20_000 + i)
        )
        for i in range(n)
    ]
    classes = [RequestClass(adapter=f"a{int(k)}") for k in rng.integers(0, 6, size=n)]
    replica_of = rng.integers(0, 2, size=n).tolist()
    engines = EngineSetup(config=EngineConfig(adapters=AdapterSettings(max_loras=2, load_ms=200.0)))
    settings = ReplaySettings(
        workers=6, seed=seed, engines=engines, adapters=AdapterRouting(load_ms=200.0, shared=shared)
    )
    fleet = Fleet(trace, settings, engines=6, classes=classes, replica_of=replica_of)
    for index in range(n):
        fleet.run_until(float(fleet.arrival_ms[index]))
        fleet.arrive(index)
    fleet.run()
    assert fleet.failed == 0
    return sum(engine.adapters.loads_total for engine in fleet.engines)


def test_replicas_sharing_adapter_state_load_adapters_less_often() -> None:
    """Each replica mirrors the adapters its peer's requests load: both keep an adapter where it
    is, where replicas that know only their own requests load it again elsewhere."""
    for seed in (0, 1):
        shared, unshared = _adapter_loads(shared=True, seed=seed), _adapter_loads(shared=False, seed=seed)
        assert shared < unshared, (seed, shared, unshared)
