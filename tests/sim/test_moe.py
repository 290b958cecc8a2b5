"""The synthetic MoE workload and MoE engines in the replay: reports, expert knowledge, rebalancing."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from copse.sim.cli import bench
from copse.sim.moe import MoeWorkload, generate
from copse.sim.replay import (
    EngineConfigError,
    MoeReport,
    ReplayReport,
    ReplaySettings,
    RouterModel,
    load_engine_setup,
    replay,
)
from copse.sim.trace import load_trace

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "moe"


def test_workload_classes_share_their_system_prompt_and_follow_the_weights() -> None:
    records = generate(MoeWorkload(requests=2000, class_weights=(0.7, 0.3), seed=1))
    first_blocks = {(record["class"], record["hash_ids"][0]) for record in records}
    assert first_blocks == {(0, 1), (1, 5)}, "every request starts with its class's prefix"
    share = sum(record["class"] == 0 for record in records) / len(records)
    assert share == pytest.approx(0.7, abs=0.03)
    for record in records:
        assert -(-record["input_length"] // 512) == len(record["hash_ids"])
    times = [record["timestamp"] for record in records]
    assert times == sorted(times)
    assert len(records) / (times[-1] / 1000) == pytest.approx(20, rel=0.1)
    with pytest.raises(ValueError, match="class weights"):
        MoeWorkload(class_weights=())


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moe") / "w.jsonl"
    result = CliRunner().invoke(
        bench, ["moe-workload", "--out", str(path), "--requests", "300", "--rate", "20"]
    )
    assert result.exit_code == 0, result.output
    return path


def _run(trace: Path, config: str, *, policy: str = "kv", expert_reports: bool = True) -> ReplayReport:
    engines = load_engine_setup(EXAMPLES / f"engine-{config}.yaml")
    settings = ReplaySettings(workers=4, engines=engines, policy=policy, expert_reports=expert_reports)
    report = replay(load_trace(trace), settings)
    assert report.requests == 300
    return report


def _moe(report: ReplayReport) -> MoeReport:
    assert report.moe is not None
    return report.moe


def test_moe_replay_reports_all_to_all_bytes_and_imbalance(trace: Path) -> None:
    static = _moe(_run(trace, "static"))
    # Every computed token crosses 58 layers of DEP32: 8 copies, 31/32 remote, 7168 x 2 x 2 bytes.
    per_token = 8 * 31 / 32 * 7168 * 4 * 58
    assert static.all_to_all_bytes_per_token > per_token, "prompt tokens count too"
    assert static.imbalance > 1.2
    assert static.rebalances == 0
    balanced = _moe(_run(trace, "eplb"))
    assert balanced.rebalances > 0
    assert balanced.imbalance < static.imbalance - 0.1
    assert balanced.moe_share < static.moe_share


def test_kv_expert_uses_the_reports_and_the_ablation_does_without(trace: Path) -> None:
    informed = _run(trace, "static", policy="kv_expert")
    blind = _run(trace, "static", policy="kv_expert", expert_reports=False)
    assert informed.as_json() != blind.as_json(), "the expert reports change the routing"
    assert set(informed.as_json()["moe"]) == {
        "all_to_all_bytes_per_token",
        "imbalance",
        "moe_share",
        "rebalances",
    }


def test_moe_engine_config_errors_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("moe: {experts: 256, expert_parallelism: 7}\n")
    with pytest.raises(EngineConfigError, match="multiple of expert_parallelism"):
        load_engine_setup(path)
    path.write_text("moe: {experts: 256, colour: blue}\n")
    with pytest.raises(EngineConfigError, match="moe: unknown key"):
        load_engine_setup(path)
    setup = load_engine_setup(EXAMPLES / "engine-eplb.yaml")
    assert setup.config.moe is not None
    assert dataclasses.asdict(setup.config.moe)["redundant_experts"] == 32


def test_bench_replay_prints_the_moe_line_and_refuses_live_moe(trace: Path) -> None:
    runner = CliRunner()
    args = [
        "replay",
        "--trace",
        str(trace),
        "--workers",
        "4",
        "--engine-config",
        str(EXAMPLES / "engine-static.yaml"),
    ]
    table = runner.invoke(bench, [*args, "--policy", "kv_expert", "--limit", "60"])
    assert table.exit_code == 0, table.output
    assert "MoE: all-to-all" in table.output
    as_json = runner.invoke(bench, [*args, "--limit", "60", "-o", "json"])
    assert json.loads(as_json.stdout)["moe"]["imbalance"] > 1
    live = runner.invoke(bench, [*args, "--live", "--limit", "5"])
    assert live.exit_code == 2
    assert "virtual clock only" in live.output


def test_kv_expert_gets_the_balanced_step_the_router_model_knows() -> None:
    setup = load_engine_setup(EXAMPLES / "engine-static.yaml")
    config, perf = setup.config, setup.perf
    assert RouterModel(source="exact").balanced(config=config, perf=perf) is perf, "the oracle is balanced"
    measured = RouterModel().resolve(config=config, perf=perf)
    balanced = RouterModel().balanced(config=config, perf=perf)
    assert balanced is not None
    point = {"active_kv_tokens": 8000.0, "context_length": 2000.0}
    assert balanced.decode_itl_ms(**point) < measured.decode_itl_ms(**point), "less the MoE terms"
    assert balanced.prefill_curve_ms(4096.0) == measured.prefill_curve_ms(4096.0)
    # A given profile: what its steps hold is not known (kv_expert adds only the deviation).
    assert RouterModel(source=perf).balanced(config=config, perf=perf) is None
    dense = dataclasses.replace(config, moe=None)
    assert RouterModel(source="exact").balanced(config=dense, perf=perf) is None
