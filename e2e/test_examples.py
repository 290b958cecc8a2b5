"""Every InferenceDeployment under examples/ is valid (``copse api validate``), and the operator
reconciles it on the local control plane: all its groups placed, and the router's config, as the
operator writes it into the router's ConfigMap, accepted by the router's own loader (what
``copse router run --config`` does first), so its router starts.

The placement examples (the design documents' seed manifest and the shapes ``copse placement
plan`` and ``copse demo`` use) name no tokenizer: their router refuses to start on a real engine,
and the operator says so in the KVRouting condition; the test holds them to exactly that."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e.operator_harness import Operator, model_cache, status, wait_gpus_released, wait_until

from copse.api import load_deployment
from copse.cluster import Kubectl
from copse.operator import names
from copse.router.config import ConfigError, parse_config

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
#: Placement inputs, not deployments: no spec.router.tokenizer, so a trtllm router refuses to start.
PLACEMENT_ONLY = {
    "seed-inferencedeployment.yaml",
    "deployment-aggregated.yaml",
    "deployment-disaggregated.yaml",
    "deployment-tp64.yaml",
}


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if isinstance(doc, dict)]


def _deployments() -> list[Path]:
    return sorted(
        path
        for path in EXAMPLES.rglob("*.yaml")
        if any(doc.get("kind") == "InferenceDeployment" for doc in _documents(path))
    )


DEPLOYMENTS = _deployments()
DEPLOYABLE = [path for path in DEPLOYMENTS if path.name not in PLACEMENT_ONLY]


def _id(path: Path) -> str:
    return str(path.relative_to(EXAMPLES))


def test_the_examples_are_there() -> None:
    names_ = {path.name for path in DEPLOYMENTS}
    assert names_ >= PLACEMENT_ONLY
    for wanted in (
        "llama-3.1-8b-trtllm.yaml",
        "llama-3.3-70b-disagg-trtllm.yaml",
        "deployment-deepseek-v3-wide-ep.yaml",
        "mock-gpu-less.yaml",
    ):
        assert wanted in names_


def test_copse_api_validate_accepts_every_example() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "copse.cli", "api", "validate", *map(str, DEPLOYMENTS)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(": ok (") == len(DEPLOYMENTS)


def _condition(kubectl: Kubectl, name: str, namespace: str, kind: str) -> dict[str, Any]:
    conditions = status(kubectl, name, namespace).get("conditions", [])
    return next((c for c in conditions if c["type"] == kind), {})


def _router_config(kubectl: Kubectl, name: str, namespace: str) -> dict[str, Any]:
    config_map = kubectl.get(f"configmap/{names.router_name(name)}", namespace=namespace)
    config: dict[str, Any] = yaml.safe_load(config_map["data"]["router.yaml"])
    return config


@pytest.mark.fills_cluster
@pytest.mark.parametrize("path", DEPLOYABLE, ids=_id)
def test_a_deployable_example_is_placed_and_its_router_config_loads(
    path: Path, kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    deployment = load_deployment(path)
    name = deployment.metadata.name
    wait_gpus_released(kubectl, operator=operator)
    with model_cache(kubectl, namespace):
        kubectl.apply(path, namespace=namespace)
        wait_until(
            f"{name}'s groups placed",
            lambda: _condition(kubectl, name, namespace, "Placed").get("status") == "True",
            operator=operator,
            timeout=180,
        )
    routing = _condition(kubectl, name, namespace, "KVRouting")
    assert (routing["status"], routing["reason"]) == ("True", "Supported"), routing
    config = parse_config(_router_config(kubectl, name, namespace), source=str(path))
    assert config.model == deployment.spec.model.name
    if deployment.spec.engine.backend.value == "trtllm":
        assert config.tokenizer is not None
        assert config.kv_capacity_tokens == deployment.spec.router.kv_capacity_tokens
    if deployment.spec.router.tokenizer is not None and deployment.spec.router.tokenizer.volume:
        router = kubectl.get(f"deployment/{names.router_name(name)}", namespace=namespace)
        volumes = router["spec"]["template"]["spec"]["volumes"]
        assert {"name": "tokenizer", **deployment.spec.router.tokenizer.volume} in volumes


@pytest.mark.parametrize("path", sorted(EXAMPLES / name for name in PLACEMENT_ONLY), ids=_id)
def test_a_placement_example_reports_the_router_it_cannot_start(
    path: Path, kubectl: Kubectl, namespace: str, operator: Operator
) -> None:
    name = load_deployment(path).metadata.name
    kubectl.apply(path, namespace=namespace)
    wait_until(
        f"{name}'s KVRouting condition",
        lambda: bool(_condition(kubectl, name, namespace, "KVRouting")),
        operator=operator,
    )
    routing = _condition(kubectl, name, namespace, "KVRouting")
    assert (routing["status"], routing["reason"]) == ("False", "TokenizerMissing"), routing
    with pytest.raises(ConfigError, match="tokenizer: required with engine: trtllm"):
        parse_config(_router_config(kubectl, name, namespace), source=str(path))
