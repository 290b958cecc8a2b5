"""The Helm chart with the real helm: lint, render, schema enforcement, and install/uninstall on the
cluster of the session (objects are asserted, not processes: kwok nodes run no images)."""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from copse.api import InferenceDeployment, Role, parse_deployment
from copse.cluster import Kubectl, binaries_for
from copse.operator import children
from copse.operator import cli as operator_cli
from copse.operator.children import COPSE_IMAGE, GroupLayout
from copse.planner import cli as planner_cli

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "copse"
ALL_OPTIONAL = CHART / "ci" / "all-optional-values.yaml"
NAMESPACE = "copse-system"
MONITORING_KINDS = {"ServiceMonitor": "servicemonitors", "PodMonitor": "podmonitors"}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
TOLERATE_FAKE_NODES = [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}]

Object = dict[str, Any]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run(
        [str(binaries_for().path("helm")), *args], capture_output=True, text=True, check=False, timeout=300
    )
    if check and completed.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {completed.returncode}:\n{completed.stderr}")
    return completed


def render(*args: str) -> dict[tuple[str, str], Object]:
    """``helm template`` of release ``copse`` in copse-system, by (kind, name); the name is
    ``namespace/name`` for objects in other namespaces than the release's."""
    text = helm("template", "copse", str(CHART), f"--namespace={NAMESPACE}", *args).stdout
    objects = [doc for doc in yaml.safe_load_all(text) if doc]
    rendered = {}
    for obj in objects:
        name, namespace = obj["metadata"]["name"], obj["metadata"].get("namespace", NAMESPACE)
        rendered[(obj["kind"], name if namespace == NAMESPACE else f"{namespace}/{name}")] = obj
    assert len(rendered) == len(objects), "two objects share a kind, namespace and name"
    return rendered


def matches(selector: Object, labels: dict[str, str]) -> bool:
    """Whether a Kubernetes label selector (matchLabels/matchExpressions, or a plain map) selects labels."""
    plain = {k: v for k, v in selector.items() if k not in ("matchLabels", "matchExpressions")}
    wanted = {**plain, **selector.get("matchLabels", {})}
    if any(labels.get(key) != value for key, value in wanted.items()):
        return False
    for expression in selector.get("matchExpressions", []):
        present = expression["key"] in labels
        value = labels.get(expression["key"])
        operator = expression["operator"]
        if operator == "In" and value not in expression["values"]:
            return False
        if operator == "NotIn" and value in expression["values"]:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


def parsed(command: click.Command, args: list[str]) -> dict[str, Any]:
    """The parameters the real CLI parses from a container's arguments after ``<group> <command>``."""
    return dict(command.make_context(command.name or "", args[2:]).params)


def rules_of(role: Object) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every grant of a Role or ClusterRole."""
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def container(deployment: Object) -> Object:
    [only] = deployment["spec"]["template"]["spec"]["containers"]
    return dict(only)


@pytest.mark.parametrize("values", [[], ["-f", str(ALL_OPTIONAL)]], ids=["defaults", "all-optional"])
def test_helm_lint_is_clean(values: list[str]) -> None:
    output = helm("lint", "--strict", str(CHART), *values).stdout
    assert "0 chart(s) failed" in output
    assert "[WARNING]" not in output
    assert "[ERROR]" not in output


def test_defaults_render_the_operator_alone() -> None:
    rendered = render()
    assert {kind for kind, _ in rendered} == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Service",
    }
    operator = rendered[("Deployment", "copse-copse-operator")]
    pod = operator["spec"]["template"]
    main = container(operator)
    # The ServiceAccount e2e/test_operator.py runs the operator as, bound to the least-privilege role.
    assert pod["spec"]["serviceAccountName"] == "copse-copse-operator"
    binding = rendered[("ClusterRoleBinding", "copse-copse-operator")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "copse-copse-operator", "namespace": NAMESPACE}
    ]
    assert main["args"][:2] == ["operator", "run"]
    params = parsed(operator_cli.run, main["args"])
    assert (params["metrics_host"], params["metrics_port"], params["health_port"], params["namespaces"]) == (
        "0.0.0.0",
        9090,
        8080,
        (),
    )
    # The image the operator itself gives routers and mock workers is the chart's default image.
    assert main["image"] == COPSE_IMAGE
    assert main["ports"] == [
        {"name": "metrics", "containerPort": 9090},
        {"name": "health", "containerPort": 8080},
    ]
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert main["readinessProbe"]["httpGet"]["port"] == "metrics"
    assert {e["name"]: e.get("value") for e in main["env"]}["COPSE_LOG_FORMAT"] == "json"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert operator["spec"]["replicas"] == 1
    assert operator["spec"]["strategy"] == {"type": "Recreate"}
    assert matches(operator["spec"]["selector"], pod["metadata"]["labels"])
    service = rendered[("Service", "copse-copse-operator-metrics")]
    assert matches(service["spec"]["selector"], pod["metadata"]["labels"])
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics"}]


def test_the_chart_image_reaches_every_pod_the_operator_creates(monkeypatch: pytest.MonkeyPatch) -> None:
    """helm renders the operator with the chart's image settings in its environment; the operator's
    own CLI reads them, and the pods it renders (router, KV relay, mocked worker) run that image."""
    image = "registry.example.com/mirror/copse"
    rendered = render(
        f"--set=image.repository={image}",
        "--set=image.tag=9.9.9",
        "--set=image.pullPolicy=Always",
        "--set=operator.trtllmImage=registry.example.com/mirror/trtllm:1.2.0",
    )
    main = container(rendered[("Deployment", "copse-copse-operator")])
    assert main["image"] == f"{image}:9.9.9"
    for variable in main["env"]:
        if "value" in variable:
            monkeypatch.setenv(variable["name"], variable["value"])
    params = parsed(operator_cli.run, main["args"])
    settings = operator_cli.reconcile_settings(
        image=params["image"],
        image_pull_policy=params["image_pull_policy"],
        trtllm_image=params["trtllm_image"],
    )
    layout = GroupLayout(role=Role.WORKER, replica=0, pods=(("gpu-a", 8),), domain="d", rack="r", cost=0.0)

    def deployment(**spec: Any) -> InferenceDeployment:
        body = {
            "apiVersion": "copse.dev/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": "llama", "namespace": "serving", "uid": "u"},
            "spec": {"model": {"name": "m", "tensorParallelism": 8}, **spec},
        }
        return parse_deployment(body, source="test")

    trtllm = deployment(router={"natsUrl": "nats://nats:4222"})
    [pod] = children.worker_pods(trtllm, layout, cold_start_source=None, images=settings.images)
    [relay] = [c for c in pod["spec"]["initContainers"] if c["name"] == "kv-relay"]
    [router] = [
        o for o in children.router_objects(trtllm, images=settings.images) if o["kind"] == "Deployment"
    ]
    [mock_pod] = children.worker_pods(
        deployment(engine={"backend": "mock"}), layout, cold_start_source=None, images=settings.images
    )
    copse_containers = [relay, container(router), *mock_pod["spec"]["containers"]]
    assert [(c["image"], c["imagePullPolicy"]) for c in copse_containers] == [
        (f"{image}:9.9.9", "Always")
    ] * 3
    assert [c["image"] for c in pod["spec"]["containers"]] == ["registry.example.com/mirror/trtllm:1.2.0"]


def test_the_prometheus_rule_renders_every_alert_on_bucket_bounds() -> None:
    rule = render("-f", str(ALL_OPTIONAL))[("PrometheusRule", "copse-copse")]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    assert set(alerts) == {
        "CopseSLOTTFTBudgetBurnFast",
        "CopseSLOTTFTBudgetBurnSlow",
        "CopseSLOITLBudgetBurnFast",
        "CopseSLOITLBudgetBurnSlow",
        "CopseRouterShedding",
        "CopseRouterNoHealthyWorker",
        "CopseKVEventGaps",
        "CopseGangRestarts",
        "CopsePlacementInfeasible",
    }
    # ci/all-optional-values.yaml: objective 0.995, TTFT 2.5 s, ITL 0.04 s.
    fast = alerts["CopseSLOTTFTBudgetBurnFast"]["expr"]
    assert 'copse_router_time_to_first_token_seconds_bucket{le="2.5"}[5m]' in fast
    assert "[1h]" in fast
    assert "(14.4 * (1 - 0.995))" in fast
    assert (
        'copse_router_inter_token_latency_seconds_bucket{le="0.04"}[6h]'
        in alerts["CopseSLOITLBudgetBurnSlow"]["expr"]
    )
    assert "{{ $labels.deployment }}" in alerts["CopseRouterShedding"]["annotations"]["summary"]
    assert not any(kind == "PrometheusRule" for kind, _ in render()), "off by default"


def test_every_optional_part_renders() -> None:
    rendered = render("-f", str(ALL_OPTIONAL))
    options = yaml.safe_load(ALL_OPTIONAL.read_text())

    operator = rendered[("Deployment", "copse-copse-operator")]
    assert parsed(operator_cli.run, container(operator)["args"])["namespaces"] == ("inference", "staging")
    assert operator["spec"]["template"]["spec"]["tolerations"] == options["operator"]["tolerations"]
    assert operator["spec"]["template"]["spec"]["imagePullSecrets"] == options["imagePullSecrets"]

    # Watched namespaces: the operator writes only there (a Role each); reads stay cluster-wide.
    operator_roles = {
        obj["metadata"]["namespace"]: obj
        for (kind, _), obj in rendered.items()
        if kind == "Role" and obj["metadata"]["name"] == "copse-copse-operator"
    }
    assert set(operator_roles) == set(options["operator"]["watchNamespaces"])
    cluster_role = rules_of(rendered[("ClusterRole", "copse-copse-operator")])
    assert {verb for group, _, verb in cluster_role if group != "apiextensions.k8s.io"} == {
        "get",
        "list",
        "watch",
    }
    for role in operator_roles.values():
        granted = rules_of(role)
        assert {("", "pods", "create"), ("rbac.authorization.k8s.io", "roles", "create")} <= granted
        assert ("copse.dev", "inferencedeployments/finalizers", "update") in granted
        binding = rendered[("RoleBinding", f"{role['metadata']['namespace']}/copse-copse-operator")]
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "copse-copse-operator", "namespace": NAMESPACE}
        ]
    cluster_wide_operator = rules_of(render()[("ClusterRole", "copse-copse-operator")])
    assert cluster_wide_operator == cluster_role | set().union(
        *(rules_of(r) for r in operator_roles.values())
    )

    nats = rendered[("Deployment", "copse-copse-nats")]
    nats_service = rendered[("Service", "copse-copse-nats")]
    assert matches(nats_service["spec"]["selector"], nats["spec"]["template"]["metadata"]["labels"])
    [client] = nats_service["spec"]["ports"]
    assert client["port"] == 4222
    assert client["targetPort"] in {port["name"] for port in container(nats)["ports"]}
    assert "--jetstream" not in container(nats)["command"]

    # The Inference Extension's InferencePool CRD, for clusters without it; kept on uninstall.
    pool_crd = rendered[("CustomResourceDefinition", "inferencepools.inference.networking.k8s.io")]
    assert pool_crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert [version["name"] for version in pool_crd["spec"]["versions"]] == ["v1"]

    # The planner plans the watched namespaces, allowed to touch only those.
    planner = rendered[("Deployment", "copse-copse-planner")]
    assert planner["spec"]["template"]["spec"]["serviceAccountName"] == "copse-copse-planner"
    args = container(planner)["args"]
    assert args[:2] == ["planner", "run"]
    params = parsed(planner_cli.run, args)
    assert params["name"] is None
    assert params["namespaces"] == tuple(options["planner"]["watchNamespaces"])
    assert params["prometheus"] == options["planner"]["prometheusUrl"]
    assert params["observe_only"] is True
    assert params["metrics_port"] == 9464
    assert str(params["config_path"]) == "/etc/copse/planner/planner.yaml"
    assert params["profile"].name == options["planner"]["profile"]["key"]
    planner_rules = {("copse.dev", "inferencedeployments", verb) for verb in ("get", "list", "patch")}
    planner_rules.add(("", "events", "create"))
    roles = {
        obj["metadata"]["namespace"]: obj
        for (kind, _), obj in rendered.items()
        if kind == "Role" and obj["metadata"]["name"] == "copse-copse-planner"
    }
    assert set(roles) == set(options["planner"]["watchNamespaces"])
    assert all(rules_of(role) == planner_rules for role in roles.values())
    assert not any(kind == "ClusterRole" and "planner" in name for kind, name in rendered)
    cluster_wide = render("--set", "planner.enabled=true", "--set", "planner.prometheusUrl=http://p:9090")
    assert rules_of(cluster_wide[("ClusterRole", "copse-copse-planner")]) == planner_rules
    assert cluster_wide[("ClusterRoleBinding", "copse-copse-planner")]["subjects"] == [
        {"kind": "ServiceAccount", "name": "copse-copse-planner", "namespace": NAMESPACE}
    ]
    config_map = rendered[("ConfigMap", "copse-copse-planner")]
    planner_config = yaml.safe_load(config_map["data"]["planner.yaml"])
    assert planner_config["predictor"] == options["planner"]["config"]["predictor"]
    assert planner_config["metrics_host"] == "0.0.0.0"

    # The ServiceMonitor finds both metrics Services, by a port they have.
    [monitor] = [obj for (kind, _), obj in rendered.items() if kind == "ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    [endpoint] = monitor["spec"]["endpoints"]
    scraped = {
        name
        for (kind, name), obj in rendered.items()
        if kind == "Service" and matches(monitor["spec"]["selector"], obj["metadata"]["labels"])
    }
    assert scraped == {"copse-copse-operator-metrics", "copse-copse-planner-metrics"}
    for name in scraped:
        assert endpoint["port"] in {port["name"] for port in rendered[("Service", name)]["spec"]["ports"]}

    [pod_monitor] = [obj for (kind, _), obj in rendered.items() if kind == "PodMonitor"]
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": ["inference"]}
    worker_leader = {
        "app.kubernetes.io/managed-by": "copse-operator",
        "app.kubernetes.io/component": "worker",
        "copse.dev/leader": "true",
    }
    assert matches(pod_monitor["spec"]["selector"], worker_leader)
    # TensorRT-LLM <= 1.2 names its request metrics without the trtllm_ prefix: the worker endpoint
    # renames them (Prometheus anchors relabel regexes), and leaves 1.3's prefixed names alone.
    [engines] = [e for e in pod_monitor["spec"]["podMetricsEndpoints"] if e["path"] == "/prometheus/metrics"]
    [rename] = engines["metricRelabelings"]
    assert (rename["sourceLabels"], rename["targetLabel"], rename["action"]) == (
        ["__name__"],
        "__name__",
        "replace",
    )

    def relabelled(name: str) -> str:
        match = re.fullmatch(rename["regex"], name)
        return match.expand(rename["replacement"].replace("$1", r"\1")) if match else name

    old_names = [
        "request_success_total",
        "e2e_request_latency_seconds_bucket",
        "time_to_first_token_seconds_sum",
        "time_per_output_token_seconds_count",
        "request_queue_time_seconds_bucket",
        "kv_cache_hit_rate",
        "kv_cache_utilization",
    ]
    assert [relabelled(name) for name in old_names] == [f"trtllm_{name}" for name in old_names]
    fixture = (REPO / "tests" / "fixtures" / "trtllm_prometheus_metrics.txt").read_text()
    current = {sample.name for family in text_string_to_metric_families(fixture) for sample in family.samples}
    assert all(relabelled(name) == name for name in current)

    dashboards = {
        name: obj
        for (kind, name), obj in rendered.items()
        if kind == "ConfigMap" and obj["metadata"]["labels"].get("grafana_dashboard") == "1"
    }
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert len(dashboards) == len(files)
    for path in files:
        [obj] = [obj for obj in dashboards.values() if path.name in obj["data"]]
        assert obj["metadata"]["namespace"] == "monitoring"
        assert json.loads(obj["data"][path.name]) == json.loads(path.read_text())


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("nats.enabled=yes", "nats"),
        ("replicaCount=2", "replicaCount"),
        ("logging.format=xml", "logging"),
    ],
)
def test_helm_enforces_the_values_schema(setting: str, complaint: str) -> None:
    failed = helm("template", "copse", str(CHART), "--set", setting, check=False)
    assert failed.returncode != 0
    assert "values don't meet the specifications of the schema" in failed.stderr
    assert complaint in failed.stderr


@pytest.fixture
def monitoring_crds(kubectl: Kubectl) -> Iterator[None]:
    """ServiceMonitor/PodMonitor kinds: the cluster's own if it has prometheus-operator, else stand-ins
    (schema-less, removed afterwards) so that the chart's monitors can be installed and uninstalled."""
    created = []
    for kind, plural in MONITORING_KINDS.items():
        name = f"{plural}.monitoring.coreos.com"
        if kubectl.run("get", "crd", name, "--ignore-not-found", "-o", "name").stdout.strip():
            continue
        kubectl.apply(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": name, "labels": {"copse.dev/e2e": "chart-stand-in"}},
                "spec": {
                    "group": "monitoring.coreos.com",
                    "names": {"kind": kind, "plural": plural, "listKind": f"{kind}List"},
                    "scope": "Namespaced",
                    "versions": [
                        {
                            "name": "v1",
                            "served": True,
                            "storage": True,
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                }
                            },
                        }
                    ],
                },
            }
        )
        created.append(name)
    try:
        for name in created:
            kubectl.wait_established(f"crd/{name}", timeout=60)
        yield
    finally:
        for name in created:
            kubectl.run("delete", "crd", name, "--ignore-not-found")


def live(kubectl: Kubectl, obj: Object, namespace: str) -> bool:
    scope = [] if obj["kind"] in CLUSTER_SCOPED else [f"--namespace={namespace}"]
    kind = MONITORING_KINDS.get(obj["kind"], obj["kind"])
    found = kubectl.run(
        "get", f"{kind}/{obj['metadata']['name']}", *scope, "--ignore-not-found", "-o", "name"
    ).stdout
    return bool(found.strip())


def test_install_then_uninstall_leaves_only_the_crds(
    kubectl: Kubectl, namespace: str, monitoring_crds: None, tmp_path: Path
) -> None:
    release = f"chart-{uuid.uuid4().hex[:6]}"
    values = tmp_path / "values.yaml"
    fake_nodes = {"tolerations": TOLERATE_FAKE_NODES}
    values.write_text(
        yaml.safe_dump(
            {
                "operator": fake_nodes,
                "nats": {"enabled": True, **fake_nodes},
                "planner": {
                    "enabled": True,
                    "watchNamespaces": [namespace],
                    "prometheusUrl": "http://prometheus-operated.monitoring:9090",
                    **fake_nodes,
                },
                "metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}},
                "grafanaDashboards": {"enabled": True},
            }
        )
    )
    kubeconfig = f"--kubeconfig={kubectl.kubeconfig}"
    scope = [kubeconfig, f"--namespace={namespace}"]
    helm("install", release, str(CHART), *scope, "-f", str(values))
    try:
        manifest = [doc for doc in yaml.safe_load_all(helm("get", "manifest", release, *scope).stdout) if doc]
        kinds = {obj["kind"] for obj in manifest}
        assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"} <= kinds
        assert {"Role", "RoleBinding", "ServiceMonitor", "PodMonitor", "ConfigMap", "Service"} <= kinds
        missing = [
            f"{o['kind']}/{o['metadata']['name']}" for o in manifest if not live(kubectl, o, namespace)
        ]
        assert missing == []
        operator_sa = kubectl.get("serviceaccount", f"{release}-copse-operator", namespace=namespace)
        assert operator_sa["metadata"]["labels"]["app.kubernetes.io/instance"] == release
        binding = kubectl.get("clusterrolebinding", f"{release}-copse-operator")
        assert binding["subjects"][0]["namespace"] == namespace
        # The controllers and the scheduler accept what the chart makes: every Deployment's pod is
        # created, bound to a (fake) node and reported available.
        for obj in manifest:
            if obj["kind"] == "Deployment":
                kubectl.wait(
                    "--for=condition=Available", f"deployment/{obj['metadata']['name']}",
                    namespace=namespace, timeout=120,
                )  # fmt: skip
        # The CRD was already there (the session applied crds/): helm left it alone.
        crd = kubectl.get("crd", "inferencedeployments.copse.dev")
        assert "meta.helm.sh/release-name" not in crd["metadata"].get("annotations", {})
    finally:
        helm("uninstall", release, *scope, "--wait", "--timeout=120s")

    leftovers = [f"{o['kind']}/{o['metadata']['name']}" for o in manifest if live(kubectl, o, namespace)]
    assert leftovers == []
    selector = f"app.kubernetes.io/instance={release}"
    kubectl.wait("--for=delete", "pods", "-l", selector, namespace=namespace, timeout=120)
    assert kubectl.items("clusterroles,clusterrolebindings", "-l", selector) == []
    assert kubectl.items("all,configmaps,serviceaccounts,secrets", "-l", selector, namespace=namespace) == []
    # helm's own record of the release goes too (no --keep-history).
    assert kubectl.items("secrets", "-l", f"owner=helm,name={release}", namespace=namespace) == []
    assert kubectl.get("crd", "inferencedeployments.copse.dev")["metadata"]["name"]
