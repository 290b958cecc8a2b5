"""The examples' router config, as the operator renders it, is accepted by the router's own loader
(e2e/test_examples.py does the same through the API server and a running operator)."""

from __future__ import annotations

from pathlib import Path

import pytest

from copse.api import InferenceDeployment, parse_deployment
from copse.api.manifest import read_documents
from copse.operator import children
from copse.router.config import ConfigError, parse_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PLACEMENT_ONLY = {
    "seed-inferencedeployment.yaml",
    "deployment-aggregated.yaml",
    "deployment-disaggregated.yaml",
    "deployment-tp64.yaml",
}
DEPLOYMENTS = sorted(p for p in EXAMPLES.rglob("*.yaml") if "kind: InferenceDeployment" in p.read_text())


def _applied(path: Path) -> InferenceDeployment:
    """The example as the operator reads it once applied: in a namespace."""
    [body] = [doc for doc in read_documents(path) if doc.get("kind") == "InferenceDeployment"]
    body["metadata"]["namespace"] = "serving"
    return parse_deployment(body, source=str(path))


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_the_router_of_every_deployable_example_starts(path: Path) -> None:
    deployment = _applied(path)
    config = children.router_config(deployment)
    if path.name in PLACEMENT_ONLY:
        reasons = [issue.reason for issue in children.routing_issues(deployment)]
        assert reasons == ["TokenizerMissing", "KVCapacityMissing"]
        with pytest.raises(ConfigError, match="tokenizer: required with engine: trtllm"):
            parse_config(config, source=str(path))
        return
    assert children.routing_issues(deployment) == []
    parsed = parse_config(config, source=str(path))
    assert parsed.model == deployment.spec.model.name
