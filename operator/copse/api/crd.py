"""Render the CRD YAML under ``crds/`` from the pydantic models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kube_custom_resource.registry import CustomResourceRegistry

from copse.api import v1alpha1


class _NoAliasDumper(yaml.SafeDumper):
    """Repeated sub-schemas must be written out, not as ``&id001`` anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _structural(node: Any) -> Any:
    # pydantic writes `additionalProperties: false` for extra="forbid"; a structural
    # schema may not combine it with `properties`, and the API server prunes unknowns anyway.
    # A `default: null` would make the API server store explicit nulls; other defaults stay,
    # so CEL rules see the same values the pydantic models fill in.
    if isinstance(node, dict):
        converted = {
            key: _structural(value)
            for key, value in node.items()
            if not (key == "additionalProperties" and value is False)
            and not (key == "default" and value is None)
        }
        # JSON Schema 2020 writes `exclusiveMinimum: 0`; OpenAPI v3.0 (CRDs) wants
        # `minimum: 0, exclusiveMinimum: true`.
        for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            value = converted.get(exclusive)
            if not isinstance(value, bool) and isinstance(value, int | float):
                converted[bound] = value
                converted[exclusive] = True
        return converted
    if isinstance(node, list):
        return [_structural(item) for item in node]
    return node


def crd_objects() -> list[dict[str, Any]]:
    """Every CRD of copse, as Kubernetes objects."""
    registry = CustomResourceRegistry(v1alpha1.GROUP, ["copse"])
    registry.discover_models(v1alpha1)
    return [_structural(crd.kubernetes_resource(include_defaults=True)) for crd in registry]


def render() -> dict[str, str]:
    """File name -> YAML text, exactly as committed under ``crds/``."""
    rendered = {}
    for crd in crd_objects():
        header = "# Generated from operator/copse/api by `make crds`; do not edit.\n"
        text = yaml.dump(crd, Dumper=_NoAliasDumper, sort_keys=True, width=100)
        rendered[f"{crd['metadata']['name']}.yaml"] = header + text
    return rendered


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written
