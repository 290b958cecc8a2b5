"""The Kubernetes objects of an InferenceDeployment, as plain dicts (pure: no I/O).

Per TP group: one pod per node it spans (gated until the whole gang exists, pinned to its
planned node by a required node affinity) and a headless Service for rank discovery; a group
spanning nodes also gets ssh wiring and, on one NVLink domain, an IMEX channel
(:mod:`copse.operator.multinode`). Per deployment: the engine ConfigMap and the router's
ConfigMap, Deployment and Service; the weights cache's Job (:mod:`copse.operator.weights`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml

from copse.api import (
    ColdStartStrategy,
    EngineBackend,
    InferenceDeployment,
    MoeLayout,
    Role,
    RouterMode,
    RouterObjective,
    RouterTenant,
    parse_quantity,
)
from copse.operator import multinode, names, weights
from copse.topology.kube import NODE_CONDITION_TAINTS
from copse.topology.links import LinkTable, LinkTier

#: Images used when neither the manifest nor the operator's settings name one. The TensorRT-LLM
#: release image carries trtllm-serve, MPI and the copse KV relay is pip-installed on top.
TRTLLM_IMAGE = "nvcr.io/nvidia/tensorrt-llm/release:1.2.0"
COPSE_IMAGE = "ghcr.io/copse-dev/copse:0.1.0"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Images:
    """The images of the pods the operator creates where the manifest names none (``spec.router.image``,
    ``spec.engine.image`` win). The chart sets them from its own ``image`` values (``copse operator run
    --image``), so that a mirror or a pinned tag reaches every pod, not only the operator's."""

    copse: str = COPSE_IMAGE
    """Routers, KV relays and mocked workers: the control plane's own image, whose tag matches the
    operator's (the router's config and the relay's protocol are versioned with it)."""
    trtllm: str = TRTLLM_IMAGE
    """TensorRT-LLM workers."""
    pull_policy: str | None = None
    """``imagePullPolicy`` of the containers that run the copse image; ``None``: Kubernetes' default
    (``Always`` for ``:latest``, else ``IfNotPresent``)."""

    def container(self, image: str) -> dict[str, str]:
        """A container's ``image``, with the pull policy when it is the copse image."""
        policy = {"imagePullPolicy": self.pull_policy} if self.pull_policy and image == self.copse else {}
        return {"image": image, **policy}


ENGINE_PORT = 8000
ROUTER_PORT = 8080
EPP_PORT = 9002
"""The endpoint picker's ext_proc port (what the InferencePool's endpointPickerRef names)."""
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
PRE_STOP_SLEEP_S = 5
"""Seconds a deleted worker pod keeps serving before its engine gets SIGTERM: the routers' pod
watches drop a deleted pod within that time, so nothing new is sent to an engine that stopped
listening (the usual preStop sleep; the operator's own removals drain first anyway)."""
ENGINE_CONFIG_DIR = "/etc/copse/engine"
ROUTER_CONFIG_DIR = "/etc/copse/router"
TOKENIZER_DIR = "/var/lib/copse/tokenizer"
PERF_PROFILE_DIR = "/etc/copse/perf-profile"
API_KEYS_DIR = "/etc/copse/api-keys"
MODELEXPRESS_PORT = 8001
"""The ModelExpress server's gRPC port (its default, ``MODEL_EXPRESS_SERVER_PORT``)."""
MODELEXPRESS_METRICS_PORT = 9401
MODELEXPRESS_REDIS_PORT = 6379
MX_WORKER_GRPC_PORT = 6555
"""ModelExpress's ``MX_WORKER_GRPC_PORT``: a worker serves its tensor manifest on it plus its rank."""
KV_DISK_DIR = "/var/cache/copse/kv"
"""Where a worker's disk KV tier lives (an emptyDir of the tier's size)."""
GPU_RESOURCE = "nvidia.com/gpu"
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupLayout:
    """Where one TP group's pods go: the operator's input to build them."""

    role: Role
    replica: int
    pods: tuple[tuple[str, int], ...]
    """(node, GPUs) per rank, rank 0 first; rank 0 leads the MPI world and serves HTTP."""
    domain: str | None
    rack: str | None
    cost: float

    @property
    def world_size(self) -> int:
        return sum(gpus for _, gpus in self.pods)


def owner_reference(deployment: InferenceDeployment) -> dict[str, Any]:
    return {
        "apiVersion": deployment.api_version,
        "kind": deployment.kind,
        "name": deployment.metadata.name,
        "uid": deployment.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def service_owner_reference(service: Mapping[str, Any]) -> dict[str, Any]:
    """A group's Service as the owner of what lives and dies with the group. Not blocking its
    deletion: that would need update on services/finalizers under OwnerReferencesPermissionEnforcement."""
    meta = service["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
    }


def worker_image(deployment: InferenceDeployment, *, images: Images = Images()) -> str:
    engine = deployment.spec.engine
    return engine.image or (images.copse if engine.backend is EngineBackend.MOCK else images.trtllm)


def revision_image(
    deployment: InferenceDeployment, pods: Iterable[Mapping[str, Any]], *, images: Images = Images()
) -> str:
    """The engine image of a new worker pod: the manifest's, else the one the pods of the
    deployment's current revision already run (the oldest pod's), else the operator's default.
    A copse upgrade that changes a default image (the chart's copse image for mocked workers,
    ``operator.trtllmImage``) changes no revision and rolls nothing; a group placed afterwards at
    the same revision (a scale-up, a restarted gang) runs its peers' image, so one revision never
    serves two engine versions (the router pairs prefill and decode by revision). The new default
    reaches the deployment with its next revision."""
    if deployment.spec.engine.image:
        return deployment.spec.engine.image
    current = revision(deployment)
    peers = [
        pod
        for pod in pods
        if pod["metadata"].get("namespace") == deployment.metadata.namespace
        and pod["metadata"].get("labels", {}).get(names.LABEL_REVISION) == current
        and all(
            pod["metadata"].get("labels", {}).get(k) == v
            for k, v in names.worker_selector(deployment.metadata.name).items()
        )
    ]
    for pod in sorted(
        peers, key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"])
    ):
        for container in pod.get("spec", {}).get("containers", []):
            if container.get("name") == "engine":
                return str(container["image"])
    return worker_image(deployment, images=images)


def _metadata(
    deployment: InferenceDeployment, *, name: str, labels: dict[str, str], **extra: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": deployment.metadata.namespace,
        "labels": {names.LABEL_MANAGED_BY: names.MANAGED_BY, **labels},
        "ownerReferences": [owner_reference(deployment)],
        **extra,
    }


def _digest(inputs: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def _revision_inputs(deployment: InferenceDeployment) -> dict[str, Any]:
    """What every role's pods share (model, engine, pod settings) as the user's spec states it:
    fields at their default are left out, so an operator upgrade that adds a field or a default
    changes no hash and rolls nothing."""
    spec = deployment.spec
    shaped: dict[str, Any] = {
        "model": spec.model.name,
        "engine": spec.engine.model_dump(mode="json", exclude_defaults=True),
        "pod": spec.pod.model_dump(mode="json", exclude_defaults=True),
        "coldStart": spec.cold_start.model_dump(mode="json", include={"strategy"}, exclude_defaults=True),
    }
    if spec.model.cache:
        shaped["cache"] = spec.model.cache.model_dump(mode="json", exclude_defaults=True)
    if spec.model.loras:  # only then: deployments without adapters keep their hashes
        shaped["loras"] = spec.model.model_dump(
            mode="json", include={"loras", "max_loras", "max_cpu_loras"}, exclude_defaults=True
        )
    return shaped


def revision(deployment: InferenceDeployment) -> str:
    """The deployment's revision: the hash of what prefill and decode pods share. Pods carry it as
    a label; the router pairs a prefill group only with decode groups of its revision (KV caches
    of two engine versions need not be compatible)."""
    return _digest(_revision_inputs(deployment))


def template_inputs(deployment: InferenceDeployment, role: Role) -> dict[str, Any]:
    """What shapes a worker pod of ``role``: the revision's inputs plus the pool's parallelism."""
    spec = deployment.spec
    [pool] = [pool for pool in spec.pools() if pool.role is role]
    shaped = {**_revision_inputs(deployment), "tp": pool.tensor_parallelism, "pp": pool.pipeline_parallelism}
    if pool.moe is not None:  # only for MoE models: dense groups keep their hashes
        shaped["moe"] = dataclasses.asdict(pool.moe)
    return shaped


def template_hash(deployment: InferenceDeployment, role: Role) -> str:
    """What shapes a worker pod of ``role``; groups with another hash get rolled."""
    return _digest(template_inputs(deployment, role))


def legacy_template_hash(deployment: InferenceDeployment, role: Role) -> str:
    """The template hash as copse 0.1 computed it (over the rendered defaults): groups it recorded
    count as current, so the upgrade to user-spec hashing rolls nothing."""
    spec = deployment.spec
    [pool] = [pool for pool in spec.pools() if pool.role is role]
    shaped = {
        "model": spec.model.name,
        **({"cache": spec.model.cache.model_dump(mode="json")} if spec.model.cache else {}),
        "tp": pool.tensor_parallelism,
        "pp": pool.pipeline_parallelism,
        "engine": spec.engine.model_dump(mode="json"),
        "pod": spec.pod.model_dump(mode="json"),
        "coldStart": spec.cold_start.strategy.value,
    }
    if pool.moe is not None:
        shaped["moe"] = dataclasses.asdict(pool.moe)
    return _digest(shaped)


def changed_fields(before: Mapping[str, Any], after: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths whose values differ between two template inputs (for the roll's Event)."""
    changed: list[str] = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            changed += changed_fields(old, new, f"{prefix}{key}.")
        elif old != new:
            changed.append(f"{prefix}{key}")
    return changed


def group_labels(deployment: InferenceDeployment, layout: GroupLayout) -> dict[str, str]:
    name = deployment.metadata.name
    return {
        **names.worker_selector(name),
        names.LABEL_ROLE: layout.role.value,
        names.LABEL_GROUP: names.group_name(name, layout.role, layout.replica),
        names.LABEL_REPLICA: str(layout.replica),
        names.LABEL_REVISION: revision(deployment),
    }


def group_service(deployment: InferenceDeployment, layout: GroupLayout) -> dict[str, Any]:
    """Headless Service of one group: DNS for its ranks, and the record of its planned placement."""
    labels = group_labels(deployment, layout)
    group = labels[names.LABEL_GROUP]
    annotations = {
        names.ANNOTATION_PLACEMENT: json.dumps([{"node": node, "gpus": gpus} for node, gpus in layout.pods]),
        names.ANNOTATION_COST: f"{layout.cost:.6f}",
        names.ANNOTATION_TEMPLATE_HASH: template_hash(deployment, layout.role),
        names.ANNOTATION_TEMPLATE: json.dumps(template_inputs(deployment, layout.role), sort_keys=True),
    }
    if layout.domain is not None:
        annotations[names.ANNOTATION_DOMAIN] = layout.domain
    if layout.rack is not None:
        annotations[names.ANNOTATION_RACK] = layout.rack
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(deployment, name=group, labels=labels, annotations=annotations),
        "spec": {
            "clusterIP": "None",
            # Ranks must resolve each other before they are Ready: MPI starts them together.
            "publishNotReadyAddresses": True,
            "selector": {names.LABEL_GROUP: group},
            "ports": [
                {"name": "http", "port": ENGINE_PORT, "targetPort": ENGINE_PORT},
                {"name": "ssh", "port": multinode.SSH_PORT, "targetPort": multinode.SSH_PORT},
            ],
        },
    }


def group_disruption_budget(
    deployment: InferenceDeployment, layout: GroupLayout, *, service: Mapping[str, Any]
) -> dict[str, Any]:
    """The group's PodDisruptionBudget: every pod must stay, so an eviction (a drain) never takes
    part of a gang; the operator moves the gang whole instead. Owned by the group's Service, so
    it goes with the group."""
    labels = group_labels(deployment, layout)
    group = labels[names.LABEL_GROUP]
    metadata = _metadata(deployment, name=group, labels=labels)
    metadata["ownerReferences"] = [service_owner_reference(service)]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata,
        "spec": {"minAvailable": len(layout.pods), "selector": {"matchLabels": {names.LABEL_GROUP: group}}},
    }


#: The mocker calls an engine serving both phases "aggregated".
_MOCK_ROLES = {Role.WORKER: "aggregated", Role.PREFILL: "prefill", Role.DECODE: "decode"}


def _engine_command(deployment: InferenceDeployment, layout: GroupLayout, *, rank: int) -> list[str]:
    spec = deployment.spec
    engine = spec.engine
    if engine.command is not None:
        return [*engine.command, *engine.args]
    [pool] = [pool for pool in spec.pools() if pool.role is layout.role]
    if engine.backend is EngineBackend.MOCK:
        if rank > 0:
            # The mocker runs the whole group in the leader; followers only hold the GPUs.
            return ["sleep", "infinity"]
        nats = ["--nats", spec.router.nats_url] if spec.router.nats_url else []
        # The router sizes its busy thresholds with the same figure (see router_config).
        capacity = (
            ["--kv-capacity-tokens", str(spec.router.kv_capacity_tokens)]
            if spec.router.kv_capacity_tokens
            else []
        )
        # The KV bytes its offload tiers and transfers move, as the router charges them.
        kv_bytes = (
            ["--kv-bytes-per-token", str(spec.model.kv_bytes_per_token)]
            if spec.model.kv_bytes_per_token
            else []
        )
        context = ["--max-model-len", str(engine.max_seq_len)] if engine.max_seq_len else []
        loras = [arg for lora in spec.model.loras for arg in ("--lora", lora.name)]
        if loras:
            loras += ["--max-loras", str(spec.model.max_loras)]
        leader = names.pod_name(names.group_name(deployment.metadata.name, layout.role, layout.replica), 0)
        gpus = pool.tensor_parallelism * pool.pipeline_parallelism
        return [
            "copse", "worker", "mock",
            "--engines", "1",
            "--port-base", str(ENGINE_PORT),
            "--host", "0.0.0.0",
            "--model", spec.model.name,
            "--role", _MOCK_ROLES[layout.role],
            "--block-size", str(engine.block_size),
            "--max-num-batched-tokens", str(engine.max_batch_tokens),
            "--max-num-seqs", str(engine.max_num_sequences),
            "--gpus-per-engine", str(gpus),
            "--namespace", str(deployment.metadata.namespace),
            "--deployment", deployment.metadata.name,
            # Worker ids (what KV events carry) must be unique across pods: prefix them with the pod.
            "--worker-prefix", leader,
            *nats,
            *_mock_moe(pool.moe, layout),
            *_mock_offload(deployment, gpus=gpus),
            *capacity,
            *kv_bytes,
            *context,
            *loras,
            *engine.args,
        ]  # fmt: skip
    serve = [
        "trtllm-serve", spec.model.name,
        "--host", "0.0.0.0",
        "--port", str(ENGINE_PORT),
        "--backend", "pytorch",
        "--tp_size", str(pool.tensor_parallelism),
        "--pp_size", str(pool.pipeline_parallelism),
        "--max_num_tokens", str(engine.max_batch_tokens),
        "--max_batch_size", str(engine.max_num_sequences),
        # The long-standing flag: --config is only an alias of it in releases after late 2025.
        "--extra_llm_api_options", f"{ENGINE_CONFIG_DIR}/{layout.role.value}.yaml",
        *engine.args,
    ]  # fmt: skip
    if not mpi_world(deployment, layout):
        return serve
    # Multi-node TP is one MPI world launched by rank 0 over ssh, the way TensorRT-LLM runs one
    # world across pods (as LeaderWorkerSet and Dynamo do).
    if rank > 0:
        return multinode.follower_command()
    return multinode.leader_command(
        launched=["trtllm-llmapi-launch", *serve], forwarded=[var.name for var in spec.pod.env]
    )


def mpi_world(deployment: InferenceDeployment, layout: GroupLayout) -> bool:
    """Whether the group runs as one MPI world over ssh (TensorRT-LLM on several nodes)."""
    engine = deployment.spec.engine
    return engine.backend is EngineBackend.TRTLLM and engine.command is None and len(layout.pods) > 1


def _mock_moe(moe: MoeLayout | None, layout: GroupLayout) -> list[str]:
    """``copse worker mock --moe``: the pool's expert layout, its online balancer's period in
    steps (every layer once in ``layers / layer_updates_per_iter`` steps) and the bandwidth of the
    slowest link between the group's ranks where placement put them."""
    if moe is None:
        return []
    links = LinkTable()
    tier = LinkTier.DOMAIN if layout.domain is not None else LinkTier.RACK if layout.rack else LinkTier.BEYOND
    link = links[tier]
    settings = {
        "experts": moe.experts,
        "experts_per_token": moe.experts_per_token,
        "hidden_size": moe.hidden_size,
        "layers": moe.layers,
        "activation_bytes": moe.activation_bytes,
        "expert_parallelism": moe.expert_parallelism,
        "redundant_experts": moe.redundant_experts,
        "rebalance_steps": -(-moe.layers // moe.layer_updates_per_iter) if moe.layer_updates_per_iter else 0,
        "link_bandwidth_gbps": link.bandwidth_gbps,
        "link_latency_us": link.latency_us,
    }
    return ["--moe", json.dumps(settings, sort_keys=True)]


def _mock_offload(deployment: InferenceDeployment, *, gpus: int) -> list[str]:
    """``copse worker mock``'s offload tiers for a group of ``gpus`` GPUs: one mocked engine is the
    whole group, so its tiers hold every rank's share and copy over every rank's link at once."""
    offload = deployment.spec.engine.kv_cache_offload
    if offload is None:
        return []
    return [
        "--host-cache-bytes", str(offload.host_bytes * gpus),
        "--disk-cache-bytes", str(offload.disk_bytes * gpus),
        "--host-bandwidth-gbps", repr(offload.host_bandwidth_gbps * gpus),
        "--disk-bandwidth-gbps", repr(offload.disk_bandwidth_gbps * gpus),
    ]  # fmt: skip


def _offload_memory(
    deployment: InferenceDeployment, resources: dict[str, dict[str, str]], *, gpus: int
) -> None:
    """Add the pinned host memory of the pod's ranks' host KV tier to its memory request (and
    limit, when one is set): the engine's cgroup is charged for it."""
    offload = deployment.spec.engine.kv_cache_offload
    if offload is None or not offload.host_bytes:
        return
    extra = offload.host_bytes * gpus
    for section in ("requests", "limits"):
        amounts = resources.get(section)
        if section == "requests" or (amounts is not None and "memory" in amounts):
            amounts = resources.setdefault(section, {})
            amounts["memory"] = str(parse_quantity(amounts.get("memory", "0")) + extra)


def _kv_relay(
    deployment: InferenceDeployment, layout: GroupLayout, *, pod: str, rank: int, images: Images
) -> list[dict[str, Any]]:
    """The sidecar that drains trtllm-serve's ``/kv_cache_events`` into copse KV events on NATS,
    on the rank that serves HTTP; the mocker publishes its own events.

    A native sidecar (an init container with ``restartPolicy: Always``, Kubernetes >= 1.29): the
    kubelet restarts it whenever it exits although the pod's own policy is ``Never`` (a gang is
    restarted whole by the operator), starts it before the engine and stops it after. A restarted
    relay has missed events: it publishes a reset (see copse.workers.relay), and proves it knows
    every block again from the engine's cache size (:func:`relay_capacity_blocks`)."""
    spec = deployment.spec
    if rank > 0 or spec.engine.backend is not EngineBackend.TRTLLM or not spec.router.nats_url:
        return []
    capacity = relay_capacity_blocks(deployment, gpus=layout.world_size)
    command = [
        "copse", "worker", "kv-relay",
        "--engine", f"http://127.0.0.1:{ENGINE_PORT}",
        "--nats", spec.router.nats_url,
        "--namespace", str(deployment.metadata.namespace),
        "--deployment", deployment.metadata.name,
        "--worker-id", pod,
        "--block-size", str(spec.engine.block_size),
        *(["--kv-capacity-blocks", str(capacity)] if capacity is not None else []),
    ]  # fmt: skip
    return [
        {
            "name": "kv-relay",
            **images.container(spec.router.image or images.copse),
            "command": command,
            "restartPolicy": "Always",
        }
    ]


def relay_capacity_blocks(deployment: InferenceDeployment, *, gpus: int) -> int | None:
    """An upper bound on the blocks one engine of ``gpus`` GPUs holds, every cache level together
    (what the relay's bound needs: TensorRT-LLM's ``created`` event counts ``num_blocks_per_cache_level``
    of the GPU, host and disk pools, and a block offloaded below the GPU is still held, its eviction
    from there a ``removed`` event). ``None`` when the manifest cannot bound it: no
    ``spec.router.kvCapacityTokens`` (the GPU pool, as the engine logs it), or offload tiers without
    ``spec.model.kvBytesPerToken`` (a tier's blocks are its bytes per GPU over a rank's bytes per
    block, at least the model's block bytes over the group's GPUs; a smaller bound would let the
    relay claim it knows every block while some below the GPU are unknown to it)."""
    spec = deployment.spec
    tokens = spec.router.kv_capacity_tokens
    if tokens is None:
        return None
    block_size = spec.engine.block_size
    blocks = -(-tokens // block_size)
    offload = spec.engine.kv_cache_offload
    lower_tiers = 0 if offload is None else offload.host_bytes + offload.disk_bytes
    if lower_tiers:
        per_token = spec.model.kv_bytes_per_token
        if per_token is None:
            return None
        blocks += -(-lower_tiers * gpus // (block_size * per_token))
    return blocks


def _worker_tolerations(deployment: InferenceDeployment) -> list[dict[str, Any]]:
    """The user's tolerations, plus the node controller's NotReady/unreachable ``NoExecute`` taints
    tolerated for good unless the user says otherwise: whether a gang leaves a node that stopped
    answering is the operator's call (``spec.disruption.notReadyGrace``), made for the whole gang,
    not pod by pod by the taint manager after its default 300 s."""
    tolerations = [t.model_dump(mode="json", exclude_none=True) for t in deployment.spec.pod.tolerations]
    covered = {t.get("key") for t in tolerations if t.get("effect") in (None, "NoExecute")}
    for key in sorted(NODE_CONDITION_TAINTS - covered):
        tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute"})
    return tolerations


def _uses_modelexpress(deployment: InferenceDeployment) -> bool:
    """ModelExpress loads TensorRT-LLM weights; mocked engines have none to load."""
    spec = deployment.spec
    return (
        spec.cold_start.strategy is ColdStartStrategy.MODELEXPRESS
        and spec.engine.backend is EngineBackend.TRTLLM
    )


def modelexpress_address(deployment: InferenceDeployment) -> str:
    """``host:port`` of the deployment's ModelExpress server (what its clients call)."""
    name = names.modelexpress_name(deployment.metadata.name)
    return f"{name}.{deployment.metadata.namespace}.svc:{MODELEXPRESS_PORT}"


def _modelexpress_env(
    deployment: InferenceDeployment, *, group: str, source: str | None, source_ranks: int | None
) -> list[dict[str, Any]]:
    """The ModelExpress client's settings in a worker (its ``envs.py``): the server every group
    publishes its weights to (``MODEL_EXPRESS_URL``, which TensorRT-LLM's integration reads, and
    ``MX_SERVER_ADDRESS``), P2P metadata served by each worker, and the pod's identity (the server
    ties its records to the pod). A group started while a healthy one-pod source group is chosen is
    pointed at it: the ``k8s-service`` backend reaches that group's worker gRPC ports through the
    Service :func:`modelexpress_objects` makes (``MX_K8S_SERVICE_PATTERN``, port 6555 + rank)."""
    address = modelexpress_address(deployment)
    env: list[dict[str, Any]] = [
        {"name": "MODEL_EXPRESS_URL", "value": address},
        {"name": "MX_SERVER_ADDRESS", "value": address},
        {"name": "MX_P2P_METADATA", "value": "1"},
    ]
    if source is not None and source != group and source_ranks:
        env += [
            {"name": "MX_METADATA_BACKEND", "value": "k8s-service"},
            {
                "name": "MX_K8S_SERVICE_PATTERN",
                "value": names.modelexpress_source_name(deployment.metadata.name),
            },
        ]
    for name, field in (
        ("POD_NAME", "metadata.name"),
        ("POD_UID", "metadata.uid"),
        ("POD_NAMESPACE", "metadata.namespace"),
    ):
        env.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": field}}})
    return env


def modelexpress_objects(
    deployment: InferenceDeployment, *, source: str | None, source_ranks: int | None
) -> list[dict[str, Any]]:
    """What ModelExpress needs for ``coldStart.strategy: modelexpress`` (TensorRT-LLM engines): its
    server as a Deployment and Service (gRPC on 8001, metrics on 9401, metadata in a Redis native
    sidecar: ``MX_METADATA_BACKEND=redis``, as ModelExpress's own server manifest runs it), and,
    while a healthy one-pod group is the chosen source, the Service that points new groups at it
    (one port per rank, 6555 + rank, on the group's leader pod)."""
    if not _uses_modelexpress(deployment):
        return []
    spec = deployment.spec.cold_start.model_express
    name = names.modelexpress_name(deployment.metadata.name)
    labels = {
        names.LABEL_DEPLOYMENT: deployment.metadata.name,
        names.LABEL_COMPONENT: names.COMPONENT_MODELEXPRESS,
    }
    tcp = {"tcpSocket": {"port": MODELEXPRESS_PORT}, "periodSeconds": 10}
    server = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(deployment, name=name, labels=labels),
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "initContainers": [
                        {
                            "name": "redis",
                            "image": spec.redis_image,
                            "restartPolicy": "Always",
                            "args": ["--bind", "127.0.0.1", "--port", str(MODELEXPRESS_REDIS_PORT)],
                            "startupProbe": {
                                "tcpSocket": {"port": MODELEXPRESS_REDIS_PORT},
                                "periodSeconds": 1,
                                "failureThreshold": 30,
                            },
                        }
                    ],
                    "containers": [
                        {
                            "name": "server",
                            "image": spec.server_image,
                            "env": [
                                {"name": "MX_METADATA_BACKEND", "value": "redis"},
                                {
                                    "name": "REDIS_URL",
                                    "value": f"redis://127.0.0.1:{MODELEXPRESS_REDIS_PORT}",
                                },
                            ],
                            "ports": [
                                {"name": "grpc", "containerPort": MODELEXPRESS_PORT},
                                {"name": "metrics", "containerPort": MODELEXPRESS_METRICS_PORT},
                            ],
                            "readinessProbe": tcp,
                            "livenessProbe": tcp,
                        }
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(deployment, name=name, labels=labels),
        "spec": {
            "selector": labels,
            "ports": [
                {"name": "grpc", "port": MODELEXPRESS_PORT, "targetPort": MODELEXPRESS_PORT},
                {
                    "name": "metrics",
                    "port": MODELEXPRESS_METRICS_PORT,
                    "targetPort": MODELEXPRESS_METRICS_PORT,
                },
            ],
        },
    }
    objects = [server, service]
    if source is not None and source_ranks:
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": _metadata(
                    deployment, name=names.modelexpress_source_name(deployment.metadata.name), labels=labels
                ),
                "spec": {
                    "selector": {names.LABEL_GROUP: source, names.LABEL_LEADER: "true"},
                    "ports": [
                        {
                            "name": f"rank-{rank}",
                            "port": MX_WORKER_GRPC_PORT + rank,
                            "targetPort": MX_WORKER_GRPC_PORT + rank,
                        }
                        for rank in range(source_ranks)
                    ],
                },
            }
        )
    return objects


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Wiring:
    """What every pod of a group gets besides its rank's own settings."""

    env: dict[str, str]
    user_env: list[dict[str, Any]]
    volumes: list[dict[str, Any]]
    mounts: list[dict[str, Any]]
    init_containers: list[dict[str, Any]]
    resource_claims: list[dict[str, Any]]


def _wiring(
    deployment: InferenceDeployment,
    layout: GroupLayout,
    *,
    hosts: Sequence[str],
    image: str,
    channel_template: str | None,
) -> _Wiring:
    spec = deployment.spec
    env: dict[str, str] = {}
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if spec.pod.shm_size is not None:
        # NCCL and MPI move data through /dev/shm; the runtime's default is 64Mi.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.pod.shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    cache = spec.model.cache
    if cache is not None:
        env |= weights.engine_env(cache)
        volumes.append(weights.volume(cache))
        mounts.append(weights.mount(cache))
    if mpi_world(deployment, layout):
        env |= multinode.ssh_env(
            hosts=hosts, layout_pods=layout.pods, timeout_s=spec.engine.multi_node.follower_timeout_s
        )
        volumes += multinode.ssh_volumes(deployment.metadata.name)
        mounts += multinode.ssh_mounts()
    claims = []
    if channel_template is not None:
        claims.append({"name": multinode.CHANNEL_CLAIM, "resourceClaimTemplateName": channel_template})
    return _Wiring(
        env=env,
        user_env=[var.model_dump(mode="json", by_alias=True, exclude_none=True) for var in spec.pod.env],
        volumes=volumes,
        mounts=mounts,
        init_containers=weights.init_containers(deployment, image=image),
        resource_claims=claims,
    )


def worker_pods(
    deployment: InferenceDeployment,
    layout: GroupLayout,
    *,
    cold_start_source: str | None,
    cold_start_ranks: int | None = None,
    channel_template: str | None = None,
    images: Images = Images(),
    image: str | None = None,
) -> list[dict[str, Any]]:
    """The pods of one TP group, gated and pinned to their planned nodes (with ModelExpress's client
    settings when it loads the weights; ``cold_start_ranks``: the source group's GPUs when it is one
    pod, see :func:`modelexpress_objects`); ``channel_template`` names the ResourceClaimTemplate of
    the group's IMEX channel (its ComputeDomain's); ``image``: the engine's (:func:`revision_image`;
    None: the deployment's default)."""
    spec = deployment.spec
    namespace = deployment.metadata.namespace
    labels = group_labels(deployment, layout)
    group = labels[names.LABEL_GROUP]
    pod_names = [names.pod_name(group, rank) for rank in range(len(layout.pods))]
    hosts = [f"{pod}.{group}.{namespace}.svc" for pod in pod_names]
    digest = template_hash(deployment, layout.role)
    image = image or worker_image(deployment, images=images)
    wiring = _wiring(deployment, layout, hosts=hosts, image=image, channel_template=channel_template)
    mpi = mpi_world(deployment, layout)
    pods = []
    for rank, ((node, gpus), pod) in enumerate(zip(layout.pods, pod_names, strict=True)):
        env = {
            "COPSE_DEPLOYMENT": deployment.metadata.name,
            "COPSE_MODEL": spec.model.name,
            "COPSE_ROLE": layout.role.value,
            "COPSE_GROUP": group,
            "COPSE_REPLICA": str(layout.replica),
            "COPSE_NODE_RANK": str(rank),
            "COPSE_NUM_NODES": str(len(layout.pods)),
            "COPSE_WORLD_SIZE": str(layout.world_size),
            "COPSE_LEADER_ADDRESS": hosts[0],
            "COPSE_COLD_START_STRATEGY": spec.cold_start.strategy.value,
            "COPSE_COLD_START_SOURCE": cold_start_source or "",
            **wiring.env,
        }
        # Quantities are strings in the API ("4", "500m"); the client validates them as such.
        resources: dict[str, Any] = {
            section: {name: str(amount) for name, amount in dict(amounts).items()}
            for section, amounts in spec.pod.resources.items()
        }
        resources.setdefault("limits", {})[GPU_RESOURCE] = str(gpus)
        resources.setdefault("requests", {})[GPU_RESOURCE] = str(gpus)
        _offload_memory(deployment, resources, gpus=gpus)
        volumes: list[dict[str, Any]] = [
            {
                "name": "engine-config",
                "configMap": {"name": names.engine_config_name(deployment.metadata.name)},
            }
        ]
        mounts = [{"name": "engine-config", "mountPath": ENGINE_CONFIG_DIR}]
        offload = spec.engine.kv_cache_offload
        if offload is not None and offload.disk_bytes and spec.engine.backend is EngineBackend.TRTLLM:
            volumes.append({"name": "kv-disk", "emptyDir": {"sizeLimit": str(offload.disk_bytes * gpus)}})
            mounts.append({"name": "kv-disk", "mountPath": KV_DISK_DIR})
        volumes += wiring.volumes
        mounts += wiring.mounts
        if wiring.resource_claims:
            resources["claims"] = [{"name": claim["name"]} for claim in wiring.resource_claims]
        env_list: list[dict[str, Any]] = [{"name": key, "value": value} for key, value in env.items()]
        if _uses_modelexpress(deployment):
            env_list += _modelexpress_env(
                deployment, group=group, source=cold_start_source, source_ranks=cold_start_ranks
            )
        container: dict[str, Any] = {
            "name": "engine",
            **images.container(image),
            "command": _engine_command(deployment, layout, rank=rank),
            "env": env_list + wiring.user_env,
            "resources": resources,
            "ports": [{"name": "http", "containerPort": ENGINE_PORT}],
            "volumeMounts": mounts,
        }
        # A pod deleted by anyone (kubectl drain, eviction) stops gracefully: the engine finishes
        # what it serves on SIGTERM within the drain timeout.
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": PRE_STOP_SLEEP_S}}}
        if _uses_modelexpress(deployment):
            # NIXL registers GPU memory for RDMA: ModelExpress's worker manifests add IPC_LOCK.
            container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
        if rank == 0:
            container["readinessProbe"] = {
                "httpGet": {"path": "/health", "port": ENGINE_PORT},
                "periodSeconds": 5,
            }
        elif mpi:
            # A follower is ready once its sshd answers: what rank 0 waits for.
            container["ports"] = [{"name": "ssh", "containerPort": multinode.SSH_PORT}]
            container["readinessProbe"] = {"tcpSocket": {"port": multinode.SSH_PORT}, "periodSeconds": 5}
        pod_labels = {
            **spec.pod.labels,
            **labels,
            names.LABEL_RANK: str(rank),
            names.LABEL_LEADER: str(rank == 0).lower(),
        }
        if layout.domain is not None and _LABEL_VALUE.match(layout.domain):
            # The router prefers a decode worker in the prefill worker's NVLink domain.
            pod_labels[names.LABEL_DOMAIN] = layout.domain
        annotations = {**spec.pod.annotations, names.ANNOTATION_TEMPLATE_HASH: digest}
        pod_spec: dict[str, Any] = {
            "hostname": pod,
            "subdomain": group,
            "schedulingGates": [{"name": names.GANG_GATE}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                        ]
                    }
                }
            },
            "tolerations": _worker_tolerations(deployment),
            "containers": [container],
            "volumes": volumes,
            # A broken gang is restarted whole by the operator, not container by container.
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": PRE_STOP_SLEEP_S + math.ceil(spec.disruption.drain_timeout_s),
        }
        # The weights step first (it may wait for the download), then the relay as a native sidecar.
        relay = _kv_relay(deployment, layout, pod=pod, rank=rank, images=images)
        init_containers = [*wiring.init_containers, *relay]
        if init_containers:
            pod_spec["initContainers"] = init_containers
        if wiring.resource_claims:
            pod_spec["resourceClaims"] = wiring.resource_claims
        if spec.pod.node_selector:
            pod_spec["nodeSelector"] = dict(spec.pod.node_selector)
        if spec.pod.service_account_name:
            pod_spec["serviceAccountName"] = spec.pod.service_account_name
        pods.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": _metadata(deployment, name=pod, labels=pod_labels, annotations=annotations),
                "spec": pod_spec,
            }
        )
    return pods


def moe_engine_config(moe: MoeLayout, *, tensor_parallelism: int) -> dict[str, Any]:
    """TensorRT-LLM's expert-parallel settings (``llm_args.py``) for one role, as its wide-EP
    recipes write them: EP and MoE-TP sizes (``moe_tp x moe_ep = tp``), attention data
    parallelism, the MoE backend and, with replica slots or online updates, the expert load
    balancer (``num_slots`` = experts + redundant, ``layer_updates_per_iter`` 0 = static)."""
    moe_config: dict[str, Any] = {"backend": moe.backend.value}
    if moe.load_balancer:
        moe_config["load_balancer"] = {
            "num_slots": moe.slots,
            "layer_updates_per_iter": moe.layer_updates_per_iter,
        }
    return {
        "moe_expert_parallel_size": moe.expert_parallelism,
        "moe_tensor_parallel_size": tensor_parallelism // moe.expert_parallelism,
        "enable_attention_dp": moe.attention_data_parallel,
        "moe_config": moe_config,
    }


def _moe_settings(deployment: InferenceDeployment, role: Role) -> dict[str, Any]:
    spec = deployment.spec
    moe = spec.moe_layout(role)
    if moe is None:
        return {}
    pools = {pool.role: pool.tensor_parallelism for pool in spec.pools()}
    return moe_engine_config(moe, tensor_parallelism=pools.get(role, spec.model.tensor_parallelism))


#: Events the engine buffers between two drains of ``/kv_cache_events`` by the relay.
KV_EVENT_BUFFER = 1024


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` on top: nested mappings merge key by key, anything else
    (scalars, lists, a mapping replacing a scalar) is replaced by the override's value."""
    merged = dict(base)
    for key, value in override.items():
        below = merged.get(key)
        if isinstance(below, Mapping) and isinstance(value, Mapping):
            merged[key] = deep_merge(below, value)
        else:
            merged[key] = value
    return merged


def engine_configs(deployment: InferenceDeployment) -> dict[Role, dict[str, Any]]:
    """TensorRT-LLM's LLM-API settings per role, as ``trtllm-serve --extra_llm_api_options`` reads
    them (every key is a field of ``tensorrt_llm/llmapi/llm_args.py``): KV block reuse and an event
    buffer (the relay feeds the router's index from ``/kv_cache_events``), chunked prefill,
    ``return_perf_metrics`` (mounts ``/prometheus/metrics``) and ``enable_iter_perf_stats`` (the
    iteration gauges: queue, running requests, KV use); a cache transceiver for disaggregated pools
    and no overlap scheduler on context servers, as TensorRT-LLM's disaggregated docs ask; the offload
    tiers of ``spec.engine.kvCacheOffload`` (``host_cache_size`` in bytes per GPU; a disk tier is
    ``disk_cache_size``/``disk_cache_path``, which only the KV cache manager v2 reads, so it turns
    ``use_kv_cache_manager_v2`` on). Then ``spec.engine.extraConfig`` deep-merged on top: the user
    wins on every key they set (:func:`routing_issues` reports the ones that break KV-aware routing)."""
    engine = deployment.spec.engine
    kv_cache: dict[str, Any] = {
        "enable_block_reuse": True,
        "event_buffer_max_size": KV_EVENT_BUFFER,
        "free_gpu_memory_fraction": engine.kv_cache_free_gpu_memory_fraction,
        "tokens_per_block": engine.block_size,
    }
    offload = engine.kv_cache_offload
    if offload is not None and offload.host_bytes:
        kv_cache["host_cache_size"] = offload.host_bytes
    if offload is not None and offload.disk_bytes:
        kv_cache.update(
            disk_cache_size=offload.disk_bytes, disk_cache_path=KV_DISK_DIR, use_kv_cache_manager_v2=True
        )
    loader: dict[str, Any] = {}
    if _uses_modelexpress(deployment):
        # TensorRT-LLM's native ModelExpress loader: weights from a serving group over NIXL, else
        # from storage, then published for the next group (ModelExpress's TensorRT-LLM example).
        loader = {"checkpoint_format": "MX", "mx_config": {"server_url": modelexpress_address(deployment)}}
    context = {"max_seq_len": engine.max_seq_len} if engine.max_seq_len is not None else {}
    base: dict[str, Any] = {
        **loader,
        **context,
        **_lora_settings(deployment),
        "kv_cache_config": kv_cache,
        "enable_chunked_prefill": True,
        "return_perf_metrics": True,
        "enable_iter_perf_stats": True,
    }
    transceiver = {"cache_transceiver_config": {"backend": "DEFAULT", "max_tokens_in_buffer": 8192}}
    roles = {
        Role.WORKER: base,
        Role.PREFILL: {**base, **transceiver, "disable_overlap_scheduler": True},
        Role.DECODE: {**base, **transceiver},
    }
    # Expert layouts differ per role (prefill and decode pools may use other EP sizes).
    return {
        role: deep_merge({**_moe_settings(deployment, role), **config}, engine.extra_config)
        for role, config in roles.items()
    }


def lora_paths(deployment: InferenceDeployment) -> dict[str, str]:
    """Adapter name -> where the engines read it (in the weights cache); empty without adapters
    or without a cache (mocked engines read nothing)."""
    cache = deployment.spec.model.cache
    if cache is None:
        return {}
    return {lora.name: weights.lora_path(cache, lora) for lora in deployment.spec.model.loras}


def _lora_settings(deployment: InferenceDeployment) -> dict[str, Any]:
    """TensorRT-LLM's ``lora_config`` (``tensorrt_llm/lora_helper.py`` ``LoraConfig``, an LLM-API
    field of ``llmapi/llm_args.py``) for ``spec.model.loras``: every adapter's directory in
    ``lora_dir`` (read at start-up for the adapters' target modules), ``max_lora_rank`` the largest
    rank, ``max_loras`` adapters on the GPUs at once and ``max_cpu_loras`` in host memory (all of
    them unless ``spec.model.maxCpuLoras`` says). Requests choose an adapter with the
    ``lora_request`` body field the router adds (``executor/request.py`` ``LoRARequest``)."""
    model = deployment.spec.model
    if not model.loras:
        return {}
    paths = lora_paths(deployment)
    config: dict[str, Any] = {
        "lora_dir": [paths[lora.name] for lora in model.loras if lora.name in paths],
        "max_lora_rank": max(lora.rank for lora in model.loras),
        "max_loras": model.max_loras,
        "max_cpu_loras": model.max_cpu_loras or max(len(model.loras), model.max_loras),
    }
    return {"lora_config": config}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoutingIssue:
    """A setting the deployment asked for that defeats KV-aware routing; accepted, and reported."""

    reason: str
    message: str


def routing_issues(deployment: InferenceDeployment) -> list[RoutingIssue]:
    """What in the deployment breaks KV-aware routing on a real engine: block reuse off (nothing
    is reused, whatever the router picks), no KV event buffer while a relay reads events (the
    router's index stays empty), a ``tokens_per_block`` other than ``spec.engine.blockSize`` (the
    router and relay hash other blocks than the engine caches), and a router that cannot start
    (no tokenizer, no KV capacity). Mocked engines ignore the engine YAML and have neither problem."""
    spec = deployment.spec
    if spec.engine.backend is EngineBackend.MOCK:
        return []
    issues: list[RoutingIssue] = []
    for role, config in engine_configs(deployment).items():
        if role not in {pool.role for pool in spec.pools()}:
            continue
        cache = config.get("kv_cache_config")
        cache = cache if isinstance(cache, Mapping) else {}
        where = f"{role.value} engines (spec.engine.extraConfig)"
        if cache.get("enable_block_reuse") is False:
            issues.append(
                RoutingIssue(
                    reason="BlockReuseDisabled",
                    message=f"{where}: kv_cache_config.enable_block_reuse is false, so no prefix is reused",
                )
            )
        buffer = cache.get("event_buffer_max_size")
        if spec.router.nats_url and not (isinstance(buffer, int) and buffer > 0):
            issues.append(
                RoutingIssue(
                    reason="KVEventsDisabled",
                    message=f"{where}: kv_cache_config.event_buffer_max_size is {buffer!r}; "
                    "the engine emits no KV events and the router's index stays empty",
                )
            )
        block = cache.get("tokens_per_block")
        if block != spec.engine.block_size:
            issues.append(
                RoutingIssue(
                    reason="BlockSizeMismatch",
                    message=f"{where}: kv_cache_config.tokens_per_block is {block!r} but "
                    f"spec.engine.blockSize (what the router and relay hash) is {spec.engine.block_size}",
                )
            )
    if spec.router.tokenizer is None:
        issues.append(
            RoutingIssue(
                reason="TokenizerMissing",
                message="spec.router.tokenizer is not set: the router cannot tokenize text prompts "
                "as trtllm-serve does and refuses to start",
            )
        )
    if spec.router.kv_capacity_tokens is None and spec.router.perf_profile is None:
        issues.append(
            RoutingIssue(
                reason="KVCapacityMissing",
                message="spec.router.kvCapacityTokens (or a perfProfile) is not set: the router does not "
                "know the engines' KV cache size and refuses to start",
            )
        )
    return issues


def engine_configmap(deployment: InferenceDeployment) -> dict[str, Any]:
    """The ConfigMap of :func:`engine_configs`, one ``<role>.yaml`` per role."""
    configs = engine_configs(deployment)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(
            deployment,
            name=names.engine_config_name(deployment.metadata.name),
            labels={names.LABEL_DEPLOYMENT: deployment.metadata.name},
        ),
        "data": {
            f"{role.value}.yaml": yaml.safe_dump(config, sort_keys=True) for role, config in configs.items()
        },
    }


def _router_classes(deployment: InferenceDeployment) -> dict[str, Any]:
    """Objectives, the InferenceObjectives to read and tenants, in the router's config format
    (unset fields left to the router's defaults)."""
    router = deployment.spec.router

    def objective(spec: RouterObjective) -> dict[str, Any]:
        return {"priority": spec.priority, "ttft_ms": spec.ttft_ms, "itl_ms": spec.itl_ms}

    def tenant(spec: RouterTenant) -> dict[str, Any]:
        return {"weight": spec.weight, "tokens_per_minute": spec.tokens_per_minute}

    config: dict[str, Any] = {
        "objectives": {name: objective(spec) for name, spec in router.objectives.items()},
        "default_objective": objective(router.default_objective),
        "tenants": {name: tenant(spec) for name, spec in router.tenants.items()},
        "default_tenant": tenant(router.default_tenant),
    }
    if router.inference_objectives is not None:
        config["inference_objectives"] = {
            "pool": deployment.metadata.name,
            "api_version": router.inference_objectives.value,
        }
    return config


def router_config(deployment: InferenceDeployment) -> dict[str, Any]:
    """The router's settings for this deployment, in the router's own config format: the engines
    it routes to (kind, block size, step token budget, KV capacity, perf profile) and where the
    model's tokenizer is mounted (:func:`router_volumes`). A ``trtllm`` deployment without
    ``spec.router.tokenizer`` or a KV capacity yields a config the router refuses at start-up,
    naming the field (the ``KVRouting`` condition says so too)."""
    spec = deployment.spec
    router = spec.router
    config: dict[str, Any] = {
        "model": spec.model.name,
        "engine": "mock" if spec.engine.backend is EngineBackend.MOCK else "trtllm",
        "host": "0.0.0.0",
        "port": ROUTER_PORT,
        "policy": router.policy.value,
        "temperature": router.temperature,
        "queue_size": router.queue_size,
        "block_size": spec.engine.block_size,
        "max_num_batched_tokens": spec.engine.max_batch_tokens,
        "nats_url": router.nats_url,
        "deployment": deployment.metadata.name,
        # the planner's fast loop reads the burn rate of this SLO from the router's counters
        "slo": {
            "ttft_ms": spec.scaling.target_latency.ttft_p99_ms,
            "itl_ms": spec.scaling.target_latency.tbt_p99_ms,
        },
        "discovery": {
            "kind": "kubernetes",
            "namespace": deployment.metadata.namespace,
            "selector": names.selector_string(_leader_selector(deployment)),
            "port": ENGINE_PORT,
        },
    }
    if router.kv_capacity_tokens is not None:
        config["kv_capacity_tokens"] = router.kv_capacity_tokens
    config.update(_router_classes(deployment))
    if spec.model.loras:
        paths = lora_paths(deployment)
        config["loras"] = [
            {"name": lora.name, **({"path": paths[lora.name]} if lora.name in paths else {})}
            for lora in spec.model.loras
        ]
        config["max_loras"] = spec.model.max_loras
    context = spec.engine.max_seq_len or spec.engine.extra_config.get("max_seq_len")
    if isinstance(context, int) and not isinstance(context, bool) and context > 1:
        config["max_context_tokens"] = context
    if router.auth is not None and router.mode is RouterMode.HTTP:
        config["api_keys_file"] = f"{API_KEYS_DIR}/{router.auth.key}"
    if spec.model.kv_bytes_per_token is not None:
        config["kv_transfer"] = {"kv_bytes_per_token": spec.model.kv_bytes_per_token}
    offload = spec.engine.kv_cache_offload
    if offload is not None:
        # Onboarding copies every rank's share over its own link at once; the pool that prefills
        # is the one whose prefix hits are onboarded.
        [prefilling] = [pool for pool in spec.pools() if pool.role in (Role.WORKER, Role.PREFILL)]
        gpus = prefilling.tensor_parallelism * prefilling.pipeline_parallelism
        config["kv_offload"] = {
            "host_gbps": offload.host_bandwidth_gbps * gpus,
            "disk_gbps": offload.disk_bandwidth_gbps * gpus,
        }
    if router.tokenizer is not None:
        config["tokenizer"] = "/".join(part for part in (TOKENIZER_DIR, router.tokenizer.path) if part)
    if router.perf_profile is not None:
        config["perf_profile"] = f"{PERF_PROFILE_DIR}/{router.perf_profile.key}"
    if router.mode is RouterMode.EPP:
        config["epp"] = {
            "grpc_port": EPP_PORT,
            "health_port": EPP_HEALTH_PORT,
            "metrics_port": EPP_METRICS_PORT,
        }
        config["discovery"] = {
            "kind": "inferencepool",
            "namespace": deployment.metadata.namespace,
            "name": deployment.metadata.name,
        }
    return config


def _leader_selector(deployment: InferenceDeployment) -> dict[str, str]:
    """Labels of the deployment's rank-0 worker pods (the engines' HTTP servers)."""
    return {**names.worker_selector(deployment.metadata.name), names.LABEL_LEADER: "true"}


def inference_pool(deployment: InferenceDeployment) -> dict[str, Any]:
    """The InferencePool of an ``epp``-mode deployment: its rank-0 workers on the engine port, and the
    router as its endpoint picker. A gateway's HTTPRoute points at it."""
    name = deployment.metadata.name
    labels = {names.LABEL_DEPLOYMENT: name, names.LABEL_COMPONENT: names.COMPONENT_ROUTER}
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": _metadata(deployment, name=name, labels=labels),
        "spec": {
            "selector": {"matchLabels": _leader_selector(deployment)},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {
                "name": names.router_name(name),
                "port": {"number": EPP_PORT},
                "failureMode": "FailClose",
            },
        },
    }


def router_volumes(deployment: InferenceDeployment) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(volumes, mounts)`` of the router pod beyond its config: the tokenizer's volume (a
    ConfigMap, or the user's volume source such as the model-cache claim), the perf profile's
    ConfigMap and the API keys' Secret (``spec.router.auth``, http mode), read-only."""
    router = deployment.spec.router
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if router.tokenizer is not None:
        source = (
            {"configMap": {"name": router.tokenizer.config_map}}
            if router.tokenizer.config_map is not None
            else dict(router.tokenizer.volume or {})
        )
        volumes.append({"name": "tokenizer", **source})
        mounts.append({"name": "tokenizer", "mountPath": TOKENIZER_DIR, "readOnly": True})
    if router.perf_profile is not None:
        volumes.append({"name": "perf-profile", "configMap": {"name": router.perf_profile.config_map}})
        mounts.append({"name": "perf-profile", "mountPath": PERF_PROFILE_DIR, "readOnly": True})
    if router.auth is not None and router.mode is RouterMode.HTTP:
        # A mounted Secret (not an environment variable): updates reach the file, and the keys
        # never appear in the pod spec or a process listing.
        volumes.append({"name": "api-keys", "secret": {"secretName": router.auth.secret_name}})
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
    return volumes, mounts


def router_objects(deployment: InferenceDeployment, *, images: Images = Images()) -> list[dict[str, Any]]:
    """ConfigMap, Deployment and Service of the router in front of this deployment's workers."""
    spec = deployment.spec
    name = names.router_name(deployment.metadata.name)
    labels = {names.LABEL_DEPLOYMENT: deployment.metadata.name, names.LABEL_COMPONENT: names.COMPONENT_ROUTER}
    config_text = yaml.safe_dump(router_config(deployment), sort_keys=True)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(deployment, name=name, labels=labels),
        "data": {"router.yaml": config_text},
    }
    config_digest = hashlib.sha256(config_text.encode()).hexdigest()[:16]
    epp = spec.router.mode is RouterMode.EPP
    extra_volumes, extra_mounts = router_volumes(deployment)
    router_deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(deployment, name=name, labels=labels),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {
                    "labels": labels,
                    # A changed config rolls the router pods.
                    "annotations": {f"{names.DOMAIN}/config-hash": config_digest},
                },
                "spec": {
                    "serviceAccountName": name,
                    # On SIGTERM the router drains for drain_timeout_s (25 s) within this.
                    "terminationGracePeriodSeconds": 30,
                    **(
                        {"nodeSelector": dict(spec.router.node_selector)} if spec.router.node_selector else {}
                    ),
                    "tolerations": [
                        t.model_dump(mode="json", exclude_none=True) for t in spec.pod.tolerations
                    ],
                    "containers": [
                        {
                            "name": "router",
                            **images.container(spec.router.image or images.copse),
                            "command": [
                                "copse",
                                "router",
                                "run",
                                "--config",
                                f"{ROUTER_CONFIG_DIR}/router.yaml",
                            ],
                            **_router_ports(epp),
                            "volumeMounts": [
                                {"name": "config", "mountPath": ROUTER_CONFIG_DIR},
                                *extra_mounts,
                            ],
                        }
                    ],
                    "volumes": [{"name": "config", "configMap": {"name": name}}, *extra_volumes],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(deployment, name=name, labels=labels),
        "spec": {
            "selector": labels,
            "ports": [
                {"name": "grpc-ext-proc", "port": EPP_PORT, "targetPort": EPP_PORT, "appProtocol": "http2"},
                {"name": "http", "port": EPP_METRICS_PORT, "targetPort": EPP_METRICS_PORT},
            ]
            if epp
            else [{"name": "http", "port": ROUTER_PORT, "targetPort": ROUTER_PORT}],
        },
    }
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(deployment, name=name, labels=labels),
        # One router at a time: a drain never takes every replica (with one replica, it may).
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}},
    }
    pool = [inference_pool(deployment)] if epp else []
    # Identity first: the ReplicaSet cannot create pods before their ServiceAccount exists.
    return [*router_rbac(deployment), config_map, router_deployment, service, budget, *pool]


def _router_ports(epp: bool) -> dict[str, Any]:
    """Container ports and probes of the router: HTTP, or the endpoint picker's gRPC health."""
    if not epp:
        return {
            "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
            # Ready once it has a worker, their caches and its peers' load (a restarted replica
            # gets no traffic blind), not while draining.
            "readinessProbe": {"httpGet": {"path": "/ready", "port": ROUTER_PORT}, "periodSeconds": 2},
        }
    return {
        "ports": [
            {"name": "grpc-ext-proc", "containerPort": EPP_PORT},
            {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT},
            # "http" like the HTTP router's port: the chart's PodMonitor scrapes /metrics there.
            {"name": "http", "containerPort": EPP_METRICS_PORT},
        ],
        "readinessProbe": {"grpc": {"port": EPP_HEALTH_PORT, "service": "readiness"}},
        "livenessProbe": {"grpc": {"port": EPP_HEALTH_PORT, "service": "liveness"}},
    }


def router_rbac(deployment: InferenceDeployment) -> list[dict[str, Any]]:
    """The router's ServiceAccount and the namespaced read access its discovery needs."""
    name = names.router_name(deployment.metadata.name)
    labels = {names.LABEL_DEPLOYMENT: deployment.metadata.name, names.LABEL_COMPONENT: names.COMPONENT_ROUTER}
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _metadata(deployment, name=name, labels=labels),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(deployment, name=name, labels=labels),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                # An endpoint picker follows its InferencePool.
                *(
                    [
                        {
                            "apiGroups": [INFERENCE_POOL_API.split("/", maxsplit=1)[0]],
                            "resources": ["inferencepools"],
                            "verbs": ["get", "list", "watch"],
                        }
                    ]
                    if deployment.spec.router.mode is RouterMode.EPP
                    else []
                ),
                # The priorities of the InferenceObjectives naming this deployment's pool.
                *(
                    [
                        {
                            "apiGroups": [api.value.split("/", maxsplit=1)[0]],
                            "resources": ["inferenceobjectives"],
                            "verbs": ["list"],
                        }
                    ]
                    if (api := deployment.spec.router.inference_objectives) is not None
                    else []
                ),
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(deployment, name=name, labels=labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [
                {"kind": "ServiceAccount", "name": name, "namespace": deployment.metadata.namespace}
            ],
        },
    ]
