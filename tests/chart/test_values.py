"""The chart's values against its schema, its CRDs against crds/, and the image it points at,
checked without helm (e2e/test_chart.py renders and installs it with helm)."""

from __future__ import annotations

import copy
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from copse.planner.config import PlannerConfig

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "copse"


def load_yaml(path: Path) -> dict[str, Any]:
    loaded = yaml.safe_load(path.read_text())
    assert isinstance(loaded, dict), f"{path} is not a mapping"
    return loaded


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Values the way helm coalesces a -f file over values.yaml (maps merge, the rest replaces)."""
    result = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


DEFAULTS = load_yaml(CHART / "values.yaml")
ALL_OPTIONAL = merged(DEFAULTS, load_yaml(CHART / "ci" / "all-optional-values.yaml"))
SCHEMA = yaml.safe_load((CHART / "values.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def errors(values: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(values)]


def test_schema_is_a_valid_draft_2020_12_schema() -> None:
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


@pytest.mark.parametrize("values", [DEFAULTS, ALL_OPTIONAL], ids=["defaults", "all-optional"])
def test_values_files_are_valid(values: dict[str, Any]) -> None:
    assert errors(values) == []


def test_all_optional_values_switch_every_optional_part_on() -> None:
    switches = {
        "nats": ALL_OPTIONAL["nats"]["enabled"],
        "planner": ALL_OPTIONAL["planner"]["enabled"],
        "serviceMonitor": ALL_OPTIONAL["metrics"]["serviceMonitor"]["enabled"],
        "podMonitor": ALL_OPTIONAL["metrics"]["podMonitor"]["enabled"],
        "grafanaDashboards": ALL_OPTIONAL["grafanaDashboards"]["enabled"],
    }
    assert all(switches.values()), switches
    defaults = [
        DEFAULTS["nats"]["enabled"],
        DEFAULTS["planner"]["enabled"],
        DEFAULTS["metrics"]["serviceMonitor"]["enabled"],
        DEFAULTS["metrics"]["podMonitor"]["enabled"],
        DEFAULTS["grafanaDashboards"]["enabled"],
    ]
    assert not any(defaults), "optional parts are off by default"


def with_value(path: str, value: Any) -> dict[str, Any]:
    values = copy.deepcopy(DEFAULTS)
    *parents, leaf = path.split(".")
    node = values
    for key in parents:
        node = node[key]
    node[leaf] = value
    return values


@pytest.mark.parametrize(
    ("path", "value", "complaint"),
    [
        ("replicaCount", 2, "Additional properties"),
        ("nats.enable", True, "Additional properties"),
        ("nats.enabled", "yes", "is not of type 'boolean'"),
        ("logging.format", "xml", "is not one of"),
        ("image.pullPolicy", "Sometimes", "is not one of"),
        ("operator.metricsPort", 0, "less than the minimum"),
        ("operator.metricsPort", 70000, "greater than the maximum"),
        ("operator.healthPort", 0, "less than the minimum"),
        ("operator.watchNamespaces", ["Not_A_Namespace"], "does not match"),
        ("operator.watchNamespaces", ["a", "a"], "non-unique"),
        ("metrics.serviceMonitor.interval", "30 seconds", "does not match"),
        ("planner.config", {"metrics_port": 1}, "should not be valid"),
        ("planner.enabled", True, "'' should be non-empty"),
        ("planner.watchNamespaces", ["Inference"], "does not match"),
        ("planner.prometheusUrl", "prometheus:9090", "is not valid under any of the given schemas"),
        ("planner.profile", {"configMap": "", "key": "../etc/passwd"}, "does not match"),
        ("operator.tolerations", [{"operator": "Maybe"}], "is not one of"),
        ("operator.resources", {"limit": {"cpu": 1}}, "Additional properties"),
        ("fullnameOverride", "Copse", "does not match"),
        ("grafanaDashboards.namespace", "Monitoring", "is not valid under any of the given schemas"),
    ],
)
def test_schema_rejects_what_would_break_the_release(path: str, value: Any, complaint: str) -> None:
    found = errors(with_value(path, value))
    assert any(complaint in error for error in found), found


def leaf_paths_of_schema(schema: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted paths of every property the schema names (following local $refs)."""
    if "$ref" in schema:
        schema = SCHEMA["$defs"][schema["$ref"].removeprefix("#/$defs/")]
    paths: set[str] = set()
    for key, child in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        paths.add(path)
        paths |= leaf_paths_of_schema(child, f"{path}.")
    return paths


SCHEMA_PATHS = leaf_paths_of_schema(SCHEMA)
#: Paths whose children the schema names; other maps (labels, resources' quantities, the planner's
#: config) are free-form: their keys belong to the user, not to the chart.
STRUCTURED = {path.rsplit(".", 1)[0] for path in SCHEMA_PATHS if "." in path}


def paths_of_values(values: dict[str, Any], prefix: str = "") -> set[str]:
    paths: set[str] = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        paths.add(path)
        if isinstance(value, dict) and path in STRUCTURED:
            paths |= paths_of_values(value, f"{path}.")
    return paths


def test_every_knob_of_the_schema_has_a_default_in_values_yaml() -> None:
    """values.yaml is the documentation users read: nothing the chart accepts is missing from it."""
    assert SCHEMA_PATHS - paths_of_values(DEFAULTS) == set()


@pytest.mark.parametrize("values", [DEFAULTS, ALL_OPTIONAL], ids=["defaults", "all-optional"])
def test_planner_config_in_values_is_a_valid_planner_config(values: dict[str, Any]) -> None:
    """The chart mounts planner.config (plus where /metrics listens) as the planner's --config file."""
    config = PlannerConfig.model_validate({**values["planner"]["config"], "metrics_host": "0.0.0.0"})
    assert config.metrics_host == "0.0.0.0"


def test_an_enabled_planner_needs_prometheus() -> None:
    """In a pod the planner's default Prometheus (127.0.0.1) is never right: say so at install."""
    values = copy.deepcopy(DEFAULTS)
    values["planner"]["enabled"] = True
    assert errors(values) == ["planner.prometheusUrl: '' should be non-empty"]
    values["planner"]["prometheusUrl"] = "http://prometheus-operated.monitoring:9090"
    assert errors(values) == []


def test_chart_crds_are_the_generated_crds_byte_for_byte() -> None:
    """`make crds` copies crds/ into the chart; nothing else may live there (helm installs it all)."""
    top = {path.relative_to(REPO / "crds"): path.read_bytes() for path in (REPO / "crds").rglob("*")}
    chart = {path.relative_to(CHART / "crds"): path.read_bytes() for path in (CHART / "crds").rglob("*")}
    assert top, "crds/ is empty"
    assert chart == top, "charts/copse/crds drifted from crds/: run `make crds`"


def test_chart_metadata() -> None:
    chart = load_yaml(CHART / "Chart.yaml")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "copse"
    # The image tag defaults to appVersion: it must name a released copse version.
    assert chart["appVersion"] == project["version"]
    assert DEFAULTS["image"]["tag"] == ""


class TestImage:
    dockerfile = (REPO / "Dockerfile").read_text().splitlines()
    ignore = (REPO / ".dockerignore").read_text().split()

    def copied(self) -> set[str]:
        """Sources of the COPY instructions that read the build context."""
        return {
            source.rstrip("/")
            for line in self.dockerfile
            if line.startswith("COPY ") and "--from" not in line
            for source in line.split()[1:-1]
        }

    def test_copies_exist_and_are_in_the_build_context(self) -> None:
        kept = {entry.removeprefix("!").rstrip("/") for entry in self.ignore if entry.startswith("!")}
        for source in self.copied():
            assert (REPO / source).exists(), f"Dockerfile copies {source}, which does not exist"
            assert source in kept, f".dockerignore keeps {source} out of the build context"

    def test_copies_everything_the_wheel_is_built_from(self) -> None:
        pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
        needed = {"pyproject.toml", "setup.py", pyproject["project"]["readme"]}
        needed |= set(pyproject["tool"]["setuptools"]["packages"]["find"]["where"])
        assert needed - self.copied() == set()

    def test_entrypoint_is_the_console_script_and_runs_as_the_charts_user(self) -> None:
        scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
        assert "copse" in scripts
        assert 'ENTRYPOINT ["copse"]' in self.dockerfile
        helpers = (CHART / "templates" / "_helpers.tpl").read_text()
        [chart_uid] = re.findall(r"runAsUser: (\d+)", helpers)
        assert f"USER {chart_uid}:{chart_uid}" in self.dockerfile
        bases = [line.split()[1] for line in self.dockerfile if line.startswith("FROM ")]
        # Built with the compiler of the full image, run on the slim one.
        assert bases == ["python:3.11", "python:3.11-slim"]
