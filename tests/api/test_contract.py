"""The InferenceDeployment contract: the seed manifest, defaults, pools and invalid manifests."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from copse.api import (
    AffinityPolicy,
    AntiAffinityPolicy,
    ManifestError,
    Role,
    load_deployment,
    parse_deployment,
    parse_duration,
    parse_quantity,
)
from copse.cli import main

REPO = Path(__file__).resolve().parents[2]
SEED = REPO / "examples" / "seed-inferencedeployment.yaml"
INVALID = sorted((Path(__file__).parent / "invalid").glob("*.yaml"))


def expectation(path: Path, key: str) -> str:
    for line in path.read_text().splitlines():
        if line.startswith(f"# {key}: "):
            return line.removeprefix(f"# {key}: ")
    raise AssertionError(f"{path} has no '# {key}:' line")


def test_seed_manifest_is_valid_unchanged() -> None:
    deployment = load_deployment(SEED)
    spec = deployment.spec
    assert spec.model.name == "meta-llama/Llama-3-70B"
    assert spec.placement.affinity_policy is AffinityPolicy.SAME_NVSWITCH_DOMAIN
    assert spec.placement.anti_affinity_policy is AntiAffinityPolicy.SPREAD_ACROSS_RACKS
    assert spec.scaling.target_latency.ttft_p99_ms == 500
    assert spec.scaling.target_latency.tbt_p99_ms == 50
    assert spec.scaling.scale_up_trigger.queue_depth == 10
    assert spec.scaling.scale_down_delay_s == 300
    assert spec.cold_start.strategy.value == "modelexpress"
    assert spec.cold_start.source_replica == "any-healthy"
    [pool] = spec.pools()
    assert (pool.role, pool.replicas, pool.gpus_per_group) == (Role.WORKER, 2, 8)


def minimal(**spec: object) -> dict[str, object]:
    return {
        "apiVersion": "copse.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "x"},
        "spec": {"model": {"name": "m", "tensorParallelism": 4}, **spec},
    }


def test_disaggregated_pools_inherit_the_model_shape() -> None:
    deployment = parse_deployment(
        minimal(prefill={"replicas": 2, "tensorParallelism": 2}, decode={"replicas": 3}), source="test"
    )
    prefill, decode = deployment.spec.pools()
    assert (prefill.role, prefill.replicas, prefill.tensor_parallelism) == (Role.PREFILL, 2, 2)
    assert (decode.role, decode.replicas, decode.tensor_parallelism) == (Role.DECODE, 3, 4)
    assert deployment.spec.disaggregated


def test_explicit_replicas_win_over_min_replicas() -> None:
    deployment = parse_deployment(minimal(replicas=5, scaling={"minReplicas": 2}), source="test")
    assert deployment.spec.pools()[0].replicas == 5


def test_dump_uses_the_manifest_spelling() -> None:
    dumped = load_deployment(SEED).spec.model_dump(mode="json", exclude_unset=True)
    assert dumped["scaling"]["targetLatency"] == {"ttft_p99_ms": 500.0, "tbt_p99_ms": 50.0}
    assert dumped["coldStart"]["sourceReplica"] == "any-healthy"


@pytest.mark.parametrize(
    ("text", "seconds"), [("300s", 300), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25), ("2m30s", 150)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5", "five minutes", "1d", "m"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)


@pytest.mark.parametrize("path", INVALID, ids=lambda path: path.stem)
def test_invalid_manifest_names_field_and_value(path: Path) -> None:
    with pytest.raises(ManifestError) as error:
        load_deployment(path)
    message = str(error.value)
    assert message.startswith(f"{path}: invalid InferenceDeployment:")
    assert expectation(path, "cli") in message


def test_wrong_kind_is_named(tmp_path: Path) -> None:
    path = tmp_path / "pod.yaml"
    path.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n")
    with pytest.raises(ManifestError, match="expected exactly one InferenceDeployment, found 0"):
        load_deployment(path)


def test_unreadable_yaml_is_named(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("spec: [unclosed\n")
    with pytest.raises(ManifestError, match=f"{path}: not valid YAML"):
        load_deployment(path)


def test_cli_validate_exit_codes() -> None:
    runner = CliRunner()
    ok = runner.invoke(main, ["api", "validate", str(SEED)])
    assert ok.exit_code == 0, ok.output
    assert "worker 2x(TP8xPP1)" in ok.output
    bad = runner.invoke(main, ["api", "validate", str(SEED), str(INVALID[0])])
    assert bad.exit_code == 1  # invalid input; 2 is a usage error
    assert expectation(INVALID[0], "cli") in bad.output


DEEPSEEK = REPO / "examples" / "deployment-deepseek-v3-wide-ep.yaml"


def test_deepseek_wide_ep_pools_resolve_their_expert_layouts() -> None:
    prefill, decode = load_deployment(DEEPSEEK).spec.pools()
    assert prefill.moe is not None
    assert decode.moe is not None
    # Prefill: DEP8 (EP defaults to the pool's TP), no redundant experts, no load balancer.
    assert (prefill.tensor_parallelism, prefill.moe.expert_parallelism) == (8, 8)
    assert prefill.moe.attention_data_parallel
    assert (prefill.moe.slots, prefill.moe.load_balancer) == (256, False)
    # Decode: DEP32 with one redundant slot per rank and the online load balancer.
    assert (decode.tensor_parallelism, decode.moe.expert_parallelism) == (32, 32)
    assert (decode.moe.slots, decode.moe.layer_updates_per_iter, decode.moe.load_balancer) == (288, 1, True)
    assert (decode.moe.experts_per_token, decode.moe.hidden_size, decode.moe.layers) == (8, 7168, 58)


def test_a_dense_model_has_no_moe_layout() -> None:
    [pool] = load_deployment(SEED).spec.pools()
    assert pool.moe is None


@pytest.mark.parametrize(
    ("moe", "expected"),
    [
        ({"expertParallelism": 2}, 2),  # TEP: moe_tp 2 x moe_ep 2 over TP 4
        ({}, 4),  # wide EP: EP = TP
    ],
)
def test_expert_parallelism_defaults_to_the_pools_tp(moe: dict[str, int], expected: int) -> None:
    shape = {"experts": 64, "expertsPerToken": 4, "hiddenSize": 2048, "layers": 24, **moe}
    spec = minimal()["spec"]
    assert isinstance(spec, dict)
    spec["model"] = {"name": "m", "tensorParallelism": 4, "moe": shape}
    [pool] = parse_deployment(minimal(**spec), source="test").spec.pools()
    assert pool.moe is not None
    assert pool.moe.expert_parallelism == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512Gi", 512 * 2**30), ("16G", 16 * 10**9), ("1073741824", 2**30), ("1.5Ki", 1536), ("2Ti", 2**41)],
)
def test_quantities_are_bytes(text: str, expected: int) -> None:
    assert parse_quantity(text) == expected


def test_kv_cache_offload_defaults_and_sizes() -> None:
    spec = parse_deployment(
        minimal(engine={"kvCacheOffload": {"hostMemory": "256Gi", "disk": "2Ti"}}), source="m"
    ).spec.engine.kv_cache_offload
    assert spec is not None
    assert (spec.host_bytes, spec.disk_bytes) == (256 * 2**30, 2 * 2**40)
    assert (spec.host_bandwidth_gbps, spec.disk_bandwidth_gbps) == (50.0, 7.0)
    assert parse_deployment(minimal(), source="m").spec.engine.kv_cache_offload is None
    with pytest.raises(ValueError, match="is not a quantity"):
        parse_quantity("12 GB")
