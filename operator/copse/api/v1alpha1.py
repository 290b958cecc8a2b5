"""``InferenceDeployment`` (``copse.dev/v1alpha1``): the contract between users, operator and planner.

The CRD under ``crds/`` is generated from these models (``make crds``); a test fails when
the two drift. Cross-field rules live twice on purpose: as CEL (so the API server rejects a
bad object) and as pydantic validators (so the CLI rejects the same file before it gets
that far); ``tests/api`` checks both against one set of invalid manifests.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import pydantic
from kube_custom_resource import schema
from kube_custom_resource.custom_resource import CustomResource
from pydantic import ConfigDict, Field, GetJsonSchemaHandler, model_validator
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from copse.workers.protocol.hashing import lora_int_id

GROUP = "copse.dev"
VERSION = "v1alpha1"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
API_VERSION = f"{GROUP}/{VERSION}"

#: Go-style durations as written in manifests ("300s", "5m", "1h30m"); the planner needs seconds.
_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?(?:(\d+)ms)?$")
DURATION_PATTERN = r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?([0-9]+ms)?$"

_T = TypeVar("_T")
#: ``nullable: true`` in the CRD instead of an ``anyOf`` with null, which is not structural.
Nullable = Annotated[_T | None, schema.Nullable]


class _Subtree:
    """``x-kubernetes-preserve-unknown-fields`` for a whole free-form subtree. pydantic writes
    ``additionalProperties: true`` for ``dict[str, Any]``, which the API server reads as an empty
    schema for every value: nested objects would then be pruned (a strict client is told
    ``unknown field "....kv_cache_config.free_gpu_memory_fraction"``). Without it the flag covers
    everything below."""

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json_schema = handler.resolve_ref_schema(handler(core_schema))
        json_schema.pop("additionalProperties", None)
        json_schema["x-kubernetes-preserve-unknown-fields"] = True
        return json_schema


#: A free-form object the API server must not prune, nested objects included.
FreeForm = Annotated[dict[str, Any], _Subtree]


PositiveInt = Annotated[int, Field(ge=1)]
Parallelism = Annotated[int, Field(ge=1, le=1024)]
#: A Kubernetes memory quantity in binary or decimal units ("8Gi", "512Mi", "16G").
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
_QUANTITY_UNITS = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}


def parse_quantity(text: str) -> int:
    """Bytes in a memory quantity such as ``512Gi`` or ``16G`` (:data:`QUANTITY_PATTERN`)."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([A-Za-z]*)", text)
    if match is None or match.group(2) not in _QUANTITY_UNITS:
        raise ValueError(f"{text!r} is not a quantity such as '512Gi', '16G' or '1073741824'")
    number, unit = match.groups()
    whole, _, fraction = number.partition(".")
    scale = _QUANTITY_UNITS[unit]
    return int(whole) * scale + (int(fraction) * scale // 10 ** len(fraction) if fraction else 0)


def parse_duration(text: str) -> float:
    """Seconds in a Go-style duration such as ``300s`` or ``1h30m``."""
    match = _DURATION.match(text)
    if not text or match is None or not any(match.groups()):
        raise ValueError(f"{text!r} is not a duration such as '300s', '5m' or '1h30m'")
    hours, minutes, seconds, millis = (int(group or 0) for group in match.groups())
    return hours * 3600 + minutes * 60 + seconds + millis / 1000


def _valid_duration(text: str) -> str:
    parse_duration(text)
    return text


#: A Go-style duration (``300s``, ``1h30m``): the CRD checks the pattern, the models also parse it
#: (the pattern alone lets an empty string through).
Duration = Annotated[str, Field(pattern=DURATION_PATTERN), pydantic.AfterValidator(_valid_duration)]


class Role(str, schema.Enum):
    """Which pool a TP group serves."""

    WORKER = "worker"  # aggregated: prefill and decode in the same engine
    PREFILL = "prefill"
    DECODE = "decode"


class AffinityPolicy(str, schema.Enum):
    SAME_NVSWITCH_DOMAIN = "same-nvswitch-domain"
    NONE = "none"


class AntiAffinityPolicy(str, schema.Enum):
    SPREAD_ACROSS_RACKS = "spread-across-racks"
    NONE = "none"


class ColdStartStrategy(str, schema.Enum):
    MODELEXPRESS = "modelexpress"  # stream weights GPU-to-GPU from a running replica
    NONE = "none"  # every replica loads weights from storage


class EngineBackend(str, schema.Enum):
    TRTLLM = "trtllm"  # NVIDIA's TensorRT-LLM image running trtllm-serve
    MOCK = "mock"  # copse's GPU-free engine mocker, same HTTP surface


class RoutingPolicy(str, schema.Enum):
    KV = "kv"
    DYNAMO = "dynamo"
    PREFIX_ONLY = "prefix_only"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"


class RouterMode(str, schema.Enum):
    HTTP = "http"
    EPP = "epp"


class MoeBackend(str, schema.Enum):
    """TensorRT-LLM's MoE kernels (``moe_config.backend``); WIDEEP is its wide expert-parallel one."""

    WIDEEP = "WIDEEP"
    CUTLASS = "CUTLASS"
    TRTLLM = "TRTLLM"
    DEEPGEMM = "DEEPGEMM"
    CUTEDSL = "CUTEDSL"


class Phase(str, schema.Enum):
    PENDING = "Pending"
    PLACING = "Placing"
    RUNNING = "Running"
    DEGRADED = "Degraded"
    FAILED = "Failed"


class _Model(pydantic.BaseModel):
    """camelCase in manifests, snake_case in Python, and dumps in the manifest spelling."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
        validate_assignment=True,
    )


def _defaults_of(model: type[pydantic.BaseModel]) -> Callable[[dict[str, Any]], None]:
    """Schema default of an optional sub-object: the object with every default filled in, so
    the API server stores and CEL rules see the values the models use (the API server checks
    defaults against CEL without applying nested defaults first, so ``{}`` would not do)."""

    def add_default(schema: dict[str, Any]) -> None:
        schema["default"] = model().model_dump(mode="json", by_alias=True, exclude_none=True)

    return add_default


class _SpecModel(_Model):
    """Spec parts reject unknown keys: a typo must not be silently ignored."""

    model_config = ConfigDict(extra="forbid")


class MoeSpec(_SpecModel):
    """A Mixture-of-Experts model and how its experts are spread over each group's GPUs."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.expertsPerToken <= self.experts",
                    "message": "model.moe.expertsPerToken must not exceed model.moe.experts",
                }
            ]
        },
    )

    experts: int = Field(ge=1, le=65536, description="Routed experts per MoE layer (DeepSeek-V3: 256).")
    experts_per_token: int = Field(ge=1, description="Experts each token activates (top-K; DeepSeek-V3: 8).")
    hidden_size: int = Field(ge=1, description="Hidden size: one token's activation dispatched to an expert.")
    layers: int = Field(
        ge=1, description="MoE layers (DeepSeek-V3: 58): one all-to-all dispatch and combine each per step."
    )
    activation_bytes: int = Field(
        default=2, ge=1, le=4, description="Bytes per dispatched activation element (2: BF16, 1: FP8)."
    )
    expert_parallelism: Nullable[Parallelism] = Field(
        default=None,
        description="EP ranks the experts are spread over; must divide the pool's tensorParallelism "
        "(defaults to it: wide EP).",
    )
    attention_data_parallel: bool = Field(
        default=False,
        description="Attention data parallelism (the wide-EP 'DEP' layout): each rank runs attention "
        "on its own requests, the experts are shared by all-to-all.",
    )
    redundant_experts: int = Field(
        default=0,
        ge=0,
        description="Extra expert slots for replicas of hot experts (EPLB); experts + redundant must be "
        "a multiple of the EP size.",
    )
    layer_updates_per_iter: int = Field(
        default=0,
        ge=0,
        description="Layers whose expert placement the online load balancer updates per iteration "
        "(0: static placement).",
    )
    backend: MoeBackend = Field(default=MoeBackend.WIDEEP, description="TensorRT-LLM MoE backend.")

    @model_validator(mode="after")
    def _check_top_k(self) -> MoeSpec:
        if self.experts_per_token > self.experts:
            raise ValueError(
                f"model.moe.expertsPerToken ({self.experts_per_token}) must not exceed "
                f"model.moe.experts ({self.experts})"
            )
        return self


class SecretKeyRef(_SpecModel):
    name: str = Field(min_length=1, description="A Secret in the deployment's namespace.")
    key: str = Field(default="HF_TOKEN", min_length=1, description="Its key holding the value.")


class ModelCacheSpec(_SpecModel):
    """Where the weights live: engines load them from here, not each from the hub (ModelExpress shares it)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.persistentVolumeClaim) != has(self.hostPath)",
                    "message": "model.cache needs exactly one of persistentVolumeClaim and hostPath",
                }
            ]
        },
    )

    persistent_volume_claim: Nullable[str] = Field(
        default=None,
        min_length=1,
        description="An existing PVC (ReadWriteMany when groups span nodes); one download Job fills it.",
    )
    host_path: Nullable[str] = Field(
        default=None,
        pattern="^/",
        description="A directory on every GPU node; each worker pod's init container fills its node's copy.",
    )
    mount_path: str = Field(
        default="/models",
        pattern="^/",
        description="Where workers see the cache; HF_HUB_CACHE is <mountPath>/hub.",
    )
    hf_token_secret: Nullable[SecretKeyRef] = Field(
        default=None,
        description="Hugging Face token for gated models, given to the download step only.",
    )
    download_timeout: Duration = Field(
        default="3600s",
        description="How long a worker pod waits for the weights before it fails (and its gang restarts).",
    )

    @model_validator(mode="after")
    def _check_source(self) -> ModelCacheSpec:
        if (self.persistent_volume_claim is None) == (self.host_path is None):
            raise ValueError("model.cache needs exactly one of persistentVolumeClaim and hostPath")
        return self

    @property
    def download_timeout_s(self) -> float:
        return parse_duration(self.download_timeout)


_PVC_SEGMENT = r"(\.?[^/\s.][^/\s]*|\.\.[^/\s]+|\.)"
"""A path segment other than ``..`` (RE2 has no lookahead: the API server checks this pattern too)."""
LORA_SOURCE_PATTERN = (
    r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?"
    rf"|pvc:///*{_PVC_SEGMENT}(/+{_PVC_SEGMENT})*/*"
    r"|(s3|gs)://[a-z0-9][a-z0-9.-]*(/[^\s]*)?)$"
)
"""Where a LoRA adapter comes from: ``hf://<org>/<repo>[@<revision>]`` (the hub), ``pvc://<path>``
(a directory on the model-cache PVC, which no ``..`` segment may leave) or ``s3://<bucket>/<prefix>``,
``gs://<bucket>/<prefix>``."""

LORA_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
"""What an adapter may be called (requests send it as ``model``; it names a folder in the cache)."""


class LoraSpec(_SpecModel):
    """A LoRA adapter of the model, served through the same engines: requests name it as ``model``."""

    name: str = Field(
        pattern=LORA_NAME_PATTERN,
        max_length=63,
        description="What requests send as model; unique in the deployment.",
    )
    source: str = Field(
        pattern=LORA_SOURCE_PATTERN,
        max_length=512,
        description="hf://<org>/<repo>[@<revision>] (the hub), pvc://<path> (a directory on the model-cache "
        "PVC, no '..' segments) or s3://<bucket>/<prefix> / gs://<bucket>/<prefix> (an object store); hub "
        "and object-store adapters are downloaded into the cache with the weights.",
    )
    rank: int = Field(
        ge=1, le=1024, description="Its LoRA rank r; the engines' lora_config.max_lora_rank is the largest."
    )

    @property
    def scheme(self) -> str:
        """``hf``, ``pvc``, ``s3`` or ``gs``."""
        return self.source.split("://", 1)[0]

    @property
    def pvc_path(self) -> str:
        """A ``pvc://`` source's directory, relative to the model cache's mount."""
        return self.source.removeprefix("pvc://").strip("/")


class ModelSpec(_SpecModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.loras) || !self.loras.exists(a, a.source.startsWith('pvc://')) "
                    "|| (has(self.cache) && has(self.cache.persistentVolumeClaim))",
                    "message": "model.loras: a pvc:// source needs model.cache.persistentVolumeClaim",
                },
            ]
        },
    )

    name: str = Field(min_length=1, description="Model id served by the engines (e.g. a Hugging Face name).")
    tensor_parallelism: Parallelism = Field(
        default=1, description="GPUs per pipeline stage; a TP group is placed whole or not at all."
    )
    pipeline_parallelism: Parallelism = Field(
        default=1, description="Pipeline stages per group; a group needs TP x PP GPUs."
    )
    moe: Nullable[MoeSpec] = Field(
        default=None, description="Mixture-of-Experts shape and expert parallelism (unset: a dense model)."
    )
    cache: Nullable[ModelCacheSpec] = Field(
        default=None, description="Weights cache (PVC or node path); without it engines pull from the hub."
    )
    kv_bytes_per_token: Nullable[PositiveInt] = Field(
        default=None,
        description="KV cache bytes of one token across the whole model: 2 (K and V) x layers x KV "
        "heads x head dim x bytes per element (Llama-3.1-8B in bf16: 131072). Sizes the "
        "engine.kvCacheOffload tiers in blocks for the KV relay, and what the router and mocked "
        "engines charge for moving KV; unset: 131072 for those, and no relay bound with offload tiers.",
    )
    loras: list[LoraSpec] = Field(
        default_factory=list,
        max_length=64,
        # A list keyed by name: the API server itself refuses two adapters of one name.
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="LoRA adapters served by the same engines; requests name one as model, the router "
        "keeps each adapter's KV apart and prefers workers that hold it.",
    )
    max_loras: PositiveInt = Field(
        default=4,
        le=64,
        description="Adapters an engine holds on its GPUs at once (TensorRT-LLM lora_config.max_loras); "
        "another one evicts the least recently used.",
    )
    max_cpu_loras: Nullable[PositiveInt] = Field(
        default=None,
        le=256,
        description="Adapters an engine keeps in host memory (lora_config.max_cpu_loras); unset: all.",
    )

    @model_validator(mode="after")
    def _check_loras(self) -> ModelSpec:
        names: set[str] = set()
        ids: dict[int, str] = {}
        for index, lora in enumerate(self.loras):
            where = f"model.loras[{index}] ({lora.name})"
            if lora.name in names:
                raise ValueError(f"{where}: every adapter needs its own name")
            if lora.name == self.name:
                raise ValueError(f"{where}: an adapter must not have the model's name")
            if lora.scheme == "pvc" and (self.cache is None or self.cache.persistent_volume_claim is None):
                raise ValueError(f"{where}: a pvc:// source needs model.cache.persistentVolumeClaim")
            clash = ids.setdefault(lora_int_id(lora.name), lora.name)
            if clash != lora.name:
                raise ValueError(
                    f"{where}: its lora_int_id (a hash of its name) is that of adapter {clash!r}: the "
                    "engines would take one for the other; rename one of them"
                )
            names.add(lora.name)
        return self

    @property
    def gpus_per_group(self) -> int:
        return self.tensor_parallelism * self.pipeline_parallelism


class PlacementSpec(_SpecModel):
    affinity_policy: AffinityPolicy = Field(
        default=AffinityPolicy.SAME_NVSWITCH_DOMAIN,
        description="same-nvswitch-domain keeps every TP group inside one NVLink domain.",
    )
    anti_affinity_policy: AntiAffinityPolicy = Field(
        default=AntiAffinityPolicy.SPREAD_ACROSS_RACKS,
        description="spread-across-racks puts replicas on different racks so one rack loss keeps serving.",
    )


class TargetLatency(_SpecModel):
    # The seed manifest spells these in snake_case; keep its spelling.
    ttft_p99_ms: float = Field(
        default=500.0, gt=0, alias="ttft_p99_ms", description="Time-to-first-token target (p99, ms)."
    )
    tbt_p99_ms: float = Field(
        default=50.0, gt=0, alias="tbt_p99_ms", description="Time-between-tokens (ITL) target (p99, ms)."
    )


class ScaleUpTrigger(_SpecModel):
    queue_depth: int = Field(
        default=10,
        ge=1,
        description="Waiting requests per worker that trigger a scale-up ahead of the forecast.",
    )


class ScalingSpec(_SpecModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.minReplicas <= self.maxReplicas",
                    "message": "scaling.minReplicas must not exceed scaling.maxReplicas",
                }
            ]
        },
    )

    min_replicas: int = Field(default=1, ge=0, description="Fewest TP groups per pool, whatever the load.")
    max_replicas: int = Field(default=16, ge=1, description="Most TP groups per pool, whatever the load.")
    max_gpus: Nullable[PositiveInt] = Field(
        default=None, description="GPU budget shared by all pools of this deployment (planner bound)."
    )
    target_latency: TargetLatency = Field(
        default_factory=TargetLatency,
        json_schema_extra=_defaults_of(TargetLatency),
        description="Latency targets the planner sizes pools for.",
    )
    scale_up_trigger: ScaleUpTrigger = Field(
        default_factory=ScaleUpTrigger,
        json_schema_extra=_defaults_of(ScaleUpTrigger),
        description="Fast path when queues build faster than forecast.",
    )
    scale_down_delay: Duration = Field(
        default="300s",
        description="How long load must stay low before capacity is removed (hysteresis).",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> ScalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"scaling.minReplicas ({self.min_replicas}) must not exceed "
                f"scaling.maxReplicas ({self.max_replicas})"
            )
        return self

    @property
    def scale_down_delay_s(self) -> float:
        return parse_duration(self.scale_down_delay)


class CordonPolicy(str, schema.Enum):
    MOVE = "Move"
    KEEP = "Keep"


class DisruptionSpec(_SpecModel):
    """How groups ride out node trouble, and leave without cutting the requests they serve."""

    on_cordon: CordonPolicy = Field(
        default=CordonPolicy.MOVE,
        description="Move: a group on a cordoned node is replaced elsewhere first, then drained and "
        "removed whole (what lets `kubectl drain` through the group's PodDisruptionBudget, which "
        "evicts no pod of a gang); Keep: it keeps running there and a drain waits on it.",
    )

    not_ready_grace: Duration = Field(
        default="300s",
        description="How long a group on a NotReady or unreachable node waits for it to come back before "
        "its gang restarts elsewhere (the node controller's default eviction toleration). "
        "Failed or deleted pods restart the gang at once.",
    )

    drain_timeout: Duration = Field(
        default="300s",
        description="Longest wait for a group being removed (scale-down, rolling update) to finish "
        "its in-flight requests once the router sends it nothing new; also bounds the worker pods' "
        "termination grace. 0s removes at once.",
    )

    @property
    def not_ready_grace_s(self) -> float:
        return parse_duration(self.not_ready_grace)

    @property
    def drain_timeout_s(self) -> float:
        return parse_duration(self.drain_timeout)


class RolloutSpec(_SpecModel):
    """How groups of an outdated template (a changed image, engine arguments, pod settings) are
    replaced, per pool and counted in TP groups. A replica change never rolls anything."""

    max_surge: int = Field(
        default=1,
        ge=0,
        description="Groups a pool may hold above its replicas while rolling (draining ones count: "
        "they still hold their GPUs). 0 replaces in place, for a cluster with no spare GPUs.",
    )
    max_unavailable: int = Field(
        default=0,
        ge=0,
        description="Ready groups a pool may lack below its replicas while rolling. 0 keeps full "
        "capacity (new groups are ready before old ones drain).",
    )
    partition: int = Field(
        default=0,
        ge=0,
        description="Groups per pool kept on the old template: a canary runs replicas - partition "
        "new groups next to them; 0 rolls everything.",
    )
    paused: bool = Field(
        default=False,
        description="Start no new step of a roll (steps under way finish); a canary holds here.",
    )


#: Seconds from a scale-up decision to the new group serving, by how it gets its weights: ModelExpress's
#: published DeepSeek-V4-Pro figures (TP8 on 8xB200, its README's benchmarks). ``hub``: a cold Hugging Face
#: pull (8m53s) plus the rest of a cold start from local storage (8m01s API-ready, of which 1m10s loading
#: weights); ``model-cache``: the cold start from shared storage (8m01s); ``modelexpress``: weights
#: GPU-to-GPU from a serving group (7m API-ready: the engine's own start, kernel compilation and warm-up
#: remain); ``modelexpress-with-kernel-caches``: weights and compiled-kernel caches (1m44s; ModelExpress
#: transfers those for vLLM and SGLang engines, not TensorRT-LLM). A smaller model starts faster: set
#: ``spec.coldStart.startupDelay``.
STARTUP_DELAYS_S: dict[str, float] = {
    "hub": 533.0 + 481.0 - 70.0,
    "model-cache": 481.0,
    "modelexpress": 420.0,
    "modelexpress-with-kernel-caches": 104.0,
}


class ModelExpressSpec(_SpecModel):
    """The ModelExpress server the operator runs for ``coldStart.strategy: modelexpress``."""

    server_image: str = Field(
        default="nvcr.io/nvidia/ai-dynamo/modelexpress-server:0.3.0",
        min_length=1,
        description="ModelExpress server image (a Rust gRPC server on port 8001).",
    )
    redis_image: str = Field(
        default="redis:7-alpine",
        min_length=1,
        description="Redis the server keeps its metadata in (a native sidecar of the server pod).",
    )


class ColdStartSpec(_SpecModel):
    strategy: ColdStartStrategy = Field(
        default=ColdStartStrategy.NONE, description="How a new replica gets its weights."
    )
    source_replica: str = Field(
        default="any-healthy",
        min_length=1,
        description="Replica to stream weights from: 'any-healthy' or a group name of this deployment.",
    )
    startup_delay: Nullable[Duration] = Field(
        default=None,
        description="Time from scaling up to the new group serving, the planner's lead time; unset: the "
        "typical figure for how a new group gets its weights: ModelExpress, else a spec.model.cache "
        "persistentVolumeClaim, else the hub (ModelExpress's published DeepSeek-V4-Pro start-up times).",
    )
    model_express: ModelExpressSpec = Field(
        default_factory=ModelExpressSpec,
        description="The ModelExpress server (strategy modelexpress).",
        json_schema_extra=_defaults_of(ModelExpressSpec),
    )

    def startup_path(self, *, model_cache: ModelCacheSpec | None) -> str:
        """How a new group gets its weights, a key of :data:`STARTUP_DELAYS_S`: ModelExpress's
        transfer; else the shared cache a ``persistentVolumeClaim`` holds (``spec.model.cache``, filled
        once by the download Job before any group starts); else the hub. A ``hostPath`` cache counts as
        the hub: each node fills its own copy, so a group landing on a node without one pulls first."""
        if self.strategy is ColdStartStrategy.MODELEXPRESS:
            return "modelexpress"
        if model_cache is not None and model_cache.persistent_volume_claim is not None:
            return "model-cache"
        return "hub"

    def startup_delay_s(self, *, model_cache: ModelCacheSpec | None) -> float:
        """The planner's lead time: ``startupDelay``, else the typical start-up time of the path."""
        if self.startup_delay is not None:
            return parse_duration(self.startup_delay)
        return STARTUP_DELAYS_S[self.startup_path(model_cache=model_cache)]


class PoolSpec(_SpecModel):
    replicas: int = Field(ge=0, description="TP groups in this pool; the planner patches this.")
    tensor_parallelism: Nullable[Parallelism] = Field(
        default=None, description="Defaults to spec.model.tensorParallelism."
    )
    pipeline_parallelism: Nullable[Parallelism] = Field(
        default=None, description="Defaults to spec.model.pipelineParallelism."
    )
    expert_parallelism: Nullable[Parallelism] = Field(
        default=None, description="Defaults to spec.model.moe.expertParallelism (MoE models only)."
    )
    attention_data_parallel: Nullable[bool] = Field(
        default=None, description="Defaults to spec.model.moe.attentionDataParallel (MoE models only)."
    )
    redundant_experts: Nullable[Annotated[int, Field(ge=0)]] = Field(
        default=None, description="Defaults to spec.model.moe.redundantExperts (MoE models only)."
    )
    layer_updates_per_iter: Nullable[Annotated[int, Field(ge=0)]] = Field(
        default=None, description="Defaults to spec.model.moe.layerUpdatesPerIter (MoE models only)."
    )

    def moe_overrides(self) -> list[str]:
        """The MoE fields this pool sets (manifest spelling)."""
        return [to_camel(name) for name in _MOE_POOL_FIELDS if getattr(self, name) is not None]


_MOE_POOL_FIELDS = (
    "expert_parallelism",
    "attention_data_parallel",
    "redundant_experts",
    "layer_updates_per_iter",
)


_DISK_NEEDS_HOST = "engine.kvCacheOffload.disk needs hostMemory: blocks reach disk from host memory"


class KvCacheOffloadSpec(_SpecModel):
    """KV cache tiers below the GPU: blocks evicted from GPU memory move to host memory (then to
    disk), and a prefix hit there is copied back instead of recomputed."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.disk) || has(self.hostMemory)",
                    "message": _DISK_NEEDS_HOST,
                }
            ]
        },
    )

    host_memory: Nullable[str] = Field(
        default=None,
        pattern=QUANTITY_PATTERN,
        description="Pinned host memory per GPU for evicted KV blocks (TensorRT-LLM's "
        "kv_cache_config.host_cache_size); added to each worker pod's memory request.",
    )
    disk: Nullable[str] = Field(
        default=None,
        pattern=QUANTITY_PATTERN,
        description="Disk per GPU for KV blocks evicted from host memory (TensorRT-LLM's "
        "kv_cache_config.disk_cache_size, KV cache manager v2 only), on an emptyDir of that size.",
    )
    host_bandwidth_gbps: float = Field(
        default=50.0,
        gt=0,
        alias="hostBandwidthGBps",
        description="Host-to-GPU copy bandwidth per GPU, GB/s (PCIe Gen5 x16 in practice; GB200's "
        "NVLink-C2C ~450): what the router and planner charge for a prefix hit in host memory.",
    )
    disk_bandwidth_gbps: float = Field(
        default=7.0,
        gt=0,
        alias="diskBandwidthGBps",
        description="Disk-to-GPU bandwidth per GPU, GB/s (one NVMe Gen4 SSD).",
    )

    @model_validator(mode="after")
    def _disk_below_host(self) -> KvCacheOffloadSpec:
        if self.disk is not None and self.host_memory is None:
            raise ValueError(_DISK_NEEDS_HOST)
        return self

    @property
    def host_bytes(self) -> int:
        """Host memory per GPU, bytes (0 without a host tier)."""
        return 0 if self.host_memory is None else parse_quantity(self.host_memory)

    @property
    def disk_bytes(self) -> int:
        """Disk per GPU, bytes (0 without a disk tier)."""
        return 0 if self.disk is None else parse_quantity(self.disk)


class ComputeDomainMode(str, schema.Enum):
    AUTO = "auto"  # a ComputeDomain per group that spans trays, when the cluster has the CRD
    DISABLED = "disabled"  # never: groups spanning trays talk over the network only


class MultiNodeSpec(_SpecModel):
    follower_timeout: Duration = Field(
        default="600s",
        description="How long rank 0 waits for the other ranks' sshd before it fails (the gang restarts).",
    )
    compute_domain: ComputeDomainMode = Field(
        default=ComputeDomainMode.AUTO,
        description="auto: an IMEX ComputeDomain (NVIDIA DRA driver) per group spanning trays of one domain.",
    )

    @property
    def follower_timeout_s(self) -> float:
        return parse_duration(self.follower_timeout)


class EngineSpec(_SpecModel):
    backend: EngineBackend = Field(
        default=EngineBackend.TRTLLM, description="trtllm for GPUs; mock runs copse's engine mocker instead."
    )
    image: Nullable[str] = Field(
        default=None, description="Worker image; defaults per backend (TensorRT-LLM release or copse)."
    )
    command: Nullable[list[str]] = Field(
        default=None, description="Replaces the backend's default command entirely."
    )
    args: list[str] = Field(default_factory=list, description="Extra arguments appended to the command.")
    block_size: int = Field(
        default=32, ge=1, le=4096, description="Tokens per KV block; the router hashes prefixes with it."
    )
    max_batch_tokens: int = Field(
        default=8192, ge=1, description="Token budget of one engine step (chunked prefill)."
    )
    max_num_sequences: int = Field(default=256, ge=1, description="Most sequences batched in one step.")
    max_seq_len: Nullable[PositiveInt] = Field(
        default=None,
        description="The engines' context: prompt plus output tokens (TensorRT-LLM's max_seq_len); "
        "the router answers 400 to a request that cannot fit it. Unset: the engine's own "
        "(the model's) for TensorRT-LLM, 131072 for the mocker and the router.",
    )
    kv_cache_free_gpu_memory_fraction: float = Field(
        default=0.9, gt=0, le=1, description="Share of free GPU memory the engine gives to the KV cache."
    )
    kv_cache_offload: Nullable[KvCacheOffloadSpec] = Field(
        default=None, description="KV cache tiers below the GPU (host memory, disk); unset: GPU only."
    )
    extra_config: FreeForm = Field(
        default_factory=dict,
        description="TensorRT-LLM LLM-API settings deep-merged into the engine YAML "
        "(trtllm-serve --extra_llm_api_options); your keys win, and settings that defeat KV-aware "
        "routing are reported in the KVRouting condition.",
    )
    multi_node: MultiNodeSpec = Field(
        default_factory=MultiNodeSpec,
        json_schema_extra=_defaults_of(MultiNodeSpec),
        description="How a group spanning several nodes starts (one MPI world over ssh).",
    )


#: A directory inside a volume: relative, segments starting with a letter, digit or underscore
#: (so no ``..``, no absolute path, no hidden directories).
RELATIVE_PATH_PATTERN = r"^([A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*)?$"


_CONFIGMAP_PATH = "router.tokenizer.path is a directory inside a volume; a ConfigMap's keys are the files"


class TokenizerSource(_SpecModel):
    # Where the router finds the model's tokenizer files (tokenizer.json, tokenizer_config.json,
    # chat_template.jinja when the model has one); the router never downloads them.
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.configMap) != has(self.volume)",
                    "message": "router.tokenizer: set exactly one of configMap and volume",
                },
                {
                    "rule": "!has(self.configMap) || !has(self.path) || self.path == ''",
                    "message": _CONFIGMAP_PATH,
                },
            ]
        },
    )

    config_map: Nullable[str] = Field(
        default=None,
        min_length=1,
        description="ConfigMap holding the tokenizer files as keys (a ConfigMap holds at most 1 MiB).",
    )
    volume: Nullable[FreeForm] = Field(
        default=None,
        min_length=1,
        max_length=1,
        description="One Kubernetes volume source holding the model files, e.g. the model cache "
        "({persistentVolumeClaim: {claimName: ..., readOnly: true}}, nfs, hostPath, csi).",
    )
    path: str = Field(
        default="",
        pattern=RELATIVE_PATH_PATTERN,
        description="Directory of the tokenizer files inside the volume "
        "(e.g. hub/models--meta-llama--Llama-3.1-70B-Instruct/snapshots/<revision>).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> TokenizerSource:
        if (self.config_map is None) == (self.volume is None):
            raise ValueError("router.tokenizer: set exactly one of configMap and volume")
        if self.config_map is not None and self.path:
            raise ValueError(_CONFIGMAP_PATH)
        return self


class RouterAuth(_SpecModel):
    secret_name: str = Field(
        min_length=1,
        max_length=253,
        description="Secret in the deployment's namespace holding the API keys, one per line; the router "
        "re-reads it when it changes.",
    )
    key: str = Field(
        default="api-keys",
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="Key of the Secret's data holding the keys.",
    )


class PerfProfileSource(_SpecModel):
    config_map: str = Field(
        min_length=1, description="ConfigMap holding the profile (binaryData for NPZ, data for JSON)."
    )
    key: str = Field(
        default="profile.npz",
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="Key of the profile in the ConfigMap; .json is read as JSON, anything else as NPZ.",
    )


class RouterObjective(_SpecModel):
    """A serving objective requests name in ``x-gateway-inference-objective``."""

    priority: int = Field(
        default=0,
        description="Higher is served first while requests wait and shed last; an InferenceObjective "
        "of the same name in the namespace (spec.poolRef.name: this deployment) overrides it.",
    )
    ttft_ms: Nullable[float] = Field(
        default=None,
        gt=0,
        description="Time-to-first-token target: while the fleet is saturated, a request predicted to "
        "miss it is answered 429 with Retry-After instead of queued; unset: queued while there is room.",
    )
    itl_ms: Nullable[float] = Field(
        default=None,
        gt=0,
        description="Inter-token target: while its requests decode on a worker, requests of lower "
        "priority go there only if the router predicts its steps stay within it (else elsewhere, or "
        "they wait); unset: no such guard.",
    )


class RouterTenant(_SpecModel):
    """A tenant: an x-gateway-inference-fairness-id, or key- and the first 16 hex digits of the
    SHA-256 of an API key."""

    weight: float = Field(
        default=1.0, gt=0, description="Its share of the fleet against other tenants of the same priority."
    )
    tokens_per_minute: Nullable[float] = Field(
        default=None,
        gt=0,
        description="Prompt plus max_tokens tokens it may send per minute per router replica (429 with "
        "Retry-After beyond); unset: unlimited.",
    )


_GATEWAY_MODE = (
    "router.gateway needs router.mode: epp (an HTTPRoute sends the gateway's requests to the InferencePool)"
)


class InferenceObjectiveApi(str, schema.Enum):
    """Where InferenceObjective objects are defined."""

    INFERENCE_EXTENSION = "inference.networking.x-k8s.io/v1alpha2"
    LLM_D = "llm-d.ai/v1alpha2"


DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
"""A DNS-1123 label: what a namespace name must be."""
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
"""A DNS-1123 subdomain: what a Gateway's name is, and what the Gateway API takes as a listener's
``sectionName`` (refused here rather than by the API server when the route is written)."""


class GatewayRef(_SpecModel):
    """The Gateway API Gateway an ``epp``-mode deployment's HTTPRoute attaches to."""

    name: str = Field(
        min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="The Gateway's name."
    )
    namespace: Nullable[str] = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=DNS_LABEL_PATTERN,
        description="The Gateway's namespace; unset: the deployment's. Another namespace's Gateway "
        "takes the route only when its listener's allowedRoutes admits this namespace.",
    )
    section_name: Nullable[str] = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="The Gateway listener the route attaches to; unset: every listener that admits it.",
    )


class RouterSpec(_SpecModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "!has(self.gateway) || self.mode == 'epp'", "message": _GATEWAY_MODE},
            ]
        },
    )

    mode: RouterMode = Field(
        default=RouterMode.HTTP,
        description="http: the router serves the OpenAI API; epp: a Gateway API gateway serves it and the "
        "router is the endpoint picker of an InferencePool the operator creates (the cluster needs its CRD).",
    )
    policy: RoutingPolicy = Field(default=RoutingPolicy.KV, description="Worker selection policy by name.")
    replicas: int = Field(
        default=2,
        ge=1,
        description="Router replicas; they share in-flight load over NATS. Two by default, with a "
        "PodDisruptionBudget, so a node drain or a router crash leaves one serving.",
    )
    temperature: float = Field(
        default=0.0, ge=0, description="Softmax temperature over predicted latency; 0 always picks the best."
    )
    queue_size: int = Field(
        default=1024, ge=0, description="Requests held while every worker is busy, before 503."
    )
    image: Nullable[str] = Field(default=None, description="Router image; defaults to copse's.")
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Labels a node must carry to host the router pods (a CPU pool)."
    )
    nats_url: Nullable[str] = Field(
        default=None, description="NATS for KV events and replica sync; without it the router approximates."
    )
    tokenizer: Nullable[TokenizerSource] = Field(
        default=None,
        description="The model's tokenizer files (tokenizer.json, tokenizer_config.json, "
        "chat_template.jinja), so the router hashes text and chat prompts as trtllm-serve tokenizes "
        "them; never downloaded; "
        "a trtllm router without it refuses to start.",
    )
    perf_profile: Nullable[PerfProfileSource] = Field(
        default=None,
        description="The engines' perf profile (copse planner profile): the router's latency model; "
        "a generic model without it.",
    )
    kv_capacity_tokens: Nullable[PositiveInt] = Field(
        default=None,
        description="KV cache of one engine in tokens (TensorRT-LLM logs it at start-up), for busy "
        "thresholds and the latency model; required for trtllm unless the perf profile carries it.",
    )
    auth: Nullable[RouterAuth] = Field(
        default=None,
        description="API keys the OpenAI paths require (Authorization: Bearer <key>; 401 without) in "
        "http mode; unset: no authentication. In epp mode the gateway authenticates.",
    )
    objectives: dict[str, RouterObjective] = Field(
        default_factory=dict,
        description="Objectives by the name requests give in x-gateway-inference-objective: priority "
        "and TTFT target.",
    )
    default_objective: RouterObjective = Field(
        default_factory=RouterObjective,
        description="The objective of requests naming none, or one the router does not know.",
    )
    inference_objectives: Nullable[InferenceObjectiveApi] = Field(
        default=InferenceObjectiveApi.INFERENCE_EXTENSION,
        description="API version of the InferenceObjective objects the router reads (those of its "
        "namespace whose spec.poolRef.name is this deployment; their spec.priority wins over "
        "objectives); null: objectives only.",
    )
    tenants: dict[str, RouterTenant] = Field(
        default_factory=dict, description="Tenants by name: fair-share weight and rate limit."
    )
    default_tenant: RouterTenant = Field(
        default_factory=RouterTenant, description="Weight and rate limit of every tenant not listed."
    )
    gateway: Nullable[GatewayRef] = Field(
        default=None,
        description="epp mode: the Gateway whose HTTPRoute the operator writes (named like the "
        "deployment, deleted with it): requests whose X-Gateway-Model-Name header (the body's model, "
        "which the Inference Extension's body-based router copies there) names the model or one of "
        "model.loras go to this deployment's InferencePool. Unset: no HTTPRoute (write your own). "
        "Without the HTTPRoute CRD in the cluster the deployment runs and its GatewayRoute condition "
        "says so.",
    )

    @model_validator(mode="after")
    def _gateway_needs_epp(self) -> RouterSpec:
        if self.gateway is not None and self.mode is not RouterMode.EPP:
            raise ValueError(_GATEWAY_MODE)
        return self


class Toleration(_SpecModel):
    key: Nullable[str] = None
    operator: str = Field(default="Equal", pattern="^(Equal|Exists)$")
    value: Nullable[str] = None
    effect: Nullable[str] = Field(default=None, pattern="^(NoSchedule|PreferNoSchedule|NoExecute)?$")
    toleration_seconds: Nullable[int] = None


class EnvVar(_SpecModel):
    name: str = Field(pattern="^[A-Za-z_][A-Za-z0-9_]*$", description="Variable name.")
    value: Nullable[str] = None
    value_from: Nullable[FreeForm] = Field(
        default=None, description="A Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef)."
    )


class PodSpec(_SpecModel):
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints worker pods tolerate; placement honours them too."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Labels a node must carry to host workers."
    )
    labels: dict[str, str] = Field(default_factory=dict, description="Added to every worker pod.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Added to every worker pod.")
    service_account_name: Nullable[str] = None
    resources: FreeForm = Field(
        default_factory=dict, description="cpu/memory requests and limits; GPUs are set by placement."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        description="Added to the engine container; rank 0's mpirun forwards them to the other ranks.",
    )
    shm_size: Nullable[str] = Field(
        default="8Gi",
        pattern=QUANTITY_PATTERN,
        description="Memory-backed /dev/shm (NCCL, MPI); counts against the pod's memory. null keeps 64Mi.",
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeLayout:
    """A pool's MoE model and expert layout, every default resolved."""

    experts: int
    experts_per_token: int
    hidden_size: int
    layers: int
    activation_bytes: int
    expert_parallelism: int
    attention_data_parallel: bool
    redundant_experts: int
    layer_updates_per_iter: int
    backend: MoeBackend

    @property
    def slots(self) -> int:
        """Expert slots over all EP ranks: every expert once plus the redundant replicas."""
        return self.experts + self.redundant_experts

    @property
    def load_balancer(self) -> bool:
        """Whether TensorRT-LLM's expert load balancer runs (replica slots, or online updates)."""
        return self.redundant_experts > 0 or self.layer_updates_per_iter > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupPool:
    """One pool as placement sees it: its role, size and the shape of each group."""

    role: Role
    replicas: int
    tensor_parallelism: int
    pipeline_parallelism: int
    moe: MoeLayout | None = None
    """Set for a Mixture-of-Experts model."""

    @property
    def gpus_per_group(self) -> int:
        return self.tensor_parallelism * self.pipeline_parallelism


_POOL_RULE = "!has(self.{pool}) || !has(self.scaling) || self.{pool}.replicas <= self.scaling.maxReplicas"
_LORA_CACHE_RULE = (
    "!has(self.model.loras) || size(self.model.loras) == 0 || has(self.model.cache) "
    "|| (has(self.engine) && self.engine.backend == 'mock')"
)
_LORA_CACHE_MESSAGE = (
    "model.loras needs model.cache: the engines read adapters from the weights cache, where hub and "
    "object-store adapters are downloaded"
)
_MOCK_RULE = (
    "!has(self.engine) || self.engine.backend != 'mock' || !has(self.router) "
    "|| (!has(self.router.tokenizer) && !has(self.router.perfProfile))"
)
_MOCK_MESSAGE = (
    "router.tokenizer and router.perfProfile describe a real engine; "
    "engine.backend mock runs copse's byte tokenizer and perf model"
)


def _pool_cel(pool: str, field: str) -> str:
    """CEL for a pool's value of ``field``: its own, else the model's (the model's default applied)."""
    model_field = f"self.model.moe.{field}" if field != "tensorParallelism" else f"self.model.{field}"
    return f"(has(self.{pool}.{field}) ? self.{pool}.{field} : {model_field})"


def _moe_rules() -> list[Any]:
    """The MoE cross-field rules as CEL, one per pool (the same checks as ``_check_moe``)."""
    rules = [
        {
            "rule": "!has(self.model.moe) || has(self.prefill) || self.model.tensorParallelism % "
            "(has(self.model.moe.expertParallelism) ? self.model.moe.expertParallelism : "
            "self.model.tensorParallelism) == 0",
            "message": _EP_DIVIDES.format(pool="model.moe"),
        },
        {
            "rule": "!has(self.model.moe) || has(self.prefill) || (self.model.moe.experts + "
            "self.model.moe.redundantExperts) % (has(self.model.moe.expertParallelism) ? "
            "self.model.moe.expertParallelism : self.model.tensorParallelism) == 0",
            "message": _SLOTS_DIVIDE.format(pool="model.moe"),
        },
    ]
    for pool in ("prefill", "decode"):
        tp = _pool_cel(pool, "tensorParallelism")
        ep = (
            f"(has(self.{pool}.expertParallelism) ? self.{pool}.expertParallelism : "
            f"has(self.model.moe.expertParallelism) ? self.model.moe.expertParallelism : {tp})"
        )
        sets_moe = " || ".join(f"has(self.{pool}.{to_camel(name)})" for name in _MOE_POOL_FIELDS)
        rules += [
            {
                "rule": f"!has(self.{pool}) || has(self.model.moe) || !({sets_moe})",
                "message": _MOE_FIELDS_NEED_MOE.format(pool=pool),
            },
            {
                "rule": f"!has(self.model.moe) || !has(self.{pool}) || {tp} % {ep} == 0",
                "message": _EP_DIVIDES.format(pool=pool),
            },
            {
                "rule": f"!has(self.model.moe) || !has(self.{pool}) || (self.model.moe.experts + "
                f"{_pool_cel(pool, 'redundantExperts')}) % {ep} == 0",
                "message": _SLOTS_DIVIDE.format(pool=pool),
            },
        ]
    return rules


_EP_DIVIDES = (
    "{pool}: the expert-parallel size must divide tensorParallelism (TensorRT-LLM splits TP ranks into "
    "moe_tp x moe_ep)"
)
_SLOTS_DIVIDE = (
    "{pool}: model.moe.experts + redundantExperts must be a multiple of the expert-parallel size "
    "(every EP rank holds the same number of expert slots)"
)
_MOE_FIELDS_NEED_MOE = "{pool}: expert-parallel settings need spec.model.moe (a Mixture-of-Experts model)"


class InferenceDeploymentSpec(_SpecModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.prefill) == has(self.decode)",
                    "message": "prefill and decode must be set together (disaggregated serving)",
                },
                {
                    "rule": "!has(self.prefill) || !has(self.replicas)",
                    "message": "spec.replicas is for aggregated serving; "
                    "set prefill.replicas and decode.replicas instead",
                },
                {
                    "rule": "!has(self.replicas) || !has(self.scaling) || "
                    "self.replicas <= self.scaling.maxReplicas",
                    "message": "spec.replicas must not exceed scaling.maxReplicas",
                },
                {
                    "rule": _POOL_RULE.format(pool="prefill"),
                    "message": "prefill.replicas must not exceed scaling.maxReplicas",
                },
                {
                    "rule": _POOL_RULE.format(pool="decode"),
                    "message": "decode.replicas must not exceed scaling.maxReplicas",
                },
                *_moe_rules(),
                {"rule": _LORA_CACHE_RULE, "message": _LORA_CACHE_MESSAGE},
                {
                    "rule": _MOCK_RULE,
                    "message": _MOCK_MESSAGE,
                },
            ]
        },
    )

    model: ModelSpec = Field(description="What is served and the shape of one TP group.")
    replicas: Nullable[Annotated[int, Field(ge=0)]] = Field(
        default=None,
        description="Aggregated TP groups (kubectl scale); defaults to scaling.minReplicas.",
    )
    prefill: Nullable[PoolSpec] = Field(default=None, description="Prefill pool (disaggregated).")
    decode: Nullable[PoolSpec] = Field(default=None, description="Decode pool (disaggregated).")
    placement: PlacementSpec = Field(
        default_factory=PlacementSpec,
        json_schema_extra=_defaults_of(PlacementSpec),
        description="Where TP groups may land.",
    )
    scaling: ScalingSpec = Field(
        default_factory=ScalingSpec,
        json_schema_extra=_defaults_of(ScalingSpec),
        description="Bounds and SLA targets.",
    )
    disruption: DisruptionSpec = Field(
        default_factory=DisruptionSpec,
        json_schema_extra=_defaults_of(DisruptionSpec),
        description="NotReady grace, and the drain before a group is removed.",
    )
    cold_start: ColdStartSpec = Field(
        default_factory=ColdStartSpec,
        json_schema_extra=_defaults_of(ColdStartSpec),
        description="How new replicas load.",
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        json_schema_extra=_defaults_of(RolloutSpec),
        description="Surge, unavailability, canary partition and pause of template changes.",
    )
    engine: EngineSpec = Field(
        default_factory=EngineSpec,
        json_schema_extra=_defaults_of(EngineSpec),
        description="The inference engine in each pod.",
    )
    router: RouterSpec = Field(
        default_factory=RouterSpec,
        json_schema_extra=_defaults_of(RouterSpec),
        description="The KV-aware router of this model.",
    )
    pod: PodSpec = Field(
        default_factory=PodSpec,
        json_schema_extra=_defaults_of(PodSpec),
        description="Pod-level settings of the worker pods.",
    )

    @model_validator(mode="after")
    def _check_pools(self) -> InferenceDeploymentSpec:
        if (self.prefill is None) != (self.decode is None):
            raise ValueError("prefill and decode must be set together (disaggregated serving)")
        if self.prefill is not None and self.replicas is not None:
            raise ValueError(
                "spec.replicas is for aggregated serving; set prefill.replicas and decode.replicas instead"
            )
        if self.engine.backend is EngineBackend.MOCK and (
            self.router.tokenizer is not None or self.router.perf_profile is not None
        ):
            raise ValueError(_MOCK_MESSAGE)
        if self.model.loras and self.engine.backend is not EngineBackend.MOCK and self.model.cache is None:
            raise ValueError(_LORA_CACHE_MESSAGE)
        for name, replicas in (
            ("spec.replicas", self.replicas),
            ("prefill.replicas", self.prefill.replicas if self.prefill else None),
            ("decode.replicas", self.decode.replicas if self.decode else None),
        ):
            if replicas is not None and replicas > self.scaling.max_replicas:
                raise ValueError(
                    f"{name} ({replicas}) must not exceed scaling.maxReplicas ({self.scaling.max_replicas})"
                )
        self._check_moe()
        return self

    def _check_moe(self) -> None:
        """The MoE layout of every pool fits its groups (the same rules as the CEL of ``_moe_rules``)."""
        for name, pool in (("prefill", self.prefill), ("decode", self.decode)):
            if pool is not None and self.model.moe is None and pool.moe_overrides():
                raise ValueError(
                    f"{_MOE_FIELDS_NEED_MOE.format(pool=name)}; {name} sets {', '.join(pool.moe_overrides())}"
                )
        for group_pool in self.pools():
            moe = group_pool.moe
            if moe is None:
                continue
            where = "model.moe" if group_pool.role is Role.WORKER else group_pool.role.value
            ep, tp = moe.expert_parallelism, group_pool.tensor_parallelism
            if tp % ep:
                raise ValueError(
                    f"{_EP_DIVIDES.format(pool=where)}; expertParallelism {ep}, tensorParallelism {tp}"
                )
            if moe.slots % ep:
                raise ValueError(
                    f"{_SLOTS_DIVIDE.format(pool=where)}; {moe.experts} + {moe.redundant_experts} "
                    f"slots over {ep} ranks"
                )

    def moe_layout(self, role: Role) -> MoeLayout | None:
        """The expert layout an engine of ``role`` runs: its pool's, or for a role without a pool
        (a decode engine serving a whole request, say) the model's at the model's TP."""
        for pool in self.pools():
            if pool.role is role:
                return pool.moe
        return self._moe_layout(None, self.model.tensor_parallelism)

    def _moe_layout(self, pool: PoolSpec | None, tensor_parallelism: int) -> MoeLayout | None:
        moe = self.model.moe
        if moe is None:
            return None

        def pick(own: _T | None, default: _T) -> _T:
            return default if own is None else own

        return MoeLayout(
            experts=moe.experts,
            experts_per_token=moe.experts_per_token,
            hidden_size=moe.hidden_size,
            layers=moe.layers,
            activation_bytes=moe.activation_bytes,
            expert_parallelism=pick(
                pool.expert_parallelism if pool else None, moe.expert_parallelism or tensor_parallelism
            ),
            attention_data_parallel=pick(
                pool.attention_data_parallel if pool else None, moe.attention_data_parallel
            ),
            redundant_experts=pick(pool.redundant_experts if pool else None, moe.redundant_experts),
            layer_updates_per_iter=pick(
                pool.layer_updates_per_iter if pool else None, moe.layer_updates_per_iter
            ),
            backend=moe.backend,
        )

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    def pools(self) -> list[GroupPool]:
        """The pools to place, each with its replica count and group shape (defaults resolved)."""
        if self.prefill is None or self.decode is None:
            replicas = self.replicas if self.replicas is not None else self.scaling.min_replicas
            return [
                GroupPool(
                    role=Role.WORKER,
                    replicas=replicas,
                    tensor_parallelism=self.model.tensor_parallelism,
                    pipeline_parallelism=self.model.pipeline_parallelism,
                    moe=self._moe_layout(None, self.model.tensor_parallelism),
                )
            ]
        pools = []
        for role, pool in ((Role.PREFILL, self.prefill), (Role.DECODE, self.decode)):
            tensor_parallelism = pool.tensor_parallelism or self.model.tensor_parallelism
            pools.append(
                GroupPool(
                    role=role,
                    replicas=pool.replicas,
                    tensor_parallelism=tensor_parallelism,
                    pipeline_parallelism=pool.pipeline_parallelism or self.model.pipeline_parallelism,
                    moe=self._moe_layout(pool, tensor_parallelism),
                )
            )
        return pools


class Condition(_Model):
    type: str
    status: str = Field(pattern="^(True|False|Unknown)$")
    reason: str = ""
    message: str = ""
    last_transition_time: Nullable[str] = None
    observed_generation: Nullable[int] = None


class RoleStatus(_Model):
    desired: int = 0
    placed: int = 0
    ready: int = 0
    updated: int = Field(default=0, description="Groups of the current template (revision).")
    updated_ready: int = Field(default=0, description="Ready groups of the current template.")
    old: int = Field(default=0, description="Groups of an older template still serving or starting.")


class GroupPodStatus(_Model):
    node: str
    gpus: int


class GroupStatus(_Model):
    name: str = Field(description="The group's deterministic name; also its headless Service.")
    role: Role
    replica: int
    domain: Nullable[str] = Field(default=None, description="NVLink domain, or null when it spans several.")
    rack: Nullable[str] = None
    pods: list[GroupPodStatus] = Field(default_factory=list)
    cost: float = 0.0
    ready: bool = False
    disruption: Nullable[str] = Field(
        default=None,
        description="Why the group is not serving normally: a NotReady node it waits out, or a drain "
        "before its removal.",
    )


class UnplacedStatus(_Model):
    role: Role
    replica: int
    reason: str


class ColdStartStatus(_Model):
    strategy: ColdStartStrategy
    source: Nullable[str] = Field(default=None, description="The group new replicas stream from.")


class InferenceDeploymentStatus(_Model):
    phase: Phase = Phase.PENDING
    observed_generation: Nullable[int] = None
    conditions: list[Condition] = Field(default_factory=list)
    roles: dict[str, RoleStatus] = Field(default_factory=dict, description="Per role: desired/placed/ready.")
    ready: str = Field(default="", description="Ready/desired per role, for kubectl get.")
    replicas: int = Field(
        default=0,
        description="Aggregated TP groups that have their rank-0 pod (scale subresource): what "
        "selector selects.",
    )
    selector: str = Field(
        default="",
        description="Label selector of the aggregated groups' rank-0 pods, one per replica "
        "(scale subresource).",
    )
    score: Nullable[float] = Field(default=None, description="Placement score in [0, 1].")
    revision: str = Field(
        default="",
        description="The current revision (what prefill and decode share); pods carry it as the "
        "copse.dev/revision label.",
    )
    groups: list[GroupStatus] = Field(default_factory=list)
    unplaced: list[UnplacedStatus] = Field(
        default_factory=list,
        description="The first unplaced groups and why (a few: the status must stay small).",
    )
    unplaced_total: int = Field(default=0, ge=0, description="Groups left unplaced, all of them.")
    cold_start: Nullable[ColdStartStatus] = None
    # kopf keeps handler progress here when told to; never let the API server prune it.
    kopf: FreeForm = Field(default_factory=dict)


#: Longest deployment name. The name is the value of the ``copse.dev/deployment`` label on every
#: child (label values stop at 63 characters), so a longer one cannot be served; children's own
#: names are ``<deployment>-<suffix>``, cut to 63 with a hash where needed (``names._fit``).
NAME_MAX_LENGTH = 63
#: A DNS-1035 label, what a Service name must be: children's names start with the deployment's,
#: so a name with a dot or a leading digit (a valid custom resource name) would make invalid Services.
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_MESSAGE = (
    f"metadata.name must be a DNS-1035 label of at most {NAME_MAX_LENGTH} characters "
    "(lower-case letters, digits and '-', starting with a letter): it names the deployment's "
    "Services and labels its pods"
)


# kube-custom-resource builds its metaclass from type(BaseModel) at run time, which mypy cannot follow.
class InferenceDeployment(  # type: ignore[metaclass,call-arg]
    CustomResource,
    kind=KIND,
    plural_name=PLURAL,
    short_names=["idep"],
    subresources={
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    },
    printer_columns=[
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Ready", "type": "string", "jsonPath": ".status.ready"},
        {"name": "Score", "type": "number", "jsonPath": ".status.score"},
        {"name": "Model", "type": "string", "jsonPath": ".spec.model.name", "priority": 1},
    ],
):
    """A served model: TP groups placed on NVLink domains, a router in front, a planner sizing it."""

    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus = Field(default_factory=InferenceDeploymentStatus)

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        # The API server refuses the name itself (CEL at the root may read metadata.name).
        json_schema: JsonSchemaValue = super().__get_pydantic_json_schema__(core_schema, handler)
        json_schema["x-kubernetes-validations"] = [
            {
                "rule": f"self.metadata.name.size() <= {NAME_MAX_LENGTH} "
                f"&& self.metadata.name.matches('{NAME_PATTERN}')",
                "message": NAME_MESSAGE,
            }
        ]
        return json_schema

    @model_validator(mode="after")
    def _check_name(self) -> InferenceDeployment:
        name = self.metadata.name
        if len(name) > NAME_MAX_LENGTH or not re.fullmatch(NAME_PATTERN, name):
            raise ValueError(f"{NAME_MESSAGE}; got {name!r} ({len(name)} characters)")
        return self
