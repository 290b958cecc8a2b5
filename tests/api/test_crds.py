"""The committed CRDs match the models, are structural, and carry what kubectl and kopf need."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from copse.api import crd

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("directory", ["crds", "charts/copse/crds"])
def test_committed_crds_match_the_models(directory: str) -> None:
    rendered = crd.render()
    committed = {path.name: path.read_text() for path in (REPO / directory).glob("*.yaml")}
    assert committed == rendered, f"{directory}/ drifted from operator/copse/api: run `make crds`"


def walk(node: Any, path: str = "") -> list[str]:
    """Paths that break the structural-schema rules (no refs/titles, a type on every node)."""
    problems = []
    if isinstance(node, dict):
        for forbidden in ("$ref", "$defs", "title", "oneOf"):
            if forbidden in node:
                problems.append(f"{path}: has {forbidden}")
        for exclusive in ("exclusiveMinimum", "exclusiveMaximum"):
            if exclusive in node and not isinstance(node[exclusive], bool):
                problems.append(f"{path}: {exclusive} must be a boolean in OpenAPI v3.0")
        if "additionalProperties" in node and "properties" in node:
            problems.append(f"{path}: both properties and additionalProperties")
        untyped_ok = node.get("x-kubernetes-preserve-unknown-fields") or node.get(
            "x-kubernetes-int-or-string"
        )
        if "type" not in node and not untyped_ok:
            problems.append(f"{path}: no type")
        for key, value in node.get("properties", {}).items():
            problems += walk(value, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            problems += walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            problems += walk(node["additionalProperties"], f"{path}{{}}")
    return problems


def test_schema_is_structural() -> None:
    [crd_object] = crd.crd_objects()
    schema = crd_object["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert walk(schema) == []


def test_status_scale_printer_columns_and_cel() -> None:
    [crd_object] = crd.crd_objects()
    version = crd_object["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    columns = {column["name"]: column["jsonPath"] for column in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase"
    assert columns["Ready"] == ".status.ready"
    assert columns["Score"] == ".status.score"
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = [rule["rule"] for rule in spec["x-kubernetes-validations"]]
    assert "has(self.prefill) == has(self.decode)" in rules
    scaling = spec["properties"]["scaling"]
    assert scaling["x-kubernetes-validations"][0]["rule"] == "self.minReplicas <= self.maxReplicas"
    # CEL sees the same defaults the models fill in.
    assert scaling["properties"]["minReplicas"]["default"] == 1
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert status["properties"]["kopf"]["x-kubernetes-preserve-unknown-fields"] is True


def test_yaml_has_no_anchors() -> None:
    for text in crd.render().values():
        assert "&id" not in text
        assert yaml.safe_load(text)["kind"] == "CustomResourceDefinition"
