"""Worker pods, group Services and the router objects the operator creates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import jsonschema
import pytest
import yaml
from aiohttp import web
from pydantic import ValidationError

from copse.api import EngineBackend, InferenceDeployment, Role, load_deployment, parse_deployment
from copse.operator import children, names
from copse.operator.children import GroupLayout
from copse.router.config import RouterConfig
from copse.router.discovery import StaticSource
from copse.router.frontend import RouterService
from copse.router.tokens import MockPromptTokenizer
from copse.workers.cli import _moe_config, kv_relay, mock, worker
from copse.workers.perf import PolynomialPerfModel

from .conftest import make_deployment

REPO = Path(__file__).resolve().parents[2]
ONE_NODE = GroupLayout(role=Role.WORKER, replica=0, pods=(("gpu-a", 8),), domain="d", rack="r", cost=0.0)
TWO_NODES = GroupLayout(
    role=Role.WORKER, replica=1, pods=(("gpu-a", 4), ("gpu-b", 4)), domain="rack1.0", rack="rack1", cost=0.25
)


def test_gang_pods_are_gated_pinned_and_ranked() -> None:
    deployment = make_deployment(replicas=2, coldStart={"strategy": "modelexpress"})
    pods = children.worker_pods(deployment, TWO_NODES, cold_start_source="llama-worker-0")
    assert [pod["metadata"]["name"] for pod in pods] == ["llama-worker-1-0", "llama-worker-1-1"]
    for rank, (pod, node) in enumerate(zip(pods, ["gpu-a", "gpu-b"], strict=True)):
        spec = pod["spec"]
        assert spec["schedulingGates"] == [{"name": names.GANG_GATE}]
        term = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["nodeSelectorTerms"][0]["matchFields"][0]["values"] == [node]
        [container] = spec["containers"]
        assert container["resources"]["limits"][children.GPU_RESOURCE] == "4"
        env = {item["name"]: item.get("value") for item in container["env"]}
        assert env["COPSE_NODE_RANK"] == str(rank)
        assert env["COPSE_WORLD_SIZE"] == "8"
        assert env["COPSE_LEADER_ADDRESS"] == "llama-worker-1-0.llama-worker-1.serving.svc"
        assert env["COPSE_COLD_START_STRATEGY"] == "modelexpress"
        assert env["COPSE_COLD_START_SOURCE"] == "llama-worker-0"
        # ModelExpress's client: the server the operator runs (the source spans pods, so no pointer)
        assert env["MODEL_EXPRESS_URL"] == env["MX_SERVER_ADDRESS"] == "llama-modelexpress.serving.svc:8001"
        assert "MX_METADATA_BACKEND" not in env
        assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert pod["metadata"]["labels"][names.LABEL_LEADER] == str(rank == 0).lower()
        assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert spec["subdomain"] == "llama-worker-1"
        assert pod["metadata"]["labels"][names.LABEL_DOMAIN] == "rack1.0"
    leader, follower = (pod["spec"]["containers"][0] for pod in pods)
    # Multi-node TP is one MPI world launched by the leader across both pods
    # (tests/operator/test_multinode.py runs these scripts).
    assert leader["command"][:2] == follower["command"][:2] == ["/bin/sh", "-c"]
    launched = leader["command"][4:]
    assert launched[:2] == ["trtllm-llmapi-launch", "trtllm-serve"]
    assert launched[launched.index("--tp_size") + 1] == "8"
    env = {item["name"]: item["value"] for item in leader["env"] if "value" in item}
    assert env["COPSE_MPI_HOSTS"] == (
        "llama-worker-1-0.llama-worker-1.serving.svc:4,llama-worker-1-1.llama-worker-1.serving.svc:4"
    )
    assert 'exec "$sshd" -D' in follower["command"][2]


def test_single_node_group_runs_trtllm_serve_with_its_role_config() -> None:
    deployment = make_deployment(prefill={"replicas": 1}, decode={"replicas": 1})
    layout = GroupLayout(role=Role.PREFILL, replica=0, pods=(("gpu-a", 8),), domain="d", rack="r", cost=0.0)
    [pod] = children.worker_pods(deployment, layout, cold_start_source=None)
    command = pod["spec"]["containers"][0]["command"]
    assert command[:2] == ["trtllm-serve", "meta-llama/Llama-3-70B"]
    # The long-standing flag (--config is a late-2025 alias of it), so any image version reads it.
    assert "--config" not in command
    assert command[command.index("--extra_llm_api_options") + 1] == "/etc/copse/engine/prefill.yaml"
    config = children.engine_configmap(deployment)
    prefill = yaml.safe_load(config["data"]["prefill.yaml"])
    decode = yaml.safe_load(config["data"]["decode.yaml"])
    assert prefill["disable_overlap_scheduler"] is True
    assert "disable_overlap_scheduler" not in decode
    assert prefill["kv_cache_config"]["enable_block_reuse"] is True
    assert prefill["kv_cache_config"]["tokens_per_block"] == 32


SEED = REPO / "examples" / "seed-inferencedeployment.yaml"


def test_seed_engine_yaml_has_metrics_and_deep_merges_extra_config() -> None:
    """The design documents' manifest with a user's extraConfig: TensorRT-LLM's metrics are on,
    the user's free_gpu_memory_fraction does not switch off block reuse or KV events, and the
    user's own keys win."""
    body = yaml.safe_load(SEED.read_text())
    body["metadata"].update(namespace="serving", uid="uid-1")
    body["spec"]["engine"] = {
        "extraConfig": {
            "kv_cache_config": {"free_gpu_memory_fraction": 0.85, "dtype": "fp8"},
            "cuda_graph_config": {"max_batch_size": 256, "enable_padding": True},
            "enable_chunked_prefill": False,
        }
    }
    deployment = parse_deployment(body, source=str(SEED))
    engine_yaml = children.engine_configmap(deployment)["data"]["worker.yaml"]
    config = yaml.safe_load(engine_yaml)
    assert config["return_perf_metrics"] is True
    assert config["enable_iter_perf_stats"] is True
    assert config["kv_cache_config"] == {
        "enable_block_reuse": True,
        "event_buffer_max_size": children.KV_EVENT_BUFFER,
        "free_gpu_memory_fraction": 0.85,
        "tokens_per_block": 32,
        "dtype": "fp8",
    }
    assert config["cuda_graph_config"] == {"max_batch_size": 256, "enable_padding": True}
    assert config["enable_chunked_prefill"] is False  # the user's key wins
    assert {issue.reason for issue in children.routing_issues(deployment)} == {
        "TokenizerMissing",
        "KVCapacityMissing",
    }


@pytest.mark.parametrize(
    ("extra", "router", "reason"),
    [
        ({"kv_cache_config": {"enable_block_reuse": False}}, {}, "BlockReuseDisabled"),
        ({"kv_cache_config": {"event_buffer_max_size": 0}}, {"natsUrl": "nats://n:4222"}, "KVEventsDisabled"),
        ({"kv_cache_config": {"tokens_per_block": 64}}, {}, "BlockSizeMismatch"),
    ],
)
def test_settings_that_break_routing_are_accepted_and_reported(
    extra: dict[str, Any], router: dict[str, Any], reason: str
) -> None:
    ready = {"tokenizer": {"configMap": "t"}, "kvCapacityTokens": 100_000}
    deployment = make_deployment(
        prefill={"replicas": 1},
        decode={"replicas": 1},
        engine={"extraConfig": extra},
        router={**ready, **router},
    )
    issues = children.routing_issues(deployment)
    assert [issue.reason for issue in issues] == [reason, reason]  # prefill and decode engines
    assert "spec.engine.extraConfig" in issues[0].message
    config = yaml.safe_load(children.engine_configmap(deployment)["data"]["prefill.yaml"])
    assert deep_get(config, extra) == extra  # accepted as the user wrote it
    assert children.routing_issues(make_deployment(replicas=1, router=ready)) == []
    without_events = make_deployment(
        replicas=1, engine={"extraConfig": {"kv_cache_config": {"event_buffer_max_size": 0}}}, router=ready
    )
    assert children.routing_issues(without_events) == []  # no NATS: no relay reads the events
    mocked = make_deployment(replicas=1, engine={"backend": "mock", "extraConfig": extra})
    assert children.routing_issues(mocked) == []


def deep_get(config: dict[str, Any], shape: dict[str, Any]) -> Any:
    """The values of ``config`` at the leaves of ``shape``."""
    return {
        key: deep_get(config[key], value) if isinstance(value, dict) else config[key]
        for key, value in shape.items()
    }


def test_image_and_command_are_overridable() -> None:
    deployment = make_deployment(
        replicas=1, engine={"image": "my/engine:1", "command": ["run"], "args": ["--x"]}
    )
    [pod] = children.worker_pods(
        deployment,
        GroupLayout(role=Role.WORKER, replica=0, pods=(("n", 8),), domain=None, rack=None, cost=0),
        cold_start_source=None,
    )
    container = pod["spec"]["containers"][0]
    assert (container["image"], container["command"]) == ("my/engine:1", ["run", "--x"])


def test_group_service_records_the_placement() -> None:
    deployment = make_deployment(replicas=2)
    service = children.group_service(deployment, TWO_NODES)
    annotations = service["metadata"]["annotations"]
    assert json.loads(annotations[names.ANNOTATION_PLACEMENT]) == [
        {"node": "gpu-a", "gpus": 4},
        {"node": "gpu-b", "gpus": 4},
    ]
    assert annotations[names.ANNOTATION_DOMAIN] == "rack1.0"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {names.LABEL_GROUP: "llama-worker-1"}


def test_template_hash_moves_with_the_engine_not_the_replica_count() -> None:
    base = children.template_hash(make_deployment(replicas=2), Role.WORKER)
    assert children.template_hash(make_deployment(replicas=5), Role.WORKER) == base
    assert children.template_hash(make_deployment(replicas=2, engine={"image": "x"}), Role.WORKER) != base


def test_router_discovers_leaders_of_this_deployment() -> None:
    objects = {obj["kind"]: obj for obj in children.router_objects(make_deployment(replicas=1))}
    config = yaml.safe_load(objects["ConfigMap"]["data"]["router.yaml"])
    assert config["discovery"]["selector"] == (
        "app.kubernetes.io/component=worker,copse.dev/deployment=llama,copse.dev/leader=true"
    )
    assert config["policy"] == "kv"
    assert objects["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == "llama-router"
    assert "nodeSelector" not in objects["Deployment"]["spec"]["template"]["spec"]
    assert objects["Role"]["rules"][0]["verbs"] == ["get", "list", "watch"]
    pinned = make_deployment(replicas=1, router={"nodeSelector": {"copse.dev/node-pool": "cpu"}})
    [router] = [obj for obj in children.router_objects(pinned) if obj["kind"] == "Deployment"]
    assert router["spec"]["template"]["spec"]["nodeSelector"] == {"copse.dev/node-pool": "cpu"}


def test_long_names_stay_valid() -> None:
    name = names.group_name("x" * 70, Role.DECODE, 12)
    assert len(name) <= 63
    assert name != names.group_name("x" * 70, Role.DECODE, 13)


def test_mock_backend_command_is_what_the_mocker_accepts() -> None:
    deployment = make_deployment(
        prefill={"replicas": 1},
        decode={"replicas": 1},
        engine={"backend": "mock"},
        router={"natsUrl": "nats://n:4222"},
    )
    layout = GroupLayout(role=Role.PREFILL, replica=0, pods=(("n", 8),), domain=None, rack=None, cost=0)
    [pod] = children.worker_pods(deployment, layout, cold_start_source=None)
    command = pod["spec"]["containers"][0]["command"]
    assert command[:3] == ["copse", "worker", "mock"]
    assert worker.get_command(click.Context(worker), "mock") is mock
    mock_context = mock.make_context("mock", command[3:])
    assert mock_context.params["role"] == "prefill"
    assert mock_context.params["gpus_per_engine"] == 8
    assert mock_context.params["nats_url"] == "nats://n:4222"
    assert mock_context.params["deployment"] == "llama"
    assert mock_context.params["worker_prefix"] == "llama-prefill-0-0"


def _router_app(config: RouterConfig) -> web.Application:
    """The HTTP application a router with ``config`` serves (not started)."""
    service = RouterService(
        config,
        source=StaticSource([]),
        perf=PolynomialPerfModel(),
        tokenizer=MockPromptTokenizer(),
        use_kv_events=False,
    )
    return service.app


def _router(deployment: InferenceDeployment) -> tuple[dict[str, Any], dict[str, Any]]:
    """The router's pod spec and its config as the router reads it (raw)."""
    objects = {obj["kind"]: obj for obj in children.router_objects(deployment)}
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    return pod, yaml.safe_load(objects["ConfigMap"]["data"]["router.yaml"])


def test_router_config_describes_the_real_engine_and_mounts_its_tokenizer() -> None:
    deployment = make_deployment(
        replicas=1,
        engine={"maxBatchTokens": 16384, "blockSize": 64},
        router={
            "tokenizer": {
                "volume": {"persistentVolumeClaim": {"claimName": "model-cache", "readOnly": True}},
                "path": "hub/models--meta-llama--Llama-3-70B/snapshots/abc123",
            },
            "perfProfile": {"configMap": "llama-profile", "key": "gb200.npz"},
            "kvCapacityTokens": 2_000_000,
        },
    )
    pod, raw = _router(deployment)
    [container] = pod["containers"]
    assert container["command"][:3] == ["copse", "router", "run"]
    config = RouterConfig.model_validate(raw)
    assert config.model == "meta-llama/Llama-3-70B"
    assert config.engine == "trtllm"
    assert (config.block_size, config.max_num_batched_tokens, config.kv_capacity_tokens) == (
        64,
        16384,
        2_000_000,
    )
    assert (
        str(config.tokenizer)
        == f"{children.TOKENIZER_DIR}/hub/models--meta-llama--Llama-3-70B/snapshots/abc123"
    )
    assert str(config.perf_profile) == f"{children.PERF_PROFILE_DIR}/gb200.npz"
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["tokenizer"]["persistentVolumeClaim"] == {"claimName": "model-cache", "readOnly": True}
    assert volumes["perf-profile"]["configMap"] == {"name": "llama-profile"}
    mounts = {mount["name"]: mount for mount in container["volumeMounts"]}
    assert mounts["tokenizer"] == {"name": "tokenizer", "mountPath": children.TOKENIZER_DIR, "readOnly": True}
    assert mounts["perf-profile"]["mountPath"] == children.PERF_PROFILE_DIR
    from_config_map = make_deployment(replicas=1, router={"tokenizer": {"configMap": "llama-tokenizer"}})
    pod, raw = _router(from_config_map)
    assert raw["tokenizer"] == children.TOKENIZER_DIR
    assert {"name": "tokenizer", "configMap": {"name": "llama-tokenizer"}} in pod["volumes"]


def test_the_routers_readiness_probe_is_a_path_it_serves() -> None:
    deployment = make_deployment(
        replicas=1, router={"tokenizer": {"configMap": "t"}, "kvCapacityTokens": 100_000}
    )
    pod, raw = _router(deployment)
    [container] = pod["containers"]
    config = RouterConfig.model_validate(raw)
    probe = container["readinessProbe"]["httpGet"]
    assert probe["port"] == config.port
    served = {route.resource.canonical for route in _router_app(config).router.routes() if route.resource}
    assert probe["path"] == "/ready"
    assert probe["path"] in served
    assert pod["terminationGracePeriodSeconds"] > config.drain_timeout_s


def test_a_trtllm_router_without_tokenizer_or_capacity_refuses_naming_the_field() -> None:
    _, raw = _router(make_deployment(replicas=1))
    with pytest.raises(ValidationError, match="tokenizer: required with engine: trtllm"):
        RouterConfig.model_validate(raw)
    _, raw = _router(make_deployment(replicas=1, router={"tokenizer": {"configMap": "t"}}))
    with pytest.raises(ValidationError, match="kv_capacity_tokens: required with engine: trtllm"):
        RouterConfig.model_validate(raw)


def test_mocked_engines_and_their_router_share_the_kv_capacity() -> None:
    deployment = make_deployment(replicas=1, engine={"backend": "mock"}, router={"kvCapacityTokens": 65536})
    pod, raw = _router(deployment)
    config = RouterConfig.model_validate(raw)
    assert (config.engine, config.tokenizer, config.kv_capacity_tokens) == ("mock", None, 65536)
    assert [volume["name"] for volume in pod["volumes"]] == ["config"]
    [worker_pod] = children.worker_pods(deployment, ONE_NODE, cold_start_source=None)
    command = worker_pod["spec"]["containers"][0]["command"]
    assert mock.make_context("mock", command[3:]).params["kv_capacity_tokens"] == 65536


def test_trtllm_leader_gets_a_kv_relay_sidecar_when_events_have_a_bus() -> None:
    deployment = make_deployment(replicas=1, router={"natsUrl": "nats://nats:4222"}, engine={"blockSize": 64})
    leader, follower = children.worker_pods(deployment, TWO_NODES, cold_start_source=None)
    # a native sidecar: restarted by the kubelet on its own though the pod's policy is Never
    assert leader["spec"]["restartPolicy"] == "Never"
    assert [c["name"] for c in leader["spec"]["containers"]] == ["engine"]
    [relay] = leader["spec"]["initContainers"]
    assert relay["restartPolicy"] == "Always"
    assert relay["name"] == "kv-relay"
    assert relay["command"][:3] == ["copse", "worker", "kv-relay"]
    params = kv_relay.make_context("kv-relay", relay["command"][3:]).params
    assert (params["engine_url"], params["nats_url"], params["block_size"]) == (
        "http://127.0.0.1:8000",
        "nats://nats:4222",
        64,
    )
    assert params["worker_id"] == "llama-worker-1-0"
    assert [c["name"] for c in follower["spec"]["containers"]] == ["engine"]
    assert "initContainers" not in follower["spec"]
    without_bus = children.worker_pods(make_deployment(replicas=1), TWO_NODES, cold_start_source=None)
    assert [c["name"] for c in without_bus[0]["spec"]["containers"]] == ["engine"]
    assert "initContainers" not in without_bus[0]["spec"]


def _relay_capacity(deployment: InferenceDeployment, layout: GroupLayout) -> int | None:
    relay = children.worker_pods(deployment, layout, cold_start_source=None)[0]["spec"]["initContainers"][0]
    capacity = kv_relay.make_context("kv-relay", relay["command"][3:]).params["kv_capacity_blocks"]
    assert capacity is None or isinstance(capacity, int)
    return capacity


def test_the_kv_relay_is_told_the_engines_cache_size_in_blocks_every_tier_together() -> None:
    """What lets a relay restarted mid-run prove it knows every block again: the GPU pool of
    spec.router.kvCapacityTokens, plus the host and disk tiers in blocks of the model's KV bytes
    spread over the group's GPUs (an upper bound: a rank holds at least its share of a block)."""
    bus = {"natsUrl": "nats://nats:4222", "kvCapacityTokens": 100_000}
    model = {"name": "meta-llama/Llama-3-70B", "tensorParallelism": 8, "kvBytesPerToken": 327_680}
    gpu_only = make_deployment(replicas=1, model=model, router=bus)
    assert _relay_capacity(gpu_only, ONE_NODE) == 3125  # 100000 tokens / 32 per block
    uneven = make_deployment(replicas=1, model=model, router={**bus, "kvCapacityTokens": 100_001})
    assert _relay_capacity(uneven, ONE_NODE) == 3126  # rounded up: a bound
    offload = {"hostMemory": "16Gi", "disk": "64Gi"}
    tiered = make_deployment(replicas=1, model=model, router=bus, engine={"kvCacheOffload": offload})
    # (16 + 64) GiB per GPU x 8 GPUs / (32 tokens x 320 KiB per token)
    assert _relay_capacity(tiered, ONE_NODE) == 3125 + 65_536
    assert _relay_capacity(tiered, TWO_NODES) == 3125 + 65_536  # the same group of 8 on two pods
    # what the manifest cannot bound, the relay learns from the engine's created event, or never
    unsized = make_deployment(
        replicas=1, model={**model, "kvBytesPerToken": None}, router=bus, engine={"kvCacheOffload": offload}
    )
    assert _relay_capacity(unsized, ONE_NODE) is None
    no_capacity = make_deployment(replicas=1, model=model, router={"natsUrl": "nats://nats:4222"})
    assert _relay_capacity(no_capacity, ONE_NODE) is None


def test_the_models_kv_bytes_reach_the_router_and_mocked_engines() -> None:
    model = {"name": "meta-llama/Llama-3-70B", "tensorParallelism": 8, "kvBytesPerToken": 327_680}
    deployment = make_deployment(replicas=1, model=model, engine={"backend": "mock"})
    _, raw = _router(deployment)
    assert RouterConfig.model_validate(raw).kv_transfer.kv_bytes_per_token == 327_680
    [pod] = children.worker_pods(deployment, ONE_NODE, cold_start_source=None)
    command = pod["spec"]["containers"][0]["command"]
    assert mock.make_context("mock", command[3:]).params["kv_bytes_per_token"] == 327_680
    unset = make_deployment(replicas=1, engine={"backend": "mock"})
    _, raw = _router(unset)
    assert "kv_transfer" not in raw  # the router's own default


def test_worker_pods_leave_not_ready_nodes_only_when_the_operator_moves_the_gang() -> None:
    """The taint manager would evict each pod alone after 300 s; the gang's pods tolerate the
    node controller's taints instead, unless the user tolerates them their own way."""
    deployment = make_deployment(replicas=1)
    [pod, _] = children.worker_pods(deployment, TWO_NODES, cold_start_source=None)
    assert {(t["key"], t["effect"]) for t in pod["spec"]["tolerations"] if "tolerationSeconds" not in t} == {
        ("node.kubernetes.io/not-ready", "NoExecute"),
        ("node.kubernetes.io/unreachable", "NoExecute"),
    }
    own = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
           "tolerationSeconds": 60}  # fmt: skip
    custom = make_deployment(replicas=1, pod={"tolerations": [own]})
    [pod, _] = children.worker_pods(custom, TWO_NODES, cold_start_source=None)
    assert [t for t in pod["spec"]["tolerations"] if t["key"] == "node.kubernetes.io/unreachable"] == [own]


def test_epp_mode_makes_an_inference_pool_with_the_router_as_its_endpoint_picker() -> None:
    deployment = make_deployment(
        replicas=1, router={"mode": "epp", "tokenizer": {"configMap": "t"}, "kvCapacityTokens": 100_000}
    )
    objects = {obj["kind"]: obj for obj in children.router_objects(deployment)}
    pool = objects["InferencePool"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["ownerReferences"][0]["name"] == "llama"
    # Valid against the Inference Extension's own CRD (the one the chart can install).
    crd = yaml.safe_load((REPO / "charts/copse/files/inferencepool-crd.yaml").read_text())
    [version] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    jsonschema.validate(pool, version["schema"]["openAPIV3Schema"])
    assert pool["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/component": "worker",
        "copse.dev/deployment": "llama",
        "copse.dev/leader": "true",
    }
    assert pool["spec"]["targetPorts"] == [{"number": children.ENGINE_PORT}]
    ref = pool["spec"]["endpointPickerRef"]
    service = objects["Service"]
    assert ref["name"] == service["metadata"]["name"] == "llama-router"
    assert ref["port"]["number"] in [port["port"] for port in service["spec"]["ports"]]
    # The router runs as that picker, discovering the pool's pods.
    config = RouterConfig.model_validate(yaml.safe_load(objects["ConfigMap"]["data"]["router.yaml"]))
    assert config.epp is not None
    assert config.epp.grpc_port == ref["port"]["number"]
    assert config.discovery.kind == "inferencepool"
    container = objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"] == {"grpc": {"port": config.epp.health_port, "service": "readiness"}}
    assert container["livenessProbe"] == {"grpc": {"port": config.epp.health_port, "service": "liveness"}}
    rules = objects["Role"]["rules"]
    assert {
        "apiGroups": ["inference.networking.k8s.io"],
        "resources": ["inferencepools"],
        "verbs": ["get", "list", "watch"],
    } in rules
    http = {obj["kind"]: obj for obj in children.router_objects(make_deployment(replicas=1))}
    assert "InferencePool" not in http
    assert [rule["resources"] for rule in http["Role"]["rules"]] == [["pods"], ["inferenceobjectives"]]


def test_objectives_and_tenants_reach_the_router_config() -> None:
    """spec.router's objectives, tenants and rate limits become the router's settings; the router
    reads the InferenceObjectives naming the deployment's pool, with a Role that lets it list them."""
    router = {
        "tokenizer": {"configMap": "t"},
        "kvCapacityTokens": 100_000,
        "objectives": {"premium": {"priority": 100, "ttftMs": 2000, "itlMs": 50}, "batch": {}},
        "defaultObjective": {"ttftMs": 30000},
        "tenants": {"team-a": {"weight": 2, "tokensPerMinute": 200000}},
        "defaultTenant": {"tokensPerMinute": 50000},
    }
    deployment = make_deployment(replicas=1, router=router)
    objects = {obj["kind"]: obj for obj in children.router_objects(deployment)}
    config = RouterConfig.model_validate(yaml.safe_load(objects["ConfigMap"]["data"]["router.yaml"]))
    classes = config.classes()
    premium = classes.objective("premium")
    assert (premium.priority, premium.ttft_ms, premium.itl_ms) == (100, 2000, 50)
    assert (classes.objective("batch").priority, classes.objective("batch").ttft_ms) == (0, None)
    assert classes.objective("unknown").ttft_ms == 30000
    assert (classes.weight("team-a"), classes.weight("other")) == (2, 1)
    limits = config.rate_limits()
    assert limits is not None
    assert (limits.limit("team-a"), limits.limit("other")) == (200000, 50000)
    assert config.inference_objectives is not None
    assert (config.inference_objectives.pool, config.inference_objectives.api_version) == (
        "llama",
        "inference.networking.x-k8s.io/v1alpha2",
    )
    assert {
        "apiGroups": ["inference.networking.x-k8s.io"],
        "resources": ["inferenceobjectives"],
        "verbs": ["list"],
    } in objects["Role"]["rules"]
    llm_d = make_deployment(replicas=1, router={"inferenceObjectives": "llm-d.ai/v1alpha2"})
    objects = {obj["kind"]: obj for obj in children.router_objects(llm_d)}
    assert objects["Role"]["rules"][-1]["apiGroups"] == ["llm-d.ai"]
    trtllm = {"tokenizer": {"configMap": "t"}, "kvCapacityTokens": 1}
    off = make_deployment(replicas=1, router={**trtllm, "inferenceObjectives": None})
    objects = {obj["kind"]: obj for obj in children.router_objects(off)}
    config = RouterConfig.model_validate(yaml.safe_load(objects["ConfigMap"]["data"]["router.yaml"]))
    assert config.inference_objectives is None
    assert [rule["resources"] for rule in objects["Role"]["rules"]] == [["pods"]]


DEEPSEEK = REPO / "examples" / "deployment-deepseek-v3-wide-ep.yaml"


def test_wide_ep_engine_yaml_per_role() -> None:
    deployment = load_deployment(DEEPSEEK)
    data = children.engine_configmap(deployment)["data"]
    prefill, decode, worker_role = (
        yaml.safe_load(data[f"{role}.yaml"]) for role in ("prefill", "decode", "worker")
    )
    # Context servers: DEP8, no expert load balancer (TensorRT-LLM's wide-EP recipe).
    assert prefill["moe_expert_parallel_size"] == 8
    assert prefill["moe_tensor_parallel_size"] == 1
    assert prefill["enable_attention_dp"] is True
    assert prefill["moe_config"] == {"backend": "WIDEEP"}
    assert prefill["disable_overlap_scheduler"] is True
    # Generation servers: DEP32 with 256 + 32 slots and the online load balancer.
    assert decode["moe_expert_parallel_size"] == 32
    assert decode["enable_attention_dp"] is True
    assert decode["moe_config"] == {
        "backend": "WIDEEP",
        "load_balancer": {"num_slots": 288, "layer_updates_per_iter": 1},
    }
    assert decode["cache_transceiver_config"]["backend"] == "DEFAULT"
    # A role without a pool gets the model's own layout at the model's TP.
    assert worker_role["moe_expert_parallel_size"] == 32
    assert worker_role["moe_config"] == {"backend": "WIDEEP"}


def test_tep_layout_splits_tp_into_moe_tp_and_ep() -> None:
    moe = {"experts": 64, "expertsPerToken": 4, "hiddenSize": 2048, "layers": 24, "expertParallelism": 2}
    deployment = make_deployment(model={"name": "m", "tensorParallelism": 8, "moe": moe}, replicas=1)
    worker_yaml = yaml.safe_load(children.engine_configmap(deployment)["data"]["worker.yaml"])
    assert (worker_yaml["moe_expert_parallel_size"], worker_yaml["moe_tensor_parallel_size"]) == (2, 4)
    assert worker_yaml["enable_attention_dp"] is False


def test_extra_config_overrides_the_generated_moe_settings_and_dense_models_get_none() -> None:
    moe = {"experts": 64, "expertsPerToken": 4, "hiddenSize": 2048, "layers": 24}
    deployment = make_deployment(
        model={"name": "m", "tensorParallelism": 8, "moe": moe},
        replicas=1,
        engine={"extraConfig": {"moe_config": {"backend": "CUTLASS"}}},
    )
    worker_yaml = yaml.safe_load(children.engine_configmap(deployment)["data"]["worker.yaml"])
    assert worker_yaml["moe_config"] == {"backend": "CUTLASS"}
    dense = yaml.safe_load(children.engine_configmap(make_deployment(replicas=1))["data"]["worker.yaml"])
    assert not any(key.startswith("moe") or key == "enable_attention_dp" for key in dense)


def test_a_changed_expert_layout_rolls_the_groups() -> None:
    before = load_deployment(DEEPSEEK)
    after = before.model_copy(deep=True)
    assert after.spec.decode is not None
    after.spec.decode.redundant_experts = 64
    assert children.template_hash(before, Role.DECODE) != children.template_hash(after, Role.DECODE)
    assert children.template_hash(before, Role.PREFILL) == children.template_hash(after, Role.PREFILL)


def test_mock_backend_engines_of_an_moe_model_are_moe_groups_on_their_placed_link() -> None:
    deployment = load_deployment(DEEPSEEK).model_copy(deep=True)
    deployment.spec.engine.backend = EngineBackend.MOCK
    decode = tuple((f"n{i}", 4) for i in range(8))
    inside = GroupLayout(role=Role.DECODE, replica=0, pods=decode, domain="r0.0", rack="r0", cost=0.0)
    split = GroupLayout(role=Role.DECODE, replica=0, pods=decode, domain=None, rack="r0", cost=0.0)
    configs = []
    for layout in (inside, split):
        command = children.worker_pods(deployment, layout, cold_start_source=None)[0]["spec"]["containers"][
            0
        ]["command"]
        context = mock.make_context("mock", command[3:])
        configs.append(_moe_config(context.params["moe_json"]))
    near, far = configs
    assert near is not None
    assert far is not None
    assert (near.expert_parallelism, near.slots, near.rebalance_steps) == (32, 288, 58)
    assert (near.link_bandwidth_gbps, far.link_bandwidth_gbps) == (900.0, 50.0), "NVLink 5 vs the NICs"
    prefill = GroupLayout(
        role=Role.PREFILL, replica=0, pods=(("p", 4), ("q", 4)), domain="d", rack="r", cost=0
    )
    command = children.worker_pods(deployment, prefill, cold_start_source=None)[0]["spec"]["containers"][0][
        "command"
    ]
    prefill_moe = _moe_config(mock.make_context("mock", command[3:]).params["moe_json"])
    assert prefill_moe is not None
    assert (prefill_moe.expert_parallelism, prefill_moe.rebalance_steps) == (8, 0)
    with pytest.raises(click.BadParameter, match="unknown key"):
        _moe_config('{"experts": 8, "colour": 1}')


def test_kv_cache_offload_reaches_the_engine_yaml_the_pods_and_the_router() -> None:
    offload = {"hostMemory": "64Gi", "disk": "1Ti", "hostBandwidthGBps": 55.0, "diskBandwidthGBps": 6.0}
    deployment = make_deployment(
        replicas=1,
        engine={"kvCacheOffload": offload},
        pod={"resources": {"requests": {"memory": "100Gi", "cpu": "8"}, "limits": {"memory": "200Gi"}}},
        router={"tokenizer": {"configMap": "t"}, "kvCapacityTokens": 100_000},
    )
    # TensorRT-LLM's KvCacheConfig (llm_args.py): bytes per GPU rank; the disk tier is the v2 manager's
    config = yaml.safe_load(children.engine_configmap(deployment)["data"]["worker.yaml"])
    assert config["kv_cache_config"] == {
        "enable_block_reuse": True,
        "event_buffer_max_size": children.KV_EVENT_BUFFER,
        "free_gpu_memory_fraction": 0.9,
        "tokens_per_block": 32,
        "host_cache_size": 64 * 2**30,
        "disk_cache_size": 2**40,
        "disk_cache_path": children.KV_DISK_DIR,
        "use_kv_cache_manager_v2": True,
    }
    first, second = children.worker_pods(deployment, TWO_NODES, cold_start_source=None)
    for pod in (first, second):
        engine = pod["spec"]["containers"][0]
        # pinned host memory of the pod's 4 ranks counts against its memory request and limit
        assert engine["resources"]["requests"]["memory"] == str(100 * 2**30 + 4 * 64 * 2**30)
        assert engine["resources"]["limits"]["memory"] == str(200 * 2**30 + 4 * 64 * 2**30)
        assert engine["resources"]["requests"]["cpu"] == "8"
        volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
        assert volumes["kv-disk"] == {"name": "kv-disk", "emptyDir": {"sizeLimit": str(4 * 2**40)}}
        assert {"name": "kv-disk", "mountPath": children.KV_DISK_DIR} in engine["volumeMounts"]
    _, raw = _router(deployment)
    router = RouterConfig.model_validate(raw)
    # a group of 8 GPUs onboards over its 8 links at once
    assert (router.kv_offload.host_gbps, router.kv_offload.disk_gbps) == (8 * 55.0, 8 * 6.0)
    assert children.engine_configs(make_deployment(replicas=1))[Role.WORKER]["kv_cache_config"].keys() == {
        "enable_block_reuse",
        "event_buffer_max_size",
        "free_gpu_memory_fraction",
        "tokens_per_block",
    }


def test_mocked_engines_hold_the_whole_groups_offload_tiers() -> None:
    deployment = make_deployment(
        replicas=1, engine={"backend": "mock", "kvCacheOffload": {"hostMemory": "16Gi"}}, pod={}
    )
    [pod] = children.worker_pods(deployment, ONE_NODE, cold_start_source=None)
    engine = pod["spec"]["containers"][0]
    params = mock.make_context("mock", engine["command"][3:]).params
    assert params["host_cache_bytes"] == 8 * 16 * 2**30
    assert params["disk_cache_bytes"] == 0
    assert params["host_bandwidth_gbps"] == 8 * 50.0
    assert engine["resources"]["requests"]["memory"] == str(8 * 16 * 2**30)
    assert "limits" not in engine["resources"] or "memory" not in engine["resources"]["limits"]
    assert "kv-disk" not in [volume["name"] for volume in pod["spec"]["volumes"]]


def test_modelexpress_cold_start_runs_its_server_and_loads_through_it() -> None:
    deployment = make_deployment(replicas=2, coldStart={"strategy": "modelexpress"})
    config = yaml.safe_load(children.engine_configmap(deployment)["data"]["worker.yaml"])
    # TensorRT-LLM's native ModelExpress loader (ModelExpress's TensorRT-LLM example)
    assert config["checkpoint_format"] == "MX"
    assert config["mx_config"] == {"server_url": "llama-modelexpress.serving.svc:8001"}
    server, service = children.modelexpress_objects(deployment, source=None, source_ranks=None)
    pod = server["spec"]["template"]["spec"]
    [redis] = pod["initContainers"]
    assert redis["restartPolicy"] == "Always"  # a native sidecar, up before the server
    [container] = pod["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env == {"MX_METADATA_BACKEND": "redis", "REDIS_URL": "redis://127.0.0.1:6379"}
    assert service["spec"]["ports"][0] == {"name": "grpc", "port": 8001, "targetPort": 8001}
    assert service["spec"]["selector"] == server["spec"]["selector"]["matchLabels"]
    # mocked engines load no weights, and without the strategy nothing of it exists
    mocked = make_deployment(replicas=2, coldStart={"strategy": "modelexpress"}, engine={"backend": "mock"})
    assert children.modelexpress_objects(mocked, source="llama-worker-0", source_ranks=8) == []
    plain = make_deployment(replicas=2)
    assert "checkpoint_format" not in yaml.safe_load(children.engine_configmap(plain)["data"]["worker.yaml"])
    [plain_pod] = children.worker_pods(plain, ONE_NODE, cold_start_source=None)
    assert not any(item["name"].startswith("MX_") for item in plain_pod["spec"]["containers"][0]["env"])


def test_the_context_and_api_keys_reach_the_router_the_engines_and_the_mocker() -> None:
    deployment = make_deployment(
        replicas=1,
        engine={"maxSeqLen": 32768},
        router={
            "tokenizer": {"configMap": "t"},
            "kvCapacityTokens": 10**6,
            "auth": {"secretName": "llama-keys"},
        },
    )
    pod, raw = _router(deployment)
    config = RouterConfig.model_validate(raw)
    assert config.max_context_tokens == 32768
    assert str(config.api_keys_file) == f"{children.API_KEYS_DIR}/api-keys"
    assert {"name": "api-keys", "secret": {"secretName": "llama-keys"}} in pod["volumes"]
    [container] = pod["containers"]
    assert {"name": "api-keys", "mountPath": children.API_KEYS_DIR, "readOnly": True} in container[
        "volumeMounts"
    ]
    assert "llama-keys" not in json.dumps(container)  # mounted as a file, never in the environment
    assert all(engine["max_seq_len"] == 32768 for engine in children.engine_configs(deployment).values())
    mock = make_deployment(replicas=1, engine={"backend": "mock", "maxSeqLen": 4096})
    command = children._engine_command(mock, ONE_NODE, rank=0)
    assert command[command.index("--max-model-len") + 1] == "4096"
    _, raw = _router(mock)
    assert raw["max_context_tokens"] == 4096
    from_extra = make_deployment(replicas=1, engine={"extraConfig": {"max_seq_len": 8192}})
    assert _router(from_extra)[1]["max_context_tokens"] == 8192
    epp = make_deployment(replicas=1, router={"mode": "epp", "auth": {"secretName": "k"}})
    pod, raw = _router(epp)
    assert "api_keys_file" not in raw  # the gateway authenticates
    assert "api-keys" not in {volume["name"] for volume in pod["volumes"]}


def test_a_new_default_image_reaches_new_groups_only_with_the_next_revision() -> None:
    """An operator upgrade that changes the default engine image changes no revision: a group
    placed at the same revision runs its peers' image; the next revision runs the new default."""
    before, after = children.Images(trtllm="trtllm:1"), children.Images(trtllm="trtllm:2")
    deployment = make_deployment(replicas=2)
    [old_pod] = children.worker_pods(deployment, ONE_NODE, cold_start_source=None, images=before)
    old_pod["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    assert children.revision_image(deployment, [old_pod], images=after) == "trtllm:1"
    [new_pod] = children.worker_pods(
        deployment,
        ONE_NODE,
        cold_start_source=None,
        images=after,
        image=children.revision_image(deployment, [old_pod], images=after),
    )
    assert new_pod["spec"]["containers"][0]["image"] == "trtllm:1"
    labels = new_pod["metadata"]["labels"]
    assert labels[names.LABEL_REVISION] == old_pod["metadata"]["labels"][names.LABEL_REVISION]
    # No peer of this revision (none left, or another deployment's): the default.
    assert children.revision_image(deployment, [], images=after) == "trtllm:2"
    stranger = json.loads(json.dumps(old_pod))
    stranger["metadata"]["labels"][names.LABEL_DEPLOYMENT] = "other"
    assert children.revision_image(deployment, [stranger], images=after) == "trtllm:2"
    # A spec change is a new revision: it takes the new default, and rolls.
    changed = make_deployment(replicas=2, engine={"args": ["--log_level=debug"]})
    assert children.revision(changed) != children.revision(deployment)
    assert children.revision_image(changed, [old_pod], images=after) == "trtllm:2"
    # The manifest's own image wins over both.
    pinned = make_deployment(replicas=2, engine={"image": "mine/trtllm:3"})
    assert children.revision_image(pinned, [old_pod], images=after) == "mine/trtllm:3"


def test_the_operator_images_reach_routers_relays_and_mocked_workers() -> None:
    images = children.Images(
        copse="mirror.example/copse:9", trtllm="mirror.example/trtllm:1", pull_policy="Always"
    )
    mocked = make_deployment(replicas=1, engine={"backend": "mock"})
    [mock_pod] = children.worker_pods(mocked, ONE_NODE, cold_start_source=None, images=images)
    [engine] = mock_pod["spec"]["containers"]
    assert (engine["image"], engine["imagePullPolicy"]) == ("mirror.example/copse:9", "Always")
    trtllm = make_deployment(replicas=1, router={"natsUrl": "nats://nats:4222"})
    [trtllm_pod] = children.worker_pods(trtllm, ONE_NODE, cold_start_source=None, images=images)
    [engine] = trtllm_pod["spec"]["containers"]
    assert engine["image"] == "mirror.example/trtllm:1"
    assert "imagePullPolicy" not in engine, "the pull policy is the copse image's"
    [relay] = [c for c in trtllm_pod["spec"]["initContainers"] if c["name"] == "kv-relay"]
    assert (relay["image"], relay["imagePullPolicy"]) == ("mirror.example/copse:9", "Always")
    [router] = [obj for obj in children.router_objects(trtllm, images=images) if obj["kind"] == "Deployment"]
    [container] = router["spec"]["template"]["spec"]["containers"]
    assert (container["image"], container["imagePullPolicy"]) == ("mirror.example/copse:9", "Always")
    # The manifest's own image wins, and keeps Kubernetes' pull policy.
    pinned = make_deployment(replicas=1, router={"image": "mine/router:1"})
    [router] = [obj for obj in children.router_objects(pinned, images=images) if obj["kind"] == "Deployment"]
    [container] = router["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "mine/router:1"
    assert "imagePullPolicy" not in container
